"""Round decisions: a pure function of the stored status, what Kubernetes says about the
pods, and the operator's clock. No I/O here; :mod:`.reconciler` fetches and writes.

The rules, in the order :func:`decide` applies them:

1. A closed rendezvous stays closed.
2. A node asking to close (``set_closed()``) closes it; so does a member of the round
   finishing (its agent's workers succeeded, or its pod did): the round's work is ending,
   and a new round would lack that member's part, so the others finish theirs undisturbed
   (torch's c10d closes at any agent's shutdown alike); and so does every member of the
   last round having left (a failed agent's ``shutdown()``) with nobody waiting.
3. A sealed round goes stale (``Reforming``) as soon as a member is lost (pod deleted or
   failed, agent restarted, left) or re-joins, or a node waits that fits under
   ``maxNodes``. Running agents see ``nodesWaiting > 0`` and re-rendezvous at once.
4. A round forming seals when at least ``minNodes`` join and either ``maxNodes`` joined,
   every node we know of has joined (after a stale round: all survivors are back), or the
   last call (``lastCallTimeoutSeconds`` after ``minNodes`` were reached) has passed.
5. A join request admitted to a round is spent: a member lost from it (or left behind by
   the next round) counts as waiting again only once its agent asks anew.
6. Ranks are stable: previous members keep their relative order (rank 0 stays while its
   node lives); newcomers follow, grouped by topology if asked, in natural order of name.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Final

from k8s_rendezvous.state import (
    SLICE_MEMBERS,
    Condition,
    Master,
    Member,
    NodeEntry,
    NodeIntent,
    RendezvousSpec,
    RendezvousStatus,
    RoundState,
    slices_needed,
)
from k8s_rendezvous_operator import reasons
from k8s_rendezvous_operator.membership import PodIdentity

CONDITION_READY: Final = "Ready"
"""True while a sealed round is current and complete."""
CONDITION_CLOSED: Final = "Closed"
"""True once no further round will be formed."""

# Reasons a member leaves a round; they appear in Events and in `kubectl describe`.
LOST_POD_DELETED: Final = "PodDeleted"
LOST_POD_TERMINATING: Final = "PodTerminating"
LOST_POD_FAILED: Final = "PodFailed"
LOST_POD_SUCCEEDED: Final = "PodSucceeded"
LOST_POD_NOT_FOUND: Final = "PodNotFound"
LOST_CONTAINER_RESTARTED: Final = "ContainerRestarted"
LOST_AGENT_RESTARTED: Final = "AgentRestarted"
LOST_LEFT: Final = "Left"
LOST_ENTRY_REMOVED: Final = "EntryRemoved"
LOST_HEARTBEAT_EXPIRED: Final = "HeartbeatExpired"

CLOSED_BY_NODE: Final = "ClosedByNode"
CLOSED_ALL_LEFT: Final = "AllNodesLeft"
CLOSED_NODE_FINISHED: Final = "NodeFinished"
CLOSED_JOB_COMPLETE: Final = "JobComplete"
CLOSED_JOB_FAILED: Final = "JobFailed"


@dataclasses.dataclass(frozen=True)
class PodObservation:
    """What Kubernetes says about the pod behind a node entry."""

    gone_reason: str | None = None
    """``None`` while the pod lives; else why it is gone (one of the ``LOST_POD_*``)."""
    restarts: int = 0
    """Sum of its containers' restart counts."""
    topology: str | None = None
    """The value of the spec's ``rankOrder.nodeLabel`` on the pod's node, if any."""
    identity: PodIdentity | None = None
    """Who the pod is and where it can be reached (``None``: never observed)."""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """The latest renewal of a node's Lease, timed by the operator's own clock when it saw
    it (so a node's clock can never make it look alive or dead)."""

    instance: str
    seen_at: datetime.datetime


@dataclasses.dataclass(frozen=True)
class Liveness:
    """Heartbeats as the operator has observed them."""

    heartbeats: Mapping[str, Heartbeat]
    since: datetime.datetime
    """When observation began (the operator's start): nobody expires for lack of
    renewals the operator could not have seen."""

    def expires_at(
        self, member: Member, sealed_at: datetime.datetime | None, timeout: datetime.timedelta
    ) -> datetime.datetime:
        last = max(self.since, sealed_at or self.since)
        beat = self.heartbeats.get(member.node)
        if beat is not None and beat.instance == member.instance:
            last = max(last, beat.seen_at)
        return last + timeout


