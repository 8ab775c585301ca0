"""Least privilege, proven: the operator runs as a local process with a real token of the
chart's ServiceAccount (bound to one of the Deployment's pods, as the kubelet would mount
it; its flags as in the Deployment, leader election and the admission webhook included,
the webhook served on 127.0.0.1) through the core scenarios, the release's NOTES among
them. Its ClusterRole is compared with an explicit minimal list, and the API server is
asked what it may not do."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous, delete_pod, free_port

from devkit.chart import (
    NAMESPACE,
    OPERATOR,
    RELEASE,
    WEBHOOK_CONFIG,
    WORKER_ROLE,
    ChartOperator,
    Helm,
    Release,
)
from devkit.cluster.controlplane import ControlPlane, read_object
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects, statuses

pytestmark = pytest.mark.usefixtures("chart_release")

MakeRendezvous = Callable[..., Rendezvous]
MakeNodes = Callable[..., list[Node]]
SUBJECT = f"system:serviceaccount:{NAMESPACE}:{OPERATOR}"

Rule = tuple[str, str, str, str]
"""(API group, resource, verb, resource name or '')"""

# Why each is there: see templates/rbac-operator.yaml, which says the same per rule.
TODAY: set[Rule] = {
    ("k8s-rendezvous.dev", "rendezvous", "list", ""),  # kopf's watch: list, then watch
    ("k8s-rendezvous.dev", "rendezvous", "watch", ""),
    ("k8s-rendezvous.dev", "rendezvous", "get", ""),  # re-read after a 409 on write_status
    ("k8s-rendezvous.dev", "rendezvous/status", "patch", ""),  # sealing rounds
    ("k8s-rendezvous.dev", "rendezvousslices", "patch", ""),  # publishing a large round
    ("k8s-rendezvous.dev", "rendezvousslices", "create", ""),  # the first time
    ("", "pods", "list", ""),  # the labelled node pods (server-side label selector)
    ("", "pods", "watch", ""),
    ("", "pods", "patch", ""),  # setting that label on a node's pod
    ("", "pods", "get", ""),  # spec.rankOrder: a pod's node before its watch event
    ("", "nodes", "get", ""),  # spec.rankOrder: that node's labels
    # A node's pod's StatefulSet: whether it stands for another workload (LeaderWorkerSet)
    ("apps", "statefulsets", "get", ""),
    ("coordination.k8s.io", "leases", "list", ""),  # nodes' heartbeat Leases (same label)
    ("coordination.k8s.io", "leases", "watch", ""),
    # a gone pod's Lease, collected (only nodes' Leases: *-operator-writes)
    ("coordination.k8s.io", "leases", "delete", ""),
    ("", "events", "create", ""),  # kopf posts Events; it never patches them
}
ANNOTATED_JOBS: set[Rule] = {  # used by annotated-Job support
    ("batch", "jobs", "list", ""),
    ("batch", "jobs", "watch", ""),
    ("batch", "jobs", "get", ""),  # before its watch event; a node's pod's, for its JobSet
    ("k8s-rendezvous.dev", "rendezvous", "create", ""),
    ("k8s-rendezvous.dev", "rendezvous", "patch", ""),  # spec follows the annotations
    # a pod-made one under the Job's name, replaced (only those: *-operator-writes)
    ("k8s-rendezvous.dev", "rendezvous", "delete", ""),
    ("", "serviceaccounts", "get", ""),  # a Job's, before binding the worker role to it
    ("rbac.authorization.k8s.io", "rolebindings", "create", ""),
    ("rbac.authorization.k8s.io", "clusterroles", "bind", WORKER_ROLE),
}
WEBHOOK: set[Rule] = {  # webhook.enabled (the default)
    # The operator merge-patches its configuration's webhooks, by name, and creates the
    # configuration only if that found none (create cannot be narrowed by name).
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "create", ""),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch", WEBHOOK_CONFIG),
}
LEADER_ELECTION: set[Rule] = {  # a Role in the release namespace
    ("coordination.k8s.io", "leases", "create", ""),
    ("coordination.k8s.io", "leases", "get", OPERATOR),
    ("coordination.k8s.io", "leases", "update", OPERATOR),
}


def flatten(role: dict[str, object]) -> set[Rule]:
    rules: set[Rule] = set()
    for rule in role["rules"]:  # type: ignore[attr-defined]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        rules.add((group, resource, verb, name))
    return rules


@pytest.fixture(scope="module")
def chart_operator(
    chart_release: Release, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChartOperator]:
    """The operator with the chart's identity and flags, watching the whole cluster; its
    webhook on 127.0.0.1 (the API server runs here, not in the cluster), registered in the
    chart's MutatingWebhookConfiguration."""
    port = free_port()
    process = ChartOperator.leading_with_webhook(
        chart_release, tmp_path_factory.mktemp("chart-operator"), port
    )
    process.start()
    try:
        wait_for(lambda: "this replica leads" in process.log(), 30, "the operator leads")
        wait_for(
            lambda: registered_url(chart_release.control_plane).startswith(
                f"https://127.0.0.1:{port}/"
            ),
            30,
            f"the operator registered its webhook in {WEBHOOK_CONFIG}",
        )
        yield process
    finally:
        process.stop()
        print(f"--- operator log (tail) ---\n{process.log_tail()}")


