"""A node in its own OS process, so a test can freeze it (SIGSTOP), thaw it (SIGCONT) or
kill it like a real agent.

The child (``python -m tests.support.node_process --endpoint NAME --nnodes MIN:MAX``)
builds our handler exactly as torchrun does (``from_parameters``, the pod's environment:
an in-cluster token bound to its pod, ``POD_NAME``, ``POD_NAMESPACE``, ``POD_IP``) and
speaks the kit's JSON-line protocol (:mod:`devkit.child`). Its operations:

* ``next``: ``next_rendezvous()``; ``{"round", "rank", "world_size", "master"}``, or the
  protocol's failure answer naming the exception type in ``error``;
* ``waiting``: ``{"waiting": num_nodes_waiting()}``;
* ``exit``: ``shutdown()``, ``{"left": <its result>}``, and the process ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devkit import child


def _child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.node_process")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--nnodes", required=True, help="MIN:MAX")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--read-timeout", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    # Imported here: the test's side must not pay for torch.
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from k8s_rendezvous.handler import KubernetesRendezvousHandler

    low, high = (int(n) for n in args.nnodes.split(":"))
    handler = KubernetesRendezvousHandler.from_parameters(
        RendezvousParameters(
            backend="kubernetes",
            endpoint=args.endpoint,
            run_id=args.run_id or args.endpoint.rpartition("/")[2],
            min_nodes=low,
            max_nodes=high,
            local_addr=os.environ.get("POD_IP"),
            read_timeout=args.read_timeout,
        )
    )

    def next_round() -> dict[str, Any]:
        info = handler.next_rendezvous()
        joined = handler.joined
        store = info.bootstrap_store_info
        assert store is not None
        return {
            "round": joined.round if joined else None,
            "rank": info.rank,
            "world_size": info.world_size,
            "master": [store.master_addr, store.master_port],
        }

    child.serve(
        {
            "next": next_round,
            "waiting": lambda: {"waiting": handler.num_nodes_waiting()},
            "exit": lambda: {"left": handler.shutdown()},
        }
    )


class NodeProcess(child.ChildProcess):
    """One node process (see :class:`devkit.child.ChildProcess`).

    Args:
        env: The pod's environment (``pod_environment`` fixture).
        endpoint: ``NAME`` or ``NAMESPACE/NAME`` of the Rendezvous.
        nnodes: ``MIN:MAX`` as given to torchrun.
        log_path: Where the child's log (stderr) goes.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        endpoint: str,
        nnodes: str,
        log_path: Path,
        read_timeout: int = 20,
    ) -> None:
        super().__init__(
            "tests.support.node_process",
            [f"--endpoint={endpoint}", f"--nnodes={nnodes}", f"--read-timeout={read_timeout}"],
            log_path=log_path,
            env=env,
            unset=["KUBECONFIG"],  # the in-cluster token, nothing else
            name=f"node process of {endpoint}",
        )


if __name__ == "__main__":
    _child(sys.argv[1:])
