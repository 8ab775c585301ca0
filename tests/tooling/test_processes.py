"""devkit/processes.py's wait for a world: what makes a world formed in the workers'
progress lines (every rank of it, on exactly the nodes named, after the moment given), and
the wait over real local processes, which returns that world's lines and fails at once,
with the log tails, when a node exits first.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from devkit.processes import LocalProcess, formed_world, wait_world
from devkit.waiting import WaitTimeout


def line(pod: str, rank: int, size: int, at: float) -> dict[str, Any]:
    return {"pod": pod, "rank": rank, "world_size": size, "time": at}


def test_a_world_is_formed_once_every_rank_stepped_on_exactly_its_nodes() -> None:
    lines = [line("a", 0, 2, 1.0), line("b", 1, 2, 1.1)]
    assert formed_world(lines, 2, ["a", "b"], after=0.0) == lines
    assert formed_world(lines[:1], 2, ["a", "b"], after=0.0) is None, "rank 1 has not stepped"
    assert formed_world(lines, 2, ["a", "b"], after=1.05) is None, "rank 0's step came before"
    assert formed_world(lines, 2, ["a", "b", "c"], after=0.0) is None, "c is not in it"
    assert formed_world(lines, 3, ["a", "b"], after=0.0) is None, "a world of another size"
    bigger = [*lines, line("c", 2, 3, 2.0)]
    assert formed_world(bigger, 2, ["a", "b"], after=0.0) == lines, "only that size's lines"


class Writer(LocalProcess):
    """A node whose process appends ``lines`` to its progress file, then runs on for
    ``linger`` seconds."""

    def __init__(self, name: str, directory: Path) -> None:
        super().__init__(name, directory / name)
        self.progress_path = self.directory / "progress.jsonl"

    def write(self, lines: list[dict[str, Any]], linger: float) -> None:
        text = "".join(json.dumps(entry) + "\n" for entry in lines)
        script = (
            "import sys, time\n"
            f"open({str(self.progress_path)!r}, 'a').write({text!r})\n"
            f"print('wrote', flush=True); time.sleep({linger})\n"
        )
        self.spawn([sys.executable, "-c", script])


def test_the_wait_returns_the_world_its_processes_wrote(tmp_path: Path) -> None:
    after = time.time()
    nodes = [Writer(name, tmp_path) for name in ("a", "b")]
    try:
        for rank, node in enumerate(nodes):
            node.write([line(node.name, rank, 2, after + 1)], linger=30)
        found = wait_world(nodes, 2, after=after, timeout=30)
    finally:
        for node in nodes:
            node.stop()
    assert sorted((entry["pod"], entry["rank"]) for entry in found) == [("a", 0), ("b", 1)]


def test_the_wait_fails_at_once_with_the_tails_when_a_node_exits(tmp_path: Path) -> None:
    after = time.time()
    nodes = [Writer(name, tmp_path) for name in ("a", "b")]
    try:
        nodes[0].write([line("a", 0, 2, after + 1)], linger=30)
        nodes[1].write([], linger=0)
        with pytest.raises(WaitTimeout) as raised:
            wait_world(nodes, 2, after=after, timeout=60)
    finally:
        for node in nodes:
            node.stop()
    message = str(raised.value)
    assert "no world of 2 on ['a', 'b']" in message
    assert "['b'] exited" in message, "b's exit ended the wait, not the timeout"
    assert "=== b\nwrote" in message, "each node's log tail"