@pytest.fixture
def operator_log(chart_operator: ChartOperator) -> Iterator[Callable[[], str]]:
    """What the operator logged during the test; it must never have been refused."""
    start = len(chart_operator.log())

    def written() -> str:
        return chart_operator.log()[start:]

    yield written
    # An RBAC denial reads 'x is forbidden: User "system:serviceaccount:..." cannot ...'
    # (kopf only logs failed Event posts; a 403 for a namespace being deleted is no denial).
    refused = [
        line
        for line in written().splitlines()
        if f'forbidden: User "{SUBJECT}"' in line or "-operator-writes' denied" in line
    ]
    assert not refused, "RBAC or its policy refused the operator:\n" + "\n".join(refused[:20])


def registered_url(control_plane: ControlPlane) -> str:
    """The URL of the first webhook in the chart's MutatingWebhookConfiguration ('' if none)."""
    return control_plane.kubectl(
        "get",
        "mutatingwebhookconfiguration",
        WEBHOOK_CONFIG,
        "-o",
        "jsonpath={.webhooks[0].clientConfig.url}",
    ).stdout


def join_all(nodes: list[Node]) -> list[tuple[int, int]]:
    """All nodes call next_rendezvous() at once; (rank, world size) each."""
    return [(info.rank, info.world_size) for info in fixtures.join_all(nodes)]


def test_cluster_role_is_exactly_the_minimal_list(control_plane: ControlPlane) -> None:
    role = json.loads(control_plane.kubectl("get", "clusterrole", OPERATOR, "-o", "json").stdout)
    assert flatten(role) == TODAY | ANNOTATED_JOBS | WEBHOOK
    election = json.loads(
        control_plane.kubectl(
            "-n", NAMESPACE, "get", "role", f"{OPERATOR}-leader-election", "-o", "json"
        ).stdout
    )
    assert flatten(election) == LEADER_ELECTION