@dataclasses.dataclass(frozen=True)
class MemberLoss:
    node: str
    rank: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Decision:
    status: RendezvousStatus
    sealed: bool = False
    """A round was sealed by this decision."""
    closed: bool = False
    """The rendezvous was closed by this decision."""
    losses: tuple[MemberLoss, ...] = ()
    """Members lost, reported when the sealed round goes stale."""
    wake_at: datetime.datetime | None = None
    """Decide again at this time even if nothing changes (last call, heartbeat expiry)."""
    forming_seconds: float | None = None
    """For a sealed round: from the first join request the operator saw to the seal."""


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """``pod-2`` before ``pod-10``: digits compare as numbers."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def _loss_reason(
    member: Member,
    entry: NodeEntry | None,
    pod: PodObservation | None,
    expires_at: datetime.datetime | None,
    now: datetime.datetime,
) -> str | None:
    if entry is None:
        return LOST_ENTRY_REMOVED
    if pod is not None and pod.gone_reason is not None:
        return pod.gone_reason
    if pod is not None and pod.restarts > member.pod_restarts:
        return LOST_CONTAINER_RESTARTED
    if entry.instance != member.instance:
        return LOST_AGENT_RESTARTED
    if entry.intent is NodeIntent.LEAVE:
        return LOST_LEFT
    if expires_at is not None and now >= expires_at and member.admits(entry):
        return LOST_HEARTBEAT_EXPIRED
    return None


def _finished_member(
    status: RendezvousStatus,
    requests: Mapping[str, NodeEntry],
    pods: Mapping[str, PodObservation],
) -> str | None:
    """The first member of the round whose agent (this member's instance) said its
    workers succeeded, or whose pod did."""
    for member in status.members:
        entry = requests.get(member.node)
        pod = pods.get(member.node)
        if (
            entry is not None
            and entry.intent is NodeIntent.FINISH
            and entry.instance == member.instance
        ) or (pod is not None and pod.gone_reason == LOST_POD_SUCCEEDED):
            return member.node
    return None


def _joiners(
    status: RendezvousStatus,
    requests: Mapping[str, NodeEntry],
    pods: Mapping[str, PodObservation],
) -> list[str]:
    """Nodes asking to be admitted to a round they are not already in."""
    admitted = {(m.node, m.instance, m.attempt) for m in (*status.members, *status.left_behind)}
    waiting = []
    for name, entry in requests.items():
        pod = pods.get(name)
        if entry.intent is not NodeIntent.JOIN or (pod is not None and pod.gone_reason):
            continue
        if (name, entry.instance, entry.attempt) in admitted:
            continue  # still running the round it was admitted to, not asking for another
        waiting.append(name)
    return waiting


def _ordered(
    candidates: Sequence[str], previous: Sequence[Member], pods: Mapping[str, PodObservation]
) -> list[str]:
    """Previous members first, in their old rank order; newcomers after, grouped by their
    node's topology value (when a rank order is set), then in natural order of name."""
    old_rank = {member.node: rank for rank, member in enumerate(previous)}
    known = sorted((name for name in candidates if name in old_rank), key=old_rank.__getitem__)

    def newcomer_key(name: str) -> tuple[bool, str, tuple[tuple[int, int | str], ...]]:
        topology = pods[name].topology if name in pods else None
        return topology is None, topology or "", natural_key(name)

    new = sorted((name for name in candidates if name not in old_rank), key=newcomer_key)
    return known + new


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int,
) -> tuple[Condition, ...]:
    """Replace the condition of ``type_``; keep its transition time unless status flips."""
    value = "True" if status else "False"
    previous = next((c for c in conditions if c.type == type_), None)
    since = previous.last_transition_time if previous and previous.status == value else now
    updated = Condition(type_, value, reason, message, since, generation)
    return (*(c for c in conditions if c.type != type_), updated)


def _with_conditions(
    status: RendezvousStatus, now: datetime.datetime, generation: int
) -> RendezvousStatus:
    conditions = status.conditions
    if status.state is RoundState.CLOSED:
        conditions = set_condition(
            conditions,
            CONDITION_CLOSED,
            True,
            status.closed_reason or "Closed",
            status.closed_message or "",
            now,
            generation,
        )
        conditions = set_condition(
            conditions,
            CONDITION_READY,
            False,
            "Closed",
            "the rendezvous is closed",
            now,
            generation,
        )
    else:
        conditions = set_condition(
            conditions,
            CONDITION_CLOSED,
            False,
            "Open",
            "rounds can still be formed",
            now,
            generation,
        )
        if status.state is RoundState.SEALED:
            master = status.master.endpoint if status.master else "none"
            message = f"round {status.round}: {status.world_size} nodes, master {master}"
            conditions = set_condition(
                conditions, CONDITION_READY, True, reasons.ROUND_SEALED, message, now, generation
            )
        else:
            message = f"forming round {status.round + 1}"
            conditions = set_condition(
                conditions, CONDITION_READY, False, status.state.value, message, now, generation
            )
    return dataclasses.replace(status, conditions=conditions, observed_generation=generation)


