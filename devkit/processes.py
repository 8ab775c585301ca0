"""Local stand-ins of a pod's container, and ending what they started.

kwok runs no containers: a pod's container is a local process started with the environment
the container would see (:func:`container_environment`). Killing a node is what a node
failure looks like to Kubernetes: the whole process tree dies at once (:func:`kill_tree`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from devkit.cluster.controlplane import ControlPlane

LOCAL_PROCESS_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""For every local stand-in of a node: gloo on the loopback interface the nodes' addresses
live on, one thread per worker (2 shared cores), output as it happens."""


def container_environment(
    control_plane: ControlPlane,
    namespace: str,
    pod_name: str,
    pod_uid: str,
    addr: str,
    service_account_dir: Path,
) -> dict[str, str]:
    """The environment a container of the pod sees, on top of this process's own: its
    in-cluster credentials (a real pod-bound token), POD_NAME, POD_NAMESPACE and POD_IP
    (``addr``), and :data:`LOCAL_PROCESS_ENV`."""
    env = {
        **os.environ,
        **control_plane.pod_environment(
            namespace=namespace,
            pod_name=pod_name,
            pod_uid=pod_uid,
            pod_ip=addr,
            directory=service_account_dir,
        ),
        **LOCAL_PROCESS_ENV,
    }
    env.pop("KUBECONFIG", None)  # a container has none: in-cluster credentials only
    return env


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` (the leader of its own session) and everything below it, by
    PID. Idempotent."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGSTOP)  # freeze the agent: it spawns no more
    for pid in _descendants(process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # workers lead sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found
