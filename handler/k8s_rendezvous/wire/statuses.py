"""``status``, written by the operator alone: the round, its members and history, what
the operator refused and keeps out, and the slices that publish it to the nodes."""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Iterable, Mapping
from typing import Any, Final

from k8s_rendezvous.wire import codec, leases, objects, records, tunables

SCHEMA_VERSION: Final = 1
"""Version of the status layout; bumped on any incompatible change."""
ROUND_KEY_FIELD: Final = "status.roundKey"
"""A selectable field: pods watch with ``status.roundKey!=<last seen>`` so that the API
server sends them only the changes that matter to them (a new round, a stale round, a
close), never another node's join."""
MAX_REFUSED: Final = 16
"""The most refused requests a status names (``status.refused``): enough for every pod of
a misconfigured workload to learn why at once in a small job, and in a large one for the
ones that read first; each refused pod also has its Warning. Bounded, as any pod of the
namespace may write a request to be refused."""
MAX_HISTORY: Final = 10
"""Sealed rounds kept in ``status.history``, newest last: enough to read a bad hour."""
MAX_EXCLUDED_NODES: Final = 8
"""The most Kubernetes nodes ``status.excludedNodes`` keeps out, newest kept: enough for a
few bad machines, and few enough that a small pool always keeps nodes to schedule on
(each failure past it frees the oldest)."""
EXCLUDED_NODE_TTL: Final = datetime.timedelta(hours=24)
"""How long a node stays out after its last failure: a node repaired overnight comes back
without anyone clearing the list."""
CLOSED_RESTARTS_EXHAUSTED: Final = "RestartsExhausted"
"""``status.closedReason`` when a failure found the job's restart budget spent: the job has
failed, so every node ends with ``RendezvousClosedError``, a spare too (not the graceful
exit of a spare that was not needed)."""


class RoundState(str, enum.Enum):
    """Where the rendezvous stands; ``kubectl get rdzv`` shows it."""

    FORMING = "Forming"
    """No round has been sealed yet; nodes are joining the first one."""
    SEALED = "Sealed"
    """``members`` is the current round and every one of them is still there."""
    REFORMING = "Reforming"
    """The sealed round lost a member or nodes wait to be admitted; the next one is forming."""
    CLOSED = "Closed"
    """No further round will be formed."""


def round_key(state: RoundState, round_number: int) -> str:
    """The selectable field (:data:`ROUND_KEY_FIELD`): changes exactly when watching pods
    must look again."""
    if state is RoundState.CLOSED:
        return "Closed"
    return f"{round_number}-{state.value}"