def _closed(status: RendezvousStatus, reason: str, message: str) -> RendezvousStatus:
    return dataclasses.replace(
        status,
        state=RoundState.CLOSED,
        closed_reason=reason,
        closed_message=message,
        nodes_waiting=0,
        forming_since=None,
        last_call_deadline=None,
    )


def slices_problem(spec: RendezvousSpec, status: RendezvousStatus) -> str | None:
    """Why ``status.slices`` is more than the rendezvous can need (an edit by hand), else
    ``None``. Each slice is an object written every round: never more of them than its
    nodes fill (``maxNodes``, or the members it has if ``maxNodes`` was lowered since)."""
    nodes = max(spec.max_nodes, len(status.members) + len(status.left_behind))
    needed = slices_needed(nodes)
    if status.slices <= needed:
        return None
    return (
        f"status.slices: {status.slices} is more than the {needed} that {nodes} nodes need "
        f"(one per {SLICE_MEMBERS}, none up to {SLICE_MEMBERS}); set it to {needed}"
    )


def decide(
    spec: RendezvousSpec,
    status: RendezvousStatus,
    requests: Mapping[str, NodeEntry],
    pods: Mapping[str, PodObservation],
    now: datetime.datetime,
    *,
    liveness: Liveness | None = None,
    expected_nodes: int | None = None,
    close: tuple[str, str] | None = None,
    generation: int = 0,
) -> Decision:
    """Decide the next status of a rendezvous.

    Args:
        spec: The rendezvous' spec.
        status: The stored status.
        requests: Each node's request (its Lease's entry), by pod name.
        pods: What Kubernetes says about the pods of the requests; a request whose pod is
            absent from the mapping is taken to be alive (not yet observed).
        now: The operator's clock. Deadlines are the operator's alone, so clock skew between
            nodes cannot change a decision.
        liveness: Observed heartbeats; members are not checked for expiry without it.
        expected_nodes: How many nodes the workload runs (a Job's parallelism): the first
            round seals as soon as that many (at most maxNodes) joined, without a last call.
        close: ``(reason, message)`` to close with, when the workload has finished.
        generation: ``metadata.generation``, recorded as observed.

    Returns:
        The new status (unchanged fields included) and what happened.
    """
    if status.state is RoundState.CLOSED:
        return Decision(_with_conditions(status, now, generation))

    if close is not None:
        closed = _closed(status, *close)
        return Decision(_with_conditions(closed, now, generation), closed=True)

    closer = next((n for n, e in sorted(requests.items()) if e.intent is NodeIntent.CLOSE), None)
    if closer is not None:
        closed = _closed(status, CLOSED_BY_NODE, f"pod {closer} called set_closed()")
        return Decision(_with_conditions(closed, now, generation), closed=True)

    finisher = _finished_member(status, requests, pods)
    if finisher is not None:
        closed = _closed(
            status,
            CLOSED_NODE_FINISHED,
            f"pod {finisher} of round {status.round} finished (its workers succeeded): no "
            "further round forms, and the other members finish their work",
        )
        return Decision(_with_conditions(closed, now, generation), closed=True)

    status = dataclasses.replace(
        status,
        left_behind=tuple(
            m
            for m in status.left_behind
            if (entry := requests.get(m.node)) is not None
            and m.admits(entry)
            and not (pods.get(m.node) or PodObservation()).gone_reason
        ),
    )
    timeout = datetime.timedelta(seconds=spec.heartbeat_timeout_seconds)
    expiries = {
        member.node: liveness.expires_at(member, status.sealed_at, timeout)
        for member in status.members
        if liveness is not None
    }
    losses = tuple(
        MemberLoss(member.node, rank, reason)
        for rank, member in enumerate(status.members)
        if (
            reason := _loss_reason(
                member,
                requests.get(member.node),
                pods.get(member.node),
                expiries.get(member.node),
                now,
            )
        )
    )
    lost_nodes = {loss.node for loss in losses}
    next_expiry = min(
        (moment for node, moment in expiries.items() if node not in lost_nodes), default=None
    )
    joiners = _joiners(status, requests, pods)

    if (
        status.members
        and not joiners
        and all(
            (entry := requests.get(m.node)) is not None and entry.intent is NodeIntent.LEAVE
            for m in status.members
        )
    ):
        message = f"every node of round {status.round} left and none is waiting"
        closed = _closed(status, CLOSED_ALL_LEFT, message)
        return Decision(_with_conditions(closed, now, generation), closed=True, losses=losses)

    reported_losses: tuple[MemberLoss, ...] = ()
    if status.state is RoundState.SEALED:
        newcomers = [name for name in joiners if name not in {m.node for m in status.members}]
        rejoined = len(joiners) > len(newcomers)
        fits = status.world_size < spec.max_nodes
        out_of_spec = not spec.min_nodes <= status.world_size <= spec.max_nodes
        if not (losses or rejoined or (newcomers and fits) or out_of_spec):
            kept = dataclasses.replace(status, nodes_waiting=0)
            return Decision(_with_conditions(kept, now, generation), wake_at=next_expiry)
        # Counted once, when the round goes stale: recounting every join while the next
        # round forms would cost a status write per join and tell running agents nothing
        # new (any positive number makes them re-rendezvous).
        status = dataclasses.replace(
            status,
            state=RoundState.REFORMING,
            forming_since=now,
            nodes_waiting=max(1, len(joiners) + len(losses)),
        )
        reported_losses = losses

    decision = _form(
        spec,
        status,
        requests,
        pods,
        joiners,
        losses,
        reported_losses,
        now,
        generation,
        expected_nodes,
    )
    if decision.sealed and liveness is not None:
        sealed = decision.status
        next_expiry = min(
            liveness.expires_at(member, sealed.sealed_at, timeout) for member in sealed.members
        )
        return dataclasses.replace(decision, wake_at=next_expiry)
    if next_expiry is None:
        return decision
    wake_at = min(next_expiry, decision.wake_at or next_expiry)
    return dataclasses.replace(decision, wake_at=wake_at)


