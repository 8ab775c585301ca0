"""Namespaces for the kit's workloads: made, ready for pods, and allowed to rendezvous."""

from __future__ import annotations

from collections.abc import Mapping

import kubernetes.client

from devkit import chart
from devkit.cluster.controlplane import read_object_or_none, to_model
from devkit.waiting import wait_for


def create(
    api: kubernetes.client.ApiClient,
    name: str,
    labels: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> str:
    """Create namespace ``name`` and return it once its ``default`` ServiceAccount exists.

    Labels are set at creation: a webhook's namespaceSelector may be judged on the API
    server's cached copy, which a label added afterwards reaches a moment later. The wait
    is long: after a test restarts the API server, the controller manager's informers
    retry with client-go's backoff, which stops at [30, 60) s.
    """
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace(
        to_model(
            kubernetes.client.V1Namespace,
            {"metadata": {"name": name, "labels": dict(labels or {})}},
        )
    )

    def default_service_account() -> bool:
        return (
            read_object_or_none(core.read_namespaced_service_account, "default", name) is not None
        )

    wait_for(
        default_service_account,
        timeout,
        f"ServiceAccount {name}/default (serviceaccount controller)",
    )
    return name


def bind_worker_role(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Let the pods of ``namespace`` (its ``default`` ServiceAccount) use a rendezvous: the
    worker ClusterRole of manifests/rbac/ and of the chart."""
    _bind_cluster_role(api, namespace, chart.WORKER_ROLE, ("coordination.k8s.io", "leases"))


def bind_creator_role(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Let the pods of ``namespace`` (its ``default`` ServiceAccount) create a missing
    Rendezvous, as docs/workloads.md has users do for workloads that are not annotated Jobs."""
    _bind_cluster_role(api, namespace, chart.CREATOR_ROLE, ("k8s-rendezvous.dev", "rendezvous"))


def _bind_cluster_role(
    api: kubernetes.client.ApiClient, namespace: str, role: str, creates: tuple[str, str]
) -> None:
    """Bind ClusterRole ``role`` to the ``default`` ServiceAccount of ``namespace``, in a
    RoleBinding of the role's name, and return once the API server's authorizer lets that
    ServiceAccount create ``creates`` (group, resource) there: its RBAC cache takes the
    binding a moment after it is written, and a pod's request in that moment is refused."""
    kubernetes.client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(
        namespace,
        to_model(
            kubernetes.client.V1RoleBinding,
            {
                "metadata": {"name": role},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role,
                },
                "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
            },
        ),
    )
    user = f"system:serviceaccount:{namespace}:default"
    group, resource = creates
    review = to_model(
        kubernetes.client.V1SubjectAccessReview,
        {
            "spec": {
                "user": user,
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                "resourceAttributes": {
                    "namespace": namespace,
                    "group": group,
                    "resource": resource,
                    "verb": "create",
                },
            }
        },
    )
    authorization = kubernetes.client.AuthorizationV1Api(api)

    def allowed() -> bool:
        status = authorization.create_subject_access_review(review).status
        return status is not None and status.allowed

    wait_for(
        allowed,
        30,
        f"{user} allowed to create {resource} by ClusterRole {role}",
        interval=0.05,
    )
