"""A bounded soak of one Rendezvous against the real control plane.

Agents behave like torchrun's elastic agents: each calls ``next_rendezvous()``, then
"trains" until ``num_nodes_waiting()`` turns positive (or its workers "fail") and calls it
again. A chaos driver meanwhile picks random faults: a worker failure (the agent
re-rendezvouses), a node leaving (``shutdown()``) and later joining again with a new agent,
a pod deleted and replaced, a scale-up (a new pod) or scale-down (a pod deleted for good),
and the operator SIGKILLed and restarted. After most faults the driver waits until the
world is whole again (sealed, every running agent in it or a spare) and records how long
that took; after the others it strikes again at once, so faults overlap.

Every status version is recorded from a watch and, with what every handler returned,
checked against the invariants (devkit/invariants.py) every few faults and at the
end. The soak stops by itself at a round count or a time limit, whichever comes first.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException
from tests.support.fixtures import create_pods

from devkit import invariants
from devkit.cluster.controlplane import ControlPlane
from devkit.manifests import WORKLOAD_SELECTOR
from devkit.operator import OperatorProcess
from devkit.waiting import WaitTimeout, wait_for
from k8s_rendezvous import config, errors, kube
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import objects, specs, statuses

log = logging.getLogger("soak")

ACTIONS: dict[str, float] = {
    "worker-failure": 4,
    "leave": 2,
    "rejoin": 3,
    "pod-deleted": 2,
    "scale-up": 1,
    "scale-down": 1,
    "operator-killed": 0.4,
}
"""Relative weights of the faults; an action that does not apply at the moment (no pod to
rejoin, the pool at its bound) is skipped and another drawn."""


@dataclasses.dataclass(frozen=True)
class Config:
    rounds: int = 1000
    """Stop once this many rounds have been sealed..."""
    seconds: float = 1800
    """...or after this long, whichever comes first."""
    seed: int = 0
    min_nodes: int = 2
    max_nodes: int = 4
    min_pods: int = 2
    """Scale-down and pod deletion never go below this many live pods."""
    max_pods: int = 6
    """More pods than maxNodes: the extra ones wait as spares."""
    settle_probability: float = 0.75
    """After a fault, how often the driver waits for the world to be whole again (and
    times it) rather than striking again at once."""
    settle_timeout: float = 90
    """A world not whole again after this long is reported as a stall."""
    operator_kills: bool = True
    """Include SIGKILLs of the operator among the faults."""
    check_every: int = 25
    """Check the invariants on the history so far every this many faults."""
    join_timeout: int = 180
    last_call_timeout: int = 1
    heartbeat_timeout: int = 10
    read_timeout: int = 30


@dataclasses.dataclass
class Result:
    config: Config
    rounds: int = 0
    seconds: float = 0.0
    stopped_by: str = ""
    actions: dict[str, int] = dataclasses.field(default_factory=dict)
    recovery_seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Per fault: from the fault to the world being whole again."""
    stalls: list[str] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)
    """Invariant violations, and handler errors that are not our named errors."""
    joins_returned: int = 0
    join_errors: dict[str, int] = dataclasses.field(default_factory=dict)
    versions_recorded: int = 0
    operator_restarts: int = 0

    def summary(self) -> dict[str, Any]:
        def figures(samples: list[float]) -> dict[str, float | int]:
            ordered = sorted(samples)
            return {
                "count": len(ordered),
                "median": round(statistics.median(ordered), 3),
                "p95": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 3),
                "max": round(ordered[-1], 3),
            }

        return {
            "config": dataclasses.asdict(self.config),
            "rounds": self.rounds,
            "seconds": round(self.seconds, 1),
            "stopped_by": self.stopped_by,
            "violations": self.violations,
            "stalls": self.stalls,
            "actions": self.actions,
            "recovery_seconds": {
                action: figures(samples)
                for action, samples in sorted(self.recovery_seconds.items())
                if samples
            },
            "joins_returned": self.joins_returned,
            "join_errors": self.join_errors,
            "versions_recorded": self.versions_recorded,
            "operator_restarts": self.operator_restarts,
        }


