"""A stand-in kubelet for the pods the real controllers make, on kwok nodes.

kwok schedules nothing and runs no containers: it marks a bound pod Running with an IP
(a loopback address, so reachable here). This plays the rest of a kubelet for the pods of
one namespace, in a thread: a pod that is Running gets its first container run as a local
process (tests/e2e/harness.py's :class:`LocalPod`: the pod's own bound token, POD_NAME,
POD_IP...), with the container's ``command``/``args`` and ``env`` resolved as a kubelet does
(``value``, ``fieldRef``, ``$(VAR)`` references); ``torchrun`` is this interpreter's
``torch.distributed.run`` and ``train.py`` is examples/elastic_train.py. A pod that is
being deleted, or is gone, has its process sent SIGTERM (then SIGKILL after the grace
period); a process that exits makes its pod Succeeded or Failed with its exit code, as
``restartPolicy: Never`` has it. Gated or unscheduled pods are never Running, so never run.
Only containers whose command is ``torchrun`` are run; others (a queue's other tenants,
``sleep``) stay Running as kwok keeps them, doing nothing, as a sleep would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException
from tests.e2e.harness import PROGRESS_ENV, LocalPod, Step

from devkit.cluster.controlplane import ControlPlane, dig, read_object, set_pod_phase
from devkit.paths import TRAIN_SCRIPT
from devkit.waiting import wait_for

GRACE_SECONDS = 10.0
"""Between SIGTERM and SIGKILL, as terminationGracePeriodSeconds (30 by default; shorter
here: the agents this stops exit within a second or two)."""
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def container_command(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` with ``$(VAR)`` expanded from ``env`` (unknown references
    stay as written, as a kubelet leaves them), ``torchrun`` and ``train.py`` made local."""
    words = [
        _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), str(word))
        for word in [*(container.get("command") or []), *(container.get("args") or [])]
    ]
    assert words, f"container {container.get('name')} has no command: nothing to run here"
    if words[0] == "torchrun":
        words[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return [str(TRAIN_SCRIPT) if word == "train.py" else word for word in words]


def container_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], addr: str
) -> dict[str, str]:
    """The container's ``env`` as a kubelet resolves it (``status.podIP`` is ``addr``)."""
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"]["uid"],
        "spec.nodeName": dig(pod, "spec", "nodeName", default=""),
        "spec.serviceAccountName": dig(pod, "spec", "serviceAccountName", default="default"),
        "status.podIP": addr,
        "status.hostIP": dig(pod, "status", "hostIP", default=""),
    }
    env: dict[str, str] = {}
    for variable in container.get("env") or []:
        name = variable["name"]
        if "value" in variable:
            env[name] = _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), variable["value"])
            continue
        path = dig(variable, "valueFrom", "fieldRef", "fieldPath")
        if path is None:
            continue  # secrets, config maps, resources: none of the tests' pods use them
        if (field := _FIELD.match(path)) is not None:
            env[name] = dig(pod, "metadata", field.group(1), default={}).get(field.group(2), "")
        else:
            env[name] = fields[path]
    return env


class ContainerOfPod(LocalPod):
    """A pod's container run here. Its progress lines name the pod by ``POD_NAME`` or the
    hostname; a container without POD_NAME writes this machine's hostname, so its lines
    are taken as the pod's own (each pod has its own progress file)."""

    def progress(self) -> list[Step]:
        return [dataclasses.replace(step, pod=self.name) for step in super().progress()]


