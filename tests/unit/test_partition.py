"""A member cut off from the cluster (:mod:`k8s_rendezvous.partition`), without threads or
clocks: the sentinel's step is driven by hand with a probe clock the test sets.

Aspects: either silence alone (probes, or the API server) is no cut; the cut is told once
both are silent and ends when either speaks; an API server that refuses or resets the
connection (it restarts) is no silence; the API server is asked ever less often while
it answers; what it answers reaches the watcher; the agent's responder tells how long
probes have been silent, from none since the last join.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Mapping
from typing import Any

import pytest

from devkit.waiting import wait_for
from k8s_rendezvous import partition
from k8s_rendezvous.errors import ApiServerSilentError, KubernetesRendezvousConnectionError
from k8s_rendezvous.probes import ProbeResponder
from k8s_rendezvous.wire import datagrams

SILENCE = partition.SILENCE_SECONDS


class Probes:
    def __init__(self) -> None:
        self.silence: float | None = None

    def silent_for(self) -> float | None:
        return self.silence


class Api:
    """The Rendezvous read: answers, refuses (the API server restarts) or is silent (the
    node is cut off), as the test says; counts the reads."""

    def __init__(self) -> None:
        self.answers = "yes"
        self.reads: list[float] = []
        self.offered: list[Mapping[str, Any]] = []

    def read(self, budget: float) -> Mapping[str, Any]:
        self.reads.append(budget)
        if self.answers == "silent":
            raise ApiServerSilentError("could not read: connection timed out")
        if self.answers == "refused":
            raise KubernetesRendezvousConnectionError("could not read: connection refused")
        return {"metadata": {"resourceVersion": str(len(self.reads))}}


@pytest.fixture
def sentinel_of() -> tuple[partition.Sentinel, Probes, Api]:
    probes, api = Probes(), Api()
    sentinel = partition.Sentinel("pod-a", probes, api.read, api.offered.append)
    return sentinel, probes, api


@pytest.mark.parametrize(
    ("silent_for", "api_answered", "cut"),
    [
        (None, False, False),  # never probed (not yet sealed in, or UDP blocked)
        (SILENCE - 0.1, False, False),  # within the operator's probe window
        (SILENCE, None, False),  # not asked yet
        (SILENCE, True, False),  # the operator's leader is changing
        (SILENCE, False, True),
        (600.0, False, True),
    ],
)
def test_a_member_is_cut_off_only_when_probes_and_the_api_server_are_both_silent(
    silent_for: float | None, api_answered: bool | None, cut: bool
) -> None:
    assert partition.cut_off(silent_for, api_answered) is cut


def test_the_api_server_is_not_asked_while_probes_come(
    sentinel_of: tuple[partition.Sentinel, Probes, Api],
) -> None:
    sentinel, probes, api = sentinel_of
    for silence in (None, 0.5, SILENCE - 0.01):
        probes.silence = silence
        sentinel.check()
    assert api.reads == []
    assert not sentinel.cut_off


def test_silent_probes_and_a_silent_api_server_are_a_cut_until_either_speaks(
    sentinel_of: tuple[partition.Sentinel, Probes, Api],
) -> None:
    sentinel, probes, api = sentinel_of
    api.answers = "silent"
    probes.silence = SILENCE
    sentinel.check()
    assert api.reads == [partition.CHECK_BUDGET_SECONDS]
    assert sentinel.cut_off
    # Cut off, it asks at every step, so as to see the network back at once.
    probes.silence = SILENCE + 1
    sentinel.check()
    assert len(api.reads) == 2 and sentinel.cut_off
    # Back: the API server answers, and its answer reaches the watcher.
    api.answers = "yes"
    probes.silence = SILENCE + 2
    sentinel.check()
    assert not sentinel.cut_off
    assert api.offered == [{"metadata": {"resourceVersion": "3"}}]
    # Or a probe comes: no longer cut off, whatever the API server said last.
    api.answers = "silent"
    probes.silence = SILENCE + 30
    sentinel.check()
    assert sentinel.cut_off
    probes.silence = 0.2
    assert not sentinel.cut_off


def test_an_api_server_that_refuses_while_it_restarts_is_no_cut(
    sentinel_of: tuple[partition.Sentinel, Probes, Api],
) -> None:
    # Its operator has lost the leadership too, so probes are silent as well; but the
    # refusal comes from the API server's end of the network, which a cut node never hears.
    sentinel, probes, api = sentinel_of
    api.answers = "refused"
    probes.silence = SILENCE
    sentinel.check()
    assert api.reads == [partition.CHECK_BUDGET_SECONDS]
    assert not sentinel.cut_off
    assert api.offered == []
    probes.silence = SILENCE + 1
    sentinel.check()
    assert len(api.reads) == 1, "asked again later, as while it answers"
    # The same silence with nothing answering is a cut.
    api.answers = "silent"
    probes.silence = SILENCE + partition.recheck_after(1)
    sentinel.check()
    assert sentinel.cut_off


def test_while_the_api_server_answers_it_is_asked_ever_less_often(
    sentinel_of: tuple[partition.Sentinel, Probes, Api],
) -> None:
    sentinel, probes, api = sentinel_of
    read_at: list[float] = []
    for tenth in range(int(SILENCE * 10), 3000):  # 5 min of silence, a step each 0.1 s
        probes.silence = tenth / 10
        before = len(api.reads)
        sentinel.check()
        if len(api.reads) > before:
            read_at.append(probes.silence)
    gaps = [later - earlier for earlier, later in itertools.pairwise(read_at)]
    assert read_at[0] == SILENCE
    assert gaps[:3] == pytest.approx([SILENCE, 2 * SILENCE, 4 * SILENCE], abs=0.11)
    assert max(gaps) == pytest.approx(partition.MAX_RECHECK_SECONDS, abs=0.11)
    assert len(read_at) < 10, read_at
    assert not sentinel.cut_off
    # A probe ends the silence: the next one starts from the first wait again.
    probes.silence = 0.1
    sentinel.check()
    probes.silence = SILENCE
    before = len(api.reads)
    sentinel.check()
    assert len(api.reads) == before + 1


def test_the_responder_tells_how_long_probes_have_been_silent_since_the_last_join() -> None:
    responder = ProbeResponder("pod-a")
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert responder.silent_for() is None, "never probed: not silent"
        sender.sendto(
            b"not a probe".ljust(datagrams.Probe.REQUEST_BYTES, b"\0"),
            ("127.0.0.1", responder.port),
        )
        sender.sendto(
            datagrams.Probe(b"n" * datagrams.PROBE_NONCE_BYTES).request(),
            ("127.0.0.1", responder.port),
        )
        sender.settimeout(5)
        sender.recvfrom(64)  # answered: it was taken for a probe
        silent = responder.silent_for()
        assert silent is not None and 0 <= silent < 5
        later = wait_for(
            lambda: s if (s := responder.silent_for()) is not None and s > silent else None,
            5,
            "the silence to grow",
        )
        assert later > silent
        responder.forget()
        assert responder.silent_for() is None
    finally:
        sender.close()
        responder.stop()
