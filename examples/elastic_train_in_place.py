"""A tiny elastic training loop that keeps its workers through changes of the world.

The same toy job as examples/elastic_train.py, on the in-place path of
:mod:`k8s_rendezvous.in_place` (torch >= 2.14, gloo): when a node is lost or added, the
running workers re-form the process group around the new member set and go on from the
step they were at, instead of being restarted by torchrun from step 0.

    torchrun --nnodes=2:4 --nproc-per-node=2 --rdzv-backend=kubernetes \\
        --rdzv-endpoint=my-rendezvous --rdzv-conf in_place=1 \\
        examples/elastic_train_in_place.py --steps 200

The "model" is a vector every rank holds. Each step all-reduces a gradient of ones and
adds the mean, so after step ``s`` every element is ``s + 1`` on every rank, whatever the
world size: a rank whose state diverged would show it. After each change of the world,
rank 0 (a worker that was there before; a newcomer is never rank 0) sends the step and the
vector to everyone. After each step a worker appends one JSON line to the file named by
``TRAIN_PROGRESS_FILE`` (if set), as examples/elastic_train.py does, with its round and
the vector's sum, and when it last saw a collective fail and re-formed. Once the file
named by ``TRAIN_STOP_FILE`` (if set) exists, every rank stops after the same step, as
examples/elastic_train.py does.

Without ``in_place=1`` (or with torch's own backends) it still runs: torchrun restarts
the workers on a change, and they start over.
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

from k8s_rendezvous import in_place

IMPORTED = time.time()
"""When this worker had imported torch (wall clock), for the benchmark's timeline."""
SIZE = 4


def share_state(step: int, model: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Everyone takes rank 0's step and model: newcomers catch up, and a survivor that
    had completed the step the failure interrupted agrees with one that had not."""
    state = torch.cat([torch.tensor([float(step)]), model])
    dist.broadcast(state, src=0)
    return int(state[0].item()), state[1:].clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps to run")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="sleep per step")
    parser.add_argument(
        "--compute-seconds",
        type=float,
        default=0.0,
        help="work before each step's all-reduce, as a forward and backward pass (a sleep)",
    )
    args = parser.parse_args()

    started = time.time()
    world = in_place.init_process_group("gloo")
    initialized = time.time()
    progress_file = os.environ.get("TRAIN_PROGRESS_FILE")
    stop_file = os.environ.get("TRAIN_STOP_FILE")
    pod = os.environ.get("POD_NAME") or socket.gethostname()
    model = torch.zeros(SIZE)
    step = 0
    failed_at: float | None = None
    reformed_at: float | None = initialized
    while step < args.steps:
        try:
            if world.reformed():
                reformed_at = time.time()
                step, model = share_state(step, model)
            time.sleep(args.compute_seconds)
            # The last element carries each rank's vote to stop, so that all stop together.
            gradient = torch.ones(SIZE + 1)
            gradient[SIZE] += bool(stop_file and os.path.exists(stop_file))
            dist.all_reduce(gradient)
            model += gradient[:SIZE] / world.world_size
        except world.failures as error:
            failed_at = time.time()
            world.recover(error)
            continue
        line = {
            "pod": pod,
            "pid": os.getpid(),
            "started": started,
            "imported": IMPORTED,
            "initialized": initialized,
            "rank": world.rank,
            "world_size": world.world_size,
            "group_rank": world.group_rank,
            "master": world.master,
            "round": world.round,
            "step": step,
            "time": time.time(),
            "checksum": float(model.sum().item()),
            "failed_at": failed_at,
            "reformed_at": reformed_at,
        }
        if progress_file:
            with open(progress_file, "a") as progress:  # one short write: lines never mix
                progress.write(json.dumps(line) + "\n")
        step += 1
        if gradient[SIZE] > world.world_size:
            break
        time.sleep(args.step_seconds)
    rank, world_size = world.rank, world.world_size  # unknown once the group is destroyed
    dist.destroy_process_group()
    print(f"elastic_train_in_place: rank {rank} of {world_size} finished {step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