class Kubelet:
    """Runs the Running pods of ``namespace`` (those ``selector`` picks) as local processes
    until :meth:`stop`, which stops every process it started, by PID."""

    def __init__(
        self,
        control_plane: ControlPlane,
        api: kubernetes.client.ApiClient,
        namespace: str,
        workdir: Path,
        selector: str = "",
    ) -> None:
        self.control_plane = control_plane
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.selector = selector
        self.nodes: dict[str, LocalPod] = {}
        """Every pod this kubelet ran, by name (stopped ones included)."""
        self._uids: dict[str, str] = {}
        self._terminating: dict[str, float] = {}
        self._reported: set[str] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        """Held by each pass of the loop and by :meth:`exit`: one of them acts on a pod."""
        self._stopping = threading.Event()
        self._holding = threading.Event()
        """Set while :meth:`holding`: no new container starts."""
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{namespace}", daemon=True)

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(30)
        for node in self.nodes.values():
            node.stop()

    def check(self) -> None:
        """Raise what went wrong in the kubelet's thread, if anything did."""
        if self._error is not None:
            raise AssertionError(f"the stand-in kubelet failed: {self._error!r}") from self._error

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """While inside, no container of a newly Running pod starts (as if its image were
        still being pulled); on leaving, they start. Running ones go on."""
        self._holding.set()
        try:
            yield
        finally:
            self._holding.clear()

    def running(self, names: Iterable[str] | None = None) -> list[LocalPod]:
        """The pods whose process runs now (of ``names``, if given)."""
        wanted = None if names is None else set(names)
        return [
            node
            for name, node in self.nodes.items()
            if node.running() and (wanted is None or name in wanted)
        ]

    def wait_running(self, count: int, timeout: float = 90) -> list[LocalPod]:
        """Until exactly ``count`` pods' processes run; those."""

        def enough() -> tuple[list[LocalPod]] | None:
            self.check()
            nodes = self.running()
            return (nodes,) if len(nodes) == count else None  # truthy when empty too

        found = wait_for(enough, timeout, f"{count} pods of {self.namespace} running", interval=0.1)
        return found[0]

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                with self._lock:
                    self._sync()
                self._stopping.wait(0.1)
        except BaseException as error:  # reported by check(), where a test looks
            self._error = error

    def _sync(self) -> None:
        core = kubernetes.client.CoreV1Api(self.api)
        pods = read_object(core.list_namespaced_pod, self.namespace, label_selector=self.selector)
        seen = {pod["metadata"]["name"]: pod for pod in pods["items"]}
        for name, node in self.nodes.items():
            pod = seen.get(name)
            gone = pod is None or pod["metadata"]["uid"] != self._uids[name]
            if (gone or dig(pod, "metadata", "deletionTimestamp")) and node.running():
                self._terminate(name, node)
            elif pod is not None and not gone and name not in self._reported:
                self._report_exit(name, node)
        for name, pod in seen.items():
            if name in self.nodes and self._uids[name] == pod["metadata"]["uid"]:
                continue
            if (
                dig(pod, "status", "phase") == "Running"
                and dig(pod, "status", "podIP")
                and not dig(pod, "metadata", "deletionTimestamp")
                and not self._holding.is_set()
                and (pod["spec"]["containers"][0].get("command") or [""])[0] == "torchrun"
            ):
                self._start(pod)

    def _start(self, pod: Mapping[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if name in self.nodes:
            self.nodes[name].stop()  # an earlier pod of the same name
        addr = pod["status"]["podIP"]
        node = ContainerOfPod(self.control_plane, self.api, pod, addr, self.workdir / "pods")
        container = pod["spec"]["containers"][0]
        env = container_env(pod, container, addr)
        # A container has POD_NAME and POD_NAMESPACE only if its env says so; the harness
        # always sets them, so they are blanked (the handler treats empty as unset). POD_IP
        # stays: this process has no network namespace, and the handler's own finding (its
        # route towards the API server) would be 127.0.0.1 rather than the pod's address.
        node.spawn(
            container_command(container, env),
            {
                "POD_NAME": "",
                "POD_NAMESPACE": "",
                **env,
                "LOGLEVEL": "INFO",
                PROGRESS_ENV: str(node.progress_path),
            },
        )
        self.nodes[name] = node
        self._uids[name] = pod["metadata"]["uid"]
        self._reported.discard(name)
        self._terminating.pop(name, None)

    def _terminate(self, name: str, node: LocalPod) -> None:
        """SIGTERM to the container's main process; SIGKILL to all of it after the grace."""
        self._reported.add(name)  # a deleted pod gets no phase
        if name not in self._terminating:
            self._terminating[name] = time.monotonic()
            if node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGTERM)
        elif time.monotonic() - self._terminating[name] > GRACE_SECONDS:
            node.stop()

    def _report_exit(self, name: str, node: LocalPod) -> None:
        code = node.returncode
        if code is None:
            return
        self._reported.add(name)
        code = 128 - code if code < 0 else code  # killed by a signal: 128 + its number
        phase = "Succeeded" if code == 0 else "Failed"
        with contextlib.suppress(ApiException):  # deleted meanwhile: nothing to report
            set_pod_phase(self.api, self.namespace, name, phase, exit_code=code)

    def kill(self, node: LocalPod) -> None:
        """The container is SIGKILLed (the OOM killer, ``kill -9`` on its node): its
        processes die and the pod turns Failed with exit code 137, as a kubelet reports it.

        Not a deletion: a Job with a ``podFailurePolicy`` replaces a pod only once it is
        Failed (its ``podReplacementPolicy`` is then ``Failed``), and a deleted pod that no
        kubelet reports stays terminating, never replaced."""
        self.exit(node, 128 + signal.SIGKILL)

    def exit(self, node: LocalPod, code: int) -> None:
        """The container of ``node`` exits with ``code`` (its processes are killed), and
        the pod turns Failed with that exit code, as a kubelet reports it."""
        with self._lock:
            self._reported.add(node.name)
            node.stop()
            set_pod_phase(self.api, self.namespace, node.name, "Failed", exit_code=code)
