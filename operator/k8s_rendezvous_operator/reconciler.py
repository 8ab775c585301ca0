"""kopf wiring: watch Rendezvous objects and their pods, decide, write, report.

Only kopf's low-level event handlers are used: they run on every watch event at once,
without the wait for the operator's own patches that kopf's create/update handlers make,
so the join that completes a round is sealed within milliseconds. One reconcile runs per
rendezvous at a time; events arriving meanwhile are coalesced into one more pass.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import kopf

from k8s_rendezvous import state
from k8s_rendezvous_operator import kube, observe, rounds

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name)"""


def _version(body: Mapping[str, Any]) -> int:
    # Etcd-backed resourceVersions are revisions; comparing them lets us keep the newest
    # of a watch event and our own write's response.
    try:
        return int(body.get("metadata", {}).get("resourceVersion", -1))
    except (TypeError, ValueError):
        return -1


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Reconciler:
    """Holds what the watches told us and runs one reconcile per rendezvous at a time."""

    def __init__(
        self, api: kube.OperatorApi, clock: Callable[[], datetime.datetime] = _utcnow
    ) -> None:
        self._api = api
        self._clock = clock
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._pods: dict[Key, rounds.PodObservation] = {}
        self._labelling: set[Key] = set()
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._heartbeats: dict[Key, rounds.Heartbeat] = {}
        self._started_at = clock()

    # -- observations ------------------------------------------------------------------

    def rendezvous_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        if deleted:
            self._bodies.pop(key, None)
            if timer := self._timers.pop(key, None):
                timer.cancel()
            return
        self._remember(key, body)
        self.request(key)

    def pod_seen(
        self, key: Key, observation: rounds.PodObservation, rendezvous: str | None
    ) -> None:
        if self._pods.get(key) == observation:
            return
        self._pods[key] = observation
        if rendezvous:
            self.request((key[0], rendezvous))

    def heartbeat_seen(self, key: Key, instance: str | None, deleted: bool) -> None:
        """A node's Lease changed. Only remembered: expiries are checked by the timer the
        last decision set, so a renewal costs no reconcile."""
        if deleted or not instance:
            self._heartbeats.pop(key, None)
        else:
            self._heartbeats[key] = rounds.Heartbeat(instance, self._clock())

    def _remember(self, key: Key, body: Mapping[str, Any]) -> None:
        known = self._bodies.get(key)
        if known is None or _version(body) > _version(known):
            self._bodies[key] = dict(body)

    # -- scheduling --------------------------------------------------------------------

    def request(self, key: Key) -> None:
        """Reconcile ``key`` now, or once more after the reconcile in progress."""
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.get_running_loop().create_task(self._loop(key))

    async def _loop(self, key: Key) -> None:
        try:
            while True:
                self._again.discard(key)
                try:
                    await self._reconcile(key)
                except Exception:
                    log.exception("reconciling Rendezvous %s/%s failed; retrying in 1 s", *key)
                    await asyncio.sleep(1)
                    self._again.add(key)
                if key not in self._again:
                    return
        finally:
            del self._running[key]

    def _wake_at(self, key: Key, moment: datetime.datetime | None) -> None:
        if timer := self._timers.pop(key, None):
            timer.cancel()
        if moment is not None:
            delay = max(0.0, (moment - self._clock()).total_seconds())
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(delay, self.request, key)

    # -- the reconcile -----------------------------------------------------------------

    async def _reconcile(self, key: Key) -> None:
        namespace, name = key
        for _ in range(5):
            body = self._bodies.get(key)
            if body is None:
                return
            try:
                spec = state.RendezvousSpec.from_dict(body.get("spec"))
                current = state.RendezvousStatus.from_dict(body.get("status"))
            except state.DecodeError as error:
                kopf.warn(
                    kopf.Body(cast(kopf.RawBody, body)),
                    reason="InvalidRendezvous",
                    message=f"cannot be read: {error}",
                )
                log.warning("Rendezvous %s/%s cannot be read: %s", namespace, name, error)
                return
            self._label_pods(namespace, name, current)
            pods = {
                node: observation
                for node in current.nodes
                if (observation := self._pods.get((namespace, node))) is not None
            }
            liveness = rounds.Liveness(
                {
                    node: beat
                    for node in current.nodes
                    if (beat := self._heartbeats.get((namespace, node))) is not None
                },
                since=self._started_at,
            )
            now = self._clock()
            decision = rounds.decide(
                spec,
                current,
                pods,
                now,
                liveness=liveness,
                generation=int(body["metadata"].get("generation", 0)),
            )
            fields = decision.status.operator_fields()
            if fields != current.operator_fields() or "state" not in (body.get("status") or {}):
                try:
                    written = await asyncio.to_thread(
                        self._api.write_status,
                        namespace,
                        name,
                        body["metadata"]["resourceVersion"],
                        fields,
                    )
                except kube.Conflict:
                    fresh = await asyncio.to_thread(self._api.get_rendezvous, namespace, name)
                    self._remember(key, fresh)
                    continue
                except kube.NotFound:
                    self._bodies.pop(key, None)
                    return
                self._remember(key, written)
                self._report(written, current, decision, now)
            self._wake_at(key, decision.wake_at)
            return
        self._again.add(key)  # lost five races in a row: try again after the next event

    def _report(
        self,
        body: Mapping[str, Any],
        previous: state.RendezvousStatus,
        decision: rounds.Decision,
        now: datetime.datetime,
    ) -> None:
        """Events after the write succeeded, where `kubectl describe` shows them."""
        status = decision.status
        target = kopf.Body(cast(kopf.RawBody, dict(body)))
        for loss in decision.losses:
            kopf.warn(
                target,
                reason="MemberLost",
                message=f"pod {loss.node} (rank {loss.rank} of round {previous.round}) "
                f"left the round: {loss.reason}",
            )
        if decision.sealed and status.master is not None:
            took = ""
            if previous.forming_since is not None:
                took = (
                    f" {(now - previous.forming_since).total_seconds():.3f} s after the first join;"
                )
            names = ", ".join(member.node for member in status.members[:8])
            more = f" and {status.world_size - 8} more" if status.world_size > 8 else ""
            kopf.info(
                target,
                reason="RoundSealed",
                message=f"round {status.round} sealed with {status.world_size} nodes "
                f"({names}{more});{took} master {status.master.endpoint}",
            )
            log.info(
                "Rendezvous %s/%s: round %d sealed with %d nodes, master %s",
                body["metadata"].get("namespace"),
                body["metadata"]["name"],
                status.round,
                status.world_size,
                status.master.endpoint,
            )
        if decision.closed:
            kopf.info(
                target,
                reason="Closed",
                message=f"{status.closed_reason}: {status.closed_message}",
            )

    def _label_pods(self, namespace: str, rendezvous: str, status: state.RendezvousStatus) -> None:
        for node in status.nodes:
            pod = (namespace, node)
            if pod in self._pods or pod in self._labelling:
                continue
            self._labelling.add(pod)
            asyncio.get_running_loop().create_task(self._label_pod(pod, rendezvous))

    async def _label_pod(self, pod: Key, rendezvous: str) -> None:
        try:
            await asyncio.to_thread(self._api.label_pod, pod[0], pod[1], rendezvous)
        except kube.NotFound:
            self.pod_seen(pod, rounds.PodObservation(rounds.LOST_POD_NOT_FOUND), rendezvous)
        except Exception:
            log.exception("labelling pod %s/%s failed; it is retried on the next change", *pod)
        finally:
            self._labelling.discard(pod)


