"""What the kit installs and creates: the CRDs and roles, the test workload's bare pods
and the Rendezvous that select them (an admin's hand-made Rendezvous, not an annotated
Job's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devkit import paths
from devkit.cluster.controlplane import ControlPlane
from k8s_rendezvous.wire import objects

WORKLOAD_LABELS = {"k8s-rendezvous.dev/test-workload": "trainer"}
"""On the kit's bare pods; the Rendezvous it makes select them (spec.podSelector), as an
admin's hand-made Rendezvous must."""
WORKLOAD_SELECTOR = {"matchLabels": WORKLOAD_LABELS}


def install(control_plane: ControlPlane, *extra: Path) -> None:
    """Apply the CRDs (and wait until they are established) and the roles of manifests/,
    then the ``extra`` manifests (e.g. :data:`devkit.paths.POLICY`)."""
    crd = str(paths.CRD)
    control_plane.kubectl("apply", "--server-side", "-f", crd)
    control_plane.kubectl("wait", "--for=condition=established", "-f", crd, "--timeout=60s")
    for manifest in (paths.RBAC, *extra):
        control_plane.kubectl("apply", "--server-side", "-f", str(manifest))


def rendezvous(
    namespace: str, name: str, min_nodes: int, max_nodes: int, **spec: Any
) -> dict[str, Any]:
    """A Rendezvous selecting :data:`WORKLOAD_LABELS`' pods, its run id its name."""
    return {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "minNodes": min_nodes,
            "maxNodes": max_nodes,
            "runId": name,
            "podSelector": WORKLOAD_SELECTOR,
            **spec,
        },
    }


def bare_pod(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod of one container that never restarts, with :data:`WORKLOAD_LABELS` unless
    ``labels`` are given; ``spec`` adds to its spec. On kwok nodes nothing runs it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": WORKLOAD_LABELS if labels is None else labels,
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{"name": "agent", "image": "example.invalid/trainer"}],
            "restartPolicy": "Never",
            **spec,
        },
    }
