"""The full soak, as a command (see tests/soak/README.md):

    .venv/bin/python -m tests.soak --rounds 1000 --seconds 1800 --out tests/soak/results

Starts its own control plane (or attaches to one: K8S_RDZV_KUBECONFIG_DIR), installs the
CRD and roles, runs the operator as a process and the soak against it, and writes
``soak-<UTC time>.json`` and ``.md`` (the figures, the exact command, the machine) plus
the soak's log into ``--out``. Exits 1 if any invariant was violated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import kubernetes.client
import torch
from tests.soak.soak import Config, Soak, log_to

from devkit import manifests, namespaces
from devkit.cluster.controlplane import ControlPlane, build_binaries, read_versions
from devkit.operator import OperatorProcess


def _namespace(api: kubernetes.client.ApiClient) -> str:
    """A namespace whose `default` ServiceAccount holds the worker role."""
    name = namespaces.create(api, f"soak-{uuid.uuid4().hex[:8]}")
    namespaces.bind_worker_role(api, name)
    return name


def _machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
        "control_plane": read_versions(),
    }


def _markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# Soak {summary['started']}",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"- rounds sealed: **{summary['rounds']}** in {summary['seconds']} s "
        f"(stopped by {summary['stopped_by']})",
        f"- invariant violations: **{len(summary['violations'])}**",
        f"- stalls (world not whole {summary['config']['settle_timeout']} s after a fault): "
        f"{len(summary['stalls'])}",
        f"- joins returned: {summary['joins_returned']}; named errors: {summary['join_errors']}",
        f"- status versions recorded and checked: {summary['versions_recorded']}",
        f"- operator SIGKILLed and restarted: {summary['operator_restarts']} times",
        f"- faults: {summary['actions']}",
        "",
        "Recovery (from the fault until the world is whole again: sealed, every running agent",
        "in it or a spare beyond maxNodes, and returned from next_rendezvous()), seconds:",
        "",
        "| fault | count | median | p95 | max |",
        "|---|---|---|---|---|",
    ]
    for action, figures in summary["recovery_seconds"].items():
        lines.append(
            f"| {action} | {figures['count']} | {figures['median']} | {figures['p95']} | "
            f"{figures['max']} |"
        )
    lines += ["", "Violations:", ""]
    lines += [f"- {v}" for v in summary["violations"]] or ["- none"]
    lines += ["", "Stalls:", ""]
    lines += [f"- {s}" for s in summary["stalls"]] or ["- none"]
    machine = summary["machine"]
    lines += [
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), load average at start "
        f"{machine['load_average_at_start']}, Python {machine['python']}, torch "
        f"{machine['torch']}, kernel {machine['kernel']}, control plane "
        f"{machine['control_plane']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    defaults = Config()
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=Path("tests/soak/results"))
    parser.add_argument(
        "--no-operator-kills", action="store_true", help="leave the operator running throughout"
    )
    args = parser.parse_args(argv)
    config = Config(
        rounds=args.rounds,
        seconds=args.seconds,
        seed=args.seed,
        operator_kills=not args.no_operator_kills,
    )
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    log_to(args.out / f"soak-{started}.log")
    machine = _machine()

    attach = os.environ.get("K8S_RDZV_KUBECONFIG_DIR")
    plane = ControlPlane.attach(Path(attach)) if attach else ControlPlane(build_binaries())
    if not attach:
        plane.start()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    try:
        manifests.install(plane)
        with plane.api_client() as api:
            namespace = _namespace(api)
            operator = OperatorProcess(
                plane.kubeconfig, work / "operator.log", namespaces=(namespace,)
            )
            operator.start()
            try:
                result = Soak(
                    plane, api, namespace, operator, config, progress=lambda s: print(s, flush=True)
                ).run()
            finally:
                operator.stop()
    finally:
        if not attach:
            plane.stop()

    summary = {
        "started": started,
        "command": shlex.join([Path(sys.executable).name, "-m", "tests.soak", *sys.argv[1:]]),
        **result.summary(),
        "machine": machine,
    }
    stem = args.out / f"soak-{started}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(summary))
    print(_markdown(summary))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
