"""The operator's only door to the Kubernetes API (besides kopf's own watches and Events).

Calls are blocking (the official client); the reconciler runs them in worker threads.
A failed request raises :class:`ApiError` and its kinds, the shared request layer's
(:mod:`k8s_rendezvous.rest`): callers catch what happened (:class:`NotFound`,
:class:`Conflict`...), never the client library's exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast
from urllib.parse import quote

from kubernetes import client

from k8s_rendezvous import rest
from k8s_rendezvous.wire import objects, specs
from k8s_rendezvous_operator import metrics, workloads

ApiClient = client.ApiClient
"""The authenticated client the operator's API doors are made from."""


ApiError = rest.RequestFailed
"""The API server refused a request, or could not be reached: every request of this
module fails with one of these, so callers (and the error metric's label) name what
happened, not the library."""
NotFound = rest.NotFound
Conflict = rest.Conflict
Unauthorized = rest.Unauthorized
Refused = rest.Refused
Forbidden = rest.Forbidden
Invalid = rest.Invalid
TooLarge = rest.TooLarge
Unavailable = rest.Unavailable
Expired = rest.Expired

LIST_PAGE: int = 500
"""Objects per page of a list, client-go's pager's size: one answer for 16,384 nodes'
Leases would be tens of megabytes, built in the API server's memory at once."""


class Taken(Conflict):
    """Someone else wrote the leader-election Lease first."""


def resource_of(path: str) -> str:
    """The resource an API ``path`` names (``/apis/batch/v1/namespaces/a/jobs/b`` ->
    ``jobs``): a label of few values, unlike the path."""
    parts = path.partition("?")[0].strip("/").split("/")
    below = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if below[:1] == ["namespaces"] and len(below) > 2:
        below = below[2:]
    return below[0] if below else ""


def _requester(api_client: client.ApiClient) -> Callable[..., dict[str, Any]]:
    """``rest.Rest.request`` that counts each request (``metrics.API_REQUESTS``)."""
    send = rest.Rest(api_client).request

    def request(
        method: str, path: str, body: object | None = None, **options: Any
    ) -> dict[str, Any]:
        metrics.API_REQUESTS.labels(method, resource_of(path)).inc()
        return send(method, path, body, **options)

    return request


def _segment(name: str) -> str:
    """``name`` as one segment of an API path. Some names come from what a pod wrote (its
    Lease's holder, the pod a Rendezvous says made it): a '/' or '..' in one must not make
    the request name another object, in another namespace or of another kind."""
    return quote(name, safe="")


def job_owner(name: str, uid: str) -> dict[str, Any]:
    """The ownerReference of what the operator makes for an annotated Job. Not blocking
    the Job's deletion: that would need update on jobs/finalizers, and nothing made for a
    Job must outlive it anyway."""
    return objects.owner_reference("batch/v1", "Job", name, uid)


def load_api_client() -> client.ApiClient:
    """In a pod, its service account; elsewhere, the current kubeconfig context."""
    # Many rendezvous may reconcile at once; do not queue them behind a tiny pool.
    return rest.load_api_client(pool_maxsize=32)


class ReconcilerApi(Protocol):
    """What the reconciler (and its :mod:`.jobs`) needs of the API: :class:`OperatorApi`,
    or a test's fake. Each call blocks; errors are :class:`ApiError`'s kinds."""

    def get_rendezvous(self, namespace: str, name: str) -> dict[str, Any]: ...

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]: ...

    def write_slice(
        self,
        namespace: str,
        rendezvous: str,
        rendezvous_uid: str,
        index: int,
        content: Mapping[str, Any],
    ) -> None: ...

    def unlabelled_job_pods(self, namespace: str, job_uid: str) -> list[dict[str, Any]]: ...

    def label_pod(self, namespace: str, pod: str, rendezvous: str) -> dict[str, Any]: ...

    def create_rendezvous(
        self, namespace: str, name: str, spec: specs.RendezvousSpec, owner: dict[str, Any]
    ) -> dict[str, Any] | None: ...

    def patch_rendezvous_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None: ...

    def delete_rendezvous(self, namespace: str, name: str, uid: str) -> None: ...

    def service_account_exists(self, namespace: str, name: str) -> bool: ...

    def bind_worker_role(
        self, namespace: str, job: str, job_uid: str, service_account: str, cluster_role: str
    ) -> None: ...

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def get_owner(
        self, namespace: str, reference: workloads.Reference
    ) -> dict[str, Any] | None: ...

    def get_pod(self, namespace: str, pod: str) -> dict[str, Any] | None: ...

    def pod_node_name(self, namespace: str, pod: str) -> str | None: ...

    def adopt_rendezvous(
        self, namespace: str, name: str, uid: str, owner: dict[str, Any]
    ) -> dict[str, Any]: ...

    def node_labels(self, node: str) -> dict[str, str]: ...

    def delete_lease(self, namespace: str, name: str, uid: str, resource_version: str) -> None: ...


