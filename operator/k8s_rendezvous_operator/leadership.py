"""Leader election over a ``coordination.k8s.io`` Lease, so several replicas are safe.

Every replica tries to hold one Lease in the operator's namespace. The holder renews it
every ``renew_period`` and runs kopf; the others stand by, looking again every
``retry_period``. As in client-go, expiry is judged by the standby's own monotonic clock,
from the moment it last saw the record change, never by comparing its clock with the
``renewTime`` another machine wrote.

The leader gives up when it has not renewed for ``renew_deadline`` or finds the Lease held
by someone else: kopf's stop flag is set at once, and the process exits (hard after
``exit_grace``) so that its Deployment restarts it as a standby. Both together are shorter
than ``lease_duration``, the earliest a standby can take over, so the old leader has
stopped before a new one starts. That narrows, but no lock can close, the window in which
an old leader's request already in flight lands late; what makes such a write harmless is
that every decision the operator writes carries the resourceVersion it was decided on.

A leader stopped by SIGTERM (a rollout, a drain) releases the Lease, so a standby takes
over within ``retry_period`` instead of waiting for the Lease to expire.

Not the Kubernetes client library's own election: it judges expiry by comparing wall
clocks, cannot be stopped on SIGTERM, and never releases. Its reads and writes of the
Lease go through :class:`k8s_rendezvous_operator.kube.LeaseLock`, like every other call,
and fail as :class:`k8s_rendezvous_operator.kube.ApiError`; the :class:`Elector` takes
anything that reads and writes a Lease as :class:`LeaseStore` does, and its clock, so a
test can drive expiry, renewal and release without waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from k8s_rendezvous.rest import own_namespace
from k8s_rendezvous.wire import codec
from k8s_rendezvous_operator import health, kube, metrics

log = logging.getLogger(__name__)


class LeaseStore(Protocol):
    """Blocking reads and writes of the one Lease (:class:`kube.LeaseLock`); every call
    bounded by ``timeout`` seconds."""

    @property
    def reference(self) -> str:
        """``Lease <namespace>/<name>``, for messages."""
        ...

    def get(self, timeout: float) -> dict[str, Any] | None:
        """The Lease, or ``None`` if there is none."""
        ...

    def create(self, spec: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Raises :class:`kube.Taken` if someone made it first."""
        ...

    def update(
        self, lease: Mapping[str, Any], spec: Mapping[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Replace the spec of ``lease`` as read; :class:`kube.Taken` if written since."""
        ...


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds. The defaults fail over within about 12 s of a leader's crash."""

    lease_duration: float = 10.0
    """How long a standby waits, after it last saw the Lease change, before taking it."""
    renew_period: float = 2.0
    """How often the leader renews."""
    retry_period: float = 2.0
    """How often a standby looks again, and a failed renewal is retried."""
    renew_deadline: float = 6.0
    """The leader gives up when its last successful renewal started this long ago."""
    exit_grace: float = 2.0
    """How long kopf may take to stop after leadership is lost before the process exits."""

    def __post_init__(self) -> None:
        if self.renew_deadline + self.exit_grace >= self.lease_duration:
            raise ValueError(
                "renew_deadline + exit_grace must be shorter than lease_duration, or an old "
                "leader could still act when a standby takes over"
            )
        if not 0 < self.renew_period < self.renew_deadline:
            raise ValueError("renew_period must be positive and shorter than renew_deadline")


@dataclasses.dataclass(frozen=True)
class Record:
    """The Lease's spec, the part that says who leads."""

    holder: str
    """Empty when nobody holds it (released)."""
    duration_seconds: int
    acquire_time: str | None
    renew_time: str | None
    transitions: int

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def to_spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder or None,
            "leaseDurationSeconds": self.duration_seconds,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


def _micro_time() -> str:
    return codec.format_time(datetime.datetime.now(datetime.timezone.utc))


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What one try found (applied by the event loop, so a try that overran its budget
    changes nothing)."""

    acquired: bool
    observed: Record | None
    observed_at: float
    started: float


class Elector:
    """Takes, keeps and releases the Lease for ``identity``.

    API calls run in a thread of their own, so a busy operator cannot delay a renewal.
    """

    def __init__(
        self,
        lock: LeaseStore,
        identity: str,
        timings: Timings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock = lock
        self.identity = identity
        self.timings = timings or Timings()
        self._clock = clock
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "leader-election")
        self._observed: Record | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        """When our last successful write started (monotonic); None: not leading."""

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None

    @property
    def holder(self) -> str:
        """Who held the Lease when we last looked ('' if nobody)."""
        return self._observed.holder if self._observed else ""

    def _expires_at(self, observed: Record | None, observed_at: float) -> float:
        return observed_at + (observed.duration_seconds if observed else 0)

    def _attempt(self, timeout: float, observed: Record | None, observed_at: float) -> _Outcome:
        """One read and at most one write: take or renew the Lease if it is free, expired
        or ours. Blocking; runs in the election thread."""
        started = self._clock()
        now = _micro_time()
        duration = max(1, round(self.timings.lease_duration))
        lease = self.lock.get(timeout)
        if lease is None:
            record = Record(self.identity, duration, now, now, 0)
            try:
                self.lock.create(record.to_spec(), timeout)
            except kube.Taken:
                return _Outcome(False, observed, observed_at, started)
            return _Outcome(True, record, self._clock(), started)
        found = Record.from_lease(lease)
        if found != observed:
            observed, observed_at = found, self._clock()
        ours = found.holder == self.identity
        if found.holder and not ours and self._clock() < self._expires_at(found, observed_at):
            return _Outcome(False, observed, observed_at, started)
        record = Record(
            self.identity,
            duration,
            found.acquire_time if ours else now,
            now,
            found.transitions if ours else found.transitions + 1,
        )
        try:
            self.lock.update(lease, record.to_spec(), timeout)
        except kube.Taken:
            return _Outcome(False, observed, observed_at, started)
        return _Outcome(True, record, self._clock(), started)

    async def _try(self, budget: float) -> bool:
        """``_attempt`` within ``budget`` seconds; an API error counts as a failed try."""
        loop = asyncio.get_running_loop()
        budget = max(budget, 0.1)
        try:
            outcome = await asyncio.wait_for(
                loop.run_in_executor(
                    self._executor, self._attempt, budget, self._observed, self._observed_at
                ),
                budget,
            )
        except Exception as error:
            log.warning("%s: could not read or write it: %r", self.lock.reference, error)
            return False
        self._observed, self._observed_at = outcome.observed, outcome.observed_at
        if outcome.acquired:
            self._renewed_at = outcome.started
        return outcome.acquired

    async def acquire(self, give_up: asyncio.Event) -> bool:
        """Stand by until the Lease is ours (True) or ``give_up`` is set (False)."""
        reported = None
        while not give_up.is_set():
            if await self._try(self.timings.retry_period):
                log.info(
                    "%s acquired by %s: this replica leads", self.lock.reference, self.identity
                )
                return True
            delay = self.timings.retry_period
            if self.holder and self.holder != self.identity:
                # Look again right when the holder's term would run out, if that is sooner.
                expiry = self._expires_at(self._observed, self._observed_at)
                delay = min(delay, max(0.05, expiry - self._clock() + 0.01))
                if reported != self.holder:
                    reported = self.holder
                    log.info(
                        "%s is held by %s: standing by as %s",
                        self.lock.reference,
                        self.holder,
                        self.identity,
                    )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(give_up.wait(), delay)
        return False

    async def keep(self) -> str:
        """Renew until leadership is lost; returns why. Cancel it to stop renewing."""
        timings = self.timings
        while True:
            renewed_at = self._renewed_at
            if renewed_at is None:
                return "not leading"
            await asyncio.sleep(max(0.0, renewed_at + timings.renew_period - self._clock()))
            deadline = renewed_at + timings.renew_deadline
            while True:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    self._renewed_at = None
                    return f"not renewed for {timings.renew_deadline:g} s"
                if await self._try(remaining):
                    break
                if self.holder not in ("", self.identity):
                    self._renewed_at = None
                    return f"taken by {self.holder}"
                await asyncio.sleep(min(timings.retry_period, max(0.0, deadline - self._clock())))

    async def release(self) -> None:
        """Hand the Lease back (holder cleared, 1 s duration) if it is still ours."""
        if not self.leading:
            return
        self._renewed_at = None

        def give_back() -> bool:
            lease = self.lock.get(self.timings.retry_period)
            if lease is None:
                return False
            found = Record.from_lease(lease)
            if found.holder != self.identity:
                return False
            now = _micro_time()
            self.lock.update(lease, Record("", 1, now, now, found.transitions).to_spec(), 5)
            return True

        loop = asyncio.get_running_loop()
        try:
            released = await loop.run_in_executor(self._executor, give_back)
        except Exception as error:
            log.warning("%s: could not release it: %r", self.lock.reference, error)
        else:
            if released:
                log.info("%s released by %s", self.lock.reference, self.identity)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def default_namespace() -> str:
    """POD_NAMESPACE (downward API), else the service account's namespace, else 'default'."""
    return own_namespace() or "default"


def default_identity() -> str:
    """The pod's name and a random suffix: a restarted container is a new candidate."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def pod_of(identity: str) -> str:
    """The pod a ``default_identity`` names."""
    return identity.partition("_")[0]


def _exit_now(reason: str) -> None:
    log.critical("exiting now: leadership lost (%s)", reason)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(1)


Operate = Callable[[asyncio.Event, asyncio.Event], Awaitable[None]]
"""``operate(stop_flag, ready_flag)``: run kopf until ``stop_flag`` is set."""


async def lead(elector: Elector, operate: Operate, liveness_endpoint: str | None) -> int:
    """Stand by until leading, then ``operate`` while the Lease is ours.

    Returns the process exit code: 0 after SIGTERM/SIGINT (the Lease released), 1 when
    leadership was lost (the Deployment restarts the pod as a standby).
    """
    loop = asyncio.get_running_loop()
    terminate = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, terminate.set)

    def status() -> dict[str, object]:
        return {
            "leader": elector.holder == elector.identity,
            "lease": elector.lock.reference,
            "holder": elector.holder,
        }

    # A standby is alive, not broken: it answers the probe too.
    probe = await health.serve(liveness_endpoint, status) if liveness_endpoint else None
    try:
        return await _lead(elector, operate, terminate, signals)
    finally:
        if probe is not None:
            await probe.cleanup()


async def _lead(
    elector: Elector,
    operate: Operate,
    terminate: asyncio.Event,
    signals: tuple[signal.Signals, ...],
) -> int:
    loop = asyncio.get_running_loop()
    try:
        acquired = await elector.acquire(terminate)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)  # kopf installs its own while it starts
    if not acquired:
        elector.close()
        return 0
    metrics.LEADER.set(1)

    stop = asyncio.Event()
    ready = asyncio.Event()
    lost: list[str] = []

    async def guard() -> None:
        reason = await elector.keep()
        lost.append(reason)
        log.error(
            "%s lost (%s): stopping the operator now; the process exits so that it "
            "restarts as a standby",
            elector.lock.reference,
            reason,
        )
        stop.set()
        timer = threading.Timer(elector.timings.exit_grace, _exit_now, (reason,))
        timer.daemon = True
        timer.start()

    async def stop_on_signals() -> None:
        # Once kopf runs, a signal sets the stop flag rather than kopf's own: kopf would
        # otherwise wait 5 s for the task that waits on the flag before it stops.
        await ready.wait()
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)

    # Created before kopf starts: kopf leaves the tasks that existed before it alone.
    helpers = [
        asyncio.create_task(guard(), name="leader-election renewals"),
        asyncio.create_task(stop_on_signals(), name="leader-election signals"),
    ]
    try:
        await operate(stop, ready)
    finally:
        metrics.LEADER.set(0)
        for task in helpers:
            task.cancel()
        for task in helpers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sig in signals:
            loop.remove_signal_handler(sig)
        if not lost:
            await elector.release()
        elector.close()
    return 1 if lost else 0


def run_elected(
    *,
    namespace: str | None,
    name: str,
    api_client: kube.ApiClient,
    liveness_endpoint: str | None,
    timings: Timings | None = None,
    **kopf_options: Any,
) -> None:
    """``kopf.run(**kopf_options)``, but only while this replica holds the Lease, with
    the liveness endpoint served from start to end (see health.py).

    Returns after SIGTERM/SIGINT (the Lease released); exits the process with status 1
    when leadership is lost, so that the pod restarts as a standby.
    """
    import kopf

    elector = Elector(
        kube.LeaseLock(api_client, namespace or default_namespace(), name),
        kopf_options.get("identity") or default_identity(),
        timings,
    )
    log.info("leader election: %s as %s", elector.lock.reference, elector.identity)

    async def operate(stop_flag: asyncio.Event, ready_flag: asyncio.Event) -> None:
        await kopf.operator(stop_flag=stop_flag, ready_flag=ready_flag, **kopf_options)

    code = asyncio.run(lead(elector, operate, liveness_endpoint))
    if code:
        raise SystemExit(code)


def run_unelected(*, liveness_endpoint: str | None, **kopf_options: Any) -> None:
    """``kopf.run(**kopf_options)`` for a single replica, with the liveness endpoint served
    as run_elected() serves it (see health.py)."""
    import kopf

    async def main() -> None:
        probe = (
            await health.serve(liveness_endpoint, lambda: {"leader": None})
            if liveness_endpoint
            else None
        )
        metrics.LEADER.set(1)
        try:
            await kopf.operator(**kopf_options)
        finally:
            metrics.LEADER.set(0)
            if probe is not None:
                await probe.cleanup()

    asyncio.run(main())
