"""JobSet with the real JobSet controller and operator: a replicated Job whose pods run
``torchrun --rdzv-backend=kubernetes --rdzv-endpoint=train --nnodes=2:3 train.py``, nothing
else changed (no POD_NAME: a JobSet pod's hostname is not its name, the node asks its
token), played by the stand-in kubelet. The first pod makes the Rendezvous (the creator
role), and the operator gives it the JobSet as its owner, not the pod's Job.

Aspects:
- the pods of three Jobs (replicas: 3) train in one world: a pod belongs because its Job's
  controller is the JobSet that owns the Rendezvous;
- a pod whose container is killed (Failed, exit code 137) is made anew by its Job; the two
  survivors train on in a world of their own, then with the new pod in a world of 3, and
  the JobSet does not restart;
- a failure that fails a Job makes the JobSet restart (failurePolicy): it deletes every Job
  and makes them anew; the Rendezvous, owned by the JobSet, is not collected with them,
  and the new Jobs' pods form the next world in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.controllers import controllers
from tests.controllers import jobsets as jobset_spec
from tests.controllers.jobsets import GROUP, NAME, VERSION
from tests.controllers.kubelet import Kubelet
from tests.controllers.recovery import survive_a_pod_kill
from tests.e2e.harness import timing, wait_world
from tests.support.fixtures import Rendezvous

from devkit.cluster.controlplane import dig, read_object
from devkit.waiting import wait_for

pytestmark = pytest.mark.usefixtures("operator_process", "creator_role")

FORM_TIMEOUT = 180
FAIL_JOB_EXIT_CODE = 42


def jobset(replicas: int) -> dict[str, Any]:
    """``replicas`` Jobs of one pod each; a Job fails at once when its container exits
    FAIL_JOB_EXIT_CODE, and the JobSet then restarts once."""
    container = {
        "name": jobset_spec.CONTAINER,
        "image": "example.invalid/trainer",
        "command": [*jobset_spec.TORCHRUN, "--steps", "100000"],
    }
    pod_spec = {"restartPolicy": "Never", "containers": [container]}
    return jobset_spec.manifest(
        pod_spec, replicas=replicas, fail_job_on_exit_code=FAIL_JOB_EXIT_CODE
    )


class JobSets:
    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.core = kubernetes.client.CoreV1Api(api)

    def create(self, body: dict[str, Any]) -> str:
        made = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "jobsets", body
        )
        return str(made["metadata"]["uid"])

    def get(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, "jobsets", NAME
        )

    def pods(self) -> list[dict[str, Any]]:
        found = read_object(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=jobset_spec.PODS,
        )
        return found["items"]


@pytest.fixture
def jobsets(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    jobset: controllers.Controller,
) -> JobSets:
    return JobSets(admin_api, workers_namespace)


def owner_of(rendezvous: Rendezvous) -> dict[str, Any]:
    owners = rendezvous.body()["metadata"].get("ownerReferences") or []
    (owner,) = [o for o in owners if o.get("controller")]
    return dict(owner)


def test_a_jobset_trains_across_its_jobs_and_survives_a_pod_kill(
    jobsets: JobSets, kubelet: Kubelet, recorded: Callable[[str], Rendezvous]
) -> None:
    rendezvous = recorded(NAME)
    uid = jobsets.create(jobset(3))
    started = time.time()
    nodes = kubelet.wait_running(3)
    world = wait_world(nodes, 3, after=started, timeout=FORM_TIMEOUT, min_step=1)
    owner = owner_of(rendezvous)
    assert (owner["kind"], owner["name"], owner["uid"]) == ("JobSet", NAME, uid)
    jobs = {dig(p, "metadata", "labels", "batch.kubernetes.io/job-name") for p in jobsets.pods()}
    assert len(jobs) == 3, f"one pod in each of three Jobs: {jobs}"
    assert set(world.group_ranks) == {node.name for node in nodes}

    survive_a_pod_kill(kubelet, nodes, world, "JobSet")
    assert jobsets.get().get("status", {}).get("restarts", 0) == 0, "no JobSet restart"
    assert owner_of(rendezvous)["uid"] == uid


def test_a_jobset_restart_makes_its_jobs_anew_and_their_pods_rejoin_its_rendezvous(
    jobsets: JobSets,
    kubelet: Kubelet,
    recorded: Callable[[str], Rendezvous],
) -> None:
    rendezvous = recorded(NAME)
    uid = jobsets.create(jobset(3))
    started = time.time()
    first = kubelet.wait_running(3)
    wait_world(first, 3, after=started, timeout=FORM_TIMEOUT, min_step=1)
    before = rendezvous.body()

    # A container exits 42: its Job fails (podFailurePolicy), so the JobSet restarts.
    broken = first[0]
    failed = time.time()
    kubelet.exit(broken, FAIL_JOB_EXIT_CODE)
    wait_for(
        lambda: jobsets.get().get("status", {}).get("restarts") == 1, 60, "the JobSet restarts"
    )
    wait_for(lambda: not any(node.running() for node in first), 60, "the first Jobs' pods gone")
    again = kubelet.wait_running(3)
    assert not {node.name for node in again} & {node.name for node in first}
    attempts = {
        dig(p, "metadata", "labels", jobset_spec.RESTART_ATTEMPT_LABEL)
        for p in jobsets.pods()
        if p["metadata"]["name"] in {node.name for node in again}
    }
    assert attempts == {"1"}, "every pod is of the JobSet's second attempt"
    reformed = wait_world(again, 3, after=failed, timeout=FORM_TIMEOUT, min_step=1)
    timing(
        "JobSet: a Job failed -> first step of the restarted JobSet's world",
        reformed.first_step_at - failed,
    )
    after = rendezvous.body()
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same Rendezvous"
    assert owner_of(rendezvous)["uid"] == uid
    assert after["status"]["round"] > before["status"]["round"]
    assert set(reformed.group_ranks) == {node.name for node in again}
