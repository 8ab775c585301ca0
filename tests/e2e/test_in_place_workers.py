"""The workers' side of re-forming in place (k8s_rendezvous.in_place), with real gloo
processes running examples/elastic_train_in_place.py and the test playing every node's
handler: it serves each round's store (a TCPStore, as a round's rank 0 does) and writes
the round each node's workers are in (k8s_rendezvous.handoff), as the handler would after
the operator sealed it.

- A node's worker is SIGKILLed: the others, the same processes, re-form a world of 2
  from the step they were at (those blocked on a survivor, not on the dead one, too).
- A node's worker stops answering (SIGSTOP: its connections stay open, as a node cut off
  from the network leaves them): the others, blocked on it, fail and re-form once the
  round that dropped its address is published.
- A node arrives: the running workers train on until it has joined, then switch to a
  world of 3 together, the newcomer last.
- The handler gives up: a worker waiting to re-form stops waiting and says why, and ends
  at once at the agent's SIGTERM.
- A worker told to stop (SIGTERM, as torch's agent sends when the pod is deleted) inside
  a step finishes it with its peers, who do not cut it off (the round names it leaving),
  then leaves at the step boundary: the others re-form without doing any step twice. One
  whose step outlasts the grace period leaves when it is over; one that stops answering
  instead of leaving is cut off once the grace is over.

No Kubernetes here: tests/e2e/test_in_place.py runs the whole path.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from devkit.paths import REPO
from devkit.processes import LocalProcess, json_lines, wait_world
from devkit.waiting import wait_for
from k8s_rendezvous import handoff

SCRIPT = REPO / "examples" / "elastic_train_in_place.py"
SIZE = 4
UID = "rendezvous-uid"


class Node(LocalProcess):
    """One node's handoff directory and its single worker process."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(name, directory / name, log_name="worker.log")
        self.handoff = self.directory / "handoff"
        self.handoff.mkdir()
        self.progress_path = self.directory / "progress.jsonl"

    def publish(
        self,
        round_number: int,
        master: str,
        group_rank: int,
        nodes: int,
        lost_addresses: tuple[str, ...] = (),
        leaving: tuple[str, ...] = (),
        **ranks: int,
    ) -> None:
        handoff.write(
            self.handoff,
            handoff.ROUND_FILE,
            handoff.PublishedRound(
                round_number,
                handoff.round_uuid(UID, round_number, master),
                master,
                group_rank,
                nodes,
                ranks.get("base_rank"),
                ranks.get("world_size"),
                lost_addresses=lost_addresses,
                leaving_addresses=leaving,
            ),
        )

    def give_up(self, reason: str) -> None:
        published = handoff.read_round(self.handoff)
        assert published is not None
        handoff.write(
            self.handoff, handoff.ROUND_FILE, dataclasses.replace(published, fallback=reason)
        )

    def start(
        self, rank: int, world_size: int, group_rank: int, master: str, compute: float = 0.0
    ) -> None:
        host, _, port = master.rpartition(":")
        self.spawn(
            [
                sys.executable,
                str(SCRIPT),
                *("--steps", "100000", "--step-seconds", "0.02"),
                *("--compute-seconds", str(compute)),
            ],
            {
                handoff.DIRECTORY_ENV: str(self.handoff),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": "0",
                "GROUP_RANK": str(group_rank),
                "MASTER_ADDR": host,
                "MASTER_PORT": port,
                "POD_NAME": self.name,
                "TRAIN_PROGRESS_FILE": str(self.progress_path),
            },
        )

    def lines(self) -> list[dict[str, Any]]:
        return json_lines(self.progress_path)

    def send(self, number: signal.Signals) -> None:
        """Send ``number`` to the worker's process group (its session, by PID)."""
        assert self.pid is not None, f"{self.name} was never started"
        os.killpg(self.pid, number)

    def tail(self) -> str:
        return f"=== {self.name}\n{self.log_tail(15)}"


class Rounds:
    """The rounds' stores, served from the test process (each round's rank 0 would)."""

    def __init__(self) -> None:
        self.stores: list[TCPStore] = []

    def new(self, host: str = "127.0.0.1") -> str:
        """A round's store, reached at ``host`` (any loopback address reaches it)."""
        store = TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        self.stores.append(store)
        return f"{host}:{store.port}"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    made = {name: Node(name, tmp_path) for name in ("a", "b", "c", "d")}
    try:
        yield made
    finally:
        for node in made.values():
            node.stop()


