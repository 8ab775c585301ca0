"""What the reconcile says: its Events, where `kubectl describe` shows them, and its
metrics. Every Warning a pod can cause is posted within the budgets of
:class:`.events.WarningBudgets`, and held while the operator starts (kopf posts no Events
from startup) until its Rendezvous is known; what a decision did is said only after its
write succeeded."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

from k8s_rendezvous.wire import leases, statuses
from k8s_rendezvous_operator import events, kube, membership, metrics, reasons, rounds
from k8s_rendezvous_operator.events import Key
from k8s_rendezvous_operator.rendezvous_view import RendezvousView

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


class Reporter:
    """Posts the reconcile's Events and keeps its metrics, and remembers, per rendezvous,
    what it said once (forgotten with the rendezvous: :meth:`forget`)."""

    def __init__(
        self,
        api: kube.ReconcilerApi,
        post: events.Poster,
        clock: Callable[[], datetime.datetime],
        known_body: Callable[[Key], Mapping[str, Any] | None],
    ) -> None:
        self.post = post
        self._api = api
        self._clock = clock
        self._known_body = known_body
        self._warnings = events.WarningBudgets()
        self._starting = True
        self._unposted: list[tuple[Key, str, str]] = []
        self._series = metrics.RendezvousSeries()
        self._waiting: dict[Key, int] = {}
        """Each rendezvous' ``nodesWaiting``, for the gauge summed over all."""
        self._spares_short: set[Key] = set()
        """The rendezvous whose ``SparesReady`` is False, for the gauge counting them."""
        self._expired: dict[Key, dict[str, leases.NodeEntry]] = {}
        """The waiters not counted for want of heartbeats (rule 12), with the request
        reported: each request is reported once."""
        self._refused: dict[Key, dict[str, str]] = {}
        """The pods whose requests are refused, with the reason reported."""

    def started(self) -> None:
        self._starting = False

    def allow(self, key: Key, pod: str | None = None) -> bool:
        """Whether a Warning about ``key`` (caused by ``pod``) is within the budgets."""
        return self._warnings.allow(self._clock(), *key, pod)

    def warn(
        self,
        key: Key,
        target: Mapping[str, Any],
        reason: str,
        message: str,
        pod: str | None = None,
    ) -> None:
        """A Warning on the Rendezvous (on ``target`` if it is not known), within budget;
        while starting, kept until the Rendezvous' first event."""
        log.warning("Rendezvous %s/%s: %s: %s", *key, reason, message)
        if not self.allow(key, pod):
            return
        if self._starting:  # kopf posts no Events from startup, and knows no Rendezvous yet
            self._unposted.append((key, reason, message))
            return
        self.post([self._known_body(key) or target], warning=True, reason=reason, message=message)

    def post_unposted(self, key: Key, body: Mapping[str, Any]) -> None:
        """Post the Warnings about ``key`` found while starting or before the Rendezvous was
        known, now that kopf can and it is (at most the budget's: bounded however long it
        never shows)."""
        if not self._unposted:
            return
        for about, reason, message in self._unposted:
            if about == key:
                self.post([body], warning=True, reason=reason, message=message)
        self._unposted = [unposted for unposted in self._unposted if unposted[0] != key]

    async def failed_check(self, key: Key, pod: str, report: leases.HealthCheckReport) -> None:
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
        if not self.allow(key, pod):
            return
        known = self._known_body(key)
        if self._starting or known is None:
            # A node may fail its check before the Rendezvous' first event reaches the
            # operator: said on the Rendezvous then, never on the Lease, where no one looks.
            self._unposted.append((key, reasons.HEALTH_CHECK_FAILED, message))
            return
        targets = [*events.rendezvous_targets(known), *([found] if found else [])]
        self.post(targets, warning=True, reason=reasons.HEALTH_CHECK_FAILED, message=message)

    async def refuse(
        self,
        key: Key,
        target: Mapping[str, Any],
        generation: int,
        resource_version: str,
        reason: str,
        message: str,
        *,
        warn: bool = True,
    ) -> dict[str, Any] | None:
        """A Rendezvous that does not decode, or whose next status the API server refuses
        for good (edited by hand, a foreign writer, a status too large to store), is not
        guessed at: no round is decided until it is fixed. Say so where users look: a
        Warning on ``target`` (if ``warn``, within the Warning budgets), and the ``Ready``
        condition written over ``resource_version``: a write of that condition alone, small
        enough to pass where a status too large did not. The Rendezvous as written, or
        ``None`` if it changed meanwhile or the condition was refused too. The caller
        holds the Rendezvous after it, or says it once per distinct problem, so that our own
        write cannot make us loop."""
        namespace, name = key
        log.warning("Rendezvous %s/%s: %s: %s", namespace, name, reason, message)
        if warn and self.allow(key):
            self.post([target], warning=True, reason=reason, message=message)
        conditions = rounds.set_condition(
            (),
            rounds.CONDITION_READY,
            False,
            reason,
            message[:32768],
            self._clock(),
            generation,
        )
        try:
            return await asyncio.to_thread(
                self._api.write_status,
                namespace,
                name,
                resource_version,
                {"conditions": [condition.to_dict() for condition in conditions]},
            )
        except (kube.Conflict, kube.NotFound):
            return None
        except kube.Refused as error:  # at the limit already: the Warning says it alone
            log.warning("Rendezvous %s/%s: its %s condition was refused: %s", *key, reason, error)
            return None

    def expired_waiters(
        self,
        view: RendezvousView,
        requests: Mapping[str, leases.NodeEntry],
        expired: tuple[str, ...],
    ) -> None:
        """Say once per request that it is not counted for want of heartbeats."""
        reported = self._expired.get(view.key, {})
        self._expired[view.key] = {pod: requests[pod] for pod in expired}
        for pod in expired:
            if reported.get(pod) != requests[pod]:
                metrics.WAITERS_EXPIRED.inc()
                self.warn(
                    view.key,
                    view.reference,
                    reasons.WAITER_EXPIRED,
                    reasons.waiter_expired(pod, view.spec.heartbeat_timeout_seconds),
                    pod=pod,
                )

    def refusals(self, view: RendezvousView, refused: Mapping[str, membership.Refusal]) -> None:
        """Say once per pod and reason why its request does not count."""
        reported = self._refused.get(view.key, {})
        for pod, refusal in refused.items():
            if reported.get(pod) != refusal.reason:
                metrics.NODES_REFUSED.labels(refusal.reason).inc()
                self.warn(view.key, view.reference, reasons.NODE_REFUSED, refusal.message, pod=pod)
        self._refused[view.key] = {pod: refusal.reason for pod, refusal in refused.items()}

    def written(
        self, view: RendezvousView, decision: rounds.Decision, now: datetime.datetime
    ) -> None:
        """The decision made on ``view`` was written: its Events and its metrics."""
        self._report(view, decision, now)
        self._count(view.key, decision)
        self._count_rendezvous(view, decision)

    def forget(self, key: Key) -> None:
        """Rendezvous ``key`` is gone: its series, its share of the gauges, what was said."""
        self._series.forget(key)
        self._waiting.pop(key, None)
        self._spares_short.discard(key)
        self._expired.pop(key, None)
        self._refused.pop(key, None)
        self._set_gauges()

    def _report(
        self, view: RendezvousView, decision: rounds.Decision, now: datetime.datetime
    ) -> None:
        status = decision.status
        previous = decision.previous or status
        targets = list(view.targets)
        for loss in decision.losses:
            self.post(
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
            self.post(targets, warning=False, reason=reasons.ROUND_SEALED, message=message)
            log.info(
                "Rendezvous %s/%s: round %d sealed with %d nodes, master %s",
                *view.key,
                status.round,
                status.world_size,
                status.master.endpoint,
            )
        if (short := rounds.spares_lost(previous, status)) is not None:
            self.post(targets, warning=True, reason=reasons.SPARES_SHORT, message=short)
        if decision.closed:
            self.post(
                targets,
                warning=status.closed_reason in rounds.CLOSED_IN_FAILURE,
                reason=reasons.CLOSED,
                message=reasons.closed(status.closed_reason, status.closed_message),
            )

    def _count(self, key: Key, decision: rounds.Decision) -> None:
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
        closed = status.state is statuses.RoundState.CLOSED
        self._waiting[key] = 0 if closed else status.nodes_waiting
        if rounds.spares_short(status):
            self._spares_short.add(key)
        else:
            self._spares_short.discard(key)
        self._set_gauges()

    def _count_rendezvous(self, view: RendezvousView, decision: rounds.Decision) -> None:
        """Its own series: world size against maxNodes, and the time its latest round took
        to recover from a failure or a loss."""
        status = decision.status
        recovery = None
        if decision.sealed and status.history and status.history[-1].cause not in PLANNED:
            recovery = status.history[-1].forming_milliseconds / 1000
            metrics.RECOVERY.observe(recovery)
        sealed = status.state is statuses.RoundState.SEALED
        self._series.set(
            view.key, status.world_size if sealed else 0, view.spec.max_nodes, recovery
        )

    def _set_gauges(self) -> None:
        """The gauges over every rendezvous remembered."""
        metrics.NODES_WAITING.set(sum(self._waiting.values()))
        metrics.SPARES_SHORT.set(len(self._spares_short))
