"""Round decisions (``k8s_rendezvous_operator.rounds.decide``), without any I/O.

Aspects: sealing at maxNodes, at the last call, and as soon as every survivor of a stale
round is back; rank stability (survivors keep their ranks, a newcomer takes a lost rank,
a shrink moves only the last rank); member losses from pod
deletion, failure, container restarts, agent restarts and leaving; redundant nodes beyond
maxNodes; closing; and, property-based, the invariants over random histories.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
from collections.abc import Sequence

import hypothesis
import pytest
from hypothesis import strategies as st

from k8s_rendezvous.wire import statuses
from k8s_rendezvous.wire.leases import NodeEntry, NodeIntent
from k8s_rendezvous.wire.objects import slice_count
from k8s_rendezvous.wire.records import Member, Refusal
from k8s_rendezvous.wire.specs import RendezvousSpec
from k8s_rendezvous.wire.statuses import RendezvousStatus, RoundState
from k8s_rendezvous_operator import reasons, rounds

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


@dataclasses.dataclass
class World:
    """A rendezvous and its pods as the operator would observe them."""

    spec: RendezvousSpec
    status: RendezvousStatus = dataclasses.field(default_factory=RendezvousStatus)
    requests: dict[str, NodeEntry] = dataclasses.field(default_factory=dict)
    """Each node's Lease entry."""
    pods: dict[str, rounds.PodObservation] = dataclasses.field(default_factory=dict)
    now: datetime.datetime = T0
    liveness: rounds.Liveness | None = None
    history: list[rounds.Decision] = dataclasses.field(default_factory=list)
    instances: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    def write(self, node: str, entry: NodeEntry) -> None:
        self.requests[node] = entry

    def join(self, node: str) -> NodeEntry:
        """``next_rendezvous()`` of the node's agent (a new one if it has none)."""
        old = self.requests.get(node)
        if old is None or old.intent is NodeIntent.CLOSE:
            entry = NodeEntry(f"i{next(self.instances)}", 1, f"10.0.0.{len(self.requests)}", 29500)
        else:
            entry = dataclasses.replace(old, attempt=old.attempt + 1, intent=NodeIntent.JOIN)
        self.write(node, entry)
        self.pods.setdefault(node, rounds.PodObservation())
        if self.liveness is not None:  # the write is a renewal of the node's Lease
            beat = rounds.Heartbeat(entry.instance, self.now)
            self.liveness = dataclasses.replace(
                self.liveness, heartbeats={**self.liveness.heartbeats, node: beat}
            )
        return entry

    def restart_agent(self, node: str) -> None:
        self.write(node, NodeEntry(f"i{next(self.instances)}", 1, "10.9.9.9", 29501))

    def leave(self, node: str) -> None:
        self.write(node, dataclasses.replace(self.requests[node], intent=NodeIntent.LEAVE))

    def kill(self, node: str, reason: str = reasons.LOST_POD_DELETED) -> None:
        self.pods[node] = rounds.PodObservation(reason)

    def tick(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)

    def decide(self, **observed: object) -> rounds.Decision:
        decision = rounds.decide(
            self.spec,
            self.status,
            self.requests,
            self.pods,
            self.now,
            liveness=self.liveness,
            **observed,  # type: ignore[arg-type]
        )
        self.status = decision.status
        self.history.append(decision)
        return decision

    def ranks(self) -> list[str]:
        return [member.node for member in self.status.members]


def spec(
    min_nodes: int,
    max_nodes: int,
    last_call: int = 30,
    heartbeat: int = 30,
    max_restarts: int | None = None,
) -> RendezvousSpec:
    return RendezvousSpec(
        min_nodes,
        max_nodes,
        "run",
        last_call_timeout_seconds=last_call,
        heartbeat_timeout_seconds=heartbeat,
        max_restarts=max_restarts,
    )


def test_round_seals_when_max_nodes_join() -> None:
    world = World(spec(2, 3))
    for node in ("a", "b"):
        world.join(node)
        assert not world.decide().sealed
    world.join("c")
    decision = world.decide()
    assert decision.sealed
    assert world.status.state is RoundState.SEALED
    assert world.status.round == 1
    assert world.ranks() == ["a", "b", "c"]
    assert world.status.master is not None
    assert world.status.master.addr == world.requests["a"].addr
    assert world.status.round_key == "1-Sealed"


def test_round_seals_at_last_call_with_min_nodes() -> None:
    world = World(spec(2, 4, last_call=30))
    world.join("a")
    world.join("b")
    decision = world.decide()
    assert not decision.sealed
    assert decision.wake_at == T0 + datetime.timedelta(seconds=30)
    world.tick(29.9)
    assert not world.decide().sealed
    world.tick(0.1)
    assert world.decide().sealed
    assert world.status.world_size == 2


def test_last_call_deadline_is_not_extended_by_later_joins() -> None:
    world = World(spec(2, 4, last_call=30))
    world.join("a")
    world.join("b")
    world.decide()
    world.tick(20)
    world.join("c")
    assert world.decide().wake_at == T0 + datetime.timedelta(seconds=30)


