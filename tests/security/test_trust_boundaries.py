"""A hostile pod in the same namespace, with its own real pod-bound token, against the real
operator: it may speak only for itself and only in its own workload's rendezvous."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.support import fixtures
from tests.support.fixtures import (
    Node,
    Rendezvous,
    create_pods,
    join_all,
)
from tests.support.hostile import Attacker
from tests.support.jobs import make_job, running_pods, wait_webhook_registered

from devkit import namespaces
from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.errors import NodeRefusedError
from k8s_rendezvous.wire import leases, objects, statuses

pytestmark = pytest.mark.usefixtures("operator_process")

MakeRendezvous = Callable[..., Rendezvous]
SUPPRESSED = "k8s_rendezvous_events_suppressed_total"
REQUESTS = "k8s_rendezvous_api_requests_total"


def refusals(rdzv: Rendezvous) -> list[str]:
    return [message for _, reason, message in rdzv.events() if reason == "NodeRefused"]


def wait_refused(rdzv: Rendezvous, fragment: str) -> str:
    return wait_for(
        lambda: next((m for m in refusals(rdzv) if fragment in m), None),
        30,
        f"a NodeRefused Event on {rdzv.name} saying {fragment!r}",
    )


@pytest.fixture
def two_jobs(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    recorded: Callable[[str], Rendezvous],
    attach_nodes: Callable[..., list[Node]],
) -> tuple[Rendezvous, list[Node], Attacker]:
    """Job ``victim`` (2 nodes, its own Rendezvous) and a pod of Job ``attacker``, whose
    name sorts before the victim's pods: ranked by name, it would be rank 0."""
    make_job(admin_api, workers_namespace, "victim", 2, {"k8s-rendezvous.dev/nodes": "2:2"})
    make_job(admin_api, workers_namespace, "attacker", 1, {"k8s-rendezvous.dev/nodes": "1:1"})
    rdzv = recorded("victim")
    wait_for(lambda: _exists(rdzv), 30, "the victim Job's Rendezvous")
    victims = attach_nodes(
        rdzv, running_pods(admin_api, workers_namespace, "victim", 2), min_nodes=2, max_nodes=2
    )
    (attacker_pod,) = running_pods(admin_api, workers_namespace, "attacker", 1)
    attacker = Attacker(control_plane, workers_namespace, attacker_pod)
    assert attacker.name < min(node.pod for node in victims)
    return rdzv, victims, attacker


def _exists(rdzv: Rendezvous) -> bool:
    try:
        rdzv.body()
    except kubernetes.client.exceptions.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def test_a_pod_of_another_job_is_never_counted_or_ranked(
    two_jobs: tuple[Rendezvous, list[Node], Attacker],
) -> None:
    rdzv, victims, attacker = two_jobs
    attacker.request(rdzv.name, leases.NodeIntent.JOIN)  # its real pod IP: only its Job differs
    message = wait_refused(rdzv, f"pod {attacker.name}")
    assert (
        f"pod {attacker.name} is controlled by Job/attacker, not by Job/victim, which owns "
        "Rendezvous victim: only that workload's pods may join it."
    ) in message
    infos = join_all(victims)
    assert sorted(info.rank for info in infos) == [0, 1]
    sealed = rdzv.status()
    assert sorted(m.node for m in sealed.members) == sorted(n.pod for n in victims)
    assert sealed.master is not None and sealed.master.addr in {n.addr for n in victims}
    assert len(refusals(rdzv)) == 1, "said once per pod"


