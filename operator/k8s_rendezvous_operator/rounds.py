"""Round decisions: a pure function of the stored status, what Kubernetes says about the
pods, and the operator's clock. No I/O here; :mod:`.reconciler` gathers, writes and reports.

:func:`decide` builds one frozen :class:`Context` and applies the rules below in order; the
first rule that settles the round ends the pass, and :func:`_decided` is the one exit that
sets the conditions. Each numbered rule is the function named with it:

1. :func:`closed_stays_closed`: a closed rendezvous stays closed.
2. :func:`closes_when_work_ends`: the workload finishing (its Job complete or failed) closes
   it; so does a node asking to close (``set_closed()``), and a member of the round
   finishing (its agent's workers succeeded, or its pod did): the round's work is ending,
   and a new round would lack that member's part, so the others finish theirs undisturbed
   (torch's c10d closes at any agent's shutdown alike).
3. :func:`forgets_spent_left_behind`: a node left behind by a round is remembered only
   while it still holds the request that round spent (rule 8).
4. :func:`closes_when_everyone_left`: every member of the last round having left (a
   failed agent's ``shutdown()``) with nobody waiting closes it.
5. :func:`goes_stale_on_change`: a sealed round goes stale (``Reforming``) as soon as a
   member is lost (pod deleted or failed, agent restarted, left, its agent silent to the
   operator's probes for the probe window or to its Lease for ``heartbeatTimeoutSeconds``)
   or re-joins, or a node waits that fits under ``maxNodes``. Running agents see
   ``nodesWaiting > 0`` and re-rendezvous at once. The status says why (``formingCause``).
   A change caused by a failure (:func:`spends_restart`) spends one of ``maxRestarts``,
   the job's restart budget; with none left the rendezvous closes instead
   (``RestartsExhausted``), and ``nodesWaiting`` stays positive so that every running agent
   re-rendezvouses into the closure rather than wait on a peer that failed.
6. :func:`seals_when_complete`: a round forming seals when at least ``minNodes`` join and
   either ``maxNodes`` joined, every node we know of has joined (after a stale round: all
   survivors are back; for a first round: the workload's expected nodes), or the last call
   (``lastCallTimeoutSeconds`` after ``minNodes`` were reached) has passed. The round goes
   into ``history`` with its cause and how long forming it took, and names in ``leaving``
   the members it dropped whose pods are being deleted (a planned removal): their workers
   finish the step in flight, so the nodes re-forming in place let them leave rather than
   cut them off.
7. :func:`keeps_forming`: otherwise the round keeps forming, with its last call set while
   ``minNodes`` have joined.

And what those rules rely on:

8. :func:`spent_request`: a join request admitted to a round is spent: a member lost from
   it (or left behind by the next round) counts as waiting again only once its agent asks
   anew.
9. :func:`rank_order`: ranks are stable, so that sharded state stays put: survivors
   keep their ranks and a newcomer takes a lost member's rank (the lowest free first),
   then ranks after the last. A rank left free with no newcomer for it is taken by the
   last survivor, so one node moves per hole; so is rank 0 when its node is lost (rank 0
   is always a node that was there before while one is: in-place re-forming shares its
   state from rank 0). Newcomers come in natural order of name, grouped by topology if
   asked; a member's ``replaces`` names who held its rank before, when that changed.
10. :func:`needs_write`: ``formingSince`` is never written on its own: a join that changes
    nothing else costs no status write. The reconciler remembers it between passes and
    hands it back (``decide(forming_since=...)``). The first write is always made: it
    fixes how many slices publish the rounds, for good.
11. :func:`awaiting_observation`: a round is never sealed with a pod not yet observed: the
    decision names those pods, and the reconciler looks before it writes (looking is how a
    restarted operator learns that the pod behind an old request is gone).
12. :func:`waiter_expired`: a node asking to join whose Lease was not renewed within
    ``heartbeatTimeoutSeconds`` (its agent died while its pod runs on: a wrapper shell, a
    sidecar, a stopped process) is not a joiner: never counted, never sealed, and named
    once by the decision. torch's c10d drops such a node after its keep-alive window; a
    round sealed with it would hang every agent of the round in torch's rank assignment.
    Nor is a waiter whose agent answers none of the operator's probes (a spare on a
    Kubernetes node cut off with a member it would replace), until it answers again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from k8s_rendezvous.wire.leases import NodeEntry, NodeIntent
from k8s_rendezvous.wire.objects import SLICE_MEMBERS, slice_count, slices_needed
from k8s_rendezvous.wire.records import (
    MAX_REFUSAL_MESSAGE,
    Condition,
    ExcludedNode,
    Master,
    Member,
    Refusal,
    RoundRecord,
)
from k8s_rendezvous.wire.specs import RendezvousSpec
from k8s_rendezvous.wire.statuses import (
    EXCLUDED_NODE_TTL,
    MAX_EXCLUDED_NODES,
    MAX_HISTORY,
    RendezvousStatus,
    RoundState,
)
from k8s_rendezvous_operator import reasons
from k8s_rendezvous_operator.membership import PodIdentity

CONDITION_READY: Final = "Ready"
"""True while a sealed round is current and complete."""
CONDITION_CLOSED: Final = "Closed"
"""True once no further round will be formed."""
CONDITION_SPARES_READY: Final = "SparesReady"
"""Set while ``spec.spares`` is: whether as many spares wait as the workload declared, as
counted at the latest seal and while that round stays current; removed once closed."""

CLOSED_IN_FAILURE: Final = frozenset({reasons.CLOSED_JOB_FAILED, reasons.CLOSED_RESTARTS_EXHAUSTED})
"""Closures that end the job in failure: their Events are Warnings."""

FAILURES: Final = frozenset(
    {
        reasons.LOST_POD_FAILED,
        reasons.LOST_CONTAINER_RESTARTED,
        reasons.LOST_AGENT_RESTARTED,
        reasons.LOST_LEFT,
        reasons.LOST_HEARTBEAT_EXPIRED,
        reasons.LOST_UNREACHABLE,
        reasons.LOST_HEALTH_CHECK_FAILED,
        reasons.CAUSE_MEMBER_REJOINED,
    }
)
"""Causes of a re-form that spend the restart budget: something failed. A pod deleted or
evicted (a drain, a preemption, a scale-down), nodes joining and a spec change are planned,
and spend nothing; so is an entry removed by hand. A member rejoining a sealed round is its
agent restarting failed workers, as torch's agent counts it against ``--max-restarts``."""