def test_deadline_is_dropped_when_joiners_fall_below_min() -> None:
    world = World(spec(2, 4))
    world.join("a")
    world.join("b")
    world.decide()
    world.kill("b")
    decision = world.decide()
    assert decision.wake_at is None
    assert world.status.last_call_deadline is None


def test_lost_member_makes_round_stale_and_survivors_reseal_without_last_call() -> None:
    world = World(spec(2, 4, last_call=30))
    for node in ("a", "b", "c", "d"):
        world.join(node)
    world.decide()
    world.kill("c")
    decision = world.decide()
    assert world.status.state is RoundState.REFORMING
    assert [loss.node for loss in decision.losses] == ["c"]
    assert decision.losses[0].reason == reasons.LOST_POD_DELETED
    assert world.status.nodes_waiting >= 1
    world.join("a")
    world.join("d")
    assert not world.decide().sealed, "b has not re-joined yet"
    world.join("b")
    assert world.decide().sealed, "every survivor is back: no need to wait for the last call"
    assert world.ranks() == ["a", "b", "d"]
    assert world.status.round == 2


def test_rank_zero_stays_when_a_lower_sorting_node_joins() -> None:
    world = World(spec(2, 3))
    world.join("pod-5")
    world.join("pod-7")
    world.decide()
    world.tick(31)
    world.decide()
    assert world.ranks() == ["pod-5", "pod-7"]
    world.join("pod-1")
    world.decide()
    assert world.status.nodes_waiting == 1
    world.join("pod-7")
    world.join("pod-5")
    world.decide()
    assert world.ranks() == ["pod-5", "pod-7", "pod-1"]


def test_losing_rank_zero_moves_the_last_survivor_and_the_master_to_it() -> None:
    world = World(spec(1, 3))
    for node in ("a", "b", "c"):
        world.join(node)
    world.decide()
    world.kill("a", reasons.LOST_POD_FAILED)
    world.decide()
    world.join("b")
    world.join("c")
    world.decide()
    assert world.ranks() == ["c", "b"], "b keeps rank 1; only c moves"
    assert world.status.master is not None
    assert world.status.master.addr == world.requests["c"].addr
    assert [m.replaces for m in world.status.members] == ["a", None]


def sealed_with_a_spare(size: int) -> World:
    """A round of ``size`` members (its max) sealed, and one more node waiting beyond it."""
    world = World(spec(1, size))
    members = [f"pod-{index}" for index in range(size)]
    for node in members:
        world.join(node)
    world.decide()
    assert world.ranks() == members
    world.join("spare")
    world.decide()
    assert (world.status.state, world.status.spares) == (RoundState.SEALED, 1)
    return world


def rejoin_survivors(world: World, lost: str) -> rounds.Decision:
    world.kill(lost)
    world.decide()
    for node in world.ranks():
        if node != lost:
            world.join(node)
    return world.decide()


def test_a_spare_takes_the_lost_members_rank_and_survivors_keep_theirs() -> None:
    world = sealed_with_a_spare(4)
    assert rejoin_survivors(world, "pod-1").sealed, "full again: no last call"
    assert world.ranks() == ["pod-0", "spare", "pod-2", "pod-3"]
    assert [m.replaces for m in world.status.members] == [None, "pod-1", None, None]
    assert world.status.spares == 0


def test_a_spare_for_rank_zero_takes_the_last_rank_which_moves_to_zero() -> None:
    world = sealed_with_a_spare(4)
    assert rejoin_survivors(world, "pod-0").sealed
    assert world.ranks() == ["pod-3", "pod-1", "pod-2", "spare"]
    assert [m.replaces for m in world.status.members] == ["pod-0", None, None, "pod-3"]


def test_the_round_names_the_members_it_dropped_while_their_pods_are_deleted() -> None:
    world = World(spec(1, 4))
    for node in ("a", "b", "c", "d"):
        world.join(node)
    world.decide()
    world.kill("b", reasons.LOST_POD_TERMINATING)  # a drain: its workers finish their step
    world.kill("c", reasons.LOST_POD_FAILED)
    world.kill("d", reasons.LOST_POD_DELETED)  # gone: its processes with it
    world.decide()
    world.join("a")
    assert world.decide().sealed
    assert world.status.leaving == ("b",)
    assert RendezvousStatus.from_dict(world.status.to_dict()).leaving == ("b",)

    world.join("e")
    world.decide()
    world.join("a")
    assert world.decide().sealed, "a node arrived"
    assert world.status.leaving == (), "each round names its own"


def spares_ready(status: RendezvousStatus) -> tuple[str, str, str] | None:
    found = [c for c in status.conditions if c.type == rounds.CONDITION_SPARES_READY]
    return None if not found else (found[0].status, found[0].reason, found[0].message)


