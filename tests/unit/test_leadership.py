"""Leader election (``k8s_rendezvous_operator.leadership.Elector``) over an in-memory
Lease, driven by the elector's injected monotonic clock: no test waits for time to pass.

Aspects: a standby judges a holder's expiry by its own clock from when it saw the record
change, never by the renewTime written on another machine; a holder that keeps renewing
is never taken over; a leader renews its own Lease without counting a transition; a
leader gives up when renewals fail for the renew deadline, or when the Lease is taken;
a stopped leader releases the Lease, and only its own.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from k8s_rendezvous_operator import kube, leadership

# Short real waits between tries: the clock, not these, decides every outcome.
TIMINGS = leadership.Timings(
    lease_duration=1.0, renew_period=0.2, retry_period=0.01, renew_deadline=0.5, exit_grace=0.2
)
ANCIENT = "2000-01-01T00:00:00.000000Z"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeLease:
    """One Lease with resourceVersion checks, as the API server keeps it. Each read moves
    the clock on by ``step`` and then runs ``on_read`` (the world changing meanwhile)."""

    reference = "Lease ns/leader"

    def __init__(self, clock: Clock, step: float) -> None:
        self.clock = clock
        self.step = step
        self.lease: dict[str, Any] | None = None
        self.reads = 0
        self.writes: list[dict[str, Any]] = []
        self.on_read: Callable[[], None] = lambda: None
        self.refuse_writes: Exception | None = None

    def hold(self, holder: str, duration: int = 10, renewed: str = ANCIENT) -> None:
        version = int(self.lease["metadata"]["resourceVersion"]) + 1 if self.lease else 1
        self.lease = {
            "metadata": {"name": "leader", "resourceVersion": str(version)},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": duration,
                "acquireTime": ANCIENT,
                "renewTime": renewed,
                "leaseTransitions": 3,
            },
        }

    @property
    def spec(self) -> dict[str, Any]:
        assert self.lease is not None
        return dict(self.lease["spec"])

    def get(self, timeout: float) -> dict[str, Any] | None:
        self.reads += 1
        self.clock.now += self.step
        self.on_read()
        return copy.deepcopy(self.lease)

    def create(self, spec: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        if self.lease is not None:
            raise kube.Taken(self.reference, 409)
        self.lease = {"metadata": {"name": "leader", "resourceVersion": "1"}, "spec": dict(spec)}
        self.writes.append(dict(spec))
        return copy.deepcopy(self.lease)

    def update(
        self, lease: Mapping[str, Any], spec: Mapping[str, Any], timeout: float
    ) -> dict[str, Any]:
        if self.refuse_writes is not None:
            raise self.refuse_writes
        current = self.lease
        if current is None or (
            current["metadata"]["resourceVersion"] != lease["metadata"]["resourceVersion"]
        ):
            raise kube.Taken(self.reference, 409)
        version = str(int(current["metadata"]["resourceVersion"]) + 1)
        self.lease = {
            "metadata": {"name": "leader", "resourceVersion": version},
            "spec": dict(spec),
        }
        self.writes.append(dict(spec))
        return copy.deepcopy(self.lease)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def elector(store: FakeLease, clock: Clock) -> leadership.Elector:
    return leadership.Elector(store, "me", TIMINGS, clock=clock)


def test_a_standby_takes_a_lease_only_once_its_own_clock_says_it_expired(clock: Clock) -> None:
    store = FakeLease(clock, step=3.0)
    store.hold("other", duration=10)  # renewTime decades ago: a wall clock would take it now
    candidate = elector(store, clock)

    acquired = asyncio.run(candidate.acquire(asyncio.Event()))

    # First seen at 3 s, so it expires at 13 s: the reads at 6, 9 and 12 s leave it alone.
    assert acquired and candidate.leading
    assert store.reads == 5
    (taken,) = store.writes
    assert taken["holderIdentity"] == "me"
    assert taken["leaseTransitions"] == 4
    assert taken["acquireTime"] != ANCIENT


def test_a_holder_that_keeps_renewing_is_never_taken_over(clock: Clock) -> None:
    store = FakeLease(clock, step=6.0)  # longer apart than half the holder's term
    store.hold("other", duration=10)
    candidate = elector(store, clock)

    async def stand_by() -> bool:
        give_up = asyncio.Event()
        loop = asyncio.get_running_loop()

        def renewed_meanwhile() -> None:
            store.hold("other", duration=10, renewed=f"2026-01-01T00:00:{store.reads:02d}Z")
            if store.reads == 10:
                loop.call_soon_threadsafe(give_up.set)

        store.on_read = renewed_meanwhile
        return await candidate.acquire(give_up)

    assert not asyncio.run(stand_by())
    assert store.reads == 10, "60 s on the standby's clock, a change seen every 6 s"
    assert store.writes == []
    assert candidate.holder == "other"


def test_a_leader_renews_its_own_lease_without_a_transition(clock: Clock) -> None:
    store = FakeLease(clock, step=0.0)
    leader = elector(store, clock)

    async def take_and_renew() -> None:
        assert await leader.acquire(asyncio.Event())
        clock.now += 0.3
        assert await leader.acquire(asyncio.Event())

    asyncio.run(take_and_renew())
    created, renewed = store.writes
    assert renewed["holderIdentity"] == "me"
    assert renewed["acquireTime"] == created["acquireTime"]
    assert renewed["leaseTransitions"] == created["leaseTransitions"] == 0


def test_a_leader_gives_up_when_renewals_fail_for_the_renew_deadline(clock: Clock) -> None:
    store = FakeLease(clock, step=0.1)
    leader = elector(store, clock)

    async def lead() -> str:
        assert await leader.acquire(asyncio.Event())
        store.refuse_writes = kube.Unavailable("503: etcd is down", 503)
        clock.now += TIMINGS.renew_period  # the first renewal is due
        return await leader.keep()

    assert asyncio.run(lead()) == "not renewed for 0.5 s"
    assert not leader.leading
    # Tries at 0.3 and 0.4 s after the last renewal began; at 0.5 s it had to stop.
    assert store.reads == 1 + 2


def test_a_leader_gives_up_at_once_when_the_lease_is_taken(clock: Clock) -> None:
    store = FakeLease(clock, step=0.0)
    leader = elector(store, clock)

    async def lead() -> str:
        assert await leader.acquire(asyncio.Event())
        store.hold("usurper", duration=10)
        clock.now += TIMINGS.renew_period
        return await leader.keep()

    assert asyncio.run(lead()) == "taken by usurper"
    assert not leader.leading
    assert store.spec["holderIdentity"] == "usurper"


def test_a_stopped_leader_releases_the_lease(clock: Clock) -> None:
    store = FakeLease(clock, step=0.0)
    leader = elector(store, clock)

    async def lead_then_stop() -> None:
        assert await leader.acquire(asyncio.Event())
        await leader.release()

    asyncio.run(lead_then_stop())
    released = store.spec
    assert released["holderIdentity"] is None
    assert released["leaseDurationSeconds"] == 1
    assert released["leaseTransitions"] == 0
    assert not leader.leading


def test_release_leaves_a_lease_someone_else_holds(clock: Clock) -> None:
    store = FakeLease(clock, step=0.0)
    leader = elector(store, clock)

    async def lead_then_stop() -> None:
        assert await leader.acquire(asyncio.Event())
        store.hold("successor")
        await leader.release()
        reads = store.reads
        await leader.release()  # not leading any more: nothing to give back
        assert store.reads == reads

    asyncio.run(lead_then_stop())
    assert store.spec["holderIdentity"] == "successor"
    assert len(store.writes) == 1


def test_an_identity_names_its_pod_and_differs_for_each_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_NAME", "k8s-rendezvous-operator-7d9f-abcde")
    first, second = leadership.default_identity(), leadership.default_identity()
    assert first != second
    assert (
        leadership.pod_of(first)
        == leadership.pod_of(second)
        == "k8s-rendezvous-operator-7d9f-abcde"
    )