def test_a_node_of_another_job_ends_with_the_operators_reason(
    two_jobs: tuple[Rendezvous, list[Node], Attacker],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Its own torchrun handler, with its pod's token: refused within seconds, not at its
    join timeout (600 s), and the victims' round forms without it."""
    rdzv, victims, attacker = two_jobs
    (attacker_pod,) = running_pods(admin_api, workers_namespace, "attacker", 1)
    (intruder,) = attach_nodes(rdzv, [attacker_pod], min_nodes=2, max_nodes=2)
    joining = intruder.join_in_background()
    infos = join_all(victims)
    with pytest.raises(NodeRefusedError) as refused:
        joining.wait(60)
    assert str(refused.value) == (
        f"the operator refused node {attacker.name}'s request to join Rendezvous "
        f"{workers_namespace}/victim "
        f"(OtherWorkload): pod {attacker.name} is controlled by Job/attacker, not by "
        "Job/victim, which owns Rendezvous victim: only that workload's pods may join it."
    )
    assert sorted(info.rank for info in infos) == [0, 1]
    assert [refusal.node for refusal in rdzv.status().refused] == [attacker.name]


def test_a_pod_of_another_job_cannot_close_its_rendezvous(
    two_jobs: tuple[Rendezvous, list[Node], Attacker],
) -> None:
    rdzv, victims, attacker = two_jobs
    attacker.request(rdzv.name, leases.NodeIntent.CLOSE)
    wait_refused(rdzv, f"pod {attacker.name} is controlled by Job/attacker")
    # The operator saw the Close before these joins (one watch, in order): had it counted,
    # the round would be closed instead.
    infos = join_all(victims)
    assert sorted(info.rank for info in infos) == [0, 1]
    assert rdzv.status().state is statuses.RoundState.SEALED


def test_a_node_offering_an_address_that_is_not_its_pods_is_refused(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    rdzv = make_rendezvous(1, 2, lastCallTimeoutSeconds=0)
    liar_pod, honest_pod = create_pods(admin_api, workers_namespace, ["a-liar", "b-honest"])
    liar = Attacker(control_plane, workers_namespace, liar_pod)
    liar.request(rdzv.name, leases.NodeIntent.JOIN, addr="127.0.0.99")
    message = wait_refused(rdzv, "pod a-liar offers address '127.0.0.99'")
    assert f"which is not one of its pod's IPs ({liar.ip})" in message
    (honest,) = attach_nodes(rdzv, [honest_pod], min_nodes=1, max_nodes=2)
    (info,) = join_all([honest])
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_addr == honest.addr


def test_a_hand_made_rendezvous_without_a_selector_admits_nobody_and_says_how_to_fix_it(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
) -> None:
    rdzv = make_rendezvous(1, 1, podSelector=None)
    (pod,) = create_pods(admin_api, workers_namespace, ["p-0"])
    Attacker(control_plane, workers_namespace, pod).request(rdzv.name, leases.NodeIntent.JOIN)
    message = wait_refused(rdzv, "has no controller owner and no spec.podSelector")
    assert "Set spec.podSelector to the labels of the job's pods." in message
    assert rdzv.status().state is statuses.RoundState.FORMING


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ('"attempt":18446744073709551616', "at most 2147483647"),
        ('"instance":"\\ud800"', "not valid UTF-8"),
        ('"addr":"[{ip}]"', "not an IP address"),
    ],
    ids=["attempt-2^64", "lone-surrogate", "bracketed-address"],
)
def test_a_members_poisoned_entry_drops_only_that_member(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
    attach_nodes: Callable[..., list[Node]],
    entry: str,
    named: str,
) -> None:
    """Stored as written, each stalled every status write of the rendezvous (a number the
    API server cannot hold) or made every round stale at once (a string stored otherwise
    than read): now refused when read, so the others re-form without that member."""
    rdzv = make_rendezvous(1, 2)
    honest_pod, member_pod = create_pods(admin_api, workers_namespace, ["honest", "poisoner"])
    honest, member = attach_nodes(rdzv, [honest_pod, member_pod], min_nodes=1, max_nodes=2)
    join_all([honest, member])
    poisoner = Attacker(control_plane, workers_namespace, member_pod)
    fields = {"instance": "i", "attempt": 2, "addr": poisoner.ip, "storePort": 1}
    text = ",".join(
        f'"{key}":{json.dumps(value)}' for key, value in fields.items() if f'"{key}"' not in entry
    )
    poisoner.write_entry(rdzv.name, "{" + text + "," + entry.format(ip=poisoner.ip) + "}")
    warning = wait_for(
        lambda: next((m for _, r, m in rdzv.events() if r == "InvalidEntry"), None),
        30,
        "the poisoned entry named",
    )
    assert named in warning, warning
    fixtures.wait_told_to_rejoin([honest], "the others are told to re-form")
    (info,) = join_all([honest])
    assert info.world_size == 1
    assert [m.node for m in rdzv.status().members] == ["honest"]


