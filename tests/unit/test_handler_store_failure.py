"""A node admitted to a round whose rank 0 is gone before it connects (the soak found it:
rank 0 left between the seal and the others' connect) gets our named connection error,
not torch's DistNetworkError, and a message that says what happened. So does a node whose
rank 0 is frozen (its kernel accepts the connection, nobody answers): torch's client alone
would wait for it without end.

The API side is a scripted client (a fast unit test of a failure path); the store side is
torch's real TCPStore, connecting to a port where nothing listens.
"""

from __future__ import annotations

import socket

import pytest
from tests.support.scripted_api import ScriptedRendezvousClient

from k8s_rendezvous.errors import KubernetesRendezvousConnectionError
from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(2, 2, "run", join_timeout_seconds=30)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SealedWithUnreachableRank0(ScriptedRendezvousClient):
    """Seals, at the first join, a round of two in which this node is rank 1 and rank 0's
    store is at ``master_port``."""

    def __init__(self, master_port: int) -> None:
        super().__init__(SPEC)
        self._master_port = master_port

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus | None:
        if len(self.joins) > 1:
            return None
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=1,
            members=(
                records.Member("pod-0", "other", 1, "127.0.0.1"),
                records.Member(node, entry.instance, entry.attempt, entry.addr),
            ),
            master=records.Master("127.0.0.1", self._master_port),
        )


def connection_error_of_rank_1(master_port: int) -> KubernetesRendezvousConnectionError:
    """What ``next_rendezvous()`` of pod-1 raises when sealed as rank 1 of a round whose
    rank 0's store is at ``master_port``."""
    handler = SealedWithUnreachableRank0(master_port).handler("pod-1", read_timeout=1)
    try:
        with pytest.raises(KubernetesRendezvousConnectionError) as error:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    return error.value


def test_unreachable_store_of_rank_0_is_a_named_connection_error() -> None:
    port = closed_port()
    error = connection_error_of_rank_1(port)
    message = str(error)
    assert "node pod-1 is rank 1 of round 1 of Rendezvous ns/r" in message
    assert f"could not reach the round's store at 127.0.0.1:{port} (rank 0, pod pod-0)" in message
    assert "the next next_rendezvous() joins a new round" in message
    assert isinstance(error.__cause__, RuntimeError)


@pytest.mark.timeout(60, method="thread")  # torch's client alone would never return
def test_a_rank_0_that_accepts_but_never_answers_is_a_named_connection_error() -> None:
    with socket.socket() as frozen:  # listening, never accepting: what a stopped process is
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)
        port = int(frozen.getsockname()[1])
        message = str(connection_error_of_rank_1(port))
    assert f"could not reach the round's store at 127.0.0.1:{port} (rank 0, pod pod-0)" in message
    assert "it accepted the connection but did not answer" in message
    assert "Rank 0 has probably left, died or stalled" in message
