"""The rendezvous invariants, checked over a history: every status version a watch saw,
plus what the handlers returned. Usable from tests (every Rendezvous made by the
``make_rendezvous`` fixture is recorded and checked at teardown), from the soak and from
bench/goodput.py.

The invariants:

* in every sealed round, each node holds one rank and ranks are 0..n-1 (a member's rank
  is its position, so this is: no node twice);
* a sealed round's world size is within [minNodes, maxNodes];
* a sealed round never changes (same members, same master, whenever that round is shown);
* the round number never decreases;
* what a handler returned (round, rank, world size, master) is what the resource says for
  that round, so no two nodes believe they are rank 0 of the same round;
* every join either got into a round, is still waiting, or ended in a named error.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import kubernetes.client
from kubernetes import watch

from devkit.cluster.controlplane import read_object_or_none
from k8s_rendezvous.wire import codec, objects, records, specs, statuses


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one ``next_rendezvous()`` call of one node ended with."""

    node: str
    round: int | None = None
    rank: int | None = None
    world_size: int | None = None
    master: tuple[str, int] | None = None
    error: str | None = None
    """The exception's type name, if it raised."""


class Violation(AssertionError):
    pass


def check(
    spec: specs.RendezvousSpec,
    history: Iterable[tuple[int, statuses.RendezvousStatus]],
    outcomes: Iterable[Outcome] = (),
) -> None:
    """Raise :class:`Violation` naming the first broken invariant."""
    sealed: dict[int, tuple[tuple[str, ...], records.Master | None]] = {}
    last_round = -1
    last_version = -1
    for version, status in history:
        if version <= last_version:
            raise Violation(f"history out of order at resourceVersion {version}")
        last_version = version
        if status.round < last_round:
            raise Violation(f"round went back from {last_round} to {status.round} at {version}")
        last_round = status.round
        if status.round == 0:
            continue
        names = tuple(member.node for member in status.members)
        if len(set(names)) != len(names):
            raise Violation(f"round {status.round}: a node holds two ranks: {names}")
        if status.state is statuses.RoundState.SEALED and not (
            spec.min_nodes <= len(names) <= spec.max_nodes
        ):
            raise Violation(
                f"round {status.round}: world size {len(names)} outside "
                f"[{spec.min_nodes}, {spec.max_nodes}]"
            )
        seen = sealed.setdefault(status.round, (names, status.master))
        if seen != (names, status.master):
            raise Violation(
                f"sealed round {status.round} changed: {seen} -> {(names, status.master)}"
            )
    claimed: dict[tuple[int, int], str] = {}
    for outcome in outcomes:
        if outcome.error is not None:
            continue
        if outcome.round is None or outcome.rank is None:
            raise Violation(f"{outcome.node}: a join ended with neither a round nor an error")
        holder = claimed.setdefault((outcome.round, outcome.rank), outcome.node)
        if holder != outcome.node:
            raise Violation(
                f"round {outcome.round}: {holder} and {outcome.node} both got rank {outcome.rank}"
            )
        if outcome.round not in sealed:
            raise Violation(f"{outcome.node} returned round {outcome.round}, never seen sealed")
        names, master = sealed[outcome.round]
        if names[outcome.rank] != outcome.node or outcome.world_size != len(names):
            raise Violation(
                f"{outcome.node} returned rank {outcome.rank} of {outcome.world_size} in round "
                f"{outcome.round}, the resource says {names}"
            )
        if master is None or (master.addr, master.port) != outcome.master:
            raise Violation(
                f"{outcome.node} got master {outcome.master}, the resource says {master}"
            )


class Recorder:
    """Records every version of one Rendezvous from a watch, in a background thread."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self.outcomes: list[Outcome] = []
        self.spec: dict[str, Any] | None = None
        """The latest spec seen (the object may be gone when the history is checked)."""
        self._api = kubernetes.client.CustomObjectsApi(api)
        self._versions: list[tuple[int, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._kept = threading.Condition(self._lock)
        self._stopped = threading.Event()
        self._watch = watch.Watch()  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(target=self._run, name=f"record-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = "0"  # from the start: the API server replays the object's current state
        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(  # type: ignore[no-untyped-call]
                    self._api.list_namespaced_custom_object,
                    objects.GROUP,
                    objects.VERSION,
                    self.namespace,
                    objects.PLURAL,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=version,
                    timeout_seconds=5,
                ):
                    obj = event["raw_object"]
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._keep(obj)
            except Exception:
                # The API server restarted or the version is too old (410): take the
                # current object and go on from there.
                if self._stopped.wait(0.2):
                    return
                try:
                    obj = self._current()
                except Exception:
                    continue
                if obj is None:
                    continue
                version = obj["metadata"]["resourceVersion"]
                self._keep(obj)

    def _current(self) -> dict[str, Any] | None:
        return read_object_or_none(
            self._api.get_namespaced_custom_object,
            objects.GROUP,
            objects.VERSION,
            self.namespace,
            objects.PLURAL,
            self.name,
        )

    def _keep(self, obj: dict[str, Any]) -> None:
        self.spec = obj.get("spec")
        with self._kept:
            self._versions.append(
                (int(obj["metadata"]["resourceVersion"]), obj.get("status") or {})
            )
            self._kept.notify_all()

    def catch_up(self, timeout: float = 30) -> None:
        """Wait until the history holds the object's current version: a test can end (its
        nodes returned) while this watch still reconnects after a fault of the test's."""
        current = self._current()
        if current is None:
            return  # never created, or deleted: the history is what was seen
        target = int(current["metadata"]["resourceVersion"])
        with self._kept:
            reached = self._kept.wait_for(
                lambda: any(version >= target for version, _ in self._versions), timeout
            )
        assert reached, f"the history of {self.name} did not reach version {target} in {timeout} s"

    def statuses(self) -> list[tuple[int, statuses.RendezvousStatus]]:
        """Every recorded version that decodes (a test may write nonsense on purpose)."""
        with self._lock:
            versions = sorted({v: s for v, s in self._versions}.items())
        decoded = []
        for version, raw in versions:
            try:
                decoded.append((version, statuses.RendezvousStatus.from_dict(raw or None)))
            except codec.DecodeError:
                continue
        return decoded

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()  # type: ignore[no-untyped-call]
        self._thread.join(10)
