"""Workloads against the real control plane: annotated Jobs (pods made by the Job
controller, scheduled onto kwok nodes), the admission webhook, a non-Job workload that
creates its own Rendezvous, and topology-aware ranks.

Aspects: annotation -> Rendezvous owned by the Job; each bad annotation -> a Warning Event
naming it, and no resource until fixed; parallelism up and down grows and shrinks the
world; a failed pod retried by the Job rejoins; Job complete/failed closes, Job deleted
removes; the worker role is bound for the Job's ServiceAccount; the webhook injects
torchrun's env and leaves other pods alone; a StatefulSet's pods create their Rendezvous;
rank order groups newcomers by zone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import (
    Node,
    Rendezvous,
    create_pods,
    join_all,
    statefulset_pods,
    wait_told_to_rejoin,
)
from tests.support.jobs import (
    job_events,
    job_pods,
    make_job,
    running_pods,
    wait_webhook_registered,
)
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from devkit import namespaces, training
from devkit.cluster.controlplane import ControlPlane, read_object, set_pod_phase
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import kube
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import objects, statuses, tunables

pytestmark = pytest.mark.usefixtures("operator_process")

AttachNodes = Callable[..., list[Node]]


def test_annotated_job_gets_an_owned_rendezvous_and_its_pods_form_a_round(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
    recorded: Callable[[str], Rendezvous],
) -> None:
    job = make_job(
        admin_api,
        workers_namespace,
        "train",
        2,
        {
            "k8s-rendezvous.dev/nodes": "2:3",
            "k8s-rendezvous.dev/last-call-timeout": "60",
            "k8s-rendezvous.dev/max-restarts": "5",
        },
    )
    rdzv = recorded("train")
    body = wait_for(lambda: _get(rdzv), 30, "Rendezvous created for the Job")
    assert body["spec"]["minNodes"] == 2 and body["spec"]["maxNodes"] == 3
    assert body["spec"]["lastCallTimeoutSeconds"] == 60
    assert body["spec"]["maxRestarts"] == 5
    assert body["spec"]["runId"] == "train"
    (owner,) = body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "Job",
        job["metadata"]["uid"],
        True,
    )
    job_now = read_object(
        kubernetes.client.BatchV1Api(admin_api).read_namespaced_job, "train", workers_namespace
    )
    assert not job_now["metadata"].get("finalizers"), "no finalizer on users' Jobs"
    nodes = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "train", 2))
    started = time.monotonic()
    infos = join_all(nodes)
    # Parallelism 2 is what the Job runs: no last call (60 s) is waited for.
    assert time.monotonic() - started < 30
    assert sorted(info.rank for info in infos) == [0, 1]
    wait_for(
        lambda: any(
            reason == "RoundSealed"
            for _, reason, _ in job_events(admin_api, workers_namespace, "train")
        ),
        10,
        "RoundSealed Event on the Job",
    )
    binding = kubernetes.client.RbacAuthorizationV1Api(admin_api).read_namespaced_role_binding(
        "k8s-rendezvous-worker-job-train", workers_namespace
    )
    assert binding.role_ref.name == "k8s-rendezvous-worker"
    assert [s.name for s in binding.subjects] == ["default"]
    (owner,) = binding.metadata.owner_references
    assert (owner.kind, owner.uid) == ("Job", job["metadata"]["uid"]), "goes with the Job"


def _get(rdzv: Rendezvous) -> dict[str, Any] | None:
    try:
        return rdzv.body()
    except kubernetes.client.exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise


def test_a_job_with_thousands_of_bad_annotations_gets_one_warning(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    unknown = {f"k8s-rendezvous.dev/key-{index}": "x" for index in range(2000)}
    make_job(admin_api, workers_namespace, "noisy", 2, {"k8s-rendezvous.dev/nodes": "2", **unknown})

    def warnings() -> list[str]:
        return [
            m
            for _, r, m in job_events(admin_api, workers_namespace, "noisy")
            if r == "InvalidAnnotation"
        ]

    (warning,) = wait_for(lambda: w if (w := warnings()) else None, 30, "InvalidAnnotation")
    assert "key-0='x': unknown key" in warning and warning.endswith(
        "and 1997 more (the operator's log names each)"
    ), warning
    assert _get(Rendezvous(admin_api, workers_namespace, "noisy")) is None
    assert len(warnings()) == 1


@pytest.mark.parametrize(
    ("annotations", "named"),
    [
        ({"k8s-rendezvous.dev/nodes": "4:2"}, "k8s-rendezvous.dev/nodes='4:2'"),
        ({"k8s-rendezvous.dev/nodes": "x"}, "k8s-rendezvous.dev/nodes='x'"),
        ({"k8s-rendezvous.dev/nodes": "3:4"}, "above the Job's parallelism (2)"),
        (
            {"k8s-rendezvous.dev/nodes": "2", "k8s-rendezvous.dev/colour": "red"},
            "k8s-rendezvous.dev/colour='red': unknown key",
        ),
    ],
    ids=["reversed", "not-a-number", "min-above-parallelism", "unknown-key"],
)
def test_bad_annotation_is_reported_on_the_job_and_fixing_it_fixes_the_state(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    annotations: dict[str, str],
    named: str,
) -> None:
    make_job(admin_api, workers_namespace, "bad", 2, annotations)
    warning = wait_for(
        lambda: next(
            (
                m
                for t, r, m in job_events(admin_api, workers_namespace, "bad")
                if r == "InvalidAnnotation"
            ),
            None,
        ),
        30,
        "InvalidAnnotation Event",
    )
    assert named in warning and "accepted:" in warning
    rdzv = Rendezvous(admin_api, workers_namespace, "bad")
    assert _get(rdzv) is None, "no half-made resource"
    fixed = {key: None for key in annotations} | {"k8s-rendezvous.dev/nodes": "1:2"}
    kubernetes.client.BatchV1Api(admin_api).patch_namespaced_job(
        "bad",
        workers_namespace,
        {"metadata": {"annotations": fixed}},
        _content_type="application/merge-patch+json",
    )
    body = wait_for(lambda: _get(rdzv), 30, "Rendezvous created once the annotation is fixed")
    assert (body["spec"]["minNodes"], body["spec"]["maxNodes"]) == (1, 2)


def test_parallelism_up_and_down_grows_and_shrinks_the_world(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
    recorded: Callable[[str], Rendezvous],
) -> None:
    make_job(admin_api, workers_namespace, "elastic", 2, {"k8s-rendezvous.dev/nodes": "1:3"})
    rdzv = recorded("elastic")
    wait_for(lambda: _get(rdzv), 30, "Rendezvous created")
    first = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "elastic", 2))
    join_all(first)
    batch = kubernetes.client.BatchV1Api(admin_api)
    scaled = time.monotonic()
    batch.patch_namespaced_job(
        "elastic",
        workers_namespace,
        {"spec": {"parallelism": 3}},
        _content_type="application/merge-patch+json",
    )
    pods = running_pods(admin_api, workers_namespace, "elastic", 3)
    new_pod = next(p for p in pods if p["metadata"]["name"] not in {n.pod for n in first})
    newcomer = attach_nodes(rdzv, [new_pod])[0]
    late = newcomer.join_in_background()
    wait_told_to_rejoin(first, "running nodes see the new pod", timeout=20)
    print(f"parallelism 2->3 to first waiting signal: {time.monotonic() - scaled:.3f} s")
    grown = join_all(first)
    assert late.wait().world_size == 3 and {i.world_size for i in grown} == {3}

    batch.patch_namespaced_job(
        "elastic",
        workers_namespace,
        {"spec": {"parallelism": 2}},
        _content_type="application/merge-patch+json",
    )
    everyone = [*first, newcomer]
    removed = wait_for(
        lambda: next((n for n in everyone if n.handler.num_nodes_waiting() > 0), None),
        30,
        "a node is removed by the Job controller and noticed",
    )
    remaining = {
        p["metadata"]["name"] for p in running_pods(admin_api, workers_namespace, "elastic", 2)
    }
    survivors = [n for n in everyone if n.pod in remaining]
    assert removed is not None and len(survivors) == 2
    shrunk = join_all(survivors)
    assert {i.world_size for i in shrunk} == {2}


def test_failed_pod_is_replaced_by_the_job_and_the_replacement_joins(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
    recorded: Callable[[str], Rendezvous],
) -> None:
    make_job(
        admin_api, workers_namespace, "retry", 2, {"k8s-rendezvous.dev/nodes": "2"}, backoffLimit=3
    )
    rdzv = recorded("retry")
    wait_for(lambda: _get(rdzv), 30, "Rendezvous created")
    nodes = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "retry", 2))
    join_all(nodes)
    set_pod_phase(admin_api, workers_namespace, nodes[1].pod, "Failed", exit_code=1)
    wait_for(lambda: nodes[0].handler.num_nodes_waiting() > 0, 20, "failure noticed", interval=0.02)
    pods = running_pods(admin_api, workers_namespace, "retry", 2)
    replacement = next(p for p in pods if p["metadata"]["name"] != nodes[0].pod)
    assert replacement["metadata"]["name"] != nodes[1].pod
    new_node = attach_nodes(rdzv, [replacement])[0]
    infos = join_all([nodes[0], new_node])
    assert {i.world_size for i in infos} == {2}
    rdzv.wait_events("MemberLost", lambda m: nodes[1].pod in m and "PodFailed" in m)


PRODUCTION_JOB: dict[str, Any] = {
    **training.PRODUCTION_SPEC,
    "backoffLimit": None,
    # 0: a single failure counted would fail the index at once.
    "backoffLimitPerIndex": 0,
}
"""The production Job of docs/annotations.md (tests/tooling/test_production_job.py holds
the docs to the dev kit's), its budget per index cut to 0."""


def test_the_production_job_replaces_a_pod_lost_to_a_disruption_and_counts_nothing(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    """Each Job loses a pod as a kubelet evicting it for node pressure reports it (Failed,
    DisruptionTarget): the real Job controller replaces it in both, and counts it only in
    the Job of the API's defaults, which the operator warns about, once."""
    nodes = {"k8s-rendezvous.dev/nodes": "1:2"}
    make_job(admin_api, workers_namespace, "kept", 2, nodes, completions=2, **PRODUCTION_JOB)
    make_job(admin_api, workers_namespace, "counted", 2, nodes)
    batch = kubernetes.client.BatchV1Api(admin_api)
    for job in ("kept", "counted"):
        victim = running_pods(admin_api, workers_namespace, job, 2)[0]["metadata"]["name"]
        set_pod_phase(
            admin_api,
            workers_namespace,
            victim,
            "Failed",
            exit_code=143,
            disruption="TerminationByKubelet",
            message="The node was low on resource: memory.",
        )
        pods = wait_for(
            lambda job=job, victim=victim: (
                found
                if len(found := job_pods(admin_api, workers_namespace, job)) == 2
                and victim not in {p["metadata"]["name"] for p in found}
                else None
            ),
            60,
            f"Job {job} replaced the pod it lost",
        )
        assert len(pods) == 2
    kept = read_object(batch.read_namespaced_job_status, "kept", workers_namespace)["status"]
    assert not kept.get("failed") and not kept.get("failedIndexes"), kept
    wait_for(
        lambda: (
            read_object(batch.read_namespaced_job_status, "counted", workers_namespace)[
                "status"
            ].get("failed")
            == 1
        ),
        30,
        "the Job of the API's defaults counted the lost pod as failed",
    )

    def warned(job: str) -> list[str]:
        return [
            m for _, r, m in job_events(admin_api, workers_namespace, job) if r == "PodLossesEndJob"
        ]

    (warning,) = wait_for(lambda: warned("counted") or None, 30, "PodLossesEndJob on the Job")
    assert "7 (backoffLimit + 1) fail the whole Job" in warning, warning
    assert "onPodConditions: [{type: DisruptionTarget}]" in warning, warning
    # Both Jobs' Rendezvous were made (the operator handled both) and only one was warned.
    assert any(
        r == "RendezvousCreated" for _, r, _ in job_events(admin_api, workers_namespace, "kept")
    )
    assert warned("kept") == []
    assert len(warned("counted")) == 1


# A member's pod succeeding closes the rendezvous before the Job's Complete condition
# comes (NodeFinished); a failed one is lost, and the Job's failure closes it.
@pytest.mark.parametrize(
    ("phase", "reason"), [("Succeeded", "NodeFinished"), ("Failed", "JobFailed")]
)
def test_finished_job_closes_the_rendezvous_and_deletion_removes_it(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
    phase: str,
    reason: str,
    recorded: Callable[[str], Rendezvous],
) -> None:
    make_job(
        admin_api,
        workers_namespace,
        "done",
        1,
        {"k8s-rendezvous.dev/nodes": "1"},
        backoffLimit=0,
        completions=1,
    )
    rdzv = recorded("done")
    wait_for(lambda: _get(rdzv), 30, "Rendezvous created")
    (node,) = attach_nodes(rdzv, running_pods(admin_api, workers_namespace, "done", 1))
    join_all([node])
    set_pod_phase(admin_api, workers_namespace, node.pod, phase)
    status = rdzv.wait(
        lambda s: s.state is statuses.RoundState.CLOSED, "closed with the Job", timeout=60
    )
    assert status.closed_reason == reason
    kubernetes.client.BatchV1Api(admin_api).delete_namespaced_job(
        "done", workers_namespace, propagation_policy="Background"
    )
    wait_for(lambda: _get(rdzv) is None, 60, "Rendezvous garbage-collected with its Job")


@pytest.mark.webhook
def test_webhook_injects_torchrun_env_into_annotated_job_pods_only(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str, control_plane: ControlPlane
) -> None:
    wait_webhook_registered(control_plane, workers_namespace)
    make_job(
        admin_api,
        workers_namespace,
        "zero-flag",
        1,
        {
            "k8s-rendezvous.dev/nodes": "1:4",
            "k8s-rendezvous.dev/run-id": "exp-3",
            "k8s-rendezvous.dev/health-check": "nccl-check --size '1 G'",
            "k8s-rendezvous.dev/in-place": "true",
            "k8s-rendezvous.dev/warm-start": "1",
        },
    )
    make_job(admin_api, workers_namespace, "plain", 1, {})
    injected = running_pods(admin_api, workers_namespace, "zero-flag", 1)[0]
    env = {e["name"]: e for e in injected["spec"]["containers"][0]["env"]}
    assert env["PET_RDZV_BACKEND"]["value"] == "kubernetes"
    assert env["PET_RDZV_ENDPOINT"]["value"] == "zero-flag"
    assert env["PET_NNODES"]["value"] == "1:4"
    assert env["PET_RDZV_ID"]["value"] == "exp-3"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[tunables.HEALTH_CHECK_ENV]["value"] == "nccl-check --size '1 G'"
    assert env["K8S_RENDEZVOUS_IN_PLACE"]["value"] == "true"
    assert env["K8S_RENDEZVOUS_WARM_START"]["value"] == "1"
    assert tunables.HEALTH_CHECK_TIMEOUT_ENV not in env, "only what the Job's annotations say"
    assert "K8S_RENDEZVOUS_IN_PLACE_LOSS_TIMEOUT" not in env
    assert injected["metadata"]["labels"][objects.NODE_LABEL] == "zero-flag"
    plain = running_pods(admin_api, workers_namespace, "plain", 1)[0]
    assert not plain["spec"]["containers"][0].get("env")
    assert objects.NODE_LABEL not in plain["metadata"]["labels"]


@pytest.mark.webhook
@pytest.mark.parametrize(
    ("annotations", "named"),
    [
        ({"k8s-rendezvous.dev/nodes": "1:999999"}, "k8s-rendezvous.dev/nodes='1:999999'"),
        (
            {"k8s-rendezvous.dev/nodes": "1", "k8s-rendezvous.dev/rank-order": "k" * 318},
            "k8s-rendezvous.dev/rank-order=",
        ),
    ],
    ids=["max-above-the-crd-bound", "rank-order-key-318-characters"],
)
def test_an_annotation_the_crd_would_refuse_is_reported_and_its_pods_get_no_env(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    control_plane: ControlPlane,
    annotations: dict[str, str],
    named: str,
) -> None:
    """Values that parse but the Rendezvous schema refuses: an Event that names the key,
    no Rendezvous, and pods without torchrun's environment (torchrun would fail on the
    missing Rendezvous anyway; without the env it says nothing about rendezvous)."""
    wait_webhook_registered(control_plane, workers_namespace)
    make_job(admin_api, workers_namespace, "refused", 1, annotations)
    warning = wait_for(
        lambda: next(
            (
                m
                for _, reason, m in job_events(admin_api, workers_namespace, "refused")
                if reason == "InvalidAnnotation"
            ),
            None,
        ),
        30,
        "InvalidAnnotation Event",
    )
    assert named in warning and "accepted:" in warning, warning
    (pod,) = running_pods(admin_api, workers_namespace, "refused", 1)
    assert not pod["spec"]["containers"][0].get("env"), pod["spec"]["containers"][0]
    assert _get(Rendezvous(admin_api, workers_namespace, "refused")) is None


@pytest.mark.webhook
def test_a_hung_operator_never_blocks_the_pods_its_webhook_is_sent(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    control_plane: ControlPlane,
    operator_process: OperatorProcess,
) -> None:
    """Registered by the operator itself: a few seconds' timeout (not kopf's fixed 30 s),
    failure policy Ignore, and only the namespaces it watches. While it hangs (SIGSTOP: its
    port accepts connections and never answers), a pod it would be sent is admitted,
    without the environment."""
    wait_webhook_registered(control_plane, workers_namespace)
    configuration = read_object(
        kubernetes.client.AdmissionregistrationV1Api(admin_api).read_mutating_webhook_configuration,
        f"torchrun-env.{workers_namespace}.k8s-rendezvous.dev",
    )
    (webhook,) = configuration["webhooks"]
    assert (webhook["timeoutSeconds"], webhook["failurePolicy"]) == (5, "Ignore")
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [workers_namespace]}
        ]
    }
    operator_process.pause()
    try:
        (pod,) = create_pods(
            admin_api,
            workers_namespace,
            ["hung-0"],
            labels={"batch.kubernetes.io/job-name": "hung"},
        )
    finally:
        operator_process.resume()
    assert not pod["spec"]["containers"][0].get("env"), "admitted without the environment"


