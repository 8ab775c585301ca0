"""What devkit/cluster/nodes.py writes for a real node, checked without starting one: the
addresses pods get must be routable between nodes, the kubelet's kernel settings must stay
in its own mount namespace, containerd's limits must hold."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devkit.cluster import nodes
from devkit.cluster.images import ImageArchive


@dataclass
class Plane:
    """What RealNodes reads of a control plane before it starts anything."""

    workdir: Path
    detach: bool = False


def real_nodes(tmp_path: Path, *, ipv6: bool, count: int = 3) -> nodes.RealNodes:
    return nodes.RealNodes(
        Plane(tmp_path),  # type: ignore[arg-type]
        count,
        images=[ImageArchive("localhost/k8s-rendezvous/pause:1", tmp_path / "pause.tar")],
        binaries=tmp_path / "bin",
        ipv6=ipv6,
    )


def cni_config(cluster: nodes.RealNodes, node: nodes.RealNode) -> dict[str, Any]:
    node.directory.mkdir(parents=True)
    (node.directory / "cni" / "net.d").mkdir(parents=True)
    cluster._write_cni_config(node)
    path = node.directory / "cni" / "net.d" / "10-krdzv.conflist"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("ipv6", [False, True])
def test_every_nodes_pods_are_routed_to_every_other_nodes_pods(tmp_path: Path, ipv6: bool) -> None:
    cluster = real_nodes(tmp_path, ipv6=ipv6)
    for node in cluster.nodes:
        (bridge,) = [p for p in cni_config(cluster, node)["plugins"] if p["type"] == "bridge"]
        routes = [ipaddress.ip_network(r["dst"]) for r in bridge["ipam"]["routes"]]
        assert not any(r.prefixlen == 0 for r in routes), "no default route: traffic stays here"
        for other in cluster.nodes:
            subnets = [other.subnet_v4, *([other.subnet_v6] if ipv6 else [])]
            for subnet in subnets:
                assert any(
                    subnet.version == r.version and subnet.subnet_of(r)  # type: ignore[arg-type]
                    for r in routes
                ), (node.name, subnet, routes)
        service = ipaddress.ip_address(nodes.KUBERNETES_SERVICE_IP)
        assert any(r.version == 4 and service in r for r in routes)


@pytest.mark.parametrize("ipv6", [False, True])
def test_a_nodes_first_address_is_of_the_family_its_pods_get_first(
    tmp_path: Path, ipv6: bool
) -> None:
    cluster = real_nodes(tmp_path, ipv6=ipv6)
    for node in cluster.nodes:
        assert ipaddress.ip_address(node.address).version == (6 if ipv6 else 4)
        command = " ".join(cluster._kubelet_command(node))
        assert f"--node-ip={','.join(node.addresses)}" in command


def test_the_kubelets_kernel_settings_are_bound_in_its_own_mount_namespace(
    tmp_path: Path,
) -> None:
    cluster = real_nodes(tmp_path, ipv6=False)
    command = cluster._kubelet_command(cluster.nodes[0])
    assert command[:4] == ["unshare", "--mount", "--propagation", "unchanged"]
    script = command[-1]
    # /proc is made private before anything is bound over its entries.
    assert script.index("mount --make-rprivate /proc") < script.index("mount --bind")
    for entry in nodes.KUBELET_SYSCTLS:
        assert f"/proc/sys/{entry} &&" in script or script.endswith(f"/proc/sys/{entry}")
    assert "exec " in script and "/kubelet " in script


def toml_values(text: str, key: str) -> list[str]:
    """Every ``key = 'value'`` of a TOML text (the pod side's Python 3.10 has no tomllib)."""
    return re.findall(rf"^\s*{re.escape(key)} = '([^']*)'", text, re.MULTILINE)


def test_containerd_keeps_its_sockets_and_state_to_the_node(tmp_path: Path) -> None:
    cluster = real_nodes(tmp_path, ipv6=True, count=2)
    for node in cluster.nodes:
        config = cluster._containerd_config(node)
        (socket_dir,) = toml_values(config, "socket_dir")
        assert len(socket_dir) <= 42, "containerd refuses a longer shim socket directory"
        assert set(toml_values(config, "address")) == {str(node.socket), f"{node.socket}.ttrpc"}
        for key in ("root", "state"):
            (value,) = toml_values(config, key)
            assert Path(value).is_relative_to(node.directory)
        assert toml_values(config, "ip_pref") == ["ipv6"]
        assert re.search(r"^\s*restrict_oom_score_adj = true$", config, re.MULTILINE)
