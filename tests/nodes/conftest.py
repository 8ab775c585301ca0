"""Fixtures of the real-node tier: two real nodes (kubelet, containerd, runc, a CNI bridge)
joined to the session's control plane, the images they run, and the chart installed with
the operator image built here, its operator running in real pods.

The nodes run IPv4 pods, or, for a module that sets ``IPV6 = True``, dual-stack pods whose
first address is IPv6; switching restarts the nodes and reinstalls the chart, so the IPv6
modules run after every IPv4 one (:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from tests.controllers import fixtures as fixtures_of_controllers
from tests.controllers.fixtures import (  # noqa: F401
    jobset,
    kueue,
    lws,
    running_controllers,
    trainer,
)

from devkit import chart
from devkit.cluster import images
from devkit.cluster.controlplane import ControlPlane, dig
from devkit.cluster.nodes import RealNodes
from devkit.nodepool import NodePool, build_node_images
from devkit.training import RunJob, TrainingJob, create_job, job_manifest

_images_key = pytest.StashKey[dict[str, images.ImageArchive]]()
HERE = Path(__file__).resolve().parent


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the nodes' binaries and images before any test runs, outside the tests'
    timeouts (cold: a few minutes), if a collected test needs real nodes."""
    if session.config.option.collectonly:
        return
    if any("node_images" in getattr(item, "fixturenames", ()) for item in session.items):
        session.config.stash[_images_key] = build_node_images()
    fixtures_of_controllers.build_if_needed(session)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This tier's IPv6 modules after its IPv4 ones, in the places this tier's tests hold
    in the session: the nodes switch families once, not at each IPv6 module."""
    places = [i for i, item in enumerate(items) if HERE in item.path.parents]
    tier = sorted((items[i] for i in places), key=_ipv6)
    for place, item in zip(places, tier, strict=True):
        items[place] = item


def _ipv6(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return bool(getattr(module, "IPV6", False))


@pytest.fixture(scope="session")
def node_images(pytestconfig: pytest.Config) -> dict[str, images.ImageArchive]:
    return pytestconfig.stash.get(_images_key, None) or build_node_images()


_pool_key = pytest.StashKey[NodePool]()


@pytest.fixture(scope="session")
def node_pool(
    pytestconfig: pytest.Config,
    control_plane: ControlPlane,
    cluster_helm: chart.Helm,
    admin_api: kubernetes.client.ApiClient,
    node_images: dict[str, images.ImageArchive],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NodePool]:
    """The real nodes and the chart on them, closed after this tier's last test
    (:func:`pytest_runtest_teardown`) and at the latest with the session."""
    pool = NodePool(
        control_plane, cluster_helm, admin_api, node_images, tmp_path_factory.mktemp("nodes")
    )
    pytestconfig.stash[_pool_key] = pool
    try:
        yield pool
    finally:
        pool.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """Once this tier's last test is torn down, stop the workload controllers (if a test
    started them), then the nodes, and uninstall the chart: its operator watches every
    namespace, and would seal the next tiers' rounds beside their
    own operator. (A "package" fixture would not do: for a directory without __init__.py
    pytest ends it with the session.)"""
    result = yield
    fixtures_of_controllers.stop_after_layer(item, nextitem, HERE)
    pool = item.config.stash.get(_pool_key, None)
    if pool is not None and (nextitem is None or HERE not in nextitem.path.parents):
        pool.close()
    return result


@pytest.fixture
def real_nodes(node_pool: NodePool, request: pytest.FixtureRequest) -> RealNodes:
    return node_pool.get(getattr(request.module, "IPV6", False))[0]


@pytest.fixture
def operator_release(node_pool: NodePool, real_nodes: RealNodes) -> chart.Release:
    return node_pool.get(real_nodes.ipv6)[1]


@pytest.fixture
def run_job(
    operator_release: chart.Release,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    node_images: dict[str, images.ImageArchive],
) -> Iterator[RunJob]:
    """``run_job(**job_manifest options) -> TrainingJob``; each Job is deleted afterwards
    with its pods (its pods' log tails are printed first, for a failing test)."""
    made: list[TrainingJob] = []

    def run(**options: Any) -> TrainingJob:
        name = options.pop("name", f"train-{uuid.uuid4().hex[:6]}")
        manifest = job_manifest(name, node_images["trainer"].reference, **options)
        job = create_job(admin_api, namespace, manifest)
        made.append(job)
        return job

    yield run
    for job in made:
        for pod in job.pods():
            print(f"--- {pod['metadata']['name']} on {dig(pod, 'spec', 'nodeName')}:")
            print("\n".join(job.logs(pod["metadata"]["name"]).splitlines()[-15:]))
        kubernetes.client.BatchV1Api(admin_api).delete_namespaced_job(
            job.name, namespace, propagation_policy="Foreground", grace_period_seconds=0
        )