@pytest.mark.metrics
def test_bad_requests_from_many_pods_make_a_bounded_number_of_events(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
    operator_process: OperatorProcess,
) -> None:
    """15 pods each write a request the operator cannot read: 10 Warnings, 5 counted.
    (Many writes of one Lease are not the test: kopf hands the operator only the latest
    of an object's events within its batch window.)"""
    rdzv = make_rendezvous(1, 1)
    names = [f"noisy-{index}" for index in range(15)]
    for pod in create_pods(admin_api, workers_namespace, names):
        Attacker(control_plane, workers_namespace, pod).write_unreadable_request(rdzv.name)
    wait_for(
        lambda: (operator_metric(operator_process, SUPPRESSED) or 0) >= 5,
        30,
        "the Warnings past the budget counted",
    )
    warnings = wait_for(
        lambda: w if len(w := [e for e in rdzv.events() if e[0] == "Warning"]) >= 10 else None,
        30,
        "the Warnings the budget allowed, posted",
    )
    assert len(warnings) == 10, warnings
    assert {reason for _, reason, _ in warnings} == {"InvalidEntry"}
    assert operator_metric(operator_process, SUPPRESSED) == 5


@pytest.mark.metrics
def test_pods_writing_under_made_up_rendezvous_names_get_their_namespaces_budget_of_events(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    make_rendezvous: MakeRendezvous,
    operator_process: OperatorProcess,
) -> None:
    """The budget per rendezvous alone was one that pods multiply by naming rendezvous:
    40 pods, each under a name of its own, get the namespace's 30 Warnings, 10 counted."""
    # Once the operator runs: what it finds while starting waits for its Rendezvous.
    ready = make_rendezvous(1, 1)
    wait_for(lambda: "state" in (ready.body().get("status") or {}), 30, "operator running")
    names = [f"flood-{index}" for index in range(40)]
    for pod in create_pods(admin_api, workers_namespace, names):
        flooder = Attacker(control_plane, workers_namespace, pod)
        flooder.write_unreadable_request(f"made-up-{flooder.name}")
    wait_for(
        lambda: (operator_metric(operator_process, SUPPRESSED) or 0) >= 10,
        60,
        "the Warnings past the namespace's budget counted",
    )
    core = kubernetes.client.CoreV1Api(admin_api)

    def posted() -> list[str]:
        return [
            e.message
            for e in core.list_namespaced_event(workers_namespace).items
            if e.type == "Warning" and e.reason == "InvalidEntry"
        ]

    warnings = wait_for(lambda: w if len(w := posted()) >= 30 else None, 30, "30 Warnings")
    assert len(warnings) == 30, warnings
    assert operator_metric(operator_process, SUPPRESSED) == 10


def operator_metric(operator: OperatorProcess, name: str, labels: str = "") -> float | None:
    """The value of a counter (of its series whose labels begin with ``labels``, as the
    endpoint writes them), ``None`` while the endpoint is not serving yet."""
    port = next(
        int(arg.split("=")[1]) for arg in operator.extra_args if arg.startswith("--metrics-port")
    )
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except urllib.error.URLError:
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{" + labels,) if labels else (name + " ", name + "{"))
    )


@pytest.mark.webhook
def test_the_webhook_sends_no_pod_to_a_rendezvous_its_job_does_not_own(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str, control_plane: ControlPlane
) -> None:
    wait_webhook_registered(control_plane, workers_namespace)

    def env_names(job: str) -> set[str]:
        (pod,) = running_pods(admin_api, workers_namespace, job, 1)
        return {e["name"] for c in pod["spec"]["containers"] for e in c.get("env") or []}

    make_job(admin_api, workers_namespace, "mine", 1, {"k8s-rendezvous.dev/nodes": "1:1"})
    assert "PET_RDZV_BACKEND" in env_names("mine"), "the webhook serves"
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": "taken"},
            "spec": {
                "minNodes": 1,
                "maxNodes": 1,
                "runId": "taken",
                "podSelector": {"matchLabels": {"team": "someone-else"}},
            },
        },
    )
    make_job(admin_api, workers_namespace, "taken", 1, {"k8s-rendezvous.dev/nodes": "1:1"})
    assert not {"PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT"} & env_names("taken")
    core = kubernetes.client.CoreV1Api(admin_api)
    wait_for(
        lambda: any(
            e.reason == "RendezvousNotOwned"
            for e in core.list_namespaced_event(
                workers_namespace,
                field_selector="involvedObject.name=taken,involvedObject.kind=Job",
            ).items
        ),
        30,
        "RendezvousNotOwned on the Job",
    )


