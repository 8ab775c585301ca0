"""The chart's ValidatingAdmissionPolicy against the real API server, with real pod-bound
tokens: a pod may keep only its own Lease (its heartbeat and join request) and cannot take
over another node's; the Rendezvous status is not the pods' to write at all (RBAC); the
operator, admins and other controllers' Leases are left alone."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support.fixtures import Rendezvous, create_pods

from devkit import namespaces
from devkit.chart import Release
from devkit.cluster.controlplane import ControlPlane
from devkit.waiting import wait_for
from k8s_rendezvous.wire import leases, objects

pytestmark = pytest.mark.usefixtures("chart_release")

MERGE = "application/merge-patch+json"
ENTRY = leases.NodeEntry("i-1", 1, "10.0.0.7", 29500)
NO_SUCH_UID = "00000000-0000-4000-8000-000000000000"
"""The uid of no Rendezvous: a Lease owned by it is collected, once past admission."""


class PodClient:
    """Raw API calls authenticated as one pod (its bound token), or as an admin."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, uid: str = "") -> None:
        self.namespace = namespace
        self.uid = uid
        """The pod's uid, for a pod's client."""
        self.custom = kubernetes.client.CustomObjectsApi(api)

    def create_lease(
        self,
        name: str,
        holder: str,
        rendezvous: str | None,
        owner_uid: str = NO_SUCH_UID,
        owners: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Labelled for ``rendezvous``; a pod's is owned by it (of uid ``owner_uid``), as
        the handler makes it, unless ``owners`` says otherwise."""
        labels = {objects.NODE_LABEL: rendezvous} if rendezvous else {}
        if owners is None and rendezvous and self.uid:
            owners = [
                objects.owner_reference(
                    objects.API_VERSION, objects.KIND, rendezvous, owner_uid, controller=False
                )
            ]
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": {
                    objects.ENTRY_ANNOTATION: ENTRY.to_annotation(),
                    # As the handler marks every write, with the pod-bound token's pod uid.
                    **({objects.POD_UID_ANNOTATION: self.uid} if self.uid else {}),
                },
                **({"ownerReferences": owners} if owners else {}),
            },
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 30},
        }
        return self.custom.create_namespaced_custom_object(  # type: ignore[no-any-return]
            "coordination.k8s.io", "v1", self.namespace, "leases", body
        )

    def patch_lease(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(  # type: ignore[no-any-return]
            "coordination.k8s.io", "v1", self.namespace, "leases", name, patch, _content_type=MERGE
        )


def denied(call: Callable[[], object]) -> str:
    """The API server's message for a request that must be refused with 403."""
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status == 403, error.value.body
    return str(json.loads(error.value.body)["message"])


def leave(node: str) -> dict[str, Any]:
    """A patch that would withdraw ``node``'s join request."""
    entry = leases.NodeEntry(ENTRY.instance, 1, ENTRY.addr, 1, leases.NodeIntent.LEAVE)
    return {"metadata": {"annotations": {objects.ENTRY_ANNOTATION: entry.to_annotation()}}}


@pytest.fixture
def pod_a(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> PodClient:
    """pod-a's client, once the policy is enforced."""
    (pod,) = create_pods(admin_api, workers_namespace, ["pod-a"])
    token = control_plane.token_for(
        workers_namespace, "default", pod_name="pod-a", pod_uid=pod["metadata"]["uid"]
    )
    client = PodClient(
        control_plane.client_for_token(token), workers_namespace, pod["metadata"]["uid"]
    )
    wait_until_enforced(client, PodClient(admin_api, workers_namespace))
    return client


def wait_until_enforced(pod: PodClient, admin: PodClient, within: float = 60.0) -> None:
    """The API server applies a new policy once its admission plugin has seen the policy
    and its binding, a moment after `helm install --wait` returns: probe with a Lease in
    another pod's name until it is refused (removing each probe that got through)."""
    deadline = time.monotonic() + within
    while True:
        try:
            pod.create_lease("policy-probe.pod-z", "pod-z", "policy-probe")
        except ApiException as error:
            if error.status == 403:
                return
            raise
        try:
            admin.custom.delete_namespaced_custom_object(
                "coordination.k8s.io", "v1", admin.namespace, "leases", "policy-probe.pod-z"
            )
        except ApiException as error:
            # The garbage collector may be first: the probe's Rendezvous does not exist.
            if error.status != 404:
                raise
        assert time.monotonic() < deadline, f"the admission policy was not enforced in {within} s"
        time.sleep(0.2)  # polling interval while the plugin catches up, not a stand-in wait


@pytest.fixture
def rendezvous(
    make_rendezvous: Callable[..., Rendezvous], admin_api: kubernetes.client.ApiClient
) -> Rendezvous:
    """A Rendezvous with the Lease of another pod, pod-b, already there."""
    rdzv = make_rendezvous(2, 2)
    PodClient(admin_api, rdzv.namespace).create_lease(f"{rdzv.name}.pod-b", "pod-b", rdzv.name)
    return rdzv


def test_a_pod_keeps_its_own_lease(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    own = f"{rendezvous.name}.pod-a"
    made = pod_a.create_lease(own, "pod-a", rendezvous.name, rendezvous.body()["metadata"]["uid"])
    assert made["spec"]["holderIdentity"] == "pod-a"
    patched = pod_a.patch_lease(own, {"spec": {"renewTime": "2026-01-01T00:00:00.000000Z"}})
    assert patched["spec"]["renewTime"].startswith("2026-01-01")
    assert pod_a.patch_lease(own, leave("pod-a"))


def test_a_pod_marks_its_lease_only_with_its_own_uid(
    pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    own = f"{rendezvous.name}.pod-a"
    pod_a.create_lease(own, "pod-a", rendezvous.name, rendezvous.body()["metadata"]["uid"])

    def mark(uid: str) -> dict[str, Any]:
        return {"metadata": {"annotations": {objects.POD_UID_ANNOTATION: uid}}}

    assert pod_a.patch_lease(own, mark(pod_a.uid))
    message = denied(lambda: pod_a.patch_lease(own, mark("the-uid-of-a-pod-before")))
    assert (
        f"pod pod-a must mark its rendezvous Lease with its own uid ({pod_a.uid}), not "
        "k8s-rendezvous.dev/pod-uid: the-uid-of-a-pod-before: the operator counts a Lease only"
        " for the pod that wrote it"
    ) in message
    # Nor unmark it: the mark is what tells the operator which pod of that name wrote it.
    unmarked = {"metadata": {"annotations": {objects.POD_UID_ANNOTATION: None}}}
    message = denied(lambda: pod_a.patch_lease(own, unmarked))
    assert f"must mark its rendezvous Lease with its own uid ({pod_a.uid}), not" in message
    assert "k8s-rendezvous.dev/pod-uid: (none)" in message


def test_a_pod_writes_no_lease_for_a_rendezvous_name_with_a_dot(pod_a: PodClient) -> None:
    """``team.train.pod-a`` would read as pod ``pod-a`` of ``team.train`` and as pod
    ``train.pod-a`` of ``team``: no Rendezvous has a dot (the CRD), nor does a Lease's."""
    message = denied(lambda: pod_a.create_lease("team.train.pod-a", "pod-a", "team.train"))
    assert (
        "pod pod-a may write no Lease for rendezvous team.train: a Rendezvous name has no "
        "dots, so a Lease <rendezvous>.<pod> names one rendezvous and one pod"
    ) in message


def test_a_pod_cannot_speak_for_another_node(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    other = f"{rendezvous.name}.pod-b"
    expected = (
        f"pod pod-a may write only its own Lease, not {other}, held by pod-b "
        "(the heartbeat and join request of another node)"
    )
    assert expected in denied(lambda: pod_a.patch_lease(other, leave("pod-b")))
    # Dropping the label does not take the Lease out of the policy's sight.
    assert expected in denied(
        lambda: pod_a.patch_lease(other, {"metadata": {"labels": {objects.NODE_LABEL: None}}})
    )
    assert expected in denied(
        lambda: pod_a.patch_lease(other, {"spec": {"holderIdentity": "pod-a"}})
    )
    # Nor by creating a Lease in another node's name.
    message = denied(lambda: pod_a.create_lease(f"{rendezvous.name}.pod-c", "pod-c", "r"))
    assert "pod pod-a may hold a rendezvous Lease only in its own name, not as pod-c" in message
    message = denied(lambda: pod_a.patch_lease(other, {"spec": {"holderIdentity": "pod-c"}}))
    assert expected in message


def test_a_pod_cannot_squat_the_lease_another_pod_will_need(
    pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    """Held by itself but named after pod-c: pod-c could never write its own Lease."""
    squat = f"{rendezvous.name}.pod-c"
    message = denied(lambda: pod_a.create_lease(squat, "pod-a", rendezvous.name))
    assert (
        f"pod pod-a may write only the rendezvous Lease named after itself, "
        f"{rendezvous.name}.pod-a (<rendezvous>.<pod>), not {squat}"
    ) in message
    # Under another rendezvous' label, its own Lease is not its own name either.
    message = denied(lambda: pod_a.create_lease(f"{rendezvous.name}.pod-a", "pod-a", "other"))
    assert "named after itself, other.pod-a" in message


def test_a_pod_cannot_move_its_lease_to_another_rendezvous(
    pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    own = f"{rendezvous.name}.pod-a"
    pod_a.create_lease(own, "pod-a", rendezvous.name, rendezvous.body()["metadata"]["uid"])
    message = denied(
        lambda: pod_a.patch_lease(own, {"metadata": {"labels": {objects.NODE_LABEL: "other"}}})
    )
    assert f"named after itself, other.pod-a (<rendezvous>.<pod>), not {own}" in message


def test_a_pods_lease_has_its_rendezvous_as_its_one_owner(
    pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    """Without it, or with another owner besides, a Lease would outlive its Rendezvous."""
    own, uid = f"{rendezvous.name}.pod-a", rendezvous.body()["metadata"]["uid"]
    expected = (
        f"pod pod-a must make Rendezvous {rendezvous.name} the one owner of its Lease {own} "
        f"(an ownerReference of apiVersion {objects.API_VERSION} with its uid), so that the "
        "Lease goes with it"
    )
    assert expected in denied(lambda: pod_a.create_lease(own, "pod-a", rendezvous.name, owners=[]))
    theirs = objects.owner_reference(objects.API_VERSION, objects.KIND, rendezvous.name, uid)
    lasting = {"apiVersion": "v1", "kind": "ServiceAccount", "name": "default", "uid": uid}
    assert expected in denied(
        lambda: pod_a.create_lease(own, "pod-a", rendezvous.name, owners=[theirs, lasting])
    )
    another = objects.owner_reference(objects.API_VERSION, objects.KIND, "other", uid)
    assert expected in denied(
        lambda: pod_a.create_lease(own, "pod-a", rendezvous.name, owners=[another])
    )
    pod_a.create_lease(own, "pod-a", rendezvous.name, uid)
    assert expected in denied(
        lambda: pod_a.patch_lease(own, {"metadata": {"ownerReferences": [theirs, lasting]}})
    )


def test_a_pods_lease_is_owned_only_by_a_version_the_api_server_serves(
    pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    """Issue 55: the policy checked only the owner's API group, so a Lease owned by
    k8s-rendezvous.dev/v1 (a version the CRD does not serve) was admitted, and the garbage
    collector, which cannot look such an owner up, kept it for good (14 minutes and
    counting), as the pod may not delete it either."""
    own, uid = f"{rendezvous.name}.pod-a", rendezvous.body()["metadata"]["uid"]
    expected = f"(an ownerReference of apiVersion {objects.API_VERSION} with its uid)"
    for api_version in (f"{objects.GROUP}/v1", f"{objects.GROUP}/v1beta1"):
        unserved = objects.owner_reference(api_version, objects.KIND, rendezvous.name, uid)
        message = denied(
            lambda owner=unserved: pod_a.create_lease(own, "pod-a", rendezvous.name, owners=[owner])
        )
        assert expected in message, message
    pod_a.create_lease(own, "pod-a", rendezvous.name, uid)
    moved = objects.owner_reference(f"{objects.GROUP}/v1", objects.KIND, rendezvous.name, uid)
    assert expected in denied(
        lambda: pod_a.patch_lease(own, {"metadata": {"ownerReferences": [moved]}})
    )


def test_a_pod_puts_no_finalizer_on_its_lease_nor_on_a_rendezvous_it_makes(
    admin_api: kubernetes.client.ApiClient, pod_a: PodClient, rendezvous: Rendezvous
) -> None:
    """Found with issue 55: a finalizer kept a pod's Lease after the garbage collector
    deleted it, and a pod-made Rendezvous after the operator deleted it to give its name
    to an annotated Job or to the workload it is named after: held for good."""
    own, uid = f"{rendezvous.name}.pod-a", rendezvous.body()["metadata"]["uid"]
    owner = objects.owner_reference(objects.API_VERSION, objects.KIND, rendezvous.name, uid)
    held = {"metadata": {"finalizers": ["example.com/hold"]}}
    message = denied(
        lambda: pod_a.custom.create_namespaced_custom_object(
            "coordination.k8s.io",
            "v1",
            pod_a.namespace,
            "leases",
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": own,
                    "labels": {objects.NODE_LABEL: rendezvous.name},
                    "annotations": {objects.POD_UID_ANNOTATION: pod_a.uid},
                    "ownerReferences": [owner],
                    "finalizers": held["metadata"]["finalizers"],
                },
                "spec": {"holderIdentity": "pod-a"},
            },
        )
    )
    assert f"pod pod-a may put no finalizer on its Lease {own}" in message, message
    pod_a.create_lease(own, "pod-a", rendezvous.name, uid)
    assert "may put no finalizer" in denied(lambda: pod_a.patch_lease(own, held))

    namespaces.bind_creator_role(admin_api, pod_a.namespace)
    body = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {
            "name": "held",
            "annotations": {objects.CREATED_BY_ANNOTATION: "pod-a"},
            **held["metadata"],
        },
        "spec": {"minNodes": 1, "maxNodes": 1, "runId": "held"},
    }
    message = denied(
        lambda: pod_a.custom.create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, pod_a.namespace, objects.PLURAL, body
        )
    )
    assert "pod pod-a may put no finalizer on Rendezvous held" in message, message


def test_a_pods_lease_for_a_rendezvous_that_does_not_exist_is_collected(
    pod_a: PodClient, rendezvous: Rendezvous, admin_api: kubernetes.client.ApiClient
) -> None:
    """A pod used to leave Leases for made-up rendezvous (2,000 kept for good): owned by a
    Rendezvous that is not there, under that name or that uid, the garbage collector takes
    them."""
    made_up = pod_a.create_lease("made-up.pod-a", "pod-a", "made-up")
    not_that_one = pod_a.create_lease(f"{rendezvous.name}.pod-a", "pod-a", rendezvous.name)
    coordination = PodClient(admin_api, rendezvous.namespace).custom

    def collected() -> bool:
        listed = coordination.list_namespaced_custom_object(
            "coordination.k8s.io", "v1", rendezvous.namespace, "leases"
        )
        remaining = {item["metadata"]["name"] for item in listed["items"]}
        return not remaining & {made_up["metadata"]["name"], not_that_one["metadata"]["name"]}

    wait_for(collected, 60, "the garbage collector takes both Leases")


def test_the_long_form_of_a_lease_name_is_the_pods_own_only(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    pod_a: PodClient,
) -> None:
    long_pod = "p" * 250
    (pod,) = create_pods(admin_api, workers_namespace, [long_pod])
    token = control_plane.token_for(
        workers_namespace, "default", pod_name=long_pod, pod_uid=pod["metadata"]["uid"]
    )
    client = PodClient(
        control_plane.client_for_token(token), workers_namespace, pod["metadata"]["uid"]
    )
    own = objects.lease_name("train", long_pod)
    assert own != f"train.{long_pod}", "shortened"
    assert client.create_lease(own, long_pod, "train")["metadata"]["name"] == own
    # pod-a cannot take that name, even holding it itself.
    message = denied(
        lambda: pod_a.create_lease(objects.lease_name("train", "q" * 250), "pod-a", "train")
    )
    assert "named after itself, train.pod-a" in message


def test_the_worker_role_writes_no_lease_outside_the_rendezvous_scheme(
    pod_a: PodClient, admin_api: kubernetes.client.ApiClient
) -> None:
    """Not another controller's leader election Lease, nor any unlabelled one: neither a
    new one nor one that controller already holds."""
    message = denied(lambda: pod_a.create_lease("some-controller-lock", "pod-a", rendezvous=None))
    assert (
        "pod pod-a writes Leases through the k8s-rendezvous worker role, which covers only its"
        " own rendezvous Lease"
    ) in message
    assert "not Lease some-controller-lock" in message
    PodClient(admin_api, pod_a.namespace).create_lease("held-lock", "controller-0", None)
    taken = {"spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 3600}}
    message = denied(lambda: pod_a.patch_lease("held-lock", taken))
    assert "not Lease held-lock" in message
    held = PodClient(admin_api, pod_a.namespace).custom.get_namespaced_custom_object(
        "coordination.k8s.io", "v1", pod_a.namespace, "leases", "held-lock"
    )
    assert held["spec"]["holderIdentity"] == "controller-0"


def test_the_status_is_not_the_pods_to_write(pod_a: PodClient, rendezvous: Rendezvous) -> None:
    message = denied(
        lambda: pod_a.custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            rendezvous.namespace,
            objects.PLURAL,
            rendezvous.name,
            {"status": {"nodes": {"pod-a": ENTRY.to_dict()}}},
            _content_type=MERGE,
        )
    )
    assert 'cannot patch resource "rendezvous/status"' in message


def test_a_pod_makes_a_rendezvous_only_in_its_own_name_and_names_no_owner(
    admin_api: kubernetes.client.ApiClient, pod_a: PodClient
) -> None:
    """With the creator role, a pod makes a missing Rendezvous saying only that it made it:
    naming an owner (another workload, whose pods would run under the spec it chose), or
    a selector that admits another workload's pods, is refused."""
    namespaces.bind_creator_role(admin_api, pod_a.namespace)

    def create(name: str, creator: str, **extra: Any) -> object:
        spec = {"minNodes": 1, "maxNodes": 2, "runId": name, **extra.pop("spec", {})}
        metadata = {"name": name, "annotations": {objects.CREATED_BY_ANNOTATION: creator}, **extra}
        body = {"apiVersion": objects.API_VERSION, "kind": objects.KIND, "metadata": metadata}
        return pod_a.custom.create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, pod_a.namespace, objects.PLURAL, {**body, "spec": spec}
        )

    message = denied(lambda: create("as-b", "pod-b"))
    assert (
        "pod pod-a may create Rendezvous as-b only as made by itself (annotation "
        "k8s-rendezvous.dev/created-by-pod: pod-a)"
    ) in message
    owner = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "victim", "uid": "u-1"}
    message = denied(lambda: create("owned", "pod-a", ownerReferences=[owner]))
    assert "pod pod-a may not set the owner of Rendezvous owned: the operator makes" in message
    selector = {"podSelector": {"matchLabels": {"app": "victim"}}}
    message = denied(lambda: create("selecting", "pod-a", spec=selector))
    assert "pod pod-a may not set spec.podSelector of Rendezvous selecting" in message
    assert create("its-own", "pod-a")


def test_the_operator_and_admins_are_not_concerned(
    rendezvous: Rendezvous, admin_api: kubernetes.client.ApiClient
) -> None:
    admin = PodClient(admin_api, rendezvous.namespace)
    other = f"{rendezvous.name}.pod-b"
    assert admin.patch_lease(other, {"spec": {"holderIdentity": "anyone"}})
    assert admin.create_lease(f"{rendezvous.name}.pod-z", "pod-y", rendezvous.name)


def test_leases_without_the_rendezvous_label_are_not_concerned(
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
    client = PodClient(control_plane.client_for_token(token), namespace, pod["metadata"]["uid"])
    assert client.create_lease("some-controller-lock", "someone-else", rendezvous=None)
    # Also when that controller's pods may use the rendezvous too: it updates Leases.
    control_plane.kubectl(
        "-n",
        namespace,
        "create",
        "rolebinding",
        "elector-worker",
        "--clusterrole=k8s-rendezvous-worker",
        f"--serviceaccount={namespace}:elector",
    )
    assert client.create_lease("another-controller-lock", "someone-else", rendezvous=None)


@pytest.mark.parametrize(
    "name",
    [
        "k8s-rendezvous-pod-leases",
        "k8s-rendezvous-worker-leases",
        "k8s-rendezvous-operator-writes",
        "k8s-rendezvous-pod-rendezvous",
    ],
)
def test_the_policy_type_checks_cleanly(
    chart_release: Release, control_plane: ControlPlane, name: str
) -> None:
    policy = json.loads(
        control_plane.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout
    )
    assert policy["status"].get("typeChecking", {}).get("expressionWarnings") is None, policy[
        "status"
    ]