def world(nodes: list[Node], size: int, after: float) -> list[dict[str, Any]]:
    """The progress lines of the world of ``size`` on ``nodes`` after ``after``, once every
    rank has completed a step in it."""
    return wait_world(nodes, size, after=after, timeout=120)


def start_world(rounds: Rounds, nodes: list[Node], compute: float = 0.0) -> list[dict[str, Any]]:
    """Round 1 with ``nodes`` in rank order, trained in: its progress lines."""
    master = rounds.new()
    for rank, node in enumerate(nodes):
        node.publish(1, master, rank, len(nodes))
        node.start(rank, len(nodes), rank, master, compute)
    return world(nodes, len(nodes), 0)


def seen(lines: list[dict[str, Any]], *keys: str) -> set[tuple[Any, ...]]:
    return {tuple(line[key] for key in keys) for line in lines}


def test_a_lost_worker_and_a_new_one_are_reformed_around_the_running_workers(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()
    a, b, c, d = nodes.values()
    first = start_world(rounds, [a, b, c])
    pids = {line["pod"]: line["pid"] for line in first}

    killed = time.time()
    c.send(signal.SIGKILL)
    master = rounds.new()
    a.publish(2, master, 0, 2, base_rank=0, world_size=2)
    b.publish(2, master, 1, 2, base_rank=1, world_size=2)
    smaller = world([a, b], 2, killed)
    assert seen(smaller, "pod", "pid", "rank") == {("a", pids["a"], 0), ("b", pids["b"], 1)}
    before = max(line["step"] for line in first if line["time"] < killed)
    assert min(line["step"] for line in smaller) >= before, "training went on"
    assert seen(smaller, "round") == {(2,)}

    added = time.time()
    master = rounds.new()
    a.publish(3, master, 0, 3, base_rank=0, world_size=3)
    b.publish(3, master, 1, 3, base_rank=1, world_size=3)
    d.publish(3, master, 2, 3)
    d.start(2, 3, 2, master)
    larger = world([a, b, d], 3, added)
    assert seen(larger, "pod", "rank") == {("a", 0), ("b", 1), ("d", 2)}
    assert {line["pid"] for line in larger if line["pod"] != "d"} == {pids["a"], pids["b"]}
    by_step: dict[int, set[float]] = {}
    for line in a.lines() + b.lines() + d.lines():
        by_step.setdefault(line["step"], set()).add(line["checksum"])
    assert all(sums == {SIZE * (step + 1.0)} for step, sums in by_step.items()), by_step


def test_workers_blocked_on_a_peer_that_stopped_answering_reform_once_it_is_dropped(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()
    a, b, c, _ = nodes.values()
    pids = {line["pod"]: line["pid"] for line in start_world(rounds, [a, b, c])}

    c.send(signal.SIGSTOP)
    # Without the cut, a and b would wait in their next all-reduce for gloo's timeout (30
    # minutes). Every node here has the same address: the survivors cut each other too,
    # and re-form all the same (on Kubernetes only the lost pod's address is cut). Round
    # 2's store is reached at another address, as a survivor's would be.
    dropped = time.time()
    master = rounds.new("127.0.0.2")
    a.publish(2, master, 0, 2, ("127.0.0.1",), base_rank=0, world_size=2)
    b.publish(2, master, 1, 2, ("127.0.0.1",), base_rank=1, world_size=2)
    smaller = world([a, b], 2, dropped)
    assert seen(smaller, "pod", "pid", "rank") == {("a", pids["a"], 0), ("b", pids["b"], 1)}
    assert "shut down" in a.log() and "shut down" in b.log()


def test_a_worker_waiting_to_reform_stops_waiting_when_its_handler_gives_up(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()  # serves the round's store for as long as the test runs
    a, b, *_ = nodes.values()
    start_world(rounds, [a, b])

    b.send(signal.SIGKILL)
    wait_for(lambda: "re-forming the world in place" in a.log(), 60, "a's recovery")
    a.give_up("the join in place failed")

    def gave_up() -> str | None:
        record = handoff.read_worker(a.handoff, 0)
        return None if record is None else record.fallback

    reason = wait_for(gave_up, 60, "a's worker to give up")
    assert "the node's handler gave up: the join in place failed" in reason
    assert "falling back to torch's restart" in a.log()
    assert a.running(), "it waits for the agent to stop it"
    a.send(signal.SIGTERM)
    wait_for(lambda: not a.running(), 10, "a, waiting between steps, to end at SIGTERM")
    assert a.returncode == 128 + signal.SIGTERM and "SIGTERM between steps" in a.log()


def test_a_worker_told_to_stop_finishes_its_step_then_leaves_and_the_others_go_on(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()
    a, b, c, _ = nodes.values()
    # Each step is mostly work before its all-reduce, as a forward and backward pass: a
    # worker ended at SIGTERM would end inside one, and its peers would redo that step.
    start_world(rounds, [a, b, c], compute=1.0)
    # Every worker well into its next step's work (the rest of a step takes milliseconds);
    # between steps there is nothing to finish, and a worker leaves at once.
    wait_for(
        lambda: time.time() - max(line["time"] for n in (a, b, c) for line in n.lines()) > 0.3,
        10,
        "every worker in its step's work",
    )
    told = time.time()
    c.send(signal.SIGTERM)  # what torch's agent sends when the pod is deleted
    # At once, as the operator seals the round without a pod being deleted: c is leaving,
    # so a and b do not cut it off (every node here has c's address), and finish the step
    # with it.
    master = rounds.new("127.0.0.2")
    a.publish(2, master, 0, 2, base_rank=0, world_size=2, leaving=("127.0.0.1",))
    b.publish(2, master, 1, 2, base_rank=1, world_size=2, leaving=("127.0.0.1",))
    wait_for(lambda: not c.running(), 15, "c to leave")
    assert c.returncode == 128 + signal.SIGTERM, c.tail()
    finished = [line for line in c.lines() if line["time"] > told]
    assert finished, f"c finished the step in flight after SIGTERM\n{c.tail()}"
    assert "leaving at the step boundary" in c.log()

    smaller = world([a, b], 2, told)
    last = max(line["step"] for line in c.lines())
    assert min(line["step"] for line in smaller) == last + 1, "no step done twice"


def test_a_worker_whose_step_outlasts_the_grace_leaves_when_it_is_over(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()
    a, b, *_ = nodes.values()
    start_world(rounds, [a, b], compute=handoff.STOP_GRACE_SECONDS + 5)
    # A second into its next step's work (the rest of a step takes milliseconds).
    wait_for(lambda: time.time() - max(line["time"] for line in a.lines()) > 1, 10, "a's work")
    told = time.time()
    a.send(signal.SIGTERM)
    wait_for(lambda: not a.running(), handoff.STOP_GRACE_SECONDS + 10, "a to give up its step")
    assert a.returncode == 128 + signal.SIGTERM
    assert a.exited_at is not None and a.exited_at - told >= handoff.STOP_GRACE_SECONDS
    assert "did not end within" in a.log()


def test_a_leaving_worker_that_stops_answering_is_cut_off_once_the_grace_is_over(
    nodes: dict[str, Node],
) -> None:
    rounds = Rounds()
    a, b, c, _ = nodes.values()
    pids = {line["pod"]: line["pid"] for line in start_world(rounds, [a, b, c])}

    c.send(signal.SIGSTOP)  # its pod deleted while its node is cut off: it never leaves
    dropped = time.time()
    master = rounds.new("127.0.0.2")
    a.publish(2, master, 0, 2, base_rank=0, world_size=2, leaving=("127.0.0.1",))
    b.publish(2, master, 1, 2, base_rank=1, world_size=2, leaving=("127.0.0.1",))
    smaller = world([a, b], 2, dropped)
    assert seen(smaller, "pod", "pid", "rank") == {("a", pids["a"], 0), ("b", pids["b"], 1)}
    resumed = min(line["time"] for line in smaller)
    assert resumed - dropped >= handoff.STOP_GRACE_SECONDS, "it was given the grace to leave"
    # The first survivor whose grace runs out cuts it off; the other's collective then
    # fails on that survivor and re-forms at once, before its own grace may run out.
    assert "while leaving" in a.log() + b.log(), "cut off once the grace was over"