def involved_events(
    api: kubernetes.client.ApiClient, namespace: str, kind: str, name: str
) -> list[kubernetes.client.CoreV1Event]:
    """The Events on ``kind/name``, in the order they were written."""
    found = kubernetes.client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={kind}"
    )
    return sorted(found.items, key=lambda e: int(e.metadata.resource_version))


def posted(
    api: kubernetes.client.ApiClient, namespace: str, kind: str, name: str, reason: str
) -> list[str]:
    return [
        e.message
        for e in involved_events(api, namespace, kind, name)
        if e.type == "Warning" and e.reason == reason
    ]


def held_by(rdzv: Rendezvous, owner_uid: str) -> dict[str, Any] | None:
    """Rendezvous ``rdzv`` if it is owned by ``owner_uid``."""
    if not _exists(rdzv):
        return None
    body = rdzv.body()
    owners = body["metadata"].get("ownerReferences") or []
    return body if any(owner["uid"] == owner_uid for owner in owners) else None


@pytest.mark.webhook
def test_a_pod_made_rendezvous_under_an_annotated_jobs_name_is_replaced_with_the_jobs(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Issue 30's squatting: a pod of StatefulSet squat, with the creator role, makes
    Rendezvous train-llm (its own handler, its own token) before annotated Job train-llm
    exists. The name is the Job's: the operator replaces it with the Job's, says so on the
    Job and on the StatefulSet, the Job's pods get the env and form a round, and the pod's
    create and join are refused from then on. The same holds, with the same messages,
    where StatefulSet squat used that name in good faith."""
    ns = workers_namespace
    wait_webhook_registered(control_plane, ns)
    namespaces.bind_creator_role(admin_api, ns)
    sts_uid, (squat_pod,) = fixtures.statefulset_pods(admin_api, ns, "squat", 1)
    rdzv = Rendezvous(admin_api, ns, "train-llm")
    (squatter,) = attach_nodes(rdzv, [squat_pod])
    (alone,) = join_all([squatter])  # its pod makes train-llm: sealed once owned by squat
    assert alone.world_size == 1
    made = held_by(rdzv, sts_uid)
    assert made is not None and made["metadata"]["annotations"] == {
        objects.CREATED_BY_ANNOTATION: "squat-0"
    }

    job_uid = make_job(admin_api, ns, "train-llm", 2, {"k8s-rendezvous.dev/nodes": "2:2"})[
        "metadata"
    ]["uid"]
    replaced = wait_for(lambda: held_by(rdzv, job_uid), 30, "train-llm made for the Job")
    assert replaced["metadata"]["uid"] != made["metadata"]["uid"]
    assert objects.CREATED_BY_ANNOTATION not in (replaced["metadata"].get("annotations") or {})
    pods = running_pods(admin_api, ns, "train-llm", 2)
    for pod in pods:  # the webhook sent them to the Job's Rendezvous, not to no one
        env = {e["name"]: e.get("value") for c in pod["spec"]["containers"] for e in c["env"]}
        assert env["PET_RDZV_ENDPOINT"] == "train-llm", env
    infos = join_all(attach_nodes(rdzv, pods, min_nodes=2, max_nodes=2))
    assert sorted(info.rank for info in infos) == [0, 1]

    on_job = wait_for(
        lambda: posted(admin_api, ns, "Job", "train-llm", "RendezvousReplaced") or None,
        30,
        "RendezvousReplaced on the Job",
    )
    assert on_job == [
        "Rendezvous train-llm had been made by pod squat-0 (of StatefulSet/squat), not for "
        "this Job. The name of an annotated Job's Rendezvous is its Job's in its namespace, "
        "so the operator deleted that one and makes this Job's in its place. If "
        "StatefulSet/squat uses rendezvous train-llm on purpose, its pods are now refused "
        "at their join: rename one of the two (this Job, or that workload's "
        "--rdzv-endpoint)."
    ]
    on_squatter = wait_for(
        lambda: posted(admin_api, ns, "StatefulSet", "squat", "RendezvousReplaced") or None,
        30,
        "RendezvousReplaced on the StatefulSet",
    )
    assert on_squatter == [
        "Rendezvous train-llm, made by pod squat-0 (of StatefulSet/squat), was deleted by "
        "the k8s-rendezvous operator and made anew for Job train-llm: the name of an "
        "annotated Job's Rendezvous is its Job's in its namespace. The pods of "
        "StatefulSet/squat are refused from Rendezvous train-llm from now on: give their "
        "torchrun another --rdzv-endpoint, or rename Job train-llm."
    ]
    reasons = {e.reason for e in involved_events(admin_api, ns, "Job", "train-llm")}
    assert not reasons & {"RendezvousNotOwned", "PodNotInjected"}, reasons

    again = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {
            "name": "train-llm",
            "annotations": {objects.CREATED_BY_ANNOTATION: "squat-0"},
        },
        "spec": {"minNodes": 1, "maxNodes": 1, "runId": "train-llm"},
    }
    with pytest.raises(kubernetes.client.exceptions.ApiException) as taken:
        kubernetes.client.CustomObjectsApi(squatter.api).create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, ns, objects.PLURAL, again
        )
    assert taken.value.status == 409, taken.value.body
    with pytest.raises(NodeRefusedError) as refused:
        squatter.join_in_background().wait(60)
    assert (
        "pod squat-0 is controlled by StatefulSet/squat, not by Job/train-llm, which owns "
        "Rendezvous train-llm: only that workload's pods may join it."
    ) in str(refused.value)
    assert held_by(rdzv, job_uid) is not None
    members = sorted(m.node for m in rdzv.status().members)
    assert members == sorted(p["metadata"]["name"] for p in pods)


@pytest.mark.metrics
def test_a_users_rendezvous_under_an_annotated_jobs_name_is_left_until_they_free_it(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    operator_process: OperatorProcess,
) -> None:
    """A Rendezvous a user made (no creator pod) is not the operator's to delete: it is
    reported as it is, with no advice to delete pods while it holds the name; once its
    user deletes it, the Job gets its own at once, and only then is each pod made without
    the env reported (deleting it now gives the Job's replacement the env)."""
    ns = workers_namespace
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    theirs = custom.create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        ns,
        objects.PLURAL,
        {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": "shared"},
            "spec": {
                "minNodes": 1,
                "maxNodes": 1,
                "runId": "shared",
                "podSelector": {"matchLabels": {"team": "someone-else"}},
            },
        },
    )
    job_uid = make_job(admin_api, ns, "shared", 1, {"k8s-rendezvous.dev/nodes": "1:1"})["metadata"][
        "uid"
    ]
    (not_owned,) = wait_for(
        lambda: posted(admin_api, ns, "Job", "shared", "RendezvousNotOwned") or None,
        30,
        "RendezvousNotOwned on the Job",
    )
    assert not_owned == (
        "Rendezvous shared exists and is not this Job's: a user or another controller made "
        "it, not a pod (it has no k8s-rendezvous.dev/created-by-pod annotation), and it "
        "admits the pods its spec.podSelector matches. The operator leaves it as it is, so "
        "this Job's pods get no env and join nothing; it makes this Job's Rendezvous as soon "
        f"as the name is free. Delete it if it is not in use (kubectl -n {ns} delete "
        "rendezvous shared), or rename the Job."
    )
    (pod,) = running_pods(admin_api, ns, "shared", 1)
    # The operator has looked at the Job's pods (its only GET of pods here) while the name
    # was held, and advised nothing: deleting a pod would not have helped.
    wait_for(
        lambda: (
            (operator_metric(operator_process, REQUESTS, 'resource="pods",verb="GET"') or 0) >= 1
        ),
        30,
        "the Job's pods looked at",
    )
    assert not posted(admin_api, ns, "Job", "shared", "PodNotInjected")
    rdzv = Rendezvous(admin_api, ns, "shared")
    assert rdzv.body()["metadata"]["uid"] == theirs["metadata"]["uid"], "left as it is"

    custom.delete_namespaced_custom_object(
        objects.GROUP, objects.VERSION, ns, objects.PLURAL, "shared"
    )
    wait_for(lambda: held_by(rdzv, job_uid), 30, "the Job's Rendezvous, once the name is free")
    (advice,) = wait_for(
        lambda: posted(admin_api, ns, "Job", "shared", "PodNotInjected") or None,
        30,
        "PodNotInjected once the Job's Rendezvous exists",
    )
    name = pod["metadata"]["name"]
    assert advice.startswith(f"pod {name} of Job shared was made without the env")
    assert advice.endswith(f"Delete pod {name}: the Job replaces it, with the env.")
    order = [e.reason for e in involved_events(admin_api, ns, "Job", "shared")]
    assert order.index("RendezvousCreated") < order.index("PodNotInjected"), order
