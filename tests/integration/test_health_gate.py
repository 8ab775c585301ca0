"""The health gate against the real control plane: real operator process, real pods on
kwok nodes, handlers authenticated with their own pod-bound tokens.

Aspects: a node whose health check fails joins no round and ends with
``NodeUnhealthyError``, leaving a report in its Lease; the round of the others is not
disturbed (not re-formed, no restart spent, no spare counted); the operator's
HealthCheckFailed Warning names the pod, the Kubernetes node the Pod object says and the
output's tail; a check that hangs is ended at its bound and said to be.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import kubernetes.client
import pytest
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous

from devkit.waiting import wait_for
from k8s_rendezvous.errors import NodeUnhealthyError
from k8s_rendezvous.wire import leases, statuses

pytestmark = pytest.mark.usefixtures("operator_process")

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]

FAILING_CHECK = (
    sys.executable,
    "-c",
    "import sys; print('all_reduce 1G: 0.0 GB/s'); "
    "print('NCCL WARN NET/IB : Got async event : port error'); sys.exit(3)",
)


def _warning_about(rdzv: Rendezvous, pod: str) -> str:
    return wait_for(
        lambda: next(
            (
                message
                for kind, reason, message in rdzv.events()
                if kind == "Warning" and reason == "HealthCheckFailed" and pod in message
            ),
            None,
        ),
        30,
        f"a HealthCheckFailed Warning about {pod}",
    )


def _pod_node(admin_api: kubernetes.client.ApiClient, namespace: str, pod: str) -> str:
    found = kubernetes.client.CoreV1Api(admin_api).read_namespaced_pod(pod, namespace)
    return str(found.spec.node_name)


def test_a_node_whose_check_fails_joins_nothing_and_the_round_is_undisturbed(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    # Two of at most three, sealed at once: no last call waits for a third.
    rdzv = make_rendezvous(2, 3, lastCallTimeoutSeconds=0)
    healthy = make_nodes(
        rdzv, 2, min_nodes=2, max_nodes=3, health_check=(sys.executable, "-c", "pass")
    )
    fixtures.join_all(healthy)
    sealed = rdzv.wait(lambda s: s.state is statuses.RoundState.SEALED, "round 1 sealed")
    [unhealthy] = make_nodes(rdzv, 1, min_nodes=2, max_nodes=3, health_check=FAILING_CHECK)

    with pytest.raises(NodeUnhealthyError, match=r"exited with code 3.*port error"):
        unhealthy.join_in_background().wait()

    # It said why in its own Lease, and never asked to join.
    entry = rdzv.requests()[unhealthy.pod]
    assert entry.intent is leases.NodeIntent.LEAVE
    assert entry.health_check is not None
    assert entry.health_check.exit_code == 3
    assert entry.health_check.tail.endswith("port error\n")
    message = _warning_about(rdzv, unhealthy.pod)
    node = _pod_node(admin_api, rdzv.namespace, unhealthy.pod)
    assert f"pod {unhealthy.pod} on node {node} joins no round" in message, message
    assert "exited with code 3" in message
    assert message.endswith("NCCL WARN NET/IB : Got async event : port error\n"), message
    # The round of the others is as it was: not re-formed, no restart spent, no spare.
    status = rdzv.status()
    assert status.round == sealed.round
    assert status.state is statuses.RoundState.SEALED
    assert [m.node for m in status.members] == [m.node for m in sealed.members]
    assert unhealthy.pod not in {m.node for m in status.members}
    assert (status.restarts, status.spares, status.nodes_waiting) == (0, 0, 0)
    assert all(node.handler.num_nodes_waiting() == 0 for node in healthy)


def test_a_check_that_hangs_is_ended_at_its_bound_and_said_to_be(
    make_rendezvous: MakeRendezvous, make_nodes: MakeNodes
) -> None:
    rdzv = make_rendezvous(1, 1)
    hanging = ("sh", "-c", "echo waiting for GPU 0; exec sleep 600")
    [node] = make_nodes(rdzv, 1, health_check=hanging, health_check_timeout=1)

    with pytest.raises(NodeUnhealthyError, match=r"did not end within health_check_timeout"):
        node.join_in_background().wait()

    message = _warning_about(rdzv, node.pod)
    assert "did not end within health_check_timeout and was killed" in message, message
    assert message.endswith("waiting for GPU 0\n"), message
    assert rdzv.status().round == 0
