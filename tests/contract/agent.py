"""One elastic agent, as a node runs it: torch's ``LocalElasticAgent`` with the
rendezvous handler torch's registry builds for the backend, and the entrypoint a
function of :mod:`tests.contract.workers`.

    python -m tests.contract.agent '<json config>'

The config names the backend, endpoint, run id, node counts, is_host, the role, local
world size, entrypoint and its args, max_restarts, monitor interval, exit barrier and
where to write the result. The result (JSON, written atomically when ``run()`` returns or
raises) is the ``RunResult`` summarized: state, each global rank's return value
(described: type, shape of a tensor, the value itself if JSON can hold it), each
failure's exit code and message, and the agent's restarts left.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from tests.contract import workers
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler


def describe(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"type": "Tensor", "shape": list(value.shape)}
    try:
        json.dumps(value)
    except TypeError:
        return {"type": type(value).__name__, "repr": repr(value)}
    return {"type": type(value).__name__, "value": value}


def _failure_text(message: str | dict[str, Any]) -> dict[str, str]:
    """A function worker's error file gives a dict (the exception and its traceback), a
    signal or an exit without one a plain message."""
    if isinstance(message, str):
        return {"message": message, "traceback": ""}
    return {
        "message": str(message.get("message", "")),
        "traceback": str(message.get("extraInfo", {}).get("py_callstack", "")),
    }


def summarize(result: RunResult, agent: LocalElasticAgent) -> dict[str, Any]:
    group = agent.get_worker_group()
    return {
        "state": result.state.name,
        "failed": result.is_failed(),
        "return_values": {str(rank): describe(v) for rank, v in result.return_values.items()},
        "failures": {
            str(rank): {
                "local_rank": failure.local_rank,
                "exitcode": failure.exitcode,
                **_failure_text(failure.message),
            }
            for rank, failure in result.failures.items()
        },
        "remaining_restarts": agent._remaining_restarts,
        "group_rank": group.group_rank,
        "group_world_size": group.group_world_size,
    }


def main(config: dict[str, Any]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    handler = get_rendezvous_handler(
        RendezvousParameters(
            backend=config["backend"],
            endpoint=config["endpoint"],
            run_id=config["run_id"],
            min_nodes=config["min_nodes"],
            max_nodes=config["max_nodes"],
            is_host=config["is_host"],
            **config["rdzv_conf"],
        )
    )
    spec = WorkerSpec(
        role=config["role"],
        local_world_size=config["local_world_size"],
        entrypoint=getattr(workers, config["entrypoint"]),
        args=tuple(config["args"]),
        rdzv_handler=handler,
        max_restarts=config["max_restarts"],
        monitor_interval=config["monitor_interval"],
    )
    agent = LocalElasticAgent(
        spec,
        logs_specs=DefaultLogsSpecs(log_dir=config["log_dir"]),
        start_method="spawn",
        exit_barrier_timeout=config["exit_barrier_timeout"],
    )
    try:
        outcome = summarize(agent.run(), agent)
    except Exception as error:
        traceback.print_exc()
        outcome = {
            "state": "RAISED",
            "error": type(error).__name__,
            "error_bases": [kind.__name__ for kind in type(error).__mro__],
            "message": str(error),
        }
    finally:
        # As torch's own agent test does after run(); torchrun's launcher does the same.
        handler.shutdown()
    path = Path(config["result"])
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as out:
        json.dump({**outcome, "pid": os.getpid()}, out)
    os.replace(out.name, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
