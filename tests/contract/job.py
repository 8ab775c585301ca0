"""One scenario's agents, each in its own OS process, over either backend.

``kubernetes``: each agent is a simulated pod (tests/e2e/harness.py's ``LocalPod``): a
real Pod object kwok runs, selected by the test's Rendezvous, and the agent process
started with that pod's environment (its bound token, POD_NAME, POD_NAMESPACE, POD_IP, a
loopback address). The endpoint is the Rendezvous's name; the operator seals its rounds.

``c10d``: torch's own backend as the control: the same agent processes, endpoint
``127.0.0.1:<free port>``, agent 0 hosting the store (``is_host``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import kubernetes.client
import pytest
from tests.e2e.harness import LocalPod
from tests.support.fixtures import Rendezvous, create_pods, free_port

from devkit.cluster.controlplane import ControlPlane
from devkit.processes import LocalProcess
from devkit.waiting import wait_for

BACKENDS = ("kubernetes", "c10d")


def backend_param(backend: str, *rest: object) -> object:
    """A parameter set of the backend; torch's own backend carries the mark c10d_control,
    which `make test` leaves to `make contract` and hack/compat.sh."""
    marks = [pytest.mark.c10d_control] if backend == "c10d" else []
    return pytest.param(backend, *rest, marks=marks, id="-".join(map(str, (backend, *rest))))


JOIN_TIMEOUT = 600
"""Both backends' default: how long a node waits for a round to seal."""


@dataclasses.dataclass(frozen=True)
class Agent:
    """What one node runs: ``local_world_size`` workers of ``entrypoint`` (a function of
    tests/contract/workers.py) with ``args``, in ``role``."""

    entrypoint: str
    local_world_size: int
    args: tuple[Any, ...] = ()
    role: str = "default"


class Container(Protocol):
    log_path: Path

    def spawn(self, args: Sequence[str], container_env: Mapping[str, str] | None = None) -> None:
        """Start the agent process."""

    def stop(self) -> None:
        """SIGKILL the agent process and its workers."""

    def kill(self) -> None:
        """Node failure: the agent process and its workers die at once."""

    @property
    def returncode(self) -> int | None:
        """The agent process's exit code once it has exited."""

    def log_tail(self, lines: int = 40) -> str:
        """The end of the agent's output."""


def c10d_container(name: str, directory: Path) -> Container:
    """A c10d node: just the agent process (no pod), with a local node's environment."""
    return LocalProcess(name, directory, log_name="agent.log")


@dataclasses.dataclass
class Node:
    index: int
    agent: Agent
    container: Container
    result_path: Path

    def result(self) -> dict[str, Any] | None:
        """The agent's summary of its run, once it has written one."""
        try:
            return json.loads(self.result_path.read_text())  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None


class Place(Protocol):
    """Where a backend's agents run and meet."""

    backend: str

    def meet(self, min_nodes: int, max_nodes: int, join_timeout: int) -> tuple[str, str]:
        """The endpoint and run id of a new rendezvous for that many nodes."""

    def containers(self, indices: Sequence[int]) -> list[Container]:
        """A container per node, ready to spawn its agent."""


