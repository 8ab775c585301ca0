"""What Pod and Job bodies say, in the terms of the round decisions (pure); a Lease reads
itself (:class:`k8s_rendezvous.wire.leases.NodeLease`)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, Final

from k8s_rendezvous.wire import codec, objects, records, specs, statuses
from k8s_rendezvous_operator import job_annotations, membership, reasons, rounds


def observe_pod(body: Mapping[str, Any], *, deleted: bool = False) -> rounds.PodObservation:
    """Kubernetes' view of a pod, in the terms of :class:`rounds.PodObservation`.

    A pod that is being deleted counts as gone at once: Kubernetes already knows it is
    leaving, and its node must not hold a round up for the whole grace period.
    """
    status = body.get("status") or {}
    restarts = sum(
        int(container.get("restartCount") or 0)
        for container in status.get("containerStatuses") or []
    )
    identity = membership.identify_pod(body)
    gone = None
    if deleted:
        gone = reasons.LOST_POD_DELETED
    elif (body.get("metadata") or {}).get("deletionTimestamp"):
        gone = reasons.LOST_POD_TERMINATING
    elif status.get("phase") == "Failed":
        gone = reasons.LOST_POD_FAILED
    elif status.get("phase") == "Succeeded":
        gone = reasons.LOST_POD_SUCCEEDED
    node_name = (body.get("spec") or {}).get("nodeName")
    return rounds.PodObservation(
        gone,
        restarts,
        identity=identity,
        kube_node=node_name if isinstance(node_name, str) and node_name else None,
    )


def excluded_kube_nodes(
    rendezvous: Mapping[str, Any],
    now: datetime.datetime,
    pods: Mapping[str, rounds.PodObservation] | None = None,
) -> tuple[str, ...]:
    """The Kubernetes nodes a Rendezvous keeps its workload's new pods off: its
    ``status.excludedNodes`` not expired nor cleared, and the nodes of the sealed round's
    members whose pods ``pods`` (as the operator observed them, by pod name) show failed.

    The second part is the decision ahead of its write: a Job makes the replacement of a
    failed pod as soon as it sees it fail, often before the operator's write of the status
    lands, and that replacement must be kept off the node all the same. A status or
    annotation that does not decode keeps nobody out; the reconciler reports it.
    """
    observed = pods or {}
    try:
        excluded = tuple(
            records.ExcludedNode.from_dict(item, f"status.excludedNodes[{index}]")
            for index, item in enumerate(
                ((rendezvous.get("status") or {}).get("excludedNodes") or [])[
                    -statuses.MAX_EXCLUDED_NODES :
                ]
            )
        )
        annotations = (rendezvous.get("metadata") or {}).get("annotations") or {}
        raw = annotations.get(objects.CLEAR_EXCLUDED_NODES_ANNOTATION)
        cleared_at = None if raw is None else codec.parse_time(raw, "annotation")
        members = [
            member.get("node")
            for member in (rendezvous.get("status") or {}).get("members") or []
            if isinstance(member, Mapping)
        ]
    except codec.DecodeError:
        return ()
    recorded = [entry.node for entry in rounds.still_excluded(excluded, now, cleared_at)]
    failing = [
        pod.kube_node
        for name in members
        if isinstance(name, str)
        and (pod := observed.get(name)) is not None
        and pod.kube_node
        and pod.gone_reason in rounds.KEEPS_NODE_OUT
    ]
    return tuple(dict.fromkeys([*recorded, *failing]))


@dataclasses.dataclass(frozen=True)
class PodLossBudget:
    """A Job that counts its pods lost to disruptions as failures, and how many end it."""

    losses: int
    """Pods lost that end it: its ``backoffLimit`` + 1, or with ``per_index`` its
    ``backoffLimitPerIndex`` + 1 on one index (that index is then failed for good and not
    run again, and the Job ends Failed)."""
    per_index: bool
    restart_policy_never: bool
    """Its pods' ``restartPolicy`` is Never, which a ``podFailurePolicy`` needs."""


DEFAULT_BACKOFF_LIMIT: Final = 6
"""The Job API's default ``backoffLimit``."""


