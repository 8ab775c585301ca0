"""The rendezvous protocol against the real control plane: real operator process, real
pods on kwok nodes, handlers authenticated with their own pod-bound tokens.

Aspects: the CRD's validation; a round seals with unique dense ranks and the master of
rank 0; many nodes joining concurrently; a waiting node hears nothing of other joins (the
server-side filter); pod deletion and rank-0 loss re-form the world with a new master;
scale-up is signalled through num_nodes_waiting(); nodes beyond maxNodes wait; closing;
one node leaving does not close; join timeout; an operator restarted mid-join; a pod
without the worker role gets an error that names the fix.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous, create_pods, delete_pod, operator_metrics

# Exported at run time, missing from torch's type stubs.
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import kube
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, objects, statuses, tunables

pytestmark = pytest.mark.usefixtures("operator_process")

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]


def join_all(nodes: list[Node]) -> list[tuple[int, int, str, int]]:
    """All nodes call next_rendezvous() concurrently; (rank, world, master addr, port)."""
    return [
        (
            i.rank,
            i.world_size,
            i.bootstrap_store_info.master_addr,
            i.bootstrap_store_info.master_port,
        )
        for i in fixtures.join_all(nodes)
    ]


def test_crd_rejects_min_above_max_with_the_rules_message(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    body = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": "bad"},
        "spec": {"minNodes": 3, "maxNodes": 2, "runId": "r"},
    }
    with pytest.raises(ApiException) as error:
        kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, body
        )
    assert error.value.status == 422
    assert "minNodes must be less than or equal to maxNodes" in str(error.value.body)


def test_run_id_is_immutable(make_rendezvous: MakeRendezvous) -> None:
    rdzv = make_rendezvous(1, 1)
    with pytest.raises(ApiException) as error:
        rdzv.patch_spec({"runId": "other"})
    assert "runId is immutable" in str(error.value.body)


def test_three_nodes_seal_one_round_with_dense_ranks_and_rank0_as_master(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, control_plane: ControlPlane
) -> None:
    rdzv = make_rendezvous(3, 3)
    nodes = make_nodes(rdzv, 3)
    results = join_all(nodes)
    ranks = sorted(rank for rank, *_ in results)
    assert ranks == [0, 1, 2]
    assert {world for _, world, *_ in results} == {3}
    rank0 = next(node for node, (rank, *_) in zip(nodes, results, strict=True) if rank == 0)
    assert {(addr, port) for *_, addr, port in results} == {
        (rank0.addr, rank0.handler.served_store.port)  # type: ignore[union-attr]
    }
    status = rdzv.status()
    assert (status.state, status.round, status.world_size) == (statuses.RoundState.SEALED, 1, 3)
    table = control_plane.kubectl("get", "rdzv", rdzv.name, "-n", rdzv.namespace).stdout
    assert "Sealed" in table and f"{rank0.addr}:" in table
    wait_for(  # kopf posts Events from a queue of its own, after the status write
        lambda: any(reason == "RoundSealed" for _, reason, _ in rdzv.events()),
        30,
        "the RoundSealed Event posted",
    )


def test_each_round_gets_a_fresh_store_shared_by_its_nodes(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(2, 2)
    nodes = make_nodes(rdzv, 2)
    first = [j.wait() for j in [n.join_in_background() for n in nodes]]
    first[0].store.set("agent-key", b"round-1")
    assert first[1].store.get("agent-key") == b"round-1", "the round's nodes share its store"
    master1 = first[0].bootstrap_store_info
    workers1 = TCPStore(master1.master_addr, master1.master_port, is_master=False)
    workers1.set("worker-key", b"stale")  # workers write unprefixed, as torch's do
    again = [j.wait() for j in [n.join_in_background() for n in nodes]]
    master2 = again[0].bootstrap_store_info
    assert {i.rank for i in again} == {0, 1}
    assert master2.master_port != master1.master_port, "a new store every round"
    workers2 = TCPStore(master2.master_addr, master2.master_port, is_master=False)
    assert not workers2.check(["worker-key"]), "no key of the last round's workers"
    assert not again[0].store.check(["agent-key"])


def test_32_nodes_joining_at_once_get_32_distinct_ranks(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(32, 32)
    nodes = make_nodes(rdzv, 32)
    results = join_all(nodes)
    assert sorted(rank for rank, *_ in results) == list(range(32))
    assert {world for _, world, *_ in results} == {32}
    status = rdzv.status()
    assert status.round == 1, "exactly one round for one wave of joins"
    returned = {node.pod: rank for node, (rank, *_) in zip(nodes, results, strict=True)}
    assert returned == {member.node: rank for rank, member in enumerate(status.members)}


def test_waiting_node_receives_no_other_nodes_joins(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(6, 6)
    nodes = make_nodes(rdzv, 6)
    watcher = nodes[0].handler.watcher
    wait_for(
        lambda: "state" in ((watcher.latest or {}).get("status") or {}),
        10,
        "node 0 holds the operator's first status, written before any join",
        interval=0.02,
    )
    offers = []
    original = watcher.offer
    watcher.offer = lambda obj: (offers.append(obj), original(obj))[1]  # type: ignore[method-assign]
    started = time.monotonic()
    first = nodes[0].join_in_background()
    rdzv.wait_requests(lambda r: nodes[0].pod in r, "first node joined")
    for node in nodes[1:]:  # one after another: five more joins while node 0 waits
        node.join_in_background()
        rdzv.wait_requests(lambda r, pod=node.pod: pod in r, f"{node.pod} joined")
    first.wait()
    took = time.monotonic() - started
    # Of the forming round, node 0 received the sealed round alone: nothing per join of the
    # other five, and nothing at its own (the round's start is written with the seal)...
    assert [o.get("status", {}).get("roundKey") for o in offers] == ["1-Sealed"]
    # ... and the operator, which kept it, still reports how long the round formed.
    sealed = wait_for(
        lambda: next((m for _, reason, m in rdzv.events() if reason == "RoundSealed"), None),
        10,
        "the RoundSealed Event",
    )
    formed = re.search(r" ([0-9.]+) s after the first join;", sealed)
    assert formed is not None, sealed
    assert 0 < float(formed.group(1)) <= took, (sealed, took)


def test_deleted_pod_is_dropped_and_survivors_reform_fast(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = make_rendezvous(2, 3)
    nodes = make_nodes(rdzv, 3)
    join_all(nodes)
    victim = nodes[2]
    delete_pod(admin_api, rdzv.namespace, victim.pod)
    survivors = nodes[:2]
    fixtures.wait_told_to_rejoin(survivors, "survivors told to re-rendezvous")
    results = join_all(survivors)
    assert sorted(rank for rank, *_ in results) == [0, 1]
    status = rdzv.status()
    assert status.round == 2 and victim.pod not in {m.node for m in status.members}
    rdzv.wait_events(
        "MemberLost",
        lambda message: (
            (victim.pod in message and "PodDeleted" in message) or "PodTerminating" in message
        ),
    )


def test_rank0_loss_hands_every_survivor_the_new_master(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = make_rendezvous(1, 3)
    nodes = make_nodes(rdzv, 3)
    first = dict(zip((n.pod for n in nodes), join_all(nodes), strict=True))
    rank0 = next(n for n in nodes if first[n.pod][0] == 0)
    delete_pod(admin_api, rdzv.namespace, rank0.pod)
    survivors = [n for n in nodes if n is not rank0]
    fixtures.wait_told_to_rejoin(survivors, "survivors told to re-rendezvous")
    results = join_all(survivors)
    new_rank0 = next(n for n, r in zip(survivors, results, strict=True) if r[0] == 0)
    assert new_rank0.pod == max(survivors, key=lambda n: first[n.pod][0]).pod, "the last moves"
    assert {(addr, port) for *_, addr, port in results} == {
        (new_rank0.addr, new_rank0.handler.served_store.port)  # type: ignore[union-attr]
    }


@pytest.mark.parametrize("rank0_store", ["refuses", "accepts-and-never-answers"])
def test_rank0_gone_between_seal_and_store_sends_the_others_on_to_the_next_round(
    rank0_store: str,
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    # The soak found it: rank 0's pod deleted just after the seal, before the others
    # reached its store. Told by the operator that the round is stale, they must not
    # wait out read_timeout (and then fail their agents) but join the next round.
    rdzv = make_rendezvous(1, 2, lastCallTimeoutSeconds=60)
    gone, survivor = make_nodes(rdzv, 2, read_timeout=120)
    with socket.socket() as rank0_socket:
        rank0_socket.bind((gone.addr, 0))
        if rank0_store == "accepts-and-never-answers":  # a process killed before serving
            rank0_socket.listen(8)
        port = int(rank0_socket.getsockname()[1])
        if rank0_store == "refuses":
            rank0_socket.close()
        # Rank 0 joins as its handler would (its name sorts first), then never serves.
        kube.RendezvousClient(gone.api, rdzv.namespace, rdzv.name, retry_seconds=10).write_lease(
            gone.pod,
            "gone-instance",
            tunables.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
            rdzv.body()["metadata"]["uid"],
            leases.NodeEntry("gone-instance", 1, gone.addr, port),
        )
        joining = survivor.join_in_background()
        wait_for(
            lambda: (s := survivor.handler.watcher.status) is not None and s.round == 1,
            30,
            "the survivor sees round 1 sealed, the gone node its rank 0",
        )
        assert rdzv.status().members[0].node == gone.pod
        delete_pod(admin_api, rdzv.namespace, gone.pod)
        info = joining.wait(60)  # read_timeout is 120 s: only the stale round ends its wait
    assert (info.rank, info.world_size) == (0, 1)
    assert survivor.handler.joined is not None and survivor.handler.joined.round == 2
    assert survivor.handler.attempt == 2  # its first request was spent on round 1
    assert info.bootstrap_store_info is not None
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
        survivor.addr,
        survivor.handler.served_store.port,  # type: ignore[union-attr]
    )


def test_scale_up_is_signalled_and_rank0_stays(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(2, 3, lastCallTimeoutSeconds=1)
    running = make_nodes(rdzv, 2)
    before = dict(zip((n.pod for n in running), join_all(running), strict=True))
    assert all(n.handler.num_nodes_waiting() == 0 for n in running)
    newcomer = make_nodes(rdzv, 1)[0]
    late = newcomer.join_in_background()
    fixtures.wait_told_to_rejoin(running, "running nodes see the newcomer")
    results = join_all(running)
    late_info = late.wait()
    assert late_info.world_size == 3 and late_info.rank == 2, "newcomers are appended"
    rank0 = next(pod for pod, r in before.items() if r[0] == 0)
    assert dict(zip((n.pod for n in running), results, strict=True))[rank0][0] == 0


def test_nodes_beyond_max_wait_without_disturbing_the_round(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = make_rendezvous(2, 2)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    spare = make_nodes(rdzv, 1)[0]
    waiting = spare.join_in_background()
    rdzv.wait_requests(lambda r: spare.pod in r, "spare joined")
    status = rdzv.wait(
        lambda s: s.state is statuses.RoundState.SEALED and s.nodes_waiting == 0,
        "round stays sealed",
    )
    assert status.round == 1
    assert all(n.handler.num_nodes_waiting() == 0 for n in nodes)
    delete_pod(admin_api, rdzv.namespace, nodes[1].pod)
    survivor_round = nodes[0].join_in_background()
    assert waiting.wait().world_size == 2, "the spare steps in when a member is lost"
    assert survivor_round.wait().rank == 0


def test_set_closed_closes_for_everyone_and_shutdown_of_one_does_not(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(1, 3)
    nodes = make_nodes(rdzv, 3)
    join_all(nodes)
    assert nodes[2].handler.shutdown()
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 10, "loss noticed", interval=0.02)
    assert rdzv.status().state is not statuses.RoundState.CLOSED
    join_all(nodes[:2])
    nodes[0].handler.set_closed()
    rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed")
    assert wait_for(lambda: nodes[1].handler.is_closed(), 10, "closure seen")
    assert nodes[1].handler.num_nodes_waiting() == 0, "workers may finish"
    with pytest.raises(RendezvousClosedError, match="ClosedByNode"):
        nodes[1].handler.next_rendezvous()


def test_all_members_leaving_closes_the_rendezvous(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(2, 2)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    for node in nodes:
        assert node.handler.shutdown()
    status = rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed after all left")
    assert status.closed_reason == "AllNodesLeft"


def test_join_timeout_names_what_is_missing_and_withdraws(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(2, 2, joinTimeoutSeconds=2)
    node = make_nodes(rdzv, 1)[0]
    with pytest.raises(RendezvousTimeoutError) as error:
        node.handler.next_rendezvous()
    message = str(error.value)
    assert f"no round of Rendezvous {rdzv.namespace}/{rdzv.name} included node {node.pod}" in (
        message
    )
    assert "(minNodes=2, maxNodes=2); it is Forming after round 0 (members: none)" in message
    assert f"kubectl get leases -n {rdzv.namespace} -l {objects.NODE_LABEL}={rdzv.name}" in message
    assert rdzv.requests()[node.pod].intent is leases.NodeIntent.LEAVE


def test_operator_restarted_in_the_middle_of_a_join_loses_nothing(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, operator_process: OperatorProcess
) -> None:
    rdzv = make_rendezvous(3, 3)
    nodes = make_nodes(rdzv, 3)
    wait_for(lambda: "state" in (rdzv.body().get("status") or {}), 30, "operator initialised")
    operator_process.kill()
    joins = [node.join_in_background() for node in nodes]
    wait_for(lambda: len(rdzv.requests()) == 3, 30, "all joined while the operator is down")
    assert rdzv.status().round == 0
    operator_process.start()
    results = [joining.wait() for joining in joins]
    assert sorted(info.rank for info in results) == [0, 1, 2]


def test_pod_without_the_worker_role_is_told_how_to_fix_it(
    make_rendezvous: MakeRendezvous,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(1, 1)
    kubernetes.client.CoreV1Api(admin_api).create_namespaced_service_account(
        rdzv.namespace, {"metadata": {"name": "no-role"}}
    )
    pod = create_pods(admin_api, rdzv.namespace, ["unbound"], service_account="no-role")[0]
    token = control_plane.token_for(
        rdzv.namespace, "no-role", pod_name="unbound", pod_uid=pod["metadata"]["uid"]
    )
    api = control_plane.client_for_token(token)
    client = kube.RendezvousClient(api, rdzv.namespace, rdzv.name, retry_seconds=2)
    handler = KubernetesRendezvousHandler(
        client, run_id=rdzv.name, node="unbound", addr="127.0.0.99", min_nodes=1, max_nodes=1
    )
    try:
        with pytest.raises(RendezvousConnectionError, match="k8s-rendezvous-worker") as error:
            handler.next_rendezvous()
    finally:  # its watch would retry, refused, for the rest of the session
        handler.shutdown()
        api.close()
    assert "403" in str(error.value)


def test_heartbeats_renew_a_lease_and_never_write_the_rendezvous(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = make_rendezvous(2, 2, heartbeatTimeoutSeconds=3)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    version = rdzv.body()["metadata"]["resourceVersion"]
    coordination = kubernetes.client.CoordinationV1Api(admin_api)
    name = objects.lease_name(rdzv.name, nodes[0].pod)
    renewals: set[object] = set()

    def renewed_three_times() -> bool:
        renewals.add(coordination.read_namespaced_lease(name, rdzv.namespace).spec.renew_time)
        return len(renewals) >= 3

    wait_for(renewed_three_times, 15, f"Lease {name} renewed", interval=0.2)
    assert rdzv.body()["metadata"]["resourceVersion"] == version
    assert rdzv.status().state is statuses.RoundState.SEALED


def test_hung_agent_is_dropped_when_its_heartbeat_expires(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(1, 2, heartbeatTimeoutSeconds=3)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    nodes[1].handler.heartbeat.stop()  # the agent hangs: its pod lives, it renews no more
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 15, "expiry noticed", interval=0.05)
    rdzv.wait_events("MemberLost", lambda m: nodes[1].pod in m and "HeartbeatExpired" in m)
    survivor = join_all(nodes[:1])
    assert survivor == [(0, 1, nodes[0].addr, survivor[0][3])]


def test_status_edited_into_nonsense_is_refused_with_a_condition_and_then_recovers(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(1, 2)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    rdzv.patch_status({"schemaVersion": 99})

    def refused() -> str | None:
        conditions = (rdzv.body().get("status") or {}).get("conditions") or []
        ready = next((c for c in conditions if c["type"] == "Ready"), None)
        return ready["message"] if ready and ready["reason"] == "InvalidRendezvous" else None

    message = wait_for(refused, 20, "InvalidRendezvous condition")
    assert "schemaVersion" in message and "kubectl edit" in message
    wait_for(
        lambda: any(reason == "InvalidRendezvous" for _, reason, _ in rdzv.events()),
        30,
        "the InvalidRendezvous Event posted",
    )
    rdzv.patch_status({"schemaVersion": statuses.SCHEMA_VERSION})
    nodes[1].handler.shutdown()  # any change: the operator decides again
    rdzv.wait(
        lambda s: s.state is not statuses.RoundState.SEALED or s.world_size == 1,
        "operator decides again once the status is readable",
    )
    assert join_all(nodes[:1])[0][1] == 1


def test_an_unreadable_request_is_reported_and_not_counted(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = make_rendezvous(1, 2)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    broken = nodes[1]
    kubernetes.client.CoordinationV1Api(admin_api).patch_namespaced_lease(
        objects.lease_name(rdzv.name, broken.pod),
        rdzv.namespace,
        {"metadata": {"annotations": {objects.ENTRY_ANNOTATION: '{"instance": 7}'}}},
        _content_type="application/merge-patch+json",
    )

    def reported() -> str | None:
        return next(
            (m for _, reason, m in rdzv.events() if reason == "InvalidEntry"),
            None,
        )

    message = wait_for(reported, 20, "InvalidEntry event")
    assert f"pod {broken.pod} wrote a request this operator cannot read" in message
    assert f"{objects.ENTRY_ANNOTATION}.instance: expected a string, got 7" in message
    fixtures.wait_told_to_rejoin(nodes[:1], "its member is dropped, the survivor told")
    assert [world for _, world, *_ in join_all(nodes[:1])] == [1]


@pytest.mark.metrics
def test_operator_metrics_count_rounds_losses_and_seal_latency(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
    operator_process: OperatorProcess,
) -> None:
    rdzv = make_rendezvous(1, 2)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    delete_pod(admin_api, rdzv.namespace, nodes[1].pod)
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 10, "loss noticed", interval=0.02)

    values = wait_for(
        lambda: (
            (m if m.get("k8s_rendezvous_rounds_sealed_total", 0) >= 1 else None)
            if (m := operator_metrics(operator_process))
            else None
        ),
        10,
        "metrics served",
    )
    assert values["k8s_rendezvous_seal_latency_seconds_count"] >= 1
    lost = {k: v for k, v in values.items() if k.startswith("k8s_rendezvous_members_lost_total")}
    assert sum(lost.values()) >= 1, lost
    assert values["k8s_rendezvous_nodes_waiting"] >= 1
