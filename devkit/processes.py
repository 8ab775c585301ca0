"""Local stand-ins of a pod's container, and ending what they started.

kwok runs no containers: a pod's container is a local process started with the environment
the container would see (:func:`container_environment`). Killing a node is what a node
failure looks like to Kubernetes: the whole process tree dies at once (:func:`kill_tree`).
:class:`LocalProcess` is such a stand-in, for the benchmark and the end-to-end tests alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from devkit.paths import REPO
from devkit.waiting import WaitTimeout, wait_for

if TYPE_CHECKING:  # imported for its type alone: devkit.child's processes import this module
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


def terminate(process: subprocess.Popen[bytes] | None, timeout: float = 15) -> None:
    """SIGTERM ``process``, then SIGKILL if it has not exited within ``timeout`` seconds:
    what Kubernetes does to a pod. Idempotent; ``None`` is a process never started."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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


def read_log(path: Path) -> str:
    """A process's log as written so far ("" where there is none to read)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of the log at ``path``."""
    return "\n".join(read_log(path).splitlines()[-lines:])


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a node's process has appended to ``path`` so far (none if it has not
    made the file yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # A line being appended may be incomplete; it is whole on the next read.
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def formed_world(
    lines: Iterable[dict[str, Any]], size: int, pods: Collection[str], after: float
) -> list[dict[str, Any]] | None:
    """The progress lines (examples/elastic_train*.py's) of the world of ``size`` ranks on
    exactly ``pods`` after ``after`` (wall clock), once every rank has completed a step in
    it; None before."""
    found = [line for line in lines if line["world_size"] == size and line["time"] > after]
    ranks = {line["rank"] for line in found}
    return (
        found
        if ranks == set(range(size)) and {line["pod"] for line in found} == set(pods)
        else None
    )


class TrainingNode(Protocol):
    """A local node whose workers append progress lines to :attr:`progress_path`."""

    name: str
    progress_path: Path

    def running(self) -> bool: ...

    def log_tail(self, lines: int = ...) -> str: ...


def wait_world(
    nodes: Sequence[TrainingNode], size: int, *, after: float, timeout: float
) -> list[dict[str, Any]]:
    """The progress lines of the world of ``size`` ranks that trains on ``nodes`` after
    ``after`` (wall clock), once every rank has completed a step in it (:func:`formed_world`).
    Raises :class:`~devkit.waiting.WaitTimeout` with the nodes' log tails as soon as one of
    them exits, or after ``timeout``."""
    names = sorted(node.name for node in nodes)

    def formed() -> list[dict[str, Any]] | None:
        lines = [line for node in nodes for line in json_lines(node.progress_path)]
        if (world := formed_world(lines, size, names, after)) is not None:
            return world
        if exited := [node.name for node in nodes if not node.running()]:
            raise WaitTimeout(f"{exited} exited")
        return None

    try:
        # Every 50 ms: a recovery trial's next event follows its world at once.
        return wait_for(formed, timeout, "not formed", interval=0.05, max_interval=0.05)
    except WaitTimeout as error:
        tails = "\n".join(f"=== {node.name}\n{node.log_tail(15)}" for node in nodes)
        raise WaitTimeout(
            f"no world of {size} on {names} after {after:.1f}: {error}\n{tails}"
        ) from None


def local_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a local node that is no pod (torch's own backends): this
    process's, without its credentials or in-cluster address, with :data:`LOCAL_PROCESS_ENV`
    and ``extra``."""
    env = {**os.environ, **LOCAL_PROCESS_ENV, **(extra or {})}
    env.pop("KUBECONFIG", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return env


class LocalProcess:
    """A node's container run locally: a command in a session of its own, its output in
    :attr:`log_path`, ended with everything it started (:func:`kill_tree`).

    The environment is :meth:`environment` (a pod's stand-in overrides it with
    :func:`container_environment`), a ``TMPDIR`` of its own (a container's /tmp is its own:
    torchrun's log directory and the in-place hand-off directory of a killed node stay with
    its files), and what :meth:`spawn` adds.

    Users: the benchmark's nodes (bench/recovery.py), tests/e2e's pods and bare workers
    (test_in_place_workers.py), and tests/contract's c10d nodes.
    """

    def __init__(self, name: str, directory: Path, log_name: str = "output.log") -> None:
        self.name = name
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / log_name
        self.started_at: float | None = None
        self.exited_at: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def environment(self) -> dict[str, str]:
        """What the process sees before :meth:`spawn`'s additions."""
        return local_environment()

    def spawn(self, args: Sequence[str], container_env: Mapping[str, str] | None = None) -> None:
        """Start ``args`` from the repository root with :meth:`environment` plus
        ``container_env``, output to :attr:`log_path`."""
        assert self._process is None, f"{self.name} was started already"
        temporary = self.directory / "tmp"
        temporary.mkdir(exist_ok=True)
        env = {**self.environment(), "TMPDIR": str(temporary), **(container_env or {})}
        with self.log_path.open("ab") as log:
            self.started_at = time.time()
            self._process = subprocess.Popen(
                list(args),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once it has exited (and :attr:`exited_at`, when first seen)."""
        if self._process is None:
            return None
        code = self._process.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code

    def running(self) -> bool:
        return self._process is not None and self.returncode is None

    def still_running_after(self, seconds: float) -> bool:
        """Whether it is still running ``seconds`` from now (answers as soon as it exits)."""
        assert self._process is not None, f"{self.name} was never started"
        try:
            self._process.wait(seconds)
        except subprocess.TimeoutExpired:
            return True
        return False

    def stop(self) -> None:
        """SIGKILL it and everything it started, by PID. Idempotent."""
        if self._process is not None:
            kill_tree(self._process)
        self.returncode  # noqa: B018  (records exited_at)

    def kill(self) -> None:
        """Node failure: it and its workers die at once."""
        self.stop()

    def log(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)