KEEPS_NODE_OUT: Final = frozenset(
    {
        reasons.LOST_POD_FAILED,
        reasons.LOST_CONTAINER_RESTARTED,
        reasons.LOST_HEARTBEAT_EXPIRED,
        reasons.LOST_UNREACHABLE,
        reasons.LOST_HEALTH_CHECK_FAILED,
    }
)
"""Losses that say the member's Kubernetes node may be bad, so the workload's next pods
are kept off it (``status.excludedNodes``): the one place a reason is classified so. A
planned removal (deleted, evicted, left, entry removed) says nothing about the machine,
and neither does an agent restarting inside a running container."""


@dataclasses.dataclass(frozen=True)
class PodObservation:
    """What Kubernetes says about the pod behind a node entry."""

    gone_reason: str | None = None
    """``None`` while the pod lives; else why it is gone (one of the ``reasons.LOST_POD_*``)."""
    restarts: int = 0
    """Sum of its containers' restart counts."""
    topology: str | None = None
    """The value of the spec's ``rankOrder.nodeLabel`` on the pod's node, if any."""
    identity: PodIdentity | None = None
    """Who the pod is and where it can be reached (``None``: never observed)."""
    kube_node: str | None = None
    """The Kubernetes node the pod was scheduled to (its ``spec.nodeName``), never what
    the pod says."""


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
    unreachable: frozenset[tuple[str, str]] = frozenset()
    """The (node, agent instance) pairs that answered none of the operator's probes for
    its probe window (:mod:`.reachability`)."""

    def expires_at(
        self,
        node: str,
        instance: str,
        timeout: datetime.timedelta,
        *,
        sealed_at: datetime.datetime | None = None,
    ) -> datetime.datetime:
        """When ``node``'s agent ``instance`` (a member of a round sealed at
        ``sealed_at``, or a waiter) is taken for dead without a renewal of its Lease."""
        last = max(self.since, sealed_at or self.since)
        beat = self.heartbeats.get(node)
        if beat is not None and beat.instance == instance:
            last = max(last, beat.seen_at)
        return last + timeout


