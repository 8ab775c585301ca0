"""The workload controllers users run, on real nodes: the real Kueue, JobSet, Kubeflow
Trainer v2 and LeaderWorkerSet controllers make the Jobs and pods; real kubelets run them
in the trainer image; the operator is the chart's, from its image; faults are real (an
agent killed by PID).

tests/controllers covers the same controllers in more cases (gated pods, preemption,
shrinking) with a stand-in kubelet, where a test can hold a container back; here each
controller's main path runs as a user would meet it.

Aspects:
- a JobSet whose replicated Jobs run ``torchrun --rdzv-backend=kubernetes`` trains in one
  world across its Jobs, in a Rendezvous its first pod makes and the JobSet owns; a killed
  agent's pod is made anew by its Job and joins a world of 3 again, with no JobSet restart;
- a JobSet failure-policy restart deletes and makes anew every Job; the Rendezvous, owned by
  the JobSet, survives, and the new pods train in its next round;
- the example ClusterTrainingRuntime and elastic TrainJob (examples/trainer/) train; a
  killed agent's container is restarted in its pod by the kubelet (JobSet defaults the
  restartPolicy to OnFailure) and rejoins, the TrainJob neither failing nor restarting;
- a LeaderWorkerSet's group trains in one world, in a Rendezvous its first pod makes and the
  LeaderWorkerSet owns (each worker admitted three controllers up from its own); a killed
  agent makes the controller recreate the whole group, which trains in the next round of
  the same Rendezvous;
- Kueue admits an elastic Job within its quota; a scale-up beyond the quota waits as a
  gated slice the world never counts; more quota admits the slice and the world grows to
  include its pod; the time from the slice's admission to that world is measured.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from tests.controllers import controllers, jobsets, leaderworkersets, queueing, timeline
from tests.e2e.harness import timing

from devkit import namespaces
from devkit.cluster import images
from devkit.cluster.controlplane import dig
from devkit.training import TrainingJob, agent_pid, local_command, on_real_nodes
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects

pytestmark = pytest.mark.timeout(600)

NAME = jobsets.NAME
TRAINER_GROUP, TRAINER_VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAIN_ARGS = ["--steps", "100000", "--step-seconds", "0.25"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trainer"
KILLED_EXIT_CODE = 137


@pytest.fixture
def controlled_namespace(
    make_namespace: Callable[..., str],
    admin_api: kubernetes.client.ApiClient,
    operator_release: object,
) -> str:
    """A namespace the controllers' webhooks see, whose pods may use and make a Rendezvous
    (the worker and creator roles, as docs/workloads.md has users bind them)."""
    namespace = make_namespace({controllers.CONTROLLERS_LABEL: "on"})
    namespaces.bind_worker_role(admin_api, namespace)
    namespaces.bind_creator_role(admin_api, namespace)
    return namespace


def rendezvous(api: kubernetes.client.ApiClient, namespace: str) -> dict[str, Any]:
    custom = kubernetes.client.CustomObjectsApi(api)
    return custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
        objects.GROUP, objects.VERSION, namespace, objects.PLURAL, NAME
    )


def controller_owner(obj: dict[str, Any]) -> tuple[str, str, str]:
    (owner,) = [o for o in obj["metadata"].get("ownerReferences") or [] if o.get("controller")]
    return owner["kind"], owner["name"], owner["uid"]


def pod_named(job: TrainingJob, name: str) -> dict[str, Any]:
    (pod,) = [p for p in job.pods() if p["metadata"]["name"] == name]
    return pod


# -- JobSet ------------------------------------------------------------------------------


def jobset_manifest(trainer_image: str, *, fail_job_when_killed: bool) -> dict[str, Any]:
    """Three Jobs of one pod each. With ``fail_job_when_killed``, a killed container fails
    its Job at once, and the JobSet restarts."""
    container = {"name": jobsets.CONTAINER, "command": [*jobsets.TORCHRUN, *TRAIN_ARGS]}
    pod_spec = on_real_nodes({"restartPolicy": "Never", "containers": [container]}, trainer_image)
    return jobsets.manifest(
        pod_spec,
        replicas=3,
        fail_job_on_exit_code=KILLED_EXIT_CODE if fail_job_when_killed else None,
    )


def create_jobset(
    api: kubernetes.client.ApiClient, namespace: str, body: dict[str, Any]
) -> tuple[str, TrainingJob]:
    made = kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        jobsets.GROUP, jobsets.VERSION, namespace, "jobsets", body
    )
    return str(made["metadata"]["uid"]), TrainingJob(api, namespace, NAME, selector=jobsets.PODS)


def jobset_restarts(api: kubernetes.client.ApiClient, namespace: str) -> int:
    found = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object(
        jobsets.GROUP, jobsets.VERSION, namespace, "jobsets", NAME
    )
    return int(dig(found, "status", "restarts", default=0))


def kill_an_agent(job: TrainingJob, world_pods: dict[int, str]) -> tuple[str, float]:
    """SIGKILL the torchrun agent of the world's rank-1 pod (its container exits 137)."""
    victim = world_pods[1]
    killed = time.time()
    os.kill(agent_pid(pod_named(job, victim)), signal.SIGKILL)
    return victim, killed


