"""The agent's side of re-forming in place (``--rdzv-conf in_place=1``).

torch's elastic agent knows one way through a change of the world: when its handler's
``num_nodes_waiting()`` is positive (or a worker failed), it stops every worker, calls
``next_rendezvous()`` and starts new ones. On the in-place path the handler keeps it from
doing so, and does the agent's part itself:

1. When the node's round goes stale (a member was lost) or a node waits to join, and
   every worker of this node is on the in-place path (each said so in the handoff
   directory, :mod:`k8s_rendezvous.handoff`), :class:`Reformer` joins the next round in
   the background, exactly as ``next_rendezvous()`` would, and ``num_nodes_waiting()``
   answers 0 meanwhile.
2. Once the round is sealed, it runs torch's own rank assignment on the round's store on
   the agent's behalf (``_assign_worker_ranks``: a newcomer's agent does its part of it
   in its ``next_rendezvous()``), records the result in the agent's worker group (ranks,
   group rank and size, master: what torch reports and what its exit barrier counts), and
   points the agent's store at the new round (the store ``next_rendezvous()`` returned
   follows the node's current round).
3. It publishes the round to the node's workers, who re-form around it
   (:mod:`k8s_rendezvous.in_place`).

Whatever stops this (a worker not on the path, or one that gave up; a failed join; no
agent to act for) makes ``num_nodes_waiting()`` answer as it would without the in-place
path, and the agent restarts the workers as it always does; the reason is logged
("in-place re-forming failed ... falling back to torch's restart") and published to the
workers, so those waiting stop waiting.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final, Protocol

from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.elastic.agent.server.api import ElasticAgent, WorkerState

from k8s_rendezvous import handoff, in_place, join
from k8s_rendezvous.wire import views

log = logging.getLogger(__name__)

_WAKE_SECONDS: Final = 1.0
"""How often the idle reformer looks up from its wait (to notice it was stopped)."""


_ASSIGN_WAIT: Final = datetime.timedelta(seconds=2)
"""How long one try of the rank assignment waits on the round's store (a few
milliseconds are enough while every member is alive)."""


_AGENT_FRAMES: Final = 4
"""How far up its callers ``next_rendezvous()`` looks for torch's agent on the in-place
path (the agent's ``_rendezvous``, under its profiling wrapper)."""


def calling_agent(frame: FrameType | None) -> ElasticAgent | None:
    """torch's elastic agent among the callers from ``frame`` up (it is the caller's
    caller at most: ``launch_agent`` holds it as ``agent``, its own methods as ``self``):
    the one :meth:`Reformer.started` is for."""
    for _ in range(_AGENT_FRAMES):
        if frame is None:
            return None
        for name in ("agent", "self"):
            candidate = frame.f_locals.get(name)
            if isinstance(candidate, ElasticAgent):
                return candidate
        frame = frame.f_back
    return None


@dataclasses.dataclass(frozen=True)
class TakeUp:
    """A round that lost a member, published in place: the workers must re-form into it."""

    round: int
    lost: tuple[str, ...]
    deadline: float
    """``time.monotonic()`` beyond which the node falls back to torch's restart."""


def lost_members(before: views.NodeView, after: views.NodeView) -> tuple[str, ...]:
    """The members of ``before``'s round that ``after``'s round no longer has (none known
    when a round is read from a slice, which lists no members)."""
    if not before.member_nodes or not after.member_nodes:
        return ()
    kept = set(after.member_nodes)
    return tuple(node for node in before.member_nodes if node not in kept)


def dropped_addresses(
    before: views.NodeView, after: views.NodeView
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The addresses of ``before``'s round that ``after``'s round no longer has: those to
    cut off at once, and those of members leaving (``after.leaving``: their pods are being
    deleted, and their workers finish the step in flight). A member whose agent restarted
    in its pod keeps its address, and its old workers' connections closed when they died."""
    kept = set(after.member_addresses)
    leaving = set(after.leaving)
    dropped = [
        (node, address)
        for node, address in zip(before.member_nodes, before.member_addresses, strict=True)
        if address not in kept
    ]
    lost = dict.fromkeys(address for node, address in dropped if node not in leaving)
    return tuple(lost), tuple(dict.fromkeys(a for _, a in dropped if a not in lost))


def late(take_up: TakeUp, rounds: list[int | None]) -> str | None:
    """Why the node must fall back to torch's restart once ``take_up``'s deadline passed,
    if it must: a worker (``rounds``: the round each worker last re-formed into, ``None``
    if unknown) is not yet in its round."""
    if all(worker_round is not None and worker_round >= take_up.round for worker_round in rounds):
        return None
    return (
        f"the workers did not re-form into round {take_up.round} in time after "
        f"{', '.join(take_up.lost)} left the world: a collective blocked on a peer that was "
        "cut off (its node lost, not its process killed) does not fail by itself "
        "(in_place_loss_timeout)"
    )


class Observer(Protocol):
    """Told of a reformer's steps as they happen (a measurement's hook: the benchmark
    times recoveries with it); it decides nothing and must return at once."""

    def rejoining(self) -> None:
        """A change is being re-formed in place: the next round's join begins."""

    def published(self, round_number: int, in_place: bool) -> None:
        """Round ``round_number`` was published to the workers: to re-form around in
        place, or (``in_place`` false) for the workers ``next_rendezvous()`` starts."""


class Reformer:
    """Re-forms this node's round in place while its workers keep running.

    Args:
        node: This node's name, for logs.
        wait_for_change: Blocks until the watched status shows a change the agent would
            restart for (the handler's own judgement), or a deadline; returns whether one
            is there.
        rejoin: Joins the next round, as ``next_rendezvous()`` does (holding the
            handler's join lock), and returns it with its store (the agents' prefix).
        lock: The handler's join lock: a join by ``next_rendezvous()`` and one in place
            never overlap.
        loss_timeout: Seconds the workers have to re-form into a round that lost a
            member. Their collectives fail within milliseconds when a peer's process
            dies; a peer cut off from the network (its node lost) closes no connection,
            and a collective blocked on it waits out the process group's timeout (30 min
            by default): past this bound the node falls back to torch's restart.
    """

    def __init__(
        self,
        node: str,
        wait_for_change: Callable[[float], bool],
        rejoin: Callable[[], tuple[join.Joined, Store]],
        lock: threading.Lock,
        loss_timeout: float,
    ) -> None:
        self._node = node
        self._loss_timeout = loss_timeout
        self._wait_for_change = wait_for_change
        self._rejoin = rejoin
        self._lock = lock
        self.directory = Path(tempfile.mkdtemp(prefix="k8s-rendezvous-in-place-"))
        # torch's agent starts its workers with this process's environment.
        os.environ[handoff.DIRECTORY_ENV] = str(self.directory)
        self._agent: ElasticAgent | None = None
        self._store: in_place.SwitchedStore | None = None
        self._gave_up: str | None = None
        self._joined: join.Joined | None = None
        self._take_up: TakeUp | None = None
        self._busy = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.observer: Observer | None = None

    # -- called by the handler -----------------------------------------------------------

    def started(self, joined: join.Joined, store: Store, agent: ElasticAgent | None) -> Store:
        """``next_rendezvous()`` joined ``joined`` (``store``: its store with the agents'
        prefix) for ``agent`` (``None`` if it was not called by torch's agent): the workers
        it starts are told the round; the agent gets a store that follows the node's
        round."""
        self._agent = agent
        self._gave_up = None
        self._joined = joined
        self._take_up = None
        for stale in self.directory.glob("worker-*.json"):  # the stopped workers'
            stale.unlink(missing_ok=True)
        self._publish(joined, None)
        self._store = in_place.SwitchedStore(store)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"k8s-rendezvous-in-place-{self._node}", daemon=True
            )
            self._thread.start()
        return self._store

    def handles_changes(self) -> bool:
        """Whether a change of the world is (being) re-formed in place, so that the agent
        must not restart the workers for it. Reads the workers' records: one that gave up
        makes the node give up."""
        if self._gave_up is not None or self._thread is None or not self._thread.is_alive():
            return False
        if self._busy:
            return True
        reason = self._workers_not_ready()
        if reason is not None and reason.startswith("worker gave up"):
            self._give_up(reason)
            return False
        if self._take_up is not None and time.monotonic() >= self._take_up.deadline:
            reason = late(self._take_up, self._worker_rounds())
            self._take_up = None
            if reason is not None:
                self._give_up(reason)
                return False
        return True

    @property
    def gave_up(self) -> str | None:
        """Why this node left the current change to torch's restart, if it did."""
        return self._gave_up

    def stop(self) -> None:
        self._stopped.set()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- the background re-forming -------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._once()
            except Exception as error:  # never leave the agent without an answer
                self._give_up(f"{type(error).__name__}: {error}")

    def _once(self) -> None:
        if self._gave_up is not None:
            self._stopped.wait(0.05)  # until next_rendezvous() starts afresh
            return
        if self._wait_for_change(time.monotonic() + _WAKE_SECONDS):
            with self._lock:
                # Judged again under the lock: a next_rendezvous() may just have joined.
                if self._gave_up is not None or not self._wait_for_change(time.monotonic()):
                    return
                reason = self._why_not_now()
                if reason is not None:
                    self._give_up(reason)
                    return
                self._busy = True
                try:
                    self._reform()
                finally:
                    self._busy = False

    def _why_not_now(self) -> str | None:
        if self._agent is None:
            return "next_rendezvous() was not called by torch's elastic agent"
        # No torch version check: on a torch that cannot reconfigure, no worker says it
        # is on the path (k8s_rendezvous.in_place creates a plain group and says why).
        group = self._agent.get_worker_group()
        if group.state is not WorkerState.HEALTHY:
            return f"the workers are {group.state.name}"
        return self._workers_not_ready()

    def _workers_not_ready(self) -> str | None:
        """Why not every worker of the agent's group is on the in-place path, if not."""
        if self._agent is None:
            return "no agent"
        for worker in self._agent.get_worker_group().workers:
            try:
                record = handoff.read_worker(self.directory, worker.local_rank)
            except handoff.HandoffError as error:
                return f"worker {worker.local_rank}'s record is unreadable: {error}"
            if record is None or record.pid != worker.id:
                return (
                    f"worker {worker.local_rank} (pid {worker.id}) has not joined through "
                    "k8s_rendezvous.in_place (it is starting, or does not use it)"
                )
            if record.fallback is not None:
                return f"worker gave up: worker {worker.local_rank}: {record.fallback}"
        return None

    def _worker_rounds(self) -> list[int | None]:
        """The round each worker of the agent's group last re-formed into, if known."""
        if self._agent is None:
            return [None]
        rounds: list[int | None] = []
        for worker in self._agent.get_worker_group().workers:
            try:
                record = handoff.read_worker(self.directory, worker.local_rank)
            except handoff.HandoffError:
                record = None
            rounds.append(record.round if record is not None and record.pid == worker.id else None)
        return rounds

    def _reform(self) -> None:
        started = time.monotonic()
        assert self._agent is not None and self._store is not None
        log.info("node %s re-forms its round in place; its workers keep running", self._node)
        if self.observer is not None:
            self.observer.rejoining()
        # Its fields are typed as torch's __init__ leaves them (None): Any to set them.
        group: Any = self._agent.get_worker_group()
        while True:
            joined, store = self._rejoin()
            workers = self._assign_ranks(joined, store, group.spec)
            if workers is not None:
                break
            log.warning(
                "node %s: round %d went stale before every member did its part of the rank "
                "assignment (one was lost since the seal); joining the next",
                self._node,
                joined.status.round,
            )
        status = joined.status
        for running, assigned in zip(group.workers, workers, strict=True):
            assigned.id = running.id
        assert status.master is not None
        group.workers = workers
        group.group_rank = joined.rank
        group.group_world_size = status.world_size
        group.master_addr = status.master.addr
        group.master_port = status.master.port
        self._store.inner = store  # the agent's store, for its exit barrier
        before = self._joined.status if self._joined is not None else views.NodeView(self._node)
        lost = lost_members(before, status)
        self._joined = joined
        if lost:
            self._take_up = TakeUp(status.round, lost, time.monotonic() + self._loss_timeout)
        self._publish(joined, workers[0] if workers else None, *dropped_addresses(before, status))
        log.info(
            "node %s is rank %d of %d in round %d, re-formed in place (workers kept as ranks "
            "%d-%d of %d) in %.3f s",
            self._node,
            joined.rank,
            status.world_size,
            status.round,
            workers[0].global_rank,
            workers[-1].global_rank,
            workers[0].world_size,
            time.monotonic() - started,
        )

    def _assign_ranks(self, joined: join.Joined, store: Store, spec: Any) -> list[Any] | None:
        """torch's own rank assignment, on the round's store, for the agent (a newcomer's
        agent does its part of the same exchange after its ``next_rendezvous()``); ``None``
        if the round went stale first. A member lost after the seal never does its part:
        the exchange is tried in short waits, between which the reformer looks whether
        the round went stale, rather than hold up the next round (which waits for this
        node) for the store's whole timeout."""
        assert self._agent is not None
        assign: Any = self._agent._assign_worker_ranks  # type: ignore[attr-defined]
        # A property of every torch store, missing from its type stubs.
        bound: datetime.timedelta = store.timeout  # type: ignore[attr-defined]
        deadline = time.monotonic() + bound.total_seconds()
        store.set_timeout(min(bound, _ASSIGN_WAIT))
        try:
            while True:
                try:
                    workers: list[Any] = assign(store, joined.rank, joined.status.world_size, spec)
                    return workers
                except RuntimeError:  # torch's DistStoreError (a part missing) or its
                    # DistNetworkError (rank 0's store gone: the round goes stale too)
                    if self._wait_for_change(time.monotonic()):
                        return None
                    if time.monotonic() >= deadline:
                        raise
        finally:
            store.set_timeout(bound)

    def _publish(
        self,
        joined: join.Joined,
        first: Any,
        lost: tuple[str, ...] = (),
        leaving: tuple[str, ...] = (),
    ) -> None:
        status = joined.status
        assert status.master is not None
        handoff.write(
            self.directory,
            handoff.ROUND_FILE,
            handoff.PublishedRound(
                round=status.round,
                uuid=handoff.round_uuid(joined.uid, status.round, status.master.endpoint),
                master=status.master.endpoint,
                group_rank=joined.rank,
                group_world_size=status.world_size,
                base_rank=None if first is None else first.global_rank,
                world_size=None if first is None else first.world_size,
                lost_addresses=lost,
                leaving_addresses=leaving,
            ),
        )
        if self.observer is not None:
            self.observer.published(status.round, in_place=first is not None)

    def _give_up(self, reason: str) -> None:
        """Leave this change to torch's restart: say so, and tell the workers."""
        if self._gave_up is not None:
            return
        self._gave_up = reason
        log.warning(
            "node %s: in-place re-forming failed (%s); falling back to torch's restart of "
            "the workers",
            self._node,
            reason,
        )
        try:
            published = handoff.read_round(self.directory)
            if published is not None:
                handoff.write(
                    self.directory,
                    handoff.ROUND_FILE,
                    dataclasses.replace(published, fallback=reason),
                )
        except (OSError, handoff.HandoffError) as error:
            log.warning("node %s could not tell its workers: %s", self._node, error)
