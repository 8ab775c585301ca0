"""The agent's side of re-forming in place (``--rdzv-conf in_place=1``,
k8s_rendezvous.reforming), with torch's own elastic agent code: its rendezvous and its
rank assignment run for real, on the rounds' real TCPStores; only the workers are ids and
the operator is scripted.

- A node arrives: the running node re-joins in the background while its agent, asking
  num_nodes_waiting(), always hears 0; torch's rank assignment runs for it against the
  newcomer's agent; its worker group and store follow the new round, which its workers
  are told, with their new ranks.
- Workers not on the in-place path: the node gives up at once, says why (in the log and to
  the workers) and the agent hears that nodes wait, so it restarts them as usual.
- A worker that gave up, in a round that did not change: the agent restarts too.
- A member lost: the workers must re-form into the round without it within
  ``in_place_loss_timeout`` (one blocked on a peer cut off never would), or the agent
  restarts them.
- A member lost after the seal, before its agent did its part of torch's rank assignment:
  the survivor gives that round up as soon as it goes stale and re-forms into the next
  one in place, rather than wait out the store's timeout and fall back.
- Without ``in_place``, nothing of this exists.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tests.support.scripted_api import ScriptedRendezvousClient
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

from k8s_rendezvous import config, handoff
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(1, 2, "run", join_timeout_seconds=30)
WORKERS = 2
"""Per node."""
LOSS_TIMEOUT = 2.0
"""``in_place_loss_timeout``: the test registers the workers well within it, even on a
loaded machine."""


class Agent(SimpleElasticAgent):  # type: ignore[misc]
    """torch's agent whose workers are only ids (pids that no process has)."""

    first_id = 1000

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return {w.local_rank: self.first_id + w.local_rank for w in worker_group.workers}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        pass

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, death_sig: Any = None, timeout: int = 30) -> None:
        pass


class Operator(ScriptedRendezvousClient):
    """pod-1 forms round 1 alone; pod-2 then waits; pod-1's next join seals round 2 of
    both, pod-1 rank 0 (as the operator keeps survivors first)."""

    def __init__(self) -> None:
        super().__init__(SPEC)
        self.entries: dict[str, leases.NodeEntry] = {}

    def member(self, node: str) -> records.Member:
        entry = self.entries[node]
        return records.Member(node, entry.instance, entry.attempt, entry.addr)

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus | None:
        self.entries[node] = entry
        if node == "pod-1" and entry.attempt == 1:
            return self.sealed(1, "pod-1")
        if node == "pod-2":
            return self.sealed(1, "pod-1", waiting=1)
        return self.sealed(2, "pod-1", "pod-2") if "pod-2" in self.entries else None

    def sealed(self, number: int, *nodes: str, waiting: int = 0) -> statuses.RendezvousStatus:
        first = self.entries[nodes[0]]
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=number,
            members=tuple(self.member(node) for node in nodes),
            master=records.Master(first.addr, first.store_port),
            nodes_waiting=waiting,
        )

    def publish(self, status: statuses.RendezvousStatus) -> None:
        """A status write of the operator's own (not caused by a join)."""
        with self._changed:
            version = int(self._object["metadata"]["resourceVersion"]) + 1
            self._object = self._versioned(version, status)
            self._changed.notify_all()


class LosingOperator(Operator):
    """As :class:`Operator`; once ``lose()`` marks round 2 stale (pod-2 lost), pod-1's
    next join seals round 3 of pod-1 alone."""

    lost = False

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus | None:
        if not self.lost:
            return super().on_join(node, entry)
        self.entries[node] = entry
        return self.sealed(3, "pod-1")

    def lose(self) -> None:
        self.lost = True
        stale = self.sealed(2, "pod-1", "pod-2")
        self.publish(dataclasses.replace(stale, state=statuses.RoundState.REFORMING))


def handler(
    client: Operator,
    node: str,
    in_place: bool = True,
    loss_timeout: float = 30,
    addr: str = "127.0.0.1",
) -> KubernetesRendezvousHandler:
    return KubernetesRendezvousHandler(
        client,
        run_id="run",
        node=node,
        addr=addr,
        min_nodes=1,
        max_nodes=2,
        settings=config.Settings(
            client.namespace,
            client.name,
            read_timeout=10,
            in_place=in_place,
            in_place_loss_timeout=loss_timeout,
        ),
    )


def agent(rdzv: KubernetesRendezvousHandler, first_id: int = 1000) -> Agent:
    spec = WorkerSpec(
        role="trainer", local_world_size=WORKERS, rdzv_handler=rdzv, entrypoint="train.py"
    )
    made = Agent(spec)
    made.first_id = first_id
    return made


