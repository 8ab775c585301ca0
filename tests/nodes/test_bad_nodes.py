"""Bad nodes kept out, on real nodes: a member whose container fails on node X has X
recorded in its Rendezvous' ``status.excludedNodes``, and the Job's replacement pod, given
a preferred node affinity away from X by the chart's webhook, lands on the other real node.

Aspects: the failure is real (the agent killed by PID, its container exits, the pod
fails); the node comes from the Pod object; the real scheduler places the replacement by
its affinity, and it runs, and trains, on the other node.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import kubernetes.client
import pytest

from devkit.cluster.controlplane import dig
from devkit.training import RunJob, TrainingJob, agent_pid
from devkit.waiting import wait_for

pytestmark = pytest.mark.timeout(600)


def kept_off(pod: dict[str, Any]) -> list[str]:
    terms = dig(
        pod,
        "spec",
        "affinity",
        "nodeAffinity",
        "preferredDuringSchedulingIgnoredDuringExecution",
        default=[],
    )
    return [
        value
        for term in terms
        for expression in term["preference"].get("matchExpressions") or []
        if expression["key"] == "kubernetes.io/hostname" and expression["operator"] == "NotIn"
        for value in expression["values"]
    ]


def test_a_failed_members_replacement_lands_on_another_node(
    run_job: RunJob, admin_api: kubernetes.client.ApiClient
) -> None:
    job: TrainingJob = run_job(parallelism=1, nodes="1:2", restart_policy="Never")
    before = job.wait_world(1, after=0)
    (victim,) = [p for p in job.running_pods() if p["metadata"]["name"] == before.pods[0]]
    bad_node = victim["spec"]["nodeName"]
    assert not kept_off(victim), "nothing is kept out before a failure"
    fault = time.time()
    os.kill(agent_pid(victim), signal.SIGKILL)  # the container exits, the pod fails
    after = job.wait_world(1, after=fault)
    (replacement,) = [p for p in job.running_pods() if p["metadata"]["name"] == after.pods[0]]
    assert replacement["metadata"]["name"] != victim["metadata"]["name"]
    assert kept_off(replacement) == [bad_node]
    assert replacement["spec"]["nodeName"] != bad_node
    recorded = wait_for(
        lambda: job.rendezvous_status().get("excludedNodes"),
        30,
        "the failed member's node recorded",
    )
    assert [(e["node"], e["reason"], e["pod"]) for e in recorded] == [
        (bad_node, "PodFailed", victim["metadata"]["name"])
    ]
