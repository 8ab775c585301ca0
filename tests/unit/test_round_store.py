"""The round's store: each join offers a listening socket; the round's rank 0 serves the
TCPStore on it, and the other members close theirs. torch's real TCPStore throughout; the
API side of the handler tests is a scripted client."""

from __future__ import annotations

import datetime
import select
import socket
import threading

import pytest
from tests.support.scripted_api import ScriptedRendezvousClient
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousInfo

from k8s_rendezvous import config, round_store
from k8s_rendezvous.errors import KubernetesRendezvousConnectionError
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(2, 2, "run", join_timeout_seconds=30)


def test_a_member_that_connects_before_rank_0_serves_is_answered_once_it_does() -> None:
    offered = round_store.listen()
    port = int(offered.getsockname()[1])
    connected: list[TCPStore] = []
    timeout = datetime.timedelta(seconds=30)
    client = threading.Thread(
        target=lambda: connected.append(
            TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        )
    )
    client.start()
    # The kernel has completed the member's connect while nothing serves the socket yet.
    assert select.select([offered], [], [], 30)[0] == [offered]
    assert not connected
    store = round_store.serve(offered, timeout=10)
    client.join(30)
    assert connected, "the member was never answered"
    connected[0].set("from-member", "hello")
    assert store.get("from-member") == b"hello"
    assert store.port == port


class SealsTwoWhenBothJoined(ScriptedRendezvousClient):
    """Seals a round of pod-0 (rank 0) and pod-1 once both have joined."""

    def __init__(self) -> None:
        super().__init__(SPEC)
        self.entries: dict[str, leases.NodeEntry] = {}

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus | None:
        self.entries[node] = entry
        if len(self.entries) < 2:
            return None
        members = tuple(
            records.Member(pod, self.entries[pod].instance, self.entries[pod].attempt, "127.0.0.1")
            for pod in ("pod-0", "pod-1")
        )
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=1,
            members=members,
            master=records.Master("127.0.0.1", self.entries["pod-0"].store_port),
        )


def handler_for(client: ScriptedRendezvousClient, node: str) -> KubernetesRendezvousHandler:
    return KubernetesRendezvousHandler(
        client,
        run_id="run",
        node=node,
        addr="127.0.0.1",
        min_nodes=2,
        max_nodes=2,
        settings=config.Settings(client.namespace, client.name, read_timeout=10),
    )


def test_rank_0_serves_on_the_port_it_offered_and_the_other_member_closes_its_own() -> None:
    client = SealsTwoWhenBothJoined()
    handlers = [handler_for(client, "pod-0"), handler_for(client, "pod-1")]
    infos: dict[int, RendezvousInfo] = {}
    joins = [
        threading.Thread(target=lambda i=i: infos.__setitem__(i, handlers[i].next_rendezvous()))
        for i in range(2)
    ]
    try:
        for join in joins:
            join.start()
        for join in joins:
            join.join(30)
        assert sorted(infos) == [0, 1], "a join did not return"
        rank_0, rank_1 = infos[0], infos[1]
        assert (rank_0.rank, rank_1.rank) == (0, 1)
        port_0 = client.entries["pod-0"].store_port
        assert rank_0.bootstrap_store_info.master_port == port_0  # type: ignore[union-attr]
        rank_1.store.set("key", "from rank 1")
        assert rank_0.store.get("key") == b"from rank 1"
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", client.entries["pod-1"].store_port))
    finally:
        for handler in handlers:
            handler.shutdown()


class SealsAloneAsRank0(ScriptedRendezvousClient):
    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus:
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=1,
            members=(records.Member(node, entry.instance, entry.attempt, entry.addr),),
            master=records.Master(entry.addr, entry.store_port),
        )


def test_a_rank_0_that_cannot_serve_the_store_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(offered: socket.socket, timeout: float) -> TCPStore:
        raise RuntimeError("scripted: the server socket has failed to listen")

    monkeypatch.setattr(round_store, "serve", refuse)
    client = SealsAloneAsRank0(specs.RendezvousSpec(1, 1, "run"))
    handler = handler_for(client, "pod-0")
    try:
        with pytest.raises(KubernetesRendezvousConnectionError) as error:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    message = str(error.value)
    port = client.joins[0].store_port
    assert "node pod-0 is rank 0 of round 1 of Rendezvous ns/r but could not serve" in message
    assert f"on port {port}: scripted: the server socket has failed to listen" in message
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))  # the offered socket is not left open
