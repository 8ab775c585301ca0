"""A tiny elastic training job for ``torchrun --rdzv-backend=kubernetes``.

Every worker joins the gloo process group torchrun describes in its environment, checks
that an all-reduce of ones adds up to WORLD_SIZE, then runs ``--steps`` steps (an
all-reduce and a short sleep each). After each step it appends one JSON line to the file
named by ``TRAIN_PROGRESS_FILE`` (if set) saying who it is, which world it is in and when
it had imported torch and joined the process group, so that tests, the demo and the
benchmark's recovery timeline can follow the job without guessing. Once the file named by
``TRAIN_STOP_FILE`` (if set) exists, every rank stops after the same step and the job
ends as if its steps were done: whoever drives the job ends it when it has seen what it
waited for. When the world changes, torchrun restarts the workers and they start over:
this script keeps no checkpoint.

    torchrun --nnodes=2:4 --nproc-per-node=2 --rdzv-backend=kubernetes \\
        --rdzv-endpoint=my-rendezvous examples/elastic_train.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

IMPORTED = time.time()
"""When this worker had imported torch (wall clock): the benchmark's recovery section
times a restarted worker's interpreter start and ``import torch`` with it."""


def check_all_reduce(world_size: int, stop: bool = False) -> bool:
    """All-reduce ones, checking that they add up to ``world_size``; whether any rank asked
    to ``stop`` (its vote rides in the same collective, so every rank gets the same
    answer in the same step)."""
    ones = torch.ones(5)
    ones[4] += stop
    dist.all_reduce(ones)
    if not torch.equal(ones[:4], torch.full((4,), float(world_size))):
        raise RuntimeError(f"all-reduce of ones gave {ones.tolist()}, expected {world_size}")
    return bool(ones[4] > world_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="sleep per step")
    parser.add_argument("--fail", action="store_true", help="exit 1 at once (a broken node)")
    parser.add_argument(
        "--final-seconds",
        type=float,
        default=0.0,
        help="extra work of the rank-0 node's workers after the last step (a final "
        "evaluation or checkpoint), while the other nodes are done",
    )
    args = parser.parse_args()
    if args.fail:
        print("elastic_train: failing on purpose (--fail)", file=sys.stderr)
        return 1

    started = time.time()
    dist.init_process_group("gloo")  # MASTER_ADDR, RANK, WORLD_SIZE... come from torchrun
    world_size = int(os.environ["WORLD_SIZE"])
    check_all_reduce(world_size)
    initialized = time.time()
    progress_file = os.environ.get("TRAIN_PROGRESS_FILE")
    stop_file = os.environ.get("TRAIN_STOP_FILE")
    who = {
        "pod": os.environ.get("POD_NAME") or socket.gethostname(),
        "pid": os.getpid(),
        "started": started,
        "imported": IMPORTED,
        "initialized": initialized,
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    }
    for step in range(args.steps):
        stopping = check_all_reduce(world_size, bool(stop_file and os.path.exists(stop_file)))
        line = json.dumps({**who, "step": step, "time": time.time()})
        if progress_file:
            with open(progress_file, "a") as progress:  # one short write: lines never mix
                progress.write(line + "\n")
        if stopping:
            break
        time.sleep(args.step_seconds)
    dist.destroy_process_group()
    if who["group_rank"] == 0 and args.final_seconds > 0:
        time.sleep(args.final_seconds)
    print(f"elastic_train: rank {who['rank']} of {world_size} finished {step + 1} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