@dataclasses.dataclass(frozen=True)
class RendezvousStatus:
    """``status``, written by the operator alone."""

    state: RoundState = RoundState.FORMING
    round: int = 0
    """Number of the latest sealed round; 0 until the first is sealed."""
    members: tuple[records.Member, ...] = ()
    """The latest sealed round in rank order (kept while it re-forms, for reference)."""
    master: records.Master | None = None
    nodes_waiting: int = 0
    """What running agents' ``num_nodes_waiting()`` returns. In a sealed round always 0
    (spares beyond maxNodes do not count); when the round goes stale, the nodes that made
    it so (waiting to be admitted, plus members lost), counted once then. More than 0 tells
    healthy agents to re-rendezvous now."""
    spares: int = 0
    """Nodes asking to join that the sealed round, full at maxNodes, left out: they wait
    and step in when a member is lost. For people (``kubectl get rdzv``); agents are not
    told (torch's agent would restart for them)."""
    forming_since: datetime.datetime | None = None
    """When the round now forming got its first join request, or went stale (operator's
    clock). Written with the round's other changes, never on its own: at a first join that
    write would cost every waiting node an event of the round it is waiting for."""
    last_call_deadline: datetime.datetime | None = None
    """Seal no later than this once minNodes have joined (operator's clock)."""
    sealed_at: datetime.datetime | None = None
    closed_reason: str | None = None
    closed_message: str | None = None
    observed_generation: int = 0
    conditions: tuple[records.Condition, ...] = ()
    left_behind: tuple[records.Member, ...] = ()
    """Members of an earlier round still running it when a later round sealed without them
    (after the last call). Their join requests are spent: they count again once they join
    anew."""
    slices: int = 0
    """How many RendezvousSlices publish the round to the nodes (0: none, the nodes watch
    the Rendezvous). Fixed by the operator's first write (:func:`objects.slice_count` of maxNodes
    then), so that a node's slice never moves under it."""
    refused: tuple[records.Refusal, ...] = ()
    """Requests not counted, with the reason (at most :data:`MAX_REFUSED`, by pod name):
    the refused nodes read it and end (``NodeRefusedError``)."""
    forming_cause: str | None = None
    """Why the round now forming is formed (a :attr:`records.RoundRecord.cause`), set when the
    sealed round goes stale; it goes into the history at the seal."""
    forming_cause_message: str | None = None
    history: tuple[records.RoundRecord, ...] = ()
    """The last :data:`MAX_HISTORY` sealed rounds, oldest first."""
    restarts: int = 0
    """Re-forms caused by a failure so far, each spending one of ``spec.maxRestarts``."""
    excluded_nodes: tuple[records.ExcludedNode, ...] = ()
    """Kubernetes nodes on which a member failed, oldest first, at most
    :data:`MAX_EXCLUDED_NODES` and none older than :data:`EXCLUDED_NODE_TTL`: the webhook
    keeps the workload's new pods off them."""
    leaving: tuple[str, ...] = ()
    """Members of the round before the latest that it dropped while their pods were being
    deleted (a drain, an eviction, a scale-down): their workers may still be finishing the
    step in flight, so nodes re-forming in place let them leave rather than cut them off
    (:data:`k8s_rendezvous.handoff.STOP_GRACE_SECONDS`). Not in a RendezvousSlice, whose
    nodes learn of no member they lost."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def round_key(self) -> str:
        return round_key(self.state, self.round)

    def rank_of(self, node: str, entry: leases.NodeEntry) -> int | None:
        """The rank ``entry`` (of pod ``node``) holds in the sealed round, if it is in it."""
        for rank, member in enumerate(self.members):
            if member.node == node and member.admits(entry):
                return rank
        return None

    def left_behind_with(self, node: str, entry: leases.NodeEntry) -> bool:
        """Whether ``entry`` was admitted to an earlier round and a later one sealed
        without it: the request is spent and will not be admitted again."""
        return any(m.node == node and m.admits(entry) for m in self.left_behind)

    def operator_fields(self) -> dict[str, Any]:
        """Every operator-owned field, ``None`` where unset so a merge patch removes it."""

        def optional_time(moment: datetime.datetime | None) -> str | None:
            return None if moment is None else codec.format_time(moment)

        return {
            "schemaVersion": SCHEMA_VERSION,
            "state": self.state.value,
            "roundKey": self.round_key,
            "round": self.round,
            "worldSize": self.world_size,
            "members": [member.to_dict(rank) for rank, member in enumerate(self.members)],
            "master": None if self.master is None else self.master.to_dict(),
            "nodesWaiting": self.nodes_waiting,
            "spares": self.spares,
            "formingSince": optional_time(self.forming_since),
            "lastCallDeadline": optional_time(self.last_call_deadline),
            "sealedAt": optional_time(self.sealed_at),
            "closedReason": self.closed_reason,
            "closedMessage": self.closed_message,
            "observedGeneration": self.observed_generation,
            "conditions": [condition.to_dict() for condition in self.conditions],
            "leftBehind": [member.to_dict(rank=None) for member in self.left_behind],
            "slices": self.slices,
            "refused": [refusal.to_dict() for refusal in self.refused],
            "formingCause": self.forming_cause,
            "formingCauseMessage": self.forming_cause_message,
            "history": [record.to_dict() for record in self.history],
            "restarts": self.restarts,
            "excludedNodes": [excluded.to_dict() for excluded in self.excluded_nodes],
            "leaving": list(self.leaving),
        }

    def slice_fields(self, indexes: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        """The status of each slice (of those ``indexes``, else all), by index: the round's
        fields, and the members, left behind and refused whose pods hash to it (with their
        ranks). ``None`` where unset, so that a merge patch removes it. A node's
        :class:`views.NodeView` of its slice answers as the whole status does. Empty if the round
        is not sliced."""
        if not self.slices:
            return {}
        round_fields = {
            "schemaVersion": SCHEMA_VERSION,
            "state": self.state.value,
            "roundKey": self.round_key,
            "round": self.round,
            "worldSize": self.world_size,
            "rankZeroNode": self.members[0].node if self.members else None,
            "master": None if self.master is None else self.master.to_dict(),
            "nodesWaiting": self.nodes_waiting,
            "closedReason": self.closed_reason,
            "closedMessage": self.closed_message,
            "slices": self.slices,
        }
        pieces: dict[int, dict[str, Any]] = {
            index: round_fields | {"slice": index, "members": [], "leftBehind": [], "refused": []}
            for index in sorted(range(self.slices) if indexes is None else set(indexes))
        }

        def piece(node: str) -> dict[str, Any] | None:
            return pieces.get(objects.slice_index(node, self.slices))

        for rank, member in enumerate(self.members):
            if (own := piece(member.node)) is not None:
                own["members"].append(member.to_dict(rank))
        for member in self.left_behind:
            if (own := piece(member.node)) is not None:
                own["leftBehind"].append(member.to_dict(rank=None))
        for refusal in self.refused:
            if (own := piece(refusal.node)) is not None:
                own["refused"].append(refusal.to_dict())
        return pieces

    def named_nodes(self) -> set[str]:
        """The pods the status names: members, left behind and refused."""
        return {
            *(member.node for member in self.members),
            *(member.node for member in self.left_behind),
            *(refusal.node for refusal in self.refused),
        }

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.operator_fields().items() if value is not None}

    @classmethod
    def from_dict(cls, value: object, field: str = "status") -> RendezvousStatus:
        """Decode a stored status. An absent or empty status is the initial one."""
        data = stored_status(value, field)
        if data is None:
            return cls()
        members = tuple(
            records.Member.from_dict(item, f"{field}.members[{rank}]", rank)
            for rank, item in enumerate(codec.listed(data, "members", field))
        )

        def optional_time(key: str) -> datetime.datetime | None:
            raw = data.get(key)
            return None if raw is None else codec.parse_time(raw, f"{field}.{key}")

        def optional_str(key: str) -> str | None:
            return None if data.get(key) is None else codec.string(data, key, field)

        return cls(
            **round_fields(data, field, sealable=bool(members)),
            members=members,
            spares=codec.integer(data, "spares", field, default=0),
            forming_since=optional_time("formingSince"),
            last_call_deadline=optional_time("lastCallDeadline"),
            sealed_at=optional_time("sealedAt"),
            observed_generation=codec.integer(data, "observedGeneration", field, default=0),
            conditions=tuple(
                records.Condition.from_dict(item, f"{field}.conditions[{index}]")
                for index, item in enumerate(codec.listed(data, "conditions", field))
            ),
            left_behind=tuple(
                records.Member.from_dict(item, f"{field}.leftBehind[{index}]", rank=None)
                for index, item in enumerate(codec.listed(data, "leftBehind", field))
            ),
            slices=codec.integer(data, "slices", field, default=0, maximum=objects.MAX_SLICES),
            refused=tuple(
                records.Refusal.from_dict(item, f"{field}.refused[{index}]")
                for index, item in enumerate(codec.listed(data, "refused", field))
            ),
            forming_cause=optional_str("formingCause"),
            forming_cause_message=optional_str("formingCauseMessage"),
            history=tuple(
                records.RoundRecord.from_dict(item, f"{field}.history[{index}]")
                for index, item in enumerate(codec.listed(data, "history", field))
            ),
            restarts=codec.integer(
                data, "restarts", field, default=0, maximum=tunables.MAX_RESTARTS
            ),
            excluded_nodes=tuple(
                records.ExcludedNode.from_dict(item, f"{field}.excludedNodes[{index}]")
                for index, item in enumerate(codec.listed(data, "excludedNodes", field))
            )[-MAX_EXCLUDED_NODES:],
            leaving=codec.Fields(data, field).strings("leaving"),
        )


def stored_status(value: object, field: str) -> Mapping[str, Any] | None:
    """The status as the operator wrote it, or ``None`` before its first write."""
    if value is None:
        return None
    data = codec.mapping(value, field)
    if "state" not in data:  # the operator has not written yet
        return None
    version = data.get("schemaVersion")
    if version != SCHEMA_VERSION:
        raise codec.DecodeError(
            f"{field}.schemaVersion: {version!r} is not {SCHEMA_VERSION}; the operator and "
            "the pods' k8s-rendezvous versions disagree, upgrade them together"
        )
    return data


def round_fields(data: Mapping[str, Any], field: str, *, sealable: bool) -> dict[str, Any]:
    """The fields every reader of a status needs, decoded and checked."""

    def optional_str(key: str) -> str | None:
        return None if data.get(key) is None else codec.string(data, key, field)

    master_data = data.get("master")
    state = codec.enumerated(RoundState, data, "state", field)
    if state is RoundState.SEALED and (master_data is None or not sealable):
        raise codec.DecodeError(f"{field}: a Sealed round needs members and a master")
    return {
        "state": state,
        "round": codec.integer(data, "round", field, default=0, maximum=records.MAX_ROUND),
        "master": None
        if master_data is None
        else records.Master.from_dict(master_data, f"{field}.master"),
        "nodes_waiting": codec.integer(data, "nodesWaiting", field, default=0),
        "closed_reason": optional_str("closedReason"),
        "closed_message": optional_str("closedMessage"),
    }
