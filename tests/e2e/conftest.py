"""Fixtures of the e2e layer: torchrun as local "pods" beside kwok's."""

from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest
from tests.e2e.harness import LocalPods, describe

from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess


@pytest.fixture
def pods(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    operator_process: OperatorProcess,
    tmp_path: Path,
) -> Iterator[LocalPods]:
    """Local torchrun "pods" in the test's namespace, stopped by PID at teardown, with each
    one's log tail printed (pytest shows it when the test failed)."""
    group = LocalPods(control_plane, admin_api, workers_namespace, tmp_path / "pods")
    try:
        yield group
    finally:
        group.stop_all()
        print(f"--- nodes ---\n{describe(group.all, lines=12)}")