@dataclasses.dataclass(frozen=True)
class MemberLoss:
    node: str
    rank: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How a rule settled the round: the status it leads to, and what happened."""

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
    expired_waiters: tuple[str, ...] = ()
    """Nodes asking to join that are not counted, their Leases not renewed in time (rule
    12); the reconciler reports each request once."""


@dataclasses.dataclass(frozen=True)
class Decision(Verdict):
    """A :class:`Verdict` with its conditions set (by :func:`_decided`, the one exit), and
    what the reconciler is to write and await."""

    write: bool = False
    """Whether ``status`` must be written (rule 10, :func:`needs_write`)."""
    awaiting: tuple[str, ...] = ()
    """Members of the round sealed here whose pods are not observed yet (rule 11,
    :func:`awaiting_observation`): look at them before writing, then decide again."""
    previous: RendezvousStatus | None = None
    """The status decided on: as stored, with the remembered ``formingSince`` back."""


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything one pass of the rules looks at, fixed for the pass. The derived views
    (losses, joiners, expiries) are computed once, on first use."""

    spec: RendezvousSpec
    stored: RendezvousStatus
    """The status as stored, with the remembered ``formingSince`` (rule 10) put back."""
    requests: Mapping[str, NodeEntry]
    pods: Mapping[str, PodObservation]
    now: datetime.datetime
    liveness: Liveness | None
    expected_nodes: int | None
    close: tuple[str, str] | None
    generation: int
    first_write: bool

    def pod(self, node: str) -> PodObservation:
        """The node's pod as observed; a pod not observed yet is taken to be alive."""
        return self.pods.get(node) or PodObservation()

    @functools.cached_property
    def heartbeat_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.spec.heartbeat_timeout_seconds)

    @functools.cached_property
    def expiries(self) -> dict[str, datetime.datetime]:
        """When each member of the stored round expires without a heartbeat."""
        if self.liveness is None:
            return {}
        return {
            member.node: self.liveness.expires_at(
                member.node,
                member.instance,
                self.heartbeat_timeout,
                sealed_at=self.stored.sealed_at,
            )
            for member in self.stored.members
        }

    @functools.cached_property
    def losses(self) -> tuple[MemberLoss, ...]:
        """Members of the stored round that are gone, in rank order, with why."""
        return tuple(
            MemberLoss(member.node, rank, reason)
            for rank, member in enumerate(self.stored.members)
            if (reason := _loss_reason(self, member)) is not None
        )

    @functools.cached_property
    def lost_nodes(self) -> frozenset[str]:
        return frozenset(loss.node for loss in self.losses)

    @functools.cached_property
    def next_expiry(self) -> datetime.datetime | None:
        """The first heartbeat expiry of a member not lost already."""
        return min(
            (moment for node, moment in self.expiries.items() if node not in self.lost_nodes),
            default=None,
        )

    @functools.cached_property
    def waiters(self) -> list[str]:
        """Nodes asking to be admitted to a round they are not already in, alive or not."""
        return [
            name for name in waiting(self.stored, self.requests) if not self.pod(name).gone_reason
        ]

    @functools.cached_property
    def waiter_expiries(self) -> dict[str, datetime.datetime]:
        """When each waiter stops counting without a heartbeat (rule 12)."""
        if self.liveness is None:
            return {}
        return {
            name: self.liveness.expires_at(
                name, self.requests[name].instance, self.heartbeat_timeout
            )
            for name in self.waiters
        }

    @functools.cached_property
    def expired_waiters(self) -> tuple[str, ...]:
        return tuple(name for name in self.waiters if waiter_expired(self, name))

    @functools.cached_property
    def unreachable_waiters(self) -> frozenset[str]:
        """Waiters whose agents answer none of the operator's probes (rule 12)."""
        if self.liveness is None:
            return frozenset()
        unreachable = self.liveness.unreachable
        return frozenset(
            name for name in self.waiters if (name, self.requests[name].instance) in unreachable
        )

    @functools.cached_property
    def joiners(self) -> list[str]:
        """Waiters that count: their agents are alive and reachable."""
        out = set(self.expired_waiters) | self.unreachable_waiters
        return [name for name in self.waiters if name not in out]

    @functools.cached_property
    def next_waiter_expiry(self) -> datetime.datetime | None:
        return min(
            (moment for moment in self.waiter_expiries.values() if moment > self.now),
            default=None,
        )


