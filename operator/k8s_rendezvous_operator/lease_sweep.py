"""Which nodes' Leases outlived their pods, and may go (pure; :mod:`.pods` reads and
deletes them).

A Job names each replacement pod anew, so without this a Rendezvous keeps one Lease per
pod it ever had: 466 after 466 interruptions, each listed at every operator start and
counted by a ResourceQuota on Leases. A Lease is collected in two steps:

1. :func:`suspected`: what the watches already say (the pod deleted or not found, or the
   Lease written by another pod of that name than the one seen) marks its node, at no
   cost: a pass never looks at every node.
2. :func:`to_check` picks, of the marked nodes, a bounded few the round no longer needs
   (not a member of the current round nor left behind by it: a member's loss is the
   round's to handle first, from its pod and its Lease), and :func:`stale` decides on the
   Pod of the Lease's name as read after the Lease: gone, or another pod (another uid)
   than the one that wrote it. The delete then carries the Lease's uid and
   resourceVersion as read, so a Lease written since (by a new pod of that name) is never
   hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Final

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import reasons, rounds

MAX_CHECKS_PER_PASS: Final = 32
"""The most Leases one pass checks (one read of a Pod and at most one delete each): a
start-up after hundreds of interruptions collects its backlog over a few passes, never
in one burst of requests beside the rounds' own."""

RETRY_AFTER_SECONDS: Final = 30.0
"""How long a rendezvous' Leases are left alone after a check or delete failed: a refusal
(an older chart's ClusterRole without ``delete``) or an API server in trouble is tried
again at a pass this much later, not at every pass of a join storm."""

GONE: Final = frozenset({reasons.LOST_POD_DELETED, reasons.LOST_POD_NOT_FOUND})
"""What the watches say of a pod that no longer exists. A failed or finished pod still
does (its Lease goes with it, or with the Rendezvous)."""


@dataclasses.dataclass(frozen=True)
class LeaseRead:
    """A node's Lease as last seen: what its delete's preconditions hold it to."""

    rendezvous: str
    name: str
    uid: str
    resource_version: str
    pod_uid: str | None
    """The uid of the pod that wrote it (its mark), if it says."""

    @classmethod
    def from_body(cls, rendezvous: str, body: Mapping[str, Any]) -> LeaseRead | None:
        """``None`` if the body lacks what a precondition needs (never so from the API
        server)."""
        metadata = body.get("metadata") or {}
        name, uid, version = (metadata.get(k) for k in ("name", "uid", "resourceVersion"))
        if not (isinstance(name, str) and isinstance(uid, str) and isinstance(version, str)):
            return None
        mark = (metadata.get("annotations") or {}).get(objects.POD_UID_ANNOTATION)
        return cls(rendezvous, name, uid, version, mark if isinstance(mark, str) else None)


def suspected(observation: rounds.PodObservation | None, lease: LeaseRead | None) -> bool:
    """Whether what the watches say makes ``lease`` worth checking: its pod gone, or seen
    with another uid than the one that wrote it."""
    if lease is None or observation is None:
        return False
    if observation.gone_reason in GONE:
        return True
    seen = observation.identity.uid if observation.identity is not None else None
    return seen is not None and lease.pod_uid is not None and seen != lease.pod_uid


def to_check(
    marked: Iterable[str], needed: frozenset[str], limit: int = MAX_CHECKS_PER_PASS
) -> list[str]:
    """The marked nodes whose Leases to check now: not ``needed`` by the round (its
    members and those it left behind), at most ``limit``, in name order (a stable pick,
    so that a backlog goes down in order)."""
    return sorted(node for node in marked if node not in needed)[:limit]


def stale(lease: LeaseRead, pod: Mapping[str, Any] | None) -> bool:
    """Whether ``lease`` speaks for a pod that is gone, given the Pod of its node's name as
    read after it (``None``: not found). A Lease that names no writer is stale only once
    no pod has the name: the pod there may be the one that wrote it."""
    if pod is None:
        return True
    uid = (pod.get("metadata") or {}).get("uid")
    return lease.pod_uid is not None and uid != lease.pod_uid