def reformer_directory(rdzv: KubernetesRendezvousHandler) -> Path:
    assert rdzv.reformer is not None
    return rdzv.reformer.directory


def register_workers(
    rdzv: KubernetesRendezvousHandler, group: WorkerGroup, round_number: int = 1
) -> None:
    """What each worker's k8s_rendezvous.in_place writes once it is in the world (and
    again after each re-forming, with the round it re-formed into)."""
    for worker in group.workers:
        handoff.write(
            reformer_directory(rdzv),
            handoff.worker_file(worker.local_rank),
            handoff.WorkerRecord(worker.local_rank, worker.id, round_number),
        )


def until(predicate: Any, what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def test_a_node_arriving_is_reformed_in_place_without_the_agent_restarting() -> None:
    operator = Operator()
    survivor_handler, newcomer_handler = handler(operator, "pod-1"), handler(operator, "pod-2")
    survivor, newcomer = agent(survivor_handler), agent(newcomer_handler, first_id=2000)
    try:
        survivor._initialize_workers(survivor._worker_group)
        group = survivor.get_worker_group()
        agent_store = survivor._store
        register_workers(survivor_handler, group)
        published_first = handoff.read_round(reformer_directory(survivor_handler))
        assert published_first is not None and not published_first.in_place

        answers: list[int] = []
        joining = threading.Thread(
            target=newcomer._initialize_workers, args=(newcomer._worker_group,)
        )
        joining.start()

        def reformed() -> handoff.PublishedRound | None:
            answers.append(survivor_handler.num_nodes_waiting())  # what the agent polls
            published = handoff.read_round(reformer_directory(survivor_handler))
            return published if published is not None and published.round == 2 else None

        published = until(reformed, "round 2 published to the survivor's workers")
        joining.join(20)
        assert not joining.is_alive()

        assert set(answers) == {0}, "the agent never heard of a node waiting"
        status = survivor_handler.watcher.status
        assert status is not None and status.master is not None
        assert published == handoff.PublishedRound(
            round=2,
            uuid=handoff.round_uuid("u-1", 2, status.master.endpoint),
            master=status.master.endpoint,
            group_rank=0,
            group_world_size=2,
            base_rank=0,
            world_size=2 * WORKERS,
        )
        assert (group.group_rank, group.group_world_size) == (0, 2)
        assert [(w.id, w.global_rank, w.world_size) for w in group.workers] == [
            (1000, 0, 4),
            (1001, 1, 4),
        ], "the running workers kept, with torch's ranks in the new world"
        assert (group.master_addr, group.master_port) == (status.master.addr, status.master.port)
        joined = newcomer.get_worker_group()
        assert [(w.global_rank, w.world_size) for w in joined.workers] == [(2, 4), (3, 4)]
        assert joined.master_addr == status.master.addr
        # The store the survivor's agent holds (its exit barrier's) is round 2's now.
        assert agent_store is survivor._store
        assert agent_store.get("torchelastic/assigned_ranks/1") == newcomer._store.get(
            "torchelastic/assigned_ranks/1"
        )
        assert operator.entries["pod-1"].attempt == 2, "one join in place, no restart"
    finally:
        newcomer_handler.shutdown()
        survivor_handler.shutdown()


def test_workers_not_on_the_in_place_path_make_the_node_fall_back_to_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="k8s_rendezvous.reforming")
    operator = Operator()
    rdzv = handler(operator, "pod-1")
    running = agent(rdzv)
    try:
        running._initialize_workers(running._worker_group)  # its workers never register
        operator.entries["pod-2"] = leases.NodeEntry("other", 1, "127.0.0.2", 1)
        operator.publish(operator.sealed(1, "pod-1", waiting=1))

        assert until(rdzv.num_nodes_waiting, "the agent to hear that a node waits") == 1
        published = handoff.read_round(reformer_directory(rdzv))
        assert published is not None and published.fallback is not None
        assert "has not joined through k8s_rendezvous.in_place" in published.fallback
        assert "in-place re-forming failed" in caplog.text
        assert "falling back to torch's restart" in caplog.text
        assert operator.entries["pod-1"].attempt == 1, "no join in place"
    finally:
        rdzv.shutdown()


def test_a_worker_that_gave_up_gets_the_workers_restarted_in_an_unchanged_round() -> None:
    operator = Operator()
    rdzv = handler(operator, "pod-1")
    running = agent(rdzv)
    try:
        running._initialize_workers(running._worker_group)
        register_workers(rdzv, running.get_worker_group())
        assert rdzv.num_nodes_waiting() == 0

        handoff.write(
            reformer_directory(rdzv),
            handoff.worker_file(1),
            handoff.WorkerRecord(1, 1001, 1, "TimeoutError: no round after round 1"),
        )

        assert rdzv.num_nodes_waiting() == 1
        assert rdzv.reformer is not None and rdzv.reformer.gave_up is not None
        assert "no round after round 1" in rdzv.reformer.gave_up
    finally:
        rdzv.shutdown()