Rule = Callable[[Context, RendezvousStatus], "RendezvousStatus | Verdict"]
"""A rule: given the pass and the status so far, either settle the round (a
:class:`Verdict`) or hand on the status, changed or not, to the next rule."""


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """``pod-2`` before ``pod-10``: digits compare as numbers."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def _loss_reason(ctx: Context, member: Member) -> str | None:
    entry = ctx.requests.get(member.node)
    pod = ctx.pods.get(member.node)
    expires_at = ctx.expiries.get(member.node)
    if entry is None:
        return reasons.LOST_ENTRY_REMOVED
    if pod is not None and pod.gone_reason is not None:
        return pod.gone_reason
    if pod is not None and pod.restarts > member.pod_restarts:
        return reasons.LOST_CONTAINER_RESTARTED
    if entry.instance != member.instance:
        return reasons.LOST_AGENT_RESTARTED
    if entry.intent is NodeIntent.LEAVE:
        return reasons.LOST_LEFT if entry.health_check is None else reasons.LOST_HEALTH_CHECK_FAILED
    if not member.admits(entry):
        return None
    if ctx.liveness is not None and (member.node, member.instance) in ctx.liveness.unreachable:
        return reasons.LOST_UNREACHABLE
    if expires_at is not None and ctx.now >= expires_at:
        return reasons.LOST_HEARTBEAT_EXPIRED
    return None


def _closed(status: RendezvousStatus, reason: str, message: str) -> Verdict:
    closed = dataclasses.replace(
        status,
        state=RoundState.CLOSED,
        closed_reason=reason,
        closed_message=message,
        nodes_waiting=0,
        spares=0,
        forming_cause=None,
        forming_cause_message=None,
        forming_since=None,
        last_call_deadline=None,
    )
    return Verdict(closed, closed=True)


# -- the rules, in order -----------------------------------------------------------------


def closed_stays_closed(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 1."""
    return Verdict(status) if status.state is RoundState.CLOSED else status


