"""Kueue's elastic Jobs (the ``kueue.x-k8s.io/elastic-job`` annotation; Kueue v0.19's
ElasticJobsViaWorkloadSlices gate, beta and on by default) with the real Kueue, Job
controller, scheduler and operator: an annotated Job in a LocalQueue whose pods run plain
``torchrun train.py`` (the operator's webhook injects the rest), played by the stand-in
kubelet.

Aspects:
- Kueue admits the Job within its ClusterQueue's quota, and the world forms;
- raising parallelism beyond the free quota makes a new workload slice whose pods Kueue
  gates: they never run, and the world never notices them (its round, size and
  nodesWaiting stay, its workers are not restarted);
- freed quota admits the slice (the old one Finished, WorkloadSliceReplaced), Kueue lifts
  the gates and the world grows to include the new pods; the time from the slice's
  admission to that world is measured;
- lowering parallelism shrinks the world while Kueue shrinks the workload in place;
- a higher-priority workload preempts the whole Job: Kueue suspends it, its pods go, the
  Rendezvous stays open (Reforming, never Closed), and when Kueue admits the Job again its
  new pods form the world in the same Rendezvous.

What Kueue v0.19 does not do, and so is not tested: it never changes a Job's parallelism
itself (the Job's owner or an autoscaler does; Kueue admits or holds the difference), and
it preempts a resized Job only as a whole (KEP-77: no partial preemption of a slice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes.client
import pytest
from tests.controllers import controllers, queueing, timeline
from tests.controllers.kubelet import Kubelet
from tests.e2e.harness import LocalPod, describe, timing, wait_world
from tests.support.fixtures import Rendezvous

from devkit.cluster.controlplane import dig, read_object
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects, statuses

pytestmark = [pytest.mark.usefixtures("operator_process"), pytest.mark.webhook]

JOB = "train"
FORM_TIMEOUT = 180
QUOTA_CPU = 4


def training_job(parallelism: int, nodes: str, priority: str | None = None) -> dict[str, Any]:
    """An annotated, elastic Job in the LocalQueue: plain torchrun, one CPU per pod."""
    labels = {queueing.QUEUE_LABEL: queueing.LOCAL_QUEUE}
    if priority:
        labels[queueing.PRIORITY_LABEL] = priority
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": JOB,
            "labels": labels,
            "annotations": {
                "k8s-rendezvous.dev/nodes": nodes,
                queueing.ELASTIC_ANNOTATION: "true",
            },
        },
        "spec": {
            # The production Job of docs/annotations.md, as docs/workloads.md shows it with
            # Kueue: Indexed, resized by parallelism and completions together.
            "parallelism": parallelism,
            "completions": parallelism,
            "completionMode": "Indexed",
            "backoffLimitPerIndex": 3,
            "podFailurePolicy": {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
            "successPolicy": {"rules": [{"succeededCount": 1}]},
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "example.invalid/trainer",
                            "command": [
                                "torchrun",
                                "--max-restarts=3",
                                "train.py",
                                "--steps",
                                "100000",
                            ],
                            "resources": {"requests": {"cpu": "1"}},
                        }
                    ],
                }
            },
        },
    }


def other_job(name: str, parallelism: int, priority: str | None = None) -> dict[str, Any]:
    """Another tenant of the queue: pods that only hold their CPU (kwok keeps them
    Running; the stand-in kubelet runs nothing but torchrun)."""
    labels = {queueing.QUEUE_LABEL: queueing.LOCAL_QUEUE}
    if priority:
        labels[queueing.PRIORITY_LABEL] = priority
    container = {
        "name": "sleeper",
        "image": "example.invalid/sleep",
        "command": ["sleep", "infinity"],
        "resources": {"requests": {"cpu": "1"}},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "parallelism": parallelism,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


@pytest.fixture
def queue(
    admin_api: kubernetes.client.ApiClient, namespace: str, kueue: controllers.Controller
) -> Iterator[str]:
    """A ClusterQueue of QUOTA_CPU CPUs for the test's namespace, and its LocalQueue."""
    with queueing.cluster_objects(admin_api, queueing.queue_objects(namespace, QUOTA_CPU)):
        yield namespace


