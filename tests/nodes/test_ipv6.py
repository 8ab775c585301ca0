"""Real nodes whose pods are dual-stack with their IPv6 address first: POD_IP, the address
a node offers, rank 0's MASTER_ADDR and the operator's own endpoints are IPv6, and the
world forms and re-forms across the two nodes over IPv6."""

from __future__ import annotations

import ipaddress
import time

import kubernetes.client
import pytest

from devkit import chart
from devkit.cluster.controlplane import read_object
from devkit.training import OPERATOR_POD_LABELS, RunJob, TrainingJob, World

IPV6 = True
pytestmark = pytest.mark.timeout(600)


def master_host(world: World) -> str:
    host, _, _port = world.master.rpartition(":")
    return host.strip("[]")


def test_a_job_forms_and_reforms_its_world_at_ipv6_masters(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    world = job.wait_world(3, after=0)
    pods = {pod["metadata"]["name"]: pod for pod in job.running_pods()}
    assert {pod["spec"]["nodeName"] for pod in pods.values()} == {"real-node-0", "real-node-1"}
    # torch 2.14+ trusts the agent's store only if MASTER_ADDR is written exactly as the
    # endpoint the agent reports: the pod's own IPv6 address, as the pod reports it.
    assert ipaddress.ip_address(master_host(world)).version == 6, world.master
    assert master_host(world) == pods[world.pods[0]]["status"]["podIP"], world.master
    victim = world.pods[1]
    fault = time.time()
    kubernetes.client.CoreV1Api(admin_api).delete_namespaced_pod(victim, job.namespace)
    after = job.wait_world(3, after=fault)
    assert victim not in after.pods.values()
    assert ipaddress.ip_address(master_host(after)).version == 6, after.master


def test_the_operator_serves_its_probes_on_ipv6_pods(
    operator_release: chart.Release, admin_api: kubernetes.client.ApiClient
) -> None:
    """The kubelet probes a pod at its first IP: an endpoint bound to IPv4 alone would
    fail every liveness probe and the operator would be restarted forever."""
    pods = read_object(
        kubernetes.client.CoreV1Api(admin_api).list_namespaced_pod,
        chart.NAMESPACE,
        label_selector=OPERATOR_POD_LABELS,
    )["items"]
    assert len(pods) == 2
    for pod in pods:
        assert ipaddress.ip_address(pod["status"]["podIP"]).version == 6, pod["status"]
        (status,) = pod["status"]["containerStatuses"]
        assert status["restartCount"] == 0, status
        assert status["state"].get("running"), status
