"""LeaderWorkerSet with the real LWS controller and operator: one group of 3 pods running
``torchrun --rdzv-backend=kubernetes --rdzv-endpoint=train --nnodes=2:3 train.py``, nothing
else changed, played by the stand-in kubelet. The first pod makes the Rendezvous (the
creator role), and the operator gives it the LeaderWorkerSet as its owner: a worker pod's
controller is the group's worker StatefulSet, owned by the group's leader pod, owned by
the leaders' StatefulSet, owned by the LeaderWorkerSet (operator/.../workloads.py).

Aspects:
- the leader and its workers train in one world, each admitted through that chain;
- a worker whose container is killed makes the controller recreate the whole group
  (``RecreateGroupOnPodRestart``): every pod of it is made anew, under the same names,
  and the new pods form the next world of the same Rendezvous, still the
  LeaderWorkerSet's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kubernetes.client
import pytest
from tests.controllers import controllers, leaderworkersets
from tests.controllers.kubelet import Kubelet
from tests.controllers.leaderworkersets import GROUP, NAME, PODS, VERSION
from tests.e2e.harness import timing, wait_world
from tests.support.fixtures import Rendezvous

from devkit.cluster.controlplane import read_object
from devkit.waiting import wait_for

pytestmark = pytest.mark.usefixtures("operator_process", "creator_role")

FORM_TIMEOUT = 180


def leader_worker_set(size: int) -> dict[str, Any]:
    """One group of ``size`` pods, played by the stand-in kubelet."""
    container = {
        "name": leaderworkersets.CONTAINER,
        "image": "example.invalid/trainer",
        "command": [*leaderworkersets.torchrun(size), "--steps", "100000"],
    }
    return leaderworkersets.manifest({"containers": [container]}, size=size)


class LeaderWorkerSets:
    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.core = kubernetes.client.CoreV1Api(api)
        self.apps = kubernetes.client.AppsV1Api(api)

    def create(self, body: dict[str, Any]) -> str:
        made = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "leaderworkersets", body
        )
        return str(made["metadata"]["uid"])

    def pods(self) -> dict[str, dict[str, Any]]:
        found = read_object(self.core.list_namespaced_pod, self.namespace, label_selector=PODS)
        return {pod["metadata"]["name"]: pod for pod in found["items"]}

    def controller_chain(self, pod: dict[str, Any]) -> list[str]:
        """``Kind/name`` of the pod's controller and of each controller above it, as the
        API server holds them."""
        readers = {
            "StatefulSet": lambda name: read_object(
                self.apps.read_namespaced_stateful_set, name, self.namespace
            ),
            "Pod": lambda name: read_object(self.core.read_namespaced_pod, name, self.namespace),
        }
        chain, body = [], pod
        while (owner := controller_of(body)) is not None:
            chain.append(f"{owner['kind']}/{owner['name']}")
            if owner["kind"] not in readers:
                break
            body = readers[owner["kind"]](owner["name"])
        return chain


def controller_of(body: dict[str, Any]) -> dict[str, Any] | None:
    owners = body["metadata"].get("ownerReferences") or []
    return next((owner for owner in owners if owner.get("controller")), None)


@pytest.fixture
def leader_worker_sets(
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    lws: controllers.Controller,
) -> LeaderWorkerSets:
    return LeaderWorkerSets(admin_api, namespace)


def test_a_leaderworkerset_group_trains_in_one_world_and_its_recreated_group_rejoins(
    leader_worker_sets: LeaderWorkerSets,
    kubelet: Kubelet,
    recorded: Callable[[str], Rendezvous],
) -> None:
    rendezvous = recorded(NAME)
    uid = leader_worker_sets.create(leader_worker_set(3))
    started = time.time()
    first = kubelet.wait_running(3)
    world = wait_world(first, 3, after=started, timeout=FORM_TIMEOUT, min_step=1)
    owner = controller_of(rendezvous.body())
    assert owner is not None and (owner["kind"], owner["uid"]) == ("LeaderWorkerSet", uid)
    pods = leader_worker_sets.pods()
    assert set(world.group_ranks) == set(pods) == {"train-0", "train-0-1", "train-0-2"}
    assert leader_worker_sets.controller_chain(pods["train-0-1"]) == [
        "StatefulSet/train-0",
        "Pod/train-0",
        "StatefulSet/train",
        "LeaderWorkerSet/train",
    ], "a worker is admitted three controllers up from its own"
    before = rendezvous.body()
    uids = {name: pod["metadata"]["uid"] for name, pod in pods.items()}

    # A worker's container is SIGKILLed: the controller makes the whole group anew.
    killed = time.time()
    kubelet.kill(next(node for node in first if node.name == "train-0-2"))
    wait_for(
        lambda: (
            (now := leader_worker_sets.pods()).keys() == uids.keys()
            and all(now[name]["metadata"]["uid"] != uids[name] for name in uids)
        ),
        120,
        "every pod of the group made anew",
        interval=0.5,
    )
    again = kubelet.wait_running(3)
    reformed = wait_world(again, 3, after=killed, timeout=FORM_TIMEOUT, min_step=1)
    timing(
        "LeaderWorkerSet: a worker killed -> first step of the recreated group's world",
        reformed.first_step_at - killed,
    )
    after = rendezvous.body()
    assert after["metadata"]["uid"] == before["metadata"]["uid"], "the same Rendezvous"
    assert after["status"]["round"] > before["status"]["round"]
    owner = controller_of(after)
    assert owner is not None and owner["uid"] == uid
