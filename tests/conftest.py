"""Fixtures for tests that need the real control plane (see devkit/cluster/controlplane.py).

K8S_RDZV_KUBECONFIG_DIR=<dir of `python -m devkit.cluster up`> reuses a running cluster.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException

from devkit import namespaces
from devkit.cluster.controlplane import ControlPlane, build_binaries, to_model

ATTACH_ENV = "K8S_RDZV_KUBECONFIG_DIR"

pytest_plugins = ("tests.support.fixtures", "tests.support.timing")
"""The rendezvous fixtures (operator, namespace, Rendezvous, nodes) for every test folder,
a folder's conftest adding its own or overriding one; and where the run's time went."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before any test runs (outside pytest-timeout's per-test budget:
    a cold build takes tens of minutes), but only if a collected test needs a cluster."""
    if os.environ.get(ATTACH_ENV) or session.config.option.collectonly:
        return
    if any("control_plane" in getattr(item, "fixturenames", ()) for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "building/locating control-plane binaries (devkit/cluster/build.sh)"
            )
        session.config.stash[_binaries_key] = build_binaries()


_binaries_key = pytest.StashKey[Path]()
_session_key = pytest.StashKey[pytest.Session]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[_session_key] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without finalizing the interpreter once pytest has reported.

    Tests run nodes' ``next_rendezvous()`` in daemon threads, and one may still be inside
    torch's C++ (a TCPStore connect to a rank 0 a test killed, bounded by its timeout)
    when the last test ends. A daemon thread that takes the GIL back during finalization is
    ended with pthread_exit, whose unwinding through torch's frames aborts the process:
    SIGABRT, exit 134, after every test passed (seen once in a CI run). Every process the
    tests start is stopped by its fixture before this point, so nothing is skipped."""
    session = config.stash.get(_session_key, None)
    if session is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


@pytest.fixture(scope="session", autouse=True)
def torch_caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """torch's processes (agents, workers) make their inductor cache in /tmp, where it
    would outlive the session: it goes under the session's own directory instead."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
        yield


@pytest.fixture(scope="session")
def control_plane(pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    attach_dir = os.environ.get(ATTACH_ENV)
    if attach_dir:
        yield ControlPlane.attach(Path(attach_dir))
        return
    binaries = pytestconfig.stash.get(_binaries_key, None) or build_binaries()
    plane = ControlPlane(binaries)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def admin_api(control_plane: ControlPlane) -> Iterator[kubernetes.client.ApiClient]:
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def make_namespace(admin_api: kubernetes.client.ApiClient) -> Iterator[Callable[..., str]]:
    """Fresh namespaces (with more ``labels`` if given) whose `default` ServiceAccount
    exists; deleted afterwards."""
    core = kubernetes.client.CoreV1Api(admin_api)
    made: list[str] = []

    def make(labels: Mapping[str, str] | None = None) -> str:
        name = f"t-{uuid.uuid4().hex[:10]}"
        made.append(name)
        return namespaces.create(
            admin_api, name, {"k8s-rendezvous.dev/test": "1", **(labels or {})}
        )

    yield make
    for name in made:
        try:
            core.delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def namespace(make_namespace: Callable[[], str]) -> str:
    """The test's own fresh namespace."""
    return make_namespace()


@pytest.fixture
def service_account_client(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, namespace: str
) -> Iterator[Callable[..., kubernetes.client.ApiClient]]:
    """Factory ``(name, namespace=None) -> ApiClient`` authenticated with a real token of
    that ServiceAccount (created if missing; namespace defaults to the test's)."""
    core = kubernetes.client.CoreV1Api(admin_api)
    clients: list[kubernetes.client.ApiClient] = []

    def make(name: str, namespace_: str | None = None) -> kubernetes.client.ApiClient:
        ns = namespace_ or namespace
        try:
            core.create_namespaced_service_account(
                ns, to_model(kubernetes.client.V1ServiceAccount, {"metadata": {"name": name}})
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
        client = control_plane.client_for_token(control_plane.token_for(ns, name))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()  # type: ignore[no-untyped-call]


@pytest.fixture
def pod_environment(control_plane: ControlPlane, tmp_path: Path) -> Callable[..., dict[str, str]]:
    """Factory ``(pod, pod_ip, service_account=None) -> env`` giving what a container of
    ``pod`` (a V1Pod or a dict) would see: in-cluster files with a pod-bound token in a
    temp dir, plus the environment pointing at them. The ServiceAccount defaults to the
    pod's own (``default`` if unset); a token can only be bound to a pod running as it."""

    def make(pod: Any, pod_ip: str, service_account: str | None = None) -> dict[str, str]:
        if isinstance(pod, dict):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            name, ns, uid = meta["name"], meta["namespace"], meta["uid"]
            pod_sa = spec.get("serviceAccountName")
        else:
            name, ns, uid = pod.metadata.name, pod.metadata.namespace, pod.metadata.uid
            pod_sa = pod.spec.service_account_name if pod.spec else None
        return control_plane.pod_environment(
            namespace=ns,
            pod_name=name,
            pod_uid=uid,
            pod_ip=pod_ip,
            directory=tmp_path / f"serviceaccount-{name}",
            service_account=service_account or pod_sa or "default",
        )

    return make
