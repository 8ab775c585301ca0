"""The status as one node reads it (:class:`NodeView`): the round, and that node's own
entries in it, from the Rendezvous or from the node's RendezvousSlice."""

from __future__ import annotations

import dataclasses

from k8s_rendezvous.wire import codec, leases, objects, records, statuses


@dataclasses.dataclass(frozen=True)
class NodeView:
    """The status as one node reads it: the round, and this node's own entries in it.

    Read from the Rendezvous status or from the node's RendezvousSlice (its status has the
    same layout, with ``slice`` set and only that slice's members). Every node reads every
    sealed round, and a round of 1000 members is about 120 kB: decoding each member would
    cost every node about 1.7 ms of CPU (``python -m bench.probes``), 1000 times over on a
    machine of simulated nodes; a node looks only for itself."""

    node: str
    state: statuses.RoundState = statuses.RoundState.FORMING
    round: int = 0
    world_size: int = 0
    rank_zero_node: str | None = None
    """The pod of rank 0, for messages about the round's store."""
    member_nodes: tuple[str, ...] = ()
    """The pods of the latest sealed round in rank order, for messages; empty when read
    from a slice (see ``world_size``)."""
    member_addresses: tuple[str, ...] = ()
    """Their addresses, in the same order."""
    own_ranks: tuple[tuple[int, records.Member], ...] = ()
    """This pod's entries in ``members`` with their ranks (one, unless its agent restarted
    and the operator has not yet noticed)."""
    own_left_behind: tuple[records.Member, ...] = ()
    master: records.Master | None = None
    nodes_waiting: int = 0
    closed_reason: str | None = None
    closed_message: str | None = None
    slices: int = 0
    """See :attr:`statuses.RendezvousStatus.slices`: more than 0 tells the node to watch its
    slice."""
    own_refusals: tuple[records.Refusal, ...] = ()
    """This pod's entries in ``refused``."""
    leaving: tuple[str, ...] = ()
    """See :attr:`statuses.RendezvousStatus.leaving` (empty when read from a slice)."""

    @property
    def round_key(self) -> str:
        return statuses.round_key(self.state, self.round)

    def rank_of(self, entry: leases.NodeEntry) -> int | None:
        """The rank this node's ``entry`` holds in the sealed round, if it is in it."""
        return next((rank for rank, member in self.own_ranks if member.admits(entry)), None)

    def left_behind_with(self, entry: leases.NodeEntry) -> bool:
        """See :meth:`statuses.RendezvousStatus.left_behind_with`."""
        return any(member.admits(entry) for member in self.own_left_behind)

    def refusal_of(self, entry: leases.NodeEntry) -> records.Refusal | None:
        """Why the operator does not count ``entry``, if it said so."""
        return next((refusal for refusal in self.own_refusals if refusal.refuses(entry)), None)

    @classmethod
    def from_dict(cls, value: object, node: str, field: str = "status") -> NodeView:
        data = statuses.stored_status(value, field)
        if data is None:
            return cls(node)
        sliced = data.get("slice") is not None
        world_size = codec.integer(data, "worldSize", field) if sliced else 0
        member_nodes: list[str] = []
        member_addresses: list[str] = []
        own_ranks: list[tuple[int, records.Member]] = []
        for position, item in enumerate(codec.listed(data, "members", field)):
            where = f"{field}.members[{position}]"
            name = item.get("node") if type(item) is dict else None
            if type(name) is not str:
                raise codec.DecodeError(f"{where}.node: expected a string, got {name!r}")
            if not sliced:
                member_nodes.append(name)
                member_addresses.append(codec.string(item, "addr", where))
            if name == node:
                rank = (
                    codec.integer(item, "rank", where, maximum=world_size - 1)
                    if sliced
                    else position
                )
                own_ranks.append((rank, records.Member.from_dict(item, where, rank)))
        if not sliced:
            world_size = len(member_nodes)
        rank_zero_node = (
            (
                None
                if data.get("rankZeroNode") is None
                else codec.string(data, "rankZeroNode", field)
            )
            if sliced
            else next(iter(member_nodes), None)
        )
        return cls(
            node,
            **statuses.round_fields(data, field, sealable=world_size > 0),
            world_size=world_size,
            rank_zero_node=rank_zero_node,
            member_nodes=tuple(member_nodes),
            member_addresses=tuple(member_addresses),
            own_ranks=tuple(own_ranks),
            own_left_behind=tuple(
                records.Member.from_dict(item, f"{field}.leftBehind[{index}]", rank=None)
                for index, item in enumerate(codec.listed(data, "leftBehind", field))
                if type(item) is not dict or item.get("node") == node
            ),
            slices=codec.integer(data, "slices", field, default=0, maximum=objects.MAX_SLICES),
            own_refusals=tuple(
                records.Refusal.from_dict(item, f"{field}.refused[{index}]")
                for index, item in enumerate(codec.listed(data, "refused", field))
                if type(item) is not dict or item.get("node") == node
            ),
            leaving=() if sliced else codec.Fields(data, field).strings("leaving"),
        )
