"""Re-forming in place end to end: ``torchrun --rdzv-conf in_place=1`` jobs whose workers
run examples/elastic_train_in_place.py (k8s_rendezvous.in_place, gloo on the CPU) against
the real control plane and operator, every node a Pod on a kwok node plus a local
torchrun with that pod's own credentials.

- The rank-0 node is killed (its processes SIGKILLed, its Pod deleted): the survivors'
  workers, the very same processes, go on training in a world of 4 with dense ranks (the
  last node moves into rank 0, the other keeps its rank), from the step they were at,
  with one model on every rank;
  no agent restarts its workers, and the job finishes.
- Then a node is added: it joins that world as the last ranks, the others still the same
  processes, every rank holding the same model.
- A spare waits beyond a full world; rank 1's node is killed: the spare's workers (cold,
  or forked warm) join the survivors' running workers at rank 1's ranks, and the
  survivors keep theirs.

Progress lines say which process trained which step as which rank, in which round, and
the model's checksum after the step (4 elements of ``step + 1`` each).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import pytest
from tests.e2e.harness import LocalPod, LocalPods, describe, timing, wait_all_exit
from tests.support.fixtures import Rendezvous

from devkit.paths import REPO
from devkit.processes import wait_world
from devkit.waiting import wait_for
from k8s_rendezvous import warm as warm_start

IN_PLACE_SCRIPT = REPO / "examples" / "elastic_train_in_place.py"
SIZE = 4
"""Elements of the example's model."""
FORM_TIMEOUT = 120
STEPS = ["--steps", "300", "--step-seconds", "0.1"]
"""Long enough for a kill and an arrival while the others train (a node takes several
seconds to start on this machine)."""
RESTARTED = ("Stopping worker group", "Detected 1 new nodes", "will restart worker group")
"""What torch's agent logs when it restarts its workers."""

Line = dict[str, Any]


def wait_lines(nodes: Iterable[LocalPod], size: int, *, after: float) -> list[Line]:
    """The progress lines of the world of ``size`` ranks that trains on ``nodes`` after
    ``after`` (wall clock), once every rank has completed a step in it."""
    return wait_world(list(nodes), size, after=after, timeout=FORM_TIMEOUT)


def pids(lines: Iterable[Line], nodes: Iterable[LocalPod]) -> set[tuple[str, int]]:
    names = {node.name for node in nodes}
    return {(line["pod"], line["pid"]) for line in lines if line["pod"] in names}


def resumed(lines: Iterable[Line]) -> float:
    """When every rank of a world had completed its first step in it (wall clock)."""
    first: dict[int, float] = {}
    for line in lines:
        first[line["rank"]] = min(first.get(line["rank"], line["time"]), line["time"])
    return max(first.values())


def assert_one_model(lines: Iterable[Line]) -> None:
    """Every rank that trained a step holds the same model after it: ``step + 1``."""
    by_step: dict[int, set[float]] = {}
    for line in lines:
        by_step.setdefault(line["step"], set()).add(line["checksum"])
    for step, checksums in by_step.items():
        assert checksums == {SIZE * (step + 1.0)}, (step, checksums)


def assert_finish_undisturbed(
    everyone: list[LocalPod], survivors: list[LocalPod], workers: set[tuple[str, int]]
) -> None:
    """Every node finishes, with one model on every rank, and no survivor's worker was
    ever restarted."""
    codes = wait_all_exit(everyone, FORM_TIMEOUT)
    assert codes == {node.name: 0 for node in everyone}, describe(everyone)
    lines = [line for node in everyone for line in node.progress_lines()]
    assert_one_model(lines)
    assert pids(lines, survivors) == workers, "no survivor's worker was ever restarted"
    assert_not_restarted(survivors)


def assert_not_restarted(nodes: Iterable[LocalPod]) -> None:
    for node in nodes:
        log = node.log()
        assert not [phrase for phrase in RESTARTED if phrase in log], describe([node])
        assert "re-formed in place" in log, describe([node])


