"""The pod side's only door to the Kubernetes API.

It reads the Rendezvous, writes this pod's own Lease (its heartbeat and its entry) and
watches for round changes (of the Rendezvous, or of this node's RendezvousSlice) with
server-side filters. Every failed request (:class:`k8s_rendezvous.rest.RequestFailed`) is
mapped here, in one place, to the torch error type the agent expects, with a message that
names the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

from kubernetes import client

from k8s_rendezvous import backoff, rest
from k8s_rendezvous.errors import (
    ApiServerSilentError,
    KubernetesRendezvousConnectionError,
    KubernetesRendezvousStateError,
    RendezvousNotFoundError,
)
from k8s_rendezvous.wire import leases, objects, specs, statuses

log = logging.getLogger(__name__)

_POD_NAME_EXTRA: Final = "authentication.kubernetes.io/pod-name"
"""What the API server adds to the user info of a token bound to a pod: its name."""
_RETRIED: Final = (rest.Unavailable,)
"""The failures retried for the whole retry budget: those that may pass later."""
_RETRIED_BRIEFLY: Final = (rest.Unauthorized, rest.Forbidden)
"""The failures retried for :data:`_REFUSAL_GRACE_SECONDS` only."""
_REFUSAL_GRACE_SECONDS: Final = 5.0
"""How long 401 and 403 are retried (within the retry budget): a kube-apiserver that has
just restarted refuses requests until its authorizer has loaded the roles. A lasting
refusal (a missing RoleBinding) is still named within seconds."""
_RETRY: Final = backoff.Backoff(base=0.05, cap=2.0, jitter=0.5)
"""How a transient failure is retried within its budget: doubling from 50 ms to 2 s, each
wait drawn from its upper half, so that nodes failing together spread out and still retry
soon enough for the budget (torch's timeouts) to hold several tries."""
_T = TypeVar("_T")
_MIN_REQUEST_SECONDS: Final = 0.1
"""The shortest timeout a budgeted request is given, so that its last retry can still be
answered."""


def load_api_client() -> client.ApiClient:
    """In a pod, its service account; elsewhere, the current kubeconfig context."""
    try:
        return rest.load_api_client()
    except rest.NoCredentials as error:
        raise KubernetesRendezvousConnectionError(str(error)) from error


def server_host(api_client: client.ApiClient) -> str:
    """The API server's host (name or address, IPv6 without brackets) ``api_client`` talks to."""
    host: str = api_client.configuration.host
    return host.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


class RendezvousClient:
    """Reads and writes one Rendezvous on behalf of one node.

    Args:
        api_client: An authenticated client.
        namespace: The Rendezvous' namespace.
        name: The Rendezvous' name.
        retry_seconds: How long transient failures (connection errors, 5xx, 429) are
            retried with bounded exponential backoff before ``RendezvousConnectionError``.
    """

    def __init__(
        self, api_client: client.ApiClient, namespace: str, name: str, *, retry_seconds: float
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.retry_seconds = retry_seconds
        self._rest = rest.Rest(api_client)
        self._pod_uid: str | None = _pod_uid(self._rest.bearer_claims())
        self._lease_owners: dict[str, str] = {}
        """The owner uid each Lease this client made or moved was last written with."""
        self._lease_entries: dict[str, leases.NodeEntry] = {}
        """The entry (the node's request) each Lease was last written with."""
        self._group_path = f"/apis/{objects.GROUP}/{objects.VERSION}/namespaces/{namespace}"
        self._leases_path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    @property
    def reference(self) -> str:
        return f"Rendezvous {self.namespace}/{self.name}"

    def open_connection(self) -> None:
        """Leave an idle connection to the API server in the pool (``GET /version``, which
        every client may read), so that the first join's write does not pay for the TCP
        and TLS handshakes while the other nodes wait for it. Failures are only logged:
        the join connects, and reports, on its own."""
        try:
            self._rest.request("GET", "/version")
        except rest.RequestFailed as error:  # nothing depends on this
            log.debug("could not open a connection to %s ahead: %s", self._rest.server, error)

    def get(self, budget_seconds: float | None = None) -> dict[str, Any]:
        """The Rendezvous; within ``budget_seconds``, if given, each request included: a
        request on a pooled connection into a cut network would otherwise wait out the
        client's read timeout, far beyond the budget."""
        path = f"{self._group_path}/{objects.PLURAL}/{self.name}"
        if budget_seconds is None:
            return self._call("read", lambda: self._rest.request("GET", path))
        deadline = time.monotonic() + budget_seconds

        def read() -> dict[str, Any]:
            # What is left of the budget: a retry after a quick failure ends by the deadline too.
            left = max(_MIN_REQUEST_SECONDS, deadline - time.monotonic())
            return self._rest.request("GET", path, timeout=left)

        return self._call("read", read, budget_seconds)

    def identity(self) -> tuple[str, str | None]:
        """Who these credentials are: the user name and, for a pod-bound service-account
        token, the pod's name (a SelfSubjectReview, which every user may create)."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        answer = self._call(
            "review this node's credentials for",
            lambda: self._rest.request(
                "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", review
            ),
        )
        user = (answer.get("status") or {}).get("userInfo") or {}
        pods = (user.get("extra") or {}).get(_POD_NAME_EXTRA) or []
        return str(user.get("username") or "?"), (str(pods[0]) if pods else None)

    def pod_exists(self, pod: str) -> bool | None:
        """Whether Pod ``pod`` exists in the namespace; ``None`` if these credentials may
        not read pods (the worker role may not)."""
        try:
            self._rest.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        except rest.NotFound:
            return False
        except rest.Forbidden:
            return None
        except rest.RequestFailed as error:
            raise self._error(f"read pod {pod} for", error) from error
        return True

    def create(self, spec: specs.RendezvousSpec, creator: str) -> bool:
        """Create the Rendezvous, made by pod ``creator`` (the operator gives it that pod's
        controller as its owner); ``True`` if made or already there, ``False`` if this
        service account may not create it."""
        body: dict[str, Any] = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {
                "name": self.name,
                "annotations": {objects.CREATED_BY_ANNOTATION: creator},
            },
            "spec": spec.to_dict(),
        }

        def create() -> bool:
            try:
                self._rest.request("POST", f"{self._group_path}/{objects.PLURAL}", body)
            except rest.Conflict:
                return True
            except rest.Forbidden:
                return False
            return True

        return self._call("create", create)

    def write_lease(
        self,
        node: str,
        instance: str,
        duration_seconds: int,
        owner_uid: str,
        entry: leases.NodeEntry | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        """Renew this node's Lease and, if given, replace its entry (the join request),
        retrying transient failures for ``budget_seconds`` (default: ``retry_seconds``).

        The Lease is the node's own object: joins and heartbeats never write the Rendezvous,
        so N nodes joining at once are N independent writes instead of N retries of one
        object's optimistic update. The Rendezvous owns it, so it goes with it.
        """
        renewal = leases.NodeLease(
            self.name,
            node,
            instance,
            entry,
            pod_uid=self._pod_uid,
            owner_uid=owner_uid,
            duration_seconds=duration_seconds,
            renew_time=datetime.datetime.now(datetime.timezone.utc),
        )
        name = renewal.name
        if entry is not None:
            self._lease_entries[name] = entry
        # A heartbeat that finds the Lease gone (collected with a deleted Rendezvous, or
        # deleted by hand) makes it anew with the node's request: without it, the node
        # would wait for a round that nobody knows it asked for.
        lease = dataclasses.replace(renewal, entry=self._lease_entries.get(name)).to_body()

        def create() -> bool:
            try:
                self._rest.request("POST", self._leases_path, lease)
            except rest.Conflict:
                return False
            return True

        def write() -> None:
            # One request per write: create only the first time, or once it is gone. Only
            # a create that was answered makes the Lease known: one refused (429 from API
            # Priority and Fairness when many pods of one ServiceAccount join at once) is
            # retried as a create, not as a patch that fails with 404 and then creates.
            if name not in self._lease_owners:
                if create():
                    self._lease_owners[name] = owner_uid
                    return
                self._lease_owners[name] = ""  # made before this client: owner unknown
            # A Rendezvous made anew: a Lease still owned by the old one would be collected
            # with it, and this node's request with it.
            patch = renewal.to_patch(owner=self._lease_owners[name] != owner_uid)
            try:
                self._rest.request(
                    "PATCH", f"{self._leases_path}/{name}", patch, content_type=rest.MERGE_PATCH
                )
                self._lease_owners[name] = owner_uid
            except rest.NotFound:
                if not create():
                    raise
                self._lease_owners[name] = owner_uid

        self._call(f"write the Lease {name} of node {node!r} for", write, budget_seconds)

    def watch_unless(
        self,
        round_key: str | None,
        resource_version: str | None,
        timeout_seconds: int,
        slice_name: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Stream ``(event type, object)`` for changes whose round key is not ``round_key``,
        of the Rendezvous or, given ``slice_name``, of that RendezvousSlice of it.

        Without ``resource_version`` the API server starts from the current state: the
        object comes first as ADDED (if it exists and passes the filter), so no separate
        read is needed. Raises the pod side's errors, as every call here does (an expired
        ``resource_version``'s 410 is a ``KubernetesRendezvousConnectionError``): the
        caller's loop watches again from the current state.

        Each event is decoded once, from its bytes. (The kubernetes client's ``Watch``
        decodes it three times: loads, dumps, loads; a sealed round of 1000 members is
        about 130 kB, and every node receives it.)
        """
        path = (
            f"{self._group_path}/{objects.PLURAL if slice_name is None else objects.SLICE_PLURAL}"
        )
        query = [
            ("fieldSelector", self._selector(slice_name or self.name, round_key)),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
            ("watch", "true"),
        ]
        if resource_version is not None:
            query.append(("resourceVersion", resource_version))
        lines = self._rest.lines(path, query, timeout=(10, timeout_seconds + 10))
        with contextlib.closing(lines):
            try:
                for line in lines:
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # a metav1.Status, e.g. 410 Gone: too old a version
                        raise self._error("watch", rest.status_failure(obj), budget=0)
                    yield kind, obj
            except rest.RequestFailed as error:
                raise self._error("watch", error, budget=0) from error

    @staticmethod
    def _selector(name: str, round_key: str | None) -> str:
        selector = f"metadata.name={name}"
        if round_key is not None:
            selector += f",{statuses.ROUND_KEY_FIELD}!={round_key}"
        return selector

    def _call(
        self, what: str, request: Callable[[], _T], budget_seconds: float | None = None
    ) -> _T:
        budget = self.retry_seconds if budget_seconds is None else budget_seconds
        started = time.monotonic()
        deadline = started + budget
        refusal_deadline = started + min(budget, _REFUSAL_GRACE_SECONDS)
        retries = backoff.Retries(_RETRY)
        while True:
            try:
                return request()
            except rest.RequestFailed as error:
                now = time.monotonic()
                transient = isinstance(error, _RETRIED) or (
                    isinstance(error, _RETRIED_BRIEFLY) and now < refusal_deadline
                )
                if not transient or now >= deadline:
                    raise self._error(what, error, budget) from error
                failure, asked = error, error.retry_after
            log.debug("retrying to %s %s after %r", what, self.reference, failure)
            # Spread below the backoff, or above the server's Retry-After (API Priority and
            # Fairness asks a flow it refused to wait): retrying sooner only meets a full
            # queue again, at the cost of a request on both ends.
            pause = retries.next_delay()
            if asked is not None:
                pause = max(pause, asked * random.uniform(1, 1.5))
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))

    def _error(
        self, what: str, error: rest.RequestFailed, budget: float | None = None
    ) -> Exception:
        target = f"{what} {self.reference}"
        budget = self.retry_seconds if budget is None else budget
        status, reason = error.status, str(error)
        if isinstance(error, rest.NotFound):
            return RendezvousNotFoundError(
                f"{self.reference} does not exist. Annotate the Job with "
                "k8s-rendezvous.dev/nodes, create the Rendezvous, let the pods create it "
                "(bind the ClusterRole k8s-rendezvous-creator), or fix --rdzv-endpoint "
                "(form: NAME or NAMESPACE/NAME)."
            )
        if isinstance(error, rest.Unauthorized | rest.Forbidden):
            return KubernetesRendezvousConnectionError(
                f"could not {target}: the API server answered {status} ({reason}). If "
                "the pod lacks permission, bind the ClusterRole k8s-rendezvous-worker to "
                f"its ServiceAccount in namespace {self.namespace} with a RoleBinding; if "
                "the admission policy refused it, the node name (POD_NAME) must be the "
                "pod's own name."
            )
        if isinstance(error, rest.Refused):
            return KubernetesRendezvousStateError(
                f"could not {target}: the API server rejected it ({reason}). Check that "
                "the CRD installed matches this k8s-rendezvous version."
            )
        if status is not None:
            within = f" within {budget:.0f} s" if budget else ""
            return KubernetesRendezvousConnectionError(
                f"could not {target}{within}: the API server answered {status} ({reason})."
            )
        unreachable = f"unreachable for {budget:.0f} s" if budget else "unreachable"
        kind = KubernetesRendezvousConnectionError if error.answered else ApiServerSilentError
        return kind(
            f"could not {target}: the API server at {self._rest.server} was {unreachable} "
            f"({error}). Check the pod's network and that the API server is up."
        )


def _pod_uid(claims: dict[str, Any] | None) -> str | None:
    """The uid of the pod a service-account token is bound to (its ``kubernetes.io.pod``
    claim), ``None`` for any other credential."""
    bound = ((claims or {}).get("kubernetes.io") or {}).get("pod") or {}
    uid = bound.get("uid") if isinstance(bound, dict) else None
    return uid if isinstance(uid, str) and uid else None
