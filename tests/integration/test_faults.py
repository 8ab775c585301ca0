"""Faults against the real control plane; every Rendezvous here is recorded and its
history checked against the invariants at teardown (devkit/invariants.py).

Aspects: kube-apiserver down during joins (retried, then sealed; or a named error past
the budget); etcd restarted during joins; 64 nodes joining within the same few
milliseconds, three times; the operator SIGKILLed during a storm of joins and seals and
right after a seal; node clocks (a Lease renewal time from the far past or future) do not
change decisions.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import kubernetes.client
import pytest
from tests.support.fixtures import (
    Node,
    Rendezvous,
    create_pods,
    delete_pod,
    wait_told_to_rejoin,
)
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import kube
from k8s_rendezvous.wire import objects, statuses

pytestmark = pytest.mark.usefixtures("operator_process")

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]


def join_all(nodes: list[Node]) -> list[int]:
    joins = [node.join_in_background() for node in nodes]
    return sorted(joining.wait(120).rank for joining in joins)


def test_api_server_restarted_during_joins_delays_but_loses_nothing(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, control_plane: ControlPlane
) -> None:
    rdzv = make_rendezvous(4, 4)
    nodes = make_nodes(rdzv, 4, read_timeout=60)
    wait_for(lambda: "state" in (rdzv.body().get("status") or {}), 30, "operator initialised")
    first = [node.join_in_background() for node in nodes[:2]]
    rdzv.wait_requests(lambda r: len(r) == 2, "two joined")
    control_plane.stop_apiserver()
    try:
        late = [node.join_in_background() for node in nodes[2:]]  # retrying meanwhile
    finally:
        control_plane.start_apiserver()
    joins = [*first, *late]
    for joining in joins:  # let every join end before judging, so a failure names its cause
        joining._thread.join(120)
    errors = {j.node.pod: repr(j.error) for j in joins if j.error is not None}
    assert not errors, errors
    assert sorted(joining.wait(1).rank for joining in joins) == [0, 1, 2, 3]


def test_api_server_down_past_the_budget_raises_a_named_connection_error(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, control_plane: ControlPlane
) -> None:
    rdzv = make_rendezvous(2, 2)
    (node,) = make_nodes(rdzv, 1, read_timeout=2)
    control_plane.stop_apiserver()
    try:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="unreachable"):
            node.handler.next_rendezvous()
        assert time.monotonic() - started < 30, "bounded retries"
    finally:
        control_plane.start_apiserver()


def test_etcd_restarted_during_joins_loses_nothing(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, control_plane: ControlPlane
) -> None:
    rdzv = make_rendezvous(3, 3)
    nodes = make_nodes(rdzv, 3, read_timeout=60)
    first = nodes[0].join_in_background()
    rdzv.wait_requests(lambda r: nodes[0].pod in r, "first joined")
    control_plane.restart_etcd()
    rest = [node.join_in_background() for node in nodes[1:]]
    assert sorted(j.wait(120).rank for j in [first, *rest]) == [0, 1, 2]


@pytest.mark.timeout(900)  # 64 pods and tokens to make, three waves, on 2 cores
def test_64_nodes_joining_within_milliseconds_three_times(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(64, 64)
    nodes = make_nodes(rdzv, 64, read_timeout=60)
    for wave in range(1, 4):
        gate = threading.Barrier(len(nodes))
        results: dict[str, int] = {}
        errors: list[BaseException] = []

        def join(
            node: Node,
            gate: threading.Barrier = gate,
            results: dict[str, int] = results,
            errors: list[BaseException] = errors,
        ) -> None:
            gate.wait()
            try:
                results[node.pod] = node.handler.next_rendezvous().rank
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=join, args=(node,)) for node in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert not errors, errors[:3]
        assert sorted(results.values()) == list(range(64)), f"wave {wave}"
        assert rdzv.status().round == wave, "one round per wave"


def test_operator_killed_during_joins_and_seals_and_after_a_seal(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    operator_process: OperatorProcess,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(8, 8)
    nodes = make_nodes(rdzv, 8, read_timeout=60)
    for wave, killed_after in enumerate((1, 4, 7), start=1):  # kills at different moments
        joins = [node.join_in_background() for node in nodes]
        rdzv.wait_requests(
            lambda r, k=killed_after, w=wave: sum(e.attempt == w for e in r.values()) >= k,
            f"{killed_after} joined",
            timeout=60,
        )
        operator_process.kill()
        operator_process.start()
        assert sorted(j.wait(120).rank for j in joins) == list(range(8)), f"wave {wave}"
        assert rdzv.status().round == wave
    operator_process.kill()  # right after a seal: the next operator must notice a loss
    victim = nodes[-1]
    delete_pod(admin_api, rdzv.namespace, victim.pod)
    operator_process.start()
    survivors = nodes[:-1]
    wait_for(
        lambda: all(n.handler.num_nodes_waiting() > 0 for n in survivors),
        30,
        "the restarted operator drops the pod deleted while it was down",
    )
    status = rdzv.status()
    assert status.state is statuses.RoundState.REFORMING and status.round == 3


def test_node_clock_does_not_change_decisions(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class ThreeHoursBehind(datetime.datetime):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> ThreeHoursBehind:  # type: ignore[override]
            return super().now(tz) - datetime.timedelta(hours=3)  # type: ignore[return-value]

    utc = datetime.timezone

    class SkewedClock:
        datetime = ThreeHoursBehind
        timezone = utc

    monkeypatch.setattr(kube, "datetime", SkewedClock)  # every node's clock is 3 h behind
    rdzv = make_rendezvous(2, 2, heartbeatTimeoutSeconds=3)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    leases = kubernetes.client.CoordinationV1Api(admin_api)
    lease = leases.read_namespaced_lease(
        objects.lease_name(rdzv.name, nodes[0].pod), rdzv.namespace
    )
    behind = datetime.datetime.now(datetime.timezone.utc) - lease.spec.renew_time
    assert behind > datetime.timedelta(hours=2), "the renewals really carry the skewed time"
    nodes[1].handler.heartbeat.stop()
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 20, "node 1 expires", interval=0.05)
    lost = rdzv.wait_events("MemberLost", lambda m: nodes[1].pod in m and "HeartbeatExpired" in m)
    assert not any(nodes[0].pod in m for m in lost), "renewals stamped 3 h ago still count"


def test_a_restarted_operator_does_not_admit_the_join_of_a_pod_deleted_before(
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    operator_process: OperatorProcess,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(2, 3, lastCallTimeoutSeconds=2, joinTimeoutSeconds=60)
    first, second, ghost = make_nodes(rdzv, 3)
    ghost.join_in_background()
    rdzv.wait_requests(lambda r: ghost.pod in r, "the ghost's join is recorded")
    ghost.handler.heartbeat.stop()  # its process dies with its pod: no shutdown()
    ghost.handler.watcher.stop()
    delete_pod(admin_api, rdzv.namespace, ghost.pod)
    operator_process.kill()  # what it knew about the deleted pod dies with it
    joins = [node.join_in_background() for node in (first, second)]
    rdzv.wait_requests(lambda r: {first.pod, second.pod} <= set(r), "both joins recorded")
    operator_process.start()
    worlds = [(j.wait(60).rank, j.wait(1).world_size) for j in joins]
    sealed = rdzv.wait(lambda s: s.round >= 1, "a round sealed")
    assert ghost.pod not in [m.node for m in sealed.members if sealed.round == 1], sealed.members
    assert sorted(worlds) == [(0, 2), (1, 2)], "the ghost is not counted in the world"


def test_a_pod_made_anew_under_its_old_name_joins_as_itself(
    make_rendezvous: MakeRendezvous,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """A StatefulSet or a PyTorchJob makes a failed pod anew under its old name (here with
    its old IP too). Its Lease still holds the old pod's request: the operator reads the new
    pod once the Lease says another pod wrote it, and admits the new pod's own request."""
    rdzv = make_rendezvous(2, 2, lastCallTimeoutSeconds=0)
    pods = create_pods(admin_api, workers_namespace, ["worker-0", "worker-1"])
    old, peer = attach_nodes(rdzv, pods, min_nodes=2, max_nodes=2)
    assert join_all([old, peer]) == [0, 1]
    old.handler.heartbeat.stop()  # its process dies with its pod: no shutdown()
    old.handler.watcher.stop()
    core = kubernetes.client.CoreV1Api(admin_api)
    delete_pod(admin_api, workers_namespace, "worker-0")
    wait_for(
        lambda: (
            not core.list_namespaced_pod(
                workers_namespace, field_selector="metadata.name=worker-0"
            ).items
        ),
        30,
        "the old worker-0 gone",
    )
    ip = pods[0]["status"]["podIP"]
    (remade,) = create_pods(admin_api, workers_namespace, ["worker-0"], addresses={"worker-0": ip})
    assert remade["metadata"]["uid"] != pods[0]["metadata"]["uid"]
    (new,) = attach_nodes(rdzv, [remade], min_nodes=2, max_nodes=2)
    wait_told_to_rejoin([peer], "worker-1 learns that its round lost worker-0")
    assert join_all([new, peer]) == [0, 1]
    sealed = rdzv.status()
    assert {m.node: m.instance for m in sealed.members}["worker-0"] == new.handler.instance
