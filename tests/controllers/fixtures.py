"""Kueue, JobSet, Kubeflow Trainer v2 and LeaderWorkerSet as fixtures, for every layer
that runs them against the session's control plane (tests/controllers with the stand-in
kubelet, tests/nodes on real nodes): each controller is started by the first test that
asks for it (``kueue``, ``jobset``, ``trainer``, ``lws``), and a layer's conftest stops
them all, their webhooks unregistered, after its last test (:func:`stop_after_layer`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.controllers import controllers

from devkit.cluster.controlplane import ControlPlane

CONTROLLER_FIXTURES = frozenset(controllers.ALL)
_built_key = pytest.StashKey[Path]()
_running_key = pytest.StashKey[controllers.Controllers]()


def build_if_needed(session: pytest.Session) -> None:
    """Build the controllers before any test runs (outside pytest-timeout's per-test
    budget: about 6 minutes cold), only if a collected test needs one."""
    if session.config.option.collectonly or _built_key in session.config.stash:
        return
    if any(CONTROLLER_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "building/locating Kueue, JobSet, Trainer, LeaderWorkerSet (build-controllers.sh)"
            )
        session.config.stash[_built_key] = controllers.build_controllers()


def stop_after_layer(item: pytest.Item, nextitem: pytest.Item | None, layer: Path) -> None:
    """After ``layer``'s last test, stop the controllers and unregister their webhooks,
    rather than at the session's end: the other layers share the control plane and should
    not pay for idle controllers watching every pod and Job. (A package-scoped fixture
    would do it, but the test directories are no Python packages.)"""
    if nextitem is None or layer not in nextitem.path.parents:
        running = item.config.stash.get(_running_key, None)
        if running is not None:
            running.stop()


@pytest.fixture(scope="session")
def running_controllers(
    pytestconfig: pytest.Config,
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[controllers.Controllers]:
    """The controllers started so far (none once a layer has stopped them: the next test
    that asks for one starts it anew)."""
    built = pytestconfig.stash.get(_built_key, None) or controllers.build_controllers()
    workdir = tmp_path_factory.mktemp("controllers")
    running = controllers.Controllers(
        control_plane, built, workdir, controllers.Certificates.make(workdir / "pki")
    )
    pytestconfig.stash[_running_key] = running
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def kueue(running_controllers: controllers.Controllers) -> controllers.Controller:
    return running_controllers.ensure("kueue")


@pytest.fixture
def jobset(running_controllers: controllers.Controllers) -> controllers.Controller:
    return running_controllers.ensure("jobset")


@pytest.fixture
def lws(running_controllers: controllers.Controllers) -> controllers.Controller:
    return running_controllers.ensure("lws")


@pytest.fixture
def trainer(
    jobset: controllers.Controller, running_controllers: controllers.Controllers
) -> controllers.Controller:
    """Trainer v2 runs its TrainJobs as JobSets: the JobSet controller runs too."""
    return running_controllers.ensure("trainer")
