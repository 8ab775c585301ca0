"""The README stays one screen, and the figures it quotes are those of the committed goodput
run (bench/results/goodput), so that a rerun that changes them changes the README too."""

from __future__ import annotations

import json
import re
from typing import Any

from devkit.paths import REPO

README = (REPO / "README.md").read_text()
GOODPUT = json.loads((REPO / "bench" / "results" / "goodput" / "results.json").read_text())
COLUMNS = ("c10d", "ours", "ours-spare")
"""The configurations of the README's table, in its column order."""


def row(label: str) -> list[str]:
    """The cells after ``label`` in the README's figures table."""
    match = re.search(rf"^\| {re.escape(label)} \|(.*)\|$", README, re.MULTILINE)
    assert match, f"no row {label!r} in the README's table"
    return [cell.strip() for cell in match.group(1).split("|")]


def by_config() -> dict[str, Any]:
    return {result["config"]: result for result in GOODPUT["results"]}


def test_the_readme_is_one_screen_of_short_lines() -> None:
    lines = README.splitlines()
    assert len(lines) <= 65, len(lines)
    assert max(len(line) for line in lines) <= 120


def test_the_goodput_figures_are_the_committed_runs() -> None:
    results = by_config()
    assert row("goodput") == [f"{float(results[c]['goodput']) * 100:.1f}%" for c in COLUMNS]


def test_a_pod_deleted_costs_what_the_committed_run_measured() -> None:
    results = by_config()
    measured = [results[c]["by_kind"]["pod"]["idle"]["median"] for c in COLUMNS]
    assert row("a pod deleted: seconds without training (median)") == [
        f"{seconds:.1f}" for seconds in measured
    ]


def test_the_run_named_is_the_one_quoted() -> None:
    faults = len(GOODPUT["results"][0]["faults"])
    minutes = round(GOODPUT["results"][0]["seconds"] / 60)
    assert f"{faults} faults in {minutes} min" in README.replace("\n", " ")