@pytest.mark.parametrize(
    ("verb", "resource", "where", "allowed"),
    [
        ("list", "rendezvous.k8s-rendezvous.dev", "-A", True),
        ("patch", "rendezvous.k8s-rendezvous.dev:status", "-A", True),
        ("create", "rendezvousslices.k8s-rendezvous.dev", "-A", True),
        ("patch", "rendezvousslices.k8s-rendezvous.dev", "-A", True),
        ("patch", "pods", "-A", True),
        ("create", "events", "-A", True),
        ("watch", "leases.coordination.k8s.io", "-A", True),
        ("update", "leases.coordination.k8s.io/k8s-rendezvous-operator", NAMESPACE, True),
        ("get", "jobs.batch", "-A", True),
        ("patch", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIG}", "", True),
        ("create", "mutatingwebhookconfigurations", "", True),
        # Denied: everything else.
        ("list", "secrets", "-A", False),
        ("get", "secrets", NAMESPACE, False),
        ("get", "configmaps", "-A", False),
        ("delete", "pods", "-A", False),
        ("create", "pods", "-A", False),
        ("update", "pods", "-A", False),
        ("create", "pods:exec", "-A", False),
        ("update", "rendezvous.k8s-rendezvous.dev", "-A", False),
        ("delete", "rendezvous.k8s-rendezvous.dev", "-A", True),  # only pod-made: the policy
        ("deletecollection", "rendezvous.k8s-rendezvous.dev", "-A", False),
        ("update", "rendezvous.k8s-rendezvous.dev:status", "-A", False),
        ("get", "rendezvousslices.k8s-rendezvous.dev", "-A", False),  # it remembers them
        ("delete", "rendezvousslices.k8s-rendezvous.dev", "-A", False),  # GC does
        ("create", "leases.coordination.k8s.io", "default", False),
        ("patch", "leases.coordination.k8s.io", "-A", False),
        ("delete", "leases.coordination.k8s.io", "-A", True),  # only nodes': the policy
        ("deletecollection", "leases.coordination.k8s.io", "-A", False),
        ("update", "leases.coordination.k8s.io/someone-elses-lock", NAMESPACE, False),
        ("patch", "events", "-A", False),
        ("list", "nodes", "", False),
        ("patch", "nodes", "", False),
        ("patch", "jobs.batch", "-A", False),
        # Webhook configurations: only its own, only patched; never read, never deleted.
        ("patch", "mutatingwebhookconfigurations/someone-elses", "", False),
        ("patch", f"validatingwebhookconfigurations/{WEBHOOK_CONFIG}", "", False),
        ("create", "validatingwebhookconfigurations", "", False),
        ("update", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIG}", "", False),
        ("delete", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIG}", "", False),
        ("delete", "mutatingwebhookconfigurations", "", False),
        ("get", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIG}", "", False),
        ("list", "mutatingwebhookconfigurations", "", False),
        ("watch", "validatingwebhookconfigurations", "", False),
        ("create", "validatingadmissionpolicies", "", False),
        ("patch", "validatingadmissionpolicies/k8s-rendezvous-pod-leases", "", False),
        ("list", "namespaces", "", False),
        ("list", "customresourcedefinitions", "", False),
        ("create", "jobs.batch", "-A", False),
        ("delete", "rolebindings", "-A", False),
        ("bind", "clusterroles/cluster-admin", "", False),
        ("escalate", "clusterroles", "", False),
        ("impersonate", "serviceaccounts", "-A", False),
    ],
)
def test_the_api_server_says_what_it_may_do(
    control_plane: ControlPlane,
    verb: str,
    resource: str,
    where: str,
    allowed: bool,
) -> None:
    """``resource[/name][:subresource]``; ``where``: -A, a namespace, or '' (cluster)."""
    scope = ["-A"] if where == "-A" else (["-n", where] if where else [])
    resource, _, subresource = resource.partition(":")
    if subresource:
        scope.append(f"--subresource={subresource}")
    answer = control_plane.kubectl(
        "auth", "can-i", verb, resource, *scope, f"--as={SUBJECT}", check=False
    ).stdout.strip()
    assert answer == ("yes" if allowed else "no"), f"can-i {verb} {resource} {where}: {answer}"


def test_nodes_join_and_a_round_seals(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
) -> None:
    rdzv = make_rendezvous(3, 3)
    nodes = make_nodes(rdzv, 3)
    assert sorted(join_all(nodes)) == [(0, 3), (1, 3), (2, 3)]
    status = rdzv.status()
    assert (status.state, status.round) == (statuses.RoundState.SEALED, 1)
    # kopf posts Events from a queue of its own, after the status write the nodes saw.
    wait_for(
        lambda: any(reason == "RoundSealed" for _, reason, _ in rdzv.events()),
        30,
        "the RoundSealed Event posted with the operator's token",
    )


def test_a_large_rendezvous_is_published_in_slices_the_nodes_watch(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
) -> None:
    rdzv = make_rendezvous(3, 101, lastCallTimeoutSeconds=0)
    nodes = make_nodes(rdzv, 3)
    assert sorted(join_all(nodes)) == [(0, 3), (1, 3), (2, 3)]
    assert rdzv.status().slices == 2
    fixtures.wait_watching_own_slice(nodes, rdzv.name, 2)