def test_declared_spares_are_reported_ready_until_one_replaces_a_lost_member() -> None:
    world = sealed_with_a_spare(3)
    world.spec = dataclasses.replace(world.spec, spares=1)
    world.decide()
    ready = world.status
    assert spares_ready(ready) == ("True", "SparesWaiting", reasons.spares_message(1, 1))

    assert rejoin_survivors(world, "pod-1").sealed
    short = spares_ready(world.status)
    assert short is not None and short[:2] == ("False", "SparesShort")
    assert "0 of 1 declared spare(s) wait" in short[2] and "another pod" in short[2]
    assert rounds.spares_lost(ready, world.status) == short[2], "the protection was lost"
    assert rounds.spares_lost(world.status, world.status) is None, "said once, not again"

    world.join("second-spare")
    world.decide()
    assert spares_ready(world.status) == ("True", "SparesWaiting", reasons.spares_message(1, 1))


def test_a_shortfall_from_the_first_seal_is_in_the_condition_without_a_warning() -> None:
    world = World(dataclasses.replace(spec(2, 2), spares=1))
    world.join("a")
    world.join("b")
    first = world.decide()
    assert first.sealed and spares_ready(world.status) == (
        "False",
        "SparesShort",
        reasons.spares_message(0, 1),
    )
    assert rounds.spares_lost(first.previous or RendezvousStatus(), world.status) is None


def test_no_declared_spares_no_condition_and_a_withdrawn_declaration_removes_it() -> None:
    world = sealed_with_a_spare(2)
    assert spares_ready(world.status) is None
    world.spec = dataclasses.replace(world.spec, spares=1)
    world.decide()
    assert spares_ready(world.status) is not None
    world.spec = dataclasses.replace(world.spec, spares=None)
    world.decide()
    assert spares_ready(world.status) is None


def test_a_closed_rendezvous_has_no_spares_to_keep() -> None:
    world = sealed_with_a_spare(2)
    world.spec = dataclasses.replace(world.spec, spares=1)
    world.decide()
    assert spares_ready(world.status) is not None
    world.decide(close=("Finished", "the job finished"))
    assert world.status.state is RoundState.CLOSED
    assert spares_ready(world.status) is None and not rounds.spares_short(world.status)


def test_the_history_says_why_each_round_was_formed_and_how_long_it_took() -> None:
    world = sealed_with_a_spare(4)
    world.tick(2)
    rejoin_survivors(world, "pod-1")
    first, second = world.status.history
    assert (first.round, first.cause, first.world_size) == (1, "FirstRound", 4)
    assert (second.round, second.cause, second.world_size) == (2, reasons.LOST_POD_DELETED, 4)
    assert second.message == "pod pod-1 (rank 1) lost: PodDeleted"
    assert second.forming_milliseconds == 0, "the operator's clock did not move meanwhile"
    assert world.status.forming_cause is None, "recorded at the seal"
    world.join("pod-9")
    world.tick(1.5)
    world.decide()
    assert world.status.forming_cause is None, "a spare beyond a full round is no cause"


def test_the_history_keeps_the_last_rounds_with_each_cause() -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.decide()
    world.tick(31)
    assert world.decide().sealed
    for _ in range(statuses.MAX_HISTORY + 2):
        world.join("b")
        assert world.decide().status.forming_cause == reasons.CAUSE_NODES_JOINED
        world.tick(0.25)
        world.join("a")
        assert world.decide().sealed
        world.leave("b")
        assert world.decide().status.forming_cause == reasons.LOST_LEFT
        world.join("a")
        world.tick(31)
        assert world.decide().sealed
    history = world.status.history
    assert len(history) == statuses.MAX_HISTORY
    assert [r.round for r in history] == list(range(world.status.round - 9, world.status.round + 1))
    assert {(r.cause, r.world_size) for r in history} == {
        (reasons.CAUSE_NODES_JOINED, 2),
        (reasons.LOST_LEFT, 1),
    }
    assert {r.forming_milliseconds for r in history} == {250, 31000}


def test_a_shrink_moves_only_the_last_rank_into_the_hole() -> None:
    world = World(spec(2, 4))
    for node in ("a", "b", "c", "d"):
        world.join(node)
    world.decide()
    world.kill("b")
    world.decide()
    for node in ("a", "c", "d"):
        world.join(node)
    assert world.decide().sealed, "every survivor is back"
    assert world.ranks() == ["a", "d", "c"]
    assert [m.replaces for m in world.status.members] == [None, "b", None]


def test_two_lost_and_one_newcomer_fill_the_lowest_hole_first() -> None:
    world = World(spec(2, 4))
    for node in ("a", "b", "c", "d"):
        world.join(node)
    world.decide()
    world.kill("b")
    world.kill("c")
    world.decide()
    for node in ("a", "d", "e"):
        world.join(node)
    assert world.decide().sealed
    assert world.ranks() == ["a", "e", "d"]


def test_newcomers_are_ordered_naturally() -> None:
    world = World(spec(3, 3))
    for node in ("pod-10", "pod-2", "pod-1"):
        world.join(node)
    world.decide()
    assert world.ranks() == ["pod-1", "pod-2", "pod-10"]


