"""A user's whole path on real nodes: the chart installs the operator from its image, an
annotated Job runs plain ``torchrun`` in real containers, and real faults (a worker's exit,
a killed container, a deleted pod, a drain, a lost node, scaling) re-form the world, as
the workers' own progress lines say."""

from __future__ import annotations

import ipaddress
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest

from devkit import chart
from devkit.cluster import images
from devkit.cluster.controlplane import ControlPlane, dig, read_object
from devkit.cluster.nodes import RealNodes
from devkit.training import (
    OPERATOR_POD_LABELS,
    RunJob,
    TrainingJob,
    agent_pid,
    operator_leader,
    pod_processes,
    progress_lines,
    wait_webhook_served_by_leader_alone,
    worker_pid,
)
from devkit.waiting import wait_for
from k8s_rendezvous import __version__

pytestmark = pytest.mark.timeout(600)

IN_PLACE_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "elastic_train_in_place.py"


def pod_of(job: TrainingJob, name: str) -> dict[str, Any]:
    (pod,) = [p for p in job.pods() if p["metadata"]["name"] == name]
    return pod


def pods_by_node(job: TrainingJob) -> dict[str, list[dict[str, Any]]]:
    by_node: dict[str, list[dict[str, Any]]] = {}
    for pod in job.running_pods():
        by_node.setdefault(pod["spec"]["nodeName"], []).append(pod)
    return by_node


def in_place_worlds(job: TrainingJob, size: int, steps: int = 2) -> dict[int, dict[int, str]]:
    """The pod of each rank in every round whose world of ``size`` trained ``steps`` steps
    on each rank, by round (the in-place example's lines name their round)."""
    by_round: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for line in job.progress():
        if line.get("round") is not None and line["world_size"] == size:
            by_round.setdefault(line["round"], {}).setdefault(line["rank"], []).append(line)
    return {
        round_: {rank: lines[0]["pod"] for rank, lines in ranks.items()}
        for round_, ranks in by_round.items()
        if sorted(ranks) == list(range(size)) and all(len(r) >= steps for r in ranks.values())
    }


def training_in_place(job: TrainingJob, size: int = 3) -> tuple[int, dict[int, str]]:
    """The latest round whose world of ``size`` trains in place, once there is one, with
    the pod of each rank."""
    worlds = wait_for(lambda: in_place_worlds(job, size), 240, f"a world of {size} in place")
    return max(worlds.items())


def in_place_command(*arguments: str) -> list[str]:
    """torchrun of one worker running the in-place example for good, with ``arguments``."""
    return ["torchrun", "--nproc-per-node=1", str(IN_PLACE_SCRIPT), "--steps", "100000", *arguments]


def lone_pod(job: TrainingJob) -> dict[str, Any]:
    """The pod alone on its node (3 pods spread over 2 nodes), whatever its rank."""
    by_node = pods_by_node(job)
    alone = [pods[0] for pods in by_node.values() if len(pods) == 1]
    assert alone, {node: [p["metadata"]["name"] for p in pods] for node, pods in by_node.items()}
    return alone[0]


# -- the operator from its image --------------------------------------------------------


