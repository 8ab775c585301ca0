"""Where a test run's time goes: each tier's wall time and the slowest tests.

A tier is a folder of ``tests/``. Its wall time runs from the start of its first test's
setup to the end of its last test's teardown, so the session fixtures a tier brings up
(a control plane, the real nodes, the chart) count where they are paid. Tiers that run
side by side (pytest-xdist workers) each report their own span; the report also gives
the run's whole wall time, which is what CI's limit is measured against.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

SLOWEST = 25
"""How many of the slowest tests the summary lists (docs/development.md keeps them)."""


@dataclasses.dataclass
class Tier:
    tests: int = 0
    first_start: float = float("inf")
    last_end: float = 0.0
    busy: float = 0.0
    """Seconds spent in this tier's setups, calls and teardowns (no gaps between them)."""


def tier_of(path: Path, root: Path) -> str:
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return path.parent.name
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


class TierClock:
    """Collects each test's phases as their reports arrive (on the controller too, under
    xdist, where every worker's reports come through ``pytest_runtest_logreport``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tiers: dict[str, Tier] = {}
        self.tests: dict[str, float] = {}
        self.started = time.time()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = self.tiers.setdefault(tier_of(Path(report.fspath), self.root), Tier())
        tier.first_start = min(tier.first_start, report.start)
        tier.last_end = max(tier.last_end, report.stop)
        tier.busy += report.duration
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            tier.tests += 1

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tests:
            return
        write = terminalreporter.write_line
        terminalreporter.section("where the time went")
        write(f"{'tier':<14}{'tests':>7}{'wall min':>10}{'busy min':>10}")
        for name, tier in sorted(self.tiers.items(), key=lambda item: item[1].first_start):
            wall = (tier.last_end - tier.first_start) / 60
            write(f"{name:<14}{tier.tests:>7}{wall:>10.1f}{tier.busy / 60:>10.1f}")
        write(f"{'all':<14}{len(self.tests):>7}{(time.time() - self.started) / 60:>10.1f}")
        write(f"slowest {SLOWEST} tests (setup + call + teardown, seconds):")
        slowest = sorted(self.tests.items(), key=lambda item: item[1], reverse=True)[:SLOWEST]
        for nodeid, seconds in slowest:
            write(f"{seconds:>8.1f}  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # xdist's workers report to the controller
        config.pluginmanager.register(TierClock(config.rootpath), "tier-clock")