class Cluster:
    """The test's view: Jobs, their pods and Workloads, as the admin sees them."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.batch = kubernetes.client.BatchV1Api(api)
        self.core = kubernetes.client.CoreV1Api(api)

    def create(self, job: dict[str, Any]) -> str:
        made = self.batch.create_namespaced_job(self.namespace, job)
        return str(made.metadata.uid)

    def job(self, name: str = JOB) -> dict[str, Any]:
        return read_object(self.batch.read_namespaced_job, name, self.namespace)

    def scale(self, parallelism: int, name: str = JOB) -> float:
        """An Indexed Job is resized by its parallelism and completions together."""
        self.batch.patch_namespaced_job(
            name, self.namespace, {"spec": {"parallelism": parallelism, "completions": parallelism}}
        )
        return time.time()

    def delete(self, name: str) -> None:
        self.batch.delete_namespaced_job(name, self.namespace, propagation_policy="Background")

    def pods(self, name: str = JOB) -> list[dict[str, Any]]:
        found = read_object(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=f"batch.kubernetes.io/job-name={name}",
        )
        return [p for p in found["items"] if not dig(p, "metadata", "deletionTimestamp")]

    def workloads(self, job_uid: str) -> list[dict[str, Any]]:
        return queueing.workloads(self.api, self.namespace, job_uid)

    def wait_admitted(self, job_uid: str, count: int, timeout: float = 60) -> dict[str, Any]:
        """Until the Job's newest Workload is admitted for ``count`` pods."""

        def admitted() -> dict[str, Any] | None:
            slices = self.workloads(job_uid)
            newest = slices[-1] if slices else None
            if newest is None or not queueing.holds(newest, "Admitted"):
                return None
            return newest if newest["spec"]["podSets"][0]["count"] == count else None

        return wait_for(admitted, timeout, f"Kueue admits {count} pods of the Job")


@pytest.fixture
def cluster(
    admin_api: kubernetes.client.ApiClient, queue: str, operator_process: OperatorProcess
) -> Cluster:
    """The test's namespace, once the operator's webhook is registered for it: Kueue may
    admit a Job, and the Job controller make its pods, within a second of its creation."""
    registrations = kubernetes.client.AdmissionregistrationV1Api(admin_api)
    wanted = f"torchrun-env.{queue}.k8s-rendezvous.dev"
    wait_for(
        lambda: any(
            c.metadata.name == wanted
            for c in registrations.list_mutating_webhook_configuration().items
        ),
        30,
        f"the operator's webhook registered ({wanted})",
    )
    return Cluster(admin_api, queue)


def wait_steps(nodes: list[LocalPod], steps: int, timeout: float = 60) -> None:
    """Until every node's workers have made ``steps`` more steps in the world they are in
    (progress observed, not time waited)."""
    start = {node.name: (node.progress() or [None])[-1] for node in nodes}

    def advanced() -> bool:
        for node in nodes:
            first, latest = start[node.name], (node.progress() or [None])[-1]
            if first is None or latest is None or latest.pid != first.pid:
                return False
            if latest.step - first.step < steps:
                return False
        return True

    wait_for(advanced, timeout, f"{steps} more steps in the same world\n{describe(nodes)}")


def first_running(pods: timeline.Timeline, name: str) -> float:
    """When pod ``name`` was first seen Running."""
    seen = pods.first(
        lambda p: p["metadata"]["name"] == name and dig(p, "status", "phase") == "Running",
        10,
        f"{name} Running",
    )
    return seen[0]


