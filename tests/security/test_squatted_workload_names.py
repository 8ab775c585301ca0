"""Squatting a workload's Rendezvous name, with real pod tokens against the real operator:
a pod with the creator role makes the Rendezvous a StatefulSet's pods will need before
that StatefulSet exists. The name is the StatefulSet's whatever came first (as an
annotated Job's is its Job's, tests/security/test_trust_boundaries.py): the operator
gives it back, its pods form their round, and both workloads are told who did what."""

from __future__ import annotations

from collections.abc import Callable

import kubernetes.client
import pytest
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous, join_all

from devkit import namespaces
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects

pytestmark = pytest.mark.usefixtures("operator_process")


def warnings_on(
    api: kubernetes.client.ApiClient, namespace: str, kind: str, name: str, reason: str
) -> list[str]:
    found = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={kind}"
    )
    return [e.message for e in found.items if e.type == "Warning" and e.reason == reason]


def test_a_pod_made_rendezvous_under_a_statefulsets_name_is_given_back_to_it(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Issue 55: the operator gave Rendezvous sts-victim to the squatter's StatefulSet, and
    sts-victim's pods were refused for good (NodeRefused: controlled by
    StatefulSet/sts-victim, not by StatefulSet/squatter)."""
    ns = workers_namespace
    namespaces.bind_creator_role(admin_api, ns)
    squatter_uid, (squatter_pod,) = fixtures.statefulset_pods(admin_api, ns, "squatter", 1)
    rdzv = Rendezvous(admin_api, ns, "sts-victim")
    (squatter,) = attach_nodes(rdzv, [squatter_pod])
    (alone,) = join_all([squatter])  # its pod makes sts-victim, owned by squatter once sealed
    assert alone.world_size == 1
    squatted = rdzv.body()
    assert [o["uid"] for o in squatted["metadata"]["ownerReferences"]] == [squatter_uid]

    victim_uid, victim_pods = fixtures.statefulset_pods(admin_api, ns, "sts-victim", 2)
    victims = attach_nodes(rdzv, victim_pods, min_nodes=2, max_nodes=2)
    infos = join_all(victims)
    assert sorted(info.rank for info in infos) == [0, 1]
    given_back = rdzv.body()
    assert given_back["metadata"]["uid"] != squatted["metadata"]["uid"]
    assert [o["uid"] for o in given_back["metadata"]["ownerReferences"]] == [victim_uid]
    assert given_back["metadata"]["annotations"][objects.CREATED_BY_ANNOTATION] in {
        pod["metadata"]["name"] for pod in victim_pods
    }
    assert sorted(m.node for m in rdzv.status().members) == sorted(n.pod for n in victims)

    (on_victim,) = wait_for(
        lambda: (
            warnings_on(admin_api, ns, "StatefulSet", "sts-victim", "RendezvousReplaced") or None
        ),
        30,
        "RendezvousReplaced on StatefulSet sts-victim",
    )
    assert on_victim == (
        "Rendezvous sts-victim had been made by pod squatter-0 (of StatefulSet/squatter), "
        "not by a pod of StatefulSet/sts-victim, whose pods asked to join it. A Rendezvous "
        "named after a workload of its namespace is that workload's, whatever made it first, "
        "so the operator deleted that one, and the pods of StatefulSet/sts-victim make it "
        "anew (their creator role). If StatefulSet/squatter uses rendezvous sts-victim on "
        "purpose, its pods are now refused at their join: rename one of the two (that "
        "workload's --rdzv-endpoint, or this one)."
    )
    (on_squatter,) = wait_for(
        lambda: warnings_on(admin_api, ns, "StatefulSet", "squatter", "RendezvousReplaced") or None,
        30,
        "RendezvousReplaced on StatefulSet squatter",
    )
    assert on_squatter == (
        "Rendezvous sts-victim, made by pod squatter-0 (of StatefulSet/squatter), was deleted "
        "by the k8s-rendezvous operator: it is named after StatefulSet/sts-victim of this "
        "namespace, whose pods asked to join it, and a Rendezvous named after a workload is "
        "that workload's. The pods of StatefulSet/squatter are refused from Rendezvous "
        "sts-victim from now on: give their torchrun another --rdzv-endpoint."
    )
    refused = [m for _, reason, m in rdzv.events() if reason == "NodeRefused"]
    assert not any("sts-victim-" in message for message in refused), refused