class Job:
    """The agents of one scenario, started together; every process is SIGKILLed by PID at
    :meth:`stop` (the fixture's teardown), whatever state it is in."""

    def __init__(self, place: Place, workdir: Path) -> None:
        self.place = place
        self.backend = place.backend
        self.workdir = workdir
        self.endpoint: str | None = None
        self.run_id: str | None = None
        self.nodes: list[Node] = []

    def start(
        self,
        agents: Sequence[Agent],
        *,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        max_restarts: int = 0,
        exit_barrier_timeout: float = 5,
        monitor_interval: float = 0.1,
        join_timeout: int = JOIN_TIMEOUT,
    ) -> list[Node]:
        """Start one agent process per entry of ``agents`` (node counts default to their
        number), all at once: their containers are made first, then spawned in a row."""
        low = len(agents) if min_nodes is None else min_nodes
        high = len(agents) if max_nodes is None else max_nodes
        if self.endpoint is None:
            self.endpoint, self.run_id = self.place.meet(low, high, join_timeout)
        first = len(self.nodes)
        indices = list(range(first, first + len(agents)))
        containers = self.place.containers(indices)
        nodes = [
            Node(index, agent, container, self.workdir / f"result-{index}.json")
            for index, agent, container in zip(indices, agents, containers, strict=True)
        ]
        self.nodes.extend(nodes)
        for node in nodes:
            config = {
                "backend": self.backend,
                "endpoint": self.endpoint,
                "run_id": self.run_id,
                "min_nodes": low,
                "max_nodes": high,
                # c10d: the first agent hosts the store, as torch's agent test does.
                "is_host": node.index == 0,
                "role": node.agent.role,
                "local_world_size": node.agent.local_world_size,
                "entrypoint": node.agent.entrypoint,
                "args": list(node.agent.args),
                "max_restarts": max_restarts,
                "monitor_interval": monitor_interval,
                "exit_barrier_timeout": exit_barrier_timeout,
                "log_dir": str(self.workdir / f"torchelastic-{node.index}"),
                "result": str(node.result_path),
                "rdzv_conf": {"join_timeout": join_timeout},
            }
            # torch's spawned workers leave an error file in TMPDIR when they fail: the
            # node's own directory, not /tmp.
            temporary = self.workdir / f"tmp-{node.index}"
            temporary.mkdir()
            node.container.spawn(
                [sys.executable, "-m", "tests.contract.agent", json.dumps(config)],
                # torch's agent logs its rounds and restarts
                {"LOGLEVEL": "INFO", "TMPDIR": str(temporary)},
            )
        return nodes

    def wait(
        self, nodes: Sequence[Node] | None = None, timeout: float = 240
    ) -> list[dict[str, Any]]:
        """Each node's result, once every one of ``nodes`` (all by default) has exited;
        fails with the agents' logs if one does not exit in time or exits without one."""
        waited = list(self.nodes if nodes is None else nodes)
        try:
            wait_for(
                lambda: all(node.container.returncode is not None for node in waited),
                timeout,
                f"agents {[n.index for n in waited]} to exit",
                interval=0.1,
                max_interval=0.5,
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.describe()}") from None
        results = []
        for node in waited:
            result = node.result()
            assert result is not None and node.container.returncode == 0, (
                f"agent {node.index} exited with {node.container.returncode}, "
                f"result {result}\n{self.describe()}"
            )
            results.append(result)
        return results

    def describe(self, lines: int = 40) -> str:
        return "\n".join(
            f"=== agent {node.index} ({self.backend}, rc={node.container.returncode}, "
            f"result={node.result()})\n{node.container.log_tail(lines)}"
            for node in self.nodes
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.container.stop()


class KubernetesPlace:
    """Pods (Running under kwok) selected by a Rendezvous the test makes."""

    backend = "kubernetes"

    def __init__(
        self,
        control_plane: ControlPlane,
        admin_api: kubernetes.client.ApiClient,
        namespace: str,
        make_rendezvous: Callable[..., Rendezvous],
        workdir: Path,
    ) -> None:
        self.control_plane = control_plane
        self.admin_api = admin_api
        self.namespace = namespace
        self.make_rendezvous = make_rendezvous
        self.workdir = workdir
        self.rendezvous: Rendezvous | None = None

    def meet(self, min_nodes: int, max_nodes: int, join_timeout: int) -> tuple[str, str]:
        # The spec decides (a node's --rdzv-conf timeout only matters if it makes one).
        self.rendezvous = self.make_rendezvous(
            min_nodes, max_nodes, joinTimeoutSeconds=join_timeout
        )
        return self.rendezvous.name, self.rendezvous.name

    def containers(self, indices: Sequence[int]) -> list[Container]:
        pods = create_pods(self.admin_api, self.namespace, [f"agent-{i}" for i in indices])
        return [
            LocalPod(self.control_plane, self.admin_api, pod, pod["status"]["podIP"], self.workdir)
            for pod in pods
        ]


class C10dPlace:
    """Plain processes meeting at a TCPStore on 127.0.0.1 hosted by agent 0."""

    backend = "c10d"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def meet(self, min_nodes: int, max_nodes: int, join_timeout: int) -> tuple[str, str]:
        return f"127.0.0.1:{free_port()}", f"contract-{uuid.uuid4().hex[:8]}"

    def containers(self, indices: Sequence[int]) -> list[Container]:
        return [c10d_container(f"agent-{i}", self.workdir / f"agent-{i}") for i in indices]
