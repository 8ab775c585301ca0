"""Fixtures of the security tests beside the shared ones: a second namespace, and an
operator watching both, so that a test shows what a pod of one can do to the other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes.client
import pytest

from devkit import namespaces
from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess


@pytest.fixture
def other_namespace(
    make_namespace: Callable[[], str], admin_api: kubernetes.client.ApiClient
) -> str:
    """A second namespace whose pods hold the worker role."""
    namespace = make_namespace()
    namespaces.bind_worker_role(admin_api, namespace)
    return namespace


@pytest.fixture
def operator_of_both(
    control_plane: ControlPlane, workers_namespace: str, other_namespace: str, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """``(*flags) -> OperatorProcess``: the operator of both namespaces with more flags,
    not started (the test starts it when it needs); stopped afterwards."""
    made: list[OperatorProcess] = []

    def make(*flags: str) -> OperatorProcess:
        made.append(
            OperatorProcess(
                control_plane.kubeconfig,
                tmp_path / f"operator-{len(made)}.log",
                namespaces=(workers_namespace, other_namespace),
                extra_args=flags,
            )
        )
        return made[-1]

    yield make
    for process in made:
        process.stop()
        print(f"--- operator log (tail) ---\n{process.log_tail()}")
