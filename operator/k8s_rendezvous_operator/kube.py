"""The operator's only door to the Kubernetes API (besides kopf's own watches and Events).

Calls are blocking (the official client); the reconciler runs them in worker threads.
"""

from __future__ import annotations

import os
from typing import Any, Final, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from k8s_rendezvous import state

_MERGE_PATCH: Final = "application/merge-patch+json"


class Conflict(Exception):
    """The object changed since it was read; read it again and decide again."""


class NotFound(Exception):
    """The object does not exist (any more)."""


def load_api_client() -> client.ApiClient:
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    # Many rendezvous may reconcile at once; do not queue them behind a tiny pool.
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


class OperatorApi:
    def __init__(self, api_client: client.ApiClient) -> None:
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    def get_rendezvous(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            found = self._custom.get_namespaced_custom_object(
                state.GROUP, state.VERSION, namespace, state.PLURAL, name
            )
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"Rendezvous {namespace}/{name}") from error
            raise
        return cast(dict[str, Any], found)

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the operator's status fields if the object is still at
        ``resource_version``: a decision is only ever written over the state it was made on.
        """
        body = {"metadata": {"resourceVersion": resource_version}, "status": fields}
        try:
            written = self._custom.patch_namespaced_custom_object_status(
                state.GROUP,
                state.VERSION,
                namespace,
                state.PLURAL,
                name,
                body,
                _content_type=_MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"Rendezvous {namespace}/{name}") from error
            if error.status == 404:
                raise NotFound(f"Rendezvous {namespace}/{name}") from error
            raise
        return cast(dict[str, Any], written)

    def label_pod(self, namespace: str, pod: str, rendezvous: str) -> None:
        """Label a node's pod so the operator's server-side filtered pod watch sees it."""
        body = {"metadata": {"labels": {state.NODE_LABEL: rendezvous}}}
        try:
            self._core.patch_namespaced_pod(pod, namespace, body, _content_type=_MERGE_PATCH)
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"Pod {namespace}/{pod}") from error
            raise
