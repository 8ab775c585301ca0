"""Real ``torchrun --rdzv-backend=kubernetes`` jobs against the real control plane.

Every node is a Pod object on a kwok node plus a local torchrun (2 gloo workers running
examples/elastic_train.py) with that pod's own credentials; the operator runs as its own
process. Tests follow the job through the workers' progress lines, never through sleeps,
and print the time from each event to the new world's first training step
(``pytest -s`` shows the ``TIMING`` lines).

Scenarios: a world forms; a node dies; the rank-0 node dies; a node arrives late with an
address that sorts first; a newcomer fails; a node done first leaves the rank-0 node to
its final work; the rendezvous is closed; the operator dies while nodes join.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import kubernetes.client
from tests.e2e.harness import (
    LocalPod,
    LocalPods,
    World,
    describe,
    timing,
    wait_all_exit,
    wait_world,
)
from tests.support.fixtures import Rendezvous

from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.wire import leases, objects, statuses

MakeRendezvous = Callable[..., Rendezvous]

LAST_CALL_SECONDS = 5
"""After minNodes (2) joined, the operator waits this long for more before sealing."""
FORM_TIMEOUT = 120
"""Bound on every wait for a world: generous, as 2 cores import torch for every worker."""
STEPS = ["--steps", "15"]
LONG_STEPS = ["--steps", "100"]
"""Used where a node must arrive while the others still train (starting a torchrun on
this machine takes several seconds)."""


def rendezvous(make_rendezvous: MakeRendezvous, **spec: int) -> Rendezvous:
    return make_rendezvous(2, 4, lastCallTimeoutSeconds=LAST_CALL_SECONDS, **spec)


def master_addr(world: World) -> str:
    """The one MASTER_ADDR every worker of ``world`` got."""
    assert len(world.masters) == 1, world.masters
    return next(iter(world.masters)).rpartition(":")[0]


def assert_all_finish(nodes: list[LocalPod], timeout: float = FORM_TIMEOUT) -> None:
    codes = wait_all_exit(nodes, timeout)
    assert codes == {node.name: 0 for node in nodes}, describe(nodes)


def test_three_nodes_form_one_world_of_six_ranks(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(
        rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"}, script_args=STEPS
    )
    world = wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT)
    timing("3 nodes started -> first step in world 6", world.first_step_at - started)

    assert world.ranks == list(range(6))
    assert sorted(world.group_ranks.values()) == [0, 1, 2]
    rank0 = next(node for node in nodes if node.name == world.rank0_pod)
    assert master_addr(world) == rank0.addr
    assert_all_finish(nodes)
    wait_world(nodes, 6, after=started, timeout=1, min_step=14)  # every rank did every step
    status = rdzv.status()
    assert [m.node for m in status.members] == sorted(
        world.group_ranks, key=world.group_ranks.__getitem__
    )
    assert status.master is not None and status.master.addr == rank0.addr


def test_killed_node_leaves_a_smaller_world_that_finishes(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(
        rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"}, script_args=STEPS
    )
    before = wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT, min_step=1)
    victim = next(n for n in nodes if before.group_ranks[n.name] == 2)
    survivors = [n for n in nodes if n is not victim]

    killed = time.time()
    victim.kill()
    after = wait_world(survivors, 4, after=killed, timeout=FORM_TIMEOUT)
    timing("non-rank-0 node killed -> first step in world 4", after.first_step_at - killed)

    assert after.ranks == list(range(4))
    assert after.rank0_pod == before.rank0_pod, "rank 0 stays while its node lives"
    assert master_addr(after) == master_addr(before)
    assert_all_finish(survivors)
    status = rdzv.status()
    assert victim.name not in {m.node for m in status.members}
    rdzv.wait_events("MemberLost", lambda message: victim.name in message)


def test_rank0_killed_every_survivor_gets_the_new_master(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(
        rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"}, script_args=STEPS
    )
    before = wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT, min_step=1)
    victim = next(n for n in nodes if n.name == before.rank0_pod)
    survivors = [n for n in nodes if n is not victim]
    (old_master,) = before.masters

    killed = time.time()
    victim.kill()
    after = wait_world(survivors, 4, after=killed, timeout=FORM_TIMEOUT)
    timing("rank-0 node killed -> first step in world 4", after.first_step_at - killed)

    new_rank0 = next(n for n in survivors if n.name == after.rank0_pod)
    assert before.group_ranks[new_rank0.name] == 2, "the last rank moves into rank 0"
    (new_master,) = after.masters  # every survivor's every worker got the same one
    assert new_master != old_master and new_master.startswith(f"{new_rank0.addr}:")
    assert_all_finish(survivors)
    status = rdzv.status()
    assert status.master is not None and status.master.endpoint == new_master


def test_late_node_sorting_first_joins_without_taking_rank0(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(
        rdzv.name,
        {"n1": "127.0.0.31", "n2": "127.0.0.32", "n3": "127.0.0.33"},
        script_args=LONG_STEPS,
    )
    before = wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT)

    arrived = time.time()
    # Its name and its address both sort before the others'. torch's c10d backend ranks by
    # address: it would take rank 0 while the others kept the old MASTER_ADDR.
    (late,) = pods.start(rdzv.name, {"n0": "127.0.0.2"}, script_args=LONG_STEPS)
    rdzv.wait_requests(lambda r: late.name in r, "the late node joined", timeout=60)
    joined_at = time.time()
    everyone = [*nodes, late]
    after = wait_world(everyone, 8, after=arrived, timeout=FORM_TIMEOUT)
    timing("late node started -> first step in world 8", after.first_step_at - arrived)
    timing("late node's join seen -> first step in world 8", after.first_step_at - joined_at)

    assert after.ranks == list(range(8))
    assert after.group_ranks[late.name] == 3, "newcomers are appended"
    assert after.rank0_pod == before.rank0_pod
    assert master_addr(after) == master_addr(before)
    for node in nodes:  # restarted through num_nodes_waiting(), not through a failure
        assert "Detected 1 new nodes" in node.log(), describe([node])
    pods.finish()
    assert_all_finish(everyone)


def test_failing_newcomer_does_not_close_the_rendezvous(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12"}, script_args=LONG_STEPS)
    wait_world(nodes, 4, after=started, timeout=FORM_TIMEOUT)

    (broken,) = pods.start(rdzv.name, {"n3": "127.0.0.13"}, max_restarts=0, script_args=["--fail"])
    assert broken.wait_exit(FORM_TIMEOUT) != 0
    failed = broken.exited_at
    assert failed is not None
    assert "failing on purpose" in broken.log()
    status = rdzv.status()
    assert status.state is not statuses.RoundState.CLOSED, status
    assert rdzv.requests()[broken.name].intent is leases.NodeIntent.LEAVE, "shutdown() only leaves"

    after = wait_world(nodes, 4, after=failed, timeout=FORM_TIMEOUT)
    timing("newcomer failed -> first step of the others' new world", after.first_step_at - failed)
    pods.finish()
    assert_all_finish(nodes)
    assert rdzv.status().closed_reason == "NodeFinished"


def test_a_node_done_first_leaves_the_rank0_node_to_finish_its_final_work(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    # torch's workers-drift case: rank 0's node does 20 s more (a final evaluation) and
    # the other node's agent waits only 1 s at the exit barrier before it leaves.
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(
        rdzv.name,
        {"n1": "127.0.0.11", "n2": "127.0.0.12"},
        script_args=[*STEPS, "--final-seconds", "20"],
        exit_barrier_timeout=1,
    )
    world = wait_world(nodes, 4, after=started, timeout=FORM_TIMEOUT)
    rank0 = next(node for node in nodes if node.name == world.rank0_pod)
    (other,) = [node for node in nodes if node is not rank0]
    assert other.wait_exit(FORM_TIMEOUT) == 0, describe(nodes)
    assert "Waiting 1.0 seconds for other agents" in other.log(), other.log_tail()
    assert rdzv.requests()[other.name].intent is leases.NodeIntent.FINISH
    closed = rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed", timeout=30)
    assert closed.closed_reason == "NodeFinished", closed
    assert rank0.running(), "the rank-0 node is still at its final work"
    assert rank0.wait_exit(FORM_TIMEOUT) == 0, describe(nodes)
    workers = {step.pid for step in world.steps if step.pod == rank0.name}
    assert {step.pid for step in rank0.progress()} == workers, "rank 0's workers restarted"
    assert "finished 15 steps" in rank0.log()


def test_closed_rendezvous_turns_joiners_away_and_lets_running_nodes_finish(
    pods: LocalPods, make_rendezvous: MakeRendezvous, admin_api: kubernetes.client.ApiClient
) -> None:
    rdzv = rendezvous(make_rendezvous)
    started = time.time()
    nodes = pods.start(rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12"}, script_args=LONG_STEPS)
    world = wait_world(nodes, 4, after=started, timeout=FORM_TIMEOUT)
    workers = {step.pid for step in world.steps}

    closer = nodes[1]
    lease = objects.lease_name(rdzv.name, closer.name)
    coordination = kubernetes.client.CoordinationV1Api(admin_api)
    annotations = coordination.read_namespaced_lease(lease, rdzv.namespace).metadata.annotations
    joined = leases.NodeEntry.from_annotation(annotations[objects.ENTRY_ANNOTATION], lease)
    close = dataclasses.replace(joined, intent=leases.NodeIntent.CLOSE).to_annotation()
    with closer.api_client() as api:  # what set_closed() writes, with the pod's own token
        kubernetes.client.CoordinationV1Api(api).patch_namespaced_lease(
            lease,
            rdzv.namespace,
            {"metadata": {"annotations": {objects.ENTRY_ANNOTATION: close}}},
            _content_type="application/merge-patch+json",
        )
    closed_at = time.time()
    closed = rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed", timeout=30)
    timing("intent Close written -> rendezvous Closed", time.time() - closed_at)
    assert closed.closed_reason == "ClosedByNode"

    (late,) = pods.start(rdzv.name, {"n3": "127.0.0.13"}, script_args=STEPS)
    assert late.wait_exit(60) != 0
    assert late.started_at is not None and late.exited_at is not None
    timing("late node started on a closed rendezvous -> exited", late.exited_at - late.started_at)
    assert "RendezvousClosedError" in late.log()
    assert not late.progress()

    assert all(node.running() for node in nodes), describe(nodes)
    assert_all_finish(nodes)
    final = {step.pid for node in nodes for step in node.progress()}
    assert final == workers, "the running workers were never restarted"
    assert {s.step for n in nodes for s in n.progress() if s.rank == 0} == set(range(100))


def test_operator_killed_while_nodes_join_then_restarted(
    pods: LocalPods, make_rendezvous: MakeRendezvous, operator_process: OperatorProcess
) -> None:
    rdzv = rendezvous(make_rendezvous)
    rdzv.wait(lambda s: s.round_key == "0-Forming", "operator initialised the status")
    operator_process.kill()
    nodes = pods.start(
        rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"}, script_args=STEPS
    )
    wait_for(
        lambda: len(rdzv.requests()) == 3, FORM_TIMEOUT, "all joined while the operator is down"
    )
    waiting = rdzv.status()
    assert (waiting.round, waiting.state) == (0, statuses.RoundState.FORMING)
    assert all(node.running() and not node.progress() for node in nodes)

    restarted = time.time()
    operator_process.start()
    world = wait_world(nodes, 6, after=restarted, timeout=FORM_TIMEOUT)
    timing(
        f"operator restarted -> first step in world 6 (last call {LAST_CALL_SECONDS} s)",
        world.first_step_at - restarted,
    )
    assert world.ranks == list(range(6))
    assert_all_finish(nodes)
    assert rdzv.status().round == 1
