"""Fixtures of the workload-controller layer: Kueue, JobSet and Kubeflow Trainer v2 running
as processes against the session's control plane (tests/controllers/fixtures.py), their
pods played by the stand-in kubelet; the controllers stop after this directory's last
test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes.client
import pytest
from tests.controllers import controllers
from tests.controllers import fixtures as fixtures_of_controllers
from tests.controllers.fixtures import (  # noqa: F401
    jobset,
    kueue,
    lws,
    running_controllers,
    trainer,
)
from tests.controllers.kubelet import Kubelet

from devkit import namespaces
from devkit.cluster.controlplane import ControlPlane

HERE = Path(__file__).resolve().parent


def pytest_collection_finish(session: pytest.Session) -> None:
    fixtures_of_controllers.build_if_needed(session)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    fixtures_of_controllers.stop_after_layer(item, nextitem, HERE)


@pytest.fixture
def namespace(make_namespace: Callable[..., str]) -> str:
    """The test's own namespace, one the controllers' webhooks see."""
    return make_namespace({controllers.CONTROLLERS_LABEL: "on"})


@pytest.fixture
def creator_role(admin_api: kubernetes.client.ApiClient, namespace: str) -> None:
    """The pods' ServiceAccount may make their Rendezvous: a workload the operator does
    not make one for (docs/workloads.md)."""
    namespaces.bind_creator_role(admin_api, namespace)


@pytest.fixture
def kubelet(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    tmp_path: Path,
) -> Iterator[Kubelet]:
    """Runs the test namespace's Running pods as local processes (stopped afterwards)."""
    stand_in = Kubelet(control_plane, admin_api, namespace, tmp_path).start()
    try:
        yield stand_in
    finally:
        stand_in.stop()
