"""The soak's quick variant, run by the default ``pytest``: a minute or two of random
worker failures, leaves and re-joins, pod deletions, scale-ups and -downs and, in the
second case, operator SIGKILLs, against the real control plane, with the invariants
checked throughout.

The full run (at least 1000 rounds) is a command, documented in tests/soak/README.md;
its result is committed under tests/soak/results/.
"""

from __future__ import annotations

import logging
from pathlib import Path

import kubernetes.client
import pytest
from tests.soak.soak import Config, Result, Soak, log_to

from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess


def soak(
    config: Config,
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    operator: OperatorProcess,
    log: Path,
) -> Result:
    handler = log_to(log)
    print(f"soak log: {log}")
    try:
        result = Soak(control_plane, admin_api, namespace, operator, config, progress=print).run()
    finally:
        for name in ("soak", "k8s_rendezvous"):
            logging.getLogger(name).removeHandler(handler)
        handler.close()
    print(result.summary())
    return result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("operator_kills", [False, True], ids=["no-kills", "operator-kills"])
def test_a_short_soak_of_random_faults_breaks_no_invariant(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    operator_process: OperatorProcess,
    tmp_path: Path,
    operator_kills: bool,
) -> None:
    seed = 8 if operator_kills else 7
    config = Config(rounds=60, seconds=180, seed=seed, operator_kills=operator_kills)
    result = soak(
        config, control_plane, admin_api, workers_namespace, operator_process, tmp_path / "log"
    )
    assert result.violations == []
    assert result.stalls == [], "after every settled fault the world became whole again"
    assert result.rounds > 0 and result.joins_returned > 0
    assert result.actions, "faults were injected"
    if operator_kills:
        assert result.operator_restarts > 0
