"""Who may hold a Rendezvous name (pure): the rule between an annotated Job and a
Rendezvous of its name that it does not own.

The name of an annotated Job's Rendezvous is its Job's, in its namespace, while the Job
runs. Whoever may create that Job (the ``edit`` role) may already delete any Rendezvous of
the namespace; a pod with the creator role is trusted less: it may only create a missing
Rendezvous, as made by itself. So a Rendezvous a pod made (annotation
``k8s-rendezvous.dev/created-by-pod``) under the name of a running annotated Job that does
not own it is replaced: the operator deletes it and makes the Job's. The pod's next create
then fails (the name exists) and its workload's pods are refused at their join as another
workload's. This holds whichever came first: a pod picks its rendezvous name before the
Job may exist, so "first come" would let any creator pod deny a Job of any name it can
guess. A Rendezvous made otherwise (by a user or another controller: no such annotation)
is left as it is and reported: its maker may delete it, and the Job's is made the moment
the name is free.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous.wire import objects


class Holder(enum.Enum):
    """Who holds the name of an annotated Job's Rendezvous."""

    JOB = "job"
    """The Job: the Rendezvous is owned by it."""
    POD = "pod"
    """A pod made it, not for the Job: the name is taken back for the Job."""
    USER = "user"
    """Made otherwise (no creator-pod annotation), not owned by the Job: left as it is."""


@dataclasses.dataclass(frozen=True)
class Holding:
    """What a Rendezvous says of who holds its name, for the decision and the messages."""

    uid: str
    creator: str | None
    """The pod that made it (its creator-pod annotation), if a pod did."""
    owner: Mapping[str, Any] | None
    """Its controller ownerReference, else its first one, if any."""
    selects: bool
    """It names its pods by ``spec.podSelector``."""
    owner_uids: frozenset[str]
    """The uids of all its ownerReferences."""

    @property
    def owner_name(self) -> str | None:
        """``Kind/name`` of :attr:`owner`."""
        return None if self.owner is None else f"{self.owner.get('kind')}/{self.owner.get('name')}"


def holding(rendezvous: Mapping[str, Any]) -> Holding:
    """What the Rendezvous body ``rendezvous`` says of who holds its name."""
    metadata = rendezvous.get("metadata") or {}
    creator = (metadata.get("annotations") or {}).get(objects.CREATED_BY_ANNOTATION)
    owners = [o for o in metadata.get("ownerReferences") or [] if isinstance(o, Mapping)]
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    return Holding(
        uid=str(metadata.get("uid") or ""),
        creator=creator if objects.is_object_name(creator) else None,
        owner=owner,
        selects=(rendezvous.get("spec") or {}).get("podSelector") is not None,
        owner_uids=frozenset(o["uid"] for o in owners if isinstance(o.get("uid"), str)),
    )


def holder(job_uid: str, held: Holding) -> Holder:
    """Who holds the name of the Job whose uid is ``job_uid``, given what its Rendezvous
    says (:func:`holding`)."""
    if job_uid in held.owner_uids:
        return Holder.JOB
    return Holder.POD if held.creator is not None else Holder.USER


def replaced_for_job(job_uid: str, job_runs: bool, held: Holding) -> bool:
    """Whether the operator deletes the Rendezvous ``held`` describes to make the Job's in
    its place: a pod made it, not for this Job, and the Job runs (a finished or deleted Job
    needs no rendezvous, and its name is free for others again)."""
    return job_runs and holder(job_uid, held) is Holder.POD


def pod_of_job(job_uid: str, pod: Mapping[str, Any]) -> bool:
    """Whether the Job whose uid is ``job_uid`` controls ``pod``: a Rendezvous that pod
    made (its creator role, before the operator made the Job's) is the Job's own."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("controller") and o.get("uid") == job_uid for o in owners)
