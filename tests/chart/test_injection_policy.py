"""Zero-flag torchrun with no operator in the path: the chart's MutatingAdmissionPolicy
(installed where the API server serves it, as the pinned Kubernetes does) against the
real API server and the real Job controller, while the operator is stopped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import free_port
from tests.support.jobs import make_job, running_pods

from devkit import chart
from devkit.chart import ChartOperator, Release
from devkit.cluster.controlplane import ControlPlane, read_object
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects

pytestmark = pytest.mark.usefixtures("chart_release", "served_here")


@pytest.fixture
def served_here(control_plane: ControlPlane) -> None:
    """Before 1.36 there is no MutatingAdmissionPolicy to test: the chart installs none
    (test_chart_install checks that), and the compatibility run says these did not run."""
    if not chart.serves_mutating_admission_policy(control_plane):
        pytest.skip("this API server serves no MutatingAdmissionPolicy (Kubernetes < 1.36)")


ANNOTATIONS = {"k8s-rendezvous.dev/nodes": "1:3", "k8s-rendezvous.dev/run-id": "exp-9"}


@pytest.fixture
def operator(chart_release: Release, tmp_path: Path) -> Iterator[ChartOperator]:
    """The operator as the chart runs it, with its webhook on 127.0.0.1."""
    process = ChartOperator.leading_with_webhook(chart_release, tmp_path, free_port())
    process.start()
    try:
        wait_for(lambda: "webhook registered" in process.log(), 60, "the webhook registered")
        yield process
    finally:
        process.stop()
        print(f"--- operator log (tail) ---\n{process.log_tail()}")


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in pod["spec"]["containers"][0].get("env") or []}


def replace_pod(api: kubernetes.client.ApiClient, namespace: str, job: str) -> dict[str, Any]:
    """Delete the Job's running pod; the pod the Job controller makes instead."""
    (old,) = running_pods(api, namespace, job, 1)
    kubernetes.client.CoreV1Api(api).delete_namespaced_pod(
        old["metadata"]["name"], namespace, grace_period_seconds=0
    )

    def replacement() -> dict[str, Any] | None:
        pods = read_object(
            kubernetes.client.CoreV1Api(api).list_namespaced_pod,
            namespace,
            label_selector=f"batch.kubernetes.io/job-name={job}",
        )["items"]
        return next((p for p in pods if p["metadata"]["uid"] != old["metadata"]["uid"]), None)

    return wait_for(replacement, 60, f"the pod Job {job} makes instead")


def test_a_pod_replaced_while_no_operator_serves_still_gets_torchruns_environment(
    operator: ChartOperator,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    make_job(admin_api, workers_namespace, "no-operator", 1, ANNOTATIONS)
    running_pods(admin_api, workers_namespace, "no-operator", 1)
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    wait_for(
        lambda: custom.list_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL
        )["items"],
        30,
        "the Job's Rendezvous made",
    )
    operator.stop()  # its webhook still registered: the API server's calls are refused

    replacement = replace_pod(admin_api, workers_namespace, "no-operator")
    env = env_of(replacement)
    assert env["PET_RDZV_BACKEND"]["value"] == "kubernetes"
    assert env["PET_RDZV_ENDPOINT"]["value"] == "no-operator"
    assert env["PET_NNODES"]["value"] == "1:3"
    assert env["PET_RDZV_ID"]["value"] == "exp-9"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert replacement["metadata"]["labels"][objects.NODE_LABEL] == "no-operator"


def test_a_rendezvous_its_job_does_not_own_gives_the_jobs_pods_nothing(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    """A Rendezvous named after a Job, labelled as the operator's, but not controlled by
    that Job: the Job's pods get nothing from it (no operator runs here at all)."""
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {
                "name": "plain",
                "labels": {"app.kubernetes.io/managed-by": "k8s-rendezvous-operator"},
            },
            "spec": {"minNodes": 1, "maxNodes": 2, "runId": "plain"},
        },
    )
    make_job(admin_api, workers_namespace, "plain", 1, {})
    (pod,) = running_pods(admin_api, workers_namespace, "plain", 1)
    assert env_of(pod) == {}
    assert objects.NODE_LABEL not in pod["metadata"]["labels"]
