"""The reconcile of each rendezvous: gather what the watches told us, decide
(:func:`.rounds.decide`), write, report. One reconcile runs per rendezvous at a time;
events arriving meanwhile are coalesced into one more pass. A pass reads the Rendezvous
once, as a :class:`.rendezvous_view.RendezvousView` (decoded once per version of it), and
hands that view to everything it calls.

The kopf handlers that feed it are in :mod:`.handlers`; the API calls go through
:mod:`.kube`. What is known of each node's pod is kept in :mod:`.pods`, what the reconcile
says is said by :mod:`.reporting`, and whose a Rendezvous is, settled by :mod:`.ownership`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from k8s_rendezvous import backoff
from k8s_rendezvous.wire import codec, leases, objects, records, statuses
from k8s_rendezvous_operator import (
    events,
    failed_checks,
    jobs,
    kube,
    lease_sweep,
    membership,
    metrics,
    names,
    observe,
    ownership,
    pods,
    reachability,
    reasons,
    rendezvous_view,
    reporting,
    rounds,
    slices,
    workloads,
)
from k8s_rendezvous_operator.events import Key
from k8s_rendezvous_operator.rendezvous_view import RendezvousView

log = logging.getLogger(__name__)


MAX_PAUSE = 0.5
"""Seconds, the longest pause between two passes of a rendezvous (:meth:`Reconciler._loop`)."""


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


RETRY: Final = backoff.Backoff(base=0.5, cap=30.0)
"""How a Rendezvous whose reconcile failed (the API server unreachable or overloaded, a
bug) is tried again: after a wait drawn below a ceiling that doubles from 0.5 s to 30 s
(full jitter), so that the rendezvous that failed together (an API server restart) do
not come back together. Counted per rendezvous: one failing delays no other."""
HOLD: Final = backoff.Backoff(base=60.0, cap=900.0, jitter=0.5)
"""How long a Rendezvous whose status the API server refused for good (invalid, too
large) waits before the same decision is tried again, unless it changes first: its next
write would be refused the same way, so only a change (a spec or status edited) or, for a
limit raised outside it (etcd's), this wait brings it back. 30-60 s the first time, up to
7.5-15 min."""


@dataclasses.dataclass(frozen=True)
class Hold:
    """No pass runs for a Rendezvous whose status write was refused for good while it
    stays at ``version`` (the version the refusal's condition made), until ``until``."""

    version: str
    until: datetime.datetime


@dataclasses.dataclass
class RendezvousMemory:
    """What is known and was done for one rendezvous; dropped whole when it is deleted."""

    body: dict[str, Any] | None = None
    """The newest body seen (``None``: only its nodes' Leases are known yet)."""
    read: tuple[dict[str, Any], RendezvousView | codec.DecodeError] | None = None
    """A body and what :func:`.rendezvous_view.read` made of it: the view, or why there is
    none (see :meth:`view`)."""
    entries: dict[str, leases.NodeEntry] = dataclasses.field(default_factory=dict)
    """Each node's request, as its Lease says."""
    forming_since: datetime.datetime | None = None
    """When its forming round began, as last decided (not written on its own: rule 10)."""
    unreadable: str | None = None
    """Why it does not decode, as last reported."""
    write_refused: str | None = None
    """Why the API server refused its next status, as last reported."""
    refusals: int = 0
    """Its status writes refused for good in a row (the :data:`HOLD` attempt)."""
    hold: Hold | None = None
    """Set while its refused status is not tried again (:meth:`Reconciler._held`)."""
    failures: int = 0
    """Its reconciles failed in a row (the :data:`RETRY` attempt)."""
    adopted: str | None = None
    """Made by a pod: the uid it was given its creator's owner for."""
    slices_written: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """What each of its RendezvousSlices was last written with."""
    published: slices.Publication | None = None
    """What its slices were last brought in step with."""
    node_labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """The labels of the Kubernetes nodes its pods run on (for its rank order)."""
    probed: tuple[reachability.Target, ...] = ()
    """Its members whose agents answer probes, as last decided."""
    checked: membership.Checked = dataclasses.field(default_factory=membership.Checked)
    """Its requests as last checked against their pods."""
    timer: asyncio.TimerHandle | None = None

    def view(self) -> RendezvousView | codec.DecodeError:
        """:attr:`body` read, or why it cannot be. Decoded at the first pass over that
        body only: every pass until the next write or event (each join, each heartbeat
        that expires a waiter, each pod change) reads the same version, and a status of
        1000 members costs milliseconds to decode."""
        assert self.body is not None, "only a known Rendezvous is reconciled"
        if self.read is None or self.read[0] is not self.body:
            try:
                self.read = (self.body, rendezvous_view.read(self.body))
            except codec.DecodeError as error:
                self.read = (self.body, error)
        return self.read[1]


def _uid(body: Mapping[str, Any]) -> object:
    return (body.get("metadata") or {}).get("uid")


class Written(enum.Enum):
    """How a status write ended."""

    WRITTEN = enum.auto()
    CONFLICT = enum.auto()
    """The rendezvous changed since it was read: decide again on the fresh one."""
    GONE = enum.auto()
    REFUSED = enum.auto()
    """Invalid: not retried until the next event, as the same decision would be refused."""


class Reconciler:
    """Holds what the watches told us and runs one reconcile per rendezvous at a time."""

    def __init__(
        self,
        api: kube.ReconcilerApi,
        post: events.Poster,
        clock: Callable[[], datetime.datetime] = _utcnow,
        *,
        worker_role: str | None = None,
        retry: backoff.Backoff = RETRY,
        hold: backoff.Backoff = HOLD,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._api = api
        self._clock = clock
        self._retry = retry
        self._hold = hold
        self._draw = draw
        self.jobs = jobs.Jobs(
            api, post, self.request, self._as_jobs_see_it, worker_role=worker_role
        )
        self._reporter = reporting.Reporter(api, post, clock, self.known_body)
        self.pods = pods.Pods(api, self._reporter, self.request, self.known_body)
        """What is known of each node's pod; the pod watch's events go to its ``seen``."""
        self._ownership = ownership.Ownership(api, self._reporter)
        self._rendezvous: dict[Key, RendezvousMemory] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._started_at = clock()
        self._unreachable: frozenset[reachability.Target] = frozenset()
        self._reporting: set[asyncio.Task[None]] = set()
        """Failed health checks being reported (each looks up its pod first)."""

    def _memory(self, key: Key) -> RendezvousMemory:
        return self._rendezvous.setdefault(key, RendezvousMemory())

    def remembers(self, key: Key) -> bool:
        """Whether anything of Rendezvous ``key`` is kept (its body, or requests for it)."""
        return key in self._rendezvous

    def known_body(self, key: Key) -> dict[str, Any] | None:
        """The newest body of Rendezvous ``key`` the watch showed, if any."""
        memory = self._rendezvous.get(key)
        return None if memory is None else memory.body

    def _as_jobs_see_it(self, key: Key) -> dict[str, Any] | None:
        """Rendezvous ``key`` as the annotated Job of its name is to see it: none while it
        is a pod-made one that the Job's replaces (:meth:`.jobs.Jobs.replaces`), so the
        Job's pods are given the env for the Job's Rendezvous, made in its place."""
        body = self.known_body(key)
        return None if body is None or self.jobs.replaces(key, names.holding(body)) else body

    def excluded_nodes(self, key: Key) -> tuple[str, ...]:
        """The Kubernetes nodes the workload of Rendezvous ``key`` is kept off (for the
        webhook), from what the watches showed: never a request to the API."""
        body = self._as_jobs_see_it(key)
        if body is None:
            return ()
        members = (body.get("status") or {}).get("members") or []
        pods = {
            name: observation
            for member in members
            if isinstance(member, Mapping)
            and isinstance(name := member.get("node"), str)
            and (observation := self.pods.observed((key[0], name))) is not None
        }
        return observe.excluded_kube_nodes(body, self._clock(), pods)

    # -- observations ------------------------------------------------------------------

    async def rendezvous_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        if deleted:
            known = self.known_body(key)
            if known is None or _uid(known) == _uid(body):
                # Not one made anew under the name, whose event came first: its own watch
                # stream (kopf's are per object) need not follow this one's.
                self._forget_rendezvous(key)
            await self.jobs.make_again(key, body)
            return
        self._remember(key, body)
        if self.jobs.replaces(key, names.holding(body)):
            await self.jobs.replace(key, body)
            return
        self._reporter.post_unposted(key, body)
        self.request(key)

    def _forget_rendezvous(self, key: Key) -> None:
        memory = self._rendezvous.pop(key, None)
        if memory is None:
            return
        self.pods.forget(key[0], memory.entries)
        self.pods.forget_marks(key)
        if memory.timer:
            memory.timer.cancel()
        self._reporter.forget(key)

    async def job_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        await self.jobs.seen(key, body, deleted)

    def leases_listed(self, bodies: Iterable[Mapping[str, Any]]) -> None:
        """Every node's Lease, listed at start: each is read on its own, so that one no
        one can read (a pod wrote it) is that Lease's refusal, never the start's."""
        for body in bodies:
            metadata = body.get("metadata")
            if isinstance(metadata, Mapping) and isinstance(metadata.get("namespace"), str):
                self.lease_changed(metadata["namespace"], body, deleted=False)

    def lease_changed(self, namespace: str, body: Mapping[str, Any], deleted: bool) -> None:
        """A Lease with the rendezvous label, as the API server gives it: read (an entry
        that cannot be read is reported as its node's, :meth:`lease_seen`), and any
        failure to handle it is logged as this Lease's alone."""
        try:
            if (lease := leases.NodeLease.from_body(body)) is not None:
                self.lease_seen(namespace, lease, body, deleted=deleted)
        except Exception:  # a bug, not the pod's input: this Lease's, not every Lease's
            log.exception(
                "reading Lease %s/%s failed; it is read again at its next change",
                namespace,
                (body.get("metadata") or {}).get("name"),
            )

    def lease_seen(
        self,
        namespace: str,
        lease: leases.NodeLease,
        body: Mapping[str, Any],
        deleted: bool,
    ) -> None:
        """A node's Lease changed. A renewal is only remembered (expiries are checked by
        the timer the last decision set); a new request reconciles its rendezvous."""
        pod, key = (namespace, lease.node), (namespace, lease.rendezvous)
        entry = None if deleted else lease.entry
        node = self.pods.memory(pod)
        node.heartbeat = (
            None
            if deleted or not lease.instance
            else rounds.Heartbeat(lease.instance, self._clock())
        )
        problem = None if deleted else lease.entry_problem
        if problem is not None and node.lease_problem is None:
            self._reporter.warn(
                key,
                body,
                reasons.INVALID_ENTRY,
                reasons.invalid_entry(lease.node, problem),
                pod=lease.node,
            )
        node.lease_problem = problem
        if (failure := failed_checks.to_report(entry, node.check_reported)) is not None:
            assert entry is not None and entry.health_check is not None
            node.check_reported = failure
            task = asyncio.get_running_loop().create_task(
                self._reporter.failed_check(key, lease.node, entry.health_check)
            )
            self._reporting.add(task)
            task.add_done_callback(self._reporting.discard)
        self.pods.lease_seen(
            pod, None if deleted else lease_sweep.LeaseRead.from_body(lease.rendezvous, body)
        )
        writer = None if deleted else lease.pod_uid
        wrote_anew = node.writer != writer
        node.writer = writer
        if key not in self._rendezvous and entry is None:
            return  # e.g. garbage collected after its Rendezvous
        entries = self._memory(key).entries
        if entries.get(lease.node) == entry and not wrote_anew:
            return
        if entry is None:
            entries.pop(lease.node, None)
            if not entries and self._rendezvous[key].body is None:
                # A Lease for a rendezvous that does not exist (collected with its missing
                # owner): what is kept for made-up names ends with their Leases.
                self._forget_rendezvous(key)
                return
        else:
            entries[lease.node] = entry
        self.request(key)

    def started(self) -> None:
        self._reporter.started()

    def _remember(self, key: Key, body: Mapping[str, Any]) -> None:
        memory = self._memory(key)
        if memory.body is None or objects.resource_version(body) > objects.resource_version(
            memory.body
        ):
            memory.body = dict(body)
            memory.failures = 0  # a new version: what failed may not any more

    # -- probes ------------------------------------------------------------------------

    def probe_targets(self) -> Iterator[reachability.Target]:
        """Every member to probe: of each rendezvous, its round's members whose agents
        answer probes."""
        for memory in self._rendezvous.values():
            yield from memory.probed

    def probes_judged(self, unreachable: frozenset[reachability.Target]) -> None:
        """The prober's verdict after a round of probes: reconcile where a member has just
        become unreachable."""
        newly, self._unreachable = unreachable - self._unreachable, unreachable
        for target in newly:
            log.warning(
                "Rendezvous %s/%s: pod %s answers no probe at %s port %d",
                target.namespace,
                target.rendezvous,
                target.node,
                target.addr,
                target.port,
            )
            self.request((target.namespace, target.rendezvous))

    # -- scheduling --------------------------------------------------------------------

    def request(self, key: Key) -> None:
        """Reconcile ``key`` now, or once more after the reconcile in progress."""
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.get_running_loop().create_task(self._loop(key))
        metrics.QUEUE_DEPTH.set(len(self._running))

    async def idle(self) -> None:
        """Wait until no reconcile runs and no pod is being looked at (nothing follows
        from what is known so far; what a test waits for)."""
        while busy := [
            *self._running.values(),
            *self._reporting,
            *self.pods.tasks(),
        ]:
            await asyncio.gather(*busy, return_exceptions=True)

    async def _loop(self, key: Key) -> None:
        """Passes of ``key`` while events ask for them. Each pass is followed by a pause
        as long as the CPU time it took (at most :data:`MAX_PAUSE`): a pass reads every
        request of the rendezvous, and without the pause a world of thousands forming
        would take one pass per join, each as long as the world is large; with it the
        events that arrive meanwhile are taken in together, and a rendezvous' passes use
        at most half of the operator's time. CPU time, not wall time: a pass of a small
        world mostly waits for its write, and pausing that long would only delay it."""
        try:
            while True:
                self._again.discard(key)
                began = time.thread_time()
                try:
                    await self._reconcile(key)
                except Exception as error:
                    metrics.API_ERRORS.labels(type(error).__name__).inc()
                    delay = self._retry_delay(key)
                    log.exception(
                        "reconciling Rendezvous %s/%s failed; retrying in %.1f s", *key, delay
                    )
                    # In this rendezvous' own task: the others' reconciles go on meanwhile.
                    await asyncio.sleep(delay)
                    self._again.add(key)
                else:
                    if (memory := self._rendezvous.get(key)) is not None:
                        memory.failures = 0
                    # After a failure its backoff has already let the events gather.
                    await asyncio.sleep(min(time.thread_time() - began, MAX_PAUSE))
                if key not in self._again:
                    return
        finally:
            del self._running[key]
            metrics.QUEUE_DEPTH.set(len(self._running))

    def _retry_delay(self, key: Key) -> float:
        """The wait before Rendezvous ``key`` is reconciled again after a failure."""
        memory = self._rendezvous.get(key)
        if memory is None:  # forgotten meanwhile: the next pass finds nothing to do
            return self._retry.delay(0, self._draw)
        delay = self._retry.delay(memory.failures, self._draw)
        memory.failures += 1
        return delay

    def _wake_at(self, key: Key, moment: datetime.datetime | None) -> None:
        memory = self._rendezvous.get(key)
        if memory is None:
            return
        if memory.timer:
            memory.timer.cancel()
            memory.timer = None
        if moment is not None:
            delay = max(0.0, (moment - self._clock()).total_seconds())
            memory.timer = asyncio.get_running_loop().call_later(delay, self.request, key)

    # -- the reconcile -----------------------------------------------------------------

    async def _reconcile(self, key: Key) -> None:
        for _ in range(5):
            memory = self._rendezvous.get(key)
            if memory is None or memory.body is None:
                return
            if await self._reconcile_once(key, memory, memory.body):
                return
        self._again.add(key)  # lost five races in a row: try again after the next event

    async def _reconcile_once(
        self, key: Key, memory: RendezvousMemory, body: dict[str, Any]
    ) -> bool:
        """Gather, decide, write, report; ``False`` to decide again at once (the body or
        what the decision awaited changed)."""
        namespace = key[0]
        if self._held(memory, body):
            return True
        view = memory.view()
        if isinstance(view, codec.DecodeError):
            await self._refuse_unreadable(key, memory, body, view)
            return True
        memory.unreadable = None
        if self.jobs.replaces(key, view.holding):
            return True  # an annotated Job's name: replaced with the Job's, not adopted
        creator = view.creator_to_adopt
        if creator is not None and memory.adopted != view.uid:
            memory.adopted = view.uid
            if await self._adopt(key, memory, view, creator):
                return False
        requests, pods, refused, claims = await self._gather(memory, view)
        if claims:
            await self._ownership.give_name_back(view, *min(claims.items()))
            return True
        job = self.jobs.owning(key, view.holding)
        now = self._clock()
        if view.exclusions_clear_problem is not None:
            self._reporter.warn(
                key,
                view.reference,
                reasons.CLEAR_EXCLUDED_NODES_UNREADABLE,
                reasons.clear_excluded_nodes_unreadable(view.exclusions_clear_problem),
            )
        decision = rounds.decide(
            view.spec,
            view.status,
            requests,
            pods,
            now,
            liveness=self._liveness(key, requests),
            expected_nodes=job.parallelism if job else None,
            close=job.finished if job else None,
            generation=view.generation,
            forming_since=memory.forming_since,
            first_write=not view.status_written,
            refused=refused,
            exclusions_cleared_at=view.exclusions_cleared_at,
        )
        if looking := self.pods.looking_at(namespace, decision.awaiting):
            await asyncio.wait(looking, timeout=10)
            return False
        self._reporter.expired_waiters(view, requests, decision.expired_waiters)
        memory.forming_since = decision.status.forming_since
        memory.probed = reachability.targets(key, decision.status, requests)
        if decision.write:
            written = await self._write(memory, view, decision, now)
            if written is not Written.WRITTEN:
                return written is not Written.CONFLICT
        await self._publish_slices(memory, view, decision.status, requests)
        self._wake_at(key, decision.wake_at)
        status = decision.status
        self.pods.sweep(key, frozenset(m.node for m in (*status.members, *status.left_behind)))
        return True

    def _held(self, memory: RendezvousMemory, body: Mapping[str, Any]) -> bool:
        """Whether no pass is to run: its status was refused for good, and since then
        neither has the Rendezvous changed (only our condition was written) nor has the
        hold's wait ended (its timer brings the next pass). Every join, pod change and
        probe verdict would otherwise send the same refused write again."""
        hold = memory.hold
        if hold is None:
            return False
        if (body.get("metadata") or {}).get("resourceVersion") == hold.version and (
            self._clock() < hold.until
        ):
            return True
        memory.hold = None
        return False

    def _liveness(self, key: Key, requests: Iterable[str]) -> rounds.Liveness:
        """What the Leases' heartbeats and the probes say of the nodes behind ``requests``."""
        return rounds.Liveness(
            self.pods.heartbeats(key[0], requests),
            since=self._started_at,
            unreachable=frozenset(
                (target.node, target.instance)
                for target in self._unreachable
                if (target.namespace, target.rendezvous) == key
            ),
        )

    async def _refuse_unreadable(
        self, key: Key, memory: RendezvousMemory, body: Mapping[str, Any], error: Exception
    ) -> None:
        """Refuse ``body``, which does not decode: once per distinct problem."""
        if memory.unreadable == str(error):
            return
        memory.unreadable = str(error)
        metadata = body["metadata"]
        refused = await self._reporter.refuse(
            key,
            body,
            int(metadata.get("generation", 0)),
            metadata["resourceVersion"],
            reasons.INVALID_RENDEZVOUS,
            reasons.invalid_rendezvous(key[1], reasons.unreadable(error)),
        )
        if refused is None:  # changed meanwhile, or not written: look again at its next event
            memory.unreadable = None

    async def _adopt(
        self, key: Key, memory: RendezvousMemory, view: RendezvousView, creator: str
    ) -> bool:
        """Give the Rendezvous its creator's workload as owner (once per Rendezvous:
        :meth:`.ownership.Ownership.adopt`); ``True`` if it now has one."""
        try:
            adopted = await self._ownership.adopt(view, creator)
        except Exception:
            memory.adopted = None  # tried again on its next event
            log.exception("Rendezvous %s/%s: giving it its creator's owner failed", *key)
            return False
        if adopted is None:
            return False
        self._remember(key, adopted)
        return True

    async def _gather(
        self, memory: RendezvousMemory, view: RendezvousView
    ) -> tuple[
        dict[str, leases.NodeEntry],
        dict[str, rounds.PodObservation],
        tuple[records.Refusal, ...],
        dict[str, workloads.Reference],
    ]:
        """The requests that count (of pods of the workload), what is known of their pods,
        the refusals for the status, and the pods held back as their workload claims the
        name (:func:`membership.claimed_by`); refusals reported, unknown pods looked up."""
        namespace, name = view.key
        requests = dict(memory.entries)
        self.pods.label(namespace, name, requests)
        pods = {
            node: observation
            for node in requests
            if (observation := self.pods.observed((namespace, node))) is not None
        }
        identities = await self._ownership.with_ancestors(
            namespace,
            view.workload,
            {node: observation.identity for node, observation in pods.items()},
        )
        status = view.status
        admission = membership.admit(
            view.workload,
            requests,
            identities,
            frozenset(m.node for m in (*status.members, *status.left_behind)),
            self.pods.writers(namespace, requests),
            memory.checked,
        )
        self._reporter.refusals(view, admission.refused)
        refused = admission.published(requests)
        requests = admission.counted
        pods = {node: observation for node, observation in pods.items() if node in requests}
        if label := view.spec.rank_order_node_label:
            pods = await self.pods.with_topology(
                namespace, label, requests, pods, memory.node_labels
            )
        return requests, pods, refused, admission.claims

    async def _write(
        self,
        memory: RendezvousMemory,
        view: RendezvousView,
        decision: rounds.Decision,
        now: datetime.datetime,
    ) -> Written:
        """Write the decided status over the version it was decided on, then report it."""
        namespace, name = key = view.key
        try:
            written = await asyncio.to_thread(
                self._api.write_status,
                namespace,
                name,
                view.resource_version,
                decision.status.operator_fields(),
            )
        except kube.Conflict:
            metrics.WRITE_CONFLICTS.inc()
            fresh = await asyncio.to_thread(self._api.get_rendezvous, namespace, name)
            self._remember(key, fresh)
            return Written.CONFLICT
        except kube.NotFound:
            memory.body = None
            return Written.GONE
        except (kube.Invalid, kube.TooLarge) as error:
            await self._refused(memory, view, decision, error)
            return Written.REFUSED
        memory.write_refused = None
        memory.refusals = 0
        self._remember(key, written)
        self._reporter.written(view, decision, now)
        return Written.WRITTEN

    async def _refused(
        self,
        memory: RendezvousMemory,
        view: RendezvousView,
        decision: rounds.Decision,
        error: kube.ApiError,
    ) -> None:
        """The API server refused the decided status for good: say so in the ``Ready``
        condition (a small write, which fits where the status did not) and one Warning
        per distinct refusal, and hold the Rendezvous (:meth:`_held`) until it changes or
        the :data:`HOLD` wait ends."""
        key = view.key
        metrics.STATUS_WRITES_REFUSED.labels(type(error).__name__).inc()
        delay = self._hold.delay(memory.refusals, self._draw)
        memory.refusals += 1
        if isinstance(error, kube.TooLarge):
            fields = decision.status.operator_fields()
            reason = reasons.STATUS_TOO_LARGE
            message = reasons.status_too_large(
                len(decision.status.members), len(json.dumps(fields)), error, delay
            )
        else:
            reason = reasons.INVALID_RENDEZVOUS
            message = reasons.invalid_rendezvous(key[1], reasons.write_refused(error))
        said, memory.write_refused = memory.write_refused, str(error)
        written = await self._reporter.refuse(
            key,
            view.reference,
            view.generation,
            view.resource_version,
            reason,
            message,
            warn=said != str(error),
        )
        version = view.resource_version
        if written is not None:  # held at our condition's version, not released by its echo
            self._remember(key, written)
            version = written["metadata"]["resourceVersion"]
        until = self._clock() + datetime.timedelta(seconds=delay)
        memory.hold = Hold(version, until)
        self._wake_at(key, until)

    async def _publish_slices(
        self,
        memory: RendezvousMemory,
        view: RendezvousView,
        status: statuses.RendezvousStatus,
        requesters: Iterable[str],
    ) -> None:
        """Bring the RendezvousSlices in step with the status just decided (after it, so
        the status stays the record): those some node needs (:func:`.slices.needed`) whose
        content changed, at once."""
        if not status.slices:
            return
        indexes = slices.needed(status, requesters, memory.slices_written)
        publication = slices.publication(view.spec, status, indexes)
        if memory.published == publication:
            return
        changed = slices.changed(view.spec, status, indexes, memory.slices_written)
        await asyncio.gather(
            *(
                asyncio.to_thread(
                    self._api.write_slice, view.namespace, view.name, view.uid, index, content
                )
                for index, content in changed.items()
            )
        )
        memory.slices_written.update(changed)
        memory.published = publication
