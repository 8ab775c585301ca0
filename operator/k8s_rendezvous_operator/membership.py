"""Who may be a node of a rendezvous: a pure check of a node's request against what
Kubernetes itself says about the pod behind it. No I/O here.

A pod can write only its own Lease (the admission policy ties the Lease to the pod's
bound token), but it can name any Rendezvous in it and any address. So the operator counts
a request only when:

1. the pod belongs to the Rendezvous' workload: its controller, or one its controller
   stands for (:mod:`.workloads`), is the Rendezvous' controller owner (the annotated Job,
   or the workload of the pod that created it, which the operator makes its owner:
   :func:`creator_to_adopt`), and its labels match ``spec.podSelector`` if one is set. A
   Rendezvous with neither (made by hand, without a selector) admits nobody: there is no
   workload to check against;
2. the address it offers is one of its pod's IPs (its node's, for a host-network pod), so
   that rank 0's store is where that pod is and nowhere else.

Anything else is never counted, ranked or allowed to close the rendezvous.

A Rendezvous a pod made is named after a workload of its namespace, and owned by another
(or by none), when a pod of the other made it first: it is not that pod's to hold. A pod
of the workload it is named after that asks to join is not refused but held back
(:func:`claimed_by`), and the operator gives the name back to that workload.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous.wire import leases, objects, records, specs, statuses
from k8s_rendezvous_operator import reasons, workloads

_NOT_ITS_WORKLOADS = (reasons.REFUSED_NO_RULE, reasons.REFUSED_OTHER_WORKLOAD)
"""The refusals a claim of the name (:func:`claimed_by`) turns into holding back."""


@dataclasses.dataclass(frozen=True)
class PodIdentity:
    """What the Pod object says about who a pod is and where it can be reached."""

    uid: str
    controller: workloads.Reference | None
    labels: tuple[tuple[str, str], ...]
    addresses: frozenset[str]
    """Its ``status.podIPs`` (its node's ``status.hostIPs`` on the host network), in
    canonical form."""
    ancestors: tuple[str, ...] = ()
    """The uids of the controllers its controller stands for, nearest first, where the
    operator has read them (:func:`to_climb`); the Pod object alone does not say."""
    workload: workloads.Reference | None = None
    """The last of them (or its controller), where the operator has read them."""

    @property
    def controller_uid(self) -> str | None:
        return None if self.controller is None else self.controller.uid


@dataclasses.dataclass(frozen=True)
class Workload:
    """Whose pods a Rendezvous admits."""

    name: str
    owner_uid: str | None
    owner: str | None
    selector: specs.LabelSelector | None
    owner_name: str | None = None
    """The name of its controller owner (:attr:`owner` is ``Kind/name``)."""
    pod_made: bool = False
    """A pod made it (its creator-pod annotation names one): the name may be claimed."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    reason: str
    message: str


@functools.lru_cache(maxsize=1 << 16)
def canonical_address(text: str) -> str | None:
    """The canonical form of an IP literal (IPv6 compressed, lower case), else ``None``.
    Cached: each pass of a rendezvous checks every request's address, and parsing one
    costs more than the rest of its check."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return None


def identify_pod(body: Mapping[str, Any]) -> PodIdentity:
    metadata = body.get("metadata") or {}
    status = body.get("status") or {}
    if (body.get("spec") or {}).get("hostNetwork"):
        listed = [item.get("ip") for item in status.get("hostIPs") or []] or [status.get("hostIP")]
    else:
        listed = [item.get("ip") for item in status.get("podIPs") or []] or [status.get("podIP")]
    addresses = frozenset(
        address
        for text in listed
        if isinstance(text, str) and (address := canonical_address(text)) is not None
    )
    labels = metadata.get("labels") or {}
    return PodIdentity(
        uid=str(metadata.get("uid") or ""),
        controller=workloads.controller(metadata),
        labels=tuple(sorted((k, v) for k, v in labels.items() if k != objects.NODE_LABEL)),
        addresses=addresses,
    )


def creator_to_adopt(rendezvous: Mapping[str, Any], spec: specs.RendezvousSpec) -> str | None:
    """The pod whose controller is to own ``rendezvous``: the pod that made it, if it has
    no controller owner yet and no ``spec.podSelector`` says whose pods it admits."""
    metadata = rendezvous.get("metadata") or {}
    if workloads.controller(metadata) is not None or spec.pod_selector is not None:
        return None
    creator = (metadata.get("annotations") or {}).get(objects.CREATED_BY_ANNOTATION)
    return creator if objects.is_object_name(creator) else None


def to_climb(workload: Workload, identity: PodIdentity) -> workloads.Reference | None:
    """The pod's controller, if the controllers it stands for must be read to tell whether
    the pod belongs to ``workload``, or whether its workload claims a pod-made one's name:
    only when the Rendezvous is owned, not by the pod's controller, or made by a pod and
    not owned yet, and that controller may stand for another."""
    reference = identity.controller
    if reference is None or reference.uid == workload.owner_uid:
        return None
    if workload.owner_uid is None and not workload.pod_made:
        return None
    return reference if workloads.may_stand_for_another(reference) else None


def workload_of(rendezvous: Mapping[str, Any], spec: specs.RendezvousSpec) -> Workload:
    metadata = rendezvous.get("metadata") or {}
    owner = workloads.controller(metadata)
    creator = (metadata.get("annotations") or {}).get(objects.CREATED_BY_ANNOTATION)
    return Workload(
        name=str(metadata.get("name") or ""),
        owner_uid=owner.uid if owner else None,
        owner=str(owner) if owner else None,
        selector=spec.pod_selector,
        owner_name=owner.name if owner else None,
        pod_made=objects.is_object_name(creator),
    )


def claimed_by(workload: Workload, identity: PodIdentity) -> workloads.Reference | None:
    """The workload of the pod ``identity`` describes, if the name of the pod-made
    Rendezvous ``workload`` describes is that workload's: named after it, and not owned
    by it nor by another workload of that name (of another kind: then the first made
    keeps it). A name a workload needs is that workload's whatever made it first, as an
    annotated Job's is its Job's (:mod:`.names`): a pod, with the creator role, may only
    make a missing Rendezvous, and cannot deny it to a workload that comes later."""
    mine = identity.workload or identity.controller
    if (
        not workload.pod_made
        or mine is None
        or mine.name != workload.name
        or workload.owner_name == workload.name
    ):
        return None
    return mine


def refusal(
    workload: Workload, pod: str, identity: PodIdentity, entry: leases.NodeEntry
) -> Refusal | None:
    """Why ``pod``'s request may not count in ``workload``'s rendezvous, or ``None``."""
    if workload.owner_uid is None and workload.selector is None:
        return Refusal(reasons.REFUSED_NO_RULE, reasons.refused_no_rule(workload.name, pod))
    if workload.owner_uid is not None and workload.owner_uid not in (
        identity.controller_uid,
        *identity.ancestors,
    ):
        return Refusal(
            reasons.REFUSED_OTHER_WORKLOAD,
            reasons.refused_other_workload(
                workload.name, pod, str(identity.controller or "nothing"), workload.owner
            ),
        )
    if workload.selector is not None and not workload.selector.matches(dict(identity.labels)):
        return Refusal(
            reasons.REFUSED_SELECTOR,
            reasons.refused_selector(workload.name, pod, str(workload.selector)),
        )
    if canonical_address(entry.addr) not in identity.addresses:
        return Refusal(
            reasons.REFUSED_ADDRESS,
            reasons.refused_address(pod, entry.addr, sorted(identity.addresses)),
        )
    return None


@dataclasses.dataclass
class Checked:
    """What each pod's request was last checked against, and the outcome: a pass checks
    every request, and between two passes of a world of thousands all but the few that
    joined meanwhile are unchanged."""

    workload: Workload | None = None
    outcomes: dict[str, tuple[leases.NodeEntry, PodIdentity, Refusal | None]] = dataclasses.field(
        default_factory=dict
    )

    def refusal(
        self, workload: Workload, pod: str, identity: PodIdentity, entry: leases.NodeEntry
    ) -> Refusal | None:
        """:func:`refusal`, reused while its inputs are equal."""
        if workload != self.workload:
            self.workload, self.outcomes = workload, {}
        last = self.outcomes.get(pod)
        if last is not None and last[0] == entry and last[1] == identity:
            return last[2]
        problem = refusal(workload, pod, identity, entry)
        self.outcomes[pod] = (entry, identity, problem)
        return problem


@dataclasses.dataclass(frozen=True)
class Admission:
    counted: dict[str, leases.NodeEntry]
    """The requests the round decisions see."""
    refused: dict[str, Refusal]
    """Pods whose request is never counted, and why."""
    claims: dict[str, workloads.Reference] = dataclasses.field(default_factory=dict)
    """Pods held back, neither counted nor refused, as their workload, named after the
    pod-made Rendezvous, claims its name (:func:`claimed_by`)."""

    def published(self, requests: Mapping[str, leases.NodeEntry]) -> tuple[records.Refusal, ...]:
        """The refusals the status names for the refused nodes to read, by pod name and at
        most :data:`~k8s_rendezvous.wire.statuses.MAX_REFUSED` of them."""
        return tuple(
            records.Refusal(
                pod, requests[pod].instance, requests[pod].attempt, refusal.reason, refusal.message
            )
            for pod, refusal in sorted(self.refused.items())[: statuses.MAX_REFUSED]
        )


def admit(
    workload: Workload,
    requests: Mapping[str, leases.NodeEntry],
    identities: Mapping[str, PodIdentity | None],
    admitted_before: frozenset[str],
    writers: Mapping[str, str] | None = None,
    checked: Checked | None = None,
) -> Admission:
    """Split the requests into those that count and those refused.

    A request whose pod has not been observed yet is held back (neither counted nor
    refused) until it is: nobody is admitted unchecked. The exception is a node already
    admitted to the current round (``admitted_before``): it was checked then, and a
    restarted operator that has not seen its pod again must not count it as gone.

    ``writers`` gives the uid of the pod that wrote each request, where its Lease says
    (the admission policy holds that to the writer's token). A request written by an
    earlier pod of the same name is held back too: that pod is gone, and the one now
    behind the name has not asked anything yet.

    A pod whose workload claims the name of a pod-made Rendezvous (:func:`claimed_by`) is
    held back as well, in :attr:`Admission.claims`: the name is given back to its
    workload, which it would otherwise be refused from for good.

    ``checked`` keeps the outcomes of the checks from one pass to the next.
    """
    counted: dict[str, leases.NodeEntry] = {}
    refused: dict[str, Refusal] = {}
    claims: dict[str, workloads.Reference] = {}
    for pod, entry in requests.items():
        identity = identities.get(pod)
        if identity is None:
            if pod in admitted_before:
                counted[pod] = entry
            continue
        if (writer := (writers or {}).get(pod)) is not None and writer != identity.uid:
            continue
        if not identity.addresses:
            continue  # the kubelet has not reported its IPs yet: nothing to check the address by
        problem = (
            refusal(workload, pod, identity, entry)
            if checked is None
            else checked.refusal(workload, pod, identity, entry)
        )
        if problem is None:
            counted[pod] = entry
        elif problem.reason in _NOT_ITS_WORKLOADS and (claimant := claimed_by(workload, identity)):
            claims[pod] = claimant
        else:
            refused[pod] = problem
    if checked is not None and len(checked.outcomes) > len(requests):
        checked.outcomes = {
            pod: outcome for pod, outcome in checked.outcomes.items() if pod in requests
        }
    return Admission(counted, refused, claims)
