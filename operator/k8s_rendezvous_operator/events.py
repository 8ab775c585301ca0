"""Where Events go: the poster the reconciler is given (kopf's, in :mod:`.handlers`), and
the budgets that keep a misbehaving pod from turning into as many Warnings."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Final, Protocol

from k8s_rendezvous_operator import metrics

Key = tuple[str, str]
"""(namespace, name)"""


class Poster(Protocol):
    """Posts one Event on each of ``targets`` (bodies with apiVersion, kind and metadata)."""

    def __call__(
        self, targets: Sequence[Mapping[str, Any]], *, warning: bool, reason: str, message: str
    ) -> None: ...


def object_reference(
    namespace: str, api_version: object, kind: object, name: object, uid: object
) -> dict[str, Any]:
    """Enough of an object to post an Event on it without reading it."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
    }


def job_reference(namespace: str, name: str, uid: str) -> dict[str, Any]:
    """Enough of a Job to post an Event on it without reading it."""
    return object_reference(namespace, "batch/v1", "Job", name, uid)


def owner_target(namespace: str, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The object an ownerReference in ``namespace`` names, to post an Event on it."""
    return object_reference(
        namespace, owner.get("apiVersion"), owner.get("kind"), owner.get("name"), owner.get("uid")
    )


def rendezvous_targets(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A Rendezvous and the Job that controls it, if any: where `kubectl describe` of
    either shows what happened to the rounds."""
    metadata = body["metadata"]
    return [
        object_reference(
            metadata.get("namespace"),
            body.get("apiVersion"),
            body.get("kind"),
            metadata.get("name"),
            metadata.get("uid"),
        ),
        *(
            job_reference(metadata.get("namespace"), owner["name"], owner["uid"])
            for owner in metadata.get("ownerReferences") or []
            if owner.get("kind") == "Job" and owner.get("controller")
        ),
    ]


WARNING_WINDOW = datetime.timedelta(minutes=1)
WARNING_BUDGETS: Final = {"rendezvous": 10, "pod": 10, "namespace": 30, "operator": 100}
"""Warning Events about bad input per WARNING_WINDOW, for each rendezvous, each pod that
caused them, each namespace and the operator as a whole. A pod picks the names it writes
under, so a budget per rendezvous alone is one it can multiply (300 made-up rendezvous
names gave 300 Warnings); its namespace's and the operator's bound it whatever it does."""
# Each budget's series is served at 0 from the start, so that the first suppression shows
# as an increase (a series first scraped at 1 has no rate in Prometheus).
for _budget in WARNING_BUDGETS:
    metrics.EVENTS_SUPPRESSED.labels(_budget)
BUDGETS_KEPT: Final = 1024
"""Budgets kept before those with nothing in their window are dropped: memory a pod's
made-up names cost is bounded by what it sent in one window."""


class WarningBudgets:
    """Whether a Warning may be posted: only if every budget it falls under has room, and
    then it counts in each. The rest are counted by level
    (``k8s_rendezvous_events_suppressed_total``) and logged."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, ...], list[datetime.datetime]] = {}

    def allow(
        self, now: datetime.datetime, namespace: str, rendezvous: str, pod: str | None = None
    ) -> bool:
        keys = [
            ("operator",),
            ("namespace", namespace),
            ("rendezvous", namespace, rendezvous),
            *([("pod", namespace, pod)] if pod is not None else []),
        ]
        recent = {key: self._recent(key, now) for key in keys}
        full = next((key for key in keys if len(recent[key]) >= WARNING_BUDGETS[key[0]]), None)
        if full is not None:
            metrics.EVENTS_SUPPRESSED.labels(full[0]).inc()
            return False
        for key in keys:
            self._sent[key] = [*recent[key], now]
        if len(self._sent) > BUDGETS_KEPT:
            self._sent = {k: v for k, v in self._sent.items() if self._recent(k, now)}
        return True

    def __len__(self) -> int:
        """How many budgets are kept (each a few timestamps)."""
        return len(self._sent)

    def _recent(self, key: tuple[str, ...], now: datetime.datetime) -> list[datetime.datetime]:
        return [moment for moment in self._sent.get(key, ()) if now - moment < WARNING_WINDOW]
