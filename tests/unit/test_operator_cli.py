"""The operator's command line: its version, and what it says without its extra."""

from __future__ import annotations

import subprocess
import sys

from k8s_rendezvous import __version__


def operator(*args: str, before: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{before}from k8s_rendezvous_operator.__main__ import main; main({list(args)!r})"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_version_is_the_distributions() -> None:
    answer = operator("--version")
    assert (answer.returncode, answer.stdout.strip()) == (
        0,
        f"k8s-rendezvous-operator {__version__}",
    )


def test_without_its_extra_it_says_what_to_install() -> None:
    # None in sys.modules: importing kopf raises ModuleNotFoundError, as when it is absent.
    answer = operator(before="import sys; sys.modules['kopf'] = None; ")
    assert answer.returncode == 1
    assert answer.stderr.strip() == (
        "k8s-rendezvous-operator: kopf is missing: the operator needs its extra, "
        "pip install 'k8s-rendezvous[operator]'"
    )


def test_a_probe_window_that_one_lost_datagram_could_end_is_refused() -> None:
    answer = operator("--probe-interval=2", "--probe-window=3")
    assert answer.returncode == 2
    assert (
        "--probe-window must be at least twice --probe-interval (one lost datagram must not "
        "drop a member), got 3.0 and 2.0"
    ) in answer.stderr
    negative = operator("--probe-interval=-1")
    assert negative.returncode == 2
    assert "--probe-interval must be 0 (no probes) or more, got -1.0" in negative.stderr