def test_the_operator_runs_from_its_image_with_leader_election_metrics_and_webhook(
    operator_release: chart.Release,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
) -> None:
    core = kubernetes.client.CoreV1Api(admin_api)
    pods = read_object(
        core.list_namespaced_pod,
        chart.NAMESPACE,
        label_selector=OPERATOR_POD_LABELS,
    )["items"]
    assert len(pods) == 2, pods
    assert {pod["spec"]["nodeName"] for pod in pods} == {"real-node-0", "real-node-1"}
    for pod in pods:
        (status,) = pod["status"]["containerStatuses"]
        assert status["image"].endswith(node_images["operator"].reference.split("/", 1)[1])
        assert status["state"].get("running"), status
    leader = operator_leader(admin_api)
    ready = [
        pod["metadata"]["name"]
        for pod in pods
        if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"])
    ]
    # Only the leader serves admission, so only the leader is Ready (values.yaml, webhook).
    assert ready == [leader], (ready, leader)
    (leader_pod,) = [pod for pod in pods if pod["metadata"]["name"] == leader]
    address = ipaddress.ip_address(leader_pod["status"]["podIP"])
    host = f"[{address}]" if address.version == 6 else str(address)
    with urllib.request.urlopen(f"http://{host}:8081/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert f'k8s_rendezvous_build_info{{version="{__version__}"}} 1.0' in metrics, metrics[:2000]
    registered = read_object(
        kubernetes.client.AdmissionregistrationV1Api(admin_api).read_mutating_webhook_configuration,
        chart.WEBHOOK_CONFIG,
    )
    (webhook,) = registered["webhooks"]
    assert webhook["clientConfig"]["service"]["name"] == chart.WEBHOOK_SERVICE, webhook


# -- an annotated Job, plain torchrun -------------------------------------------------


def test_an_annotated_job_trains_with_plain_torchrun_on_both_nodes(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    started = time.time()
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    world = job.wait_world(3, after=started)
    pods = {pod["metadata"]["name"]: pod for pod in job.running_pods()}
    assert set(world.pods.values()) == set(pods)
    assert {pod["spec"]["nodeName"] for pod in pods.values()} == {"real-node-0", "real-node-1"}
    for pod in pods.values():
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env") or []}
        # Injected at admission; the user's command has no rendezvous flag.
        assert env["PET_RDZV_BACKEND"]["value"] == "kubernetes", env
        assert env["PET_RDZV_ENDPOINT"]["value"] == job.name, env
        assert not any("rdzv" in arg for arg in container["command"]), container["command"]
    # The master is rank 0's pod IP as that pod reports it, and the port its agent bound.
    rank0 = pods[world.pods[0]]
    host, _, port = world.master.rpartition(":")
    assert host.strip("[]") == rank0["status"]["podIP"], (world.master, rank0["status"])
    assert int(port) > 0


def test_annotations_alone_keep_a_warm_spare_that_takes_the_lost_rank_in_place(
    run_job: RunJob,
) -> None:
    """Spares, warm starts and in-place re-forming with no --rdzv-conf: a Job of 4 pods for
    3 nodes keeps one spare, and its annotations turn on the other two."""
    job: TrainingJob = run_job(
        parallelism=4,
        nodes="3",
        annotations={"k8s-rendezvous.dev/in-place": "true", "k8s-rendezvous.dev/warm-start": "1"},
        command=[
            "torchrun",
            "--nproc-per-node=1",
            *("-m", "k8s_rendezvous.warm", str(IN_PLACE_SCRIPT)),
            *("--steps", "100000", "--step-seconds", "0.25"),
        ],
    )
    first_round, before = training_in_place(job)
    wait_for(lambda: job.rendezvous_status().get("spares") == 1 or None, 120, "a spare waiting")
    (spare,) = {p["metadata"]["name"] for p in job.running_pods()} - set(before.values())
    survivors = {rank: pod_of(job, before[rank]) for rank in (0, 2)}
    workers = {rank: worker_pid(pod) for rank, pod in survivors.items()}
    kubernetes.client.CoreV1Api(job.api).delete_namespaced_pod(before[1], job.namespace)

    def replaced() -> dict[int, str] | None:
        later = [world for round_, world in in_place_worlds(job, 3).items() if round_ > first_round]
        return later[-1] if later else None

    after = wait_for(replaced, 120, "a world of 3 with the spare, training in place")
    assert after == {0: before[0], 1: spare, 2: before[2]}, "the spare took the lost rank alone"
    assert {rank: worker_pid(pod) for rank, pod in survivors.items()} == workers, "kept in place"
    # A fork of the spare's zygote keeps its command line; a worker started cold has its own.
    processes = pod_processes(pod_of(job, spare))
    zygote_and_forks = {pid for pid, cmd in processes.items() if "warm --zygote" in cmd}
    assert worker_pid(pod_of(job, spare)) in zygote_and_forks, processes


# -- faults ----------------------------------------------------------------------------


def test_a_worker_that_dies_in_its_container_restarts_the_world(run_job: RunJob) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3", torchrun_args=("--max-restarts=3",))
    before = job.wait_world(3, after=0)
    victim = pod_of(job, before.pods[1])
    fault = time.time()
    os.kill(worker_pid(victim), signal.SIGKILL)  # as the OOM killer ends a worker
    after = job.wait_world(3, after=fault)
    # The same pods, new worker processes: the agents restarted their workers in place.
    assert set(after.pods.values()) == set(before.pods.values())
    assert set(after.pids.values()).isdisjoint(before.pids.values())


@pytest.mark.parametrize("restart_policy", ["Never", "OnFailure"])
def test_a_killed_agent_container_is_replaced_and_rejoins(
    run_job: RunJob, restart_policy: str
) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3", restart_policy=restart_policy)
    before = job.wait_world(3, after=0)
    victim = pod_of(job, before.pods[1])
    fault = time.time()
    os.kill(agent_pid(victim), signal.SIGKILL)
    after = job.wait_world(3, after=fault)
    name = victim["metadata"]["name"]
    if restart_policy == "Never":
        # The pod failed; the Job made a new one, which joined the world.
        assert name not in after.pods.values()
        assert dig(pod_of(job, name), "status", "phase") == "Failed"
    else:
        # The kubelet restarted the container in the same pod, which rejoined.
        assert name in after.pods.values()
        (status,) = pod_of(job, name)["status"]["containerStatuses"]
        assert status["restartCount"] >= 1, status


def test_a_deleted_pod_is_replaced_in_a_new_world(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    before = job.wait_world(3, after=0)
    victim = before.pods[2]
    fault = time.time()
    kubernetes.client.CoreV1Api(admin_api).delete_namespaced_pod(victim, job.namespace)
    after = job.wait_world(3, after=fault)
    assert victim not in after.pods.values()
    assert before.pods[0] == after.pods[0], "rank 0 stays while its pod lives"


def test_a_drained_node_moves_its_training_pods(
    run_job: RunJob, control_plane: ControlPlane
) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    job.wait_world(3, after=0)
    victim = lone_pod(job)
    node = victim["spec"]["nodeName"]
    fault = time.time()
    try:
        control_plane.kubectl(
            "drain",
            node,
            "--ignore-daemonsets",
            f"--pod-selector=batch.kubernetes.io/job-name={job.name}",
            "--timeout=120s",
        )
        after = job.wait_world(3, after=fault)
    finally:
        control_plane.kubectl("uncordon", node)
    assert victim["metadata"]["name"] not in after.pods.values()
    assert all(pod["spec"]["nodeName"] != node for pod in job.running_pods())


def test_a_lost_node_is_noticed_by_the_operators_probes_and_rejoins_once_back(
    run_job: RunJob, real_nodes: RealNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    # Heartbeats: 30 s, the default; torchrun's --max-restarts: 0, the default.
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    before = job.wait_world(3, after=0)
    victim = lone_pod(job)
    victim_name, node = victim["metadata"]["name"], victim["spec"]["nodeName"]
    worker = Path(f"/proc/{worker_pid(victim)}")
    fault = time.time()
    # Power off, as far as a host can tell: the kubelet dies and the node's pods reach
    # nothing and are reached by nothing, though their processes live on.
    real_nodes.kill_kubelet(node)
    real_nodes.cut_network(node)
    try:
        after = job.wait_world(2, after=fault)
        lost = job.rendezvous_status()["history"][-1]
        # Cut off (no probe, no API server), its agent stops its workers while the network
        # is still cut: none fails on a reset once back, which would end an agent with no
        # restart left.
        wait_for(lambda: not worker.exists() or None, 30, "the cut-off agent to stop its worker")
    finally:
        restored = time.time()
        real_nodes.restore_network(node)
        real_nodes.start_kubelet(node)
        # The node may have run the operator's leader: the next test's pods must not be
        # sent to its pod, still an endpoint, before its kubelet has seen it stand by.
        wait_webhook_served_by_leader_alone(admin_api)
    assert victim_name not in after.pods.values()
    assert set(after.pods.values()) < set(before.pods.values())
    # Long before its 30 s heartbeat window (where the operator's leader ran on the lost
    # node, after the other replica took over).
    assert lost["cause"] == "AgentUnreachable" and victim_name in lost["message"], lost
    # Back, its agent finds its round replaced and joins a later one: one world again.
    again = job.wait_world(3, after=restored)
    assert set(again.pods.values()) == set(before.pods.values())
    rounds = [record["round"] for record in job.rendezvous_status()["history"]]
    assert rounds == sorted(set(rounds)), rounds


def test_survivors_of_a_lost_node_re_form_in_place_without_waiting_out_their_collective(
    run_job: RunJob, real_nodes: RealNodes, admin_api: kubernetes.client.ApiClient
) -> None:
    """A node cut off closes no connection: its peers' collective blocks on it. Once the
    round without it is published they shut their connections to it down and re-form in
    place, instead of waiting out ``in_place_loss_timeout`` (10 minutes here) and being
    restarted."""
    job: TrainingJob = run_job(
        parallelism=3,
        nodes="2:3",
        annotations={
            "k8s-rendezvous.dev/in-place": "true",
            "k8s-rendezvous.dev/in-place-loss-timeout": "600",
        },
        command=in_place_command("--step-seconds", "0.25"),
    )
    first_round, _ = training_in_place(job)
    victim = lone_pod(job)
    node = victim["spec"]["nodeName"]
    survivors = {
        pod["metadata"]["name"]: worker_pid(pod)
        for pod in job.running_pods()
        if pod["spec"]["nodeName"] != node
    }
    real_nodes.kill_kubelet(node)
    real_nodes.cut_network(node)
    try:

        def without_it() -> dict[int, str] | None:
            later = [
                world for round_, world in in_place_worlds(job, 2).items() if round_ > first_round
            ]
            return later[-1] if later else None

        after = wait_for(without_it, 120, "the survivors training in place in a world of 2")
        kept = {name: worker_pid(pod_of(job, name)) for name in survivors}
    finally:
        real_nodes.restore_network(node)
        real_nodes.start_kubelet(node)
        wait_webhook_served_by_leader_alone(admin_api)
    assert set(after.values()) == set(survivors)
    assert kept == survivors, "the survivors' workers were kept, not restarted"


def test_an_evicted_pod_finishes_its_step_and_the_survivors_redo_none(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    """A planned removal on the in-place path: the evicted pod's worker finishes the step
    in flight (a second of compute, then its all-reduce) with its peers, and leaves at the
    step boundary; the survivors re-form without it from the next step."""
    job: TrainingJob = run_job(
        parallelism=3,
        nodes="2:3",
        annotations={"k8s-rendezvous.dev/in-place": "true"},
        command=in_place_command("--step-seconds", "0", "--compute-seconds", "1"),
    )
    first_round, _ = training_in_place(job)
    victim = lone_pod(job)["metadata"]["name"]

    def into_its_compute() -> bool:
        # A step is all compute but for the all-reduce at either end, so a SIGTERM that
        # lands a few tenths of a second later finds the worker inside a step.
        latest = max(line["time"] for line in job.progress() if line["pod"] == victim)
        return 0.2 < time.time() - latest < 0.5

    wait_for(into_its_compute, 60, "the evicted pod's worker to be into a step's compute")
    its_log = job.follow_log(victim)
    evicted = time.time()
    meta = kubernetes.client.V1ObjectMeta(name=victim, namespace=job.namespace)
    kubernetes.client.CoreV1Api(admin_api).create_namespaced_pod_eviction(
        victim, job.namespace, kubernetes.client.V1Eviction(metadata=meta)
    )

    def without_it() -> list[dict[str, Any]] | None:
        lines = [line for line in job.progress() if (line.get("round") or 0) > first_round]
        return lines if lines and all(line["pod"] != victim for line in lines) else None

    later = wait_for(without_it, 120, "the survivors training in a later round")
    log = its_log.result(timeout=60)
    leaver = progress_lines(log, victim)
    assert any(line["time"] > evicted for line in leaver), "it finished the step in flight"
    assert "the step in flight is done; leaving at the step boundary" in log, log[-2000:]
    last = max(line["step"] for line in leaver)
    assert min(line["step"] for line in later) == last + 1, "no step redone"


def test_the_world_follows_the_jobs_parallelism_down_and_up(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    job: TrainingJob = run_job(parallelism=3, nodes="2:3")
    job.wait_world(3, after=0)
    batch = kubernetes.client.BatchV1Api(admin_api)
    lowered = time.time()
    batch.patch_namespaced_job(job.name, job.namespace, {"spec": {"parallelism": 2}})
    smaller = job.wait_world(2, after=lowered)
    raised = time.time()
    batch.patch_namespaced_job(job.name, job.namespace, {"spec": {"parallelism": 3}})
    larger = job.wait_world(3, after=raised)
    assert set(smaller.pods.values()) < set(larger.pods.values())
