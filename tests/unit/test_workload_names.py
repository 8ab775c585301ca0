"""Whose is a pod-made Rendezvous' name (``membership.claimed_by``): the workload it is
named after, of any kind workloads.py knows (and any other controller that is the
workload itself), whatever made it first; the first made keeps it otherwise.

Aspects: a pod of the workload named so, refused today as another workload's or as
nobody's, is held back instead, naming its workload; a hand-made Rendezvous, one owned by
the workload named so, or by another workload of that very name, is nobody's to claim;
the pod's chain is read to know its workload only where a claim could follow.
"""

from __future__ import annotations

from typing import Any

import pytest

from k8s_rendezvous.wire import leases, objects, specs
from k8s_rendezvous_operator import membership, reasons
from k8s_rendezvous_operator.workloads import Reference

SQUATTER = Reference("apps/v1", "StatefulSet", "squatter", "squatter-uid")
STATEFULSET = Reference("apps/v1", "StatefulSet", "train", "sts-uid")
JOB = Reference("batch/v1", "Job", "train", "job-uid")
JOBSET = Reference("jobset.x-k8s.io/v1alpha2", "JobSet", "train", "jobset-uid")
JOBSET_JOB = Reference("batch/v1", "Job", "train-workers-0", "jobset-job-uid")
LWS = Reference("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "train", "lws-uid")
LWS_WORKERS = Reference("apps/v1", "StatefulSet", "train-0", "workers-uid")
PYTORCHJOB = Reference("kubeflow.org/v1", "PyTorchJob", "train", "ptj-uid")
ENTRY = leases.NodeEntry("i-1", 1, "10.1.0.5", 29500)

KINDS = {
    # the pod's controller, and the workload it stands for once its chain is read
    "StatefulSet": (STATEFULSET, None),
    "Job": (JOB, None),
    "JobSet": (JOBSET_JOB, JOBSET),
    "LeaderWorkerSet": (LWS_WORKERS, LWS),
    "PyTorchJob": (PYTORCHJOB, None),
}


def made_by_a_pod(owner: Reference | None, name: str = "train") -> membership.Workload:
    metadata: dict[str, Any] = {
        "name": name,
        "annotations": {objects.CREATED_BY_ANNOTATION: "squatter-0"},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner.owner_reference()]
    body = {"metadata": metadata, "spec": {"minNodes": 1, "maxNodes": 1, "runId": name}}
    return membership.workload_of(body, specs.RendezvousSpec.from_dict(body["spec"]))


def identity(controller: Reference, workload: Reference | None) -> membership.PodIdentity:
    climbed = workload is not None
    return membership.PodIdentity(
        uid="pod-uid",
        controller=controller,
        labels=(),
        addresses=frozenset({ENTRY.addr}),
        ancestors=(workload.uid,) if climbed else (),
        workload=workload if climbed else None,
    )


def admitted(workload: membership.Workload, pod: membership.PodIdentity) -> Any:
    return membership.admit(workload, {"train-0": ENTRY}, {"train-0": pod}, frozenset())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("owner", [SQUATTER, None], ids=["owned-by-the-squatter", "unowned"])
def test_a_pod_of_the_workload_a_pod_made_rendezvous_is_named_after_is_held_back_as_its_claim(
    kind: str, owner: Reference | None
) -> None:
    controller, stands_for = KINDS[kind]
    workload = made_by_a_pod(owner)
    pod = identity(controller, stands_for)
    unread = membership.PodIdentity("u", controller, (), frozenset())
    read_above = kind != "PyTorchJob"  # a kind that stands for no other is the workload
    assert membership.to_climb(workload, unread) == (controller if read_above else None)
    admission = admitted(workload, pod)
    assert (admission.counted, admission.refused) == ({}, {})
    assert admission.claims == {"train-0": stands_for or controller}


def test_a_pod_of_another_workload_is_refused_as_before() -> None:
    other = Reference("apps/v1", "StatefulSet", "elsewhere", "other-uid")
    admission = admitted(made_by_a_pod(SQUATTER), identity(other, None))
    assert admission.claims == {}
    assert admission.refused["train-0"].reason == reasons.REFUSED_OTHER_WORKLOAD


def test_a_name_held_by_its_own_workload_or_one_of_the_same_name_is_not_claimed() -> None:
    own = admitted(made_by_a_pod(STATEFULSET), identity(STATEFULSET, None))
    assert (list(own.counted), own.claims) == (["train-0"], {})
    namesake = admitted(made_by_a_pod(JOB), identity(STATEFULSET, None))
    assert namesake.claims == {}, "two workloads of the name: the first made keeps it"
    assert namesake.refused["train-0"].reason == reasons.REFUSED_OTHER_WORKLOAD


def test_a_hand_made_rendezvous_is_nobodys_to_claim_and_costs_no_climb() -> None:
    body = {"metadata": {"name": "train"}, "spec": {"minNodes": 1, "maxNodes": 1, "runId": "t"}}
    hand_made = membership.workload_of(body, specs.RendezvousSpec.from_dict(body["spec"]))
    assert not hand_made.pod_made
    assert membership.to_climb(hand_made, identity(JOBSET_JOB, None)) is None
    admission = admitted(hand_made, identity(STATEFULSET, None))
    assert admission.claims == {}
    assert admission.refused["train-0"].reason == reasons.REFUSED_NO_RULE


def test_a_pod_whose_chain_is_not_read_claims_by_its_controller_only() -> None:
    """A JobSet's Job is named train-workers-0, not train: unread, it claims nothing."""
    admission = admitted(made_by_a_pod(SQUATTER), identity(JOBSET_JOB, None))
    assert admission.claims == {}
    assert admission.refused["train-0"].reason == reasons.REFUSED_OTHER_WORKLOAD
