"""The Leases of gone pods collected, against the real control plane and operator.

Aspects: a deleted member's Lease stays while the round that lost it is re-forming (its
loss is the round's to handle) and goes once the next round is sealed, the survivors'
staying; a waiting node's Lease goes with its pod, and the Lease a pod made anew under
that name writes is kept (checked against the Pod read after it); a Lease whose pod went
while the operator was down goes at its start; and the delete's preconditions refuse a
Lease rewritten, or made anew, since it was read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import (
    Node,
    Rendezvous,
    create_pods,
    delete_pod,
    join_all,
    wait_told_to_rejoin,
)

from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import kube as pod_kube
from k8s_rendezvous.wire import leases, objects, statuses
from k8s_rendezvous_operator import kube, reasons

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]
AttachNodes = Callable[..., list[Node]]
POD_GOING = (reasons.LOST_POD_DELETED, reasons.LOST_POD_TERMINATING)


def _leases(api: kubernetes.client.ApiClient, rdzv: Rendezvous) -> dict[str, Any]:
    """The Rendezvous' Leases, by holder."""
    found = kubernetes.client.CoordinationV1Api(api).list_namespaced_lease(
        rdzv.namespace, label_selector=f"{objects.NODE_LABEL}={rdzv.name}"
    )
    return {lease.spec.holder_identity: lease for lease in found.items}


def _ask(node: Node, rdzv: Rendezvous) -> None:
    """Write ``node``'s join request in its Lease with its own pod-bound token, as its
    agent does, without waiting for a round."""
    client = pod_kube.RendezvousClient(node.api, rdzv.namespace, rdzv.name, retry_seconds=5)
    request = leases.NodeEntry(f"i-{node.pod}", 1, node.addr, 29500)
    owner = rdzv.body()["metadata"]["uid"]
    client.write_lease(node.pod, request.instance, 30, owner, entry=request)


@pytest.mark.usefixtures("operator_process")
def test_a_deleted_members_lease_stays_while_its_round_reforms_and_goes_after(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(2, 3)
    nodes = make_nodes(rdzv, 3)
    join_all(nodes)
    victim, survivors = nodes[2], nodes[:2]
    delete_pod(admin_api, rdzv.namespace, victim.pod)
    wait_told_to_rejoin(survivors, "survivors told to re-rendezvous")
    status = rdzv.status()
    assert status.state is statuses.RoundState.REFORMING
    assert victim.pod in {member.node for member in status.members}
    assert victim.pod in _leases(admin_api, rdzv), "a member's Lease, its loss not yet sealed"

    assert [info.world_size for info in join_all(survivors)] == [2, 2]
    wait_for(
        lambda: set(_leases(admin_api, rdzv)) == {node.pod for node in survivors},
        15,
        "the deleted member's Lease collected once round 2 is sealed, the survivors' kept",
    )
    # Lost as its pod, not as its request removed: the sweep did not race the round.
    (lost,) = [message for _, reason, message in rdzv.events() if reason == "MemberLost"]
    assert victim.pod in lost and lost.endswith(POD_GOING), lost


def test_the_lease_a_pod_made_anew_under_the_name_writes_is_kept(
    operator_process: OperatorProcess,
    make_rendezvous: MakeRendezvous,
    attach_nodes: AttachNodes,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    """The old pod's Lease goes with it; the new pod's, whose pod the watches saw deleted
    under that name, is checked against the Pod as read now, and stays."""
    rdzv = make_rendezvous(2, 2)
    name = "again-0"
    lease_name = objects.lease_name(rdzv.name, name)
    (old,) = attach_nodes(rdzv, create_pods(admin_api, workers_namespace, [name]))
    _ask(old, rdzv)
    rdzv.wait_requests(lambda requests: name in requests, "the first pod asked")
    delete_pod(admin_api, workers_namespace, name)
    wait_for(lambda: name not in _leases(admin_api, rdzv), 15, "the deleted pod's Lease collected")

    (pod,) = create_pods(admin_api, workers_namespace, [name])
    (new,) = attach_nodes(rdzv, [pod])
    _ask(new, rdzv)
    written = _leases(admin_api, rdzv)[name]
    assert written.metadata.annotations[objects.POD_UID_ANNOTATION] == pod["metadata"]["uid"]
    wait_for(
        lambda: f"Lease {workers_namespace}/{lease_name} kept" in operator_process.log(),
        15,
        "the operator checked the new pod's Lease",
    )
    assert _leases(admin_api, rdzv)[name].metadata.uid == written.metadata.uid


def test_a_lease_whose_pod_went_while_the_operator_was_down_goes_at_its_start(
    operator_process: OperatorProcess,
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(3, 3)
    kept, gone = make_nodes(rdzv, 2)
    for node in (kept, gone):
        _ask(node, rdzv)
    rdzv.wait_requests(lambda requests: len(requests) == 2, "both pods asked")
    operator_process.stop()
    delete_pod(admin_api, rdzv.namespace, gone.pod)
    operator_process.start()
    wait_for(
        lambda: set(_leases(admin_api, rdzv)) == {kept.pod},
        15,
        "the Lease of the pod deleted meanwhile collected at start, the other kept",
    )


def test_a_lease_rewritten_or_made_anew_since_it_was_read_is_not_deleted(
    admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    coordination = kubernetes.client.CoordinationV1Api(admin_api)
    api = kube.OperatorApi(admin_api)
    name = "r.p-0"
    body = {"metadata": {"name": name, "labels": {objects.NODE_LABEL: "r"}}, "spec": {}}

    read = coordination.create_namespaced_lease(namespace, body).metadata
    coordination.patch_namespaced_lease(name, namespace, {"spec": {"holderIdentity": "p-0"}})
    with pytest.raises(kube.Conflict):
        api.delete_lease(namespace, name, read.uid, read.resource_version)

    coordination.delete_namespaced_lease(name, namespace)
    made_anew = coordination.create_namespaced_lease(namespace, body).metadata
    with pytest.raises(kube.Conflict):
        api.delete_lease(namespace, name, read.uid, made_anew.resource_version)
    assert coordination.read_namespaced_lease(name, namespace).metadata.uid == made_anew.uid

    api.delete_lease(namespace, name, made_anew.uid, made_anew.resource_version)
    with pytest.raises(kube.NotFound):
        api.delete_lease(namespace, name, made_anew.uid, made_anew.resource_version)
