"""What a Pod body says about the node running in it (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k8s_rendezvous_operator import rounds


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
    if deleted:
        return rounds.PodObservation(rounds.LOST_POD_DELETED, restarts)
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return rounds.PodObservation(rounds.LOST_POD_TERMINATING, restarts)
    phase = status.get("phase")
    if phase == "Failed":
        return rounds.PodObservation(rounds.LOST_POD_FAILED, restarts)
    if phase == "Succeeded":
        return rounds.PodObservation(rounds.LOST_POD_SUCCEEDED, restarts)
    return rounds.PodObservation(None, restarts)