def closes_when_work_ends(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 2: the workload finished, a node asked to close, or a member finished."""
    if ctx.close is not None:
        return _closed(status, *ctx.close)
    closer = next(
        (name for name, entry in sorted(ctx.requests.items()) if entry.intent is NodeIntent.CLOSE),
        None,
    )
    if closer is not None:
        return _closed(status, reasons.CLOSED_BY_NODE, reasons.closed_by_node(closer))
    for member in status.members:
        entry = ctx.requests.get(member.node)
        if (
            entry is not None
            and entry.intent is NodeIntent.FINISH
            and entry.instance == member.instance  # this member's agent, not a later one
        ) or ctx.pod(member.node).gone_reason == reasons.LOST_POD_SUCCEEDED:
            return _closed(
                status,
                reasons.CLOSED_NODE_FINISHED,
                reasons.closed_node_finished(member.node, status.round),
            )
    return status


def forgets_spent_left_behind(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 3."""
    kept = tuple(member for member in status.left_behind if spent_request(ctx, member))
    return dataclasses.replace(status, left_behind=kept)


def closes_when_everyone_left(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 4."""
    if (
        status.members
        and not ctx.joiners
        and all(
            (entry := ctx.requests.get(member.node)) is not None
            and entry.intent is NodeIntent.LEAVE
            for member in status.members
        )
    ):
        closed = _closed(status, reasons.CLOSED_ALL_LEFT, reasons.closed_all_left(status.round))
        return dataclasses.replace(closed, losses=ctx.losses)
    return status


def goes_stale_on_change(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 5: a sealed round either stays (a Verdict) or goes stale and forms anew."""
    if status.state is not RoundState.SEALED:
        return status
    spec = ctx.spec
    members = {member.node for member in status.members}
    newcomers = [name for name in ctx.joiners if name not in members]
    rejoined = len(ctx.joiners) > len(newcomers)
    fits = status.world_size < spec.max_nodes
    out_of_spec = not spec.min_nodes <= status.world_size <= spec.max_nodes
    if not (ctx.losses or rejoined or (newcomers and fits) or out_of_spec):
        unchanged = dataclasses.replace(status, nodes_waiting=0, spares=len(newcomers))
        return Verdict(unchanged, wake_at=ctx.next_expiry)
    # Counted once, when the round goes stale: recounting every join while the next round
    # forms would cost a status write per join and tell running agents nothing new (any
    # positive number makes them re-rendezvous).
    if ctx.losses:
        lost = [(loss.node, loss.rank) for loss in ctx.losses]
        cause = ctx.losses[0].reason, reasons.cause_members_lost(lost, ctx.losses[0].reason)
    elif rejoined:
        pod = next(name for name in ctx.joiners if name in members)
        cause = reasons.CAUSE_MEMBER_REJOINED, reasons.cause_member_rejoined(pod)
    elif newcomers and fits:
        cause = reasons.CAUSE_NODES_JOINED, reasons.cause_nodes_joined(len(newcomers))
    else:
        cause = reasons.CAUSE_SPEC_CHANGED, reasons.cause_spec_changed(status.world_size, spec)
    waiting = max(1, len(ctx.joiners) + len(ctx.losses))
    restarts = status.restarts
    if spends_restart(ctx, cause[0]):
        if spec.max_restarts is not None and restarts >= spec.max_restarts:
            message = reasons.closed_restarts_exhausted(spec.max_restarts, status.round, cause[1])
            closed = _closed(status, reasons.CLOSED_RESTARTS_EXHAUSTED, message)
            return dataclasses.replace(
                closed,
                status=dataclasses.replace(closed.status, nodes_waiting=waiting),
                losses=ctx.losses,
            )
        restarts += 1
    status = dataclasses.replace(
        status, excluded_nodes=excluded_after(ctx.losses, ctx.pods, status.excluded_nodes, ctx.now)
    )
    return dataclasses.replace(
        status,
        state=RoundState.REFORMING,
        forming_since=ctx.now,
        nodes_waiting=waiting,
        spares=0,
        forming_cause=cause[0],
        forming_cause_message=cause[1],
        restarts=restarts,
    )


def excluded_after(
    losses: Sequence[MemberLoss],
    pods: Mapping[str, PodObservation],
    excluded: tuple[ExcludedNode, ...],
    now: datetime.datetime,
) -> tuple[ExcludedNode, ...]:
    """The Kubernetes nodes kept out once ``losses`` are counted: each node a member was
    lost from to a failure (:data:`KEEPS_NODE_OUT`) moves to the end with this failure,
    and the oldest go past :data:`MAX_EXCLUDED_NODES`. A loss whose pod was never seen
    scheduled names no node and keeps none out."""
    for loss in losses:
        pod = pods.get(loss.node)
        if loss.reason not in KEEPS_NODE_OUT or pod is None or not pod.kube_node:
            continue
        entry = ExcludedNode(pod.kube_node, loss.reason, loss.node, now)
        excluded = (*(e for e in excluded if e.node != pod.kube_node), entry)
    return excluded[-MAX_EXCLUDED_NODES:]


def still_excluded(
    excluded: tuple[ExcludedNode, ...],
    now: datetime.datetime,
    cleared_at: datetime.datetime | None,
) -> tuple[ExcludedNode, ...]:
    """The entries not yet expired (:data:`EXCLUDED_NODE_TTL`) nor cleared by the user
    (failed at or before ``cleared_at``, the Rendezvous' clear annotation)."""
    return tuple(
        entry
        for entry in excluded
        if now < entry.failed_at + EXCLUDED_NODE_TTL
        and (cleared_at is None or entry.failed_at > cleared_at)
    )


def spends_restart(ctx: Context, cause: str) -> bool:
    """Whether a sealed round going stale for ``cause`` spends the restart budget: any of
    its losses (not only the first, which names the cause) or the cause is a failure."""
    return cause in FAILURES or any(loss.reason in FAILURES for loss in ctx.losses)


def _last_call(ctx: Context, status: RendezvousStatus) -> datetime.datetime | None:
    """The last call's deadline: set when ``minNodes`` have joined, dropped below."""
    if len(ctx.joiners) < ctx.spec.min_nodes:
        return None
    return status.last_call_deadline or ctx.now + datetime.timedelta(
        seconds=ctx.spec.last_call_timeout_seconds
    )


def _reported_losses(ctx: Context) -> tuple[MemberLoss, ...]:
    """Losses are reported once: in the pass that makes the sealed round stale."""
    return ctx.losses if ctx.stored.state is RoundState.SEALED else ()


def seals_when_complete(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 6, the seal."""
    spec, joiners, now = ctx.spec, ctx.joiners, ctx.now
    deadline = _last_call(ctx, status)
    # Members of the last round that have not asked again (nor are lost): every node we
    # know of is here when there are none.
    here = ctx.lost_nodes.union(joiners)
    pending = [member for member in status.members if member.node not in here]
    if status.round > 0:
        everyone_here = not pending
    else:
        everyone_here = ctx.expected_nodes is not None and len(joiners) >= min(
            ctx.expected_nodes, spec.max_nodes
        )
    if deadline is None or not (len(joiners) >= spec.max_nodes or everyone_here or now >= deadline):
        return status
    selected = rank_order(ctx, joiners, status.members, spec.max_nodes)
    members = tuple(
        Member(
            node=name,
            instance=ctx.requests[name].instance,
            attempt=ctx.requests[name].attempt,
            addr=ctx.requests[name].addr,
            pod_restarts=ctx.pod(name).restarts,
            replaces=replaced(status.members, rank, name),
        )
        for rank, name in enumerate(selected)
    )
    # A lost member's join request was spent on the round it is lost from. Its Lease may
    # still hold it (a hung agent, a restarted container): unless its agent asks again (a
    # new attempt), it must not count as waiting, or the next round would go stale at once
    # and seal with a node that is not there.
    spent = [
        member
        for member in status.members
        if member.node in ctx.lost_nodes
        and spent_request(ctx, member)
        and ctx.requests[member.node].intent is NodeIntent.JOIN
    ]
    rank0 = ctx.requests[selected[0]]
    forming_seconds = (now - (status.forming_since or now)).total_seconds()
    record = RoundRecord(
        round=status.round + 1,
        cause=status.forming_cause or reasons.CAUSE_FIRST_ROUND,
        message=(status.forming_cause_message or "")[:MAX_REFUSAL_MESSAGE],
        world_size=len(members),
        sealed_at=now,
        forming_milliseconds=max(0, round(forming_seconds * 1000)),
    )
    sealed = dataclasses.replace(
        status,
        state=RoundState.SEALED,
        round=status.round + 1,
        members=members,
        master=Master(rank0.addr, rank0.store_port),
        nodes_waiting=0,
        spares=len(joiners) - len(selected),
        forming_since=None,
        last_call_deadline=None,
        sealed_at=now,
        left_behind=(*status.left_behind, *pending, *spent),
        forming_cause=None,
        forming_cause_message=None,
        history=(*status.history, record)[-MAX_HISTORY:],
        leaving=tuple(
            loss.node for loss in ctx.losses if loss.reason == reasons.LOST_POD_TERMINATING
        ),
    )
    wake_at = None
    if ctx.liveness is not None:
        wake_at = min(
            ctx.liveness.expires_at(
                member.node, member.instance, ctx.heartbeat_timeout, sealed_at=now
            )
            for member in members
        )
    return Verdict(
        sealed,
        sealed=True,
        losses=_reported_losses(ctx),
        wake_at=wake_at,
        forming_seconds=forming_seconds,
    )


def keeps_forming(ctx: Context, status: RendezvousStatus) -> RendezvousStatus | Verdict:
    """Rule 7: wake at the last call or the first heartbeat expiry, whichever is sooner."""
    deadline = _last_call(ctx, status)
    forming = dataclasses.replace(
        status,
        nodes_waiting=status.nodes_waiting if status.state is RoundState.REFORMING else 0,
        forming_since=status.forming_since or (ctx.now if ctx.joiners else None),
        last_call_deadline=deadline,
    )
    wake_at = min(
        (m for m in (deadline, ctx.next_expiry, ctx.next_waiter_expiry) if m is not None),
        default=None,
    )
    return Verdict(forming, losses=_reported_losses(ctx), wake_at=wake_at)


RULES: Final[tuple[Rule, ...]] = (
    closed_stays_closed,
    closes_when_work_ends,
    forgets_spent_left_behind,
    closes_when_everyone_left,
    goes_stale_on_change,
    seals_when_complete,
    keeps_forming,
)
"""Rules 1 to 7, in the order they are applied; :func:`keeps_forming` always settles."""


# -- what the rules rely on --------------------------------------------------------------


def spent_request(ctx: Context, member: Member) -> bool:
    """Rule 8: whether ``member``'s node still holds the very request its round admitted
    (and its pod lives): that request is spent, and does not make it wait again."""
    entry = ctx.requests.get(member.node)
    return entry is not None and member.admits(entry) and not ctx.pod(member.node).gone_reason


def rank_order(
    ctx: Context, candidates: Sequence[str], previous: Sequence[Member], capacity: int
) -> list[str]:
    """Rule 9: at most ``capacity`` of ``candidates`` (survivors first), in rank order."""
    old_rank = {member.node: rank for rank, member in enumerate(previous)}

    def newcomer_key(name: str) -> tuple[bool, str, tuple[tuple[int, int | str], ...]]:
        topology = ctx.pods[name].topology if name in ctx.pods else None
        return topology is None, topology or "", natural_key(name)

    survivors = sorted((name for name in candidates if name in old_rank), key=old_rank.__getitem__)
    newcomers = sorted((name for name in candidates if name not in old_rank), key=newcomer_key)
    survivors = survivors[:capacity]
    newcomers = newcomers[: capacity - len(survivors)]
    size = len(survivors) + len(newcomers)
    ranks: list[str | None] = [None] * size
    movers = [name for name in survivors if old_rank[name] >= size]
    for name in survivors:
        if old_rank[name] < size:
            ranks[old_rank[name]] = name
    if survivors and ranks[0] is None:
        last = survivors[-1]
        if last in movers:
            movers.remove(last)
        else:
            ranks[old_rank[last]] = None
        ranks[0] = last
    # Free ranks, lowest first: the newcomers, then the survivors beyond the new size.
    takers = iter([*newcomers, *movers])
    return [name if name is not None else next(takers) for name in ranks]


def replaced(previous: Sequence[Member], rank: int, node: str) -> str | None:
    """Rule 9: who held ``rank`` in the round before, if not ``node``."""
    if rank < len(previous) and previous[rank].node != node:
        return previous[rank].node
    return None


def waiting(status: RendezvousStatus, requests: Mapping[str, NodeEntry]) -> list[str]:
    """Nodes asking to be admitted to a round of ``status`` they are not already in."""
    admitted = {(m.node, m.instance, m.attempt) for m in (*status.members, *status.left_behind)}
    return [
        name
        for name, entry in requests.items()
        if entry.intent is NodeIntent.JOIN
        # still running the round it was admitted to, not asking for another
        and (name, entry.instance, entry.attempt) not in admitted
    ]


def waiter_expired(ctx: Context, name: str) -> bool:
    """Rule 12: whether the waiting node ``name`` has gone a heartbeat timeout without
    renewing its Lease (its join request counts as a renewal)."""
    expiry = ctx.waiter_expiries.get(name)
    return expiry is not None and ctx.now >= expiry


def needs_write(ctx: Context, decided: RendezvousStatus) -> bool:
    """Rule 10: whether ``decided`` differs from the stored status in more than
    ``formingSince`` (or nothing was written yet)."""

    def without_forming_since(status: RendezvousStatus) -> dict[str, object]:
        fields = status.operator_fields()
        del fields["formingSince"]
        return fields

    return ctx.first_write or without_forming_since(decided) != without_forming_since(ctx.stored)


def awaiting_observation(ctx: Context, verdict: Verdict) -> tuple[str, ...]:
    """Rule 11: the members of a round sealed here whose pods were never observed."""
    if not verdict.sealed:
        return ()
    return tuple(member.node for member in verdict.status.members if member.node not in ctx.pods)


# -- conditions and the one exit ---------------------------------------------------------


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
    spec: RendezvousSpec, status: RendezvousStatus, now: datetime.datetime, generation: int
) -> RendezvousStatus:
    def setting(
        conditions: tuple[Condition, ...], type_: str, value: bool, reason: str, message: str
    ) -> tuple[Condition, ...]:
        return set_condition(conditions, type_, value, reason, message, now, generation)

    conditions = tuple(status.conditions)
    if status.state is RoundState.CLOSED:
        conditions = setting(
            conditions,
            CONDITION_CLOSED,
            True,
            status.closed_reason or reasons.CLOSED,
            status.closed_message or "",
        )
        conditions = setting(
            conditions, CONDITION_READY, False, reasons.CLOSED, reasons.READY_CLOSED_MESSAGE
        )
    else:
        conditions = setting(
            conditions, CONDITION_CLOSED, False, reasons.OPEN, reasons.OPEN_MESSAGE
        )
        if status.state is RoundState.SEALED:
            master = status.master.endpoint if status.master else "none"
            conditions = setting(
                conditions,
                CONDITION_READY,
                True,
                reasons.ROUND_SEALED,
                reasons.ready_message(status.round, status.world_size, master),
            )
        else:
            conditions = setting(
                conditions,
                CONDITION_READY,
                False,
                status.state.value,
                reasons.forming_message(status.round + 1),
            )
    if spec.spares is None or status.state is RoundState.CLOSED:
        # Nothing declared, or nothing left to protect.
        conditions = tuple(c for c in conditions if c.type != CONDITION_SPARES_READY)
    elif status.state is RoundState.SEALED:
        # Spares are counted only while a sealed round stands (a forming round admits them).
        conditions = setting(
            conditions,
            CONDITION_SPARES_READY,
            status.spares >= spec.spares,
            reasons.SPARES_WAITING if status.spares >= spec.spares else reasons.SPARES_SHORT,
            reasons.spares_message(status.spares, spec.spares),
        )
    return dataclasses.replace(status, conditions=conditions, observed_generation=generation)


def _spares_ready(status: RendezvousStatus) -> Condition | None:
    return next((c for c in status.conditions if c.type == CONDITION_SPARES_READY), None)


def spares_short(status: RendezvousStatus) -> bool:
    """Whether fewer spares wait than the workload declared (``SparesReady`` is False)."""
    condition = _spares_ready(status)
    return condition is not None and condition.status == "False"


def spares_lost(previous: RendezvousStatus, status: RendezvousStatus) -> str | None:
    """The ``SparesReady`` message when the declared spares, all waiting before, no longer
    are: the protection they gave is lost. ``None`` otherwise; a shortfall from the start
    is said by the condition alone, as spares often join just after the first seal."""
    before, after = _spares_ready(previous), _spares_ready(status)
    if before is None or before.status != "True" or after is None or after.status != "False":
        return None
    return after.message


def _decided(ctx: Context, verdict: Verdict) -> Decision:
    """The one exit: conditions set, and what to write and await."""
    status = _with_conditions(ctx.spec, verdict.status, ctx.now, ctx.generation)
    return Decision(
        **{field.name: getattr(verdict, field.name) for field in dataclasses.fields(Verdict)}
        | {"status": status, "expired_waiters": ctx.expired_waiters},
        write=needs_write(ctx, status),
        awaiting=awaiting_observation(ctx, verdict),
        previous=ctx.stored,
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
    forming_since: datetime.datetime | None = None,
    first_write: bool = False,
    refused: tuple[Refusal, ...] = (),
    exclusions_cleared_at: datetime.datetime | None = None,
) -> Decision:
    """Decide the next status of a rendezvous: apply :data:`RULES` in order.

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
        forming_since: When the forming round began, as the last decision said, if that
            was not written (rule 10).
        first_write: Nothing was written to the status yet: the write is due, and it fixes
            the slice count (``status.slices``) for good, so a node's slice never moves.
        refused: The requests not counted, with why, for the refused nodes to read
            (``status.refused``).
        exclusions_cleared_at: The Rendezvous' clear annotation: the Kubernetes nodes
            that failed at or before it are no longer kept out.

    Returns:
        The new status (unchanged fields included), whether to write it, what to look at
        first, when to decide again, and what happened.
    """
    if first_write:
        status = dataclasses.replace(status, slices=slice_count(spec.max_nodes))
    if status.state is not RoundState.SEALED and status.forming_since is None:
        status = dataclasses.replace(status, forming_since=forming_since)
    ctx = Context(
        spec,
        status,
        requests,
        pods,
        now,
        liveness,
        expected_nodes,
        close,
        generation,
        first_write,
    )
    # After ctx, as both are compared with what is stored: a change is a write.
    status = dataclasses.replace(
        status,
        refused=refused,
        excluded_nodes=still_excluded(status.excluded_nodes, now, exclusions_cleared_at),
    )
    for rule in RULES:
        settled = rule(ctx, status)
        if isinstance(settled, Verdict):
            return _decided(ctx, settled)
        status = settled
    raise AssertionError("keeps_forming settles every round")  # pragma: no cover
