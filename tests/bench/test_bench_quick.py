"""The benchmark harness works end to end: ``python bench/run.py --mode check`` (the quick
mode's sizes, each figure measured once) starts its own control plane and operator, runs
every section with small sizes against ours, torch's c10d (and etcd-v2 where it can be
built) and writes results with numbers in each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Over 3 minutes (about 10 beside make test's other lane): one run of every section, since
# the report and its plots are made from all of them together.
@pytest.mark.timeout(2400)
def test_check_mode_writes_every_section_with_numbers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--mode", "check", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=2300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("results.md", "seal_latency.png", "failure_scaleup.png", "cost.png", "scale.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    seal = results["seal_latency"]
    for backend in ("ours", "c10d"):
        for count in ("2", "8"):
            assert _number(seal[backend][count]["median"]), (backend, count, seal[backend][count])
    if "etcd-v2" not in results["absent"]:
        assert _number(seal["etcd-v2"]["2"]["median"]), seal["etcd-v2"]

    failure = results["failure_to_new_world"]
    assert _number(failure["ours"]["median"]), failure["ours"]
    assert _number(failure["ours"]["from_pod_deletion"]["median"])
    assert _number(failure["c10d (1 s x 4, last call 1 s)"]["median"])

    scaleup = results["scaleup_notice"]
    assert _number(scaleup["ours"]["median"]) and _number(scaleup["c10d"]["median"]), scaleup

    rows = results["cost_analysis"]["rows"]
    assert [row["nodes"] for row in rows][:2] == [2, 8]
    assert all(_number(row["requests"]) and row["watch_bytes"] > 0 for row in rows), rows
    assert _number(results["cost_analysis"]["requests_slope"])

    scale = results["scale"]
    assert _number(scale["seal"]["median"]), scale
    assert _number(scale["concurrent"]["all_sealed"]["median"]), scale["concurrent"]
    processes = scale["runs"][0]["processes"]
    assert {"kube-apiserver", "etcd", "operator"} <= set(processes)
    assert all(_number(p["cpu_seconds"]) and p["peak_rss_mb"] > 0 for p in processes.values())

    footprint = results["footprint"]
    assert _number(footprint["operator_rss_idle_mb"]) and _number(footprint["operator_rss_live_mb"])
    assert _number(results["import"]["plugin_load_ms"]["median"])
    assert results["import"]["plugin_registered"]

    recovery = results["recovery"]["summary"]
    for variant in ("ours", "ours-in-place"):
        assert not recovery[variant]["errors"], recovery[variant]["errors"]
        for event in ("kill", "add"):
            assert _number(recovery[variant][event]["first_step"]["median"]), (variant, event)
    assert (tmp_path / "recovery_timeline.png").stat().st_size > 0

    assert {t["name"].split(" ")[0] for t in results["targets"]} >= {"seal", "failure", "plugin"}
    assert all("verdict" in t for t in results["targets"])
