"""Which workload a pod is of: its controller, or the workload that controller stands for.
Pure: what to read and what it says; the reads are the reconciler's (one cached read of
each controller in the chain, :meth:`k8s_rendezvous_operator.kube.OperatorApi.get_owner`).

A pod's controller is not always the workload that lasts. Some controllers are made anew
by a parent during a run, or several of them make up one job, so a Rendezvous owned by
one of them would refuse the others' pods and be garbage-collected with it mid-run:

- a **Job controlled by a JobSet** stands for the JobSet: a JobSet's pods come from
  several Jobs (replicas, replicated Jobs), and a failure-policy restart deletes its Jobs
  and makes them anew;
- a **StatefulSet controlled by a Pod** stands for that pod, and a **Pod controlled by a
  StatefulSet** for the StatefulSet: a LeaderWorkerSet group's workers are a StatefulSet
  owned by the group's leader pod, and the leader pods are the LeaderWorkerSet's own
  StatefulSet's (a group is made anew whole when one of its pods fails);
- a **StatefulSet controlled by a LeaderWorkerSet** stands for the LeaderWorkerSet.

So a LeaderWorkerSet's worker pod climbs worker StatefulSet -> leader pod -> leader
StatefulSet -> LeaderWorkerSet, and its leader pod the last two steps. No other pair is
followed: a CronJob's Jobs are separate runs, each with its own rendezvous, and a
ReplicaSet's Deployment rolls its pods over to another ReplicaSet on a template change (a
new run). Adding a kind is a row of :data:`STANDS_FOR` and, if its objects are read on the
way up, of :data:`READ`, with the operator's role allowed to get them.

Each step is read from the API server, never from the pod: the ownerReferences of the
objects the controllers made. Whoever may create such an object in the namespace could
make it owned by the workload: as with the pods themselves, that is trusted (the
operator's threat model: a hostile pod, not a hostile workload author).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from k8s_rendezvous.wire import objects

MAX_DEPTH: Final = 4
"""Steps climbed at most above a pod's controller (a LeaderWorkerSet's worker climbs 3)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    group: str
    """The API group (``""``: the core group)."""
    kind: str


JOB: Final = Kind("batch", "Job")
JOBSET: Final = Kind("jobset.x-k8s.io", "JobSet")
POD: Final = Kind("", "Pod")
STATEFULSET: Final = Kind("apps", "StatefulSet")
LEADERWORKERSET: Final = Kind("leaderworkerset.x-k8s.io", "LeaderWorkerSet")

STANDS_FOR: Final[frozenset[tuple[Kind, Kind]]] = frozenset(
    {
        (JOB, JOBSET),
        (STATEFULSET, POD),
        (POD, STATEFULSET),
        (STATEFULSET, LEADERWORKERSET),
    }
)
"""(a controller's kind, its own controller's kind): the first stands for the second."""

READ: Final[Mapping[Kind, str]] = {JOB: "jobs", POD: "pods", STATEFULSET: "statefulsets"}
"""The kinds whose objects are read on the way up, by their resource (plural)."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """A controller, as an ownerReference names it."""

    api_version: str
    kind: str
    name: str
    uid: str

    @property
    def of_kind(self) -> Kind:
        group, _, version = self.api_version.rpartition("/")
        return Kind(group if version else "", self.kind)

    @property
    def resource(self) -> str | None:
        """Its plural, if objects of its kind are read on the way up."""
        return READ.get(self.of_kind)

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

    def owner_reference(self) -> dict[str, Any]:
        """As the owner of a Rendezvous: the controller, not blocking deletion."""
        return objects.owner_reference(self.api_version, self.kind, self.name, self.uid)


def controller(metadata: Mapping[str, Any]) -> Reference | None:
    """The controller ownerReference in ``metadata``, if it names one fully."""
    for owner in metadata.get("ownerReferences") or []:
        if not isinstance(owner, Mapping) or not owner.get("controller"):
            continue
        fields = [owner.get(key) for key in ("apiVersion", "kind", "name", "uid")]
        texts = [value for value in fields if isinstance(value, str) and value]
        return Reference(*texts) if len(texts) == len(fields) else None
    return None


def may_stand_for_another(reference: Reference) -> bool:
    """Whether ``reference`` may stand for its own controller: its object is worth a read."""
    return reference.resource is not None and any(
        child == reference.of_kind for child, _ in STANDS_FOR
    )


class Unknown(Exception):
    """The object read is not the one referred to (gone, or made anew under its name):
    which workload it stood for is not known now."""


def stands_for(reference: Reference, read: Mapping[str, Any] | None) -> Reference | None:
    """The controller ``reference`` stands for, from its object as read (``None``: not
    found); ``None`` if it stands for nobody (it is the workload).

    Raises:
        Unknown: ``read`` is not ``reference``'s object.
    """
    metadata = (read or {}).get("metadata") or {}
    if read is None or metadata.get("uid") != reference.uid:
        raise Unknown(f"{reference} (uid {reference.uid}) is gone or was made anew")
    parent = controller(metadata)
    if parent is None or (reference.of_kind, parent.of_kind) not in STANDS_FOR:
        return None
    return parent


def workload(controller_of_pod: Reference, above: tuple[Reference, ...]) -> Reference:
    """The workload of a pod whose controller is ``controller_of_pod``, given the
    controllers it stands for, nearest first (:func:`stands_for`, climbed)."""
    return above[-1] if above else controller_of_pod