def test_a_jobset_trains_across_its_jobs_and_a_killed_pod_is_replaced(
    jobset: controllers.Controller,
    controlled_namespace: str,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
) -> None:
    manifest = jobset_manifest(node_images["trainer"].reference, fail_job_when_killed=False)
    started = time.time()
    uid, job = create_jobset(admin_api, controlled_namespace, manifest)
    world = job.wait_world(3, after=started)
    timing(
        "JobSet (real nodes): created -> first step of its world of 3", world.first_step - started
    )
    assert controller_owner(rendezvous(admin_api, controlled_namespace)) == ("JobSet", NAME, uid)
    jobs = {p["metadata"]["labels"]["batch.kubernetes.io/job-name"] for p in job.running_pods()}
    assert len(jobs) == 3, f"one pod in each of three Jobs: {jobs}"
    assert set(world.pods.values()) == {p["metadata"]["name"] for p in job.running_pods()}

    victim, killed = kill_an_agent(job, world.pods)
    again = job.wait_world(3, after=killed)
    timing(
        "JobSet (real nodes): agent killed -> first step of a world of 3", again.first_step - killed
    )
    assert victim not in again.pods.values(), "the killed pod's Job made a new one"
    assert dig(pod_named(job, victim), "status", "phase") == "Failed"
    assert again.pods[0] == world.pods[0], "rank 0 stays while its pod lives"
    assert jobset_restarts(admin_api, controlled_namespace) == 0, "no JobSet restart"
    assert controller_owner(rendezvous(admin_api, controlled_namespace))[2] == uid


def test_a_jobset_restart_makes_its_jobs_anew_and_they_train_in_the_same_rendezvous(
    jobset: controllers.Controller,
    controlled_namespace: str,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
) -> None:
    manifest = jobset_manifest(node_images["trainer"].reference, fail_job_when_killed=True)
    uid, job = create_jobset(admin_api, controlled_namespace, manifest)
    first = job.wait_world(3, after=0)
    before = rendezvous(admin_api, controlled_namespace)

    _, killed = kill_an_agent(job, first.pods)
    wait_for(
        lambda: jobset_restarts(admin_api, controlled_namespace) == 1, 90, "the JobSet restarts"
    )
    again = job.wait_world(3, after=killed)
    timing(
        "JobSet (real nodes): a Job failed -> first step of the restarted JobSet's world",
        again.first_step - killed,
    )
    assert not set(again.pods.values()) & set(first.pods.values()), "every pod made anew"
    attempts = {
        dig(p, "metadata", "labels", jobsets.RESTART_ATTEMPT_LABEL)
        for p in job.pods()
        if p["metadata"]["name"] in again.pods.values()
    }
    assert attempts == {"1"}, "every pod of the new world is of the JobSet's second attempt"
    after = rendezvous(admin_api, controlled_namespace)
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same Rendezvous"
    assert controller_owner(after) == ("JobSet", NAME, uid)
    assert after["status"]["round"] > before["status"]["round"]


# -- Kubeflow Trainer v2 ------------------------------------------------------------------


