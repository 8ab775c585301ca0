"""A node whose watch lost track while the round that admitted it was sealed, and which
was left behind when the next round sealed without it, asks again instead of waiting out
its join timeout.

The API side is a scripted client (a fast unit test of a path a real API server produces
only with a well-timed watch failure); the store is torch's real TCPStore.
"""

from __future__ import annotations

from tests.support.scripted_api import ScriptedRendezvousClient

from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(2, 2, "run", join_timeout_seconds=20)
OTHER = records.Member("pod-0", "other", 1, "10.0.0.1")


class MissedRound(ScriptedRendezvousClient):
    """Plays the operator: the first join is admitted to round 1, which this node never
    sees, and left behind by round 2; a new join is admitted to round 3 as rank 0."""

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus:
        this = records.Member(node, entry.instance, entry.attempt, entry.addr)
        if len(self.joins) == 1:
            return statuses.RendezvousStatus(
                state=statuses.RoundState.SEALED,
                round=2,
                members=(OTHER, records.Member("pod-2", "third", 1, "10.0.0.2")),
                master=records.Master(OTHER.addr, 1),
                left_behind=(this,),
            )
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=3,
            members=(this, OTHER),
            master=records.Master(entry.addr, entry.store_port),
        )


def test_a_node_left_behind_by_a_round_it_missed_joins_again() -> None:
    client = MissedRound(SPEC)
    handler = client.handler("pod-1", read_timeout=5)
    try:
        info = handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert (info.rank, info.world_size) == (0, 2)
    assert [entry.attempt for entry in client.joins] == [1, 2]
    assert client.joins[0].instance == client.joins[1].instance
    assert client.joins[1].store_port == client.joins[0].store_port