def test_nodes_beyond_max_are_redundant_and_not_counted_as_waiting() -> None:
    world = World(spec(2, 2))
    for node in ("a", "b", "c"):
        world.join(node)
    world.decide()
    assert world.status.state is RoundState.SEALED
    assert world.status.world_size == 2
    assert world.status.nodes_waiting == 0
    assert world.status.spares == 1, "shown, not told"
    world.kill("b")
    world.decide()
    world.join("a")
    assert world.decide().sealed
    assert world.ranks() == ["a", "c"]


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (lambda w: w.kill("b", reasons.LOST_POD_TERMINATING), reasons.LOST_POD_TERMINATING),
        (lambda w: w.restart_agent("b"), reasons.LOST_AGENT_RESTARTED),
        (lambda w: w.leave("b"), reasons.LOST_LEFT),
        (
            lambda w: w.pods.__setitem__("b", rounds.PodObservation(None, restarts=1)),
            reasons.LOST_CONTAINER_RESTARTED,
        ),
    ],
    ids=["terminating", "agent-restarted", "left", "container-restarted"],
)
def test_member_loss_reasons(event: object, reason: str) -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.join("b")
    world.decide()
    event(world)  # type: ignore[operator]
    decision = world.decide()
    assert [(loss.node, loss.reason) for loss in decision.losses] == [("b", reason)]
    assert world.status.state is RoundState.REFORMING


def test_rejoining_member_is_waiting_not_lost() -> None:
    world = World(spec(2, 2))
    world.join("a")
    world.join("b")
    world.decide()
    world.join("b")
    decision = world.decide()
    assert decision.losses == ()
    assert world.status.state is RoundState.REFORMING
    world.join("a")
    assert world.decide().sealed


def reseal(world: World, *nodes: str) -> None:
    """``nodes`` join and the round seals: every survivor is back (a first round: the
    workload expects just them)."""
    for node in nodes:
        world.join(node)
    assert world.decide(expected_nodes=len(nodes)).sealed


def test_failures_spend_the_restart_budget_and_planned_changes_do_not() -> None:
    world = World(spec(2, 3, max_restarts=2))
    reseal(world, "a", "b")
    world.join("b")  # its agent restarts failed workers
    world.decide()
    assert (world.status.forming_cause, world.status.restarts) == (
        reasons.CAUSE_MEMBER_REJOINED,
        1,
    )
    reseal(world, "a")
    world.join("c")  # a scale-up
    world.decide()
    reseal(world, "a", "b")
    world.kill("c")  # deleted: a drain, a preemption, a scale-down
    world.decide()
    reseal(world, "a", "b")
    assert world.status.restarts == 1, "planned changes spend nothing"
    assert [record.world_size for record in world.status.history] == [2, 2, 3, 2]
    world.kill("b", reasons.LOST_CONTAINER_RESTARTED)
    world.decide()
    assert world.status.restarts == 2
    assert world.status.state is RoundState.REFORMING, "the last restart is still granted"


def test_a_failure_with_the_budget_spent_closes_and_sends_every_member_into_the_closure() -> None:
    world = World(spec(2, 3, max_restarts=1))
    reseal(world, "a", "b", "c")
    world.kill("c", reasons.LOST_POD_FAILED)
    world.decide()
    reseal(world, "a", "b")
    world.kill("b", reasons.LOST_UNREACHABLE)
    decision = world.decide()
    assert decision.closed
    assert [(loss.node, loss.reason) for loss in decision.losses] == [
        ("b", reasons.LOST_UNREACHABLE)
    ]
    status = world.status
    assert (status.state, status.closed_reason) == (
        RoundState.CLOSED,
        reasons.CLOSED_RESTARTS_EXHAUSTED,
    )
    assert status.closed_message is not None and "spec.maxRestarts" in status.closed_message
    assert status.nodes_waiting >= 1, "running agents re-rendezvous into the closure"
    assert status.restarts == 1, "the refused restart is not counted"
    closed = next(c for c in status.conditions if c.type == rounds.CONDITION_CLOSED)
    assert (closed.status, closed.reason) == ("True", reasons.CLOSED_RESTARTS_EXHAUSTED)
    world.join("a")
    world.join("d")
    assert world.decide().status.state is RoundState.CLOSED


def test_any_failed_member_spends_the_budget_even_when_another_loss_names_the_cause() -> None:
    world = World(spec(1, 3, max_restarts=0))
    reseal(world, "a", "b", "c")
    world.kill("a")  # deleted, rank 0: it names the cause
    world.kill("c", reasons.LOST_POD_FAILED)
    decision = world.decide()
    assert decision.closed
    assert world.status.closed_reason == reasons.CLOSED_RESTARTS_EXHAUSTED


def test_without_a_budget_failures_are_counted_and_never_close() -> None:
    world = World(spec(2, 2))
    reseal(world, "a", "b")
    for expected in (1, 2, 3):
        world.join("b")
        world.decide()
        assert world.status.restarts == expected
        reseal(world, "a")


