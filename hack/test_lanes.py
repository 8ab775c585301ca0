"""`make test`'s tests in lanes that run side by side, each its own pytest session.

Most of a test run waits (join and last-call windows, kubelets and containers starting,
torch importing in fresh processes), so two sessions at once keep two cores busier
without making any test wait longer than it would alone for what it waits on. Each lane
starts its own control plane (and the lane with tests/nodes its own real nodes), so no
lane sees another's operators, chart releases, controllers or pods, and kwok gives each
lane's pods loopback addresses of their own (``K8S_RDZV_POD_CIDR``). The lanes are fixed,
not balanced at run time, so that the same tests always run beside the same tests.

    python -m hack.test_lanes [PYTEST_ARG ...]    # every lane, the args given to each

What the lanes need built (the control plane, the real nodes' binaries and images, the
workload controllers) is built first, once, so that no two lanes build it at once. The
tests' files go to one directory, removed once every lane passed and kept (and named)
otherwise. At the end the lanes' timings are merged into one report: each tier's wall
time and the slowest tests (tests/support/timing.py), docs/development.md keeps it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMING_FILE_ENV = "K8S_RDZV_TIMING_FILE"
"""Where a lane's session leaves its timings (tests/support/timing.py), as JSON:
``{"tiers": {name: Tier's fields}, "tests": {nodeid: seconds}, "failed": [nodeid (phase)]}``."""
POD_CIDR_ENV = "K8S_RDZV_POD_CIDR"
STOP_SECONDS = 120
"""How long an interrupted lane has to stop its control plane and nodes."""
PASSED = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
"""A lane whose tests a ``-k`` or ``-m`` left out entirely passed too."""
SLOWEST = 25
"""How many of the slowest tests the report lists (docs/development.md keeps them)."""


@dataclasses.dataclass
class Tier:
    """A folder of tests/ in one session: its wall time runs from the start of its first
    test's setup to the end of its last test's teardown, so the session fixtures it brings
    up (a control plane, the real nodes, the chart) count where they are paid; ``busy`` is
    the sum of its tests' setups, calls and teardowns."""

    tests: int = 0
    first_start: float = float("inf")
    last_end: float = 0.0
    busy: float = 0.0


def report(
    tiers: dict[str, Tier], tests: dict[str, float], wall: float, write: Callable[[str], None]
) -> None:
    """The tiers in the order they started, the whole run's wall time and the
    :data:`SLOWEST` tests."""
    write(f"{'tier':<22}{'tests':>7}{'wall min':>10}{'busy min':>10}")
    for name, tier in sorted(tiers.items(), key=lambda item: item[1].first_start):
        span = (tier.last_end - tier.first_start) / 60
        write(f"{name:<22}{tier.tests:>7}{span:>10.1f}{tier.busy / 60:>10.1f}")
    write(f"{'all':<22}{len(tests):>7}{wall / 60:>10.1f}")
    write(f"slowest {SLOWEST} tests (setup + call + teardown, seconds):")
    slowest = sorted(tests.items(), key=lambda item: item[1], reverse=True)[:SLOWEST]
    for nodeid, seconds in slowest:
        write(f"{seconds:>8.1f}  {nodeid}")


@dataclasses.dataclass(frozen=True)
class Lane:
    name: str
    tiers: tuple[str, ...]
    """Folders of tests/, run in this order."""
    pod_cidr: str


LANES: tuple[Lane, ...] = (
    Lane("a", ("nodes", "controllers", "chart", "security", "bench", "tooling"), "127.244.0.0/16"),
    Lane("b", ("integration", "e2e", "contract", "soak", "unit"), "127.245.0.0/16"),
)
"""Which tiers run together, in that order. The real nodes, the chart releases and the
workload controllers, whose operators and controllers watch every namespace, each stay
within one lane. Balanced by the tiers' measured wall times (docs/development.md)."""


def lane_command(lane: Lane, pytest_args: Sequence[str], files: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "not c10d_control",
        f"--basetemp={files / lane.name}",
        *pytest_args,
        *(f"tests/{tier}" for tier in lane.tiers),
    ]


def _stream(lane: Lane, pipe: IO[str], lock: threading.Lock, log: Path) -> None:
    """The lane's output, prefixed, to stdout, and unprefixed to its own log (kept with the
    tests' files when a lane fails: a CI that shows only the output's end loses the rest)."""
    with log.open("w") as copy:
        for line in pipe:
            copy.write(line)
            with lock:
                sys.stdout.write(f"[{lane.name}] {line}")
                sys.stdout.flush()


def run(pytest_args: Sequence[str], lanes: Sequence[Lane] = LANES, repo: Path = REPO) -> int:
    """Every lane at once; 0 once each passed (or had no test selected), else the worst
    lane's pytest exit code."""
    files = Path(tempfile.mkdtemp(prefix="k8s-rdzv-tests."))
    started = time.time()
    lock = threading.Lock()
    running: list[tuple[Lane, subprocess.Popen[str], threading.Thread]] = []
    try:
        for lane in lanes:
            env = {
                **os.environ,
                TIMING_FILE_ENV: str(files / f"{lane.name}.timing.json"),
                POD_CIDR_ENV: lane.pod_cidr,
            }
            process = subprocess.Popen(
                lane_command(lane, pytest_args, files),
                cwd=repo,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
            reader = threading.Thread(
                target=_stream, args=(lane, process.stdout, lock, files / f"{lane.name}.log")
            )
            reader.start()
            running.append((lane, process, reader))
        codes = {lane.name: process.wait() for lane, process, _ in running}
    finally:
        # An interrupted run (Ctrl-C, CI's timeout) stops each lane as pytest stops on
        # Ctrl-C: its fixtures stop their control plane and nodes by PID.
        for _, process, _ in running:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for _, process, reader in running:
            try:
                process.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            reader.join()
    failed_tests = report_lanes(lanes, files, time.time() - started)
    failed = {name: code for name, code in codes.items() if code not in PASSED}
    if failed or all(code == pytest.ExitCode.NO_TESTS_COLLECTED for code in codes.values()):
        # Last, so that the end of the output, which is all some CIs show, names them.
        for nodeid in failed_tests:
            print(f"FAILED {nodeid}")
        print(f"make test: lanes {failed} failed; their output and the tests' files are in {files}")
        return max(failed.values(), default=pytest.ExitCode.NO_TESTS_COLLECTED)
    # rm stays on its file system: a mount a test left behind fails the run instead of
    # being emptied.
    subprocess.run(["rm", "-rf", "--one-file-system", str(files)], check=True)
    return 0


def report_lanes(lanes: Sequence[Lane], files: Path, wall: float) -> list[str]:
    """Prints the merged report; returns the tests that failed, each with its lane."""
    tiers: dict[str, Tier] = {}
    tests: dict[str, float] = {}
    failed: list[str] = []
    for lane in lanes:
        timing = files / f"{lane.name}.timing.json"
        if timing.exists():
            data = json.loads(timing.read_text())
            tiers |= {f"{lane.name}: {name}": Tier(**tier) for name, tier in data["tiers"].items()}
            tests |= data["tests"]
            failed += [f"[{lane.name}] {nodeid}" for nodeid in data["failed"]]
    print(f"\n{' where the time went (every lane) ':=^80}")
    report(tiers, tests, wall, print)
    return failed


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