def test_a_killed_rank0_node_and_an_added_node_are_reformed_around_running_workers(
    pods: LocalPods, make_rendezvous: Any
) -> None:
    rdzv: Rendezvous = make_rendezvous(2, 4, lastCallTimeoutSeconds=5)
    started = time.time()
    nodes = pods.start(
        rdzv.name,
        {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"},
        rdzv_conf="in_place=1",
        script=IN_PLACE_SCRIPT,
        script_args=STEPS,
    )
    wait_lines(nodes, 6, after=started)
    first = wait_lines(nodes, 6, after=time.time())  # trained a step more, every rank
    group_ranks = {line["pod"]: line["group_rank"] for line in first}
    victim = next(node for node in nodes if group_ranks[node.name] == 0)
    survivors = sorted((n for n in nodes if n is not victim), key=lambda n: group_ranks[n.name])
    workers = pids(first, survivors)

    killed = time.time()
    victim.kill()
    smaller = wait_lines(survivors, 4, after=killed)
    timing(
        "rank-0 node killed -> every rank's first step in the world of 4", resumed(smaller) - killed
    )

    assert pids(smaller, survivors) == workers, "the survivors' workers are the same processes"
    assert {line["rank"] for line in smaller} == set(range(4))
    assert {(line["pod"], line["group_rank"]) for line in smaller} == {
        (survivors[1].name, 0),
        (survivors[0].name, 1),
    }, "dense: the last node moved into rank 0, the other kept its rank"
    assert len({line["master"] for line in smaller}) == 1
    assert {line["round"] for line in smaller} != {line["round"] for line in first}
    last_before = max(line["step"] for line in first)
    assert min(line["step"] for line in smaller) >= last_before, "training went on"

    added = time.time()
    (newcomer,) = pods.start(
        rdzv.name,
        {"n4": "127.0.0.14"},
        rdzv_conf="in_place=1",
        script=IN_PLACE_SCRIPT,
        script_args=STEPS,
    )
    everyone = [*survivors, newcomer]
    larger = wait_lines(everyone, 6, after=added)
    timing("node added -> every rank's first step in the world of 6", resumed(larger) - added)

    assert pids(larger, survivors) == workers, "still the same processes"
    joined = [line for line in larger if line["pod"] == newcomer.name]
    assert {line["rank"] for line in joined} == {4, 5}, "newcomers are appended"
    assert {line["group_rank"] for line in joined} == {2}
    assert min(line["step"] for line in larger) > last_before

    pods.finish()
    assert_finish_undisturbed(everyone, survivors, workers)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_waiting_spare_takes_the_lost_rank_in_place_and_the_survivors_keep_theirs(
    pods: LocalPods, make_rendezvous: Any, warm: bool
) -> None:
    rdzv: Rendezvous = make_rendezvous(2, 3, lastCallTimeoutSeconds=5)
    options: dict[str, Any] = {
        "rdzv_conf": "in_place=1,warm_start=1" if warm else "in_place=1",
        "warm": warm,
        "script": IN_PLACE_SCRIPT,
        "script_args": STEPS,
    }
    started = time.time()
    nodes = pods.start(
        rdzv.name, {"n1": "127.0.0.11", "n2": "127.0.0.12", "n3": "127.0.0.13"}, **options
    )
    wait_lines(nodes, 6, after=started)
    (spare,) = pods.start(rdzv.name, {"n4": "127.0.0.14"}, **options)
    rdzv.wait_requests(lambda r: spare.name in r, "the spare asked to join", FORM_TIMEOUT)
    if warm:  # a spare that has waited a while: its zygote has imported torch
        wait_for(lambda: warm_start.READY_MESSAGE in spare.log(), FORM_TIMEOUT, "spare warm")
    first = wait_lines(nodes, 6, after=time.time())
    group_ranks = {line["pod"]: line["group_rank"] for line in first}
    victim = next(node for node in nodes if group_ranks[node.name] == 1)
    survivors = [node for node in nodes if node is not victim]
    workers = pids(first, survivors)

    killed = time.time()
    victim.kill()
    everyone = [*survivors, spare]
    replaced = wait_lines(everyone, 6, after=killed)
    timing(
        f"rank-1 node killed, a spare waiting ({'warm' if warm else 'cold'}) -> every rank's "
        "first step in the world of 6",
        resumed(replaced) - killed,
    )

    assert pids(replaced, survivors) == workers, "the survivors' workers are the same processes"
    assert {(line["pod"], line["group_rank"]) for line in replaced} == {
        *((node.name, group_ranks[node.name]) for node in survivors),
        (spare.name, 1),
    }, "the spare at the lost rank, the survivors at theirs"
    assert {line["rank"] for line in replaced if line["pod"] == spare.name} == {2, 3}
    assert [m.replaces for m in rdzv.status().members] == [None, victim.name, None]

    pods.finish()
    assert_finish_undisturbed(everyone, survivors, workers)
