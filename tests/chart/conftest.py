"""Fixtures of the chart tests: helm, a release of the chart installed into the test
control plane, and namespaces whose pods hold the chart's worker role."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes.client
import pytest

from devkit import chart
from devkit.cluster.controlplane import ControlPlane


@pytest.fixture(scope="module")
def chart_release(
    control_plane: ControlPlane,
    cluster_helm: chart.Helm,
    admin_api: kubernetes.client.ApiClient,
) -> Iterator[chart.Release]:
    """The chart installed with its defaults but 2 replicas (two pods whose identities the
    tests' operator processes borrow); uninstalled after the module, leaving the session
    as the other fixtures expect it (CRD, worker and creator roles from manifests/)."""
    removed = chart.adopt_shared_roles(control_plane)
    chart.ensure_namespace(control_plane)
    cluster_helm.run(
        "install",
        chart.RELEASE,
        str(chart.CHART),
        "--namespace",
        chart.NAMESPACE,
        "--set",
        "replicas=2",
        "--wait",
        "--timeout",
        "120s",
    )
    control_plane.kubectl(
        "wait", "--for=condition=established", "-f", str(chart.CHART / "crds"), "--timeout=60s"
    )
    try:
        yield chart.Release(control_plane, admin_api)
    finally:
        chart.uninstall(cluster_helm, control_plane)
        if removed:
            chart.restore_shared_roles(control_plane)


@pytest.fixture
def workers_namespace(
    namespace: str, control_plane: ControlPlane, chart_release: chart.Release
) -> str:
    """A namespace whose `default` ServiceAccount is bound to the chart's worker role the
    way NOTES.txt says (instead of the role applied from manifests/ with kubectl)."""
    control_plane.kubectl(
        "-n",
        namespace,
        "create",
        "rolebinding",
        chart.WORKER_ROLE,
        f"--clusterrole={chart.WORKER_ROLE}",
        f"--serviceaccount={namespace}:default",
    )
    return namespace
