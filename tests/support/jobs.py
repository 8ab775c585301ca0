"""Jobs in tests: made by the admin, their pods made by the real Job controller and run by
kwok."""

from __future__ import annotations

from typing import Any

import kubernetes.client

from devkit.cluster.controlplane import ControlPlane, read_object
from devkit.waiting import wait_for


def make_job(
    api: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    parallelism: int,
    annotations: dict[str, str],
    command: list[str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "trainer", "image": "example.invalid/trainer"}
    if command is not None:
        container["command"] = command
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "parallelism": parallelism,
            "completions": None,
            "backoffLimit": spec.pop("backoffLimit", 6),
            "template": {
                "spec": {
                    "containers": [container],
                    "restartPolicy": "Never",
                }
            },
            **spec,
        },
    }
    created = kubernetes.client.BatchV1Api(api).create_namespaced_job(namespace, body)
    return api.sanitize_for_serialization(created)  # type: ignore[no-any-return]


def job_events(
    api: kubernetes.client.ApiClient, namespace: str, job: str
) -> list[tuple[str, str, str]]:
    """``(type, reason, message)`` of each Event on Job ``job``."""
    core = kubernetes.client.CoreV1Api(api)
    found = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={job},involvedObject.kind=Job"
    )
    return [(e.type, e.reason, e.message) for e in found.items]


def job_pods(api: kubernetes.client.ApiClient, namespace: str, job: str) -> list[dict[str, Any]]:
    core = kubernetes.client.CoreV1Api(api)
    found = read_object(
        core.list_namespaced_pod, namespace, label_selector=f"batch.kubernetes.io/job-name={job}"
    )
    return [
        pod
        for pod in found["items"]
        if pod["status"].get("phase") == "Running"
        and pod["status"].get("podIP")
        and not pod["metadata"].get("deletionTimestamp")
    ]


def running_pods(
    api: kubernetes.client.ApiClient, namespace: str, job: str, count: int
) -> list[dict[str, Any]]:
    return wait_for(
        lambda: pods if len(pods := job_pods(api, namespace, job)) == count else None,
        60,
        f"{count} running pods of Job {job}",
    )


def wait_webhook_registered(control_plane: ControlPlane, namespace: str) -> None:
    """Until the test operator's webhook configuration (named after the namespace) is
    there: pods created before it are not sent to the webhook."""
    wait_for(
        lambda: (
            control_plane.kubectl(
                "get", "mutatingwebhookconfigurations", "-o", "name", check=False
            ).stdout.count(namespace)
            == 1
        ),
        30,
        "webhook configuration registered",
    )
