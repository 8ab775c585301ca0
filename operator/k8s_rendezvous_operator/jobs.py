"""Annotated Jobs: each makes and owns its Rendezvous, gets the worker role bound for its
ServiceAccount, and has its pods made without the injected env reported. The rounds learn
from here how many nodes a Job runs and when it finished."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from k8s_rendezvous.wire import specs, tunables
from k8s_rendezvous_operator import (
    events,
    injection,
    kube,
    metrics,
    names,
    observe,
    reasons,
)
from k8s_rendezvous_operator.events import Key

log = logging.getLogger(__name__)

INJECTION_CHECK_DELAY_SECONDS = 1.0
"""How long after a Job's status change its pods are looked at: a burst of pod starts
costs one request."""

WATCH_WAIT_SECONDS = 1.0
"""How long the webhook waits for the watch event of a pod's Job it has not seen yet
(:meth:`Jobs.rendezvous_for_pod`): the Job controller makes a Job's pods only after it sees
the Job, so the operator's event usually comes first and at worst trails by kopf's queue.
Well below the webhook's timeout (5 s by default), after which the API server gives up."""


@dataclasses.dataclass(frozen=True)
class PodRendezvous:
    """What the webhook gives a pod of an annotated Job."""

    name: str
    """Of the Job's Rendezvous."""
    spec: specs.RendezvousSpec
    agent_env: tuple[tuple[str, str], ...]
    """What the Job's annotations tell its pods' agents (``job_annotations.AGENT_SETTINGS``)."""


@dataclasses.dataclass
class JobMemory:
    """What is known of one annotated Job, dropped whole when it goes."""

    job: observe.JobObservation
    bound: bool = False
    """The worker role is bound for its ServiceAccount."""
    injection_check: asyncio.Task[None] | None = None
    """The look for its pods made without the env, if one is due."""
    uninjected: set[str] = dataclasses.field(default_factory=set)
    """The uids of its pods reported as made without the env."""
    replaced: set[str] = dataclasses.field(default_factory=set)
    """The pods whose Rendezvous of its name were replaced with its own, as reported: a
    pod that makes it anew each time (and wins the race) is reported once."""


async def maker(
    api: kube.ReconcilerApi, namespace: str, held: names.Holding
) -> Mapping[str, Any] | None:
    """Where an Event about a pod-made Rendezvous goes for whoever made it: its owner, the
    workload of the pod that made it, or that pod if it has none (read; ``None``: gone)."""
    if held.owner is not None:
        return events.owner_target(namespace, held.owner)
    assert held.creator is not None, "a pod made it"
    return await asyncio.to_thread(api.get_pod, namespace, held.creator)


