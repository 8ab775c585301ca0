"""Kueue's objects for the tests: a queue with quota, priorities, reading Workloads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from devkit.cluster.controlplane import dig

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
REPLACEMENT_ANNOTATION = "kueue.x-k8s.io/workload-slice-replacement-for"
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"
FLAVOR = "k8s-rendezvous-default"
LOCAL_QUEUE = "training"


def queue_objects(namespace: str, cpu: int | str) -> list[dict[str, Any]]:
    """A ResourceFlavor (any node), a ClusterQueue of ``cpu`` CPUs for ``namespace`` that
    preempts lower priorities within itself, and the LocalQueue users name in their Jobs."""
    return [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR},
        },
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ClusterQueue",
            "metadata": {"name": namespace},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu"],
                        "flavors": [
                            {"name": FLAVOR, "resources": [{"name": "cpu", "nominalQuota": cpu}]}
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "LocalQueue",
            "metadata": {"name": LOCAL_QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": namespace},
        },
    ]


def priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


@contextlib.contextmanager
def cluster_objects(
    api: kubernetes.client.ApiClient, objects: list[dict[str, Any]]
) -> Iterator[None]:
    """Create ``objects`` (created already is fine); delete the cluster-scoped ones but the
    shared flavor afterwards (namespaced ones go with the test's namespace)."""
    custom = kubernetes.client.CustomObjectsApi(api)
    plural = {
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
        "WorkloadPriorityClass": "workloadpriorityclasses",
    }
    made = []
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        try:
            if namespace:
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, namespace, plural[obj["kind"]], obj
                )
            else:
                custom.create_cluster_custom_object(GROUP, VERSION, plural[obj["kind"]], obj)
        except ApiException as error:
            if error.status != 409:
                raise
        if not namespace and obj["kind"] != "ResourceFlavor":
            made.append((plural[obj["kind"]], obj["metadata"]["name"]))
    try:
        yield
    finally:
        for kind, name in made:
            with contextlib.suppress(ApiException):
                custom.delete_cluster_custom_object(GROUP, VERSION, kind, name)


def workloads(
    api: kubernetes.client.ApiClient, namespace: str, job_uid: str
) -> list[dict[str, Any]]:
    """The Workloads (slices) Kueue made for the Job ``job_uid``, oldest first."""
    found = kubernetes.client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, "workloads"
    )
    mine = [
        w
        for w in found["items"]
        if any(o.get("uid") == job_uid for o in w["metadata"].get("ownerReferences") or [])
    ]
    return sorted(mine, key=lambda w: w["metadata"]["creationTimestamp"])


def condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next(
        (c for c in dig(obj, "status", "conditions", default=[]) if c["type"] == kind), None
    )


def holds(obj: Mapping[str, Any], kind: str) -> bool:
    """Whether condition ``kind`` is True."""
    found = condition(obj, kind)
    return found is not None and found.get("status") == "True"


def gated(pod: Mapping[str, Any]) -> bool:
    """Whether Kueue holds ``pod`` back from scheduling (its elastic-job gate)."""
    gates = dig(pod, "spec", "schedulingGates", default=[])
    return any(gate.get("name") == ELASTIC_GATE for gate in gates)
