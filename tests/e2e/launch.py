"""``torchrun`` with an exit barrier of the caller's choosing.

torch's elastic agent takes ``exit_barrier_timeout`` (how long an agent whose workers
finished waits for the others before it leaves; 300 s), but neither torchrun nor its
``LaunchConfig`` passes one: only ``LocalElasticAgent(exit_barrier_timeout=...)`` does.
This runs exactly what ``python -m torch.distributed.run`` runs (its argument parser and
``run``), with the agent that ``launch_agent`` builds given that timeout:

    python -m tests.e2e.launch --exit-barrier-timeout=1 <torchrun arguments>
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed.launcher.api as launcher
from torch.distributed.run import get_args_parser, run

PREFIX = "--exit-barrier-timeout="


def main(argv: list[str]) -> None:
    timeouts = [float(arg[len(PREFIX) :]) for arg in argv if arg.startswith(PREFIX)]
    if timeouts:
        base = launcher.LocalElasticAgent
        timeout = timeouts[-1]

        class Agent(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, exit_barrier_timeout=timeout, **kwargs)

        launcher.LocalElasticAgent = Agent  # what launch_agent builds its agent from
    run(get_args_parser().parse_args([arg for arg in argv if not arg.startswith(PREFIX)]))


if __name__ == "__main__":
    main(sys.argv[1:])