class Jobs:
    """The annotated Jobs the watch showed, and what is done for them."""

    def __init__(
        self,
        api: kube.ReconcilerApi,
        post: events.Poster,
        request: Callable[[Key], None],
        known_rendezvous: Callable[[Key], Mapping[str, Any] | None],
        *,
        worker_role: str | None = None,
    ) -> None:
        self._api = api
        self._post = post
        self._request = request
        self._known_rendezvous = known_rendezvous
        self._worker_role = worker_role
        self._jobs: dict[Key, JobMemory] = {}
        self._watched: dict[Key, tuple[str, observe.JobObservation | None]] = {}
        """Every Job the watch showed, annotated or not: its uid and its rendezvous spec
        (``None``: none, or annotations that are refused). What the webhook answers from;
        one small entry per Job in the watched namespaces."""
        self._arrived = asyncio.Condition()
        """Notified at each Job event: the webhook's requests waiting for their Job."""

    def get(self, key: Key) -> observe.JobObservation | None:
        memory = self._jobs.get(key)
        return None if memory is None else memory.job

    def owning(self, key: Key, held: names.Holding) -> observe.JobObservation | None:
        """The annotated Job ``key`` if it owns the Rendezvous ``held`` describes."""
        job = self.get(key)
        if job is None or job.uid not in held.owner_uids:
            return None
        return job

    async def seen(self, key: Key, body: Mapping[str, Any], deleted: bool) -> None:
        """An annotated Job changed: make or update its Rendezvous, report bad annotations,
        and let its parallelism and completion inform the rounds. Unannotated Jobs cost a
        scan of their annotations and nothing else."""
        uid = (body.get("metadata") or {}).get("uid", "")
        job = None if deleted else observe.observe_job(body)
        await self._remember_for_webhook(key, uid, job, deleted)
        if job is None:
            if (gone := self._jobs.pop(key, None)) and gone.injection_check:
                gone.injection_check.cancel()
            return
        memory = self._jobs.get(key)
        previous = None if memory is None else memory.job
        if memory is None:
            memory = JobMemory(job)
        if (
            job.spec is not None
            and job.finished is None
            and (body.get("status") or {}).get("active")
        ):
            self._look_for_uninjected_pods(key, memory, job.uid)
        if job.spec is not None and self._worker_role and not memory.bound:
            await self._bind_worker_role(key, job, previous, body, memory)
        if job == previous:
            return
        memory.job = job
        self._jobs[key] = memory
        if job.spec is None:
            if job.errors and (previous is None or previous.errors != job.errors):
                for error in job.errors:
                    log.warning("Job %s/%s: %s", *key, error.message)
                self._post(
                    [body],
                    warning=True,
                    reason=reasons.INVALID_ANNOTATION,
                    message=reasons.invalid_annotations([e.message for e in job.errors]),
                )
            return
        # Once per Job (and again if its failure settings change), as its annotations are
        # fixed: a Job with bad annotations is told about those first.
        if job.pod_losses is not None and (
            previous is None or previous.spec is None or previous.pod_losses != job.pod_losses
        ):
            self._post(
                [body],
                warning=True,
                reason=reasons.POD_LOSSES_END_JOB,
                message=reasons.pod_losses_end_job(
                    key[1],
                    job.pod_losses.losses,
                    job.pod_losses.per_index,
                    job.pod_losses.restart_policy_never,
                ),
            )
        if previous is None or previous.spec != job.spec:
            await self._ensure_rendezvous(key, body, job.spec)
        self._request(key)

    async def _remember_for_webhook(
        self, key: Key, uid: str, job: observe.JobObservation | None, deleted: bool
    ) -> None:
        if deleted:
            self._watched.pop(key, None)
            return
        self._watched[key] = (uid, job)
        async with self._arrived:
            self._arrived.notify_all()

    def _look_for_uninjected_pods(self, key: Key, memory: JobMemory, job_uid: str) -> None:
        """Soon, once for however many of the Job's status changes come meanwhile: its pods
        made while no webhook served (its failure policy lets pods through) have none of
        the env that points torchrun here, and would train alone, silently."""
        if memory.injection_check is None:
            loop = asyncio.get_running_loop()
            memory.injection_check = loop.create_task(self._report_uninjected(key, memory, job_uid))

    async def _report_uninjected(self, key: Key, memory: JobMemory, job_uid: str) -> None:
        try:
            await asyncio.sleep(INJECTION_CHECK_DELAY_SECONDS)
            pods = await asyncio.to_thread(self._api.unlabelled_job_pods, key[0], job_uid)
        except Exception as error:  # the API's or the transport's: looked at again later
            log.warning("could not list the pods of Job %s/%s: %s", *key, error)
            return
        finally:
            memory.injection_check = None
        held = self._known_rendezvous(key)
        if held is not None and names.holder(job_uid, names.holding(held)) is not names.Holder.JOB:
            # Deleting a pod would not help while another holds the name (RendezvousNotOwned
            # says how to free it); its pods are looked at again once the Job's is made.
            return
        job = events.job_reference(key[0], key[1], job_uid)
        for pod in pods:
            metadata = pod.get("metadata") or {}
            if (
                metadata.get("uid") in memory.uninjected
                or metadata.get("deletionTimestamp")
                or injection.configured_for_rendezvous(pod)
            ):
                continue
            memory.uninjected.add(metadata.get("uid", ""))
            message = reasons.pod_not_injected(metadata.get("name"), key[1])
            metrics.PODS_UNINJECTED.inc()
            log.warning("Job %s/%s: %s", *key, message)
            for target in (job, pod):
                self._post([target], warning=True, reason=reasons.POD_NOT_INJECTED, message=message)

    async def _bind_worker_role(
        self,
        key: Key,
        job: observe.JobObservation,
        previous: observe.JobObservation | None,
        body: Mapping[str, Any],
        memory: JobMemory,
    ) -> None:
        """Bind the worker role for the Job's ServiceAccount, once it exists: a binding for
        a name nobody holds yet would be granted to whoever creates that ServiceAccount."""
        namespace, name = key
        account = job.service_account
        if not await asyncio.to_thread(self._api.service_account_exists, namespace, account):
            if previous is None or previous.service_account != account:
                self._post(
                    [body],
                    warning=True,
                    reason=reasons.SERVICE_ACCOUNT_NOT_FOUND,
                    message=reasons.service_account_not_found(account),
                )
            return
        assert self._worker_role is not None
        await asyncio.to_thread(
            self._api.bind_worker_role, namespace, name, job.uid, account, self._worker_role
        )
        memory.bound = True

    async def _ensure_rendezvous(
        self,
        key: Key,
        job: Mapping[str, Any],
        spec: specs.RendezvousSpec,
        again: bool = False,
    ) -> None:
        """Make the Job's Rendezvous, or keep it in step with the annotations; a pod-made
        one under its name is replaced, any other is reported (:mod:`.names`)."""
        namespace, name = key
        if await self._create_rendezvous(key, job, spec, again):
            return
        try:
            existing = await asyncio.to_thread(self._api.get_rendezvous, namespace, name)
        except kube.NotFound:
            return  # deleted meanwhile: its deletion brings the Job back here
        held = names.holding(existing)
        holder = names.holder(job["metadata"]["uid"], held)
        if holder is names.Holder.POD:
            if self._runs(key):
                await self._replace(key, job, spec, existing)
            return
        if holder is names.Holder.USER:
            self._post(
                [job],
                warning=True,
                reason=reasons.RENDEZVOUS_NOT_OWNED,
                message=reasons.rendezvous_not_owned(
                    name, namespace, held.owner_name, held.selects
                ),
            )
            return
        await self._follow_annotations(key, job, spec, existing)

    async def _create_rendezvous(
        self, key: Key, job: Mapping[str, Any], spec: specs.RendezvousSpec, again: bool
    ) -> bool:
        """Create the Job's Rendezvous; ``False`` if the name is held."""
        namespace, name = key
        owner = kube.job_owner(name, job["metadata"]["uid"])
        created = await asyncio.to_thread(self._api.create_rendezvous, namespace, name, spec, owner)
        if created is None:
            return False
        if again:
            self._post(
                [job],
                warning=True,
                reason=reasons.RENDEZVOUS_RECREATED,
                message=reasons.rendezvous_recreated(name, spec),
            )
        else:
            self._post(
                [job],
                warning=False,
                reason=reasons.RENDEZVOUS_CREATED,
                message=reasons.rendezvous_created(name, spec),
            )
        if (memory := self._jobs.get(key)) is not None:
            # Its pods made while another held the name were not reported (deleting them
            # would not have helped then): now it does.
            self._look_for_uninjected_pods(key, memory, owner["uid"])
        return True

    async def _follow_annotations(
        self,
        key: Key,
        job: Mapping[str, Any],
        spec: specs.RendezvousSpec,
        existing: Mapping[str, Any],
    ) -> None:
        namespace, name = key
        wanted = {k: v for k, v in spec.to_dict().items() if k != "runId"}
        current = existing.get("spec") or {}
        # An optional field whose annotation was removed is removed from the spec too.
        optional = ("rankOrder", *(t.field for t in tunables.SPEC_TUNABLES if t.default is None))
        removed = {k: None for k in optional if k in current and k not in wanted}
        if removed or any(current.get(k) != v for k, v in wanted.items()):
            await asyncio.to_thread(
                self._api.patch_rendezvous_spec, namespace, name, wanted | removed
            )
        if current.get("runId") != spec.run_id:
            self._post(
                [job],
                warning=True,
                reason=reasons.RUN_ID_IMMUTABLE,
                message=reasons.run_id_immutable(name, current.get("runId"), spec.run_id),
            )

    def _runs(self, key: Key) -> bool:
        """The annotated Job ``key`` is known, neither finished nor being deleted."""
        job = self.get(key)
        return job is not None and job.finished is None and not job.deleting

    def replaces(self, key: Key, held: names.Holding) -> bool:
        """Whether the Rendezvous ``held`` describes is a pod-made one that the annotated
        Job ``key``'s replaces (:mod:`.names`): it is not reconciled (nor adopted)
        meanwhile, and the Job's pods are given the env, for the Job's Rendezvous made in
        its place. Known from the Job's watch event already while that event is still being
        handled."""
        watched = self._watched.get(key)
        if watched is None or watched[1] is None or watched[1].spec is None:
            return False
        job = self.get(key)
        runs = job is None or (job.finished is None and not job.deleting)
        return names.replaced_for_job(watched[0], runs, held)

    async def replace(self, key: Key, rendezvous: Mapping[str, Any]) -> None:
        """The watch showed a pod-made Rendezvous under the name of the annotated Job
        ``key`` (made before the Job, or anew after it was replaced): replace it. A Job
        whose event is still being handled does so itself, once remembered."""
        job = self.get(key)
        if job is None or job.spec is None or not self._runs(key):
            return
        target = events.job_reference(key[0], key[1], job.uid)
        await self._replace(key, target, job.spec, rendezvous)

    async def _replace(
        self,
        key: Key,
        job: Mapping[str, Any],
        spec: specs.RendezvousSpec,
        existing: Mapping[str, Any],
    ) -> None:
        """Delete the pod-made Rendezvous ``existing`` that holds the Job's name, say so on
        the Job and on the pod's workload, and make the Job's. Its pod's next create then
        fails (the name exists), and its workload's pods are refused at their join.

        One made by a pod of the Job itself (its creator role, before the operator made
        the Job's) is the Job's: given the Job as its owner, not replaced."""
        namespace, name = key
        held = names.holding(existing)
        assert held.creator is not None
        job_uid = job["metadata"]["uid"]
        if held.owner is None:
            pod = await asyncio.to_thread(self._api.get_pod, namespace, held.creator)
            if pod is not None and names.pod_of_job(job_uid, pod):
                try:
                    adopted = await asyncio.to_thread(
                        self._api.adopt_rendezvous,
                        namespace,
                        name,
                        held.uid,
                        kube.job_owner(name, job_uid),
                    )
                except (kube.NotFound, kube.Conflict):
                    return  # deleted or made anew meanwhile: its own event follows
                await self._follow_annotations(key, job, spec, adopted)
                return
        try:
            await asyncio.to_thread(self._api.delete_rendezvous, namespace, name, held.uid)
        except (kube.NotFound, kube.Conflict):
            return  # deleted, or made anew, meanwhile: that event brings the Job back here
        except kube.Refused as error:  # RBAC or the admission policy of another release
            self._post(
                [job],
                warning=True,
                reason=reasons.RENDEZVOUS_NOT_OWNED,
                message=reasons.rendezvous_not_replaced(
                    name, namespace, held.creator, held.owner_name, error
                ),
            )
            return
        log.warning(
            "Job %s/%s: replaced Rendezvous %s made by pod %s (%s)",
            *key,
            name,
            held.creator,
            held.owner_name or "no owner",
        )
        await self._report_replaced(key, job, held)
        # If the pod makes it anew first, that one's watch event brings the Job back here.
        await self._create_rendezvous(key, job, spec, again=False)

    async def _report_replaced(self, key: Key, job: Mapping[str, Any], held: names.Holding) -> None:
        """A Warning on the Job and on the workload whose pod made the replaced Rendezvous
        (on that pod, if the Rendezvous had no owner): once per pod."""
        namespace, name = key
        assert held.creator is not None
        memory = self._jobs.get(key)
        if memory is not None:
            if held.creator in memory.replaced:
                return
            memory.replaced.add(held.creator)
        self._post(
            [job],
            warning=True,
            reason=reasons.RENDEZVOUS_REPLACED,
            message=reasons.rendezvous_replaced(name, held.creator, held.owner_name),
        )
        if (made_by := await maker(self._api, namespace, held)) is not None:
            self._post(
                [made_by],
                warning=True,
                reason=reasons.RENDEZVOUS_REPLACED,
                message=reasons.rendezvous_replaced_for_workload(
                    name, held.creator, held.owner_name, name
                ),
            )

    async def make_again(self, key: Key, deleted: Mapping[str, Any]) -> None:
        """A Rendezvous under the name of a running annotated Job was deleted: make the
        Job's. Its own (deleted by hand: garbage collection takes it only with its Job) is
        made anew, as a Job makes a deleted pod anew, and its nodes notice the new uid and
        join its first round; another's (a user's, once freed as RendezvousNotOwned said,
        or a pod-made one the operator replaced) frees the name for it. The Job is read
        first, as its own deletion may not have reached us yet: a Rendezvous made for a
        Job that is gone would only be collected again."""
        job = self.get(key)
        if job is None or job.spec is None or not self._runs(key):
            return
        owners = (deleted.get("metadata") or {}).get("ownerReferences") or []
        its_own = any(owner.get("uid") == job.uid for owner in owners)
        body = await asyncio.to_thread(self._api.get_job, *key)
        current = observe.observe_job(body) if body is not None else None
        if current is None or current.uid != job.uid or current.deleting or current.finished:
            return
        assert body is not None and current.spec is not None
        await self._ensure_rendezvous(key, body, current.spec, again=its_own)

    async def rendezvous_for_pod(
        self, namespace: str, pod: Mapping[str, Any], wait: float = WATCH_WAIT_SECONDS
    ) -> PodRendezvous | None:
        """The rendezvous of the annotated Job that owns ``pod``, if any (for the webhook).

        Answered from what the watches showed, never by a request to the API: anyone who
        reaches the webhook's port can ask, as often as its connections allow. A Job the
        watch has not shown is waited for, ``wait`` seconds at most (see
        :data:`WATCH_WAIT_SECONDS`); then the pod gets no env. That is safe: the pod is
        admitted as it would be with no webhook serving (failure policy Ignore), the
        operator reports a pod of an annotated Job made so (PodNotInjected), and the Job
        makes the env'd pod anew when that one is deleted. A request for a made-up Job
        costs a waiter here for ``wait`` seconds (no more of them than the webhook's
        connection limit) and nothing else.
        """
        owner = next(
            (
                o
                for o in (pod.get("metadata") or {}).get("ownerReferences") or []
                if o.get("kind") == "Job" and o.get("controller")
            ),
            None,
        )
        if owner is None or not isinstance(owner.get("name"), str):
            return None
        key = (namespace, owner["name"])
        job = await self._watched_job(key, owner.get("uid"), wait)
        if job is None or job.spec is None:
            return None
        rendezvous = self._known_rendezvous(key)
        if rendezvous is not None:
            owners = (rendezvous.get("metadata") or {}).get("ownerReferences") or []
            if not any(o.get("uid") == owner["uid"] for o in owners):
                return None  # someone else's: its pods must not be sent there (RendezvousNotOwned)
        # Unknown: the watch shows no Rendezvous of that name, so the operator makes it for
        # this Job (and if another made it first, the pods are refused at their join).
        return PodRendezvous(owner["name"], job.spec, job.agent_env)

    async def _watched_job(
        self, key: Key, uid: object, wait: float
    ) -> observe.JobObservation | None:
        """Job ``key`` as the watch showed it with ``uid`` (``None``: not annotated),
        waiting up to ``wait`` seconds for its event."""

        def watched() -> tuple[str, observe.JobObservation | None] | None:
            found = self._watched.get(key)
            return found if found is not None and found[0] == uid else None

        if not isinstance(uid, str) or not uid:
            return None
        if (found := watched()) is None and wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait), self._arrived:
                    await self._arrived.wait_for(lambda: watched() is not None)
            found = watched()
        return None if found is None else found[1]
