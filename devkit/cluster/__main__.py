"""Developer entry point for the local control plane.

    python -m devkit.cluster build            # build (or find) the binaries; print their dir
    python -m devkit.cluster up [--dir DIR]   # start detached; print `export KUBECONFIG=...`
    python -m devkit.cluster up --real-nodes 2 [--ipv6]
                                             # ... with real nodes beside kwok (root; see
                                             # devkit/cluster/nodes.py), their images loaded
    python -m devkit.cluster down [--dir DIR] # stop it (and its real nodes) and remove DIR

With a cluster up, ``K8S_RDZV_KUBECONFIG_DIR=DIR pytest ...`` reuses it instead of starting
one per session.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from devkit.cluster import images
from devkit.cluster.controlplane import (
    STATE_FILE,
    ControlPlane,
    ControlPlaneError,
    build_binaries,
)
from devkit.cluster.nodes import RealNodes, build_node_binaries

REPO = Path(__file__).resolve().parents[2]


def default_dir() -> Path:
    return Path(os.environ.get("TMPDIR") or "/tmp") / "k8s-rendezvous-dev"


def _up(directory: Path, real_nodes: int, ipv6: bool) -> int:
    if (directory / STATE_FILE).exists():
        existing = ControlPlane.attach(directory)
        running = existing.running_components()
        if running:
            print(f"# already up in {directory} ({', '.join(running)})", file=sys.stderr)
            print(f"export KUBECONFIG={existing.kubeconfig}")
            return 0
        shutil.rmtree(directory)
    binaries = build_binaries(stream_log=True)
    plane = ControlPlane(binaries, directory, detach=True, keep_workdir=True)
    try:
        plane.start()
        if real_nodes:
            node_binaries = build_node_binaries()
            cache = images.default_cache()
            loaded = [
                images.pause_image(node_binaries / "pause", cache),
                images.trainer_image(cache),
                images.operator_image(REPO, cache),
            ]
            RealNodes(plane, real_nodes, images=loaded, binaries=node_binaries, ipv6=ipv6).start()
            print(f"# images on the real nodes: {[i.reference for i in loaded]}", file=sys.stderr)
    except (ControlPlaneError, images.ImageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        plane.stop()
        return 1
    print(
        f"# control plane up in {plane.startup_seconds:.1f}s at {plane.server}; "
        f"logs in {plane.workdir / 'logs'}; stop with: python -m devkit.cluster down"
        + ("" if directory == default_dir() else f" --dir {directory}"),
        file=sys.stderr,
    )
    print(f"export KUBECONFIG={plane.kubeconfig}")
    return 0


def _down(directory: Path) -> int:
    if not (directory / STATE_FILE).exists():
        print(f"# nothing to stop in {directory}", file=sys.stderr)
        return 0
    plane = ControlPlane.attach(directory)
    nodes = RealNodes.attach(plane)
    if nodes is not None:
        nodes.stop()
    plane.stop()
    left = plane.running_components()
    if left:
        print(f"error: still running: {left}", file=sys.stderr)
        return 1
    shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the binaries and print their directory")
    for name in ("up", "down"):
        command = sub.add_parser(name)
        command.add_argument(
            "--dir", type=Path, default=default_dir(), help="state directory (default: %(default)s)"
        )
        if name == "up":
            command.add_argument(
                "--real-nodes", type=int, default=0, help="real nodes to start beside kwok's"
            )
            command.add_argument("--ipv6", action="store_true", help="dual-stack pods, IPv6 first")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build_binaries(stream_log=True))
        return 0
    directory = Path(args.dir).resolve()
    if args.command == "up":
        return _up(directory, args.real_nodes, args.ipv6)
    return _down(directory)


if __name__ == "__main__":
    sys.exit(main())
