"""The soak's quick variant, run by the default ``pytest``: a few minutes of random
worker failures, leaves and re-joins, pod deletions, scale-ups and -downs and operator
SIGKILLs against the real control plane, with the invariants checked throughout.

The full run (at least 1000 rounds) is a command, documented in tests/soak/README.md;
its result is committed under tests/soak/results/.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes.client
import pytest
from tests.cluster.controlplane import ControlPlane
from tests.soak.soak import Config, Soak, log_to
from tests.support.operator import OperatorProcess


@pytest.mark.timeout(600)
def test_a_short_soak_of_random_faults_breaks_no_invariant(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    operator_process: OperatorProcess,
    tmp_path: Path,
) -> None:
    log_to(tmp_path / "soak.log")
    print(f"soak log: {tmp_path / 'soak.log'}")
    config = Config(rounds=60, seconds=180, seed=7)
    result = Soak(
        control_plane, admin_api, workers_namespace, operator_process, config, progress=print
    ).run()
    print(result.summary())
    assert result.violations == []
    assert result.stalls == [], "after every settled fault the world became whole again"
    assert result.rounds > 0 and result.joins_returned > 0
    assert result.actions, "faults were injected"
