"""Connections to a member the operator dropped are shut down (k8s_rendezvous.cut_peers),
with real sockets on distinct loopback addresses: a receive blocked on the dropped
address returns at once, a connection elsewhere is untouched, and the watch acts once
per published round that lost members, only while the worker's world is older. A member
dropped while its pod is being deleted is left to finish its step: cut only if still
connected after the grace."""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.waiting import wait_for
from k8s_rendezvous import cut_peers, handoff, reforming
from k8s_rendezvous.wire import statuses, views


def published(
    round_number: int, *lost: str, leaving: tuple[str, ...] = ()
) -> handoff.PublishedRound:
    return handoff.PublishedRound(round_number, 1, "10.0.0.1:1", 0, 2, 0, 2, None, lost, leaving)


def test_the_handler_tells_leaving_members_from_lost_ones() -> None:
    def view(members: dict[str, str], leaving: tuple[str, ...] = ()) -> views.NodeView:
        status = {
            "schemaVersion": statuses.SCHEMA_VERSION,
            "state": "Sealed",
            "round": 1,
            "master": {"addr": "10.0.0.1", "port": 1},
            "members": [
                {"rank": rank, "node": node, "instance": "i", "attempt": 1, "addr": addr}
                for rank, (node, addr) in enumerate(members.items())
            ],
            "leaving": list(leaving),
        }
        return views.NodeView.from_dict(status, "a")

    before = view({"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3", "d": "10.0.0.4"})
    after = view({"a": "10.0.0.1", "d": "10.0.0.4"}, leaving=("b",))
    assert reforming.dropped_addresses(before, after) == (("10.0.0.3",), ("10.0.0.2",))
    shared = view({"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.2"})
    assert reforming.dropped_addresses(shared, view({"a": "10.0.0.1"}, leaving=("b",))) == (
        ("10.0.0.2",),
        (),
    ), "an address a lost member shares is cut at once"
    assert reforming.dropped_addresses(before, before) == ((), ())


def test_a_round_that_lost_members_is_cut_once_while_the_world_is_older() -> None:
    lost = published(5, "10.0.0.2", "[fd00::3]", "::ffff:10.0.0.4", "not-an-ip")
    assert cut_peers.addresses_to_cut(lost, 4, 0) == {"10.0.0.2", "fd00::3", "10.0.0.4"}
    assert cut_peers.addresses_to_cut(lost, 5, 0) == set(), "the worker is already in it"
    assert cut_peers.addresses_to_cut(lost, 4, 5) == set(), "already cut"
    assert cut_peers.addresses_to_cut(published(5), 4, 0) == set(), "a node arrived"
    assert cut_peers.addresses_to_cut(None, 0, 0) == set()
    leaving = published(5, "10.0.0.2", leaving=("10.0.0.3",))
    assert cut_peers.addresses_to_cut(leaving, 4, 0) == {"10.0.0.2"}
    assert cut_peers.addresses_to_cut(leaving, 4, 0, leaving=True) == {"10.0.0.3"}
    assert cut_peers.addresses_to_cut(leaving, 5, 0, leaving=True) == set()


def hexed(address: str) -> str:
    """``address`` as /proc/net/tcp prints it: each 32-bit word as this host stores it."""
    packed = ipaddress.ip_address(address).packed
    if sys.byteorder == "little":
        packed = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return packed.hex().upper()


def test_a_tables_remote_addresses_are_read_in_the_hosts_byte_order() -> None:
    rows = [
        ("127.0.0.1", "0.0.0.0", 111),  # listening: no remote
        ("127.0.0.1", "127.0.0.2", 222),
        ("::1", "::ffff:127.0.0.3", 333),
        ("::1", "fd00::4", 444),
    ]
    table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    for number, (local, remote, inode) in enumerate(rows):
        table += (
            f"   {number}: {hexed(local)}:1F90 {hexed(remote)}:9C40 01 00000000:00000000 "
            f"00:00000000 00000000     0        0 {inode} 1 0000000000000000 20 4 30 10 -1\n"
        )
    assert cut_peers.remote_addresses(table) == {
        222: "127.0.0.2",
        333: "127.0.0.3",
        444: "fd00::4",
    }


