"""The join step: what a node waiting to join does next, decided from the round as its
watch shows it and from the node's own join request. No I/O, no clock, no torch.

As torch's ``_RendezvousJoinOp`` is to its executor, :func:`decide` is to the join loop
(:class:`k8s_rendezvous.join_loop.JoinLoop`), which loops sync -> decide -> apply: it
waits on the watched status (sync), asks :func:`decide` (decide), and serves or reaches
the round's store, writes a new request, or raises (apply). The rules, in order:

1. The rendezvous is closed: :class:`Closed`, whatever else the status says; but a node
   that waited as a spare (:func:`is_spare`) is :class:`Released` by a closure not in
   failure, as torch's c10d ends a node of its redundancy list: gracefully, so that its
   pod does not fail.
   Then, the operator refused the request (the pod is not of the workload, its address not
   the pod's...): :class:`Refused`, with the operator's reason; no round can include it.
2. The request holds a rank in the round shown: :class:`Admitted`, to that rank, even in a
   round gone stale since (seen late, e.g. after the watch lost track): rank 0 serves its
   store, a member gives up on a rank 0 that does not answer while the round is stale
   (:func:`is_stale`) and asks again, and the agents re-rendezvous once they see it.
   (A status edited by hand to list the request without a master: :class:`Rejoin`.)
3. The request was admitted to a round this node never saw (its watch lost track, e.g.
   across an API server restart) and a later round sealed without it: the operator has
   spent it, so :class:`Rejoin` with a new one rather than wait out the join timeout.
4. Anything else: :class:`Wait` for the next status.

The join timeout and a Rendezvous deleted under the node are the waiting's to judge: the
first is the absence of a status by a deadline, the second a change of the object's uid,
neither of which a status shows. The deadline does not run while :func:`is_spare` says
the node waits as a spare, and starts afresh when it stops being one, as torch's c10d
treats its redundancy list.

:func:`nodes_waiting` (what ``num_nodes_waiting()`` answers) and :func:`is_stale` judge a
joined round by the same watched status. :func:`check_pod` judges what a node that waits
unadmitted learns of the pod it names: the operator admits only pods, so a node that is
another pod, or none, ends rather than wait out its join timeout.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeAlias

from k8s_rendezvous.wire import leases, records, statuses, views


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The request is a member of the round: this node's rank, the world and where the
    round's store is (rank 0's)."""

    round: int
    rank: int
    world_size: int
    master: records.Master


@dataclasses.dataclass(frozen=True)
class Closed:
    """No further round forms: the operator's reason and message for closing."""

    reason: str | None
    message: str | None

    @property
    def in_failure(self) -> bool:
        """The job failed (its restart budget spent): a spare ends in failure too."""
        return self.reason == statuses.CLOSED_RESTARTS_EXHAUSTED


@dataclasses.dataclass(frozen=True)
class Released:
    """No further round forms, and this node waited as a spare: it ends gracefully (the
    operator's reason and message for closing)."""

    reason: str | None
    message: str | None


@dataclasses.dataclass(frozen=True)
class Refused:
    """The operator does not count the request: its reason and message."""

    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Rejoin:
    """The request is spent without a round to show for it: ask again (a new attempt)."""

    reason: str
    """Why, for the log (\"... joining again\")."""


@dataclasses.dataclass(frozen=True)
class Wait:
    """Nothing to do yet: wait for the next status."""


Decision: TypeAlias = Admitted | Closed | Released | Refused | Rejoin | Wait


def decide(view: views.NodeView, request: leases.NodeEntry, *, spare: bool = False) -> Decision:
    """The join step for ``request`` (this node's join request) given ``view`` (the
    status as this node reads it), ``spare`` telling whether the node waited as a spare
    before ``view``: the rules of this module's docstring, in order."""
    if view.state is statuses.RoundState.CLOSED:
        closed = Closed(view.closed_reason, view.closed_message)
        if spare and not closed.in_failure:
            return Released(closed.reason, closed.message)
        return closed
    if (refusal := view.refusal_of(request)) is not None:
        return Refused(refusal.reason, refusal.message)
    rank = view.rank_of(request)
    if rank is not None:
        if view.master is None:  # a status edited by hand: a member list without a master
            return Rejoin(f"round {view.round} admitted it but names no master")
        return Admitted(view.round, rank, view.world_size, view.master)
    if view.left_behind_with(request):
        return Rejoin(
            f"it was admitted to a round it never saw, and round {view.round} sealed without it"
        )
    return Wait()


