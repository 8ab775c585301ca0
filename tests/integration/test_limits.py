"""Names and entries at the limits, against the real API server.

Aspects: a Rendezvous name of 63 characters (the most a label value holds) works with a pod
named with 253 characters (the most a Kubernetes name holds), whose heartbeat Lease name is
shortened with a hash; one more character in the Rendezvous name is refused with the CRD
rule's message; member entries the schema refuses, oversized ones included (the API
server's messages asserted); a status past etcd's request limit is refused as etcd says it
(a 500), classified as too large; a status too large to store (a real 413) is said in a
condition and one Warning and held, tried again only when the Rendezvous changes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support.fixtures import (
    Node,
    Rendezvous,
    create_pods,
    join_all,
    operator_metrics,
)

from devkit.manifests import WORKLOAD_SELECTOR
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import rest
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


def test_a_status_past_etcds_request_limit_is_refused_as_too_large_not_as_retryable(
    make_rendezvous: Callable[..., Rendezvous],
) -> None:
    """What the API server answers for a status larger than etcd takes (1.5 MiB by
    default) but within its own body limit (3 MiB): etcd's refusal, passed on as a 500
    with etcd's words, which would read as an API server in trouble. The classifier both
    sides share makes it a lasting refusal."""
    rdzv = make_rendezvous(1, 1)
    members = [{**MEMBER, "rank": r, "node": f"pod-{r:05d}-{'x' * 100}"} for r in range(10_000)]
    assert 1.5 * 2**20 < len(json.dumps({"status": {"members": members}})) < 2 * 2**20
    with pytest.raises(ApiException) as error:
        rdzv.patch_status({"members": members})
    said = json.loads(error.value.body)["message"]
    assert (error.value.status, said) == (500, "etcdserver: request is too large")
    assert type(rest.failure(error.value.status, said)) is rest.TooLarge
    assert rdzv.status().members == (), "nothing stored"


@contextlib.contextmanager
def statuses_of_one_member_at_most(
    admin_api: kubernetes.client.ApiClient, namespace: str
) -> Iterator[None]:
    """etcd's request limit scaled down to two nodes: an admission policy that refuses a
    Rendezvous status of more than one member in ``namespace`` with RequestEntityTooLarge,
    which the API server answers with a real 413, as it does a body past its own limit.
    (etcd's own refusal, a 500 with etcd's words, is classified by tests/unit/test_rest.py;
    the operator treats both the same.)"""
    admission = kubernetes.client.AdmissionregistrationV1Api(admin_api)
    name = f"status-one-member.{namespace}"
    in_namespace = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    admission.create_validating_admission_policy(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "namespaceSelector": in_namespace,
                    "resourceRules": [
                        {
                            "apiGroups": [objects.GROUP],
                            "apiVersions": ["*"],
                            "operations": ["UPDATE"],
                            "resources": [f"{objects.PLURAL}/status"],
                        }
                    ],
                },
                "validations": [
                    {
                        "expression": "!has(object.status.members) || "
                        "size(object.status.members) <= 1",
                        "reason": "RequestEntityTooLarge",
                        "message": "a status of more than 1 member (this test's etcd limit)",
                    }
                ],
            },
        }
    )
    try:
        admission.create_validating_admission_policy_binding(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": name},
                "spec": {
                    "policyName": name,
                    "validationActions": ["Deny"],
                    "matchResources": {"namespaceSelector": in_namespace},
                },
            }
        )
        yield
    finally:
        with contextlib.suppress(ApiException):
            admission.delete_validating_admission_policy_binding(name)
        admission.delete_validating_admission_policy(name)


def two_members_refused(rdzv: Rendezvous, admin_api: kubernetes.client.ApiClient) -> bool:
    """Whether a status of two members is refused as too large now (a dry run: nothing is
    stored, and the operator sees no event)."""
    members = [{**MEMBER, "rank": rank, "node": f"pod-{rank}"} for rank in (0, 1)]
    try:
        kubernetes.client.CustomObjectsApi(admin_api).patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            rdzv.namespace,
            objects.PLURAL,
            rdzv.name,
            {"status": {"members": members}},
            dry_run="All",
            _content_type="application/merge-patch+json",
        )
    except ApiException as error:
        assert error.status == 413, error.body
        return True
    return False


REFUSED_TOO_LARGE = 'k8s_rendezvous_status_writes_refused_total{kind="TooLarge"}'


@pytest.mark.metrics
def test_a_status_too_large_to_store_is_said_once_and_held_until_the_rendezvous_changes(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    operator_process: OperatorProcess,
) -> None:
    """The seal of two nodes is refused (413): the Ready condition says why and what to
    do, one Warning; then no write while the Rendezvous stays as it is, though its nodes
    go on renewing and another rendezvous seals meanwhile. Each change of it is one more
    try; once the limit is raised, the next change seals it."""
    rdzv = make_rendezvous(2, 2)
    with statuses_of_one_member_at_most(admin_api, workers_namespace):
        wait_for(lambda: two_members_refused(rdzv, admin_api), 30, "the policy in force")
        joins = [node.join_in_background() for node in make_nodes(rdzv, 2)]
        held = rdzv.wait(
            lambda s: any(c.reason == "StatusTooLarge" for c in s.conditions),
            "the refused seal said in the Ready condition",
        )
        (ready,) = [c for c in held.conditions if c.type == "Ready"]
        assert ready.status == "False" and held.state.value == "Forming"
        assert "its next status (2 members" in ready.message
        assert "Lower spec.maxNodes" in ready.message and "Tried again when" in ready.message
        assert "this test's etcd limit" in ready.message, "the API server's own words"
        assert operator_metrics(operator_process)[REFUSED_TOO_LARGE] == 1
        # Meanwhile the operator goes on with the others: one that fits seals.
        other = make_rendezvous(1, 1)
        assert join_all(make_nodes(other, 1))[0].world_size == 1
        assert operator_metrics(operator_process)[REFUSED_TOO_LARGE] == 1, "held, not resent"
        rdzv.patch_spec({"lastCallTimeoutSeconds": 29})  # a change: tried once more
        wait_for(
            lambda: operator_metrics(operator_process)[REFUSED_TOO_LARGE] == 2 or None,
            30,
            "the write tried again after the edit",
        )
    wait_for(lambda: not two_members_refused(rdzv, admin_api), 30, "the limit raised")
    rdzv.patch_spec({"lastCallTimeoutSeconds": 28})
    assert [joining.wait(60).world_size for joining in joins] == [2, 2]
    assert operator_metrics(operator_process)[REFUSED_TOO_LARGE] == 2
    warnings = rdzv.wait_events("StatusTooLarge", lambda m: "2 members" in m, kind="Warning")
    assert len(warnings) == 1, warnings