def pod_node(
    control_plane: ControlPlane, namespace: str, pod: dict[str, Any], rendezvous: str, nodes: int
) -> Node:
    """A handler in ``pod``, with its own token, for ``rendezvous`` of ``nodes`` nodes."""
    token = control_plane.token_for(
        namespace, "default", pod_name=pod["metadata"]["name"], pod_uid=pod["metadata"]["uid"]
    )
    api = control_plane.client_for_token(token)
    client = kube.RendezvousClient(api, namespace, rendezvous, retry_seconds=20)
    handler = KubernetesRendezvousHandler(
        client,
        run_id=rendezvous,
        node=pod["metadata"]["name"],
        addr=pod["status"]["podIP"],
        min_nodes=nodes,
        max_nodes=nodes,
    )
    return Node(handler.node, handler.addr, handler, api)


def test_statefulset_pods_create_their_rendezvous_owned_by_the_statefulset(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str, control_plane: ControlPlane
) -> None:
    namespaces.bind_creator_role(admin_api, workers_namespace)
    sts_uid, pods = statefulset_pods(admin_api, workers_namespace, "sts", 2)
    nodes = [pod_node(control_plane, workers_namespace, pod, "sts-train", 2) for pod in pods]
    try:
        infos = join_all(nodes)
        assert sorted(i.rank for i in infos) == [0, 1]
        rdzv = Rendezvous(admin_api, workers_namespace, "sts-train")
        body = rdzv.body()
        (owner,) = body["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("StatefulSet", "sts", sts_uid)
        assert (body["spec"]["minNodes"], body["spec"]["maxNodes"], body["spec"]["runId"]) == (
            2,
            2,
            "sts-train",
        )
    finally:
        for node in nodes:
            node.handler.shutdown()
            node.api.close()


def test_set_closed_before_the_rendezvous_exists_makes_it_closed_as_with_c10d(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str, control_plane: ControlPlane
) -> None:
    """c10d's set_closed() writes a closed state where there was none: a node that closes
    first makes the Rendezvous (its creator role), the operator closes it, and the other
    node's next_rendezvous() raises RendezvousClosedError instead of waiting to join."""
    namespaces.bind_creator_role(admin_api, workers_namespace)
    _, pods = statefulset_pods(admin_api, workers_namespace, "early", 2)
    closing, late = (pod_node(control_plane, workers_namespace, pod, "early", 2) for pod in pods)
    try:
        closing.handler.set_closed()
        assert closing.handler.is_closed()
        rdzv = Rendezvous(admin_api, workers_namespace, "early")
        closed = rdzv.wait(
            lambda s: s.state is statuses.RoundState.CLOSED, "closed by the operator"
        )
        assert closed.closed_reason is not None
        with pytest.raises(RendezvousClosedError):
            late.handler.next_rendezvous()
        assert late.handler.is_closed()
    finally:
        for node in (closing, late):
            node.handler.shutdown()
            node.api.close()


def test_a_rendezvous_made_by_a_bare_pod_gets_no_owner_and_says_why(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
) -> None:
    namespaces.bind_creator_role(admin_api, workers_namespace)
    rdzv = Rendezvous(admin_api, workers_namespace, "loner-train")
    (node,) = attach_nodes(rdzv, create_pods(admin_api, workers_namespace, ["loner"]))
    node.join_in_background()  # it makes the Rendezvous, then waits to be admitted
    message = wait_for(
        lambda: next((m for _, r, m in rdzv.events() if r == "NoOwner"), None),
        30,
        "a NoOwner Warning on the Rendezvous",
    )
    assert message.startswith(
        "Rendezvous loner-train was made by pod loner, which has no controller (a bare pod): "
        "there is no workload to check its nodes against, so it admits nobody."
    )
    body = rdzv.body()
    assert body["metadata"]["annotations"][objects.CREATED_BY_ANNOTATION] == "loner"
    assert not body["metadata"].get("ownerReferences")


def test_rank_order_groups_newcomers_by_zone(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: AttachNodes,
    make_rendezvous: Callable[..., Rendezvous],
) -> None:
    rdzv = make_rendezvous(4, 4, rankOrder={"nodeLabel": "topology.kubernetes.io/zone"})
    placement = {
        "p-1": "kwok-node-2",
        "p-2": "kwok-node-0",
        "p-3": "kwok-node-2",
        "p-4": "kwok-node-1",
    }
    pods = create_pods(admin_api, workers_namespace, list(placement), placement=placement)
    nodes = attach_nodes(rdzv, pods)
    infos = dict(zip((n.pod for n in nodes), join_all(nodes), strict=True))
    by_rank = [pod for pod, _ in sorted(infos.items(), key=lambda item: item[1].rank)]
    # zone-a (node-0), zone-b (node-1), zone-c (node-2); natural name order within a zone
    assert by_rank == ["p-2", "p-4", "p-1", "p-3"]


def test_pods_made_without_the_webhook_are_reported_on_the_job_and_the_pod(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    # No webhook serves this operator (as in a rollout): the Job's pods get no env.
    annotations = {"k8s-rendezvous.dev/nodes": "2"}
    configured = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "example.invalid/trainer",
                    "env": [{"name": "PET_RDZV_BACKEND", "value": "kubernetes"}],
                }
            ],
            "restartPolicy": "Never",
        }
    }
    make_job(admin_api, workers_namespace, "by-hand", 1, annotations, template=configured)
    make_job(admin_api, workers_namespace, "uninjected", 2, annotations)
    pods = running_pods(admin_api, workers_namespace, "uninjected", 2)

    def reported(job: str) -> list[str]:
        events = job_events(admin_api, workers_namespace, job)
        return [message for _, reason, message in events if reason == "PodNotInjected"]

    warned = wait_for(
        lambda: found if len(found := reported("uninjected")) == 2 else None,
        30,
        "PodNotInjected on the Job for each of its pods",
    )
    core = kubernetes.client.CoreV1Api(admin_api)
    for pod in pods:
        name = pod["metadata"]["name"]
        assert any(name in message and f"Delete pod {name}" in message for message in warned)

        def on_pod(name: str = name) -> list[str] | None:
            found = core.list_namespaced_event(
                workers_namespace,
                field_selector=f"involvedObject.name={name},involvedObject.kind=Pod",
            )
            return [e.reason for e in found.items if e.type == "Warning"] or None

        assert wait_for(on_pod, 10, f"the Warning on pod {name}") == ["PodNotInjected"]
    # The Job that sets the env itself was looked at first, and is not reported.
    assert reported("by-hand") == []


