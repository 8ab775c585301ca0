"""A node that is not the pod it names, against the real control plane and operator.

Aspects: torchrun on a plain host with admin credentials (no Pod of its node's name) and a
pod whose POD_NAME names another pod are told so within seconds by a named error, not at
their join timeout; the operator puts a Warning on the Rendezvous naming the node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import Joining, Node, Rendezvous, create_pods

from devkit.cluster.controlplane import ControlPlane
from devkit.waiting import wait_for
from k8s_rendezvous import kube
from k8s_rendezvous.errors import NodeNotAPodError
from k8s_rendezvous.handler import KubernetesRendezvousHandler

pytestmark = pytest.mark.usefixtures("operator_process")

JOIN_TIMEOUT = 600
"""Far off: only noticing what the node is can end its wait."""


def _node(rendezvous: Rendezvous, api: kubernetes.client.ApiClient, name: str, addr: str) -> Node:
    client = kube.RendezvousClient(api, rendezvous.namespace, rendezvous.name, retry_seconds=20)
    handler = KubernetesRendezvousHandler(
        client, run_id=rendezvous.name, node=name, addr=addr, min_nodes=1, max_nodes=1
    )
    return Node(name, addr, handler, api, rendezvous)


def test_a_node_with_admin_credentials_and_no_pod_is_told_within_seconds(
    admin_api: kubernetes.client.ApiClient,
    make_rendezvous: Callable[..., Rendezvous],
) -> None:
    rdzv = make_rendezvous(1, 1, joinTimeoutSeconds=JOIN_TIMEOUT)
    node = _node(rdzv, admin_api, "a-plain-host", "127.0.0.21")
    try:
        joining = Joining(node)
        with pytest.raises(NodeNotAPodError, match="no Pod a-plain-host exists") as caught:
            joining.wait(timeout=60)
        assert "not as a pod" in str(caught.value) and "POD_NAME" in str(caught.value)
        warned = wait_for(
            lambda: [m for _, r, m in rdzv.events() if r == "NodeWithoutPod"] or None,
            30,
            "a NodeWithoutPod Warning on the Rendezvous",
        )
        assert "no Pod a-plain-host exists" in warned[0], warned
    finally:
        node.handler.shutdown()


def test_a_pod_naming_another_pod_is_told_within_seconds(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: Callable[..., Rendezvous],
) -> None:
    rdzv = make_rendezvous(1, 1, joinTimeoutSeconds=JOIN_TIMEOUT)
    (pod,) = create_pods(admin_api, workers_namespace, ["real-pod"])
    metadata: dict[str, Any] = pod["metadata"]
    token = control_plane.token_for(
        workers_namespace, "default", pod_name=metadata["name"], pod_uid=metadata["uid"]
    )
    api = control_plane.client_for_token(token)
    node = _node(rdzv, api, "pod-it-is-not", pod["status"]["podIP"])
    try:
        joining = Joining(node)
        with pytest.raises(NodeNotAPodError, match="runs with the token of pod real-pod"):
            joining.wait(timeout=60)
    finally:
        node.handler.shutdown()
        api.close()