def log_to(path: Path) -> logging.Handler:
    """Send the soak's and the handlers' log lines to ``path`` (returns the handler)."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(message)s"))
    for name in ("soak", "k8s_rendezvous"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    return handler


class Agent:
    """One torchrun-like agent in one pod: rendezvous, train until told to re-rendezvous."""

    def __init__(self, pod: str, handler: KubernetesRendezvousHandler, soak: Soak) -> None:
        self.pod = pod
        self.handler = handler
        self.returned_round: int | None = None
        """The round of its latest ``next_rendezvous()`` that returned."""
        self._soak = soak
        self._failed = threading.Event()
        self._leave = threading.Event()
        self._dead = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agent-{pod}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self.done.is_set() and not self._dead.is_set()

    @property
    def training(self) -> bool:
        return self.running and self.returned_round is not None

    def fail_workers(self) -> None:
        self._failed.set()

    @property
    def reacted(self) -> bool:
        """It has taken the worker failure in (and is re-rendezvousing, or done)."""
        return not self._failed.is_set()

    def leave(self) -> None:
        """At the next poll the agent calls ``shutdown()`` and ends."""
        self._leave.set()

    def die(self) -> None:
        """Its pod is gone: it stops without a word (no ``shutdown()``), like a killed
        process. A ``next_rendezvous()`` in progress still returns or raises later and
        is recorded like any other."""
        self._dead.set()
        self.handler.heartbeat.stop()
        self.handler.watcher.stop()

    def _run(self) -> None:
        try:
            while not self._dead.is_set():
                self.returned_round = None
                if not self._rendezvous():
                    return
                while not self._dead.is_set():
                    if self._leave.is_set():
                        self.handler.shutdown()
                        return
                    if self._failed.is_set():
                        self._failed.clear()
                        break
                    if self.handler.num_nodes_waiting() > 0:
                        break
                    self._dead.wait(0.05)  # torchrun's monitor interval is 5 s; we hurry
        finally:
            self.done.set()

    def _rendezvous(self) -> bool:
        try:
            info = self.handler.next_rendezvous()
        except Exception as error:
            log.info(
                "%s: next_rendezvous() raised %s (its pod %s): %s",
                self.pod,
                type(error).__name__,
                "was deleted" if self._dead.is_set() else "lives",
                error,
            )
            self._soak.joined(invariants.Outcome(self.pod, error=type(error).__name__), error)
            return False
        joined = self.handler.joined
        assert joined is not None
        self._soak.joined(
            invariants.Outcome(
                self.pod,
                round=joined.round,
                rank=info.rank,
                world_size=info.world_size,
                master=(
                    info.bootstrap_store_info.master_addr,
                    info.bootstrap_store_info.master_port,
                ),
            ),
            None,
        )
        self.returned_round = joined.round
        return True


@dataclasses.dataclass
class Pod:
    name: str
    addr: str
    api: kubernetes.client.ApiClient
    agent: Agent | None = None
    alive: bool = True


class Soak:
    """Drives one Rendezvous in ``namespace`` (whose ``default`` ServiceAccount holds the
    worker role) with ``operator`` already running and watching that namespace."""

    def __init__(
        self,
        control_plane: ControlPlane,
        admin_api: kubernetes.client.ApiClient,
        namespace: str,
        operator: OperatorProcess,
        config: Config,
        progress: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.control_plane = control_plane
        self.admin_api = admin_api
        self.namespace = namespace
        self.operator = operator
        self.config = config
        self.progress = progress
        self.name = f"soak-{uuid.uuid4().hex[:6]}"
        self.result = Result(config)
        self._random = random.Random(config.seed)
        self._pods: dict[str, Pod] = {}
        self._names = (f"soak-{n}" for n in itertools.count())
        self._addresses = (f"127.0.{n // 250}.{n % 250 + 2}" for n in itertools.count())
        self._outcomes: list[invariants.Outcome] = []
        self._lock = threading.Lock()
        self._custom = kubernetes.client.CustomObjectsApi(admin_api)
        self._recorder: invariants.Recorder | None = None
        self._spec = specs.RendezvousSpec(
            min_nodes=config.min_nodes,
            max_nodes=config.max_nodes,
            run_id=self.name,
            join_timeout_seconds=config.join_timeout,
            last_call_timeout_seconds=config.last_call_timeout,
            heartbeat_timeout_seconds=config.heartbeat_timeout,
            pod_selector=specs.LabelSelector.from_dict(WORKLOAD_SELECTOR, "podSelector"),
        )

    # -- what agents report -----------------------------------------------------------

    def joined(self, outcome: invariants.Outcome, error: BaseException | None) -> None:
        with self._lock:
            self._outcomes.append(outcome)
            if error is None:
                self.result.joins_returned += 1
                return
            kind = type(error).__name__
            self.result.join_errors[kind] = self.result.join_errors.get(kind, 0) + 1
            if type(error).__module__ != errors.__name__:
                self.result.violations.append(f"{outcome.node}: not a named error: {error!r}")

    # -- the run ----------------------------------------------------------------------

    def run(self) -> Result:
        started = time.monotonic()
        self._recorder = invariants.Recorder(self.admin_api, self.namespace, self.name)
        try:
            self._custom.create_namespaced_custom_object(
                objects.GROUP,
                objects.VERSION,
                self.namespace,
                objects.PLURAL,
                {
                    "apiVersion": objects.API_VERSION,
                    "kind": objects.KIND,
                    "metadata": {"name": self.name},
                    "spec": self._spec.to_dict(),
                },
            )
            self._add_pods(self.config.min_nodes + 1)
            self._settle("start", started)
            faults = 0
            while True:
                rounds = self._status().round
                elapsed = time.monotonic() - started
                if rounds >= self.config.rounds:
                    self.result.stopped_by = f"rounds ({rounds} >= {self.config.rounds})"
                    break
                if elapsed >= self.config.seconds:
                    self.result.stopped_by = f"time ({elapsed:.0f} s >= {self.config.seconds} s)"
                    break
                action = self._strike()
                faults += 1
                if self._random.random() < self.config.settle_probability:
                    self._settle(action, time.monotonic())
                if faults % self.config.check_every == 0:
                    self._check(final=False)
                    self.progress(
                        f"{elapsed:6.0f} s  round {rounds}  faults {faults}  "
                        f"violations {len(self.result.violations)}  stalls "
                        f"{len(self.result.stalls)}"
                    )
            self._settle("end", time.monotonic())
            self.result.rounds = self._status().round
            self.result.seconds = time.monotonic() - started
            self._check(final=True)
            return self.result
        finally:
            self._teardown()

    def _strike(self) -> str:
        weights = dict(ACTIONS)
        if not self.config.operator_kills:
            del weights["operator-killed"]
        while weights:
            action = self._random.choices(list(weights), list(weights.values()))[0]
            log.info("fault: %s", action)
            if getattr(self, "_" + action.replace("-", "_"))():
                self.result.actions[action] = self.result.actions.get(action, 0) + 1
                return action
            del weights[action]
        raise AssertionError("no fault applies: the pool is in an impossible shape")

    # -- faults; each returns False when it does not apply now --------------------------

    def _training(self) -> list[Pod]:
        return [p for p in self._pods.values() if p.alive and p.agent and p.agent.training]

    def _running_count(self) -> int:
        return sum(1 for p in self._live() if p.agent is not None and p.agent.running)

    def _live(self) -> list[Pod]:
        return [p for p in self._pods.values() if p.alive]

    def _worker_failure(self) -> bool:
        training = self._training()
        if not training:
            return False
        agent = self._random.choice(training).agent
        assert agent is not None
        log.info("workers of %s fail", agent.pod)
        agent.fail_workers()
        # Judge recovery from when the agent acted on it, not from a world not yet broken.
        wait_for(lambda: agent.reacted or not agent.running, 30, f"{agent.pod} re-rendezvous")
        return True

    def _leave(self) -> bool:
        # Only while two more agents run, so the last round never loses every member to
        # leaving (that closes the rendezvous, by design: the job is done).
        running = [p for p in self._live() if p.agent and p.agent.running]
        training = self._training()
        if len(running) < 3 or not training:
            return False
        pod = self._random.choice(training)
        assert pod.agent is not None
        log.info("%s leaves", pod.name)
        pod.agent.leave()
        pod.agent.done.wait(30)
        return True

    def _rejoin(self) -> bool:
        idle = [p for p in self._live() if p.agent is None or not p.agent.running]
        if not idle:
            return False
        pod = self._random.choice(idle)
        log.info("%s starts a new agent", pod.name)
        pod.agent = Agent(pod.name, self._handler(pod), self)
        return True

    def _pod_deleted(self) -> bool:
        if not self._delete_a_pod():
            return False
        self._add_pods(1)
        return True

    def _scale_up(self) -> bool:
        if len(self._live()) >= self.config.max_pods:
            return False
        self._add_pods(1)
        return True

    def _scale_down(self) -> bool:
        return self._delete_a_pod()

    def _operator_killed(self) -> bool:
        self.operator.kill()
        self.operator.start()
        self.result.operator_restarts += 1
        return True

    # -- helpers ----------------------------------------------------------------------

    def _delete_a_pod(self) -> bool:
        live = self._live()
        if len(live) <= self.config.min_pods:
            return False
        pod = self._random.choice(live)
        log.info("pod %s is deleted", pod.name)
        pod.alive = False
        if pod.agent is not None:
            pod.agent.die()
        try:
            kubernetes.client.CoreV1Api(self.admin_api).delete_namespaced_pod(
                pod.name, self.namespace, grace_period_seconds=0
            )
        except ApiException as error:
            if error.status != 404:
                raise
        return True

    def _add_pods(self, count: int) -> None:
        addresses = {next(self._names): next(self._addresses) for _ in range(count)}
        for made in create_pods(
            self.admin_api, self.namespace, list(addresses), addresses=addresses
        ):
            name = made["metadata"]["name"]
            token = self.control_plane.token_for(
                self.namespace, "default", pod_name=name, pod_uid=made["metadata"]["uid"]
            )
            pod = Pod(name, addresses[name], self.control_plane.client_for_token(token))
            pod.agent = Agent(name, self._handler(pod), self)
            self._pods[name] = pod
            log.info("pod %s (%s) created", name, pod.addr)

    def _handler(self, pod: Pod) -> KubernetesRendezvousHandler:
        """A fresh agent's handler (a new instance), with the pod's own bound token."""
        client = kube.RendezvousClient(
            pod.api, self.namespace, self.name, retry_seconds=self.config.read_timeout
        )
        return KubernetesRendezvousHandler(
            client,
            run_id=self.name,
            node=pod.name,
            addr=pod.addr,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.max_nodes,
            settings=config.Settings(
                self.namespace, self.name, read_timeout=self.config.read_timeout
            ),
        )

    def _status(self) -> statuses.RendezvousStatus:
        body = self._custom.get_namespaced_custom_object(
            objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL, self.name
        )
        return statuses.RendezvousStatus.from_dict(body.get("status"))

    def _whole(self) -> bool:
        """Sealed, and every running agent is in the round (and has returned from its
        ``next_rendezvous()``) or waits as a spare beyond maxNodes."""
        status = self._status()
        if status.state is not statuses.RoundState.SEALED:
            return False
        running = {p.name: p.agent for p in self._live() if p.agent is not None and p.agent.running}
        members = [m.node for m in status.members]
        return (
            len(members) == min(len(running), self.config.max_nodes)
            and all(m in running for m in members)
            and all(running[m].returned_round == status.round for m in members)
        )

    def _settle(self, action: str, since: float) -> None:
        # Agents that ended (left, or a named error) are not waited for: "rejoin" starts
        # new ones in their pods. Fewer than minNodes running can never be whole: like a
        # Job keeping its parallelism, start agents (in idle pods, else in new ones).
        while self._running_count() < self.config.min_nodes:
            if not self._rejoin():
                self._add_pods(1)
        try:
            wait_for(self._whole, self.config.settle_timeout, "the world whole again")
        except WaitTimeout:
            stall = f"after {action} ({time.monotonic() - since:.0f} s): {self._describe()}"
            self.result.stalls.append(stall)
            self.progress(f"stall {stall}")
            return
        self.result.recovery_seconds.setdefault(action, []).append(time.monotonic() - since)

    def _describe(self) -> str:
        """The status and the agents, for a stall's report."""
        status = self._status()
        members = [(m.node, m.instance, m.attempt) for m in status.members]
        agents = {
            p.name: (
                "alive" if p.alive else "deleted",
                p.agent.handler.instance if p.agent else None,
                p.agent.handler.attempt if p.agent else None,
                "running" if p.agent and p.agent.running else "ended",
                p.agent.returned_round if p.agent else None,
            )
            for p in self._pods.values()
            if p.alive or (p.agent and p.agent.running)
        }
        return (
            f"{status.state.value} round {status.round} waiting {status.nodes_waiting} "
            f"members {members} left behind {[m.node for m in status.left_behind]} "
            f"agents {agents}"
        )

    def _check(self, *, final: bool) -> None:
        assert self._recorder is not None
        if final:  # let the recorder see the last seal every handler returned
            with self._lock:
                latest = max((o.round or 0 for o in self._outcomes), default=0)
            try:
                wait_for(
                    lambda: (h := self._recorder.statuses()) and h[-1][1].round >= latest,
                    30,
                    "the recorder caught up",
                )
            except WaitTimeout as error:
                self.result.violations.append(str(error))
        recorded = self._recorder.statuses()
        seen = max((s.round for _, s in recorded), default=0)
        with self._lock:
            # An outcome of a round the recorder has not shown yet is judged later.
            outcomes = [o for o in self._outcomes if o.round is None or o.round <= seen]
        self.result.versions_recorded = len(recorded)
        try:
            invariants.check(self._spec, recorded, outcomes)
        except invariants.Violation as violation:
            message = str(violation)
            if message not in self.result.violations:
                self.result.violations.append(message)

    def _teardown(self) -> None:
        for pod in self._pods.values():
            if pod.agent is not None:
                pod.agent.die()
        if self._recorder is not None:
            self._recorder.stop()
        for pod in self._pods.values():
            pod.api.close()
