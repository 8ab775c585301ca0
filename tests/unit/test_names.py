"""Who may hold the name of an annotated Job's Rendezvous (``k8s_rendezvous_operator.names``).

Aspects: the Job's own Rendezvous is the Job's whoever made it; one a pod made is replaced
while the Job runs, whatever owns it and whichever came first, unless the pod is the
Job's own; one a user made is left as it is; what a Rendezvous says of its holder, for the
messages.
"""

from __future__ import annotations

from typing import Any

import pytest

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import names

JOB_UID = "uid-job"


def owner(kind: str, name: str, uid: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "name": name, "uid": uid, "controller": controller}


def rendezvous(
    creator: str | None = None,
    owners: list[dict[str, Any]] | None = None,
    selector: bool = False,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "train", "uid": "uid-rdzv"}
    if creator is not None:
        metadata["annotations"] = {objects.CREATED_BY_ANNOTATION: creator}
    if owners is not None:
        metadata["ownerReferences"] = owners
    spec: dict[str, Any] = {"minNodes": 1, "maxNodes": 2, "runId": "r"}
    if selector:
        spec["podSelector"] = {"matchLabels": {"app": "train"}}
    return {"metadata": metadata, "spec": spec}


STATEFULSET = owner("StatefulSet", "train", "uid-sts")


@pytest.mark.parametrize(
    ("body", "holder"),
    [
        pytest.param(
            rendezvous(owners=[owner("Job", "train", JOB_UID)]),
            names.Holder.JOB,
            id="made-for-the-job",
        ),
        pytest.param(
            rendezvous("train-0-abc", [owner("Job", "train", JOB_UID)]),
            names.Holder.JOB,
            id="made-by-a-pod-of-the-job-and-adopted",
        ),
        pytest.param(
            rendezvous("train-0", [STATEFULSET]),
            names.Holder.POD,
            id="made-by-another-workloads-pod",
        ),
        pytest.param(rendezvous("squatter"), names.Holder.POD, id="made-by-a-pod-not-adopted-yet"),
        pytest.param(
            rendezvous("old-0", [owner("Job", "train", "uid-an-earlier-job")]),
            names.Holder.POD,
            id="made-by-a-pod-of-an-earlier-job-of-the-name",
        ),
        pytest.param(
            rendezvous(selector=True), names.Holder.USER, id="made-by-a-user-with-a-selector"
        ),
        pytest.param(
            rendezvous(owners=[STATEFULSET]), names.Holder.USER, id="made-by-a-user-owned"
        ),
        pytest.param(rendezvous(""), names.Holder.USER, id="an-empty-creator-is-no-pod"),
    ],
)
def test_who_holds_the_name_of_an_annotated_job(body: dict[str, Any], holder: names.Holder) -> None:
    assert names.holder(JOB_UID, names.holding(body)) is holder


def test_a_pod_made_rendezvous_is_replaced_only_while_the_job_runs() -> None:
    squatted = names.holding(rendezvous("squatter", [STATEFULSET]))
    assert names.replaced_for_job(JOB_UID, True, squatted)
    assert not names.replaced_for_job(JOB_UID, False, squatted), "a finished Job frees its name"


def test_neither_the_jobs_own_nor_a_users_rendezvous_is_replaced() -> None:
    jobs_own = names.holding(rendezvous("p", [owner("Job", "j", JOB_UID)]))
    assert not names.replaced_for_job(JOB_UID, True, jobs_own)
    assert not names.replaced_for_job(JOB_UID, True, names.holding(rendezvous(selector=True)))


def test_what_a_rendezvous_says_of_its_holder() -> None:
    helper = owner("Job", "helper", "uid-helper", controller=False)
    held = names.holding(rendezvous("train-0", [helper, STATEFULSET], selector=True))
    assert held == names.Holding(
        uid="uid-rdzv",
        creator="train-0",
        owner=STATEFULSET,
        selects=True,
        owner_uids=frozenset({"uid-helper", "uid-sts"}),
    )
    assert held.owner_name == "StatefulSet/train", "the controller, not the first owner"
    assert names.holding(rendezvous(owners=[helper])).owner_name == "Job/helper"
    bare = names.holding(rendezvous("bare-pod"))
    assert (bare.owner, bare.owner_name, bare.selects) == (None, None, False)


def test_only_a_pod_the_job_controls_makes_the_jobs_own_rendezvous() -> None:
    def pod(*owners: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": "p", "ownerReferences": list(owners)}}

    assert names.pod_of_job(JOB_UID, pod(owner("Job", "train", JOB_UID)))
    assert not names.pod_of_job(JOB_UID, pod(owner("Job", "train", JOB_UID, controller=False)))
    assert not names.pod_of_job(JOB_UID, pod(STATEFULSET))
    assert not names.pod_of_job(JOB_UID, pod()), "a bare pod"
