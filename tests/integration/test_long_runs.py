"""What a long run meets, against the real control plane, as torch's c10d backend would
behave: spares that outwait their join timeout, a waiter whose agent died while its pod
runs on, and a handler used after it closed or shut down.

Aspects: a node's own ``--rdzv-conf join_timeout`` is its deadline (the spec's 600 s is
not); a spare (the round is sealed full without it) has no join deadline, steps in when
a member is lost at that member's rank while the survivors keep theirs (and a shrink
moves only the last rank into the hole), gets the whole join timeout afresh once it is
no longer a spare, and ends with ``RendezvousGracefulExitError`` when the rendezvous
closes; a waiter killed by PID (its pod stays Running) stops counting once its Lease is
a heartbeat timeout old, is named once in a ``WaiterExpired`` Warning and is never
sealed into a round; the job's restart budget (``maxRestarts``) is spent by any
node's failure, and a failure with none left closes the rendezvous, sending the agent
still training into the closure too (``RendezvousClosedError`` for both, a Warning Event
naming the budget, ``kubectl get rdzv`` showing the restarts); ``next_rendezvous()``
after ``set_closed()`` or ``shutdown()`` raises ``RendezvousClosedError`` at once and
writes nothing; ``is_closed()`` before the Rendezvous exists is ``False``; a member
whose pod is being deleted is named in the next round's ``leaving`` (one whose pod failed
is not).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kubernetes.client
import pytest
from tests.support.fixtures import (
    Joining,
    Node,
    Rendezvous,
    create_pods,
    delete_pod,
    join_all,
    operator_metrics,
    wait_told_to_rejoin,
)
from tests.support.node_process import NodeProcess
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils import store as store_util

from devkit.cluster.controlplane import ControlPlane, set_pod_phase
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import kube
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, statuses

pytestmark = pytest.mark.usefixtures("operator_process")

JOIN_TIMEOUT = 2
SPARE_TIMEOUTS = {"joinTimeoutSeconds": JOIN_TIMEOUT}
"""The spare's own ``--rdzv-conf``: a local deadline, as in c10d (the spec's is 600 s)."""
HEARTBEAT_TIMEOUT = 3  # the CRD's minimum: nodes renew every second


def full_round_and_a_spare(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    size: int,
    **spec: object,
) -> tuple[Rendezvous, list[Node], Node, Joining]:
    """A round sealed with ``size`` members (its max), and a node waiting beyond it."""
    rdzv = make_rendezvous(size, size, **spec)
    members = make_nodes(rdzv, size)
    join_all(members)
    (spare,) = make_nodes(rdzv, 1, configured_spec=SPARE_TIMEOUTS)
    waiting = spare.join_in_background()
    rdzv.wait_requests(lambda r: spare.pod in r, "the spare asked to join")
    rdzv.wait(lambda s: s.spares == 1, "the spare shown in the status")
    return rdzv, members, spare, waiting


def test_a_spare_outwaits_its_join_timeout_and_steps_in_when_a_member_is_lost(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv, members, _, waiting = full_round_and_a_spare(make_rendezvous, make_nodes, 2)
    # Three join timeouts: c10d's redundancy list has no deadline, nor has ours.
    assert waiting.still_blocked_after(3 * JOIN_TIMEOUT), f"the spare gave up: {waiting.error!r}"
    assert rdzv.status().round == 1, "a spare does not disturb the full round"

    delete_pod(admin_api, rdzv.namespace, members[1].pod)
    survivor = members[0].join_in_background()
    assert waiting.wait(30).world_size == 2, "the spare steps in when a member is lost"
    assert survivor.wait(30).world_size == 2


@pytest.mark.metrics
def test_the_spare_takes_the_lost_members_rank_and_the_survivors_keep_theirs(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    operator_process: OperatorProcess,
    control_plane: ControlPlane,
) -> None:
    rdzv, members, spare, waiting = full_round_and_a_spare(make_rendezvous, make_nodes, 3)
    table = control_plane.kubectl("get", "rdzv", rdzv.name, "-n", rdzv.namespace).stdout
    header, row = table.splitlines()
    assert dict(zip(header.split(), row.split(), strict=False))["SPARES"] == "1", table
    before = [member.node for member in rdzv.status().members]
    lost = before[1]
    survivors = [node for node in members if node.pod != lost]

    delete_pod(admin_api, rdzv.namespace, lost)
    joins = [node.join_in_background() for node in survivors]
    assert waiting.wait(30).rank == 1, "the spare takes the lost rank"
    assert [join.wait(30).rank for join in joins] == [0, 2], "the survivors keep theirs"
    after = rdzv.status()
    assert [m.node for m in after.members] == [before[0], spare.pod, before[2]]
    assert [m.replaces for m in after.members] == [None, lost, None]
    assert after.spares == 0
    first, second = after.history
    assert (first.round, first.cause, first.world_size) == (1, "FirstRound", 3)
    assert (second.round, second.world_size) == (2, 3)
    assert second.cause in {"PodTerminating", "PodDeleted"}, "seen terminating, or gone"
    assert after.history[-1].message.startswith(f"pod {lost} (rank 1) lost")
    # As docs/troubleshooting.md reads it.
    jsonpath = (
        "{range .status.history[*]}{.round} {.cause} {.formingMilliseconds}ms {.message}"
        '{"\\n"}{end}'
    )
    told = control_plane.kubectl(
        "get", "rdzv", rdzv.name, "-n", rdzv.namespace, "-o", f"jsonpath={jsonpath}"
    ).stdout.splitlines()
    assert [line.split()[:2] for line in told] == [["1", "FirstRound"], ["2", second.cause]]
    changes = wait_for(
        lambda: operator_metrics(operator_process).get("k8s_rendezvous_rank_changes_total"),
        10,
        "the seal counted",
    )
    assert changes == 1, "one rank changed hands: the spare's"


def spares_ready(status: statuses.RendezvousStatus) -> tuple[str, str, str] | None:
    found = [c for c in status.conditions if c.type == "SparesReady"]
    return None if not found else (found[0].status, found[0].reason, found[0].message)


@pytest.mark.metrics
def test_declared_spares_are_ready_and_a_warning_says_when_the_protection_is_lost(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    control_plane: ControlPlane,
    operator_process: OperatorProcess,
) -> None:
    def short_of_spares() -> float:
        return operator_metrics(operator_process)["k8s_rendezvous_spares_short"]

    rdzv, members, _, waiting = full_round_and_a_spare(make_rendezvous, make_nodes, 2, spares=1)
    ready = rdzv.wait(lambda s: spares_ready(s) is not None and s.spares == 1, "SparesReady")
    assert spares_ready(ready) == (
        "True",
        "SparesWaiting",
        "1 of 1 declared spare(s) wait beyond the full round",
    )
    table = control_plane.kubectl("get", "rdzv", rdzv.name, "-n", rdzv.namespace, "-o", "wide")
    header, row = table.stdout.splitlines()
    shown = dict(zip(header.split(), row.split(), strict=False))
    assert (shown["SPARES"], shown["DECLARED"]) == ("1", "1"), table.stdout

    delete_pod(admin_api, rdzv.namespace, members[1].pod)
    survivor = members[0].join_in_background()
    assert waiting.wait(30).world_size == 2 and survivor.wait(30).world_size == 2
    short = rdzv.wait(
        lambda s: s.round == 2 and (spares_ready(s) or ("",))[0] == "False",
        "SparesReady False once the spare took the lost member's place",
    )
    condition = spares_ready(short)
    assert condition is not None and condition[1] == "SparesShort"
    warnings = wait_for(
        lambda: [
            m for kind, reason, m in rdzv.events() if (kind, reason) == ("Warning", "SparesShort")
        ],
        10,
        "the SparesShort Warning",
    )
    assert warnings == [condition[2]] and warnings[0].startswith("0 of 1 declared spare(s)")
    assert wait_for(lambda: short_of_spares() == 1, 10, "one rendezvous short of spares")

    (replacement,) = make_nodes(rdzv, 1)
    replacement.join_in_background()
    restored = rdzv.wait(
        lambda s: (spares_ready(s) or ("",))[0] == "True",
        "SparesReady again once the workload's next pod waits",
    )
    assert (restored.round, restored.spares) == (2, 1), "a new spare does not disturb the round"
    assert wait_for(lambda: short_of_spares() == 0, 10, "the gauge back at 0")


def test_a_member_whose_pod_is_being_deleted_is_named_leaving_by_the_next_round(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(1, 3)
    survivor, leaver, failed = make_nodes(rdzv, 3)
    join_all([survivor, leaver, failed])
    core = kubernetes.client.CoreV1Api(admin_api)
    # Held while terminating, as a drained pod is for its grace period.
    held = {"metadata": {"finalizers": ["k8s-rendezvous.dev/test-hold"]}}
    core.patch_namespaced_pod(leaver.pod, rdzv.namespace, held)
    try:
        delete_pod(admin_api, rdzv.namespace, leaver.pod)
        set_pod_phase(admin_api, rdzv.namespace, failed.pod, "Failed", exit_code=1)
        wait_told_to_rejoin([survivor], "the round gone stale")
        assert survivor.join_in_background().wait(30).rank == 0
        after = rdzv.status()
        assert [m.node for m in after.members] == [survivor.pod]
        assert after.leaving == (leaver.pod,), "a failed member is not leaving: it is gone"
    finally:
        core.patch_namespaced_pod(leaver.pod, rdzv.namespace, {"metadata": {"finalizers": None}})


def test_a_shrink_moves_only_the_last_rank_into_the_hole(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv = make_rendezvous(2, 4)
    nodes = make_nodes(rdzv, 4)
    join_all(nodes)
    before = [member.node for member in rdzv.status().members]
    delete_pod(admin_api, rdzv.namespace, before[1])
    ranks = {info.rank for info in join_all([n for n in nodes if n.pod != before[1]])}
    assert ranks == {0, 1, 2}
    after = rdzv.status()
    assert [m.node for m in after.members] == [before[0], before[3], before[2]]
    assert [m.replaces for m in after.members] == [None, before[1], None]


def test_a_spare_no_longer_spare_gets_the_whole_join_timeout_afresh_then_times_out(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
) -> None:
    rdzv, members, spare, waiting = full_round_and_a_spare(make_rendezvous, make_nodes, 2)
    assert waiting.still_blocked_after(2 * JOIN_TIMEOUT), f"the spare gave up: {waiting.error!r}"
    # Both members lost and none rejoins: the round re-forms, and the spare alone cannot
    # make minNodes. It is no longer a spare, so its deadline runs again, from now.
    for member in members:
        delete_pod(admin_api, rdzv.namespace, member.pod)
    rdzv.wait(lambda s: s.state is not statuses.RoundState.SEALED, "the round re-forms")
    with pytest.raises(RendezvousTimeoutError, match=f"within {JOIN_TIMEOUT} s"):
        waiting.wait(30)
    assert rdzv.requests()[spare.pod].intent is leases.NodeIntent.LEAVE, "withdrawn"


def test_a_spare_ends_gracefully_when_the_rendezvous_closes(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    _, (member,), _, waiting = full_round_and_a_spare(make_rendezvous, make_nodes, 1)
    member.handler.set_closed()
    with pytest.raises(RendezvousGracefulExitError, match="waited as a spare"):
        waiting.wait(30)


def test_a_waiter_whose_agent_died_is_reported_once_and_never_sealed_into_a_round(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    pod_environment: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    rdzv = make_rendezvous(1, 2, heartbeatTimeoutSeconds=HEARTBEAT_TIMEOUT)
    (member,) = make_nodes(rdzv, 1)
    join_all([member])
    (pod,) = create_pods(admin_api, workers_namespace, ["waiter-0"])
    env = pod_environment(pod, pod["status"]["podIP"])
    with NodeProcess(env, rdzv.name, "1:2", tmp_path / "waiter-0.log") as waiter:
        assert waiter.answer(60)["ready"] == waiter.pid
        waiter.send("next")
        # Its request makes the round re-form; the member, training, has not rejoined yet.
        rdzv.wait(lambda s: s.state is statuses.RoundState.REFORMING, "the newcomer is seen")
        waiter.kill()  # SIGKILL by PID: the agent is gone, the pod runs on

    def expired() -> list[str]:
        return [m for _, reason, m in rdzv.events() if reason == "WaiterExpired"]

    reported = wait_for(expired, HEARTBEAT_TIMEOUT + 30, "the dead waiter is reported")
    assert "pod waiter-0 asked to join" in reported[0], reported
    rejoined = member.join_in_background().wait(30)
    assert rejoined.world_size == 1, "the dead waiter is not sealed into the round"
    status = rdzv.status()
    assert [m.node for m in status.members] == [member.pod]
    assert len(expired()) == 1, "reported once"
    core = kubernetes.client.CoreV1Api(admin_api)
    assert core.read_namespaced_pod("waiter-0", workers_namespace).status.phase == "Running"


def test_after_set_closed_or_shutdown_next_rendezvous_raises_closed_and_writes_nothing(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    operator_process: OperatorProcess,
) -> None:
    rdzv = make_rendezvous(1, 2)
    closing, leaving = make_nodes(rdzv, 2)
    join_all([closing, leaving])
    assert leaving.handler.shutdown()
    with pytest.raises(RendezvousClosedError, match="shutdown"):
        leaving.handler.next_rendezvous()
    assert rdzv.requests()[leaving.pod].intent is leases.NodeIntent.LEAVE, "nothing rewritten"
    # Closed before the operator saw it: no join may overwrite the Close.
    operator_process.kill()
    closing.handler.set_closed()
    with pytest.raises(RendezvousClosedError, match="set_closed"):
        closing.handler.next_rendezvous()
    assert rdzv.requests()[closing.pod].intent is leases.NodeIntent.CLOSE
    assert closing.handler.is_closed()
    operator_process.start()
    rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed once the operator is back")


def test_is_closed_before_the_rendezvous_exists_is_false_as_with_c10d(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    rdzv = make_rendezvous(1, 1)
    (node,) = make_nodes(rdzv, 1)
    client = kube.RendezvousClient(node.api, rdzv.namespace, f"{rdzv.name}-absent", retry_seconds=5)
    handler = KubernetesRendezvousHandler(
        client, run_id="absent", node=node.pod, addr=node.addr, min_nodes=1, max_nodes=1
    )
    try:
        assert handler.is_closed() is False
    finally:
        handler.shutdown()


def test_a_node_of_another_run_id_is_refused_not_merged_into_the_round(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    """Merged, it would wait for ever on another store prefix than the round's others."""
    rdzv = make_rendezvous(1, 2)
    (node,) = make_nodes(rdzv, 1)
    client = kube.RendezvousClient(node.api, rdzv.namespace, rdzv.name, retry_seconds=5)
    other_run = KubernetesRendezvousHandler(
        client, run_id="another-run", node=node.pod, addr=node.addr, min_nodes=1, max_nodes=2
    )
    try:
        with pytest.raises(RendezvousStateError, match="--rdzv-id='another-run'"):
            other_run.next_rendezvous()
    finally:
        other_run.shutdown()
    assert node.pod not in rdzv.requests(), "it asked nothing"