def example(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return loaded


@pytest.fixture
def runtime(
    admin_api: kubernetes.client.ApiClient,
    trainer: controllers.Controller,
    node_images: dict[str, images.ImageArchive],
) -> Iterator[dict[str, Any]]:
    """The example ClusterTrainingRuntime, its pods made to run on the real nodes in the
    trainer image (its env, the rendezvous part, as written)."""
    body = example("cluster-training-runtime.yaml")
    (node,) = body["spec"]["template"]["spec"]["replicatedJobs"]
    on_real_nodes(node["template"]["spec"]["template"]["spec"], node_images["trainer"].reference)
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    custom.create_cluster_custom_object(
        TRAINER_GROUP, TRAINER_VERSION, "clustertrainingruntimes", body
    )
    try:
        yield body
    finally:
        custom.delete_cluster_custom_object(
            TRAINER_GROUP, TRAINER_VERSION, "clustertrainingruntimes", body["metadata"]["name"]
        )


def test_an_elastic_trainjob_trains_and_a_killed_container_restarts_and_rejoins(
    runtime: dict[str, Any],
    controlled_namespace: str,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    train_job = example("trainjob.yaml")
    assert train_job["metadata"]["name"] == NAME
    assert train_job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    # Trainer sets the container's command from the TrainJob: the real-node paths go here.
    command = train_job["spec"]["trainer"]["command"]
    train_job["spec"]["trainer"]["command"] = [*local_command(command), *TRAIN_ARGS]
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    started = time.time()
    custom.create_namespaced_custom_object(
        TRAINER_GROUP, TRAINER_VERSION, controlled_namespace, "trainjobs", train_job
    )
    job = TrainingJob(
        admin_api, controlled_namespace, NAME, selector=jobsets.PODS, container="node"
    )
    world = job.wait_world(3, after=started)
    timing(
        "Trainer (real nodes): TrainJob created -> first step of its world of 3",
        world.first_step - started,
    )
    made = rendezvous(admin_api, controlled_namespace)
    assert controller_owner(made)[:2] == ("JobSet", NAME)
    assert (made["spec"]["minNodes"], made["spec"]["maxNodes"]) == (2, 3)

    victim, killed = kill_an_agent(job, world.pods)
    again = job.wait_world(3, after=killed)
    timing(
        "Trainer (real nodes): agent killed -> first step of a world of 3",
        again.first_step - killed,
    )
    # JobSet makes a template without a restartPolicy OnFailure: the kubelet restarts the
    # killed container in its pod, and the new agent rejoins.
    assert victim in again.pods.values() and again.pids != world.pids
    (status,) = pod_named(job, victim)["status"]["containerStatuses"]
    assert status["restartCount"] >= 1, status
    found = custom.get_namespaced_custom_object(
        TRAINER_GROUP, TRAINER_VERSION, controlled_namespace, "trainjobs", NAME
    )
    conditions = dig(found, "status", "conditions", default=[])
    assert not [c for c in conditions if c["type"] == "Failed" and c["status"] == "True"], found
    assert jobset_restarts(admin_api, controlled_namespace) == 0


# -- LeaderWorkerSet ----------------------------------------------------------------------


def test_a_leaderworkerset_group_trains_and_its_recreated_group_rejoins(
    lws: controllers.Controller,
    controlled_namespace: str,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
) -> None:
    container = {
        "name": leaderworkersets.CONTAINER,
        "command": [*leaderworkersets.torchrun(2), *TRAIN_ARGS],
    }
    pod_spec = on_real_nodes({"containers": [container]}, node_images["trainer"].reference)
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    started = time.time()
    made = custom.create_namespaced_custom_object(
        leaderworkersets.GROUP,
        leaderworkersets.VERSION,
        controlled_namespace,
        "leaderworkersets",
        leaderworkersets.manifest(pod_spec, size=2),
    )
    job = TrainingJob(admin_api, controlled_namespace, NAME, selector=leaderworkersets.PODS)
    world = job.wait_world(2, after=started)
    timing(
        "LeaderWorkerSet (real nodes): created -> first step of its world of 2",
        world.first_step - started,
    )
    before = rendezvous(admin_api, controlled_namespace)
    owner = ("LeaderWorkerSet", NAME, made["metadata"]["uid"])
    assert controller_owner(before) == owner, "a worker is admitted three controllers up"
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.running_pods()}
    assert set(uids) == set(world.pods.values()) == {"train-0", "train-0-1"}

    # The worker's agent is SIGKILLed: its container restarts, so the controller makes the
    # whole group anew, under the same names.
    killed = time.time()
    os.kill(agent_pid(pod_named(job, "train-0-1")), signal.SIGKILL)
    again = job.wait_world(2, after=killed)
    timing(
        "LeaderWorkerSet (real nodes): a worker's agent killed -> first step of the "
        "recreated group's world",
        again.first_step - killed,
    )
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.running_pods()}
    assert now.keys() == uids.keys() and not set(now.values()) & set(uids.values()), (
        "every pod of the group made anew"
    )
    after = rendezvous(admin_api, controlled_namespace)
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same Rendezvous"
    assert after["status"]["round"] > before["status"]["round"]
    assert controller_owner(after) == owner