# -- kopf registrations ------------------------------------------------------------------


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.reporting_component = "k8s-rendezvous-operator"
    settings.posting.level = logging.INFO
    # Only pods we labelled (nodes of some rendezvous) are streamed to us, not every pod.
    settings.watching.label_selectors["pods"] = state.NODE_LABEL
    settings.watching.label_selectors["leases"] = state.NODE_LABEL
    # No cluster-wide namespace/CRD scanning: fewer permissions, nothing to gain here.
    settings.scanning.disabled = True
    settings.execution.max_workers = 8
    memo["reconciler"] = Reconciler(kube.OperatorApi(kube.load_api_client()))


@kopf.on.event(state.GROUP, state.VERSION, state.PLURAL)
async def rendezvous_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    reconciler.rendezvous_seen(
        (namespace, name), dict(body), deleted=event.get("type") == "DELETED"
    )


@kopf.on.event("", "v1", "pods", labels={state.NODE_LABEL: kopf.PRESENT})
async def pod_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    observation = observe.observe_pod(body, deleted=event.get("type") == "DELETED")
    reconciler.pod_seen((namespace, name), observation, labels.get(state.NODE_LABEL))


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={state.NODE_LABEL: kopf.PRESENT})
async def lease_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    annotations: Mapping[str, str],
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    node = (body.get("spec") or {}).get("holderIdentity")
    if node:
        reconciler.heartbeat_seen(
            (namespace, node),
            annotations.get(state.INSTANCE_ANNOTATION),
            deleted=event.get("type") == "DELETED",
        )