def test_a_node_finishes_when_its_round_entered_torchs_exit_barrier_whoever_calls_shutdown(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    """No torch agent among the callers: the round's store says whether an agent's
    workers succeeded (torch's agent enters its exit barrier only then)."""
    rdzv = make_rendezvous(2, 2)
    done, other = make_nodes(rdzv, 2)
    info, _ = join_all([done, other])
    store_util.barrier(info.store, world_size=1, key_prefix="torchelastic/agent/terminal_state")
    assert done.handler.shutdown()
    assert rdzv.requests()[done.pod].intent is leases.NodeIntent.FINISH
    closed = rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed")
    assert closed.closed_reason == "NodeFinished"
    assert other.handler.num_nodes_waiting() == 0, "the other finishes undisturbed"


def test_a_node_whose_round_never_reached_the_exit_barrier_leaves(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
) -> None:
    rdzv = make_rendezvous(1, 2)
    failed, survivor = make_nodes(rdzv, 2)
    join_all([failed, survivor])
    assert failed.handler.shutdown()
    assert rdzv.requests()[failed.pod].intent is leases.NodeIntent.LEAVE
    wait_for(lambda: survivor.handler.num_nodes_waiting() > 0, 10, "the survivor re-forms")
    assert rdzv.status().state is not statuses.RoundState.CLOSED


def test_the_jobs_restart_budget_is_spent_by_any_nodes_failure_and_ends_every_agent(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    control_plane: ControlPlane,
) -> None:
    rdzv = make_rendezvous(2, 2, maxRestarts=1)
    first, second = make_nodes(rdzv, 2)
    join_all([first, second])
    # second's workers fail: its agent re-rendezvouses, as torch's does for its own
    # --max-restarts; the job's budget counts it too.
    rejoining = second.join_in_background()
    wait_told_to_rejoin([first], "the survivor told to re-rendezvous")
    join_all([first])
    rejoining.wait(30)
    assert rdzv.status().restarts == 1

    # Then first's: another agent, the same job's budget, now spent.
    failing = first.join_in_background()
    closed = rdzv.wait(lambda s: s.state is statuses.RoundState.CLOSED, "closed, budget spent")
    assert (closed.closed_reason, closed.restarts) == ("RestartsExhausted", 1)
    with pytest.raises(RendezvousClosedError):
        failing.wait(30)
    wait_told_to_rejoin([second], "the agent still training sent into the closure")
    with pytest.raises(RendezvousClosedError):
        second.handler.next_rendezvous()
    (warning,) = rdzv.wait_events("Closed", lambda m: True, kind="Warning")
    assert "spec.maxRestarts" in warning and "RestartsExhausted" in warning
    table = control_plane.kubectl("get", "rdzv", rdzv.name, "-n", rdzv.namespace).stdout
    header, row = table.splitlines()
    assert dict(zip(header.split(), row.split(), strict=False))["RESTARTS"] == "1", table
