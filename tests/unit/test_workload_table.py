"""Which workload a pod is of: the table of controllers that stand for another, and the
climb up to it with one read per object."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from k8s_rendezvous_operator import owners, workloads
from k8s_rendezvous_operator.workloads import Reference

LWS = Reference("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "train", "lws-uid")
LEADERS = Reference("apps/v1", "StatefulSet", "train", "leaders-uid")
LEADER = Reference("v1", "Pod", "train-0", "leader-uid")
WORKERS = Reference("apps/v1", "StatefulSet", "train-0", "workers-uid")
JOB = Reference("batch/v1", "Job", "train-workers-0", "job-uid")
JOBSET = Reference("jobset.x-k8s.io/v1alpha2", "JobSet", "train", "jobset-uid")
CRONJOB = Reference("batch/v1", "CronJob", "nightly", "cron-uid")
REPLICASET = Reference("apps/v1", "ReplicaSet", "train-5d8f", "rs-uid")
DEPLOYMENT = Reference("apps/v1", "Deployment", "train", "deploy-uid")


def reference_dict(reference: Reference, controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": reference.api_version,
        "kind": reference.kind,
        "name": reference.name,
        "uid": reference.uid,
        "controller": controller,
    }


def body(reference: Reference, owner: Reference | None = None) -> dict[str, Any]:
    owners_ = [reference_dict(owner)] if owner is not None else []
    return {"metadata": {"name": reference.name, "uid": reference.uid, "ownerReferences": owners_}}


# A LeaderWorkerSet as its controller makes it: the leaders' StatefulSet, a leader pod of
# it, and the group's workers' StatefulSet owned by that leader pod.
LEADER_WORKER_SET = {
    LEADERS: body(LEADERS, LWS),
    LEADER: body(LEADER, LEADERS),
    WORKERS: body(WORKERS, LEADER),
    JOB: body(JOB, JOBSET),
}


class Reader:
    """What the API server holds, counting the reads."""

    def __init__(self, objects: dict[Reference, dict[str, Any]]) -> None:
        self.objects = objects
        self.reads: list[tuple[str, Reference]] = []

    def __call__(self, namespace: str, reference: Reference) -> dict[str, Any] | None:
        self.reads.append((namespace, reference))
        return self.objects.get(reference)


def climb(reader: Reader, reference: Reference, chains: owners.Owners | None = None) -> Any:
    return asyncio.run((chains or owners.Owners(reader)).above("ns", reference))


def test_a_leaderworkersets_worker_climbs_to_the_leaderworkerset() -> None:
    reader = Reader(LEADER_WORKER_SET)
    assert climb(reader, WORKERS) == (LEADER, LEADERS, LWS)
    assert workloads.workload(WORKERS, (LEADER, LEADERS, LWS)) == LWS
    assert climb(reader, LEADERS) == (LWS,), "a leader pod's controller"


def test_a_jobsets_job_stands_for_the_jobset_and_other_parents_are_not_followed() -> None:
    objects = {
        **LEADER_WORKER_SET,
        Reference("batch/v1", "Job", "run-1", "run-uid"): body(
            Reference("batch/v1", "Job", "run-1", "run-uid"), CRONJOB
        ),
        REPLICASET: body(REPLICASET, DEPLOYMENT),
    }
    reader = Reader(objects)
    assert climb(reader, JOB) == (JOBSET,)
    assert climb(reader, Reference("batch/v1", "Job", "run-1", "run-uid")) == (), (
        "a CronJob's Jobs are separate runs"
    )
    assert climb(reader, REPLICASET) == (), "a Deployment rolls over to another ReplicaSet"
    assert [r for _, r in reader.reads] == [
        JOB,
        Reference("batch/v1", "Job", "run-1", "run-uid"),
    ], "a ReplicaSet stands for nobody: it is not read"


def test_each_object_is_read_once_and_a_gone_one_is_asked_again() -> None:
    reader = Reader(dict(LEADER_WORKER_SET))
    chains = owners.Owners(reader)
    assert climb(reader, WORKERS, chains) == (LEADER, LEADERS, LWS)
    assert climb(reader, WORKERS, chains) == (LEADER, LEADERS, LWS)
    assert len(reader.reads) == 3, "the second climb is answered from what was read"
    gone = Reference("apps/v1", "StatefulSet", "train-1", "workers-uid-2")
    assert climb(reader, gone, chains) is None, "not found: unknown now"
    reader.objects[gone] = body(gone, LEADER)
    assert climb(reader, gone, chains) == (LEADER, LEADERS, LWS), "read again once it exists"


def test_an_object_made_anew_under_the_same_name_is_not_the_one_referred_to() -> None:
    anew = {"metadata": {"name": JOB.name, "uid": "job-uid-2", "ownerReferences": []}}
    with pytest.raises(workloads.Unknown, match="gone or was made anew"):
        workloads.stands_for(JOB, anew)
    with pytest.raises(workloads.Unknown):
        workloads.stands_for(JOB, None)
    assert climb(Reader({JOB: anew}), JOB) is None


def test_the_climb_is_bounded_however_the_owners_loop() -> None:
    first = Reference("apps/v1", "StatefulSet", "a", "a-uid")
    second = Reference("v1", "Pod", "b", "b-uid")
    reader = Reader({first: body(first, second), second: body(second, first)})
    chain = climb(reader, first)
    assert len(chain) == workloads.MAX_DEPTH
    assert len(reader.reads) == 2, "each object once"


@pytest.mark.parametrize(
    "owner",
    [
        {"kind": "Job", "name": "j", "uid": "u", "controller": True},
        {"apiVersion": "batch/v1", "kind": "Job", "name": "", "uid": "u", "controller": True},
        {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": 5, "controller": True},
        "not an object",
    ],
)
def test_a_controller_reference_missing_a_field_names_no_controller(owner: Any) -> None:
    assert workloads.controller({"ownerReferences": [owner]}) is None


def test_only_the_controller_reference_counts() -> None:
    metadata = {"ownerReferences": [reference_dict(JOBSET, controller=False), reference_dict(JOB)]}
    assert workloads.controller(metadata) == JOB
    assert workloads.controller({"ownerReferences": [reference_dict(JOB, False)]}) is None


def test_kinds_are_told_apart_by_group_not_by_name_alone() -> None:
    impostor = Reference("example.com/v1", "JobSet", "train", "other-uid")
    objects = {JOB: body(JOB, impostor)}
    assert climb(Reader(objects), JOB) == (), "a JobSet of another group is not JobSet"
    assert Reference("v1", "Pod", "p", "u").of_kind == workloads.POD
    assert Reference("apps/v1", "StatefulSet", "s", "u").resource == "statefulsets"
    assert Reference("example.com/v1", "StatefulSet", "s", "u").resource is None
