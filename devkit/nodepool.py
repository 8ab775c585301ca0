"""The real nodes of a test session or a benchmark, with the chart installed on them."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes.client

from devkit import chart
from devkit.cluster import images
from devkit.cluster.controlplane import ControlPlane, dig, read_object
from devkit.cluster.nodes import (
    REAL_NODE_LABEL,
    REAL_NODE_TOLERATION,
    RealNodes,
    build_node_binaries,
)
from devkit.paths import REPO
from devkit.training import OPERATOR_POD_LABELS, operator_leader
from devkit.waiting import wait_for


def build_node_images() -> dict[str, images.ImageArchive]:
    """The pause (sandbox), trainer and operator images, built here (cached by content)."""
    cache = images.default_cache()
    return {
        "pause": images.pause_image(build_node_binaries() / "pause", cache),
        "trainer": images.trainer_image(cache),
        "operator": images.operator_image(REPO, cache),
    }


class NodePool:
    """The session's real nodes and the chart release on them, in one configuration at a
    time (IPv4 or IPv6 first)."""

    def __init__(
        self,
        control_plane: ControlPlane,
        cluster_helm: chart.Helm,
        api: kubernetes.client.ApiClient,
        node_images: dict[str, images.ImageArchive],
        directory: Path,
        restart_delay_cap: int | None = None,
    ) -> None:
        self.control_plane = control_plane
        self.restart_delay_cap = restart_delay_cap
        """The kubelets' cap on a crashing container's restart delay (RealNodes)."""
        self.helm = cluster_helm
        self.api = api
        self.images = node_images
        self.directory = directory
        self.nodes: RealNodes | None = None
        self.release: chart.Release | None = None
        self._removed_roles = False

    def get(self, ipv6: bool) -> tuple[RealNodes, chart.Release]:
        if self.nodes is None or self.nodes.ipv6 != ipv6 or self.release is None:
            self.close()
            self.nodes = RealNodes(
                self.control_plane,
                2,
                images=list(self.images.values()),
                ipv6=ipv6,
                restart_delay_cap=self.restart_delay_cap,
            )
            self.nodes.start()
            self.release = self._install()
        return self.nodes, self.release

    def _install(self) -> chart.Release:
        """`helm install` of the chart with the operator image built here: two replicas (a
        leader and a standby, one per node), metrics and the webhook served from the pod;
        returns once the leader serves the webhook. helm's --wait cannot tell: Helm 3's
        counts the Deployment's maxUnavailable (100%: done at once), and Helm 4's waits for
        every replica Ready, which a standby never is while the webhook is on."""
        repository, _, tag = self.images["operator"].reference.rpartition(":")
        values = {
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
            "replicas": 2,
            "tolerations": [REAL_NODE_TOLERATION],
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "k8s-rendezvous"}},
                }
            ],
        }
        values_file = self.directory / "values.json"
        values_file.write_text(json.dumps(values))
        self._removed_roles = chart.adopt_shared_roles(self.control_plane) or self._removed_roles
        chart.ensure_namespace(self.control_plane)
        self.helm.run(
            "install",
            chart.RELEASE,
            str(chart.CHART),
            "--namespace",
            chart.NAMESPACE,
            "--values",
            str(values_file),
        )
        leader = operator_leader(self.api)
        core = kubernetes.client.CoreV1Api(self.api)

        def leader_ready() -> bool:
            pods = read_object(
                core.list_namespaced_pod, chart.NAMESPACE, label_selector=OPERATOR_POD_LABELS
            )["items"]
            return any(
                pod["metadata"]["name"] == leader
                and any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in dig(pod, "status", "conditions", default=[])
                )
                for pod in pods
            )

        wait_for(leader_ready, 120, f"the leader {leader} Ready (serving the webhook)")
        return chart.Release(self.control_plane, self.api)

    def close(self) -> None:
        if self.release is not None:
            chart.uninstall(self.helm, self.control_plane)
            self.release = None
        if self.nodes is not None:
            self.nodes.stop()
            self.nodes = None
        if self._removed_roles:
            chart.restore_shared_roles(self.control_plane)
            self._removed_roles = False
