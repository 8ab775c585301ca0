"""The workers' entrypoints: functions torch's ``LocalElasticAgent`` spawns (``spawn``
start method, so each must be importable by name). They read only what the agent gives a
worker (its environment); anything a test asserts on is returned, so it comes back in
the agent's ``RunResult``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

AGENT_ENV = (
    "RANK",
    "LOCAL_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)
"""What torch's agent promises every worker (torch's own agent test checks these)."""

SAD_MESSAGE = "sad on purpose"


def _rank() -> int:
    return int(os.environ["RANK"])


def _first_attempt() -> bool:
    return os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"


def happy() -> None:
    return None


def compute() -> torch.Tensor:
    return torch.rand(100, 100)


def sad() -> None:
    raise RuntimeError(SAD_MESSAGE)


def bipolar() -> None:
    if _rank() % 2:
        raise RuntimeError(f"{SAD_MESSAGE}: odd rank {_rank()}")


def killed_once() -> torch.Tensor:
    """Rank 1 dies by SIGKILL on the first attempt (no error file, no exception)."""
    if _rank() == 1 and _first_attempt():
        os.kill(os.getpid(), signal.SIGKILL)
    return compute()


def environment() -> dict[str, str]:
    """The agent's variables; a missing one fails the worker (KeyError)."""
    return {name: os.environ[name] for name in AGENT_ENV}


def dist_sum(wait: float = 0) -> dict[str, int]:
    """all_reduce of the ranks over gloo: the world's sum, as the workers computed it."""
    dist.init_process_group(backend="gloo")
    try:
        total = torch.tensor(_rank())
        time.sleep(wait)  # simulated work between joining the group and the collective
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return {"sum": int(total.item()), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


def fails_once_then_sums(failing_rank: int, wait: float) -> dict[str, int]:
    """``failing_rank`` raises on the first attempt, before the others' collective can
    complete: they are stuck in it until their agent restarts them."""
    if _rank() == failing_rank and _first_attempt():
        raise RuntimeError(f"{SAD_MESSAGE}: rank {failing_rank} fails once")
    return dist_sum(wait)


def train_until_shrunk(marks: str, full_world: int, steps: int) -> dict[str, int]:
    """In a world of ``full_world`` ranks or more, all_reduce forever (only a lost peer
    ends it, with an error); in a smaller world, ``steps`` all_reduces and return. Each
    worker first leaves a mark (``<world>-<rank>-<restart>``) so the test knows the world
    is training before it kills a node."""
    dist.init_process_group(backend="gloo")
    world = dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    (Path(marks) / f"{world}-{_rank()}-{restart}").touch()
    done = _train(world, None if world >= full_world else steps)
    return {"world_size": world, "steps": done}


def train_until_replaced(marks: str, steps: int) -> dict[str, int]:
    """A world started before the file ``replaced`` exists all_reduces forever (only a
    lost peer ends it, with an error); one started after it, ``steps`` all_reduces and
    return. Each worker first leaves a mark (``<world>-<rank>-<pid>``) so the test knows
    which world trains."""
    replaced = (Path(marks) / "replaced").exists()
    dist.init_process_group(backend="gloo")
    world = dist.get_world_size()
    (Path(marks) / f"{world}-{_rank()}-{os.getpid()}").touch()
    done = _train(world, steps if replaced else None)
    return {"world_size": world, "steps": done, "pid": os.getpid()}


def _train(world: int, steps: int | None) -> int:
    """All-reduce ones ``steps`` times (forever if ``None``: only a lost peer ends it, with
    an error), checking each sum; then leave the group. Returns the steps done."""
    done = 0
    while steps is None or done < steps:
        total = torch.tensor(1)
        dist.all_reduce(total)
        if int(total.item()) != world:
            raise RuntimeError(f"all_reduce of ones gave {total.item()} in a world of {world}")
        done += 1
        time.sleep(0.2)  # simulated work per step
    dist.destroy_process_group()
    return done


def sleep_then_rank(seconds: float) -> int:
    time.sleep(seconds)  # simulated work
    return _rank()


def rank0_works_longer(seconds: float) -> dict[str, int]:
    """The node of group rank 0 works ``seconds`` longer than the others (torch's workers
    drift: e.g. rank 0's final evaluation)."""
    if os.environ["GROUP_RANK"] == "0":
        time.sleep(seconds)  # simulated work
    return {"rank": _rank(), "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}


def role_info() -> dict[str, int | str]:
    return {
        "rank": _rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "role": os.environ["ROLE_NAME"],
        "role_rank": int(os.environ["ROLE_RANK"]),
        "role_world_size": int(os.environ["ROLE_WORLD_SIZE"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
