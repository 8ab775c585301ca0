"""``torchrun`` with an exit barrier of the caller's choosing.

torch's launcher takes ``exit_barrier_timeout`` (how long an agent whose workers finished
waits for the others before it leaves; 300 s) in its ``LaunchConfig`` but torchrun has no
flag for it. This runs exactly what ``python -m torch.distributed.run`` runs (its own
argument parser, ``config_from_args`` and ``elastic_launch``) with that one field set:

    python -m tests.e2e.launch --exit-barrier-timeout=1 <torchrun arguments>
"""

from __future__ import annotations

import sys

from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser


def main(argv: list[str]) -> None:
    prefix = "--exit-barrier-timeout="
    timeouts = [arg for arg in argv if arg.startswith(prefix)]
    rest = [arg for arg in argv if not arg.startswith(prefix)]
    args = get_args_parser().parse_args(rest)
    config, command, command_args = config_from_args(args)
    if timeouts:
        config.exit_barrier_timeout = float(timeouts[-1][len(prefix) :])
    elastic_launch(config, command)(*command_args)


if __name__ == "__main__":
    main(sys.argv[1:])
