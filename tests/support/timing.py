"""Where a test session's time goes: each tier's wall time and the slowest tests
(:class:`hack.test_lanes.Tier`). A session run as a lane of hack/test_lanes.py leaves
its timings in a file instead, and the driver reports every lane's at once."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from hack import test_lanes


def tier_of(path: Path, root: Path) -> str:
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return path.parent.name
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


class TierClock:
    """Adds up each test's phases as their reports arrive."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tiers: dict[str, test_lanes.Tier] = {}
        self.tests: dict[str, float] = {}
        self.failed: list[str] = []
        self.started = time.time()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = self.tiers.setdefault(tier_of(Path(report.fspath), self.root), test_lanes.Tier())
        tier.first_start = min(tier.first_start, report.start)
        tier.last_end = max(tier.last_end, report.stop)
        tier.busy += report.duration
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self.failed.append(f"{report.nodeid} ({report.when})")
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            tier.tests += 1

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.tests:
            return
        if destination := os.environ.get(test_lanes.TIMING_FILE_ENV):
            tiers = {name: dataclasses.asdict(tier) for name, tier in self.tiers.items()}
            Path(destination).write_text(
                json.dumps({"tiers": tiers, "tests": self.tests, "failed": self.failed})
            )
            return  # the driver reports every lane's at once
        terminalreporter.section("where the time went")
        test_lanes.report(
            self.tiers, self.tests, time.time() - self.started, terminalreporter.write_line
        )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TierClock(config.rootpath), "tier-clock")