def test_an_elastic_job_grows_when_kueue_admits_its_slice_and_gated_pods_never_count(
    cluster: Cluster,
    kubelet: Kubelet,
    recorded: Callable[[str], Rendezvous],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rendezvous = recorded(JOB)
    cluster.create(other_job("other-tenant", 2))
    job_uid = cluster.create(training_job(2, "1:4"))
    started = time.time()
    cluster.wait_admitted(job_uid, 2)
    first = wait_world(kubelet.wait_running(2), 2, after=started, timeout=FORM_TIMEOUT, min_step=1)
    sealed = rendezvous.wait(lambda s: s.state is statuses.RoundState.SEALED, "the world sealed")

    # More than the quota leaves: a new slice, pending; its pods gated, never run.
    cluster.scale(4)
    gated = wait_for(
        lambda: g if len(g := [p for p in cluster.pods() if queueing.gated(p)]) == 2 else None,
        30,
        "two new pods, gated by Kueue",
    )
    pending = cluster.workloads(job_uid)[-1]
    assert pending["metadata"]["annotations"].get(queueing.REPLACEMENT_ANNOTATION)
    assert not queueing.holds(pending, "QuotaReserved"), "no quota for it yet"
    assert all(dig(p, "status", "phase") == "Pending" for p in gated)
    nodes = kubelet.running()
    wait_steps(nodes, 25)  # the world trains on, unaware of the gated pods
    now = rendezvous.status()
    assert (now.state, now.round, now.world_size, now.nodes_waiting) == (
        statuses.RoundState.SEALED,
        sealed.round,
        2,
        0,
    )
    assert set(rendezvous.requests()) == {node.name for node in nodes}, "no gated pod asked"
    assert sorted(p.name for p in kubelet.running()) == sorted(first.group_ranks)

    # Quota frees: Kueue admits the slice, lifts the gates, and the world grows.
    slices = timeline.custom(
        admin_api, queueing.GROUP, queueing.VERSION, cluster.namespace, "workloads"
    )
    pods = timeline.pods(admin_api, cluster.namespace, f"batch.kubernetes.io/job-name={JOB}")
    worlds = timeline.custom(
        admin_api, objects.GROUP, objects.VERSION, cluster.namespace, objects.PLURAL
    )
    try:
        freed = time.time()
        cluster.delete("other-tenant")
        grown = wait_world(kubelet.wait_running(4), 4, after=freed, timeout=FORM_TIMEOUT)
        new = {p["metadata"]["name"] for p in gated}
        admitted_at, _, admitted = slices.first(
            lambda w: (
                w["metadata"]["uid"] == pending["metadata"]["uid"] and queueing.holds(w, "Admitted")
            ),
            10,
            "the new slice admitted",
        )
        ungated_at, _, _ = pods.first(
            lambda p: p["metadata"]["name"] in new and not queueing.gated(p), 10, "a gate lifted"
        )
        running_at = max(first_running(pods, name) for name in new)
        sealed_at, _, _ = worlds.first(
            lambda r: dig(r, "status", "worldSize") == 4 and dig(r, "status", "state") == "Sealed",
            10,
            "a round of 4 sealed",
        )
    finally:
        for watched in (slices, pods, worlds):
            watched.stop()
    old = cluster.workloads(job_uid)[0]
    finished = queueing.condition(old, "Finished")
    assert finished is not None and finished["reason"] == "WorkloadSliceReplaced"
    assert admitted["spec"]["podSets"][0]["count"] == 4
    assert set(grown.group_ranks) >= new
    timing("Kueue: quota freed -> slice admitted", admitted_at - freed)
    timing("Kueue: slice admitted -> gates lifted", ungated_at - admitted_at)
    timing("Kueue: slice admitted -> its pods Running (kwok)", running_at - admitted_at)
    timing("Kueue: slice admitted -> round of 4 sealed", sealed_at - admitted_at)
    timing(
        "Kueue: slice admitted -> first step of the world of 4", grown.first_step_at - admitted_at
    )
    timing(
        "Kueue: pods Running -> round of 4 sealed (torchrun start, join)", sealed_at - running_at
    )


def test_an_elastic_job_shrinks_with_its_workload_and_a_preempted_job_reforms_on_readmission(
    cluster: Cluster,
    kubelet: Kubelet,
    recorded: Callable[[str], Rendezvous],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    low, high = f"{cluster.namespace}-low", f"{cluster.namespace}-high"
    priorities = [queueing.priority_class(low, 10), queueing.priority_class(high, 1000)]
    with queueing.cluster_objects(admin_api, priorities):
        rendezvous = recorded(JOB)
        job_uid = cluster.create(training_job(3, "2:3", priority=low))
        started = time.time()
        cluster.wait_admitted(job_uid, 3)
        wait_world(kubelet.wait_running(3), 3, after=started, timeout=FORM_TIMEOUT, min_step=1)

        # Lowered by its owner: Kueue shrinks the workload in place, the world follows.
        lowered = cluster.scale(2)
        survivors = kubelet.wait_running(2)
        shrunk = wait_world(survivors, 2, after=lowered, timeout=FORM_TIMEOUT, min_step=1)
        timing("Kueue: parallelism 3 -> 2 -> first step in world 2", shrunk.first_step_at - lowered)
        slices = cluster.workloads(job_uid)
        assert len([w for w in slices if not queueing.holds(w, "Finished")]) == 1
        assert slices[-1]["spec"]["podSets"][0]["count"] == 2, "the workload shrank in place"
        before = rendezvous.body()

        # Preempted: the whole Job is suspended, its pods go; the rendezvous stays open.
        preempted = time.time()
        cluster.create(other_job("urgent", 3, priority=high))
        wait_for(lambda: dig(cluster.job(), "spec", "suspend"), 60, "Kueue suspends the Job")
        kubelet.wait_running(0)
        evicted = queueing.condition(cluster.workloads(job_uid)[-1], "Evicted")
        assert evicted is not None and evicted["reason"] == "Preempted"
        open_ = rendezvous.wait(
            lambda s: s.state is statuses.RoundState.REFORMING, "the members lost, not closed", 60
        )
        assert open_.closed_reason is None
        wait_for(
            lambda: (
                all(dig(p, "status", "phase") == "Running" for p in cluster.pods("urgent"))
                and len(cluster.pods("urgent")) == 3
            ),
            60,
            "the urgent Job runs in the quota",
        )
        assert rendezvous.status().state is statuses.RoundState.REFORMING

        # The urgent Job done, Kueue admits the Job again; new pods, the same Rendezvous.
        resumed = time.time()
        cluster.delete("urgent")
        cluster.wait_admitted(job_uid, 2, timeout=90)
        back = kubelet.wait_running(2)
        assert not {node.name for node in back} & {node.name for node in survivors}
        reformed = wait_world(back, 2, after=resumed, timeout=FORM_TIMEOUT, min_step=1)
        timing(
            "Kueue: preempted Job readmitted -> first step of its new world",
            reformed.first_step_at - resumed,
        )
        timing("Kueue: preemption -> readmission (the urgent Job's whole run)", resumed - preempted)
        after = rendezvous.body()
        assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same Rendezvous"
        assert after["status"]["round"] > before["status"]["round"]
        assert all(node.running() for node in back), describe(back)
