"""Where Events go: the poster the reconciler is given (kopf's, in :mod:`.handlers`), and
the budget that keeps a misbehaving pod from turning into as many Warnings."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from k8s_rendezvous_operator import metrics

Key = tuple[str, str]
"""(namespace, name)"""


class Poster(Protocol):
    """Posts one Event on each of ``targets`` (bodies with apiVersion, kind and metadata)."""

    def __call__(
        self, targets: Sequence[Mapping[str, Any]], *, warning: bool, reason: str, message: str
    ) -> None: ...


def job_reference(namespace: str, name: str, uid: str) -> dict[str, Any]:
    """Enough of a Job to post an Event on it without reading it."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
    }


def rendezvous_targets(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A Rendezvous and the Job that controls it, if any: where `kubectl describe` of
    either shows what happened to the rounds."""
    metadata = body["metadata"]
    return [
        body,
        *(
            job_reference(metadata.get("namespace"), owner["name"], owner["uid"])
            for owner in metadata.get("ownerReferences") or []
            if owner.get("kind") == "Job" and owner.get("controller")
        ),
    ]


WARNING_BUDGET = 10
"""Warning Events about bad node input per rendezvous and WARNING_WINDOW: a pod writing
request after request must not turn into as many Events."""
WARNING_WINDOW = datetime.timedelta(minutes=1)


class WarningBudget:
    """At most :data:`WARNING_BUDGET` Events per rendezvous in any :data:`WARNING_WINDOW`;
    the rest are counted (``k8s_rendezvous_events_suppressed_total``) and logged."""

    def __init__(self) -> None:
        self._sent: list[datetime.datetime] = []

    def allow(self, now: datetime.datetime) -> bool:
        recent = [moment for moment in self._sent if now - moment < WARNING_WINDOW]
        allowed = len(recent) < WARNING_BUDGET
        if allowed:
            recent.append(now)
        else:
            metrics.EVENTS_SUPPRESSED.inc()
        self._sent = recent
        return allowed
