"""A hostile pod on a real node, with the token its kubelet mounted (bound to the pod and
its node), against the chart's RBAC and admission policies: it keeps its own Lease and
nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest

from devkit.paths import REPO
from devkit.training import RunJob, TrainingJob
from devkit.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


def test_a_pods_mounted_token_writes_its_own_lease_and_nothing_else(run_job: RunJob) -> None:
    script = REPO / "tests" / "nodes" / "hostile_pod.py"
    job: TrainingJob = run_job(
        parallelism=1,
        nodes="1",
        command=[str(REPO / ".venv" / "bin" / "python"), str(script), "victim-0"],
    )

    def attempts() -> dict[str, dict[str, Any]] | None:
        pods = job.running_pods()
        if not pods:
            return None
        lines = [
            json.loads(line)
            for line in job.logs(pods[0]["metadata"]["name"]).splitlines()
            if line.startswith('{"attempt"')
        ]
        if not lines or lines[-1]["attempt"] != "done":
            return None
        return {line["attempt"]: line for line in lines[:-1]}

    found = wait_for(attempts, 120, "the hostile pod's attempts", interval=0.5)
    assert found["own-lease"]["status"] == 200, found
    assert found["victim-lease"]["status"] == 403, found
    assert (
        "may write only the rendezvous Lease named after itself" in found["victim-lease"]["message"]
    )
    assert found["other-controller-lock"]["status"] == 403, found
    assert (
        "writes Leases through the k8s-rendezvous worker role"
        in found["other-controller-lock"]["message"]
    )
    assert found["rendezvous-status"]["status"] == 403, found
    assert 'cannot patch resource "rendezvous/status"' in found["rendezvous-status"]["message"]
