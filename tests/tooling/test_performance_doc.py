"""The headline figures of docs/performance.md are those of the committed runs they name:
run O's table against bench/results/results.json, and each goodput figure against the
results.json of the run its row or column names, so that a rerun that changes a figure
fails here until the page says so too."""

from __future__ import annotations

import json
import re
from typing import Any

from devkit.paths import REPO

PAGE = (REPO / "docs" / "performance.md").read_text()
RESULTS = REPO / "bench" / "results"
RUN_O = json.loads((RESULTS / "results.json").read_text())

FAULTS = {
    "worker SIGKILL": "worker",
    "agent container SIGKILL": "container",
    "pod deleted": "pod",
    "drain": "drain",
    "node lost": "node",
    "operator leader SIGKILL": "leader",
    "API server restarted": "apiserver",
}
"""The per-fault table's rows, by the fault kind bench/goodput.py records."""

CONFIGS = {"c10d": "c10d", "ours": "ours", "ours with a spare": "ours-spare"}
"""The per-fault table's column heads, by the configuration bench/goodput.py records."""


def cells(label: str) -> list[str]:
    """The cells after ``label`` in the page's one table row that starts with it."""
    rows = re.findall(rf"^\| {re.escape(label)} \|(.*)\|$", PAGE, re.MULTILINE)
    assert len(rows) == 1, f"{len(rows)} rows {label!r} on the page"
    return [cell.strip() for cell in rows[0].split("|")]


def goodput_run(name: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = json.loads((RESULTS / name / "results.json").read_text())[
        "results"
    ]
    return results


def median_min_max(stat: dict[str, float], digits: int) -> str:
    return f"{stat['median']:.{digits}f} s ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"


def test_the_headline_seals_are_run_os_medians() -> None:
    seal = RUN_O["seal_latency"]

    def medians(backend: str, sizes: tuple[str, ...]) -> str:
        return " / ".join(f"{seal[backend][n]['median']:.3f}" for n in sizes) + " s"

    small = ("2", "8", "32")
    assert cells("seal of 2 / 8 / 32 nodes (last call to last return)") == [
        medians("ours", small),
        medians("c10d", small),
        medians("etcd-v2", small),
    ]
    assert cells("seal of 128 nodes (2 slices) / 256 / 512")[0] == medians(
        "ours", ("128", "256", "512")
    )


def test_the_headline_scale_figures_are_medians_with_their_range() -> None:
    scale = RUN_O["scale"]
    assert cells("1000 nodes sealed and released (2 cores for everything)")[0] == (
        median_min_max(scale["seal"], 2)
    )
    assert cells("100 rendezvous of 8 nodes, all sealed")[0] == median_min_max(
        scale["concurrent"]["all_sealed"], 2
    )


def test_the_headline_failure_scale_up_and_footprint_are_run_os() -> None:
    failure = RUN_O["failure_to_new_world"]["ours"]
    assert cells("failure to new world (8 simulated nodes, one killed; the rendezvous alone)")[
        0
    ] == (
        f"{failure['from_pod_deletion']['median']:.3f} s after the pod deletion"
        f" ({failure['median']:.3f} after the kill)"
    )
    notice = RUN_O["scaleup_notice"]
    assert cells("scale-up noticed by every running node") == [
        f"{notice[backend]['median']:.3f} s" for backend in ("ours", "c10d", "etcd-v2")
    ]
    footprint = RUN_O["footprint"]
    assert cells("operator RSS idle / with 200 live rendezvous")[0] == (
        f"{footprint['operator_rss_idle_mb']} MB / {footprint['operator_rss_live_mb']} MB"
    )
    assert cells("plugin load at torchrun's start")[0] == (
        f"{RUN_O['import']['plugin_load_ms']['median']:.1f} ms"
    )


def test_each_goodput_row_is_a_configuration_of_the_run_it_names() -> None:
    rows = re.findall(r"^\| (ours|c10d)[^|]* \| (goodput[\w-]*) \|(.*)\|$", PAGE, re.MULTILINE)
    assert len(rows) == 5, rows
    for _, run, rest in rows:
        goodput, steps, lost = (cell.strip() for cell in rest.split("|"))
        measured = {
            (f"{result['goodput'] * 100:.1f}%", str(result["steps"]), result["goodput"])
            for result in goodput_run(run)
        }
        assert any(
            (goodput, steps) == (shown, count) and lost == f"{100 - share * 100:.1f}%"
            for shown, count, share in measured
        ), (run, goodput, steps, lost)


def pause(cell: str, stats: dict[str, Any]) -> None:
    """``cell`` gives the median / max seconds without training (one figure where they are
    equal, 0 where there was no pause) and, where it says so, the full world's median."""
    idle = stats["idle"]
    figures = re.match(r"([\d.]+)(?: / ([\d.]+))?", cell)
    assert figures, cell
    if idle["max"] == 0:
        assert figures.group(0) == "0", cell
    elif idle["median"] == idle["max"]:
        assert figures.group(0) == f"{idle['median']:.1f}", cell
    else:
        assert figures.group(0) == f"{idle['median']:.1f} / {idle['max']:.1f}", cell
    full_world = re.search(r"\(full world ([\d.]+) s\)", cell)
    if full_world:
        assert full_world.group(1) == f"{stats['full_world']['median']:.2f}", cell


def test_each_pause_is_the_run_its_column_names() -> None:
    head = re.search(r"^\| fault \|(.*\(goodput.*)\|$", PAGE, re.MULTILINE)
    assert head
    columns = []
    for title in head.group(1).split("|"):
        named = re.fullmatch(r"(.+) \((goodput[\w-]*)\)", title.strip())
        assert named, title
        by_config = {result["config"]: result for result in goodput_run(named.group(2))}
        columns.append(by_config[CONFIGS[named.group(1)]]["by_kind"])
    for label, kind in FAULTS.items():
        for cell, by_kind in zip(cells(label), columns, strict=True):
            pause(cell, by_kind[kind])
