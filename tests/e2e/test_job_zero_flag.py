"""A real annotated Job whose pods run plain ``torchrun train.py``: no rendezvous flag
anywhere, only what the operator's webhook injected. The harness stands in for the
kubelet: for each Running pod of the Job it runs the container's command, plain
``torchrun`` on examples/elastic_train.py, with the container's env (fieldRefs resolved;
the pod IP is a loopback address, so reachable), and when the Job controller deletes
a pod, it kills that pod's processes.

Aspects: the world forms from the Job's pods alone; lowering parallelism shrinks it and
raising it grows it again, and the job trains on through both; a pod beyond the
annotation's MAX waits as a spare past three join timeouts without failing (the Job's
backoffLimit untouched), and takes the place of a member whose pod is deleted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from tests.e2e.harness import LocalPod, describe, timing, wait_world
from tests.support.jobs import make_job, wait_webhook_registered

from devkit.cluster.controlplane import ControlPlane, read_object
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects

pytestmark = [pytest.mark.usefixtures("operator_process"), pytest.mark.webhook]

JOB = "zero-flag"
FORM_TIMEOUT = 150


class JobPods:
    """Plays the kubelet for the pods of one Job (processes stopped by PID at the end)."""

    def __init__(
        self,
        control_plane: ControlPlane,
        api: kubernetes.client.ApiClient,
        namespace: str,
        workdir: Path,
        job: str = JOB,
    ) -> None:
        self.job = job
        self.control_plane = control_plane
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.nodes: dict[str, LocalPod] = {}

    def pods(self) -> list[dict[str, Any]]:
        found = read_object(
            kubernetes.client.CoreV1Api(self.api).list_namespaced_pod,
            self.namespace,
            label_selector=f"batch.kubernetes.io/job-name={self.job}",
        )
        return [
            p
            for p in found["items"]
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        ]

    def sync(self, count: int) -> list[LocalPod]:
        """Wait for ``count`` running pods; start new ones, kill the deleted ones' processes."""
        pods = wait_for(
            lambda: p if len(p := self.pods()) == count else None,
            60,
            f"{count} pods of {self.job}",
        )
        live = {p["metadata"]["name"] for p in pods}
        for name, node in self.nodes.items():
            if name not in live:
                node.stop()  # the kubelet kills a deleted pod's containers
        for pod in pods:
            name = pod["metadata"]["name"]
            if name not in self.nodes:
                node = LocalPod(
                    self.control_plane, self.api, pod, pod["status"]["podIP"], self.workdir
                )
                node.start_container(pod, script_args=["--steps", "400"])
                self.nodes[name] = node
        return [self.nodes[p["metadata"]["name"]] for p in pods]

    def stop_all(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture
def job_pods(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    tmp_path: Path,
) -> Iterator[JobPods]:
    group = JobPods(control_plane, admin_api, workers_namespace, tmp_path / "pods")
    try:
        yield group
    finally:
        group.stop_all()


def test_plain_torchrun_in_a_job_survives_scale_down_and_up(
    job_pods: JobPods,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    control_plane: ControlPlane,
) -> None:
    wait_webhook_registered(control_plane, workers_namespace)
    batch = kubernetes.client.BatchV1Api(admin_api)
    make_job(
        admin_api,
        workers_namespace,
        JOB,
        3,
        {"k8s-rendezvous.dev/nodes": "2:3", "k8s-rendezvous.dev/last-call-timeout": "5"},
        command=["torchrun", "train.py"],
        backoffLimit=10,
    )
    started = time.time()
    nodes = job_pods.sync(3)
    env = {e["name"] for e in job_pods.pods()[0]["spec"]["containers"][0]["env"]}
    assert {"PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_NNODES", "PET_RDZV_ID"} <= env
    wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT, min_step=1)

    def scale(parallelism: int) -> float:
        batch.patch_namespaced_job(
            JOB,
            workers_namespace,
            {"spec": {"parallelism": parallelism}},
            _content_type="application/merge-patch+json",
        )
        return time.time()

    lowered = scale(2)
    survivors = job_pods.sync(2)
    shrunk = wait_world(survivors, 4, after=lowered, timeout=FORM_TIMEOUT, min_step=1)
    timing("Job parallelism 3 -> 2 -> first step in world 4", shrunk.first_step_at - lowered)

    raised = scale(3)
    grown_nodes = job_pods.sync(3)
    grown = wait_world(grown_nodes, 6, after=raised, timeout=FORM_TIMEOUT, min_step=1)
    timing("Job parallelism 2 -> 3 -> first step in world 6", grown.first_step_at - raised)
    assert grown.ranks == list(range(6))
    assert all(node.running() for node in grown_nodes), describe(grown_nodes)


def test_a_spare_pod_outwaits_its_join_timeout_and_steps_in_without_failing_the_job(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    tmp_path: Path,
) -> None:
    join_timeout = 10
    job = "spare"
    pods = JobPods(control_plane, admin_api, workers_namespace, tmp_path / "pods", job=job)
    try:
        wait_webhook_registered(control_plane, workers_namespace)
        make_job(
            admin_api,
            workers_namespace,
            job,
            3,  # one beyond the world: a spare
            {
                "k8s-rendezvous.dev/nodes": "2",
                "k8s-rendezvous.dev/join-timeout": str(join_timeout),
            },
            command=["torchrun", "train.py"],
            backoffLimit=1,
        )
        batch = kubernetes.client.BatchV1Api(admin_api)
        started = time.time()
        nodes = pods.sync(3)

        def members() -> list[LocalPod] | None:
            training = [node for node in nodes if node.progress()]
            return training if len(training) == 2 else None

        wait_for(members, FORM_TIMEOUT, "two of the three pods train")
        world = wait_world(members() or [], 4, after=started, timeout=FORM_TIMEOUT, min_step=1)
        (spare,) = [node for node in nodes if node.name not in world.group_ranks]
        assert spare.still_running_after(3 * join_timeout), describe(nodes)
        status = batch.read_namespaced_job(job, workers_namespace).status
        assert not status.failed and status.active == 3, status
        rendezvous = kubernetes.client.CustomObjectsApi(admin_api)

        def spares_ready() -> tuple[int, str | None]:
            body = rendezvous.get_namespaced_custom_object(
                objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, job
            )
            conditions = (body.get("status") or {}).get("conditions") or []
            ready = [c["status"] for c in conditions if c["type"] == "SparesReady"]
            return body["spec"].get("spares"), (ready or [None])[0]

        assert wait_for(lambda: spares_ready()[1], 10, "SparesReady") and spares_ready() == (
            1,
            "True",
        ), "the Job's pod beyond its nodes is its declared spare"

        lost = next(node for node in nodes if node is not spare)
        survivor = next(node for node in nodes if node not in (spare, lost))
        deleted = time.time()
        lost.kill()
        back = wait_world([survivor, spare], 4, after=deleted, timeout=FORM_TIMEOUT, min_step=1)
        timing("member pod deleted -> first step with the spare in", back.first_step_at - deleted)
        assert spares_ready() == (1, "False"), "the spare is in the world: none waits"
    finally:
        pods.stop_all()