# Loopback addresses no other test connects to: the whole suite runs in one process, and
# a connection another test left open to the same address would be cut too.
DROPPED, KEPT, CLIENT = "127.77.0.2", "127.77.0.3", "127.77.0.9"


class Peer:
    """A listener on one loopback address and this process's connection to it."""

    def __init__(self, address: str) -> None:
        self.listener = socket.create_server((address, 0))
        self.client = socket.socket()
        self.client.bind((CLIENT, 0))  # so that the accepted end's remote is not ``address``
        self.client.connect(self.listener.getsockname())
        self.server, _ = self.listener.accept()

    def close(self) -> None:
        for end in (self.client, self.server, self.listener):
            end.close()


@pytest.fixture
def peers() -> Iterator[tuple[Peer, Peer]]:
    made = (Peer(DROPPED), Peer(KEPT))
    try:
        yield made
    finally:
        for peer in made:
            peer.close()


def blocked_receive(connection: socket.socket) -> tuple[threading.Thread, list[bytes]]:
    received: list[bytes] = []
    thread = threading.Thread(target=lambda: received.append(connection.recv(1)), daemon=True)
    thread.start()
    return thread, received


def test_connections_to_a_dropped_address_are_shut_down_and_others_left_alone(
    peers: tuple[Peer, Peer],
) -> None:
    dropped, kept = peers
    thread, received = blocked_receive(dropped.client)

    assert cut_peers.shut_down_connections({DROPPED}) == 1
    thread.join(timeout=30)
    assert received == [b""], "the blocked receive ended as if the peer had closed"
    kept.server.sendall(b"x")
    assert kept.client.recv(1) == b"x"
    assert dropped.client.fileno() >= 0, "the owner's descriptor stays open"


def test_the_watch_cuts_when_a_round_that_dropped_the_address_is_published(
    tmp_path: Path, peers: tuple[Peer, Peer]
) -> None:
    dropped, _ = peers
    world_round = 4
    watch = cut_peers.Watch(tmp_path, lambda: world_round)
    handoff.write(tmp_path, handoff.ROUND_FILE, published(5))  # a node arrived
    watch._once()
    handoff.write(tmp_path, handoff.ROUND_FILE, published(5, "10.0.0.7"))
    watch._once()
    dropped.server.sendall(b"y")
    assert dropped.client.recv(1) == b"y", "no round dropped it yet"

    thread, received = blocked_receive(dropped.client)
    watch.start()
    try:
        handoff.write(tmp_path, handoff.ROUND_FILE, published(6, DROPPED))
        thread.join(timeout=30)
        assert received == [b""]
        wait_for(lambda: watch._cut_round == 6 or None, 30, "the watch to record the round")
    finally:
        watch.stop()


@pytest.mark.parametrize("reformed", [False, True], ids=["still-connected", "reformed"])
def test_a_leaving_member_is_cut_only_after_the_grace_and_only_if_still_in_the_world(
    tmp_path: Path, peers: tuple[Peer, Peer], monkeypatch: pytest.MonkeyPatch, reformed: bool
) -> None:
    monkeypatch.setattr(handoff, "STOP_GRACE_SECONDS", 0.5)
    dropped, _ = peers
    world_round = 4
    watch = cut_peers.Watch(tmp_path, lambda: world_round)
    handoff.write(tmp_path, handoff.ROUND_FILE, published(5, leaving=(DROPPED,)))
    watch._once()
    watch._cut_leavers()
    dropped.server.sendall(b"y")
    assert dropped.client.recv(1) == b"y", "it is finishing its step with this worker"
    if reformed:
        world_round = 5  # the leaver left at the step boundary and the worker re-formed

    thread, received = blocked_receive(dropped.client)
    watch.start()
    try:
        if reformed:
            wait_for(lambda: watch._leavers is None or None, 30, "the grace to pass")
            dropped.server.sendall(b"z")
            thread.join(timeout=30)
            assert received == [b"z"], "a world re-formed without it cuts nothing"
        else:
            thread.join(timeout=30)
            assert received == [b""], "still connected after the grace: cut off"
    finally:
        watch.stop()
