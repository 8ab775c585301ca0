"""The chart's worker ClusterRole, bound per namespace: a pod's real bound token works in
its own namespace and is refused (403) everywhere else."""

from __future__ import annotations

import json
from collections.abc import Callable

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support.fixtures import Rendezvous, create_pods
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from devkit.cluster.controlplane import ControlPlane
from k8s_rendezvous import kube
from k8s_rendezvous.wire import leases, objects

MERGE = "application/merge-patch+json"
ENTRY = {"instance": "i-1", "attempt": 1, "addr": "10.0.0.7", "storePort": 29500, "intent": "Join"}


def create_rendezvous(admin_api: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
    body = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"minNodes": 1, "maxNodes": 2, "runId": name},
    }
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP, objects.VERSION, namespace, objects.PLURAL, body
    )


def forbidden(call: Callable[[], object]) -> str:
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status == 403, error.value.body
    return str(json.loads(error.value.body)["message"])


def test_pod_token_works_in_its_namespace_and_is_refused_in_another(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_namespace: Callable[[], str],
    make_rendezvous: Callable[..., Rendezvous],
) -> None:
    home = make_rendezvous(1, 2)
    elsewhere = make_namespace()
    create_rendezvous(admin_api, elsewhere, "train")
    (pod,) = create_pods(admin_api, workers_namespace, ["worker-0"])
    token = control_plane.token_for(
        workers_namespace, "default", pod_name="worker-0", pod_uid=pod["metadata"]["uid"]
    )
    api = control_plane.client_for_token(token)
    custom = kubernetes.client.CustomObjectsApi(api)

    # Namespace A: what the handler does, through the handler's own client.
    client = kube.RendezvousClient(api, workers_namespace, home.name, retry_seconds=5)
    assert client.get()["metadata"]["name"] == home.name
    kind, item = next(client.watch_unless(None, None, timeout_seconds=10))
    assert (kind, item["metadata"]["name"]) == ("ADDED", home.name)
    uid = home.body()["metadata"]["uid"]
    client.write_lease("worker-0", "i-1", 30, uid, leases.NodeEntry("i-1", 1, "10.0.0.7", 29500))
    client.write_lease("worker-0", "i-1", 30, uid)  # a heartbeat: the patch path
    lease = kubernetes.client.CustomObjectsApi(admin_api).get_namespaced_custom_object(
        "coordination.k8s.io", "v1", workers_namespace, "leases", f"{home.name}.worker-0"
    )
    assert lease["metadata"]["annotations"][objects.POD_UID_ANNOTATION] == pod["metadata"]["uid"]

    # Namespace B: the same token, no binding there.
    user = f"system:serviceaccount:{workers_namespace}:default"
    message = forbidden(
        lambda: custom.get_namespaced_custom_object(
            objects.GROUP, objects.VERSION, elsewhere, objects.PLURAL, "train"
        )
    )
    assert f'User "{user}" cannot get resource "rendezvous"' in message
    assert f'in the namespace "{elsewhere}"' in message
    forbidden(
        lambda: custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            elsewhere,
            objects.PLURAL,
            "train",
            {"status": {"nodes": {"worker-0": ENTRY}}},
            _content_type=MERGE,
        )
    )
    forbidden(
        lambda: custom.list_namespaced_custom_object(
            objects.GROUP, objects.VERSION, elsewhere, objects.PLURAL
        )
    )
    # The pod side's watch says so in its own error, naming the role to bind.
    stranger = kube.RendezvousClient(api, elsewhere, "train", retry_seconds=5)
    with pytest.raises(RendezvousConnectionError, match="answered 403") as refused:
        next(stranger.watch_unless(None, None, timeout_seconds=10))
    assert 'cannot watch resource "rendezvous"' in str(refused.value)
    assert "bind the ClusterRole k8s-rendezvous-worker" in str(refused.value)
    sliced = objects.slice_name("train", 0)
    with pytest.raises(RendezvousConnectionError, match="rendezvousslices"):
        next(stranger.watch_unless(None, None, timeout_seconds=10, slice_name=sliced))
    forbidden(
        lambda: custom.create_namespaced_custom_object(
            "coordination.k8s.io",
            "v1",
            elsewhere,
            "leases",
            {"metadata": {"name": "train.worker-0"}, "spec": {"holderIdentity": "worker-0"}},
        )
    )
    # And in its own namespace, nothing beyond the role: it reads slices, never writes them
    # (the operator alone does); no status, spec edits or deletes of the Rendezvous.
    assert (
        custom.list_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.SLICE_PLURAL
        )["items"]
        == []
    )
    forbidden(
        lambda: custom.create_namespaced_custom_object(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.SLICE_PLURAL,
            {
                "apiVersion": objects.API_VERSION,
                "kind": objects.SLICE_KIND,
                "metadata": {"name": objects.slice_name(home.name, 0)},
                "spec": {},
                "status": {},
            },
        )
    )
    forbidden(
        lambda: custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.PLURAL,
            home.name,
            {"status": {"nodes": {"worker-0": ENTRY}}},
            _content_type=MERGE,
        )
    )
    forbidden(
        lambda: custom.patch_namespaced_custom_object(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.PLURAL,
            home.name,
            {"spec": {"maxNodes": 1}},
            _content_type=MERGE,
        )
    )
    forbidden(
        lambda: custom.delete_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, home.name
        )
    )