def test_set_closed_closes_for_everyone() -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.decide()
    world.write("a", dataclasses.replace(world.requests["a"], intent=NodeIntent.CLOSE))
    decision = world.decide()
    assert decision.closed
    assert world.status.state is RoundState.CLOSED
    assert world.status.closed_reason == reasons.CLOSED_BY_NODE
    world.join("b")
    assert world.decide().status.state is RoundState.CLOSED


def test_one_node_leaving_does_not_close_but_all_leaving_does() -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.join("b")
    world.decide()
    world.leave("b")
    assert not world.decide().closed
    world.join("a")
    world.decide()
    assert world.ranks() == ["a"]
    world.leave("a")
    decision = world.decide()
    assert decision.closed
    assert world.status.closed_reason == reasons.CLOSED_ALL_LEFT


@pytest.mark.parametrize(
    "finish",
    [
        lambda w: w.write("b", dataclasses.replace(w.requests["b"], intent=NodeIntent.FINISH)),
        lambda w: w.kill("b", reasons.LOST_POD_SUCCEEDED),
    ],
    ids=["agent-finished", "pod-succeeded"],
)
def test_a_member_finishing_closes_with_the_others_left_to_finish(finish: object) -> None:
    world = World(spec(2, 3))
    for node in ("a", "b"):
        world.join(node)
    world.decide()
    world.tick(60)
    assert world.decide().sealed
    world.join("c")  # waiting: it would make the round stale
    finish(world)  # type: ignore[operator]
    decision = world.decide()
    assert decision.closed and decision.losses == ()
    assert world.status.closed_reason == reasons.CLOSED_NODE_FINISHED
    assert "pod b of round 1 finished" in (world.status.closed_message or "")
    # The others' agents see nobody waiting: their workers run on to their end.
    assert world.status.nodes_waiting == 0
    assert world.ranks() == ["a", "b"]


def test_a_finish_of_an_earlier_agent_of_a_member_is_not_its_finish() -> None:
    world = World(spec(1, 2))
    world.join("a")
    earlier = world.join("b")
    world.decide()
    world.restart_agent("b")
    world.join("b")
    world.join("a")
    world.decide()
    world.write("b", dataclasses.replace(earlier, intent=NodeIntent.FINISH))
    decision = world.decide()
    assert not decision.closed
    assert [(loss.node, loss.reason) for loss in decision.losses] == [
        ("b", reasons.LOST_AGENT_RESTARTED)
    ]


def test_conditions_track_state_and_keep_transition_time() -> None:
    world = World(spec(1, 1))
    world.join("a")
    world.decide()
    ready = next(c for c in world.status.conditions if c.type == rounds.CONDITION_READY)
    assert (ready.status, ready.reason) == ("True", "RoundSealed")
    world.tick(5)
    world.decide()
    again = next(c for c in world.status.conditions if c.type == rounds.CONDITION_READY)
    assert again.last_transition_time == ready.last_transition_time


def test_member_without_heartbeats_expires_after_the_timeout_and_wakes_the_operator() -> None:
    world = World(spec(1, 2, heartbeat=9), liveness=rounds.Liveness({}, since=T0))
    world.join("a")
    world.join("b")
    decision = world.decide()
    assert decision.sealed
    assert decision.wake_at == T0 + datetime.timedelta(seconds=9)
    beat_a = rounds.Heartbeat(world.requests["a"].instance, T0 + datetime.timedelta(seconds=8))
    world.liveness = rounds.Liveness({"a": beat_a}, since=T0)
    world.tick(8.9)
    assert world.decide().wake_at == T0 + datetime.timedelta(seconds=9)
    world.tick(0.1)
    decision = world.decide()
    assert [(loss.node, loss.reason) for loss in decision.losses] == [
        ("b", reasons.LOST_HEARTBEAT_EXPIRED)
    ]
    assert decision.wake_at == T0 + datetime.timedelta(seconds=17), "a's next expiry"


def test_a_member_its_agent_silent_to_probes_is_lost_long_before_its_heartbeat_expires() -> None:
    world = World(spec(1, 3, heartbeat=30), liveness=rounds.Liveness({}, since=T0))
    for node in ("a", "b", "c"):
        world.join(node)
    assert world.decide().sealed
    world.tick(4)
    silent = (("b", world.requests["b"].instance),)
    world.liveness = dataclasses.replace(world.liveness, unreachable=frozenset(silent))
    decision = world.decide()
    assert [(loss.node, loss.reason) for loss in decision.losses] == [
        ("b", reasons.LOST_UNREACHABLE)
    ]
    assert world.status.state is RoundState.REFORMING