class OperatorApi:
    def __init__(self, api_client: client.ApiClient) -> None:
        # Plain JSON, not the typed clients: they validate every call (bench/FINDINGS.md)
        # and would cost about 100 MB of memory for their models, for the handful of calls
        # made here.
        self._request = _requester(api_client)

    @staticmethod
    def _path(namespace: str, plural: str, name: str = "") -> str:
        path = f"/apis/{objects.GROUP}/{objects.VERSION}/namespaces/{namespace}/{plural}"
        return f"{path}/{_segment(name)}" if name else path

    def get_rendezvous(self, namespace: str, name: str) -> dict[str, Any]:
        return self._request("GET", self._path(namespace, objects.PLURAL, name))

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the operator's status fields if the object is still at
        ``resource_version``: a decision is only ever written over the state it was made on.
        """
        body = {"metadata": {"resourceVersion": resource_version}, "status": fields}
        return self._request(
            "PATCH",
            self._path(namespace, objects.PLURAL, name) + "/status",
            body,
            content_type=rest.MERGE_PATCH,
        )

    def write_slice(
        self,
        namespace: str,
        rendezvous: str,
        rendezvous_uid: str,
        index: int,
        content: Mapping[str, Any],
    ) -> None:
        """Make RendezvousSlice ``index`` of Rendezvous ``rendezvous`` hold ``content`` (its
        spec and status): a merge patch (``None`` removes a field), or a create the first
        time. The Rendezvous (``rendezvous_uid``) owns it, so it goes with it."""
        name = objects.slice_name(rendezvous, index)
        try:
            self._request(
                "PATCH",
                self._path(namespace, objects.SLICE_PLURAL, name),
                dict(content),
                content_type=rest.MERGE_PATCH,
            )
            return
        except NotFound:
            pass
        owner = objects.owner_reference(
            objects.API_VERSION, objects.KIND, rendezvous, rendezvous_uid
        )
        body = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.SLICE_KIND,
            "metadata": {
                "name": name,
                "labels": {objects.NODE_LABEL: rendezvous},
                "ownerReferences": [owner],
            },
            **{
                part: {key: value for key, value in fields.items() if value is not None}
                for part, fields in content.items()
            },
        }
        self._request("POST", self._path(namespace, objects.SLICE_PLURAL), body)

    def list_node_leases(self, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        """Every node's Lease, in ``namespaces`` (all if empty), as plain JSON."""
        query = [("labelSelector", objects.NODE_LABEL)]
        paths = [f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases" for ns in namespaces]
        return [
            lease
            for path in paths or ["/apis/coordination.k8s.io/v1/leases"]
            for lease in self._list(path, query)
        ]

    def _list(self, path: str, query: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
        """Every item a list at ``path`` answers, :data:`LIST_PAGE` at a time. A continue
        token the API server no longer keeps (the listing outlived etcd's compaction) ends
        in one list without pages, as client-go's pager does: starting the pages over
        could expire again."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            page = [*query, ("limit", str(LIST_PAGE))] + ([("continue", token)] if token else [])
            try:
                answer = self._request("GET", path, query=page)
            except Expired:
                return list(self._request("GET", path, query=query)["items"])
            items += answer["items"]
            token = (answer.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    def delete_lease(self, namespace: str, name: str, uid: str, resource_version: str) -> None:
        """Delete a node's Lease if it is still the one read (its ``uid``, unwritten since
        ``resource_version``): else a :class:`Conflict`, so a Lease a new pod of the name
        made or wrote meanwhile is never deleted in the old one's place."""
        self._request(
            "DELETE",
            f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{_segment(name)}",
            {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "preconditions": {"uid": uid, "resourceVersion": resource_version},
            },
        )

    def unlabelled_job_pods(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        """The pods of the Job of ``job_uid`` that carry no rendezvous label (neither the
        webhook nor the operator has seen them as nodes), as plain JSON with their kind."""
        selector = f"batch.kubernetes.io/controller-uid={job_uid},!{objects.NODE_LABEL}"
        found = self._list(f"/api/v1/namespaces/{namespace}/pods", [("labelSelector", selector)])
        return [{"apiVersion": "v1", "kind": "Pod", **pod} for pod in found]

    def label_pod(self, namespace: str, pod: str, rendezvous: str) -> dict[str, Any]:
        """Label a node's pod so the operator's server-side filtered pod watch sees it;
        returns the pod as labelled."""
        body = {"metadata": {"labels": {objects.NODE_LABEL: rendezvous}}}
        return self._request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{_segment(pod)}",
            body,
            content_type=rest.MERGE_PATCH,
        )

    def create_rendezvous(
        self, namespace: str, name: str, spec: specs.RendezvousSpec, owner: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Create the Rendezvous owned by ``owner`` (an ownerReference); ``None`` if it
        exists already. No finalizer: garbage collection removes it with its owner."""
        body = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {
                "name": name,
                "namespace": namespace,
                "ownerReferences": [owner],
                "labels": {"app.kubernetes.io/managed-by": "k8s-rendezvous-operator"},
            },
            "spec": spec.to_dict(),
        }
        try:
            return self._request("POST", self._path(namespace, objects.PLURAL), body)
        except Conflict:
            return None

    def patch_rendezvous_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self._request(
            "PATCH",
            self._path(namespace, objects.PLURAL, name),
            {"spec": spec},
            content_type=rest.MERGE_PATCH,
        )

    def delete_rendezvous(self, namespace: str, name: str, uid: str) -> None:
        """Delete the Rendezvous whose uid is ``uid``: the uid is a precondition, so one
        made anew under the name meanwhile is never deleted in its place (a Conflict)."""
        self._request(
            "DELETE",
            self._path(namespace, objects.PLURAL, name),
            {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}},
        )

    def service_account_exists(self, namespace: str, name: str) -> bool:
        try:
            self._request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{_segment(name)}")
        except NotFound:
            return False
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
        with contextlib.suppress(Conflict):  # bound already
            self._request(
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
                body,
            )

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
            except NotFound:
                self._request("POST", path, body)
        except ApiError as error:
            if error.status is None:
                raise  # no answer: Unavailable already
            # Refused for good, or it may pass later (a 409: made meanwhile).
            said = f"{error.status}: {error}"
            kind = Refused if isinstance(error, Refused) else Unavailable
            raise kind(said, error.status) from error

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request(
                "GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/{_segment(name)}"
            )
        except NotFound:
            return None

    def get_owner(self, namespace: str, reference: workloads.Reference) -> dict[str, Any] | None:
        """The object ``reference`` names, of a kind read on the way up to a workload
        (:data:`workloads.READ`); ``None`` if not found."""
        resource = reference.resource
        if resource is None:
            raise ValueError(f"{reference}: objects of kind {reference.kind} are not read")
        group = reference.of_kind.group
        version = quote(reference.api_version.rpartition("/")[2], safe="")
        root = f"/apis/{group}/{version}" if group else f"/api/{version}"
        path = f"{root}/namespaces/{namespace}/{resource}/{_segment(reference.name)}"
        try:
            return self._request("GET", path)
        except NotFound:
            return None

    def get_pod(self, namespace: str, pod: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"/api/v1/namespaces/{namespace}/pods/{_segment(pod)}")
        except NotFound:
            return None

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
        return self._request(
            "PATCH",
            self._path(namespace, objects.PLURAL, name),
            {"metadata": {"uid": uid, "ownerReferences": [owner]}},
            content_type=rest.MERGE_PATCH,
        )

    def node_labels(self, node: str) -> dict[str, str]:
        found = self._request("GET", f"/api/v1/nodes/{_segment(node)}")
        return dict((found.get("metadata") or {}).get("labels") or {})


class LeaseLock:
    """Blocking reads and writes of the leader-election Lease (``leadership``); every call
    bounded by ``timeout`` seconds."""

    def __init__(self, api_client: client.ApiClient, namespace: str, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self._request = _requester(api_client)
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    @property
    def reference(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def get(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self._request("GET", f"{self._path}/{self.name}", timeout=timeout)
        except NotFound:
            return None

    def create(self, spec: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": dict(spec),
        }
        try:
            return self._request("POST", self._path, body, timeout=timeout)
        except Conflict as error:
            raise Taken(self.reference, error.status) from error

    def update(
        self, lease: Mapping[str, Any], spec: Mapping[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Replace the spec of ``lease`` (as read) if nobody wrote it since."""
        metadata = {k: v for k, v in lease["metadata"].items() if k != "managedFields"}
        body = {**lease, "metadata": metadata, "spec": dict(spec)}
        try:
            return self._request("PUT", f"{self._path}/{self.name}", body, timeout=timeout)
        except (NotFound, Conflict) as error:
            raise Taken(self.reference, error.status) from error
