"""A pod killed under a workload controller, and the world it leaves behind."""

from __future__ import annotations

import time

from tests.controllers.kubelet import Kubelet
from tests.e2e.harness import LocalPod, World, describe, timing, wait_world

FORM_TIMEOUT = 180


def survive_a_pod_kill(kubelet: Kubelet, nodes: list[LocalPod], world: World, label: str) -> World:
    """Kill the container of one pod of ``world`` that is not its rank 0 (SIGKILL: the pod
    turns Failed, exit code 137); check that the survivors train on in a world of their
    own, then that the pod its Job makes anew joins them in a world as large as before;
    that world.

    The replacement's container is held back until the survivors' world trains (as if
    its image were still being pulled): without that, whether it joins before or after
    the survivors re-form depends on the load, and the survivors' world would not always
    exist to be checked."""
    victim = next(node for node in nodes if node.name != world.rank0_pod)
    survivors = [node for node in nodes if node is not victim]
    killed = time.time()
    with kubelet.holding():
        kubelet.kill(victim)
        alone = wait_world(
            survivors, len(survivors), after=killed, timeout=FORM_TIMEOUT, min_step=1
        )
    timing(
        f"{label}: pod killed -> first step of the survivors' world", alone.first_step_at - killed
    )
    back = kubelet.wait_running(len(nodes))
    replacements = [node for node in back if node.name not in {n.name for n in nodes}]
    assert len(replacements) == 1, f"one pod made anew: {replacements}"
    grown = wait_world(back, len(nodes), after=killed, timeout=FORM_TIMEOUT, min_step=1)
    timing(f"{label}: pod killed -> first step with its replacement", grown.first_step_at - killed)
    assert set(alone.group_ranks) == {node.name for node in survivors}
    assert set(grown.group_ranks) == {node.name for node in back}
    assert all(node.running() for node in survivors), describe(survivors)
    return grown
