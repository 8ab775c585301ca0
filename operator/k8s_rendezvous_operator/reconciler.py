"""kopf wiring: watch Rendezvous objects, their nodes' Leases and pods, decide, write, report.

Only kopf's low-level event handlers are used: they run on every watch event at once,
without the wait for the operator's own patches that kopf's create/update handlers make,
so the join that completes a round is sealed within milliseconds. One reconcile runs per
rendezvous at a time; events arriving meanwhile are coalesced into one more pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import kopf

from k8s_rendezvous import state
from k8s_rendezvous_operator import injection, kube, membership, metrics, observe, reasons, rounds

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name)"""


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


WARNING_BUDGET = 10
"""Warning Events about bad node input per rendezvous and WARNING_WINDOW: a pod writing
request after request must not turn into as many Events."""
WARNING_WINDOW = datetime.timedelta(minutes=1)


class WarningBudget:
    """At most :data:`WARNING_BUDGET` Events per rendezvous in any :data:`WARNING_WINDOW`;
    the rest are counted (``k8s_rendezvous_events_suppressed_total``) and logged."""

    def __init__(self) -> None:
        self._sent: dict[Key, list[datetime.datetime]] = {}

    def allow(self, key: Key, now: datetime.datetime) -> bool:
        recent = [moment for moment in self._sent.get(key, ()) if now - moment < WARNING_WINDOW]
        allowed = len(recent) < WARNING_BUDGET
        if allowed:
            recent.append(now)
        else:
            metrics.EVENTS_SUPPRESSED.inc()
        self._sent[key] = recent
        return allowed

    def forget(self, key: Key) -> None:
        self._sent.pop(key, None)


_INJECTION_CHECK_DELAY_SECONDS = 1.0
"""How long after a Job's status change its pods are looked at: a burst of pod starts
costs one request."""


def _without_forming_since(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if name != "formingSince"}


