"""Local stand-ins for training pods: a Pod object on a kwok node plus a real ``torchrun``.

kwok runs no containers, so each node is two halves: the Pod object (scheduled, Running,
with a 10.244.x.x IP nobody can reach) and a local ``python -m torch.distributed.run``
started with the environment a container of that pod would see (in-cluster credentials
holding a real pod-bound token, ``POD_NAME``, ``POD_IP``). ``POD_IP`` is a distinct
loopback address per node so that every node's TCPStore is reachable. The workers run
examples/elastic_train.py, whose progress lines (one JSON object per worker and step) let
tests follow the job without sleeping.

Killing a node is what a node failure looks like to Kubernetes: the whole process tree
dies at once (SIGKILL) and the kubelet reports the pod gone (deleted, grace period 0).
torchrun starts its workers in sessions of their own, so they are found through
``/proc`` and killed by PID with the agent.

The process is the kit's :class:`~devkit.processes.LocalProcess` (the benchmark's nodes
are too), started with the pod's environment (:func:`~devkit.processes.container_environment`);
tests/e2e, tests/contract and tests/controllers use this module.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
from tests.support.fixtures import create_pods, delete_pod

from devkit.cluster.controlplane import ControlPlane
from devkit.paths import TRAIN_SCRIPT
from devkit.processes import LocalProcess, container_environment, json_lines
from devkit.waiting import wait_for

PROGRESS_ENV = "TRAIN_PROGRESS_FILE"
STOP_ENV = "TRAIN_STOP_FILE"
NPROC_PER_NODE = 2


@dataclasses.dataclass(frozen=True)
class Step:
    """One progress line of examples/elastic_train.py: a worker finished a step."""

    pod: str
    pid: int
    started: float
    """When the worker process started (wall clock): tells worlds of equal size apart."""
    rank: int
    world_size: int
    group_rank: int
    master: str
    """``MASTER_ADDR:MASTER_PORT`` as the worker got it."""
    step: int
    time: float


_STEP_FIELDS = frozenset(field.name for field in dataclasses.fields(Step))
"""A progress line's keys that make a :class:`Step` (the lines carry more, e.g. when the
worker had imported torch, which :meth:`LocalPod.progress_lines` keeps)."""


@dataclasses.dataclass(frozen=True)
class World:
    """The workers of one world as seen in progress lines."""

    steps: tuple[Step, ...]

    @property
    def first_step_at(self) -> float:
        return min(step.time for step in self.steps)

    @property
    def ranks(self) -> list[int]:
        return sorted({step.rank for step in self.steps})

    @property
    def group_ranks(self) -> dict[str, int]:
        return {step.pod: step.group_rank for step in self.steps}

    @property
    def masters(self) -> set[str]:
        return {step.master for step in self.steps}

    @property
    def rank0_pod(self) -> str:
        return next(pod for pod, rank in self.group_ranks.items() if rank == 0)


class LocalPod(LocalProcess):
    """One node: a Running Pod object and the local torchrun standing in for its container.

    Args:
        control_plane: Issues the pod-bound token (TokenRequest) and the in-cluster files.
        admin_api: Admin client, used to delete the Pod object when the node is killed.
        pod: The Pod as returned by ``create_pods`` (scheduled and Running).
        addr: This node's reachable address (a loopback address), published as POD_IP.
        workdir: Where its service-account files, log and progress file go (in a folder
            of its name), and the ``stop`` file of every node started there: once it
            exists, their training ends after the step in which any rank saw it (the
            examples' ``TRAIN_STOP_FILE``).
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        admin_api: kubernetes.client.ApiClient,
        pod: Mapping[str, Any],
        addr: str,
        workdir: Path,
    ) -> None:
        self.control_plane = control_plane
        self.admin_api = admin_api
        self.namespace: str = pod["metadata"]["namespace"]
        self.uid: str = pod["metadata"]["uid"]
        self.addr = addr
        name: str = pod["metadata"]["name"]
        super().__init__(name, workdir / name, log_name="torchrun.log")
        self.progress_path = self.directory / "progress.jsonl"
        self.stop_path = workdir / "stop"
        self.service_account_dir = self.directory / "serviceaccount"

    # -- the container -------------------------------------------------------------------

    def start(
        self,
        rendezvous: str,
        *,
        nnodes: str = "2:4",
        max_restarts: int = 3,
        script_args: Sequence[str] = (),
        exit_barrier_timeout: float | None = None,
        rdzv_conf: str = "",
        script: Path = TRAIN_SCRIPT,
        warm: bool = False,
    ) -> None:
        """Start ``torchrun --rdzv-backend=kubernetes`` running ``script``
        (examples/elastic_train.py by default; with ``exit_barrier_timeout``:
        tests/e2e/launch.py, torchrun with that setting; ``warm``: through
        ``-m k8s_rendezvous.warm``, which needs ``warm_start=1`` in ``rdzv_conf``)."""
        self._launch(
            {},
            [
                *(
                    []
                    if exit_barrier_timeout is None
                    else [f"--exit-barrier-timeout={exit_barrier_timeout}"]
                ),
                f"--nnodes={nnodes}",
                f"--nproc-per-node={NPROC_PER_NODE}",
                "--rdzv-backend=kubernetes",
                f"--rdzv-endpoint={rendezvous}",
                f"--rdzv-id={rendezvous}",
                *([f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []),
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1",
                *(["-m", "k8s_rendezvous.warm"] if warm else []),
            ],
            script_args,
            script,
        )

    def _launch(
        self,
        container_env: Mapping[str, str],
        torchrun_args: Sequence[str],
        script_args: Sequence[str],
        script: Path = TRAIN_SCRIPT,
    ) -> None:
        launcher = (
            "tests.e2e.launch"
            if any(arg.startswith("--exit-barrier-timeout=") for arg in torchrun_args)
            else "torch.distributed.run"
        )
        self.spawn(
            [sys.executable, "-m", launcher, *torchrun_args, str(script), *script_args],
            {
                **container_env,
                "LOGLEVEL": "INFO",
                PROGRESS_ENV: str(self.progress_path),
                STOP_ENV: str(self.stop_path),
            },
        )

    def environment(self) -> dict[str, str]:
        """The pod's container's (:func:`container_environment`): its bound token, POD_NAME,
        POD_NAMESPACE and POD_IP."""
        return container_environment(
            self.control_plane,
            self.namespace,
            self.name,
            self.uid,
            self.addr,
            self.service_account_dir,
        )

    def start_container(
        self, pod: Mapping[str, Any], *, max_restarts: int = 3, script_args: Sequence[str] = ()
    ) -> None:
        """Start plain ``torchrun train.py`` with the container's own env, as a kubelet
        would resolve it (values, and fieldRefs from the pod; status.podIP is this node's
        loopback stand-in): the rendezvous settings come only from what the webhook put
        there."""
        resolved = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "status.podIP": self.addr,
        }
        container_env: dict[str, str] = {}
        for variable in pod["spec"]["containers"][0].get("env") or []:
            if "value" in variable:
                container_env[variable["name"]] = variable["value"]
            elif path := (variable.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath"):
                container_env[variable["name"]] = resolved[path]
        self._launch(
            container_env,
            [
                f"--nproc-per-node={NPROC_PER_NODE}",
                f"--max-restarts={max_restarts}",
                "--monitor-interval=0.1",
            ],
            script_args,
        )

    def wait_exit(self, timeout: float) -> int:
        """Wait for torchrun to exit; its exit code. Fails with the log's tail on timeout."""
        assert self.pid is not None, f"{self.name} was never started"
        code = wait_for(
            lambda: (self.returncode,) if self.returncode is not None else None,
            timeout,
            f"torchrun of {self.name} to exit\n--- log tail ---\n{self.log_tail()}",
            interval=0.05,
            max_interval=0.5,
        )[0]
        assert code is not None
        return code

    def kill(self) -> None:
        """Node failure: SIGKILL the agent and its workers, then delete the Pod (grace 0)."""
        self.stop()
        delete_pod(self.admin_api, self.namespace, self.name)

    # -- what it produced -----------------------------------------------------------------

    def progress(self) -> list[Step]:
        return [
            Step(**{key: value for key, value in line.items() if key in _STEP_FIELDS})
            for line in self.progress_lines()
        ]

    def progress_lines(self) -> list[dict[str, Any]]:
        """The progress lines as written, with any keys beyond :class:`Step`'s."""
        return json_lines(self.progress_path)

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client with this pod's own credentials (its bound token), as its container has."""
        token = (self.service_account_dir / "token").read_text()
        return self.control_plane.client_for_token(token)

    def __repr__(self) -> str:
        return f"LocalPod({self.name}, {self.addr}, pid={self.pid}, rc={self.returncode})"


class LocalPods:
    """Creates and starts nodes in one namespace; ``finish()`` ends their training as if
    its steps were done, ``stop_all()`` stops every one by PID."""

    def __init__(
        self,
        control_plane: ControlPlane,
        admin_api: kubernetes.client.ApiClient,
        namespace: str,
        workdir: Path,
    ) -> None:
        self.control_plane = control_plane
        self.admin_api = admin_api
        self.namespace = namespace
        self.workdir = workdir
        self.stop_path = workdir / "stop"
        self.all: list[LocalPod] = []

    def start(
        self,
        rendezvous: str,
        addresses: Mapping[str, str],
        **options: Any,
    ) -> list[LocalPod]:
        """Create pods ``{name: loopback address}``, wait until Running, start their torchrun
        (``options`` go to :meth:`LocalPod.start`)."""
        created = create_pods(
            self.admin_api, self.namespace, list(addresses), addresses=dict(addresses)
        )
        pods = [
            LocalPod(
                self.control_plane,
                self.admin_api,
                pod,
                addresses[pod["metadata"]["name"]],
                self.workdir,
            )
            for pod in created
        ]
        self.all.extend(pods)
        for pod in pods:
            pod.start(rendezvous, **options)
        return pods

    def finish(self) -> None:
        """Every node's workers stop after the step in which one of them sees this, then
        the nodes exit as after their last step: a test that has seen what it waited for
        need not wait out the steps it gave the job to outlast its events."""
        self.stop_path.touch()

    def stop_all(self) -> None:
        for pod in self.all:
            pod.stop()


# -- following progress ------------------------------------------------------------------


def wait_world(
    pods: Iterable[LocalPod],
    world_size: int,
    *,
    after: float,
    timeout: float,
    min_step: int = 0,
) -> World:
    """Wait until every one of ``pods`` trains in a world of ``world_size`` ranks whose
    workers started after ``after`` (wall clock) and all ranks reached ``min_step``.
    Fails naming the pods' last progress and log tails."""
    pods = list(pods)

    def world() -> World | None:
        exited = [pod for pod in pods if not pod.running()]  # before reading: no race
        steps = [
            step
            for pod in pods
            for step in pod.progress()
            if step.world_size == world_size and step.started > after
        ]
        reached = {step.rank for step in steps if step.step >= min_step}
        if reached == set(range(world_size)) and {s.pod for s in steps} == {p.name for p in pods}:
            return World(tuple(steps))
        if exited:
            raise AssertionError(
                f"{[p.name for p in pods]} will not form a world of {world_size} ranks: "
                f"{', '.join(f'{p.name} exited with {p.returncode}' for p in exited)}"
            )
        return None

    try:
        return wait_for(
            world,
            timeout,
            f"{[p.name for p in pods]} in a new world of {world_size} ranks",
            interval=0.05,
            max_interval=0.25,
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{describe(pods)}") from None


def wait_all_exit(pods: Iterable[LocalPod], timeout: float) -> dict[str, int]:
    """Exit codes of every pod's torchrun, waiting at most ``timeout`` in total."""
    deadline = time.monotonic() + timeout
    return {pod.name: pod.wait_exit(max(0.1, deadline - time.monotonic())) for pod in pods}


def describe(pods: Iterable[LocalPod], lines: int = 25) -> str:
    """Each pod's exit code, last progress line and log tail: for failure messages."""
    parts = []
    for pod in pods:
        progress = pod.progress()
        parts.append(
            f"=== {pod!r}; last progress: {progress[-1] if progress else None}\n"
            f"{pod.log_tail(lines)}"
        )
    return "\n".join(parts)


def timing(label: str, seconds: float, sink: Callable[[str], None] = print) -> float:
    """Print a measured duration in a greppable form (``pytest -s`` shows it)."""
    sink(f"TIMING {label}: {seconds:.2f} s")
    return seconds
