"""Fixtures of the workload-controller layer: Kueue, JobSet and Kubeflow Trainer v2 running
as processes against the session's control plane (tests/controllers/controllers.py), each
started by the first test that needs it (``kueue``, ``jobset``, ``trainer``) and stopped,
its webhooks unregistered, after the last test of this directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import kubernetes.client
import pytest
from tests.controllers import controllers
from tests.controllers.kubelet import Kubelet
from tests.support import fixtures
from tests.support.fixtures import (  # noqa: F401  (fixtures)
    operator_process,
    recorded,
    rendezvous_crd,
    workers_namespace,
)

from devkit.cluster.controlplane import ControlPlane

CONTROLLER_FIXTURES = frozenset(controllers.ALL)
HERE = Path(__file__).resolve().parent
_built_key = pytest.StashKey[Path]()
_running_key = pytest.StashKey[controllers.Controllers]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the controllers before any test runs (outside pytest-timeout's per-test
    budget: about 6 minutes cold), only if a collected test needs one."""
    if session.config.option.collectonly:
        return
    if any(CONTROLLER_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("building/locating Kueue, JobSet, Trainer (build-controllers.sh)")
        session.config.stash[_built_key] = controllers.build_controllers()


@pytest.fixture(scope="session")
def running_controllers(
    pytestconfig: pytest.Config,
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[controllers.Controllers]:
    """The controllers started so far (stopped after this directory's last test)."""
    built = pytestconfig.stash.get(_built_key, None) or controllers.build_controllers()
    workdir = tmp_path_factory.mktemp("controllers")
    running = controllers.Controllers(
        control_plane, built, workdir, controllers.Certificates.make(workdir / "pki")
    )
    pytestconfig.stash[_running_key] = running
    try:
        yield running
    finally:
        _stop(running)


def _stop(running: controllers.Controllers) -> None:
    for controller in running.running.values():
        print(f"--- {controller.name} log (tail) ---\n{controller.log_tail()}")
    running.stop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After this directory's last test, stop the controllers and unregister their
    webhooks, rather than at the session's end: the other layers share the control plane
    and should not pay for three idle controllers watching every pod and Job. (A
    package-scoped fixture would do it, but this directory is no Python package.)"""
    if nextitem is None or HERE not in nextitem.path.parents:
        running = item.config.stash.get(_running_key, None)
        if running is not None:
            _stop(running)


@pytest.fixture
def kueue(running_controllers: controllers.Controllers) -> controllers.Controller:
    return running_controllers.ensure("kueue")


@pytest.fixture
def jobset(running_controllers: controllers.Controllers) -> controllers.Controller:
    return running_controllers.ensure("jobset")


@pytest.fixture
def trainer(
    jobset: controllers.Controller, running_controllers: controllers.Controllers
) -> controllers.Controller:
    """Trainer v2 runs its TrainJobs as JobSets: the JobSet controller runs too."""
    return running_controllers.ensure("trainer")


@pytest.fixture
def namespace(make_namespace: Callable[..., str]) -> str:
    """The test's own namespace, one the controllers' webhooks see."""
    return make_namespace({controllers.CONTROLLERS_LABEL: "on"})


@pytest.fixture
def creator_role(control_plane: ControlPlane, namespace: str) -> None:
    """The pods' ServiceAccount may make their Rendezvous: a workload the operator does
    not make one for (docs/workloads.md)."""
    fixtures.bind_creator_role(control_plane, namespace)


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