def test_a_spare_cut_off_with_the_member_it_would_replace_is_not_admitted() -> None:
    """A Kubernetes node lost takes a member and the spare beside it: both go silent to
    the probes at once, and the round re-forms without either, until the spare answers."""
    world = World(spec(1, 3), liveness=rounds.Liveness({}, since=T0))
    for node in ("pod-0", "pod-1", "pod-2", "spare"):
        world.join(node)
    world.decide()
    assert (world.ranks(), world.status.spares) == (["pod-0", "pod-1", "pod-2"], 1)
    cut = {(node, world.requests[node].instance) for node in ("pod-1", "spare")}
    world.liveness = dataclasses.replace(world.liveness, unreachable=frozenset(cut))
    decision = world.decide()
    assert [(loss.node, loss.reason) for loss in decision.losses] == [
        ("pod-1", reasons.LOST_UNREACHABLE)
    ]
    for node in ("pod-0", "pod-2"):
        world.join(node)
    assert world.decide().sealed, "every survivor is back"
    assert world.ranks() == ["pod-0", "pod-2"], "the silent spare was not sealed in"
    assert world.status.nodes_waiting == 0

    world.liveness = dataclasses.replace(world.liveness, unreachable=frozenset())
    world.decide()
    assert world.status.nodes_waiting == 1, "it counts again once it answers"


def test_an_unreachable_agent_of_an_earlier_instance_loses_no_member() -> None:
    """The verdict names the agent probed: a restarted agent is judged anew."""
    world = World(spec(1, 2, heartbeat=30), liveness=rounds.Liveness({}, since=T0))
    world.join("a")
    world.join("b")
    assert world.decide().sealed
    world.liveness = dataclasses.replace(
        world.liveness, unreachable=frozenset({("b", "an-agent-before-this-one")})
    )
    world.tick(1)
    assert world.decide().losses == ()


def test_a_waiter_without_heartbeats_stops_counting_and_is_never_sealed() -> None:
    """Rule 12: its agent died while its pod runs on (a wrapper shell, a sidecar)."""
    world = World(spec(1, 3, last_call=30, heartbeat=9), liveness=rounds.Liveness({}, since=T0))
    world.join("a")
    world.join("dead")
    decision = world.decide()
    assert not decision.sealed and decision.expired_waiters == ()
    assert decision.wake_at == T0 + datetime.timedelta(seconds=9), "woken at the expiry"
    beat = rounds.Heartbeat(world.requests["a"].instance, T0 + datetime.timedelta(seconds=8))
    world.liveness = rounds.Liveness({"a": beat}, since=T0)
    world.tick(9)
    decision = world.decide()
    assert decision.expired_waiters == ("dead",)
    assert decision.wake_at == T0 + datetime.timedelta(seconds=17), "a's expiry, then"
    world.tick(21)  # the last call; a renews every few seconds
    beat = rounds.Heartbeat(world.requests["a"].instance, world.now)
    world.liveness = rounds.Liveness({"a": beat}, since=T0)
    assert world.decide().sealed
    assert world.ranks() == ["a"], "the dead waiter is not sealed"


def test_a_waiter_that_renews_again_counts_again() -> None:
    world = World(spec(2, 2, heartbeat=9), liveness=rounds.Liveness({}, since=T0))
    world.join("a")
    world.join("b")
    world.tick(9)
    assert world.decide().expired_waiters == ("a", "b")
    assert world.status.state is not RoundState.SEALED
    world.liveness = rounds.Liveness(
        {node: rounds.Heartbeat(world.requests[node].instance, world.now) for node in ("a", "b")},
        since=T0,
    )
    decision = world.decide()
    assert decision.expired_waiters == () and decision.sealed


def test_heartbeat_of_a_previous_agent_instance_does_not_count() -> None:
    world = World(spec(1, 1, heartbeat=9), liveness=rounds.Liveness({}, since=T0))
    world.join("a")
    world.decide()
    stale = rounds.Heartbeat("some-older-instance", T0 + datetime.timedelta(seconds=100))
    world.liveness = rounds.Liveness({"a": stale}, since=T0)
    world.tick(10)
    assert [loss.reason for loss in world.decide().losses] == [reasons.LOST_HEARTBEAT_EXPIRED]


def test_a_member_dropped_for_its_heartbeat_is_not_readmitted_on_its_spent_join() -> None:
    """Its entry still holds the join request round 1 was sealed with; until its agent
    asks again (a new attempt) it must not count as waiting, or the survivors' round goes
    stale at once and the next one seals with a node that is not there."""
    world = World(spec(2, 3, heartbeat=9), liveness=rounds.Liveness({}, since=T0))
    for node in ("a", "b", "c"):
        world.join(node)
    assert world.decide().sealed
    alive = {
        node: rounds.Heartbeat(world.requests[node].instance, T0 + datetime.timedelta(seconds=8))
        for node in ("b", "c")
    }
    world.liveness = rounds.Liveness(alive, since=T0)
    world.tick(9)  # a's agent froze: its Lease is no longer renewed
    assert [loss.node for loss in world.decide().losses] == ["a"]
    world.join("b")
    world.join("c")
    assert world.decide().sealed
    assert world.ranks() == ["c", "b"]
    for _ in range(2):  # decided again (any event, a timer): the round stands
        world.tick(1)
        world.decide()
        assert (world.status.state, world.status.round) == (RoundState.SEALED, 2)
        assert world.status.nodes_waiting == 0
    world.join("a")  # back, its agent asks anew: now it counts
    world.decide()
    assert world.status.state is RoundState.REFORMING
    world.join("b")
    world.join("c")
    assert world.decide().sealed
    assert world.ranks() == ["c", "b", "a"]