class Reconciler:
    """Holds what the watches told us and runs one reconcile per rendezvous at a time."""

    def __init__(
        self,
        api: kube.OperatorApi,
        clock: Callable[[], datetime.datetime] = _utcnow,
        *,
        worker_role: str | None = None,
    ) -> None:
        self._api = api
        self._clock = clock
        self._worker_role = worker_role
        self._jobs: dict[Key, observe.JobObservation] = {}
        self._bound: set[Key] = set()
        self._pod_nodes: dict[Key, str] = {}
        self._node_labels: dict[str, dict[str, str]] = {}
        self._unreadable: dict[Key, str] = {}
        self._write_refused: dict[Key, str] = {}
        self._waiting: dict[Key, int] = {}
        self._bodies: dict[Key, dict[str, Any]] = {}
        self._pods: dict[Key, rounds.PodObservation] = {}
        self._labelling: dict[Key, asyncio.Task[None]] = {}
        self._labelled: set[Key] = set()
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._again: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._heartbeats: dict[Key, rounds.Heartbeat] = {}
        self._entries: dict[Key, dict[str, state.NodeEntry]] = {}
        """Per rendezvous: each node's request, as its Lease says."""
        self._adopted: dict[Key, str] = {}
        """Per rendezvous made by a pod: the uid it was given its creator's owner for."""
        self._writers: dict[Key, str] = {}
        """Per pod: the uid of the pod that wrote its Lease, where the Lease says."""
        self._lease_problems: dict[Key, str] = {}
        self._slices: dict[Key, dict[int, dict[str, Any]]] = {}
        """Per rendezvous: what each of its RendezvousSlices was last written with."""
        self._published: dict[Key, tuple[state.RendezvousSpec, state.RendezvousStatus]] = {}
        """Per rendezvous: what its slices were last brought in step with."""
        self._forming_since: dict[Key, datetime.datetime] = {}
        """Per rendezvous: when its forming round began, if not written yet."""
        self._pod_versions: dict[Key, int] = {}
        self._refused: dict[Key, dict[str, str]] = {}
        """Per rendezvous: the pods whose requests are refused, with the reason reported."""
        self._job_controllers: dict[Key, tuple[str, ...]] = {}
        """Per Job (namespace, uid) whose pods asked to join: the uids of its controllers,
        as :meth:`_with_ancestors` read them."""
        self._injection_checks: dict[Key, asyncio.Task[None]] = {}
        """Per annotated Job: the look for its pods made without the env, if one is due."""
        self._uninjected: dict[Key, set[str]] = {}
        """Per annotated Job: the uids of its pods reported as made without the env."""
        self._warnings = WarningBudget()
        self._starting = True
        self._unposted: list[tuple[Key, str, str]] = []
        self._started_at = clock()

    # -- observations ------------------------------------------------------------------

    async def rendezvous_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        if deleted:
            self._forget_rendezvous(key)
            await self._make_again(key, body)
            return
        self._remember(key, body)
        if self._unposted:
            self._post_unposted(key, body)
        self.request(key)

    def _forget_rendezvous(self, key: Key) -> None:
        self._bodies.pop(key, None)
        for node in self._entries.pop(key, {}):
            pod = (key[0], node)
            for memory in (
                self._pods,
                self._heartbeats,
                self._pod_nodes,
                self._pod_versions,
                self._writers,
            ):
                memory.pop(pod, None)
            self._labelled.discard(pod)
        self._unreadable.pop(key, None)
        self._adopted.pop(key, None)
        self._write_refused.pop(key, None)
        self._waiting.pop(key, None)
        self._slices.pop(key, None)
        self._published.pop(key, None)
        self._forming_since.pop(key, None)
        self._refused.pop(key, None)
        self._warnings.forget(key)
        if timer := self._timers.pop(key, None):
            timer.cancel()

    async def _make_again(self, key: Key, deleted: Mapping[str, Any]) -> None:
        """A running annotated Job's Rendezvous was deleted (by hand: garbage collection
        takes it only with its Job): make it anew, as a Job makes a deleted pod anew. Its
        nodes notice the new uid and join its first round. The Job is read first, as its
        own deletion may not have reached us yet: a Rendezvous made for a Job that is gone
        would only be collected again."""
        job = self._jobs.get(key)
        owners = (deleted.get("metadata") or {}).get("ownerReferences") or []
        if (
            job is None
            or job.spec is None
            or job.finished is not None
            or job.deleting
            or not any(owner.get("uid") == job.uid for owner in owners)
        ):
            return
        body = await asyncio.to_thread(self._api.get_job, *key)
        current = observe.observe_job(body) if body is not None else None
        if current is None or current.uid != job.uid or current.deleting or current.finished:
            return
        assert body is not None and current.spec is not None
        await self._ensure_rendezvous(
            key, body, current.spec, kopf.Body(cast(kopf.RawBody, body)), again=True
        )

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
        if version >= 0:
            if version < self._pod_versions.get(key, -1):
                return
            self._pod_versions[key] = version
        if node_name:
            self._pod_nodes[key] = node_name
        if self._pods.get(key) == observation:
            return
        self._pods[key] = observation
        if rendezvous:
            self.request((key[0], rendezvous))

    async def job_seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        """An annotated Job changed: make or update its Rendezvous, report bad annotations,
        and let its parallelism and completion inform the rounds. Unannotated Jobs cost a
        scan of their annotations and nothing else."""
        if deleted:
            self._job_controllers.pop((key[0], (body.get("metadata") or {}).get("uid", "")), None)
        job = None if deleted else observe.observe_job(body)
        previous = self._jobs.pop(key, None) if job is None else self._jobs.get(key)
        if job is None:
            self._bound.discard(key)
            self._uninjected.pop(key, None)
            if check := self._injection_checks.pop(key, None):
                check.cancel()
            return
        if (
            job.spec is not None
            and job.finished is None
            and (body.get("status") or {}).get("active")
        ):
            self._look_for_uninjected_pods(key, job.uid)
        target = kopf.Body(cast(kopf.RawBody, dict(body)))
        if job.spec is not None and self._worker_role and key not in self._bound:
            await self._bind_worker_role(key, job, previous, target)
        if job == previous:
            return
        self._jobs[key] = job
        if job.spec is None:
            if previous is None or previous.errors != job.errors:
                for error in job.errors:
                    kopf.warn(target, reason=reasons.INVALID_ANNOTATION, message=error.message)
            return
        if previous is None or previous.spec != job.spec:
            await self._ensure_rendezvous(key, body, job.spec, target)
        self.request(key)

    def _look_for_uninjected_pods(self, key: Key, job_uid: str) -> None:
        """Soon, once for however many of the Job's status changes come meanwhile: its pods
        made while no webhook served (its failure policy lets pods through) have none of
        the env that points torchrun here, and would train alone, silently."""
        if key not in self._injection_checks:
            task = asyncio.get_running_loop().create_task(self._report_uninjected(key, job_uid))
            self._injection_checks[key] = task

    async def _report_uninjected(self, key: Key, job_uid: str) -> None:
        try:
            await asyncio.sleep(_INJECTION_CHECK_DELAY_SECONDS)
            pods = await asyncio.to_thread(self._api.unlabelled_job_pods, key[0], job_uid)
        except Exception as error:  # the API's or the transport's: looked at again later
            log.warning("could not list the pods of Job %s/%s: %s", *key, error)
            return
        finally:
            self._injection_checks.pop(key, None)
        reported = self._uninjected.setdefault(key, set())
        job: dict[str, Any] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"namespace": key[0], "name": key[1], "uid": job_uid},
        }
        for pod in pods:
            metadata = pod.get("metadata") or {}
            if (
                metadata.get("uid") in reported
                or metadata.get("deletionTimestamp")
                or injection.configured_for_rendezvous(pod)
            ):
                continue
            reported.add(metadata.get("uid", ""))
            name = metadata.get("name")
            message = (
                f"pod {name} of Job {key[1]} was made without the env that points torchrun "
                f"at Rendezvous {key[1]} (PET_RDZV_BACKEND and the rest): nothing injected "
                "it when it was created (the webhook's failure policy lets pods through "
                "during an operator rollout or leader change, and the injection policy, "
                "where the cluster serves it, needs the Job's Rendezvous to exist). A plain "
                f"torchrun in it trains alone. Delete pod {name}: the Job replaces it, "
                "with the env."
            )
            metrics.PODS_UNINJECTED.inc()
            log.warning("Job %s/%s: %s", *key, message)
            for target in (job, pod):
                kopf.warn(
                    kopf.Body(cast(kopf.RawBody, target)),
                    reason=reasons.POD_NOT_INJECTED,
                    message=message,
                )

    async def _bind_worker_role(
        self,
        key: Key,
        job: observe.JobObservation,
        previous: observe.JobObservation | None,
        target: kopf.Body,
    ) -> None:
        """Bind the worker role for the Job's ServiceAccount, once it exists: a binding for
        a name nobody holds yet would be granted to whoever creates that ServiceAccount."""
        namespace, name = key
        account = job.service_account
        if not await asyncio.to_thread(self._api.service_account_exists, namespace, account):
            if previous is None or previous.service_account != account:
                kopf.warn(
                    target,
                    reason=reasons.SERVICE_ACCOUNT_NOT_FOUND,
                    message=f"ServiceAccount {account} does not exist, so the worker role "
                    "is not bound for it (and the Job cannot create pods). Create it, or "
                    "name an existing one in the pod template; the role is bound then.",
                )
            return
        assert self._worker_role is not None
        await asyncio.to_thread(
            self._api.bind_worker_role, namespace, name, job.uid, account, self._worker_role
        )
        self._bound.add(key)

    async def _ensure_rendezvous(
        self,
        key: Key,
        job: Mapping[str, Any],
        spec: state.RendezvousSpec,
        target: kopf.Body,
        again: bool = False,
    ) -> None:
        namespace, name = key
        owner = kube.job_owner(name, job["metadata"]["uid"])
        created = await asyncio.to_thread(self._api.create_rendezvous, namespace, name, spec, owner)
        if created is not None:
            nodes = f"{spec.min_nodes}:{spec.max_nodes}"
            what = f"Rendezvous {name} for {nodes} nodes, run id {spec.run_id}"
            if again:
                kopf.warn(
                    target,
                    reason=reasons.RENDEZVOUS_RECREATED,
                    message=f"{what} was deleted while the Job runs, and is made anew: its "
                    "nodes join its first round. Delete the Job to stop the run.",
                )
            else:
                kopf.info(target, reason=reasons.RENDEZVOUS_CREATED, message=what)
            return
        existing = await asyncio.to_thread(self._api.get_rendezvous, namespace, name)
        owners = existing["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == owner["uid"] for o in owners):
            kopf.warn(
                target,
                reason=reasons.RENDEZVOUS_NOT_OWNED,
                message=f"Rendezvous {name} exists and is not owned by this Job; it is left "
                "as it is. Delete it, or rename the Job.",
            )
            return
        wanted = {k: v for k, v in spec.to_dict().items() if k != "runId"}
        current = existing.get("spec") or {}
        if any(current.get(k) != v for k, v in wanted.items()) or (
            "rankOrder" in current and "rankOrder" not in wanted
        ):
            await asyncio.to_thread(
                self._api.patch_rendezvous_spec,
                namespace,
                name,
                wanted | ({} if "rankOrder" in wanted else {"rankOrder": None}),
            )
        if current.get("runId") != spec.run_id:
            kopf.warn(
                target,
                reason=reasons.RUN_ID_IMMUTABLE,
                message=f"Rendezvous {name} keeps runId {current.get('runId')!r}; "
                f"the annotation asks for {spec.run_id!r}. Use a new Job for a new run.",
            )

    async def rendezvous_for_pod(
        self, namespace: str, pod: Mapping[str, Any]
    ) -> tuple[str, state.RendezvousSpec] | None:
        """The rendezvous of the annotated Job that owns ``pod``, if any (for the webhook;
        reads the Job when its watch event has not arrived yet)."""
        owner = next(
            (
                o
                for o in (pod.get("metadata") or {}).get("ownerReferences") or []
                if o.get("kind") == "Job" and o.get("controller")
            ),
            None,
        )
        if owner is None:
            return None
        key = (namespace, owner["name"])
        job = self._jobs.get(key)
        if job is None or job.uid != owner.get("uid"):
            body = await asyncio.to_thread(self._api.get_job, namespace, owner["name"])
            job = observe.observe_job(body) if body is not None else None
        if job is None or job.spec is None or job.uid != owner.get("uid"):
            return None
        rendezvous = self._bodies.get(key)
        if rendezvous is None:
            try:
                rendezvous = await asyncio.to_thread(self._api.get_rendezvous, *key)
            except kube.NotFound:
                return owner["name"], job.spec  # not made yet: it will be, owned by the Job
        owners = (rendezvous.get("metadata") or {}).get("ownerReferences") or []
        if not any(o.get("uid") == job.uid for o in owners):
            return None  # someone else's: its pods must not be sent there (RendezvousNotOwned)
        return owner["name"], job.spec

    def lease_seen(
        self,
        namespace: str,
        lease: observe.LeaseObservation,
        body: Mapping[str, Any],
        deleted: bool,
    ) -> None:
        """A node's Lease changed. A renewal is only remembered (expiries are checked by
        the timer the last decision set); a new request reconciles its rendezvous."""
        pod, key = (namespace, lease.node), (namespace, lease.rendezvous)
        if deleted or not lease.instance:
            self._heartbeats.pop(pod, None)
        else:
            self._heartbeats[pod] = rounds.Heartbeat(lease.instance, self._clock())
        problem = None if deleted else lease.problem
        if problem is None:
            self._lease_problems.pop(pod, None)
        elif self._lease_problems.get(pod) is None:  # said once, until the pod writes a good one
            self._lease_problems[pod] = problem
            message = (
                f"pod {lease.node} wrote a request this operator cannot read, so it is not "
                f"counted: {problem}. Run the same k8s-rendezvous version in the pods as in "
                "the operator."
            )
            self._warn(key, self._bodies.get(key) or body, reasons.INVALID_ENTRY, message)
        entry = None if deleted else lease.entry
        writer = None if deleted else lease.pod_uid
        wrote_anew = self._writers.get(pod) != writer
        if writer is None:
            self._writers.pop(pod, None)
        else:
            self._writers[pod] = writer
        entries = self._entries.get(key)
        if entries is None:
            if entry is None:
                return  # e.g. garbage collected after its Rendezvous
            entries = self._entries[key] = {}
        if entries.get(lease.node) == entry and not wrote_anew:
            return
        if entry is None:
            entries.pop(lease.node, None)
        else:
            entries[lease.node] = entry
        self.request(key)

    def _warn(self, key: Key, body: Mapping[str, Any], reason: str, message: str) -> None:
        """A Warning on the Rendezvous (on ``body`` if it is not known), within budget;
        while starting, kept until the Rendezvous' first event."""
        log.warning("Rendezvous %s/%s: %s: %s", *key, reason, message)
        if not self._warnings.allow(key, self._clock()):
            return
        if self._starting:  # kopf posts no Events from startup, and knows no Rendezvous yet
            self._unposted.append((key, reason, message))
            return
        target = kopf.Body(cast(kopf.RawBody, self._bodies.get(key) or body))
        kopf.warn(target, reason=reason, message=message)

    def started(self) -> None:
        self._starting = False

    def _post_unposted(self, key: Key, body: Mapping[str, Any]) -> None:
        """Post the Warnings about ``key`` found while starting, now that kopf can and the
        Rendezvous is known (at most the budget's: bounded however long it never shows)."""
        target = kopf.Body(cast(kopf.RawBody, body))
        for about, reason, message in self._unposted:
            if about == key:
                kopf.warn(target, reason=reason, message=message)
        self._unposted = [unposted for unposted in self._unposted if unposted[0] != key]

    def _report_refusals(
        self, key: Key, body: Mapping[str, Any], refused: Mapping[str, membership.Refusal]
    ) -> None:
        """Say once per pod and reason why its request does not count."""
        reported = self._refused.get(key, {})
        for pod, refusal in refused.items():
            if reported.get(pod) != refusal.reason:
                metrics.NODES_REFUSED.labels(refusal.reason).inc()
                self._warn(key, body, reasons.NODE_REFUSED, refusal.message)
        self._refused[key] = {pod: refusal.reason for pod, refusal in refused.items()}

    def _remember(self, key: Key, body: Mapping[str, Any]) -> None:
        known = self._bodies.get(key)
        if known is None or state.resource_version(body) > state.resource_version(known):
            self._bodies[key] = dict(body)

    # -- scheduling --------------------------------------------------------------------

    def request(self, key: Key) -> None:
        """Reconcile ``key`` now, or once more after the reconcile in progress."""
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.get_running_loop().create_task(self._loop(key))
        metrics.QUEUE_DEPTH.set(len(self._running))

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
                if problem := rounds.slices_problem(spec, current):
                    raise state.DecodeError(problem)
            except state.DecodeError as error:
                if self._unreadable.get(key) != str(error):
                    self._unreadable[key] = str(error)
                    await self._refuse(key, body, f"cannot be read, no round is decided: {error}")
                return
            self._unreadable.pop(key, None)
            creator = membership.creator_to_adopt(body, spec)
            if creator is not None and self._adopted.get(key) != body["metadata"].get("uid"):
                self._adopted[key] = body["metadata"].get("uid", "")
                if await self._adopt(key, body, creator):
                    continue
            first_write = "state" not in (body.get("status") or {})
            if first_write:
                # The first write fixes how the rounds are published, for good: a node's
                # slice must not move under it.
                current = dataclasses.replace(current, slices=state.slice_count(spec.max_nodes))
            if current.state is not state.RoundState.SEALED and current.forming_since is None:
                current = dataclasses.replace(current, forming_since=self._forming_since.get(key))
            requests = dict(self._entries.get(key, {}))
            self._label_pods(namespace, name, requests)
            pods = {
                node: observation
                for node in requests
                if (observation := self._pods.get((namespace, node))) is not None
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
                {node: uid for node in requests if (uid := self._writers.get((namespace, node)))},
            )
            self._report_refusals(key, body, admission.refused)
            requests = admission.counted
            pods = {node: observation for node, observation in pods.items() if node in requests}
            liveness = rounds.Liveness(
                {
                    node: beat
                    for node in requests
                    if (beat := self._heartbeats.get((namespace, node))) is not None
                },
                since=self._started_at,
            )
            if spec.rank_order_node_label:
                pods = await self._with_topology(
                    namespace, spec.rank_order_node_label, requests, pods
                )
            job = self._owning_job(key, body)
            now = self._clock()
            decision = rounds.decide(
                spec,
                current,
                requests,
                pods,
                now,
                liveness=liveness,
                expected_nodes=job.parallelism if job else None,
                close=job.finished if job else None,
                generation=int(body["metadata"].get("generation", 0)),
            )
            if decision.sealed and (unseen := self._unseen_members(namespace, decision)):
                # Labelling a pod is how a restarted operator learns that a pod behind an
                # old request is gone: never seal such a request in before the answer.
                await asyncio.wait(unseen, timeout=10)
                continue
            if decision.status.forming_since is None:
                self._forming_since.pop(key, None)
            else:
                self._forming_since[key] = decision.status.forming_since
            fields = decision.status.operator_fields()
            if first_write or _without_forming_since(fields) != _without_forming_since(
                current.operator_fields()
            ):
                try:
                    written = await asyncio.to_thread(
                        self._api.write_status,
                        namespace,
                        name,
                        body["metadata"]["resourceVersion"],
                        fields,
                    )
                except kube.Conflict:
                    metrics.WRITE_CONFLICTS.inc()
                    fresh = await asyncio.to_thread(self._api.get_rendezvous, namespace, name)
                    self._remember(key, fresh)
                    continue
                except kube.NotFound:
                    self._bodies.pop(key, None)
                    return
                except kube.Invalid as error:
                    # Not retried until the next event: the same decision would be refused
                    # the same way. Said once per distinct refusal, so that the condition
                    # written here (an event itself) ends in one more refused write.
                    if self._write_refused.get(key) != str(error):
                        self._write_refused[key] = str(error)
                        await self._refuse(
                            key, body, f"its next status was refused, no round is decided: {error}"
                        )
                    return
                self._write_refused.pop(key, None)
                self._remember(key, written)
                self._report(written, current, decision, now)
                self._count(key, current, decision, now)
            await self._publish_slices(key, spec, decision.status)
            self._wake_at(key, decision.wake_at)
            return
        self._again.add(key)  # lost five races in a row: try again after the next event

    async def _publish_slices(
        self, key: Key, spec: state.RendezvousSpec, status: state.RendezvousStatus
    ) -> None:
        """Bring the RendezvousSlices in step with the status just decided (after it, so
        the status stays the record): those whose content changed, at once. A slice
        changes only with the round key, the spec or the close, not with joins."""
        body = self._bodies.get(key)
        if body is None or not status.slices:
            return
        # The status without what no slice carries: a forming round's bookkeeping (its
        # first join, its last call, conditions) writes no slice.
        inputs = (
            spec,
            dataclasses.replace(
                status,
                conditions=(),
                observed_generation=0,
                forming_since=None,
                last_call_deadline=None,
            ),
        )
        if self._published.get(key) == inputs:
            return
        written = self._slices.setdefault(key, {})
        spec_fields = {"rankOrder": None} | {
            field: value for field, value in spec.to_dict().items() if field != "podSelector"
        }
        changed = {
            index: content
            for index, fields in enumerate(status.slice_fields())
            if written.get(index) != (content := {"spec": spec_fields, "status": fields})
        }
        await asyncio.gather(
            *(
                asyncio.to_thread(self._api.write_slice, key[0], body, index, content)
                for index, content in changed.items()
            )
        )
        written.update(changed)
        self._published[key] = inputs

    async def _refuse(self, key: Key, body: Mapping[str, Any], problem: str) -> None:
        """A Rendezvous that does not decode, or whose next status the API server refuses
        (edited by hand, or by a foreign writer), is not guessed at: no round is decided
        until it is fixed. Say so where users look, once per distinct problem, so that our
        own write cannot make us loop."""
        namespace, name = key
        message = (
            f"{problem}. Fix the field (kubectl edit rdzv {name} --subresource=status) or "
            "recreate the Rendezvous."
        )
        log.warning("Rendezvous %s/%s: %s", namespace, name, message)
        target = kopf.Body(cast(kopf.RawBody, body))
        kopf.warn(target, reason=reasons.INVALID_RENDEZVOUS, message=message)
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
            self._unreadable.pop(key, None)  # changed meanwhile: look again at the next event

    def _count(
        self,
        key: Key,
        previous: state.RendezvousStatus,
        decision: rounds.Decision,
        now: datetime.datetime,
    ) -> None:
        status = decision.status
        for loss in decision.losses:
            metrics.MEMBERS_LOST.labels(loss.reason).inc()
        if decision.sealed:
            metrics.ROUNDS_SEALED.inc()
            if decision.forming_seconds is not None:
                metrics.SEAL_LATENCY.observe(decision.forming_seconds)
        if decision.closed:
            metrics.CLOSED.labels(status.closed_reason or "").inc()
        self._waiting[key] = status.nodes_waiting
        metrics.NODES_WAITING.set(sum(self._waiting.values()))

    async def _with_ancestors(
        self,
        namespace: str,
        workload: membership.Workload,
        identities: Mapping[str, membership.PodIdentity | None],
    ) -> dict[str, membership.PodIdentity | None]:
        """The pods' identities with their Job's controller where that decides whether they
        belong (a JobSet-owned Rendezvous: its pods are its Jobs'). Each Job is read once:
        its controller does not change, and the answer is kept by the Job's uid."""
        result = dict(identities)
        for node, identity in identities.items():
            if identity is None or identity.controller_uid is None:
                continue
            job = membership.job_to_resolve_for(workload, identity)
            if job is None:
                continue
            known = (namespace, identity.controller_uid)
            ancestors = self._job_controllers.get(known)
            if ancestors is None:
                body = await asyncio.to_thread(self._api.get_job, namespace, job)
                ancestors = membership.job_ancestors(identity, body)
                if ancestors is None:
                    continue  # gone or made anew: refused now, read again at its next event
                self._job_controllers[known] = ancestors
            result[node] = dataclasses.replace(identity, ancestors=ancestors)
        return result

    def _owning_job(self, key: Key, body: Mapping[str, Any]) -> observe.JobObservation | None:
        job = self._jobs.get(key)
        owners = body["metadata"].get("ownerReferences") or []
        if job is None or not any(owner.get("uid") == job.uid for owner in owners):
            return None
        return job

    async def _with_topology(
        self,
        namespace: str,
        label: str,
        nodes: Mapping[str, object],
        pods: dict[str, rounds.PodObservation],
    ) -> dict[str, rounds.PodObservation]:
        """Each node's value of the rank-order label of the Kubernetes node its pod runs on
        (pods read once if the watch has not shown them yet; node labels cached)."""
        result = dict(pods)
        for pod in nodes:
            node = self._pod_nodes.get((namespace, pod))
            if node is None:
                node = await asyncio.to_thread(self._api.pod_node_name, namespace, pod)
                if node is None:
                    continue
                self._pod_nodes[(namespace, pod)] = node
            if node not in self._node_labels:
                self._node_labels[node] = await asyncio.to_thread(self._api.node_labels, node)
            observation = result.get(pod, rounds.PodObservation())
            result[pod] = dataclasses.replace(
                observation, topology=self._node_labels[node].get(label)
            )
        return result

    def _report(
        self,
        body: Mapping[str, Any],
        previous: state.RendezvousStatus,
        decision: rounds.Decision,
        now: datetime.datetime,
    ) -> None:
        """Events after the write succeeded, where `kubectl describe` shows them."""
        status = decision.status
        targets = [kopf.Body(cast(kopf.RawBody, dict(body)))]
        metadata = body["metadata"]
        for owner in metadata.get("ownerReferences") or []:
            if owner.get("kind") == "Job" and owner.get("controller"):
                job = {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {
                        "name": owner["name"],
                        "namespace": metadata.get("namespace"),
                        "uid": owner["uid"],
                    },
                }
                targets.append(kopf.Body(cast(kopf.RawBody, job)))
        target = targets
        for loss in decision.losses:
            kopf.warn(
                target,
                reason=reasons.MEMBER_LOST,
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
                reason=reasons.ROUND_SEALED,
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
                reason=reasons.CLOSED,
                message=f"{status.closed_reason}: {status.closed_message}",
            )

    def _unseen_members(
        self, namespace: str, decision: rounds.Decision
    ) -> list[asyncio.Task[None]]:
        """The labelling still under way of members whose pods we have not observed."""
        return [
            task
            for member in decision.status.members
            if (namespace, member.node) not in self._pods
            and (task := self._labelling.get((namespace, member.node))) is not None
        ]

    def _label_pods(
        self, namespace: str, rendezvous: str, requests: Mapping[str, state.NodeEntry]
    ) -> None:
        for node in requests:
            pod = (namespace, node)
            if pod in self._labelling or (
                (pod in self._pods or pod in self._labelled) and not self._replaced(pod)
            ):
                continue
            task = asyncio.get_running_loop().create_task(self._label_pod(pod, rendezvous))
            self._labelling[pod] = task

    async def _adopt(self, key: Key, body: Mapping[str, Any], creator: str) -> bool:
        """Make the workload of the pod that created the Rendezvous its owner (once per
        Rendezvous): its controller, or the JobSet of its Job
        (:func:`membership.workload_reference`); ``True`` if it now has one. The pod only
        said that it made it (the admission policy holds that to its token): which
        workload that is, is the word of the Pod and Job objects, never the pod's."""
        namespace, name = key
        try:
            pod = await asyncio.to_thread(self._api.get_pod, namespace, creator)
            job_name = None if pod is None else membership.job_to_resolve(pod)
            job = None
            if job_name is not None:
                job = await asyncio.to_thread(self._api.get_job, namespace, job_name)
            owner = None if pod is None else membership.workload_reference(pod, job)
            if owner is not None:
                adopted = await asyncio.to_thread(
                    self._api.adopt_rendezvous, namespace, name, body["metadata"]["uid"], owner
                )
                self._remember(key, adopted)
                log.info("Rendezvous %s/%s: owned by %s/%s", *key, owner["kind"], owner["name"])
                return True
        except (kube.NotFound, kube.Conflict):
            return False  # deleted or made anew meanwhile: its own event follows
        except Exception:
            self._adopted.pop(key, None)  # tried again on its next event
            log.exception("Rendezvous %s/%s: giving it its creator's owner failed", *key)
            return False
        why = "no longer exists" if pod is None else "has no controller (a bare pod)"
        self._warn(
            key,
            body,
            reasons.NO_OWNER,
            f"Rendezvous {name} was made by pod {creator}, which {why}: there is no workload "
            "to check its nodes against, so it admits nobody. Run torchrun in pods of a "
            "controller (a Job, JobSet, StatefulSet...), or set spec.podSelector to the "
            "labels of the job's pods.",
        )
        return False

    def _replaced(self, pod: Key) -> bool:
        """Whether the pod that wrote ``pod``'s Lease is not the one we know of by that
        name: a StatefulSet or PyTorchJob makes a failed pod anew under the same name, and
        the new one, not yet labelled, is read (and labelled) only by asking again."""
        known = self._pods.get(pod)
        writer = self._writers.get(pod)
        return (
            known is not None
            and known.identity is not None
            and writer is not None
            and known.identity.uid != writer
        )

    async def _label_pod(self, pod: Key, rendezvous: str) -> None:
        try:
            body = await asyncio.to_thread(self._api.label_pod, pod[0], pod[1], rendezvous)
            self._labelled.add(pod)
            # The answer is the pod as it is now: no need to wait for its watch event.
            self.pod_seen(
                pod,
                observe.observe_pod(body),
                rendezvous,
                node_name=(body.get("spec") or {}).get("nodeName"),
                version=state.resource_version(body),
            )
        except kube.NotFound:
            self.pod_seen(pod, rounds.PodObservation(rounds.LOST_POD_NOT_FOUND), rendezvous)
            key = (pod[0], rendezvous)
            if (known := self._bodies.get(key)) is not None:
                self._warn(
                    key,
                    known,
                    reasons.NODE_WITHOUT_POD,
                    f"node {pod[1]} asks to join (Lease {state.lease_name(rendezvous, pod[1])}),"
                    f" but no Pod {pod[1]} exists in namespace {pod[0]}: only pods of the "
                    "workload are admitted. Run torchrun in the workload's pods, with POD_NAME "
                    "set to the pod's name (the downward API's metadata.name).",
                )
        except Exception:
            log.exception("labelling pod %s/%s failed; it is retried on the next change", *pod)
        finally:
            self._labelling.pop(pod, None)


# -- kopf registrations ------------------------------------------------------------------


class _NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: only low-level event handlers are registered, and nothing reads one.
    kopf builds it for every event anyway, from a deep copy of the whole body (a pod, a
    sealed status of every member), and reads the last one back from an annotation: over
    half of kopf's processing of each event (bench/FINDINGS.md)."""

    def build(self, *, body: kopf.Body, extra_fields: object = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.reporting_component = "k8s-rendezvous-operator"
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.posting.level = logging.INFO
    # Only pods we labelled (nodes of some rendezvous) are streamed to us, not every pod.
    settings.watching.label_selectors["pods"] = state.NODE_LABEL
    settings.watching.label_selectors["leases"] = state.NODE_LABEL
    # No cluster-wide namespace/CRD scanning: fewer permissions, nothing to gain here.
    settings.scanning.disabled = True
    settings.execution.max_workers = 8
    # Opting Jobs in by annotation means every Job event reaches us; a cluster with many
    # Jobs can require a label as well, filtered by the API server.
    if memo.get("job_label_selector"):
        settings.watching.label_selectors["jobs"] = memo["job_label_selector"]
    api = kube.OperatorApi(kube.load_api_client())
    reconciler = Reconciler(api, worker_role=memo.get("worker_role") or None)
    # Know every node's request before the first reconcile: a member whose Lease had not
    # been seen yet would otherwise count as gone.
    for body in await asyncio.to_thread(api.list_node_leases, memo.get("namespaces") or ()):
        if (lease := observe.observe_lease(body)) is not None:
            reconciler.lease_seen(body["metadata"]["namespace"], lease, body, deleted=False)
    reconciler.started()
    memo["reconciler"] = reconciler


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
    await reconciler.rendezvous_seen(
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
    reconciler.pod_seen(
        (namespace, name),
        observation,
        labels.get(state.NODE_LABEL),
        node_name=(body.get("spec") or {}).get("nodeName"),
        version=state.resource_version(body),
    )


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={state.NODE_LABEL: kopf.PRESENT})
async def lease_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    if (lease := observe.observe_lease(body)) is not None:
        reconciler.lease_seen(namespace, lease, dict(body), deleted=event.get("type") == "DELETED")


@kopf.on.event("batch", "v1", "jobs")
async def job_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    await reconciler.job_seen((namespace, name), body, deleted=event.get("type") == "DELETED")