def test_a_deleted_pod_reforms_the_world(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
    admin_api: kubernetes.client.ApiClient,
) -> None:
    """...and the victim's Lease is collected, within the operator's rights."""
    rdzv = make_rendezvous(2, 3)
    nodes = make_nodes(rdzv, 3)
    join_all(nodes)
    victim, survivors = nodes[2], nodes[:2]
    delete_pod(admin_api, rdzv.namespace, victim.pod)
    fixtures.wait_told_to_rejoin(survivors, "survivors told to re-rendezvous")
    assert sorted(join_all(survivors)) == [(0, 2), (1, 2)]
    assert rdzv.status().round == 2
    lost = [message for _, reason, message in rdzv.events() if reason == "MemberLost"]
    assert any(victim.pod in message for message in lost), lost
    coordination = kubernetes.client.CoordinationV1Api(admin_api)
    wait_for(
        lambda: (
            {
                lease.spec.holder_identity
                for lease in coordination.list_namespaced_lease(
                    rdzv.namespace, label_selector=f"{objects.NODE_LABEL}={rdzv.name}"
                ).items
            }
            == {node.pod for node in survivors}
        ),
        15,
        "the deleted pod's Lease collected, the survivors' kept",
    )


def test_a_hung_agent_is_dropped_when_its_heartbeat_expires(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    make_rendezvous: MakeRendezvous,
    make_nodes: MakeNodes,
) -> None:
    rdzv = make_rendezvous(1, 2, heartbeatTimeoutSeconds=3)
    nodes = make_nodes(rdzv, 2)
    join_all(nodes)
    nodes[1].handler.heartbeat.stop()
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 15, "expiry noticed", interval=0.05)
    lost = [message for _, reason, message in rdzv.events() if reason == "MemberLost"]
    assert any(nodes[1].pod in message and "HeartbeatExpired" in message for message in lost), lost
    assert join_all(nodes[:1]) == [(0, 1)]


def test_an_annotated_job_gets_its_rendezvous_kept_in_step_and_its_role_bound(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    batch = kubernetes.client.BatchV1Api(admin_api)
    annotations = {"k8s-rendezvous.dev/nodes": "2:3", "k8s-rendezvous.dev/last-call-timeout": "60"}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "annotations": annotations},
        "spec": {
            "parallelism": 2,
            "template": {
                "spec": {
                    "containers": [{"name": "trainer", "image": "example.invalid/trainer"}],
                    "restartPolicy": "Never",
                }
            },
        },
    }
    batch.create_namespaced_job(workers_namespace, job)
    custom = kubernetes.client.CustomObjectsApi(admin_api)

    def spec() -> dict[str, object] | None:
        try:
            body = custom.get_namespaced_custom_object(
                objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, "train"
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return dict(body["spec"])

    assert wait_for(spec, 30, "the Job's Rendezvous created")["lastCallTimeoutSeconds"] == 60
    rbac = kubernetes.client.RbacAuthorizationV1Api(admin_api)
    binding = wait_for(
        lambda: next(
            (
                b
                for b in rbac.list_namespaced_role_binding(workers_namespace).items
                if b.role_ref.name == WORKER_ROLE and b.metadata.name != WORKER_ROLE
            ),
            None,
        ),
        30,
        "the operator bound the worker role for the Job's ServiceAccount",
    )
    assert binding.subjects[0].name == "default"
    (owner,) = binding.metadata.owner_references
    assert (owner.kind, owner.name) == ("Job", "train"), "removed with the Job"
    batch.patch_namespaced_job(
        "train",
        workers_namespace,
        {"metadata": {"annotations": {"k8s-rendezvous.dev/last-call-timeout": "5"}}},
    )
    wait_for(
        lambda: (spec() or {}).get("lastCallTimeoutSeconds") == 5,
        30,
        "the Rendezvous spec follows the annotation",
    )


def test_rank_order_reads_the_nodes_pods_run_on(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    rdzv = make_rendezvous(3, 3, rankOrder={"nodeLabel": "topology.kubernetes.io/zone"})
    placement = {"p-1": "kwok-node-2", "p-2": "kwok-node-0", "p-3": "kwok-node-1"}
    pods = fixtures.create_pods(admin_api, workers_namespace, list(placement), placement=placement)
    nodes = attach_nodes(rdzv, pods)
    ranks = dict(zip((n.pod for n in nodes), join_all(nodes), strict=True))
    # zone-a (kwok-node-0), zone-b (kwok-node-1), zone-c (kwok-node-2)
    assert sorted(ranks, key=lambda pod: ranks[pod][0]) == ["p-2", "p-3", "p-1"]


def test_annotated_job_permissions_suffice_and_bind_only_the_worker_role(
    chart_operator: ChartOperator,
    control_plane: ControlPlane,
    make_namespace: Callable[[], str],
) -> None:
    """What annotated-Job support will do, done with the operator's own token."""
    kubeconfig = json.loads(Path(chart_operator.kubeconfig).read_text())
    api = control_plane.client_for_token(kubeconfig["users"][0]["user"]["token"])
    team = make_namespace()
    kubernetes.client.BatchV1Api(api).list_job_for_all_namespaces(limit=1)
    kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        team,
        objects.PLURAL,
        {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": "job-train"},
            "spec": {"minNodes": 1, "maxNodes": 1, "runId": "job-train"},
        },
    )
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)

    def binding(role: str) -> dict[str, object]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"bind-{role}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": team}],
        }

    rbac.create_namespaced_role_binding(team, binding(WORKER_ROLE))  # type: ignore[arg-type]
    with pytest.raises(ApiException) as error:
        rbac.create_namespaced_role_binding(team, binding("edit"))  # type: ignore[arg-type]
    assert error.value.status == 403
    assert "is attempting to grant RBAC permissions not currently held" in str(error.value.body)


