"""The operator's only door to the Kubernetes API (besides kopf's own watches and Events).

Calls are blocking (the official client); the reconciler runs them in worker threads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from k8s_rendezvous import rest, state

ApiClient = client.ApiClient
"""The authenticated client the operator's API doors are made from."""


class Conflict(Exception):
    """The object changed since it was read; read it again and decide again."""


class NotFound(Exception):
    """The object does not exist (any more)."""


class Invalid(Exception):
    """The API server refused the object as invalid (422); the message says why."""


class Refused(Exception):
    """The API server refused the request for good (400, 403, 422); the message says why."""


class Unavailable(Exception):
    """The request may succeed later: no answer, or a 409, 429 or 5xx."""


def api_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


def job_owner(name: str, uid: str) -> dict[str, Any]:
    """The ownerReference of what the operator makes for an annotated Job. Not blocking
    the Job's deletion: that would need update on jobs/finalizers, and nothing made for a
    Job must outlive it anyway."""
    return state.owner_reference("batch/v1", "Job", name, uid)


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
        # Plain JSON, not the typed clients: they validate every call (bench/FINDINGS.md)
        # and would cost about 100 MB of memory for their models, for the handful of calls
        # made here.
        self._request = rest.Rest(api_client).request

    @staticmethod
    def _path(namespace: str, plural: str, name: str = "") -> str:
        path = f"/apis/{state.GROUP}/{state.VERSION}/namespaces/{namespace}/{plural}"
        return f"{path}/{name}" if name else path

    def get_rendezvous(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self._request("GET", self._path(namespace, state.PLURAL, name))
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"Rendezvous {namespace}/{name}") from error
            raise

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the operator's status fields if the object is still at
        ``resource_version``: a decision is only ever written over the state it was made on.
        """
        body = {"metadata": {"resourceVersion": resource_version}, "status": fields}
        try:
            return self._request(
                "PATCH",
                self._path(namespace, state.PLURAL, name) + "/status",
                body,
                content_type=rest.MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 409:
                raise Conflict(f"Rendezvous {namespace}/{name}") from error
            if error.status == 404:
                raise NotFound(f"Rendezvous {namespace}/{name}") from error
            if error.status == 422:
                raise Invalid(api_message(error)) from error
            raise

    def write_slice(
        self,
        namespace: str,
        rendezvous: Mapping[str, Any],
        index: int,
        content: Mapping[str, Any],
    ) -> None:
        """Make RendezvousSlice ``index`` of ``rendezvous`` hold ``content`` (its spec and
        status): a merge patch (``None`` removes a field), or a create the first time. The
        Rendezvous owns it, so it goes with it."""
        metadata = rendezvous["metadata"]
        name = state.slice_name(metadata["name"], index)
        try:
            self._request(
                "PATCH",
                self._path(namespace, state.SLICE_PLURAL, name),
                dict(content),
                content_type=rest.MERGE_PATCH,
            )
            return
        except ApiException as error:
            if error.status != 404:
                raise
        owner = state.owner_reference(
            state.API_VERSION, state.KIND, metadata["name"], metadata["uid"]
        )
        body = {
            "apiVersion": state.API_VERSION,
            "kind": state.SLICE_KIND,
            "metadata": {
                "name": name,
                "labels": {state.NODE_LABEL: metadata["name"]},
                "ownerReferences": [owner],
            },
            **{
                part: {key: value for key, value in fields.items() if value is not None}
                for part, fields in content.items()
            },
        }
        self._request("POST", self._path(namespace, state.SLICE_PLURAL), body)

    def list_node_leases(self, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        """Every node's Lease, in ``namespaces`` (all if empty), as plain JSON."""
        query = [("labelSelector", state.NODE_LABEL)]
        paths = [f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases" for ns in namespaces]
        return [
            lease
            for path in paths or ["/apis/coordination.k8s.io/v1/leases"]
            for lease in self._request("GET", path, query=query)["items"]
        ]

    def unlabelled_job_pods(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        """The pods of the Job of ``job_uid`` that carry no rendezvous label (neither the
        webhook nor the operator has seen them as nodes), as plain JSON with their kind."""
        selector = f"batch.kubernetes.io/controller-uid={job_uid},!{state.NODE_LABEL}"
        found = self._request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", query=[("labelSelector", selector)]
        )
        return [{"apiVersion": "v1", "kind": "Pod", **pod} for pod in found["items"]]

    def label_pod(self, namespace: str, pod: str, rendezvous: str) -> dict[str, Any]:
        """Label a node's pod so the operator's server-side filtered pod watch sees it;
        returns the pod as labelled."""
        body = {"metadata": {"labels": {state.NODE_LABEL: rendezvous}}}
        try:
            return self._request(
                "PATCH",
                f"/api/v1/namespaces/{namespace}/pods/{pod}",
                body,
                content_type=rest.MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"Pod {namespace}/{pod}") from error
            raise

    def create_rendezvous(
        self, namespace: str, name: str, spec: state.RendezvousSpec, owner: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Create the Rendezvous owned by ``owner`` (an ownerReference); ``None`` if it
        exists already. No finalizer: garbage collection removes it with its owner."""
        body = {
            "apiVersion": state.API_VERSION,
            "kind": state.KIND,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "ownerReferences": [owner],
                "labels": {"app.kubernetes.io/managed-by": "k8s-rendezvous-operator"},
            },
            "spec": spec.to_dict(),
        }
        try:
            return self._request("POST", self._path(namespace, state.PLURAL), body)
        except ApiException as error:
            if error.status == 409:
                return None
            raise

    def patch_rendezvous_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self._request(
            "PATCH",
            self._path(namespace, state.PLURAL, name),
            {"spec": spec},
            content_type=rest.MERGE_PATCH,
        )

    def service_account_exists(self, namespace: str, name: str) -> bool:
        try:
            self._request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def bind_worker_role(
        self, namespace: str, job: str, job_uid: str, service_account: str, cluster_role: str
    ) -> None:
        """Let ``job``'s ``service_account`` use rendezvous in ``namespace`` (idempotent),
        with a RoleBinding owned by the Job: garbage collection removes it with the Job."""
        body = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {
                "name": f"{cluster_role}-job-{job}"[:253].rstrip("-."),
                "labels": {"app.kubernetes.io/managed-by": "k8s-rendezvous-operator"},
                "ownerReferences": [job_owner(job, job_uid)],
            },
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_role,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
            ],
        }
        try:
            self._request(
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
                body,
            )
        except ApiException as error:
            if error.status != 409:
                raise

    def register_webhooks(self, configuration: str, webhooks: list[dict[str, Any]]) -> None:
        """Make MutatingWebhookConfiguration ``configuration``'s webhooks these (a merge
        patch replaces the list whole); create it if it is missing."""
        path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
        body = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": configuration},
            "webhooks": webhooks,
        }
        try:
            try:
                self._request(
                    "PATCH",
                    f"{path}/{configuration}",
                    {"webhooks": webhooks},
                    content_type=rest.MERGE_PATCH,
                )
            except ApiException as error:
                if error.status != 404:
                    raise
                self._request("POST", path, body)
        except ApiException as error:
            said = f"{error.status}: {api_message(error)}"
            raise (Refused if error.status in (400, 403, 422) else Unavailable)(said) from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise Unavailable(str(error)) from error

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def get_pod(self, namespace: str, pod: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def pod_node_name(self, namespace: str, pod: str) -> str | None:
        found = self.get_pod(namespace, pod)
        return (
            None if found is None else cast(str | None, (found.get("spec") or {}).get("nodeName"))
        )

    def adopt_rendezvous(
        self, namespace: str, name: str, uid: str, owner: dict[str, Any]
    ) -> dict[str, Any]:
        """Make ``owner`` the controller owner of the Rendezvous whose uid is ``uid``
        (the uid is a precondition: not one made anew since); the Rendezvous as it is now."""
        try:
            return self._request(
                "PATCH",
                self._path(namespace, state.PLURAL, name),
                {"metadata": {"uid": uid, "ownerReferences": [owner]}},
                content_type=rest.MERGE_PATCH,
            )
        except ApiException as error:
            if error.status == 404:
                raise NotFound(name) from error
            if error.status == 409:
                raise Conflict(name) from error
            raise

    def node_labels(self, node: str) -> dict[str, str]:
        found = self._request("GET", f"/api/v1/nodes/{node}")
        return dict((found.get("metadata") or {}).get("labels") or {})


class Taken(Exception):
    """Someone else wrote the Lease first (409)."""


class LeaseLock:
    """Blocking reads and writes of the leader-election Lease (``leadership``); every call
    bounded by ``timeout`` seconds."""

    def __init__(self, api_client: client.ApiClient, namespace: str, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self._request = rest.Rest(api_client).request
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    @property
    def reference(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def get(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"{self._path}/{self.name}", timeout=timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def create(self, spec: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": dict(spec),
        }
        try:
            return self._request("POST", self._path, body, timeout=timeout)
        except ApiException as error:
            if error.status == 409:
                raise Taken(self.reference) from error
            raise

    def update(
        self, lease: Mapping[str, Any], spec: Mapping[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Replace the spec of ``lease`` (as read) if nobody wrote it since."""
        metadata = {k: v for k, v in lease["metadata"].items() if k != "managedFields"}
        body = {**lease, "metadata": metadata, "spec": dict(spec)}
        try:
            return self._request("PUT", f"{self._path}/{self.name}", body, timeout=timeout)
        except ApiException as error:
            if error.status in (404, 409):
                raise Taken(self.reference) from error
            raise