def _ignores_disruptions(rule: Mapping[str, Any]) -> bool:
    return rule.get("action") == "Ignore" and any(
        isinstance(condition, Mapping)
        and condition.get("type") == "DisruptionTarget"
        and condition.get("status", "True") == "True"
        for condition in rule.get("onPodConditions") or ()
    )


def pod_loss_budget(spec: Mapping[str, Any]) -> PodLossBudget | None:
    """How many pod losses end a Job of ``spec``, if pods it lost to a disruption count:
    ``None`` when a ``podFailurePolicy`` rule ignores them (action Ignore on the
    DisruptionTarget condition, which Kubernetes sets on a pod it deletes for a drain's
    eviction, a preemption, a taint or a node that is gone).

    Without that rule the Job controller counts each such pod as failed, as it counts a pod
    deleted by hand: ``backoffLimit`` (6 by default) counts them for the whole Job, and
    ``backoffLimitPerIndex`` (an Indexed Job) for each index, so a long run on a busy
    cluster ends after a few node drains, whatever the rendezvous does."""
    policy = spec.get("podFailurePolicy") or {}
    rules = policy.get("rules") if isinstance(policy, Mapping) else None
    if any(isinstance(rule, Mapping) and _ignores_disruptions(rule) for rule in rules or ()):
        return None
    never = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy") == "Never"
    limit = spec.get("backoffLimit")
    per_index = spec.get("backoffLimitPerIndex")
    if isinstance(per_index, int):
        # backoffLimit unset is then unbounded; set, it bounds the Job too, and the budget
        # spent first ends it.
        if not isinstance(limit, int) or per_index < limit:
            return PodLossBudget(per_index + 1, True, never)
        return PodLossBudget(limit + 1, False, never)
    return PodLossBudget(
        (limit if isinstance(limit, int) else DEFAULT_BACKOFF_LIMIT) + 1, False, never
    )


@dataclasses.dataclass(frozen=True)
class JobObservation:
    """What an annotated Job asks for and where it stands."""

    uid: str
    spec: specs.RendezvousSpec | None
    """``None`` when the annotations have errors (see ``errors``)."""
    errors: tuple[job_annotations.AnnotationError, ...]
    parallelism: int | None
    service_account: str
    finished: tuple[str, str] | None
    """``(reason, message)`` once the Job completed or failed."""
    deleting: bool = False
    """The Job is being deleted: what it owns goes with it, and is not made again."""
    agent_env: tuple[tuple[str, str], ...] = ()
    """What its annotations give its pods' agents (its health check), name and value."""
    pod_losses: PodLossBudget | None = None
    """How many pods lost to disruptions end it, if they count (:func:`pod_loss_budget`)."""


def observe_job(body: Mapping[str, Any]) -> JobObservation | None:
    """The rendezvous view of a Job, or ``None`` if it did not opt in."""
    metadata = body.get("metadata") or {}
    spec = body.get("spec") or {}
    parallelism = spec.get("parallelism")
    parsed = job_annotations.parse(
        metadata.get("annotations") or {},
        job_name=metadata.get("name", ""),
        parallelism=parallelism if isinstance(parallelism, int) else None,
    )
    if parsed is None:
        return None
    finished = None
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            finished = (reasons.CLOSED_JOB_COMPLETE, f"Job {metadata.get('name')} completed")
        elif condition.get("type") == "Failed":
            why = condition.get("reason") or "Failed"
            finished = (reasons.CLOSED_JOB_FAILED, f"Job {metadata.get('name')} failed: {why}")
    pod_spec = (spec.get("template") or {}).get("spec") or {}
    return JobObservation(
        uid=metadata.get("uid", ""),
        spec=parsed if isinstance(parsed, specs.RendezvousSpec) else None,
        errors=parsed if isinstance(parsed, tuple) else (),
        parallelism=parallelism if isinstance(parallelism, int) else None,
        service_account=pod_spec.get("serviceAccountName") or "default",
        finished=finished,
        deleting=bool(metadata.get("deletionTimestamp")),
        agent_env=job_annotations.agent_env(metadata.get("annotations") or {}),
        pod_losses=pod_loss_budget(spec),
    )
