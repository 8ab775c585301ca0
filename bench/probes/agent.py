"""``torchrun`` whose elastic agent records when each of its steps begins and ends.

    RECOVERY_EVENTS=/path/events.jsonl python -m bench.probes.agent <torchrun arguments>

Runs exactly what ``python -m torch.distributed.run`` runs (its argument parser and
``run``), with the agent ``launch_agent`` builds subclassed to append one JSON line per
step to the file named by ``RECOVERY_EVENTS``: a worker group's state changing, the first
``num_nodes_waiting() > 0``, a restart and why, stopping the workers, the rendezvous (with
the round's group rank and size) and starting the workers; for ours on the in-place path
also when its handler begins re-forming the round in place and when it publishes a round
to the workers. The recovery section of the
benchmark (:mod:`bench.recovery`) reads them to break a recovery down; every backend runs
under this same launcher, so each pays the same few file appends per recovery.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch.distributed.launcher.api as launcher
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.run import get_args_parser, run

EVENTS_ENV = "RECOVERY_EVENTS"


def record(event: str, **fields: Any) -> None:
    """Append ``event`` with the wall-clock time (one short write: lines never mix)."""
    path = os.environ.get(EVENTS_ENV)
    if path:
        line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields})
        with open(path, "a") as events:
            events.write(line + "\n")


class ReformRecorder:
    """Records the steps of ours on the in-place path (a reformer's observer)."""

    def rejoining(self) -> None:
        record("reform")

    def published(self, round_number: int, in_place: bool) -> None:
        record("published", round=round_number, in_place=in_place)


class ProbedAgent(launcher.LocalElasticAgent):  # type: ignore[misc, name-defined]
    """torch's local agent, unchanged but for the records around its steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_state: WorkerState | None = None
        self._waiting_seen = False
        handler = self._worker_group.spec.rdzv_handler
        asked = handler.num_nodes_waiting

        def num_nodes_waiting() -> int:
            waiting = int(asked())
            if waiting > 0 and not self._waiting_seen:
                self._waiting_seen = True
                record("nodes_waiting", waiting=waiting)
            return waiting

        handler.num_nodes_waiting = num_nodes_waiting
        # Ours on the in-place path: when its reformer acts on a change, and when it
        # publishes a round to the workers.
        reformer = getattr(handler, "reformer", None)
        if reformer is not None:
            reformer.observer = ReformRecorder()

    def _monitor_workers(self, worker_group: WorkerGroup) -> Any:
        result = super()._monitor_workers(worker_group)
        if result.state is not self._last_state:
            self._last_state = result.state
            record("state", state=result.state.name)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        record("restart", state=worker_group.state.name)
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        record("stop")
        super()._stop_workers(worker_group)
        record("stopped")

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        record("rendezvous")
        super()._rendezvous(worker_group)
        self._waiting_seen = False
        self._last_state = None
        record(
            "rendezvous_done",
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
        )

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        record("start")
        pids: dict[int, Any] = super()._start_workers(worker_group)
        record("started", pids=sorted(pids.values()))
        return pids


def main(argv: list[str]) -> None:
    # What launch_agent builds its agent from (a name the module imports, not one it exports).
    launcher.LocalElasticAgent = ProbedAgent  # type: ignore[attr-defined]
    record("launched")
    run(get_args_parser().parse_args(argv))  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main(sys.argv[1:])