def make_job(
    api: kubernetes.client.ApiClient, namespace: str, name: str, annotations: dict[str, str]
) -> None:
    kubernetes.client.BatchV1Api(api).create_namespaced_job(
        namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {
                "parallelism": 1,
                "template": {
                    "spec": {
                        "containers": [{"name": "trainer", "image": "example.invalid/trainer"}],
                        "restartPolicy": "Never",
                    }
                },
            },
        },
    )


def job_pod(api: kubernetes.client.ApiClient, namespace: str, job: str) -> dict[str, Any]:
    """The Job's first pod, as admitted (the webhook runs when the Job controller creates it)."""
    core = kubernetes.client.CoreV1Api(api)

    def created() -> dict[str, Any] | None:
        pods = read_object(
            core.list_namespaced_pod,
            namespace,
            label_selector=f"batch.kubernetes.io/job-name={job}",
        )["items"]
        return pods[0] if pods else None

    return wait_for(created, 60, f"a pod of Job {namespace}/{job}")


def test_the_webhook_gives_only_annotated_job_pods_torchruns_environment(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    """The webhook with exactly the chart's RBAC: the operator patched its configuration
    (the chart made it) with its own token, and serves the pods the Job controller
    creates."""
    annotations = {"k8s-rendezvous.dev/nodes": "1:2", "k8s-rendezvous.dev/run-id": "exp-7"}
    make_job(admin_api, workers_namespace, "zero-flag", annotations)
    make_job(admin_api, workers_namespace, "plain", {})

    injected = job_pod(admin_api, workers_namespace, "zero-flag")
    env = {e["name"]: e for e in injected["spec"]["containers"][0].get("env") or []}
    assert env["PET_RDZV_BACKEND"]["value"] == "kubernetes"
    assert env["PET_RDZV_ENDPOINT"]["value"] == "zero-flag"
    assert env["PET_NNODES"]["value"] == "1:2"
    assert env["PET_RDZV_ID"]["value"] == "exp-7"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert injected["metadata"]["labels"][objects.NODE_LABEL] == "zero-flag"
    plain = job_pod(admin_api, workers_namespace, "plain")
    assert not plain["spec"]["containers"][0].get("env"), "a pod of an unannotated Job"
    assert objects.NODE_LABEL not in plain["metadata"]["labels"]

    # The configuration as the operator registered it: served on 127.0.0.1 with
    # failurePolicy Ignore, the chart's timeout, the job-name objectSelector, and the
    # namespaces it watches (none given: all but the system ones).
    mutating = json.loads(
        control_plane.kubectl(
            "get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, "-o", "json"
        ).stdout
    )
    (webhook,) = mutating["webhooks"]
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["objectSelector"] == {
        "matchExpressions": [{"key": "batch.kubernetes.io/job-name", "operator": "Exists"}]
    }
    assert webhook["timeoutSeconds"] == 5
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "kube-node-lease", "kube-public"],
            }
        ]
    }

    # What the webhook does when a Job's watch event is late (reads the Job), done with
    # the operator's own token; and the operator is still running (a 403 would stop kopf).
    kubeconfig = json.loads(Path(chart_operator.kubeconfig).read_text())
    api = control_plane.client_for_token(kubeconfig["users"][0]["user"]["token"])
    job = kubernetes.client.BatchV1Api(api).read_namespaced_job("zero-flag", workers_namespace)
    assert job.metadata.annotations["k8s-rendezvous.dev/nodes"] == "1:2"
    assert chart_operator.returncode() is None


