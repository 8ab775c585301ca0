"""Warm worker starts (``--rdzv-conf warm_start=1``, ``-m k8s_rendezvous.warm``) in real
``torchrun`` jobs against the real control plane, as in test_torchrun.py.

Aspects: after a node is killed, every worker of the survivors' new world is a process
forked by its own node's zygote (which its torchrun started), the world re-forms and
trains, and every node exits 0 through its workers' stand-ins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.e2e.harness import LocalPod, LocalPods, describe, timing, wait_all_exit, wait_world
from tests.support.fixtures import Rendezvous

MakeRendezvous = Callable[..., Rendezvous]

FORM_TIMEOUT = 120
STEPS = ["--steps", "60"]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _command(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _zygote_of(node: LocalPod) -> int:
    """The zygote its torchrun started: the one child of the agent running it."""
    assert node.pid is not None
    children = Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()
    zygotes = [int(c) for c in children if "--zygote" in _command(int(c))]
    assert len(zygotes) == 1, [(c, _command(int(c))) for c in children]
    return zygotes[0]


def test_workers_restarted_after_a_node_is_killed_are_forked_from_their_nodes_zygote(
    pods: LocalPods, make_rendezvous: MakeRendezvous
) -> None:
    rdzv = make_rendezvous(2, 4, lastCallTimeoutSeconds=5)
    started = time.time()
    nodes = pods.start(
        rdzv.name,
        {"w1": "127.0.0.21", "w2": "127.0.0.22", "w3": "127.0.0.23"},
        script_args=STEPS,
        rdzv_conf="warm_start=1",
        warm=True,
    )
    before = wait_world(nodes, 6, after=started, timeout=FORM_TIMEOUT, min_step=1)
    victim = next(n for n in nodes if before.group_ranks[n.name] == 2)
    survivors = [n for n in nodes if n is not victim]

    killed = time.time()
    victim.kill()
    after = wait_world(survivors, 4, after=killed, timeout=FORM_TIMEOUT)
    timing("node killed -> first step in world 4, workers warm", after.first_step_at - killed)

    assert after.ranks == list(range(4))
    for node in survivors:
        zygote = _zygote_of(node)
        workers = {step.pid for step in after.steps if step.pod == node.name}
        assert len(workers) == 2, after.steps
        assert {_parent(pid) for pid in workers} == {zygote}, describe(survivors)
    pods.finish()
    codes = wait_all_exit(survivors, FORM_TIMEOUT)
    assert codes == {node.name: 0 for node in survivors}, describe(survivors)