def _keep_out_values(pod: dict[str, Any]) -> list[list[str]]:
    """The hostnames each preferred node affinity term of ``pod`` keeps it off."""
    affinity = (pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    return [
        [
            value
            for expression in term["preference"].get("matchExpressions") or []
            if expression["key"] == "kubernetes.io/hostname" and expression["operator"] == "NotIn"
            for value in expression["values"]
        ]
        for term in affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    ]


@pytest.mark.webhook
def test_a_failed_members_node_is_recorded_and_the_jobs_next_pods_are_kept_off_it(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    control_plane: ControlPlane,
    attach_nodes: AttachNodes,
    recorded: Callable[[str], Rendezvous],
) -> None:
    wait_webhook_registered(control_plane, workers_namespace)
    make_job(
        admin_api,
        workers_namespace,
        "keepout",
        2,
        {"k8s-rendezvous.dev/nodes": "2:3"},
        backoffLimit=3,
    )
    rdzv = recorded("keepout")
    wait_for(lambda: _get(rdzv), 30, "Rendezvous created")
    pods = running_pods(admin_api, workers_namespace, "keepout", 2)
    assert all(not _keep_out_values(pod) for pod in pods), "nothing is kept out at first"
    nodes = attach_nodes(rdzv, pods)
    join_all(nodes)
    failed = next(pod for pod in pods if pod["metadata"]["name"] == nodes[1].pod)
    bad_node = failed["spec"]["nodeName"]
    set_pod_phase(admin_api, workers_namespace, nodes[1].pod, "Failed", exit_code=1)
    status = rdzv.wait(lambda s: bool(s.excluded_nodes), "the failed member's node recorded")
    (entry,) = status.excluded_nodes
    assert (entry.node, entry.reason, entry.pod) == (bad_node, "PodFailed", nodes[1].pod)
    # A pod the Job makes from now on is kept off the node (the replacement the Job made
    # at once may have been admitted before the status was written).
    kubernetes.client.BatchV1Api(admin_api).patch_namespaced_job(
        "keepout", workers_namespace, {"spec": {"parallelism": 3}}
    )
    known = {pod["metadata"]["name"] for pod in pods}
    newest = wait_for(
        lambda: next(
            (
                pod
                for pod in job_pods(admin_api, workers_namespace, "keepout")
                if pod["metadata"]["name"] not in known and _keep_out_values(pod)
            ),
            None,
        ),
        60,
        "a new pod kept off the failed node",
    )
    assert _keep_out_values(newest) == [[bad_node]]
    placed_on = wait_for(
        lambda: next(
            (
                pod["spec"].get("nodeName")
                for pod in job_pods(admin_api, workers_namespace, "keepout")
                if pod["metadata"]["name"] == newest["metadata"]["name"]
            ),
            None,
        ),
        30,
        "the new pod scheduled",
    )
    assert placed_on != bad_node, "the scheduler took the preference: other nodes fit"
    # The user clears the list: the operator empties the status, and pods made next are
    # not kept off anything.
    cleared_at = status.excluded_nodes[0].failed_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    kubernetes.client.CustomObjectsApi(admin_api).patch_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        "keepout",
        {"metadata": {"annotations": {objects.CLEAR_EXCLUDED_NODES_ANNOTATION: cleared_at}}},
    )
    rdzv.wait(lambda s: not s.excluded_nodes, "the list cleared by the annotation")