def operator_api(chart_operator: ChartOperator, control_plane: ControlPlane) -> Any:
    kubeconfig = json.loads(Path(chart_operator.kubeconfig).read_text())
    return control_plane.client_for_token(kubeconfig["users"][0]["user"]["token"])


def refused_by_policy(call: Callable[[], object]) -> str:
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status == 403, error.value.body
    message = str(json.loads(error.value.body)["message"])
    assert "k8s-rendezvous-operator-writes" in message, message
    return message


def test_the_operators_identity_changes_only_the_rendezvous_label_of_a_pod(
    chart_operator: ChartOperator,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    (pod,) = fixtures.create_pods(admin_api, workers_namespace, ["victim-0"])
    core = kubernetes.client.CoreV1Api(operator_api(chart_operator, control_plane))
    labelled = core.patch_namespaced_pod(
        "victim-0", workers_namespace, {"metadata": {"labels": {objects.NODE_LABEL: "r"}}}
    )
    assert labelled.metadata.labels[objects.NODE_LABEL] == "r"
    image = {"spec": {"containers": [{"name": "agent", "image": "example.invalid/evil"}]}}
    message = refused_by_policy(
        lambda: core.patch_namespaced_pod("victim-0", workers_namespace, image)
    )
    assert "may change only the label k8s-rendezvous.dev/rendezvous of pod victim-0" in message
    refused_by_policy(
        lambda: core.patch_namespaced_pod(
            "victim-0", workers_namespace, {"metadata": {"labels": {"app": "other"}}}
        )
    )
    unchanged = core.read_namespaced_pod("victim-0", workers_namespace)
    assert unchanged.spec.containers[0].image == pod["spec"]["containers"][0]["image"]
    assert "app" not in unchanged.metadata.labels


def test_the_operators_identity_binds_only_the_worker_role_to_its_namespaces_accounts(
    chart_operator: ChartOperator,
    control_plane: ControlPlane,
    make_namespace: Callable[[], str],
) -> None:
    rbac = kubernetes.client.RbacAuthorizationV1Api(operator_api(chart_operator, control_plane))
    team = make_namespace()

    def binding(subject: dict[str, str]) -> dict[str, object]:
        return {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"generateName": "attempt-"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": WORKER_ROLE,
            },
            "subjects": [subject],
        }

    everyone = {
        "kind": "Group",
        "name": "system:authenticated",
        "apiGroup": "rbac.authorization.k8s.io",
    }
    message = refused_by_policy(
        lambda: rbac.create_namespaced_role_binding(team, binding(everyone))  # type: ignore[arg-type]
    )
    assert f"and only to ServiceAccounts of namespace {team}" in message
    elsewhere = {"kind": "ServiceAccount", "name": "default", "namespace": "kube-system"}
    refused_by_policy(
        lambda: rbac.create_namespaced_role_binding(team, binding(elsewhere))  # type: ignore[arg-type]
    )
    own = {"kind": "ServiceAccount", "name": "default", "namespace": team}
    assert rbac.create_namespaced_role_binding(team, binding(own))  # type: ignore[arg-type]


def test_the_operators_identity_writes_only_its_own_webhook_configuration(
    chart_operator: ChartOperator, control_plane: ControlPlane
) -> None:
    admission = kubernetes.client.AdmissionregistrationV1Api(
        operator_api(chart_operator, control_plane)
    )
    evil = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "evil"},
        "webhooks": [],
    }
    message = refused_by_policy(
        lambda: admission.create_mutating_webhook_configuration(evil)  # type: ignore[arg-type]
    )
    assert f"may write only its own webhook configuration {WEBHOOK_CONFIG}, not evil" in message