def test_a_member_whose_container_restarted_is_not_readmitted_on_its_old_join() -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.join("b")
    assert world.decide().sealed
    world.pods["b"] = rounds.PodObservation(restarts=1)  # its agent is starting afresh
    world.decide()
    world.join("a")
    assert world.decide().sealed
    assert world.ranks() == ["a"], "b's old request died with its container"
    world.decide()
    assert world.status.state is RoundState.SEALED


def test_operator_restart_gives_members_a_full_heartbeat_period() -> None:
    world = World(spec(1, 1, heartbeat=9))
    world.join("a")
    world.decide()
    world.tick(60)  # the operator was down for a minute and saw no renewals
    world.liveness = rounds.Liveness({}, since=world.now)
    world.tick(8)
    assert world.decide().losses == ()


def test_first_round_seals_once_the_expected_nodes_joined() -> None:
    world = World(spec(1, 8, last_call=30))
    world.join("a")
    assert not world.decide(expected_nodes=3).sealed
    world.join("b")
    world.join("c")
    assert world.decide(expected_nodes=3).sealed, "no last call when all expected are in"
    assert world.status.world_size == 3


def test_finished_workload_closes_with_its_reason() -> None:
    world = World(spec(1, 2))
    world.join("a")
    world.decide()
    decision = world.decide(close=(reasons.CLOSED_JOB_COMPLETE, "Job train completed"))
    assert decision.closed
    assert (world.status.closed_reason, world.status.closed_message) == (
        reasons.CLOSED_JOB_COMPLETE,
        "Job train completed",
    )
    closed = next(c for c in world.status.conditions if c.type == rounds.CONDITION_CLOSED)
    assert (closed.status, closed.reason) == ("True", reasons.CLOSED_JOB_COMPLETE)


def test_rank_order_groups_newcomers_by_topology_but_survivors_keep_ranks() -> None:
    world = World(spec(4, 6))
    zones = {"n1": "zone-b", "n2": "zone-a", "n3": "zone-b", "n4": "zone-a"}
    for node, zone in zones.items():
        world.join(node)
        world.pods[node] = rounds.PodObservation(topology=zone)
    world.decide(expected_nodes=4)
    assert world.ranks() == ["n2", "n4", "n1", "n3"]
    for node, zone in {"n5": "zone-a", "n0": "zone-b"}.items():
        world.join(node)
        world.pods[node] = rounds.PodObservation(topology=zone)
    world.decide()
    for node in zones:
        world.join(node)
    world.decide()
    assert world.ranks() == ["n2", "n4", "n1", "n3", "n5", "n0"]


def test_decision_is_a_fixed_point() -> None:
    world = World(spec(2, 4))
    for node in ("a", "b", "c"):
        world.join(node)
    first = world.decide().status
    assert world.decide().status == first


# -- properties over random histories ---------------------------------------------------

NODES = [f"pod-{index}" for index in range(6)]
operations = st.lists(
    st.tuples(
        st.sampled_from(["join", "restart", "leave", "kill", "revive", "tick"]),
        st.sampled_from(NODES),
        st.floats(min_value=0, max_value=40),
    ),
    max_size=40,
)


@hypothesis.settings(max_examples=2000, deadline=None)
@hypothesis.given(
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda b: (b[0], b[0] + b[1])),
    history=operations,
    budget=st.none() | st.integers(0, 3),
)
def test_invariants_hold_over_any_history(
    bounds: tuple[int, int],
    history: list,  # type: ignore[type-arg]
    budget: int | None,
) -> None:
    world = World(spec(*bounds, last_call=10, max_restarts=budget))
    sealed_rounds: dict[int, tuple[object, ...]] = {}
    last_round = 0
    restarts = 0
    for op, node, seconds in history:
        if op == "join":
            world.join(node)
        elif op == "restart" and node in world.requests:
            world.restart_agent(node)
        elif op == "leave" and node in world.requests:
            world.leave(node)
        elif op == "kill":
            world.kill(node)
        elif op == "revive" and node in world.pods:
            world.pods[node] = rounds.PodObservation()
        elif op == "tick":
            world.tick(seconds)
        status = world.decide().status
        assert world.decide().status == status, "decisions are a fixed point"
        assert status.round >= last_round, "rounds only increase"
        last_round = status.round
        assert restarts <= status.restarts <= status.round, "restarts only increase"
        restarts = status.restarts
        assert budget is None or restarts <= budget, "the restart budget is never overspent"
        if status.round:
            members = tuple(status.members)
            assert sealed_rounds.setdefault(status.round, members) == members, (
                "sealed round changed"
            )
            names = [m.node for m in members]
            assert len(set(names)) == len(names), "a node holds two ranks"
            assert_ranks_stable(sealed_rounds.get(status.round - 1, ()), members)
            assert status.spares == 0 or len(members) == bounds[1], "spares beyond a full round"
            if status.state is RoundState.SEALED:
                assert bounds[0] <= len(members) <= bounds[1]
                assert status.master is not None
                assert status.master.addr == world.requests[names[0]].addr
    # No join is lost: once time passes and agents left out of the round re-join (as their
    # num_nodes_waiting() > 0 makes them do), every live node is admitted unless it is full.
    if world.status.state is RoundState.CLOSED:
        return
    live = [
        name
        for name, entry in world.requests.items()
        if entry.intent is NodeIntent.JOIN and world.pods[name].gone_reason is None
    ]
    world.tick(1000)  # every last call has passed
    for _ in range(len(NODES) + 1):  # agents react to a stale round by re-joining at once
        stale = [
            name
            for name in live
            if world.status.state is not RoundState.SEALED
            or world.status.rank_of(name, world.requests[name]) is None
        ]
        full = world.status.world_size == bounds[1]
        if world.status.state is RoundState.SEALED and (not stale or full):
            break  # everyone is in, or only spares beyond maxNodes are left out
        for name in stale:
            world.join(name)
        world.decide()
    if len(live) >= bounds[0]:
        assert world.status.state is RoundState.SEALED
        admitted = {m.node for m in world.status.members}
        left_out = [name for name in live if name not in admitted]
        assert len(admitted) == bounds[1] or not left_out, f"{left_out} never admitted"


