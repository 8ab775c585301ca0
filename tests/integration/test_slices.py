"""A rendezvous above 100 nodes is published in RendezvousSlices, against the real control
plane: the operator writes each slice after the status, every member appears in exactly the
slice its pod name hashes to, with its rank, and each node watches only its own slice,
through the seal, a lost member and the re-formed round. Only the slices of pods that join
are made, however many maxNodes admits. Small rendezvous stay unsliced."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous, delete_pod

from devkit.cluster.controlplane import ControlPlane
from k8s_rendezvous.wire import objects, statuses

pytestmark = pytest.mark.usefixtures("operator_process")

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]


def slices_of(api: kubernetes.client.ApiClient, rdzv: Rendezvous) -> list[dict[str, Any]]:
    found = kubernetes.client.CustomObjectsApi(api).list_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        rdzv.namespace,
        objects.SLICE_PLURAL,
        label_selector=f"{objects.NODE_LABEL}={rdzv.name}",
    )
    return sorted(found["items"], key=lambda item: item["metadata"]["name"])


def assert_published(
    api: kubernetes.client.ApiClient, rdzv: Rendezvous, status: statuses.RendezvousStatus
) -> None:
    """The slices of the members' pods, and no other, hold the status' round, each member
    once, in the slice of its pod."""
    uid = rdzv.body()["metadata"]["uid"]
    pieces = {piece["status"]["slice"]: piece for piece in slices_of(api, rdzv)}
    assert set(pieces) == {
        objects.slice_index(member.node, status.slices) for member in status.members
    }
    ranks: dict[str, int] = {}
    for index, piece in pieces.items():
        assert piece["metadata"]["name"] == objects.slice_name(rdzv.name, index)
        assert objects.rendezvous_uid(piece) == uid, "the Rendezvous owns its slices"
        stored = piece["status"]
        assert (stored["roundKey"], stored["worldSize"], stored["slice"]) == (
            status.round_key,
            status.world_size,
            index,
        )
        for member in stored["members"]:
            assert objects.slice_index(member["node"], status.slices) == index
            ranks[member["node"]] = member["rank"]
    assert ranks == {member.node: rank for rank, member in enumerate(status.members)}


def test_a_large_rendezvous_seals_through_each_nodes_own_slice(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
    control_plane: ControlPlane,
) -> None:
    rdzv = make_rendezvous(12, 300, lastCallTimeoutSeconds=0)
    nodes = make_nodes(rdzv, 12)
    infos = fixtures.join_all(nodes)
    assert sorted(info.rank for info in infos) == list(range(12))
    assert {info.world_size for info in infos} == {12}
    status = rdzv.status()
    assert (status.state, status.round, status.slices) == (statuses.RoundState.SEALED, 1, 3)
    returned = {node.pod: info.rank for node, info in zip(nodes, infos, strict=True)}
    assert returned == {member.node: rank for rank, member in enumerate(status.members)}
    assert_published(admin_api, rdzv, status)
    # Written when the round began forming (or at once sealed) and at the seal: never per
    # join, though the twelve joins came one by one.
    generations = {
        p["metadata"]["name"]: p["metadata"]["generation"] for p in slices_of(admin_api, rdzv)
    }
    assert max(generations.values()) <= 2, generations
    fixtures.wait_watching_own_slice(nodes, rdzv.name, 3)
    table = control_plane.kubectl("get", "rdzvslice", "-n", rdzv.namespace).stdout
    assert all(name in table for name in generations) and "Sealed" in table


def test_a_lost_member_of_a_sliced_round_is_told_to_every_survivor_through_its_slice(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(6, 250, lastCallTimeoutSeconds=0)
    nodes = make_nodes(rdzv, 6)
    fixtures.join_all(nodes)
    assert rdzv.status().slices == 3
    # Fewer nodes will do from now on, and many more may come: the slices stay as they are
    # (a node's slice must not move under it).
    generation = rdzv.patch_spec({"minNodes": 5, "maxNodes": 1000})["metadata"]["generation"]
    rdzv.wait(lambda s: s.observed_generation == generation, "the new spec is observed")
    victim, survivors = nodes[0], nodes[1:]
    delete_pod(admin_api, rdzv.namespace, victim.pod)
    fixtures.wait_told_to_rejoin(survivors, "every survivor reads the loss in its slice")
    infos = fixtures.join_all(survivors)
    assert sorted(info.rank for info in infos) == list(range(5))
    status = rdzv.status()
    assert (status.round, status.world_size, status.slices) == (2, 5, 3)
    assert_published(admin_api, rdzv, status)
    fixtures.wait_watching_own_slice(survivors, rdzv.name, 3)


def test_a_rendezvous_admitting_a_hundred_thousand_nodes_makes_only_its_joiners_slices(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    """Any pod that may make a Rendezvous sets its maxNodes: 1,000 slices written for it
    with nobody joining would be the operator's cost of one create."""
    rdzv = make_rendezvous(2, 100_000, lastCallTimeoutSeconds=0)
    rdzv.wait(lambda s: s.slices == objects.MAX_SLICES, "the slice count is written")
    assert slices_of(admin_api, rdzv) == [], "no pod asked to join: no slice"
    nodes = make_nodes(rdzv, 2)
    infos = fixtures.join_all(nodes)
    assert sorted(info.rank for info in infos) == [0, 1]
    status = rdzv.status()
    assert_published(admin_api, rdzv, status)
    assert len(slices_of(admin_api, rdzv)) <= 2
    fixtures.wait_watching_own_slice(nodes, rdzv.name, objects.MAX_SLICES)


def test_a_rendezvous_of_at_most_a_hundred_nodes_has_no_slices(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(2, 100, lastCallTimeoutSeconds=0)
    nodes = make_nodes(rdzv, 2)
    fixtures.join_all(nodes)
    assert rdzv.status().slices == 0
    assert slices_of(admin_api, rdzv) == []
    for node in nodes:
        latest = node.handler.watcher.latest
        assert latest is not None and latest["kind"] == objects.KIND