def test_the_operators_identity_deletes_only_a_rendezvous_a_pod_made(
    chart_operator: ChartOperator,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    """It deletes a pod-made Rendezvous under an annotated Job's name, to make the Job's:
    never one a user made, which is theirs to delete."""
    admin = kubernetes.client.CustomObjectsApi(admin_api)
    operator = kubernetes.client.CustomObjectsApi(operator_api(chart_operator, control_plane))

    def create(name: str, annotations: dict[str, str]) -> None:
        body = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"minNodes": 1, "maxNodes": 1, "runId": name},
        }
        admin.create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, body
        )

    def delete(name: str) -> object:
        return operator.delete_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, name
        )

    create("users", {})
    message = refused_by_policy(lambda: delete("users"))
    assert "may delete only a Rendezvous a pod made (annotation" in message
    assert "k8s-rendezvous.dev/created-by-pod), not users" in message
    create("pod-made", {objects.CREATED_BY_ANNOTATION: "some-pod"})
    assert delete("pod-made")


def test_the_operators_identity_deletes_only_a_nodes_lease(
    chart_operator: ChartOperator,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    """It collects gone pods' Leases: never another Lease, its own leader-election Lease
    (which it keeps holding) nor one a user or a kubelet made."""
    admin = kubernetes.client.CoordinationV1Api(admin_api)
    operator = kubernetes.client.CoordinationV1Api(operator_api(chart_operator, control_plane))

    def create(name: str, labels: dict[str, str]) -> None:
        body = {"metadata": {"name": name, "labels": labels}, "spec": {"holderIdentity": "x"}}
        admin.create_namespaced_lease(workers_namespace, body)

    create("users-lock", {"app": "other"})
    message = refused_by_policy(
        lambda: operator.delete_namespaced_lease("users-lock", workers_namespace)
    )
    assert "may delete only a rendezvous node Lease (label" in message
    assert "k8s-rendezvous.dev/rendezvous), not Lease users-lock" in message
    refused_by_policy(lambda: operator.delete_namespaced_lease(OPERATOR, NAMESPACE))
    assert admin.read_namespaced_lease(OPERATOR, NAMESPACE).spec.holder_identity
    create("r.gone-pod", {objects.NODE_LABEL: "r"})
    assert operator.delete_namespaced_lease("r.gone-pod", workers_namespace)
    assert chart_operator.returncode() is None


def test_a_pod_made_rendezvous_under_an_annotated_jobs_name_is_replaced_within_its_rights(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
) -> None:
    """The operator's delete of a squatter and create of the Job's pass its RBAC and
    its policy (operator_log: nothing refused)."""
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    squatter = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": "squatted", "annotations": {objects.CREATED_BY_ANNOTATION: "gone"}},
        "spec": {"minNodes": 1, "maxNodes": 1, "runId": "squatted"},
    }
    made = custom.create_namespaced_custom_object(
        objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, squatter
    )
    job = kubernetes.client.BatchV1Api(admin_api).create_namespaced_job(
        workers_namespace,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "squatted", "annotations": {"k8s-rendezvous.dev/nodes": "1"}},
            "spec": {
                "template": {
                    "spec": {
                        "containers": [{"name": "trainer", "image": "example.invalid/trainer"}],
                        "restartPolicy": "Never",
                    }
                }
            },
        },
    )

    def owned_by_job() -> dict[str, Any] | None:
        try:
            body = custom.get_namespaced_custom_object(
                objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, "squatted"
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        owners = body["metadata"].get("ownerReferences") or []
        return body if [o["uid"] for o in owners] == [job.metadata.uid] else None

    replaced = wait_for(owned_by_job, 30, "the Job's Rendezvous in place of the pod-made one")
    assert replaced["metadata"]["uid"] != made["metadata"]["uid"]


def test_a_job_naming_a_missing_service_account_gets_no_binding_until_it_exists(
    chart_operator: ChartOperator,
    operator_log: Callable[[], str],
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    make_namespace: Callable[[], str],
) -> None:
    team = make_namespace()
    batch = kubernetes.client.BatchV1Api(admin_api)
    template = {"containers": [{"name": "trainer", "image": "example.invalid/trainer"}]}
    batch.create_namespaced_job(
        team,
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "ghost", "annotations": {"k8s-rendezvous.dev/nodes": "1"}},
            "spec": {
                "template": {
                    "spec": {**template, "restartPolicy": "Never", "serviceAccountName": "ghost"}
                }
            },
        },
    )
    core = kubernetes.client.CoreV1Api(admin_api)

    def warned() -> str | None:
        events = core.list_namespaced_event(team, field_selector="involvedObject.name=ghost")
        return next((e.message for e in events.items if e.reason == "ServiceAccountNotFound"), None)

    message = wait_for(warned, 30, "ServiceAccountNotFound on the Job")
    assert "ServiceAccount ghost does not exist, so the worker role is not bound" in message
    rbac = kubernetes.client.RbacAuthorizationV1Api(admin_api)
    assert not [
        b for b in rbac.list_namespaced_role_binding(team).items if b.role_ref.name == WORKER_ROLE
    ]
    control_plane.kubectl("-n", team, "create", "serviceaccount", "ghost")
    bound = wait_for(
        lambda: (
            [
                b
                for b in rbac.list_namespaced_role_binding(team).items
                if b.role_ref.name == WORKER_ROLE
            ]
            or None
        ),
        60,
        "the worker role bound once the ServiceAccount exists",
    )
    assert [s.name for s in bound[0].subjects] == ["ghost"]


