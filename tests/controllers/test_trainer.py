"""Kubeflow Trainer v2 with the real Trainer and JobSet controllers and the operator: the
ClusterTrainingRuntime and TrainJob of examples/trainer/, applied as written (the run made
long enough to outlive the test), the pods played by the stand-in kubelet.

Aspects:
- the TrainJob's pods train in one elastic world (``--nnodes=2:3``) in a Rendezvous named
  after the TrainJob, made by its first pod and owned by its JobSet; Trainer's static
  PET_MASTER_ADDR and PET_NNODES are in the pods, and torchrun uses neither;
- a pod whose container is killed (Failed, exit code 137): the two survivors train on at
  2, its Job makes it anew, and the world is 3 again with it; the TrainJob neither fails
  nor restarts.

The stand-in kubelet runs every pod as ``restartPolicy: Never`` has it. JobSet gives
Trainer's template ``OnFailure``, so on a real node the kubelet restarts the killed
container in its pod instead, and it rejoins (tests/nodes/test_workload_controllers.py);
what this test checks is how the world fares while a member is gone and comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from tests.controllers import controllers
from tests.controllers.kubelet import Kubelet
from tests.controllers.recovery import survive_a_pod_kill
from tests.e2e.harness import timing, wait_world
from tests.support.fixtures import Rendezvous

from devkit.cluster.controlplane import dig, read_object

pytestmark = pytest.mark.usefixtures("operator_process", "creator_role")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "trainer"
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
FORM_TIMEOUT = 180


def example(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    return loaded


@pytest.fixture
def runtime(
    admin_api: kubernetes.client.ApiClient, trainer: controllers.Controller
) -> Iterator[str]:
    """The example ClusterTrainingRuntime, installed as written."""
    body = example("cluster-training-runtime.yaml")
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    custom.create_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", body)
    try:
        yield body["metadata"]["name"]
    finally:
        custom.delete_cluster_custom_object(
            GROUP, VERSION, "clustertrainingruntimes", body["metadata"]["name"]
        )


def test_an_elastic_trainjob_on_the_example_runtime_trains_and_survives_a_pod_kill(
    runtime: str,
    kubelet: Kubelet,
    recorded: Callable[[str], Rendezvous],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    job = example("trainjob.yaml")
    name = job["metadata"]["name"]
    assert job["spec"]["runtimeRef"]["name"] == runtime
    job["spec"]["trainer"]["command"] += ["--steps", "100000"]  # outlive the test
    rendezvous = recorded(name)
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    custom.create_namespaced_custom_object(GROUP, VERSION, workers_namespace, "trainjobs", job)
    started = time.time()
    nodes = kubelet.wait_running(3)
    world = wait_world(nodes, 3, after=started, timeout=FORM_TIMEOUT, min_step=1)
    timing(
        "Trainer: TrainJob created -> first step of its world of 3", world.first_step_at - started
    )

    owners = rendezvous.body()["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners if o.get("controller")] == [("JobSet", name)]
    assert rendezvous.body()["spec"]["minNodes"] == 2 and rendezvous.body()["spec"]["maxNodes"] == 3
    core = kubernetes.client.CoreV1Api(admin_api)
    pod = read_object(core.read_namespaced_pod, nodes[0].name, workers_namespace)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["PET_NNODES"] == "3" and env["PET_MASTER_ADDR"].startswith(f"{name}-node-0-0.")
    assert env["PET_RDZV_BACKEND"] == "kubernetes"

    survive_a_pod_kill(kubelet, nodes, world, "Trainer")
    train_job = custom.get_namespaced_custom_object(
        GROUP, VERSION, workers_namespace, "trainjobs", name
    )
    failed = [
        c for c in dig(train_job, "status", "conditions", default=[]) if c["type"] == "Failed"
    ]
    assert not [c for c in failed if c["status"] == "True"], train_job["status"]
    jobset = custom.get_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", workers_namespace, "jobsets", name
    )
    assert dig(jobset, "status", "restarts", default=0) == 0
