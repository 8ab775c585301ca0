"""Bad Kubernetes nodes kept out (``status.excludedNodes``), without any I/O.

Aspects: a member lost to a failure records its pod's Kubernetes node, a planned removal
does not; the list is bounded by count (oldest go) and by age; the user's clear
annotation forgets what failed before it; the node comes from the Pod object; the wire
format round-trips; and the webhook's node affinity keeps pods off the excluded nodes,
merged into the affinity a pod already has.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest
from tests.unit.test_rounds import T0, World, reseal, spec

from k8s_rendezvous.wire import leases, objects, statuses
from k8s_rendezvous.wire.records import ExcludedNode
from k8s_rendezvous.wire.specs import RendezvousSpec
from k8s_rendezvous.wire.statuses import RendezvousStatus
from k8s_rendezvous_operator import injection, observe, reasons, rounds


def sealed_world(*nodes: str) -> World:
    """A sealed round whose pods ran on Kubernetes nodes ``node-<pod>``."""
    world = World(spec(1, 20))
    reseal(world, *nodes)
    for node in nodes:
        world.pods[node] = rounds.PodObservation(kube_node=f"node-{node}")
    return world


def fail(world: World, pod: str, reason: str) -> None:
    world.pods[pod] = dataclasses.replace(world.pods[pod], gone_reason=reason)


@pytest.mark.parametrize("reason", sorted(rounds.KEEPS_NODE_OUT))
def test_a_member_lost_to_a_failure_keeps_its_kubernetes_node_out(reason: str) -> None:
    world = sealed_world("a", "b")
    world.tick(5)
    fail(world, "b", reason)
    decision = world.decide()
    assert decision.write
    assert world.status.excluded_nodes == (ExcludedNode("node-b", reason, "b", world.now),)


@pytest.mark.parametrize(
    "reason",
    [reasons.LOST_POD_DELETED, reasons.LOST_POD_TERMINATING, reasons.LOST_ENTRY_REMOVED],
)
def test_a_planned_removal_keeps_no_node_out(reason: str) -> None:
    world = sealed_world("a", "b")
    if reason == reasons.LOST_ENTRY_REMOVED:
        del world.requests["b"]
    else:
        fail(world, "b", reason)
    world.decide()
    assert world.status.state is statuses.RoundState.REFORMING
    assert world.status.excluded_nodes == ()


def test_leaving_or_an_agent_restart_keeps_no_node_out() -> None:
    world = sealed_world("a", "b")
    world.leave("a")
    world.restart_agent("b")
    world.decide()
    assert world.status.round == 2, "both losses were counted"
    assert world.status.history[-1].cause == reasons.LOST_LEFT
    assert world.status.excluded_nodes == ()


def test_a_member_whose_health_check_failed_before_its_next_join_keeps_its_node_out() -> None:
    world = sealed_world("a", "b")
    report = leases.HealthCheckReport(leases.HealthCheckOutcome.FAILED, 0.5, 3, "port error\n")
    leave = dataclasses.replace(
        world.requests["b"], intent=leases.NodeIntent.LEAVE, health_check=report
    )
    world.write("b", leave)
    world.decide()
    assert world.status.forming_cause == reasons.LOST_HEALTH_CHECK_FAILED
    assert world.status.restarts == 1, "a failed check is a failure, not a planned leave"
    assert world.status.excluded_nodes == (
        ExcludedNode("node-b", reasons.LOST_HEALTH_CHECK_FAILED, "b", world.now),
    )


def test_a_failed_pod_never_seen_scheduled_names_no_node() -> None:
    world = World(spec(1, 3))
    reseal(world, "a", "b")
    world.kill("b", reasons.LOST_POD_FAILED)  # observed without spec.nodeName
    world.decide()
    assert world.status.excluded_nodes == ()


def test_the_list_keeps_the_newest_failures_and_one_entry_per_node() -> None:
    pods = [f"p{index}" for index in range(statuses.MAX_EXCLUDED_NODES + 3)]
    excluded: tuple[ExcludedNode, ...] = ()
    for minute, pod in enumerate(pods):
        loss = rounds.MemberLoss(pod, 0, reasons.LOST_POD_FAILED)
        observed = {pod: rounds.PodObservation(kube_node=f"node-{pod}")}
        moment = T0 + datetime.timedelta(minutes=minute)
        excluded = rounds.excluded_after([loss], observed, excluded, moment)
    assert [entry.node for entry in excluded] == [f"node-{pod}" for pod in pods[3:]]
    again = rounds.MemberLoss("q", 1, reasons.LOST_HEARTBEAT_EXPIRED)
    later = T0 + datetime.timedelta(hours=1)
    excluded = rounds.excluded_after(
        [again], {"q": rounds.PodObservation(kube_node="node-p5")}, excluded, later
    )
    assert len(excluded) == statuses.MAX_EXCLUDED_NODES
    assert [e.node for e in excluded].count("node-p5") == 1
    assert excluded[-1] == ExcludedNode("node-p5", reasons.LOST_HEARTBEAT_EXPIRED, "q", later)


def test_entries_older_than_the_age_bound_are_dropped() -> None:
    world = sealed_world("a", "b", "c")
    fail(world, "c", reasons.LOST_POD_FAILED)
    world.decide()
    reseal(world, "a", "b")
    world.tick(statuses.EXCLUDED_NODE_TTL.total_seconds() - 1)
    assert world.decide().status.excluded_nodes != ()
    world.tick(1)
    decision = world.decide()
    assert decision.status.excluded_nodes == ()
    assert decision.write, "the expiry is written"


def test_the_clear_annotation_forgets_what_failed_at_or_before_it() -> None:
    world = sealed_world("a", "b", "c")
    fail(world, "c", reasons.LOST_POD_FAILED)
    world.decide()
    failed_at = world.now
    reseal(world, "a", "b")
    world.pods["b"] = rounds.PodObservation(kube_node="node-b")
    world.tick(60)
    fail(world, "b", reasons.LOST_CONTAINER_RESTARTED)
    world.decide()
    assert [e.node for e in world.status.excluded_nodes] == ["node-c", "node-b"]
    decision = world.decide(exclusions_cleared_at=failed_at)
    assert [e.node for e in decision.status.excluded_nodes] == ["node-b"]
    assert decision.write


def test_the_kubernetes_node_is_the_pods_spec_node_name() -> None:
    body: dict[str, Any] = {
        "metadata": {"name": "p", "uid": "u"},
        "spec": {"nodeName": "worker-3"},
        "status": {"phase": "Failed"},
    }
    observed = observe.observe_pod(body)
    assert (observed.gone_reason, observed.kube_node) == (reasons.LOST_POD_FAILED, "worker-3")
    assert observe.observe_pod({"metadata": {"name": "p"}}).kube_node is None


def test_excluded_nodes_round_trip_and_are_bounded_when_read() -> None:
    entries = tuple(
        ExcludedNode(f"n{i}", reasons.LOST_POD_FAILED, f"p{i}", T0)
        for i in range(statuses.MAX_EXCLUDED_NODES + 2)
    )
    wire = dataclasses.replace(RendezvousStatus(), excluded_nodes=entries).to_dict()
    assert wire["excludedNodes"][0] == {
        "node": "n0",
        "reason": "PodFailed",
        "pod": "p0",
        "failedAt": "2026-01-01T00:00:00.000000Z",
    }
    read = RendezvousStatus.from_dict(wire).excluded_nodes
    assert read == entries[-statuses.MAX_EXCLUDED_NODES :]


def test_the_webhook_view_skips_expired_and_cleared_entries_and_unreadable_status() -> None:
    old = ExcludedNode("old", reasons.LOST_POD_FAILED, "p", T0)
    new = ExcludedNode("new", reasons.LOST_POD_FAILED, "p", T0 + datetime.timedelta(hours=2))
    body: dict[str, Any] = {"status": {"excludedNodes": [old.to_dict(), new.to_dict()]}}
    assert observe.excluded_kube_nodes(body, T0 + datetime.timedelta(hours=3)) == ("old", "new")
    assert observe.excluded_kube_nodes(body, T0 + datetime.timedelta(hours=25)) == ("new",)
    cleared = {
        **body,
        "metadata": {
            "annotations": {objects.CLEAR_EXCLUDED_NODES_ANNOTATION: "2026-01-01T01:00:00Z"}
        },
    }
    assert observe.excluded_kube_nodes(cleared, T0 + datetime.timedelta(hours=3)) == ("new",)
    assert observe.excluded_kube_nodes({"status": {"excludedNodes": [{"node": 1}]}}, T0) == ()


def pod_with(affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {"containers": [{"name": "trainer"}]}
    if affinity is not None:
        pod_spec["affinity"] = affinity
    return {"metadata": {"name": "p"}, "spec": pod_spec}


KEEP_OUT = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["x", "y"]}
PREFER_OTHERS = {"weight": 100, "preference": {"matchExpressions": [KEEP_OUT]}}


def test_injection_adds_no_affinity_when_no_node_is_excluded() -> None:
    patch = injection.inject(pod_with(), "job", RendezvousSpec(1, 2, "run"))
    assert "affinity" not in patch["spec"]


def test_injection_prefers_any_node_but_the_excluded_ones_and_requires_nothing() -> None:
    patch = injection.inject(pod_with(), "job", RendezvousSpec(1, 2, "run"), ["y", "x", "y"])
    node_affinity = patch["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity == {"preferredDuringSchedulingIgnoredDuringExecution": [PREFER_OTHERS]}


def test_the_pods_own_affinities_are_kept_beside_the_preference() -> None:
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    gpu = {"key": "gpu", "operator": "Exists"}
    required = {"nodeSelectorTerms": [{"matchExpressions": [zone]}]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [gpu]}}]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": required,
            "preferredDuringSchedulingIgnoredDuringExecution": preferred,
        },
        "podAntiAffinity": {"anything": "kept"},
    }
    merged = injection.keep_off(pod_with(affinity), ["x", "y"])
    assert merged["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == required
    assert merged["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        *preferred,
        PREFER_OTHERS,
    ]
    assert merged["podAntiAffinity"] == {"anything": "kept"}
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 1, "preference": {"matchExpressions": [gpu]}}
    ], "the pod's own body is not changed"


def test_the_webhook_keeps_pods_off_a_failed_members_node_before_the_status_says_so() -> None:
    members = [{"node": "a", "rank": 0}, {"node": "b", "rank": 1}]
    body: dict[str, Any] = {"status": {"members": members}}
    pods = {
        "a": rounds.PodObservation(reasons.LOST_POD_DELETED, kube_node="drained"),
        "b": rounds.PodObservation(reasons.LOST_POD_FAILED, kube_node="bad"),
        "waiter": rounds.PodObservation(reasons.LOST_POD_FAILED, kube_node="not-a-member"),
    }
    assert observe.excluded_kube_nodes(body, T0, pods) == ("bad",)
    recorded = ExcludedNode("bad", reasons.LOST_POD_FAILED, "b", T0)
    body["status"]["excludedNodes"] = [recorded.to_dict()]
    assert observe.excluded_kube_nodes(body, T0, pods) == ("bad",), "named once"
