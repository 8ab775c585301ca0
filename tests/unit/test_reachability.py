"""Which members the operator judges unreachable from its probes, and the probes
themselves: real UDP between the operator's prober and agents' responders on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k8s_rendezvous.probes import ProbeResponder
from k8s_rendezvous.wire import codec, datagrams, leases
from k8s_rendezvous_operator.probing import Prober
from k8s_rendezvous_operator.reachability import Target, unreachable

MISSES = 3


def target(node: str, port: int = 1) -> Target:
    return Target("ns", "job", node, f"{node}-agent", "127.0.0.1", port)


def test_a_target_is_unreachable_once_its_last_probes_all_went_unanswered() -> None:
    unanswered = {target("a"): 0, target("late"): 1, target("b"): MISSES, target("c"): 7}
    heard = {target("a")}
    assert unreachable(unanswered, heard, MISSES) == {target("b"), target("c")}
    assert unreachable({**unanswered, target("b"): MISSES - 1}, heard, MISSES) == {target("c")}


def test_members_of_a_rendezvous_none_of_whose_members_ever_answered_are_not_judged() -> None:
    """UDP does not reach them (a NetworkPolicy), or they were gone before probing began:
    their heartbeats judge them, and their silence does not silence the judgement of others."""
    blocked = [dataclasses.replace(target(f"b-{i}"), rendezvous="blocked") for i in range(5)]
    unanswered = {target("a"): 0, target("lost"): MISSES, **dict.fromkeys(blocked, 9)}
    assert unreachable(unanswered, {target("a")}, MISSES) == {target("lost")}
    assert unreachable(unanswered, set(), MISSES) == frozenset()


@given(st.integers(1, 20), st.integers(0, 20))
def test_nobody_is_judged_while_most_are_silent_for_the_operator_is_then_cut_off(
    answering: int, silent: int
) -> None:
    unanswered = {target(f"up-{i}"): 0 for i in range(answering)}
    unanswered |= {target(f"down-{i}"): MISSES for i in range(silent)}
    verdict = unreachable(unanswered, set(unanswered), MISSES)
    if silent > answering:
        assert verdict == frozenset()
    else:
        assert verdict == {t for t in unanswered if t.node.startswith("down-")}


def test_a_silent_spare_is_judged_but_not_counted_against_the_members() -> None:
    """A lost Kubernetes node holding half the members and the spare: more than half of
    all targets are silent, yet the operator is not cut off (half its members answer)."""
    spare = dataclasses.replace(target("spare"), waiting=True)
    unanswered = {target("a"): 0, target("b"): 0, target("c"): MISSES, target("d"): MISSES}
    unanswered[spare] = MISSES
    assert unreachable(unanswered, set(unanswered), MISSES) == {target("c"), target("d"), spare}
    everyone_silent = dict.fromkeys(unanswered, MISSES)
    assert unreachable(everyone_silent, set(unanswered), MISSES) == frozenset()


def test_a_probe_round_trips_and_nothing_else_is_taken_for_one() -> None:
    probe = datagrams.Probe(bytes(range(datagrams.PROBE_NONCE_BYTES)))
    assert len(probe.request()) == datagrams.Probe.REQUEST_BYTES >= len(probe.reply())
    assert datagrams.Probe.from_request(probe.request()) == probe
    assert datagrams.Probe.from_reply(probe.reply()) == probe
    assert datagrams.Probe.from_request(probe.reply()) is None
    assert datagrams.Probe.from_reply(probe.request()) is None
    assert datagrams.Probe.from_request(b"GET / HTTP/1.1\r\n".ljust(64)) is None
    assert datagrams.Probe.from_reply(probe.reply()[:-1]) is None


def test_a_node_entry_names_its_probe_port_and_one_without_is_not_probed() -> None:
    entry = leases.NodeEntry("agent", 1, "10.0.0.1", 29400, probe_port=41000)
    assert leases.NodeEntry.from_annotation(entry.to_annotation(), "entry") == entry
    older = {k: v for k, v in entry.to_dict().items() if k != "probePort"}
    assert leases.NodeEntry.from_dict(older, "entry").probe_port == 0
    with pytest.raises(codec.DecodeError, match=r"entry\.probePort: must be at most 65535"):
        leases.NodeEntry.from_dict({**entry.to_dict(), "probePort": 70000}, "entry")


async def answered(prober: Prober, probed: Target) -> None:
    """Until ``probed`` has answered its last probe (polled: answers arrive on the loop,
    between rounds of probes)."""
    while prober.unanswered(probed) != 0:
        await asyncio.sleep(0.001)


def test_an_agent_answers_probes_until_stopped_then_is_judged_unreachable() -> None:
    asyncio.run(_an_agent_answers_probes_until_stopped())


async def _an_agent_answers_probes_until_stopped() -> None:
    responders = [ProbeResponder(f"node-{i}") for i in range(3)]
    targets = [
        dataclasses.replace(target(f"node-{i}"), port=r.port) for i, r in enumerate(responders)
    ]
    verdicts: list[frozenset[Target]] = []
    prober = Prober(lambda: targets, verdicts.append, interval=1.0, window=3.0)
    try:
        await prober.probe_once()
        for probed in targets:
            await asyncio.wait_for(answered(prober, probed), 5)
        responders[1].stop()
        for _ in range(MISSES):
            await prober.probe_once()
            for probed in (targets[0], targets[2]):
                await asyncio.wait_for(answered(prober, probed), 5)
        assert prober.unanswered(targets[1]) == MISSES
        assert verdicts == [frozenset()] * (1 + MISSES), "judged before each round's probes"
        await prober.probe_once()
        assert verdicts[-1] == {targets[1]}
    finally:
        await prober.stop()
        for responder in responders:
            responder.stop()


def test_an_answer_with_a_nonce_not_sent_counts_for_nobody() -> None:
    asyncio.run(_an_answer_with_a_nonce_not_sent())


async def _an_answer_with_a_nonce_not_sent() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    probed = dataclasses.replace(target("node"), port=silent.getsockname()[1])
    prober = Prober(lambda: [probed], lambda _: None, interval=1.0, window=3.0)
    try:
        await prober.probe_once()
        request, sender = silent.recvfrom(128)
        forged = datagrams.Probe(bytes(datagrams.PROBE_NONCE_BYTES))
        silent.sendto(forged.reply(), sender)
        silent.sendto(datagrams.Probe.from_request(request).reply(), sender)  # type: ignore[union-attr]
        await asyncio.wait_for(answered(prober, probed), 5)
        assert prober.answers == 1
    finally:
        await prober.stop()
        silent.close()


def test_a_member_that_got_its_own_probe_cannot_answer_for_another() -> None:
    asyncio.run(_a_member_cannot_answer_for_another())


async def _a_member_cannot_answer_for_another() -> None:
    """Issue 55: the nonces of one round were one secret and the target's index, so a
    member that got its probe answered for every other member (of any namespace) by
    counting. Now each nonce is its own: its answer and any variation of it answer for
    itself only, round after round, and the silent member is judged unreachable."""
    forger, silent = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    for sock in (forger, silent):
        sock.bind(("127.0.0.1", 0))
    honest = ProbeResponder("honest")
    own = Target("mine", "job", "forger", "i", "127.0.0.1", forger.getsockname()[1])
    other = Target("theirs", "job", "victim", "i", "127.0.0.1", silent.getsockname()[1])
    peer = Target("theirs", "job", "peer", "i", "127.0.0.1", honest.port)
    verdicts: list[frozenset[Target]] = []
    prober = Prober(lambda: [own, other, peer], verdicts.append, interval=1.0, window=3.0)
    try:
        for _ in range(MISSES + 1):
            await prober.probe_once()
            request, sender = forger.recvfrom(128)
            nonce = datagrams.Probe.from_request(request).nonce  # type: ignore[union-attr]
            forger.sendto(datagrams.Probe(nonce).reply(), sender)
            for index in range(8):  # its nonce with every other index the round could use
                forged = nonce[:-8] + index.to_bytes(8, "big")
                forger.sendto(datagrams.Probe(forged).reply(), sender)
            await asyncio.wait_for(answered(prober, own), 5)
            await asyncio.wait_for(answered(prober, peer), 5)
        assert prober.unanswered(other) == MISSES + 1
        assert verdicts[-1] == {other}
    finally:
        await prober.stop()
        honest.stop()
        forger.close()
        silent.close()
