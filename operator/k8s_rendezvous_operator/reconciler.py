"""The reconcile of each rendezvous: gather what the watches told us, decide
(:func:`.rounds.decide`), write, report. One reconcile runs per rendezvous at a time;
events arriving meanwhile are coalesced into one more pass. The kopf handlers that feed it
are in :mod:`.handlers`; the API calls go through :mod:`.kube`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from k8s_rendezvous.wire import codec, leases, objects, records, specs, statuses
from k8s_rendezvous_operator import (
    events,
    failed_checks,
    jobs,
    kube,
    membership,
    metrics,
    names,
    observe,
    owners,
    reachability,
    reasons,
    rounds,
    slices,
    workloads,
)
from k8s_rendezvous_operator.events import Key

log = logging.getLogger(__name__)

# Each reason's series is served at 0 from the start: Prometheus counts an increase only
# from an earlier sample, so a series first scraped at 1 would hide the first loss or
# closure of its reason from every rate() (the dashboard's "Members lost by cause",
# "closed, budget spent" and "Nodes refused by reason").
for _reason in reasons.LOST_REASONS:
    metrics.MEMBERS_LOST.labels(_reason)
for _reason in reasons.CLOSED_REASONS:
    metrics.CLOSED.labels(_reason)
for _reason in reasons.REFUSED_REASONS:
    metrics.NODES_REFUSED.labels(_reason)

PLANNED = frozenset(
    {reasons.CAUSE_FIRST_ROUND, reasons.CAUSE_NODES_JOINED, reasons.CAUSE_SPEC_CHANGED}
)
"""Causes of a round that are no recovery: the first, a scale-up, a spec edited."""


_REPORTS_KEPT = 1024
"""Names given back whose report is remembered (once per pod that made one)."""


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclasses.dataclass
class PodMemory:
    """What is known of one node's pod and its Lease; dropped with its rendezvous."""

    observation: rounds.PodObservation | None = None
    """``None``: the pod was never observed."""
    version: int = -1
    """The resourceVersion ``observation`` is from: an older answer is dropped."""
    node_name: str | None = None
    """The Kubernetes node it runs on, once known."""
    heartbeat: rounds.Heartbeat | None = None
    writer: str | None = None
    """The uid of the pod that wrote its Lease, where the Lease says."""
    lease_problem: str | None = None
    """Why its Lease's request cannot be read (said once, until it writes a good one)."""
    check_reported: failed_checks.Reported | None = None
    """The last failed health check of its Lease reported (each is said once)."""
    labelled: bool = False
    labelling: asyncio.Task[None] | None = None


@dataclasses.dataclass
class RendezvousMemory:
    """What is known and was done for one rendezvous; dropped whole when it is deleted."""

    body: dict[str, Any] | None = None
    """The newest body seen (``None``: only its nodes' Leases are known yet)."""
    entries: dict[str, leases.NodeEntry] = dataclasses.field(default_factory=dict)
    """Each node's request, as its Lease says."""
    forming_since: datetime.datetime | None = None
    """When its forming round began, as last decided (not written on its own: rule 10)."""
    unreadable: str | None = None
    """Why it does not decode, as last reported."""
    write_refused: str | None = None
    """Why the API server refused its next status, as last reported."""
    adopted: str | None = None
    """Made by a pod: the uid it was given its creator's owner for."""
    refused: dict[str, str] = dataclasses.field(default_factory=dict)
    """The pods whose requests are refused, with the reason reported."""
    expired: dict[str, leases.NodeEntry] = dataclasses.field(default_factory=dict)
    """The waiters not counted for want of heartbeats (rule 12), with the request
    reported: each request is reported once."""
    waiting: int = 0
    """Its ``nodesWaiting``, for the gauge summed over every rendezvous."""
    spares_short: bool = False
    """Its ``SparesReady`` is False, for the gauge counted over every rendezvous."""
    slices_written: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """What each of its RendezvousSlices was last written with."""
    published: slices.Publication | None = None
    """What its slices were last brought in step with."""
    node_labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    """The labels of the Kubernetes nodes its pods run on (for its rank order)."""
    probed: tuple[reachability.Target, ...] = ()
    """Its members whose agents answer probes, as last decided."""
    timer: asyncio.TimerHandle | None = None