def assert_ranks_stable(before: Sequence[Member], after: Sequence[Member]) -> None:
    """Rule 9 between two sealed rounds: a survivor moves only to fill a free rank it had
    to leave (beyond the new size) or rank 0; each member names who held its rank."""
    old_rank = {member.node: rank for rank, member in enumerate(before)}
    moved = [
        (old_rank[member.node], rank)
        for rank, member in enumerate(after)
        if member.node in old_rank and old_rank[member.node] != rank
    ]
    assert all(old >= len(after) or new == 0 for old, new in moved), moved
    if any(member.node in old_rank for member in after):
        assert after[0].node in old_rank, "rank 0 is a node that was there before"
    for rank, member in enumerate(after):
        holder = before[rank].node if rank < len(before) else None
        assert member.replaces == (holder if holder != member.node else None)


def test_a_status_edited_to_a_later_round_without_members_forms_it_instead_of_closing() -> None:
    """Nobody left: the all-left rule needs members that did."""
    world = World(spec(1, 2), RendezvousStatus(state=RoundState.FORMING, round=7))
    assert not world.decide().closed
    world.join("a")
    world.tick(31)
    decision = world.decide()
    assert decision.sealed and world.status.round == 8


def test_rules_are_applied_in_the_order_the_module_lists_them() -> None:
    assert [rule.__name__ for rule in rounds.RULES] == [
        "closed_stays_closed",
        "closes_when_work_ends",
        "forgets_spent_left_behind",
        "closes_when_everyone_left",
        "goes_stale_on_change",
        "seals_when_complete",
        "keeps_forming",
    ]
    for number, rule in enumerate(rounds.RULES, start=1):
        assert f"{number}. :func:`{rule.__name__}`" in (rounds.__doc__ or "")


def test_forming_since_alone_needs_no_write_and_is_handed_back() -> None:
    world = World(spec(3, 3))
    world.status = world.decide(first_write=True).status
    assert world.history[-1].write, "the first write is always made"
    world.join("a")
    decision = world.decide()
    assert decision.status.forming_since == T0
    assert not decision.write, "only formingSince changed"
    # Not written, so the stored status lacks it; the reconciler hands the time back.
    stored = dataclasses.replace(decision.status, forming_since=None)
    world.tick(5)
    world.join("b")
    world.join("c")
    sealed = rounds.decide(
        world.spec, stored, world.requests, world.pods, world.now, forming_since=T0
    )
    assert sealed.sealed and sealed.write
    assert sealed.forming_seconds == 5


def test_first_write_fixes_the_slice_count() -> None:
    decision = World(spec(1, 1000)).decide(first_write=True)
    assert decision.status.slices == slice_count(1000)
    assert decision.write


def test_a_seal_awaits_the_members_whose_pods_were_never_observed() -> None:
    world = World(spec(2, 2))
    world.join("a")
    world.join("b")
    del world.pods["b"]  # its request counts (admitted before), its pod not seen yet
    decision = world.decide()
    assert decision.sealed
    assert decision.awaiting == ("b",)
    assert world.decide().awaiting == (), "nothing sealed: nothing to await"


def test_the_refusals_are_written_with_the_status_and_a_change_of_them_is_a_write() -> None:
    spec = RendezvousSpec(2, 2, "run")
    refusal = Refusal("stranger", "i9", 1, "OtherWorkload", "not of the workload")
    first = rounds.decide(spec, RendezvousStatus(), {}, {}, T0, first_write=True)
    assert first.status.refused == ()
    refused = rounds.decide(spec, first.status, {}, {}, T0, refused=(refusal,))
    assert (refused.write, refused.status.refused) == (True, (refusal,))
    again = rounds.decide(spec, refused.status, {}, {}, T0, refused=(refusal,))
    assert not again.write
    assert rounds.decide(spec, refused.status, {}, {}, T0).write, "a refusal gone is a write"
