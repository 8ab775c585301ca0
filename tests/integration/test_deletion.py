"""A Rendezvous deleted under its nodes, against the real control plane and operator.

Aspects: an annotated Job's Rendezvous deleted while the Job runs is made anew by the
operator (an Event on the Job says so); a node that waited joins the new one's first
round, even when its request's Lease was collected with the old one; members of a sealed
round are told to rejoin and do; their Leases move to the new owner rather than being
collected with the old. A waiting node's Lease deleted under it is made anew, with its
request, by its next heartbeat. A Rendezvous nobody makes anew gives a waiting node,
within seconds rather than at its join timeout, an error that says it was deleted.
"""

from __future__ import annotations

from collections.abc import Callable

import kubernetes.client
import pytest
from tests.support.fixtures import Node, Rendezvous, join_all, wait_told_to_rejoin
from tests.support.jobs import job_events, make_job, running_pods

from devkit.waiting import wait_for
from k8s_rendezvous.errors import KubernetesRendezvousClosedError
from k8s_rendezvous.wire import leases, objects

pytestmark = pytest.mark.usefixtures("operator_process")

AttachNodes = Callable[..., list[Node]]


def _uid(rdzv: Rendezvous) -> str | None:
    try:
        return str(rdzv.body()["metadata"]["uid"])
    except kubernetes.client.exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise


def _delete(api: kubernetes.client.ApiClient, rdzv: Rendezvous) -> None:
    kubernetes.client.CustomObjectsApi(api).delete_namespaced_custom_object(
        objects.GROUP, objects.VERSION, rdzv.namespace, objects.PLURAL, rdzv.name
    )


def _delete_lease(api: kubernetes.client.ApiClient, rdzv: Rendezvous, node: str) -> None:
    kubernetes.client.CoordinationV1Api(api).delete_namespaced_lease(
        objects.lease_name(rdzv.name, node), rdzv.namespace
    )


def _lease_entry(api: kubernetes.client.ApiClient, rdzv: Rendezvous, node: str) -> str | None:
    try:
        lease = kubernetes.client.CoordinationV1Api(api).read_namespaced_lease(
            objects.lease_name(rdzv.name, node), rdzv.namespace
        )
    except kubernetes.client.exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise
    return (lease.metadata.annotations or {}).get(objects.ENTRY_ANNOTATION)


def _lease_owners(api: kubernetes.client.ApiClient, rdzv: Rendezvous) -> dict[str, set[str]]:
    found = kubernetes.client.CoordinationV1Api(api).list_namespaced_lease(
        rdzv.namespace, label_selector=f"{objects.NODE_LABEL}={rdzv.name}"
    )
    return {
        lease.spec.holder_identity: {owner.uid for owner in lease.metadata.owner_references or []}
        for lease in found.items
    }


def test_a_running_jobs_deleted_rendezvous_is_made_anew_and_its_nodes_join_it(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
) -> None:
    # Heartbeats 5 min apart: only the join itself can ask the new Rendezvous.
    annotations = {"k8s-rendezvous.dev/nodes": "2", "k8s-rendezvous.dev/heartbeat-timeout": "900"}
    make_job(admin_api, workers_namespace, "remade", 2, annotations)
    # No recorder: the history of two objects of one name is not one rendezvous'.
    rdzv = Rendezvous(admin_api, workers_namespace, "remade")
    first_uid = wait_for(lambda: _uid(rdzv), 30, "Rendezvous created for the Job")
    nodes = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "remade", 2))

    # A node waiting for its peer when the Rendezvous is deleted. Its request's Lease is
    # owned by the deleted one; garbage collection may take it before the node notices
    # the deletion, and here it is gone first for certain.
    waiting = nodes[0].join_in_background()
    rdzv.wait_requests(lambda requests: nodes[0].pod in requests, "the first node asked")
    _delete_lease(admin_api, rdzv, nodes[0].pod)
    _delete(admin_api, rdzv)
    second_uid = wait_for(
        lambda: (uid := _uid(rdzv)) != first_uid and uid, 30, "Rendezvous made anew"
    )
    later = nodes[1].join_in_background()
    infos = [waiting.wait(), later.wait()]
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {2}
    assert rdzv.status().round >= 1
    recreated = [
        (kind, message)
        for kind, reason, message in job_events(admin_api, workers_namespace, "remade")
        if reason == "RendezvousRecreated"
    ]
    assert recreated and recreated[0][0] == "Warning" and "made anew" in recreated[0][1]
    owners = _lease_owners(admin_api, rdzv)
    assert owners == {node.pod: {second_uid} for node in nodes}, owners

    # Members of a sealed round when it is deleted again: told to rejoin, and they do.
    _delete(admin_api, rdzv)
    third_uid = wait_for(
        lambda: (uid := _uid(rdzv)) not in (None, second_uid) and uid, 30, "made anew again"
    )
    wait_told_to_rejoin(nodes, "members of the deleted Rendezvous' round told to rejoin")
    infos = join_all(nodes)
    assert sorted(info.rank for info in infos) == [0, 1]
    wait_for(
        lambda: _lease_owners(admin_api, rdzv) == {node.pod: {third_uid} for node in nodes},
        10,
        "every Lease owned by the Rendezvous made anew",
    )


def test_a_waiting_nodes_lease_deleted_under_it_is_made_anew_with_its_request(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
) -> None:
    # The shortest heartbeat timeout: a renewal each second.
    annotations = {"k8s-rendezvous.dev/nodes": "2", "k8s-rendezvous.dev/heartbeat-timeout": "3"}
    make_job(admin_api, workers_namespace, "relet", 2, annotations)
    rdzv = Rendezvous(admin_api, workers_namespace, "relet")
    wait_for(lambda: _uid(rdzv), 30, "Rendezvous created for the Job")
    nodes = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "relet", 2))
    waiting = nodes[0].join_in_background()
    asked = rdzv.wait_requests(lambda requests: nodes[0].pod in requests, "the first node asked")

    _delete_lease(admin_api, rdzv, nodes[0].pod)
    wait_for(
        lambda: (
            (entry := _lease_entry(admin_api, rdzv, nodes[0].pod)) is not None
            and leases.NodeEntry.from_annotation(entry, "lease") == asked[nodes[0].pod]
        ),
        30,
        "the waiting node's Lease made anew by its heartbeat, with its request",
    )
    later = nodes[1].join_in_background()
    infos = [waiting.wait(), later.wait()]
    assert sorted(info.rank for info in infos) == [0, 1]


def test_a_waiting_node_is_told_that_its_rendezvous_was_deleted(
    admin_api: kubernetes.client.ApiClient,
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    # Made by hand: nobody makes it anew. The join timeout (10 min) is far off, so only
    # noticing the deletion can end the wait.
    made = make_rendezvous(2, 2, joinTimeoutSeconds=600)
    (node,) = make_nodes(made, 1, min_nodes=2, max_nodes=2)
    waiting = node.join_in_background()
    made.wait_requests(lambda requests: node.pod in requests, "the node asked")
    _delete(admin_api, made)
    with pytest.raises(KubernetesRendezvousClosedError, match="was deleted while node") as caught:
        waiting.wait(timeout=60)
    assert "was not made anew" in str(caught.value)
    assert node.handler.num_nodes_waiting() == 0
