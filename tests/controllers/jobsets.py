"""The JobSet of the tests: replicated Jobs of one pod each running torchrun with only the
backend changed, as docs/workloads.md shows it."""

from __future__ import annotations

from typing import Any

GROUP, VERSION = "jobset.x-k8s.io", "v1alpha2"
NAME = "train"
PODS = f"jobset.sigs.k8s.io/jobset-name={NAME}"
"""The label selector of every pod of the JobSet, whichever Job made it."""
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
CONTAINER = "trainer"
TORCHRUN = [
    "torchrun",
    "--rdzv-backend=kubernetes",
    f"--rdzv-endpoint={NAME}",
    "--nnodes=2:3",
    "--max-restarts=3",
    "train.py",
]


def manifest(
    pod_spec: dict[str, Any], *, replicas: int, fail_job_on_exit_code: int | None
) -> dict[str, Any]:
    """``replicas`` Jobs of one ``pod_spec`` pod each. With ``fail_job_on_exit_code``, a
    container exiting with it fails its Job at once (podFailurePolicy), and the JobSet then
    restarts once (failurePolicy)."""
    job: dict[str, Any] = {
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 2,
        "template": {"spec": pod_spec},
    }
    if fail_job_on_exit_code is not None:
        job["podFailurePolicy"] = {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": CONTAINER,
                        "operator": "In",
                        "values": [fail_job_on_exit_code],
                    },
                }
            ]
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": {"name": NAME},
        "spec": {
            "failurePolicy": {"maxRestarts": 1},
            "replicatedJobs": [
                {"name": "workers", "replicas": replicas, "template": {"spec": job}}
            ],
        },
    }