def _form(
    spec: RendezvousSpec,
    status: RendezvousStatus,
    requests: Mapping[str, NodeEntry],
    pods: Mapping[str, PodObservation],
    joiners: list[str],
    losses: tuple[MemberLoss, ...],
    reported_losses: tuple[MemberLoss, ...],
    now: datetime.datetime,
    generation: int,
    expected_nodes: int | None,
) -> Decision:
    lost_nodes = {loss.node for loss in losses}
    pending = [m for m in status.members if m.node not in lost_nodes and m.node not in joiners]
    # A lost member's join request was spent on the round it is lost from. Its Lease may
    # still hold it (a hung agent, a restarted container): unless its agent asks again (a
    # new attempt), it must not count as waiting, or the next round would go stale at once
    # and seal with a node that is not there.
    spent = [
        m
        for m in status.members
        if m.node in lost_nodes
        and (entry := requests.get(m.node)) is not None
        and entry.intent is NodeIntent.JOIN
        and m.admits(entry)
        and not (pods.get(m.node) or PodObservation()).gone_reason  # as the filter in decide()
    ]
    deadline = status.last_call_deadline
    forming_since = status.forming_since or (now if joiners else None)
    enough = len(joiners) >= spec.min_nodes
    if not enough:
        deadline = None
    elif deadline is None:
        deadline = now + datetime.timedelta(seconds=spec.last_call_timeout_seconds)

    if status.round > 0:
        everyone_here = not pending
    else:
        everyone_here = expected_nodes is not None and len(joiners) >= min(
            expected_nodes, spec.max_nodes
        )
    if deadline is not None and (
        len(joiners) >= spec.max_nodes or everyone_here or now >= deadline
    ):
        selected = _ordered(joiners, status.members, pods)[: spec.max_nodes]
        members = tuple(
            Member(
                node=name,
                instance=requests[name].instance,
                attempt=requests[name].attempt,
                addr=requests[name].addr,
                pod_restarts=pods[name].restarts if name in pods else 0,
            )
            for name in selected
        )
        rank0 = requests[selected[0]]
        sealed = dataclasses.replace(
            status,
            state=RoundState.SEALED,
            round=status.round + 1,
            members=members,
            master=Master(rank0.addr, rank0.store_port),
            nodes_waiting=0,
            forming_since=None,
            last_call_deadline=None,
            sealed_at=now,
            left_behind=(*status.left_behind, *pending, *spent),
        )
        return Decision(
            _with_conditions(sealed, now, generation),
            sealed=True,
            losses=reported_losses,
            forming_seconds=(now - (forming_since or now)).total_seconds(),
        )

    forming = dataclasses.replace(
        status,
        nodes_waiting=status.nodes_waiting if status.state is RoundState.REFORMING else 0,
        forming_since=forming_since,
        last_call_deadline=deadline,
    )
    return Decision(
        _with_conditions(forming, now, generation), losses=reported_losses, wake_at=deadline
    )