def is_spare(view: views.NodeView, request: leases.NodeEntry, max_nodes: int) -> bool:
    """Whether ``request`` waits as a spare in ``view``: the round is sealed full
    (``max_nodes`` members) without it, so it cannot be admitted until a member is lost or
    the round goes stale. torch's c10d keeps such a node in its redundancy list, with no
    join deadline while it is there."""
    return (
        view.state is statuses.RoundState.SEALED
        and view.world_size >= max_nodes
        and view.rank_of(request) is None
    )


def is_decided(view: views.NodeView, request: leases.NodeEntry) -> bool:
    """Whether :func:`decide` has more to say for ``view`` than :class:`Wait`."""
    return not isinstance(decide(view, request), Wait)


@dataclasses.dataclass(frozen=True)
class Joined:
    """A round this node joined, as the join step admitted it."""

    status: views.NodeView
    """The round as this node saw it sealed."""
    rank: int
    uid: str
    """Of the Rendezvous the round belongs to: one made anew under the same name has
    rounds of its own."""

    @property
    def round(self) -> int:
        return self.status.round


def is_stale(view: views.NodeView | None, round_number: int) -> bool:
    """Whether round ``round_number`` is no longer the sealed round ``view`` shows (the
    operator learnt a member is gone, or nodes wait to join): its store may never answer.
    No status seen yet judges nothing."""
    return view is not None and not (
        view.round == round_number and view.state is statuses.RoundState.SEALED
    )


def nodes_waiting(view: views.NodeView, joined: Joined | None, uid: str | None) -> int:
    """What ``num_nodes_waiting()`` answers for ``view`` after joining ``joined`` (``None``:
    never), while the Rendezvous held has ``uid`` (``None``: deleted, none made anew).

    torch's agent restarts its workers and re-rendezvouses when this is positive: so it is
    at least 1 whenever the node's round is over (a later round, a stale one, a Rendezvous
    made anew), and 0 when there is nothing to re-rendezvous into (never joined, deleted,
    closed: the members train on). A rendezvous closed because a failure found the job's
    restart budget spent says how many to the members, so that each restarts into the
    closure (``RendezvousClosedError``) rather than wait on a peer that failed."""
    if joined is None or uid is None:
        return 0
    if view.state is statuses.RoundState.CLOSED:
        return view.nodes_waiting
    if (
        uid == joined.uid
        and view.round == joined.round
        and view.state is statuses.RoundState.SEALED
    ):
        return view.nodes_waiting
    return max(1, view.nodes_waiting)


class PodCheck(enum.Enum):
    """What a node learns of whether it is the pod it names (:func:`check_pod`)."""

    IS_THE_POD = enum.auto()
    """Its token is bound to that very pod, or a Pod of its name exists."""
    ANOTHER_POD = enum.auto()
    """Its token is bound to another pod: the join ends."""
    NO_SUCH_POD = enum.auto()
    """No Pod of its name exists: the join ends."""
    CANNOT_TELL = enum.auto()
    """Its token is no pod's and may not read pods: it waits on, and says so."""


def check_pod(node: str, token_pod: str | None, pod_exists: bool | None) -> PodCheck:
    """Whether ``node`` is the pod it names, from the pod its token is bound to
    (``token_pod``; ``None``: no pod's) and, for a token of no pod, whether a Pod ``node``
    exists (``pod_exists``; ``None``: the token may not read pods)."""
    if token_pod is not None:
        return PodCheck.IS_THE_POD if token_pod == node else PodCheck.ANOTHER_POD
    if pod_exists is None:
        return PodCheck.CANNOT_TELL
    return PodCheck.IS_THE_POD if pod_exists else PodCheck.NO_SUCH_POD
