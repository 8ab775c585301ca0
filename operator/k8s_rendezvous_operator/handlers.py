"""The kopf registrations: what the operator watches and how each event reaches the
:class:`.reconciler.Reconciler` (imported for its side effect by ``__main__``), and the
admission webhook's (:func:`register_webhook`, with ``--webhook``).

Only kopf's low-level event handlers are used: they run on every watch event at once,
without the wait for the operator's own patches that kopf's create/update handlers make,
so the join that completes a round is sealed within milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import injection, jobs, kube, observe, probing, webhook
from k8s_rendezvous_operator.reconciler import Reconciler
from k8s_rendezvous_operator.settings import Settings


def _settings(memo: kopf.Memo) -> Settings:
    """The operator's settings, as ``__main__`` parsed them from its flags."""
    parsed: Settings = memo["settings"]
    return parsed


def post(targets: Sequence[Mapping[str, Any]], *, warning: bool, reason: str, message: str) -> None:
    """Post an Event through kopf (which batches them and never blocks the caller)."""
    kopf.event(
        [kopf.Body(cast(kopf.RawBody, dict(target))) for target in targets],
        type="Warning" if warning else "Normal",
        reason=reason,
        message=message,
    )


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
    ours = _settings(memo)
    settings.posting.reporting_component = "k8s-rendezvous-operator"
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.posting.level = logging.INFO
    # Only pods we labelled (nodes of some rendezvous) are streamed to us, not every pod.
    settings.watching.label_selectors["pods"] = objects.NODE_LABEL
    settings.watching.label_selectors["leases"] = objects.NODE_LABEL
    # No cluster-wide namespace/CRD scanning: fewer permissions, nothing to gain here.
    settings.scanning.disabled = True
    settings.execution.max_workers = 8
    # Opting Jobs in by annotation means every Job event reaches us; a cluster with many
    # Jobs can require a label as well, filtered by the API server.
    if ours.job_label_selector is not None:
        settings.watching.label_selectors["jobs"] = ours.job_label_selector
    api = kube.OperatorApi(kube.load_api_client())
    reconciler = Reconciler(api, post, worker_role=ours.worker_role)
    # Know every node's request before the first reconcile: a member whose Lease had not
    # been seen yet would otherwise count as gone.
    reconciler.leases_listed(await asyncio.to_thread(api.list_node_leases, ours.namespaces))
    reconciler.started()
    memo["reconciler"] = reconciler
    if ours.probes is not None:
        memo["prober"] = probing.Prober(
            reconciler.probe_targets,
            reconciler.probes_judged,
            interval=ours.probes.interval,
            window=ours.probes.window,
        )


@kopf.on.cleanup()
async def stop_probing(memo: kopf.Memo, **_: Any) -> None:
    if (prober := memo.get("prober")) is not None:
        await prober.stop()


@kopf.on.event(objects.GROUP, objects.VERSION, objects.PLURAL)
async def rendezvous_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    if (prober := memo.get("prober")) is not None:
        # Started from an event handler, not at startup: the reconciles it asks for post
        # Events, which kopf takes only from tasks begun in its handlers' context.
        prober.start()
    assert namespace is not None, "namespaced resource"
    await reconciler.rendezvous_seen(
        (namespace, name), dict(body), deleted=event.get("type") == "DELETED"
    )


@kopf.on.event("", "v1", "pods", labels={objects.NODE_LABEL: kopf.PRESENT})
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
    reconciler.pods.seen(
        (namespace, name),
        observation,
        labels.get(objects.NODE_LABEL),
        node_name=(body.get("spec") or {}).get("nodeName"),
        version=objects.resource_version(body),
    )


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={objects.NODE_LABEL: kopf.PRESENT})
async def lease_event(
    event: kopf.RawEvent,
    body: kopf.Body,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    assert namespace is not None, "namespaced resource"
    reconciler.lease_changed(namespace, dict(body), deleted=event.get("type") == "DELETED")


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


def register_webhook() -> None:
    """Serve the mutating admission webhook that gives pods of annotated Jobs torchrun's
    environment (:mod:`.webhook` says how it is registered with the API server)."""
    kopf.on.startup()(_configure_webhook)
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id=webhook.HANDLER_ID,
        operations={"CREATE"},
        ignore_failures=True,
        labels={webhook.JOB_NAME_LABEL: kopf.PRESENT},
    )(_inject_torchrun_env)


async def _configure_webhook(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ours = _settings(memo)
    assert ours.webhook is not None, "registered with --webhook only"
    settings.admission.server = webhook.server(ours.webhook, ours.namespaces)
    settings.admission.managed = None


def _webhook_wait(ours: Settings) -> float:
    """How long a pod whose Job the watch has not shown yet waits for its event. With a Job
    label selector the watch never shows the other Jobs, whose pods the webhook is sent
    all the same (a pod carries no Job label): none waits, and a selected Job's pod that
    outruns its Job's event is admitted without the env and reported (PodNotInjected)."""
    if ours.job_label_selector is not None or ours.webhook is None:
        return 0.0
    return min(jobs.WATCH_WAIT_SECONDS, ours.webhook.timeout_seconds / 2)


async def _inject_torchrun_env(
    body: kopf.Body, patch: kopf.Patch, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    found = await reconciler.jobs.rendezvous_for_pod(
        namespace or body.metadata.namespace or "", body, wait=_webhook_wait(_settings(memo))
    )
    if found is not None:
        excluded = reconciler.excluded_nodes(
            (namespace or body.metadata.namespace or "", found.name)
        )
        changes = injection.inject(body, found.name, found.spec, excluded, found.agent_env)
        for key, value in changes.items():
            patch[key] = value
