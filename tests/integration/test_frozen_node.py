"""A node whose process is frozen (SIGSTOP, as when its network is cut or its host
stalls) and later thawed (SIGCONT), against the real control plane.

Aspects: the frozen node runs our real handler in its own OS process, authenticated with
its pod's bound token; the operator drops a frozen member once its agent answers none of
the operator's probes for the probe window (3 s, long before its 30 s heartbeat window),
a frozen spare as soon, so that it never takes a frozen member's place, and a frozen
waiter that answers no probes once its Lease is not renewed for heartbeatTimeoutSeconds; the
survivors form a new round without it, with a new master; back from SIGCONT, its agent is
told to re-rendezvous and joins a later round with a fresh rank, never disturbing the
round formed without it. Every handler's result,
the frozen one's included, is checked against the invariants at teardown.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import Node, Rendezvous, create_pods, wait_told_to_rejoin
from tests.support.node_process import NodeProcess

from devkit import invariants
from devkit.waiting import wait_for
from k8s_rendezvous.wire import statuses

pytestmark = pytest.mark.usefixtures("operator_process")

HEARTBEAT_TIMEOUT = 3  # the CRD's minimum: nodes renew every second
PROBE_WINDOW = 3  # the operator's default (--probe-window)


def record(rdzv: Rendezvous, pod: str, answer: dict[str, Any]) -> None:
    """Add what the node process returned to the history checked at teardown."""
    assert rdzv.recorder is not None
    if "error" in answer:
        rdzv.recorder.outcomes.append(invariants.Outcome(pod, error=answer["error"]))
        return
    rdzv.recorder.outcomes.append(
        invariants.Outcome(
            pod,
            round=answer["round"],
            rank=answer["rank"],
            world_size=answer["world_size"],
            master=(answer["master"][0], answer["master"][1]),
        )
    )


def test_a_frozen_node_is_dropped_and_its_return_does_not_corrupt_the_new_round(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    pod_environment: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    rdzv = make_rendezvous(2, 3, lastCallTimeoutSeconds=30)  # heartbeats: 30 s, the default
    # "frozen-0" sorts before "node-*": it is rank 0, the round's master, when frozen.
    (pod,) = create_pods(admin_api, workers_namespace, ["frozen-0"])
    survivors = make_nodes(rdzv, 2)
    env = pod_environment(pod, pod["status"]["podIP"])
    with NodeProcess(env, rdzv.name, "2:3", tmp_path / "frozen-0.log") as frozen:
        assert frozen.answer(60)["ready"] == frozen.pid
        frozen.send("next")
        first_joins = [node.join_in_background() for node in survivors]
        first = frozen.answer(60)
        record(rdzv, "frozen-0", first)
        assert (first["round"], first["rank"], first["world_size"]) == (1, 0, 3), first
        assert sorted(j.wait(60).rank for j in first_joins) == [1, 2]

        frozen.freeze()
        frozen_at = time.monotonic()
        wait_for(
            lambda: all(node.handler.num_nodes_waiting() > 0 for node in survivors),
            PROBE_WINDOW + 15,
            "the survivors are told to re-rendezvous",
            interval=0.05,
        )
        detected = time.monotonic() - frozen_at
        rdzv.wait_events("MemberLost", lambda m: "frozen-0" in m and "AgentUnreachable" in m)

        second_joins = [node.join_in_background() for node in survivors]
        second = sorted(j.wait(60).rank for j in second_joins)
        reformed = time.monotonic() - frozen_at
        assert second == [0, 1]
        sealed = rdzv.status()
        # The last rank moves into the frozen node's rank 0; rank 1 keeps its rank.
        reordered = [survivors[1], survivors[0]]
        assert sealed.round == 2 and [m.node for m in sealed.members] == [
            n.pod for n in reordered
        ], "only the last rank moved; the frozen node is out"
        assert sealed.master is not None and sealed.master.addr == reordered[0].addr

        frozen.thaw()
        # Back, its agent reads its own round as stale (no API call: the watched status)...
        wait_for(
            lambda: frozen.ask("waiting", 30)["waiting"] > 0,
            30,
            "the thawed node sees its round is no longer current",
        )
        assert rdzv.status().round == 2 and rdzv.status().state is statuses.RoundState.SEALED, (
            "being back changes nothing until it asks to join"
        )
        # ...and re-rendezvouses: a later round, a fresh rank after the survivors.
        frozen.send("next")
        wait_told_to_rejoin(survivors, "the survivors are told a node waits", timeout=30)
        third_joins = [node.join_in_background() for node in survivors]
        back = frozen.answer(60)
        record(rdzv, "frozen-0", back)
        assert sorted(j.wait(60).rank for j in third_joins) == [0, 1]
        assert (back["round"], back["rank"], back["world_size"]) == (3, 2, 3), back
        third = rdzv.status()
        assert [m.node for m in third.members] == [*(n.pod for n in reordered), "frozen-0"]
        assert third.master is not None and third.master.addr == reordered[0].addr
        print(
            f"frozen rank 0: survivors told after {detected:.2f} s, new round sealed "
            f"{reformed:.2f} s after SIGSTOP (probe window {PROBE_WINDOW} s)"
        )


def test_a_node_frozen_while_joining_returns_its_old_round_then_joins_a_later_one(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    pod_environment: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    """Frozen inside next_rendezvous(): its request is sealed into round 1 without its
    knowing, and it is dropped from it. Thawed, it returns round 1 (the event was waiting
    in its socket), a round already over: told so at once, it joins a later round with a
    fresh rank. It sorts last: frozen as rank 0, its store would hold the others' TCPStore
    connect until read_timeout."""
    rdzv = make_rendezvous(
        2, 3, heartbeatTimeoutSeconds=HEARTBEAT_TIMEOUT, lastCallTimeoutSeconds=30
    )
    (pod,) = create_pods(admin_api, workers_namespace, ["zfrozen-0"])
    survivors = make_nodes(rdzv, 2)
    env = pod_environment(pod, pod["status"]["podIP"])
    with NodeProcess(env, rdzv.name, "2:3", tmp_path / "zfrozen-0.log") as frozen:
        assert frozen.answer(60)["ready"] == frozen.pid
        frozen.send("next")
        rdzv.wait_requests(lambda r: "zfrozen-0" in r, "the node's join is recorded")
        frozen.freeze()
        first = [node.join_in_background() for node in survivors]
        assert sorted(j.wait(60).rank for j in first) == [0, 1]
        assert [m.node for m in rdzv.status().members][-1] == "zfrozen-0", "sealed in, unaware"

        wait_for(
            lambda: all(node.handler.num_nodes_waiting() > 0 for node in survivors),
            HEARTBEAT_TIMEOUT + 30,
            "the frozen member is dropped",
            interval=0.05,
        )
        second = [node.join_in_background() for node in survivors]
        assert sorted(j.wait(60).rank for j in second) == [0, 1]
        assert rdzv.status().round == 2

        frozen.thaw()
        old = frozen.answer(60)
        record(rdzv, "zfrozen-0", old)
        assert (old["round"], old["rank"], old["world_size"]) == (1, 2, 3), old
        wait_for(
            lambda: frozen.ask("waiting", 30)["waiting"] > 0,
            30,
            "the thawed node learns its round is over (its watch catches up)",
        )
        assert rdzv.status().round_key == "2-Sealed", "its return alone changes nothing"

        frozen.send("next")
        wait_told_to_rejoin(survivors, "the survivors are told a node waits", timeout=30)
        third = [node.join_in_background() for node in survivors]
        back = frozen.answer(60)
        record(rdzv, "zfrozen-0", back)
        assert sorted(j.wait(60).rank for j in third) == [0, 1]
        assert (back["round"], back["rank"], back["world_size"]) == (3, 2, 3), back


def test_a_spare_frozen_with_a_member_does_not_take_its_place(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    pod_environment: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    """A Kubernetes node lost takes a member and the spare beside it: the survivor
    re-forms alone, not with a spare that would never answer its rank assignment."""
    rdzv = make_rendezvous(1, 2, lastCallTimeoutSeconds=30)  # heartbeats: 30 s, the default
    pods = create_pods(admin_api, workers_namespace, ["frozen-member", "frozen-spare"])
    (survivor,) = make_nodes(rdzv, 1)
    member_env, spare_env = (pod_environment(p, p["status"]["podIP"]) for p in pods)
    with (
        NodeProcess(member_env, rdzv.name, "1:2", tmp_path / "member.log") as member,
        NodeProcess(spare_env, rdzv.name, "1:2", tmp_path / "spare.log") as spare,
    ):
        assert member.answer(60)["ready"] == member.pid
        assert spare.answer(60)["ready"] == spare.pid
        member.send("next")
        joining = survivor.join_in_background()
        first = member.answer(60)
        record(rdzv, "frozen-member", first)
        assert joining.wait(60).world_size == 2 and first["world_size"] == 2
        spare.send("next")
        wait_for(lambda: rdzv.status().spares == 1 or None, 30, "the spare waiting")

        spare.freeze()  # first: its silence is judged no later than the member's
        member.freeze()
        wait_for(
            lambda: survivor.handler.num_nodes_waiting() > 0,
            PROBE_WINDOW + 15,
            "the survivor is told to re-rendezvous",
            interval=0.05,
        )
        again = survivor.join_in_background().wait(60)
        assert (again.rank, again.world_size) == (0, 1), "re-formed alone, not with the spare"
        sealed = rdzv.status()
        assert [m.node for m in sealed.members] == [survivor.pod]
        assert sealed.nodes_waiting == 0, "the silent spare is not counted"