def notes_commands(notes: str, namespace: str) -> tuple[list[str], str, list[str]]:
    """What the release's NOTES tell a user to run, for namespace ``namespace`` (theirs
    say "team"): the worker role's binding, the Rendezvous' YAML, torchrun's words."""
    lines = notes.splitlines()
    start = next(i for i, line in enumerate(lines) if "create rolebinding" in line)
    binding = ""
    for line in lines[start:]:
        binding += line.strip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            break
    yaml_text = notes.split("<<'YAML'\n", 1)[1].split("\n     YAML", 1)[0]
    (torchrun,) = [line.strip() for line in lines if line.strip().startswith("torchrun ")]

    def here(words: list[str]) -> list[str]:
        return [w.replace("team:", f"{namespace}:") if w != "team" else namespace for w in words]

    return here(shlex.split(binding)), yaml_text, shlex.split(torchrun)


def test_the_notes_rendezvous_admits_the_pods_they_name_and_a_round_seals(
    chart_operator: ChartOperator,
    cluster_helm: Helm,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """The release's own NOTES (helm get notes), followed word for word: the RoleBinding
    command, the Rendezvous YAML applied to the real API server, pods labelled as they say
    and torchrun's flags; two pods join and a round seals. (A Rendezvous with no
    podSelector, as they once gave, admits nobody; a torchrun without --rdzv-id is refused.)"""
    notes = cluster_helm.run("get", "notes", RELEASE, "--namespace", NAMESPACE).stdout
    binding, yaml_text, torchrun = notes_commands(notes, workers_namespace)
    assert "POD_NAME" not in notes, "a pod's name comes from its token: nothing to set"
    # The worker role's binding the workers_namespace fixture made, made anew as NOTES say.
    control_plane.kubectl("-n", workers_namespace, "delete", "rolebinding", WORKER_ROLE)
    assert binding[0] == "kubectl"
    control_plane.kubectl(*binding[1:])
    control_plane.kubectl("-n", workers_namespace, "apply", "-f", "-", input=yaml_text)
    rendezvous = yaml.safe_load(yaml_text)
    flags = dict(word.removeprefix("--").split("=", 1) for word in torchrun if "=" in word)
    assert flags["rdzv-backend"] == "kubernetes"
    assert flags["rdzv-endpoint"] == rendezvous["metadata"]["name"]
    assert flags["rdzv-id"] == rendezvous["spec"]["runId"], "else every node is refused"
    labels = rendezvous["spec"]["podSelector"]["matchLabels"]
    assert f"label the training pods {','.join(f'{k}: {v}' for k, v in labels.items())}" in notes
    low, high = (int(n) for n in flags["nnodes"].split(":"))
    pods = fixtures.create_pods(admin_api, workers_namespace, ["notes-0", "notes-1"], labels=labels)
    rdzv = Rendezvous(admin_api, workers_namespace, flags["rdzv-endpoint"])
    nodes = attach_nodes(rdzv, pods, min_nodes=low, max_nodes=high)
    assert sorted(join_all(nodes)) == [(0, 2), (1, 2)]
    assert rdzv.status().state is statuses.RoundState.SEALED
