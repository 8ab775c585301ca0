"""The LeaderWorkerSet of the tests: one group whose pods run torchrun with only the
backend changed, as docs/workloads.md shows it."""

from __future__ import annotations

from typing import Any

GROUP, VERSION = "leaderworkerset.x-k8s.io", "v1"
NAME = "train"
PODS = f"leaderworkerset.sigs.k8s.io/name={NAME}"
"""The label selector of every pod of the LeaderWorkerSet, leader and workers."""
CONTAINER = "trainer"


def torchrun(size: int) -> list[str]:
    """The group's command: every pod of a group of ``size`` joins one world."""
    return [
        "torchrun",
        "--rdzv-backend=kubernetes",
        f"--rdzv-endpoint={NAME}",
        f"--nnodes=2:{size}",
        "--max-restarts=3",
        "train.py",
    ]


def manifest(pod_spec: dict[str, Any], *, size: int) -> dict[str, Any]:
    """One group of ``size`` pods of ``pod_spec`` (the leader uses the workers' template);
    a pod whose container restarts makes the controller recreate the whole group."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": NAME},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"spec": pod_spec},
            },
        },
    }