def test_without_in_place_nothing_is_handed_to_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(handoff.DIRECTORY_ENV, raising=False)
    rdzv = handler(Operator(), "pod-1", in_place=False)
    running = agent(rdzv)
    try:
        running._initialize_workers(running._worker_group)
        assert rdzv.reformer is None
        assert handoff.DIRECTORY_ENV not in os.environ
    finally:
        rdzv.shutdown()


@pytest.mark.parametrize("workers_reform", [True, False], ids=["re-formed", "blocked"])
def test_workers_that_do_not_reform_after_a_loss_are_restarted_past_the_bound(
    workers_reform: bool,
) -> None:
    operator = LosingOperator()
    survivor_handler = handler(operator, "pod-1", loss_timeout=LOSS_TIMEOUT)
    lost_handler = handler(operator, "pod-2", addr="127.0.0.2")
    survivor, lost = agent(survivor_handler), agent(lost_handler, first_id=2000)
    try:
        survivor._initialize_workers(survivor._worker_group)
        group = survivor.get_worker_group()
        register_workers(survivor_handler, group)
        joining = threading.Thread(target=lost._initialize_workers, args=(lost._worker_group,))
        joining.start()
        until(
            lambda: survivor_handler.num_nodes_waiting() == 0 and group.group_world_size == 2,
            "round 2 re-formed in place",
        )
        joining.join(20)
        register_workers(survivor_handler, group, 2)

        operator.lose()

        def published_round() -> int:
            assert survivor_handler.num_nodes_waiting() == 0, "in place until the bound"
            published = handoff.read_round(reformer_directory(survivor_handler))
            return 0 if published is None else published.round

        until(lambda: published_round() == 3, "round 3 published to the survivor's workers")
        assert (group.group_rank, group.group_world_size) == (0, 1)
        published = handoff.read_round(reformer_directory(survivor_handler))
        assert published is not None and published.lost_addresses == ("127.0.0.2",), (
            "the workers are told whose connections to cut"
        )
        if workers_reform:
            register_workers(survivor_handler, group, 3)
        past_bound = time.monotonic() + LOSS_TIMEOUT + 0.1
        answers = []
        while time.monotonic() < past_bound or len(answers) < 2:
            answers.append(survivor_handler.num_nodes_waiting())
            time.sleep(0.05)

        assert survivor_handler.reformer is not None
        if workers_reform:
            assert set(answers) == {0}, "workers in the round are left alone"
            assert survivor_handler.reformer.gave_up is None
        else:
            assert answers[-1] == 1, "the agent hears that it must restart its workers"
            reason = survivor_handler.reformer.gave_up
            assert reason is not None and "did not re-form into round 3" in reason
            assert "pod-2" in reason and "in_place_loss_timeout" in reason
            published = handoff.read_round(reformer_directory(survivor_handler))
            assert published is not None and published.fallback == reason
    finally:
        lost_handler.shutdown()
        survivor_handler.shutdown()


def test_a_member_lost_before_it_did_its_part_of_the_rank_assignment_holds_nothing_up() -> None:
    operator = LosingOperator()
    survivor_handler = handler(operator, "pod-1")
    lost_handler = handler(operator, "pod-2", addr="127.0.0.2")
    survivor = agent(survivor_handler)
    try:
        survivor._initialize_workers(survivor._worker_group)
        group = survivor.get_worker_group()
        register_workers(survivor_handler, group)
        # pod-2 joins round 2 and dies before its agent does its part of torch's rank
        # assignment: the survivor's part waits on it.
        info = lost_handler.next_rendezvous()
        assert (info.rank, info.world_size) == (1, 2)

        operator.lose()

        def published() -> handoff.PublishedRound | None:
            found = handoff.read_round(reformer_directory(survivor_handler))
            return found if found is not None and found.round == 3 else None

        third = until(published, "round 3 published to the survivor's workers")
        assert third.in_place and third.fallback is None, "re-formed in place, no restart"
        assert (group.group_rank, group.group_world_size) == (0, 1)
        assert operator.entries["pod-1"].attempt == 3, "round 2 given up for round 3"
        assert survivor_handler.num_nodes_waiting() == 0
    finally:
        lost_handler.shutdown()
        survivor_handler.shutdown()
