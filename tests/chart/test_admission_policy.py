"""The chart's ValidatingAdmissionPolicies against the real API server, with real
pod-bound tokens: a pod may write its own status entry and its own heartbeat Lease, and
nothing else of a Rendezvous or of other nodes; everyone else is left alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tests.chart.chart import CHART, REPO, Helm, Release, find
from tests.cluster.controlplane import ControlPlane
from tests.support.fixtures import Rendezvous, create_pods

from k8s_rendezvous import state

pytestmark = pytest.mark.usefixtures("chart_release")

MERGE = "application/merge-patch+json"
ENTRY = {"instance": "i-1", "attempt": 1, "addr": "10.0.0.7", "storePort": 29500, "intent": "Join"}


class PodClient:
    """Raw API calls authenticated as one pod (its bound token)."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, pod: str) -> None:
        self.pod = pod
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api)

    def patch_status(self, rendezvous: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object_status(  # type: ignore[no-any-return]
            state.GROUP,
            state.VERSION,
            self.namespace,
            state.PLURAL,
            rendezvous,
            {"status": status},
            _content_type=MERGE,
        )

    def create_lease(self, name: str, holder: str) -> dict[str, Any]:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "labels": {state.NODE_LABEL: name.split(".")[0]}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 30},
        }
        return self.custom.create_namespaced_custom_object(  # type: ignore[no-any-return]
            "coordination.k8s.io", "v1", self.namespace, "leases", body
        )

    def patch_lease(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(  # type: ignore[no-any-return]
            "coordination.k8s.io",
            "v1",
            self.namespace,
            "leases",
            name,
            {"spec": spec},
            _content_type=MERGE,
        )


def denied(call: Callable[[], object]) -> str:
    """The API server's message for a request that must be refused with 403."""
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status == 403, error.value.body
    return str(json.loads(error.value.body)["message"])


@pytest.fixture
def rendezvous(
    make_rendezvous: Callable[..., Rendezvous], admin_api: kubernetes.client.ApiClient
) -> Rendezvous:
    """A Rendezvous whose status the operator (here: admin) has initialised, with the entry
    of another pod already in it."""
    rdzv = make_rendezvous(2, 2)
    kubernetes.client.CustomObjectsApi(admin_api).patch_namespaced_custom_object_status(
        state.GROUP,
        state.VERSION,
        rdzv.namespace,
        state.PLURAL,
        rdzv.name,
        {
            "status": {
                "state": "Forming",
                "roundKey": "0-Forming",
                "round": 0,
                "nodes": {"pod-b": {**ENTRY, "instance": "b"}},
            }
        },
        _content_type=MERGE,
    )
    return rdzv


@pytest.fixture
def pod_a(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> PodClient:
    (pod,) = create_pods(admin_api, workers_namespace, ["pod-a"])
    token = control_plane.token_for(
        workers_namespace, "default", pod_name="pod-a", pod_uid=pod["metadata"]["uid"]
    )
    return PodClient(control_plane.client_for_token(token), workers_namespace, "pod-a")


def test_a_pod_writes_its_own_entry(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    written = pod_a.patch_status(rendezvous.name, {"nodes": {"pod-a": ENTRY}})
    assert written["status"]["nodes"]["pod-a"] == ENTRY
    left = pod_a.patch_status(rendezvous.name, {"nodes": {"pod-a": {**ENTRY, "intent": "Leave"}}})
    assert left["status"]["nodes"]["pod-a"]["intent"] == "Leave"
    assert left["status"]["nodes"]["pod-b"]["instance"] == "b"


def test_another_pods_entry_is_denied(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    expected = (
        'pod pod-a may write only its own entry status.nodes["pod-a"]: '
        "the entries of other pods are written by those pods alone"
    )
    assert expected in denied(
        lambda: pod_a.patch_status(
            rendezvous.name, {"nodes": {"pod-b": {**ENTRY, "intent": "Leave"}}}
        )
    )
    assert expected in denied(
        lambda: pod_a.patch_status(rendezvous.name, {"nodes": {"pod-b": None}})
    )
    assert expected in denied(
        lambda: pod_a.patch_status(rendezvous.name, {"nodes": {"pod-c": ENTRY}})
    )
    assert rendezvous.body()["status"]["nodes"]["pod-b"]["instance"] == "b"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round", 7),
        ("members", [{"rank": 0, "node": "pod-a", "instance": "i", "attempt": 1, "addr": "x"}]),
        ("master", {"addr": "10.0.0.66", "port": 1}),
        ("state", "Closed"),
        (
            "conditions",
            [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Forged",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        ),
    ],
)
def test_what_the_operator_owns_is_denied(
    pod_a: PodClient, rendezvous: Rendezvous, field: str, value: object
) -> None:
    message = denied(
        lambda: pod_a.patch_status(rendezvous.name, {field: value, "nodes": {"pod-a": ENTRY}})
    )
    assert (
        f"status.{field} is written by the k8s-rendezvous operator alone; "
        'pod pod-a may change only its own entry status.nodes["pod-a"]'
    ) in message
    assert "pod-a" not in rendezvous.body()["status"].get("nodes", {}), "nothing was written"


def test_the_operator_and_admins_are_not_concerned(
    rendezvous: Rendezvous, admin_api: kubernetes.client.ApiClient
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    written = custom.patch_namespaced_custom_object_status(
        state.GROUP,
        state.VERSION,
        rendezvous.namespace,
        state.PLURAL,
        rendezvous.name,
        {"status": {"round": 1, "nodes": {"pod-b": None}}},
        _content_type=MERGE,
    )
    assert written["status"]["round"] == 1 and "pod-b" not in written["status"]["nodes"]


def test_a_pod_keeps_only_its_own_heartbeat_lease(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    own = f"{rendezvous.name}.pod-a"
    assert pod_a.create_lease(own, "pod-a")["spec"]["holderIdentity"] == "pod-a"
    assert pod_a.patch_lease(own, {"renewTime": "2026-01-01T00:00:00.000000Z"})

    message = denied(lambda: pod_a.create_lease(f"{rendezvous.name}.pod-b", "pod-a"))
    assert (
        f"pod pod-a may write only its own heartbeat Lease <rendezvous>.pod-a, "
        f"not {rendezvous.name}.pod-b (the heartbeat of another node)"
    ) in message
    message = denied(lambda: pod_a.patch_lease(own, {"holderIdentity": "pod-b"}))
    assert "pod pod-a may hold its heartbeat Lease only in its own name, not as pod-b" in message


def test_leases_of_pods_without_the_worker_role_are_not_concerned(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    """Another controller's leader election (a pod-bound token too) is left alone."""
    control_plane.kubectl("-n", namespace, "create", "serviceaccount", "elector")
    control_plane.kubectl(
        "-n",
        namespace,
        "create",
        "role",
        "leases",
        "--verb=create,get,update",
        "--resource=leases.coordination.k8s.io",
    )
    control_plane.kubectl(
        "-n",
        namespace,
        "create",
        "rolebinding",
        "leases",
        "--role=leases",
        f"--serviceaccount={namespace}:elector",
    )
    (pod,) = create_pods(admin_api, namespace, ["controller"], service_account="elector")
    token = control_plane.token_for(
        namespace, "elector", pod_name="controller", pod_uid=pod["metadata"]["uid"]
    )
    client = PodClient(control_plane.client_for_token(token), namespace, "controller")
    assert client.create_lease("some-controller-lock", "someone-else")


def test_every_status_field_but_nodes_is_guarded(helm: Helm) -> None:
    """The policy lists the operator's fields one by one (CEL cannot iterate an object's
    fields): a status field added to the CRD must be added to the policy too."""
    crd = yaml.safe_load(
        (REPO / "manifests" / "crds" / "k8s-rendezvous.dev_rendezvous.yaml").read_text()
    )
    (version,) = crd["spec"]["versions"]
    fields = set(version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"])
    policy = find(helm.template_objects(), "ValidatingAdmissionPolicy", "k8s-rendezvous-pod-status")
    guarded = {
        v["expression"].split("object.?status.?")[1].split()[0]
        for v in policy["spec"]["validations"]
        if v["expression"].startswith("object.?status.?")
    }
    assert guarded == fields - {"nodes"}
    assert CHART.is_dir()


def test_policies_type_check_cleanly(chart_release: Release, control_plane: ControlPlane) -> None:
    for name in ("k8s-rendezvous-pod-status", "k8s-rendezvous-pod-leases"):
        policy = json.loads(
            control_plane.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout
        )
        assert policy["status"].get("typeChecking", {}).get("expressionWarnings") is None, policy[
            "status"
        ]