# -- Kueue ---------------------------------------------------------------------------------

POD_CPU = "500m"


def kueue_job(trainer_image: str, parallelism: int) -> dict[str, Any]:
    """An annotated elastic Job in the LocalQueue: plain torchrun, half a CPU per pod."""
    container = {
        "name": "trainer",
        "command": ["torchrun", "--max-restarts=3", "train.py", *TRAIN_ARGS],
        "resources": {"requests": {"cpu": POD_CPU}},
    }
    pod_spec = on_real_nodes({"restartPolicy": "Never", "containers": [container]}, trainer_image)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": NAME,
            "labels": {queueing.QUEUE_LABEL: queueing.LOCAL_QUEUE},
            "annotations": {
                "k8s-rendezvous.dev/nodes": "1:4",
                queueing.ELASTIC_ANNOTATION: "true",
            },
        },
        "spec": {"parallelism": parallelism, "backoffLimit": 10, "template": {"spec": pod_spec}},
    }


def set_quota(api: kubernetes.client.ApiClient, namespace: str, cpu: str) -> None:
    (body,) = [o for o in queueing.queue_objects(namespace, cpu) if o["kind"] == "ClusterQueue"]
    kubernetes.client.CustomObjectsApi(api).patch_cluster_custom_object(
        queueing.GROUP,
        queueing.VERSION,
        "clusterqueues",
        namespace,
        {"spec": {"resourceGroups": body["spec"]["resourceGroups"]}},
    )


def test_kueue_admits_an_elastic_jobs_slice_and_the_world_grows_to_include_it(
    kueue: controllers.Controller,
    controlled_namespace: str,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
) -> None:
    namespace = controlled_namespace
    batch = kubernetes.client.BatchV1Api(admin_api)
    with queueing.cluster_objects(admin_api, queueing.queue_objects(namespace, "1")):
        made = batch.create_namespaced_job(
            namespace, kueue_job(node_images["trainer"].reference, 2)
        )
        job_uid = str(made.metadata.uid)
        job = TrainingJob(admin_api, namespace, NAME)
        first = job.wait_world(2, after=0)
        sealed_round = rendezvous(admin_api, namespace)["status"]["round"]

        # One pod more than the quota holds: a new slice waits, its pod gated.
        batch.patch_namespaced_job(NAME, namespace, {"spec": {"parallelism": 3}})
        (gated,) = wait_for(
            lambda: [p for p in job.pods() if queueing.gated(p)] or None,
            60,
            "a new pod, gated by Kueue",
        )
        pending = queueing.workloads(admin_api, namespace, job_uid)[-1]
        assert pending["metadata"]["annotations"].get(queueing.REPLACEMENT_ANNOTATION)
        assert not queueing.holds(pending, "QuotaReserved"), "no quota for it yet"
        lines_before = len(job.progress())
        wait_for(lambda: len(job.progress()) >= lines_before + 20, 60, "the world of 2 training on")
        now = rendezvous(admin_api, namespace)["status"]
        assert (now["state"], now["round"], now.get("nodesWaiting", 0)) == (
            "Sealed",
            sealed_round,
            0,
        ), "the gated pod is never counted"
        latest = job.world(2, after=0)
        assert latest is not None and (latest.master, latest.pids) == (first.master, first.pids), (
            "the world of 2 trains on, its workers not restarted"
        )

        # More quota: Kueue admits the slice, lifts the gate, and the world grows.
        slices = timeline.custom(
            admin_api, queueing.GROUP, queueing.VERSION, namespace, "workloads"
        )
        try:
            freed = time.time()
            set_quota(admin_api, namespace, "1500m")
            grown = job.wait_world(3, after=freed)
            admitted_at, _, admitted = slices.first(
                lambda w: (
                    w["metadata"]["uid"] == pending["metadata"]["uid"]
                    and queueing.holds(w, "Admitted")
                ),
                10,
                "the new slice admitted",
            )
        finally:
            slices.stop()
        assert admitted["spec"]["podSets"][0]["count"] == 3
        assert gated["metadata"]["name"] in grown.pods.values()
        assert set(first.pods.values()) < set(grown.pods.values())
        timing("Kueue (real nodes): quota raised -> slice admitted", admitted_at - freed)
        timing(
            "Kueue (real nodes): slice admitted -> first step of the world of 3",
            grown.first_step - admitted_at,
        )
        batch.delete_namespaced_job(NAME, namespace, propagation_policy="Foreground")