def _uid(body: Mapping[str, Any]) -> object:
    return (body.get("metadata") or {}).get("uid")


def _probe_targets(
    key: Key, status: statuses.RendezvousStatus, requests: Mapping[str, leases.NodeEntry]
) -> tuple[reachability.Target, ...]:
    """The members of a sealed round (a stale round's are re-joining, or lost), and the
    nodes waiting, in any state: a spare cut off with the member it would replace must be
    known unreachable when that member is, not admitted in its place."""
    members = [
        (member.node, entry, False)
        for member in status.members
        if status.state is statuses.RoundState.SEALED
        and (entry := requests.get(member.node))
        and member.admits(entry)
    ]
    waiters = [(name, requests[name], True) for name in rounds.waiting(status, requests)]
    return tuple(
        reachability.Target(*key, node, entry.instance, entry.addr, entry.probe_port, waiting)
        for node, entry, waiting in (*members, *waiters)
        if entry.probe_port
    )


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
    ) -> None:
        self._api = api
        self._post = post
        self._clock = clock
        self.jobs = jobs.Jobs(
            api, post, self.request, self._as_jobs_see_it, worker_role=worker_role
        )
        self._owners = owners.Owners(api.get_owner)
        self._rendezvous: dict[Key, RendezvousMemory] = {}
        self._pods: dict[Key, PodMemory] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._starting = True
        self._unposted: list[tuple[Key, str, str]] = []
        self._warnings = events.WarningBudgets()
        self._series = metrics.RendezvousSeries()
        self._started_at = clock()
        self._unreachable: frozenset[reachability.Target] = frozenset()
        self._reporting: set[asyncio.Task[None]] = set()
        """Failed health checks being reported (each looks up its pod first)."""
        self._given_back: dict[tuple[str, str, str], None] = {}
        """(namespace, rendezvous, creator pod) of each pod-made Rendezvous deleted for the
        workload named so, as reported (once per pod; the oldest forgotten first)."""

    def _memory(self, key: Key) -> RendezvousMemory:
        return self._rendezvous.setdefault(key, RendezvousMemory())

    def _pod(self, pod: Key) -> PodMemory:
        return self._pods.setdefault(pod, PodMemory())

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
        return None if body is None or self.jobs.replaces(key, body) else body

    def observed(self, pod: Key) -> rounds.PodObservation | None:
        """The pod as last observed (``None``: never)."""
        memory = self._pods.get(pod)
        return None if memory is None else memory.observation

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
            and (observation := self.observed((key[0], name))) is not None
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
        if self.jobs.replaces(key, body):
            await self.jobs.replace(key, body)
            return
        if self._unposted:
            self._post_unposted(key, body)
        self.request(key)

    def _forget_rendezvous(self, key: Key) -> None:
        memory = self._rendezvous.pop(key, None)
        if memory is None:
            return
        for node in memory.entries:
            self._pods.pop((key[0], node), None)
        if memory.timer:
            memory.timer.cancel()
        self._series.forget(key)
        self._set_gauges()

    async def job_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        await self.jobs.seen(key, body, deleted)

    def pod_seen(
        self,
        key: Key,
        observation: rounds.PodObservation,
        rendezvous: str | None,
        node_name: str | None = None,
        version: int = -1,
    ) -> None:
        """A pod changed: its watch event, or the answer to our labelling of it (whichever
        is older than what we know is dropped)."""
        memory = self._pod(key)
        if version >= 0:
            if version < memory.version:
                return
            memory.version = version
        if node_name:
            memory.node_name = node_name
        if memory.observation == observation:
            return
        memory.observation = observation
        if rendezvous:
            self.request((key[0], rendezvous))

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
        node = self._pod(pod)
        node.heartbeat = (
            None
            if deleted or not lease.instance
            else rounds.Heartbeat(lease.instance, self._clock())
        )
        problem = None if deleted else lease.entry_problem
        if problem is not None and node.lease_problem is None:
            self._warn(
                key,
                self.known_body(key) or body,
                reasons.INVALID_ENTRY,
                reasons.invalid_entry(lease.node, problem),
                pod=lease.node,
            )
        node.lease_problem = problem
        if (failure := failed_checks.to_report(entry, node.check_reported)) is not None:
            assert entry is not None and entry.health_check is not None
            node.check_reported = failure
            task = asyncio.get_running_loop().create_task(
                self._report_failed_check(key, lease.node, entry.health_check)
            )
            self._reporting.add(task)
            task.add_done_callback(self._reporting.discard)
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

    def _warn(
        self,
        key: Key,
        body: Mapping[str, Any],
        reason: str,
        message: str,
        pod: str | None = None,
    ) -> None:
        """A Warning on the Rendezvous (on ``body`` if it is not known), within budget;
        while starting, kept until the Rendezvous' first event."""
        log.warning("Rendezvous %s/%s: %s: %s", *key, reason, message)
        if not self._warnings.allow(self._clock(), *key, pod):
            return
        if self._starting:  # kopf posts no Events from startup, and knows no Rendezvous yet
            self._unposted.append((key, reason, message))
            return
        self._post([self.known_body(key) or body], warning=True, reason=reason, message=message)

    async def _report_failed_check(
        self, key: Key, pod: str, report: leases.HealthCheckReport
    ) -> None:
        """A HealthCheckFailed Warning on the Rendezvous, its Job and the pod, naming the
        Kubernetes node the Pod object says it runs on (the pod's word is not taken for
        where it runs), within the Warning budgets like every Warning a pod can cause."""
        namespace = key[0]
        try:
            found = await asyncio.to_thread(self._api.get_pod, namespace, pod)
        except Exception:
            log.exception("reading pod %s/%s for its failed health check failed", namespace, pod)
            found = None
        node_name = None if found is None else (found.get("spec") or {}).get("nodeName")
        message = reasons.health_check_failed(pod, node_name, report)
        log.warning("Rendezvous %s/%s: %s: %s", *key, reasons.HEALTH_CHECK_FAILED, message)
        if not self._warnings.allow(self._clock(), *key, pod):
            return
        known = self.known_body(key)
        if self._starting or known is None:
            # A node may fail its check before the Rendezvous' first event reaches the
            # operator: said on the Rendezvous then, never on the Lease, where no one looks.
            self._unposted.append((key, reasons.HEALTH_CHECK_FAILED, message))
            return
        targets = [*events.rendezvous_targets(known), *([found] if found else [])]
        self._post(targets, warning=True, reason=reasons.HEALTH_CHECK_FAILED, message=message)

    def started(self) -> None:
        self._starting = False

    def _post_unposted(self, key: Key, body: Mapping[str, Any]) -> None:
        """Post the Warnings about ``key`` found while starting or before the Rendezvous was
        known, now that kopf can and it is (at most the budget's: bounded however long it
        never shows)."""
        for about, reason, message in self._unposted:
            if about == key:
                self._post([body], warning=True, reason=reason, message=message)
        self._unposted = [unposted for unposted in self._unposted if unposted[0] != key]

    def _report_expired(
        self,
        key: Key,
        body: Mapping[str, Any],
        spec: specs.RendezvousSpec,
        requests: Mapping[str, leases.NodeEntry],
        expired: tuple[str, ...],
    ) -> None:
        """Say once per request that it is not counted for want of heartbeats."""
        memory = self._memory(key)
        reported, memory.expired = memory.expired, {pod: requests[pod] for pod in expired}
        for pod in expired:
            if reported.get(pod) != requests[pod]:
                metrics.WAITERS_EXPIRED.inc()
                self._warn(
                    key,
                    body,
                    reasons.WAITER_EXPIRED,
                    reasons.waiter_expired(pod, spec.heartbeat_timeout_seconds),
                    pod=pod,
                )

    def _report_refusals(
        self, key: Key, body: Mapping[str, Any], refused: Mapping[str, membership.Refusal]
    ) -> None:
        """Say once per pod and reason why its request does not count."""
        memory = self._memory(key)
        for pod, refusal in refused.items():
            if memory.refused.get(pod) != refusal.reason:
                metrics.NODES_REFUSED.labels(refusal.reason).inc()
                self._warn(key, body, reasons.NODE_REFUSED, refusal.message, pod=pod)
        memory.refused = {pod: refusal.reason for pod, refusal in refused.items()}

    def _remember(self, key: Key, body: Mapping[str, Any]) -> None:
        memory = self._memory(key)
        if memory.body is None or objects.resource_version(body) > objects.resource_version(
            memory.body
        ):
            memory.body = dict(body)

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
            *(task for pod in self._pods.values() if (task := pod.labelling) is not None),
        ]:
            await asyncio.gather(*busy, return_exceptions=True)

    async def _loop(self, key: Key) -> None:
        try:
            while True:
                self._again.discard(key)
                try:
                    await self._reconcile(key)
                except Exception as error:
                    metrics.API_ERRORS.labels(type(error).__name__).inc()
                    log.exception("reconciling Rendezvous %s/%s failed; retrying in 1 s", *key)
                    await asyncio.sleep(1)
                    self._again.add(key)
                if key not in self._again:
                    return
        finally:
            del self._running[key]
            metrics.QUEUE_DEPTH.set(len(self._running))

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
        try:
            spec = specs.RendezvousSpec.from_dict(body.get("spec"))
            current = statuses.RendezvousStatus.from_dict(body.get("status"))
            if problem := rounds.slices_problem(spec, current):
                raise codec.DecodeError(problem)
        except codec.DecodeError as error:
            if memory.unreadable != str(error):
                memory.unreadable = str(error)
                await self._refuse(key, body, reasons.unreadable(error))
            return True
        memory.unreadable = None
        if self.jobs.replaces(key, body):
            return True  # an annotated Job's name: replaced with the Job's, not adopted
        creator = membership.creator_to_adopt(body, spec)
        if creator is not None and memory.adopted != body["metadata"].get("uid"):
            memory.adopted = body["metadata"].get("uid", "")
            if await self._adopt(key, body, creator):
                return False
        requests, pods, refused, claims = await self._gather(key, body, spec, current)
        if claims:
            await self._give_name_back(key, body, *min(claims.items()))
            return True
        job = self.jobs.owning(key, body)
        now = self._clock()
        cleared_at = self._exclusions_cleared_at(key, body)
        decision = rounds.decide(
            spec,
            current,
            requests,
            pods,
            now,
            liveness=rounds.Liveness(
                {
                    node: beat
                    for node in requests
                    if (pod := self._pods.get((namespace, node))) and (beat := pod.heartbeat)
                },
                since=self._started_at,
                unreachable=frozenset(
                    (target.node, target.instance)
                    for target in self._unreachable
                    if (target.namespace, target.rendezvous) == key
                ),
            ),
            expected_nodes=job.parallelism if job else None,
            close=job.finished if job else None,
            generation=int(body["metadata"].get("generation", 0)),
            forming_since=memory.forming_since,
            first_write="state" not in (body.get("status") or {}),
            refused=refused,
            exclusions_cleared_at=cleared_at,
        )
        if looking := self._looking_at(namespace, decision.awaiting):
            await asyncio.wait(looking, timeout=10)
            return False
        self._report_expired(key, body, spec, requests, decision.expired_waiters)
        memory.forming_since = decision.status.forming_since
        memory.probed = _probe_targets(key, decision.status, requests)
        if decision.write:
            written = await self._write(key, memory, body, decision, now)
            if written is not Written.WRITTEN:
                return written is not Written.CONFLICT
        await self._publish_slices(key, memory, spec, decision.status, requests)
        self._wake_at(key, decision.wake_at)
        return True

    def _exclusions_cleared_at(self, key: Key, body: Mapping[str, Any]) -> datetime.datetime | None:
        """The user's clear annotation; one that is not a time clears nothing and is
        reported, as a typo there must not stop the rendezvous."""
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        raw = annotations.get(objects.CLEAR_EXCLUDED_NODES_ANNOTATION)
        if raw is None:
            return None
        try:
            return codec.parse_time(raw, objects.CLEAR_EXCLUDED_NODES_ANNOTATION)
        except codec.DecodeError as error:
            self._warn(
                key,
                body,
                reasons.CLEAR_EXCLUDED_NODES_UNREADABLE,
                reasons.clear_excluded_nodes_unreadable(str(error)),
            )
            return None

    async def _gather(
        self,
        key: Key,
        body: Mapping[str, Any],
        spec: specs.RendezvousSpec,
        current: statuses.RendezvousStatus,
    ) -> tuple[
        dict[str, leases.NodeEntry],
        dict[str, rounds.PodObservation],
        tuple[records.Refusal, ...],
        dict[str, workloads.Reference],
    ]:
        """The requests that count (of pods of the workload), what is known of their pods,
        the refusals for the status, and the pods held back as their workload claims the
        name (:func:`membership.claimed_by`); refusals reported, unknown pods looked up."""
        namespace, name = key
        requests = dict(self._memory(key).entries)
        self._label_pods(namespace, name, requests)
        pods = {
            node: observation
            for node in requests
            if (observation := self.observed((namespace, node))) is not None
        }
        workload = membership.workload_of(body, spec)
        identities = await self._with_ancestors(
            namespace,
            workload,
            {node: observation.identity for node, observation in pods.items()},
        )
        admission = membership.admit(
            workload,
            requests,
            identities,
            frozenset(m.node for m in (*current.members, *current.left_behind)),
            {
                node: writer
                for node in requests
                if (pod := self._pods.get((namespace, node))) and (writer := pod.writer)
            },
        )
        self._report_refusals(key, body, admission.refused)
        refused = admission.published(requests)
        requests = admission.counted
        pods = {node: observation for node, observation in pods.items() if node in requests}
        if spec.rank_order_node_label:
            pods = await self._with_topology(key, spec.rank_order_node_label, requests, pods)
        return requests, pods, refused, admission.claims

    def _looking_at(self, namespace: str, nodes: tuple[str, ...]) -> list[asyncio.Task[None]]:
        """The labelling still under way of these pods, if they are still not observed:
        labelling a pod is how a restarted operator learns that a pod behind an old request
        is gone, so a round is never sealed with it before the answer (rule 11)."""
        return [
            task
            for node in nodes
            if (pod := self._pods.get((namespace, node))) is not None
            and pod.observation is None
            and (task := pod.labelling) is not None
        ]

    async def _write(
        self,
        key: Key,
        memory: RendezvousMemory,
        body: Mapping[str, Any],
        decision: rounds.Decision,
        now: datetime.datetime,
    ) -> Written:
        """Write the decided status over the one it was decided on, then report it."""
        namespace, name = key
        try:
            written = await asyncio.to_thread(
                self._api.write_status,
                namespace,
                name,
                body["metadata"]["resourceVersion"],
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
        except kube.Invalid as error:
            # Not retried until the next event: the same decision would be refused the
            # same way. Said once per distinct refusal, so that the condition written here
            # (an event itself) ends in one more refused write.
            if memory.write_refused != str(error):
                memory.write_refused = str(error)
                await self._refuse(key, body, reasons.write_refused(error))
            return Written.REFUSED
        memory.write_refused = None
        self._remember(key, written)
        self._report(written, decision, now)
        self._count(memory, decision)
        self._count_rendezvous(key, body, decision)
        return Written.WRITTEN

    async def _publish_slices(
        self,
        key: Key,
        memory: RendezvousMemory,
        spec: specs.RendezvousSpec,
        status: statuses.RendezvousStatus,
        requesters: Iterable[str],
    ) -> None:
        """Bring the RendezvousSlices in step with the status just decided (after it, so
        the status stays the record): those some node needs (:func:`.slices.needed`) whose
        content changed, at once."""
        body = memory.body
        if body is None or not status.slices:
            return
        indexes = slices.needed(status, requesters, memory.slices_written)
        publication = slices.publication(spec, status, indexes)
        if memory.published == publication:
            return
        changed = slices.changed(spec, status, indexes, memory.slices_written)
        await asyncio.gather(
            *(
                asyncio.to_thread(self._api.write_slice, key[0], body, index, content)
                for index, content in changed.items()
            )
        )
        memory.slices_written.update(changed)
        memory.published = publication

    async def _refuse(self, key: Key, body: Mapping[str, Any], problem: str) -> None:
        """A Rendezvous that does not decode, or whose next status the API server refuses
        (edited by hand, or by a foreign writer), is not guessed at: no round is decided
        until it is fixed. Say so where users look, once per distinct problem, so that our
        own write cannot make us loop."""
        namespace, name = key
        message = reasons.invalid_rendezvous(name, problem)
        log.warning("Rendezvous %s/%s: %s", namespace, name, message)
        self._post([body], warning=True, reason=reasons.INVALID_RENDEZVOUS, message=message)
        generation = int(body["metadata"].get("generation", 0))
        conditions = rounds.set_condition(
            (),
            rounds.CONDITION_READY,
            False,
            reasons.INVALID_RENDEZVOUS,
            message[:32768],
            self._clock(),
            generation,
        )
        try:
            await asyncio.to_thread(
                self._api.write_status,
                namespace,
                name,
                body["metadata"]["resourceVersion"],
                {"conditions": [condition.to_dict() for condition in conditions]},
            )
        except (kube.Conflict, kube.NotFound):
            if memory := self._rendezvous.get(key):  # changed meanwhile: look again at next event
                memory.unreadable = None

    def _count(self, memory: RendezvousMemory, decision: rounds.Decision) -> None:
        status = decision.status
        for loss in decision.losses:
            metrics.MEMBERS_LOST.labels(loss.reason).inc()
        if decision.sealed:
            metrics.ROUNDS_SEALED.inc()
            metrics.RANK_CHANGES.inc(sum(m.replaces is not None for m in status.members))
            if decision.forming_seconds is not None:
                metrics.SEAL_LATENCY.observe(decision.forming_seconds)
        if decision.closed:
            metrics.CLOSED.labels(status.closed_reason or "").inc()
        previous = decision.previous or status
        if status.restarts > previous.restarts:
            metrics.RESTARTS.inc(status.restarts - previous.restarts)
        # A closed rendezvous' nodesWaiting tells its members to end, not that nodes wait.
        memory.waiting = 0 if status.state is statuses.RoundState.CLOSED else status.nodes_waiting
        memory.spares_short = rounds.spares_short(status)
        self._set_gauges()

    def _count_rendezvous(
        self, key: Key, body: Mapping[str, Any], decision: rounds.Decision
    ) -> None:
        """Its own series: world size against maxNodes, and the time its latest round took
        to recover from a failure or a loss."""
        status = decision.status
        recovery = None
        if decision.sealed and status.history and status.history[-1].cause not in PLANNED:
            recovery = status.history[-1].forming_milliseconds / 1000
            metrics.RECOVERY.observe(recovery)
        sealed = status.state is statuses.RoundState.SEALED
        self._series.set(
            key,
            status.world_size if sealed else 0,
            int((body.get("spec") or {}).get("maxNodes") or 0),
            recovery,
        )

    def _set_gauges(self) -> None:
        """The gauges over every rendezvous remembered."""
        metrics.NODES_WAITING.set(sum(m.waiting for m in self._rendezvous.values()))
        metrics.SPARES_SHORT.set(sum(m.spares_short for m in self._rendezvous.values()))

    async def _with_topology(
        self,
        key: Key,
        label: str,
        nodes: Mapping[str, object],
        pods: dict[str, rounds.PodObservation],
    ) -> dict[str, rounds.PodObservation]:
        """Each node's value of the rank-order label of the Kubernetes node its pod runs on
        (pods read once if the watch has not shown them yet; node labels kept while the
        rendezvous lives)."""
        namespace = key[0]
        labels = self._memory(key).node_labels
        result = dict(pods)
        for pod in nodes:
            memory = self._pod((namespace, pod))
            node = memory.node_name
            if node is None:
                node = await asyncio.to_thread(self._api.pod_node_name, namespace, pod)
                if node is None:
                    continue
                memory.node_name = node
            if node not in labels:
                labels[node] = await asyncio.to_thread(self._api.node_labels, node)
            observation = result.get(pod, rounds.PodObservation())
            result[pod] = dataclasses.replace(observation, topology=labels[node].get(label))
        return result

    def _report(
        self, body: Mapping[str, Any], decision: rounds.Decision, now: datetime.datetime
    ) -> None:
        """Events after the write succeeded, where `kubectl describe` shows them."""
        status = decision.status
        previous = decision.previous or status
        targets = events.rendezvous_targets(body)
        for loss in decision.losses:
            self._post(
                targets,
                warning=True,
                reason=reasons.MEMBER_LOST,
                message=reasons.member_lost(loss.node, loss.rank, previous.round, loss.reason),
            )
        if decision.sealed and status.master is not None:
            forming = previous.forming_since
            message = reasons.round_sealed(
                status.round,
                [member.node for member in status.members],
                status.master.endpoint,
                None if forming is None else (now - forming).total_seconds(),
            )
            self._post(targets, warning=False, reason=reasons.ROUND_SEALED, message=message)
            log.info(
                "Rendezvous %s/%s: round %d sealed with %d nodes, master %s",
                body["metadata"].get("namespace"),
                body["metadata"]["name"],
                status.round,
                status.world_size,
                status.master.endpoint,
            )
        if (short := rounds.spares_lost(previous, status)) is not None:
            self._post(targets, warning=True, reason=reasons.SPARES_SHORT, message=short)
        if decision.closed:
            self._post(
                targets,
                warning=status.closed_reason in rounds.CLOSED_IN_FAILURE,
                reason=reasons.CLOSED,
                message=reasons.closed(status.closed_reason, status.closed_message),
            )

    def _label_pods(
        self, namespace: str, rendezvous: str, requests: Mapping[str, leases.NodeEntry]
    ) -> None:
        for node in requests:
            pod = self._pod((namespace, node))
            if pod.labelling is not None or (
                (pod.observation is not None or pod.labelled) and not self._replaced(pod)
            ):
                continue
            pod.labelling = asyncio.get_running_loop().create_task(
                self._label_pod((namespace, node), rendezvous)
            )

    async def _with_ancestors(
        self,
        namespace: str,
        workload: membership.Workload,
        identities: Mapping[str, membership.PodIdentity | None],
    ) -> dict[str, membership.PodIdentity | None]:
        """The pods' identities with the controllers their controller stands for, where
        that decides whether they belong (:func:`membership.to_climb`); a pod whose chain
        is not known now stays as it is, refused until its next event."""
        result = dict(identities)
        for node, identity in identities.items():
            if identity is None or (reference := membership.to_climb(workload, identity)) is None:
                continue
            above = await self._owners.above(namespace, reference)
            if above is not None:
                result[node] = dataclasses.replace(
                    identity,
                    ancestors=tuple(parent.uid for parent in above),
                    workload=workloads.workload(reference, above),
                )
        return result

    async def _adopt(self, key: Key, body: Mapping[str, Any], creator: str) -> bool:
        """Make the workload of the pod that created the Rendezvous its owner (once per
        Rendezvous): its controller, or the workload that stands behind it (a Job's JobSet,
        a LeaderWorkerSet: :mod:`.workloads`); ``True`` if it now has one. The pod only
        said that it made it (the admission policy holds that to its token): which
        workload that is, is the word of the Pod and its controllers' objects, never the
        pod's."""
        namespace, name = key
        try:
            pod = await asyncio.to_thread(self._api.get_pod, namespace, creator)
            controller = None if pod is None else workloads.controller(pod.get("metadata") or {})
            if controller is not None:
                above = await self._owners.above(namespace, controller) or ()
                owner = workloads.workload(controller, above).owner_reference()
                adopted = await asyncio.to_thread(
                    self._api.adopt_rendezvous, namespace, name, body["metadata"]["uid"], owner
                )
                self._remember(key, adopted)
                log.info("Rendezvous %s/%s: owned by %s/%s", *key, owner["kind"], owner["name"])
                return True
        except (kube.NotFound, kube.Conflict):
            return False  # deleted or made anew meanwhile: its own event follows
        except Exception:
            self._memory(key).adopted = None  # tried again on its next event
            log.exception("Rendezvous %s/%s: giving it its creator's owner failed", *key)
            return False
        message = reasons.no_owner(name, creator, pod_exists=pod is not None)
        self._warn(key, body, reasons.NO_OWNER, message)
        return False

    async def _give_name_back(
        self, key: Key, body: Mapping[str, Any], pod: str, claimant: workloads.Reference
    ) -> None:
        """Delete the pod-made Rendezvous ``body``, named after ``claimant``, whose pod
        ``pod`` asks to join it, and say so on both workloads: the claimant's pods make it
        anew (their creator role), as they would have, had the other pod not been first.
        The deleted one's maker can make it again only to see it deleted again, at the
        next join of the claimant's pods: each try costs it a create."""
        namespace, name = key
        held = names.holding(body)
        assert held.creator is not None, "only a pod-made Rendezvous is claimed"
        try:
            await asyncio.to_thread(self._api.delete_rendezvous, namespace, name, held.uid)
        except (kube.NotFound, kube.Conflict):
            return  # deleted, or made anew, meanwhile: that one's event follows
        except kube.Refused as error:  # RBAC or the admission policy of another release
            message = reasons.rendezvous_not_given_back(
                name, namespace, held.creator, held.owner_name, str(claimant), error
            )
            self._warn(key, body, reasons.RENDEZVOUS_NOT_OWNED, message, pod=held.creator)
            return
        log.warning(
            "Rendezvous %s/%s: made by pod %s (%s), deleted: it is named after %s, whose pod "
            "%s asks to join it",
            *key,
            held.creator,
            held.owner_name or "no owner",
            claimant,
            pod,
        )
        reported = (namespace, name, held.creator)
        if reported in self._given_back or not self._warnings.allow(
            self._clock(), namespace, name, held.creator
        ):
            return
        self._given_back[reported] = None
        if len(self._given_back) > _REPORTS_KEPT:
            del self._given_back[next(iter(self._given_back))]
        self._post(
            [
                events.object_reference(
                    namespace, claimant.api_version, claimant.kind, claimant.name, claimant.uid
                )
            ],
            warning=True,
            reason=reasons.RENDEZVOUS_REPLACED,
            message=reasons.rendezvous_given_back(
                name, held.creator, held.owner_name, str(claimant)
            ),
        )
        maker = await jobs.maker(self._api, namespace, held)
        if maker is not None:
            self._post(
                [maker],
                warning=True,
                reason=reasons.RENDEZVOUS_REPLACED,
                message=reasons.rendezvous_taken_back(
                    name, held.creator, held.owner_name, str(claimant)
                ),
            )

    @staticmethod
    def _replaced(pod: PodMemory) -> bool:
        """Whether the pod that wrote the Lease is not the one we know of by that name: a
        StatefulSet or PyTorchJob makes a failed pod anew under the same name, and the new
        one, not yet labelled, is read (and labelled) only by asking again."""
        known = pod.observation
        return (
            known is not None
            and known.identity is not None
            and pod.writer is not None
            and known.identity.uid != pod.writer
        )

    async def _label_pod(self, pod: Key, rendezvous: str) -> None:
        try:
            body = await asyncio.to_thread(self._api.label_pod, pod[0], pod[1], rendezvous)
            self._pod(pod).labelled = True
            # The answer is the pod as it is now: no need to wait for its watch event.
            self.pod_seen(
                pod,
                observe.observe_pod(body),
                rendezvous,
                node_name=(body.get("spec") or {}).get("nodeName"),
                version=objects.resource_version(body),
            )
        except kube.NotFound:
            self.pod_seen(pod, rounds.PodObservation(reasons.LOST_POD_NOT_FOUND), rendezvous)
            key = (pod[0], rendezvous)
            # A Lease a pod wrote (its uid annotation says which) outlives that pod: the pod
            # is gone, nothing is misconfigured, and a restarted operator would otherwise
            # warn again of every pod a long job ever replaced. Only a node that never ran
            # in a pod is told to.
            memory = self._pods.get(pod)
            never_a_pod = memory is None or memory.writer is None
            if never_a_pod and (known := self.known_body(key)) is not None:
                lease = objects.lease_name(rendezvous, pod[1])
                message = reasons.node_without_pod(pod[1], pod[0], lease)
                self._warn(key, known, reasons.NODE_WITHOUT_POD, message, pod=pod[1])
        except Exception:
            log.exception("labelling pod %s/%s failed; it is retried on the next change", *pod)
        finally:
            if (memory := self._pods.get(pod)) is not None:
                memory.labelling = None
