"""Names and entries at the limits, against the real API server.

Aspects: a Rendezvous name of 63 characters (the most a label value holds) works with a pod
named with 253 characters (the most a Kubernetes name holds), whose heartbeat Lease name is
shortened with a hash; one more character in the Rendezvous name is refused with the CRD
rule's message; member entries the schema refuses, oversized ones included (the API
server's messages asserted).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support.fixtures import Node, Rendezvous, create_pods

from devkit.manifests import WORKLOAD_SELECTOR
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects, records

pytestmark = pytest.mark.usefixtures("operator_process")


def body(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": name},
        "spec": {
            "minNodes": 2,
            "maxNodes": 2,
            "runId": name,
            "podSelector": WORKLOAD_SELECTOR,
            **spec,
        },
    }


def long_name(length: int, prefix: str) -> str:
    """A valid DNS subdomain of exactly ``length`` characters."""
    return (prefix + "-" + "x" * length)[: length - 1] + "z"


def test_a_63_character_rendezvous_seals_with_a_253_character_pod_and_keeps_its_heartbeat(
    recorded: Callable[[str], Rendezvous],
    attach_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    name = long_name(63, "rdzv")
    rdzv = recorded(name)
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        body(name, heartbeatTimeoutSeconds=3),
    )
    longest = long_name(253, "a")  # sorts first: rank 0
    pods = create_pods(admin_api, workers_namespace, [longest, "short"])
    nodes = attach_nodes(rdzv, pods, min_nodes=2, max_nodes=2)
    joins = [node.join_in_background() for node in nodes]
    assert [j.wait(60).rank for j in joins] == [0, 1]
    sealed = rdzv.status()
    assert [m.node for m in sealed.members] == [longest, "short"]
    assert sealed.master is not None and sealed.master.addr == nodes[0].addr

    lease_name = objects.lease_name(name, longest)
    assert len(lease_name) == 253 and lease_name != f"{name}.{longest}", "shortened"
    leases = kubernetes.client.CoordinationV1Api(admin_api)
    lease = leases.read_namespaced_lease(lease_name, workers_namespace)
    assert lease.spec.holder_identity == longest
    assert lease.metadata.labels == {objects.NODE_LABEL: name}
    pod = kubernetes.client.CoreV1Api(admin_api).read_namespaced_pod(longest, workers_namespace)
    assert pod.metadata.labels[objects.NODE_LABEL] == name, "labelled for the operator's watch"

    # The operator finds the member's heartbeat under the shortened name: renewed past the
    # timeout, the round stands.
    assert sealed.sealed_at is not None
    expiry = sealed.sealed_at.timestamp() + 3

    def renewed_past_expiry() -> bool:
        renewed = leases.read_namespaced_lease(lease_name, workers_namespace).spec.renew_time
        return bool(renewed.timestamp() > expiry + 1)

    wait_for(renewed_past_expiry, 30, "the long pod's Lease renewed past the first expiry")
    assert rdzv.status().round_key == "1-Sealed"
    lost = [m for _, reason, m in rdzv.events() if reason == "MemberLost"]
    assert lost == [], "no member expired"


def test_a_64_character_rendezvous_name_is_refused_with_the_rules_message(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    with pytest.raises(ApiException) as error:
        kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.PLURAL,
            body(long_name(64, "r")),
        )
    assert error.value.status == 422
    assert "a Rendezvous name has at most 63 characters (it is used as a label value)" in str(
        json.loads(error.value.body)["message"]
    )


def test_a_rendezvous_name_with_a_dot_is_refused_with_the_rules_message(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    """``team.train`` would make the Lease ``team.train.w-0`` of its pod ``w-0`` the one pod
    ``train.w-0`` of rendezvous ``team`` writes."""
    with pytest.raises(ApiException) as error:
        kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, body("team.train")
        )
    assert error.value.status == 422
    message = json.loads(error.value.body)["message"]
    assert "a Rendezvous name has no dots (a DNS label)" in message
    assert "<rendezvous>.<pod>" in message


@pytest.mark.parametrize("run_id", ["a\nb", "nul\u0000", "with space", "\u0663"])
def test_a_run_id_that_is_not_printable_ascii_is_refused_with_the_accepted_form(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str, run_id: str
) -> None:
    with pytest.raises(ApiException) as error:
        kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.PLURAL,
            body("r", runId=run_id),
        )
    assert error.value.status == 422
    assert "runId must be printable ASCII without spaces (torchrun --rdzv-id" in str(
        json.loads(error.value.body)["message"]
    )


MEMBER = {"rank": 0, "node": "pod-a", "instance": "i", "attempt": 1, "addr": "10.0.0.1"}


@pytest.mark.parametrize(
    ("status", "message"),
    [
        pytest.param(
            {"members": [{**MEMBER, "attempt": 0}]},
            "status.members[0].attempt: Invalid value: 0: members[0].attempt in body "
            "should be greater than or equal to 1",
            id="attempt-0",
        ),
        pytest.param(
            {"members": [{k: v for k, v in MEMBER.items() if k != "instance"}]},
            "status.members[0].instance: Required value",
            id="no-instance",
        ),
        pytest.param(
            {"members": [{**MEMBER, "node": "n" * 100_000}]},
            "status.members[0].node: Too long: may not be more than 253 bytes",
            id="member-node-100k",
        ),
        pytest.param(
            {"leftBehind": [{**MEMBER, "instance": "i" * 65}]},
            "status.leftBehind[0].instance: Too long: may not be more than 64 bytes",
            id="left-behind-instance-65",
        ),
        pytest.param(
            {"master": {"addr": "a" * 254, "port": 29500}},
            "status.master.addr: Too long: may not be more than 253 bytes",
            id="master-addr-254",
        ),
        pytest.param(
            {"round": 2**63 - 1},
            "status.round: Invalid value: 9223372036854775807: round in body should be "
            "less than or equal to 1000000000000",
            id="round-2^63-1",
        ),
        pytest.param(
            {"slices": 1001},
            "status.slices: Invalid value: 1001: slices in body should be less than or equal to "
            "1000",
            id="slices-1001",
        ),
        pytest.param(
            {"members": [MEMBER] * 2, "conditions": [{"type": "Ready", "status": "Yes"}]},
            'status.conditions[0].status: Unsupported value: "Yes"',
            id="condition-status",
        ),
    ],
)
def test_the_schema_refuses_a_malformed_or_oversized_entry_naming_the_field(
    make_rendezvous: Callable[..., Rendezvous],
    status: dict[str, Any],
    message: str,
) -> None:
    rdzv = make_rendezvous(1, 1)
    with pytest.raises(ApiException) as error:
        rdzv.patch_status(status)
    assert error.value.status == 422
    assert message in json.loads(error.value.body)["message"]


def test_a_status_whose_next_round_the_api_server_refuses_is_reported_once_not_retried(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_nodes: Callable[..., list[Node]],
) -> None:
    """The last round the schema allows: sealing the next one is refused (422). The
    operator says so in a condition and one Event, and tries again only when the status
    changes, not every second. (Not recorded for the invariants: the hand edits move
    the round back.)"""
    name = "last-round"
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        body(name, minNodes=1, maxNodes=1),
    )
    rdzv = Rendezvous(admin_api, workers_namespace, name)
    rdzv.patch_status({"state": "Forming", "round": records.MAX_ROUND, "schemaVersion": 1})
    (node,) = make_nodes(rdzv, 1, read_timeout=5)
    joining = node.join_in_background()
    ready = rdzv.wait(
        lambda s: any(c.reason == "InvalidRendezvous" for c in s.conditions),
        "the refused seal reported",
    )
    (condition,) = [c for c in ready.conditions if c.type == "Ready"]
    assert "its next status was refused, no round is decided" in condition.message
    assert "status.round" in condition.message and "kubectl edit rdzv" in condition.message
    # Fixed by hand: the next decision is written, and the refusal was said once.
    rdzv.patch_status({"round": 5})
    assert joining.wait(60).world_size == 1
    assert rdzv.status().round == 6
    refusals = wait_for(
        lambda: [m for _, reason, m in rdzv.events() if reason == "InvalidRendezvous"] or None,
        30,
        "the InvalidRendezvous Event posted",
    )
    assert len(refusals) == 1, refusals


def test_more_slices_than_the_nodes_need_are_refused_not_made(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_nodes: Callable[..., list[Node]],
) -> None:
    """``slices: 300`` edited into the status of a 2-node rendezvous: the operator makes
    none of them and decides no round, says what to set instead, once; fixed, it seals."""
    name = "many-slices"
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        body(name, minNodes=1, maxNodes=2),
    )
    rdzv = Rendezvous(admin_api, workers_namespace, name)
    rdzv.patch_status({"state": "Forming", "round": 0, "slices": 300, "schemaVersion": 1})
    (node,) = make_nodes(rdzv, 1, read_timeout=5)
    joining = node.join_in_background()
    refusal = wait_for(
        lambda: [m for _, reason, m in rdzv.events() if reason == "InvalidRendezvous"] or None,
        30,
        "the InvalidRendezvous Event posted",
    )
    assert (
        "status.slices: 300 is more than the 0 that 2 nodes need (one per 100, none up to "
        "100); set it to 0"
    ) in refusal[0]
    rdzv.patch_status({"slices": 0})
    assert joining.wait(60).world_size == 1
    slices = kubernetes.client.CustomObjectsApi(admin_api).list_namespaced_custom_object(
        objects.GROUP, objects.VERSION, workers_namespace, "rendezvousslices"
    )
    assert slices["items"] == []
    assert len([r for _, r, _ in rdzv.events() if r == "InvalidRendezvous"]) == 1
