"""The operator's command line: its version, what it says without its extra, the flags
it refuses, and the settings its flags become."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from k8s_rendezvous import __version__
from k8s_rendezvous_operator import __main__, settings


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


def test_the_flags_are_parsed_once_into_the_settings_the_handlers_read() -> None:
    defaults = __main__.settings_of(__main__.command_line().parse_args([]))
    assert defaults == settings.Settings(
        namespaces=(),
        job_label_selector=None,
        worker_role="k8s-rendezvous-worker",
        probes=settings.Probes(interval=1.0, window=3.0),
        webhook=None,
    )
    flags = [
        "-n=a",
        "--namespace=b",
        "--job-label-selector=k8s-rendezvous.dev/enabled=true",
        "--worker-role=",
        "--probe-interval=0",
        "--webhook",
        "--webhook-host=op.system.svc",
        "--webhook-cert-dir=/certs",
    ]
    parsed = __main__.settings_of(__main__.command_line().parse_args(flags))
    assert (parsed.namespaces, parsed.job_label_selector, parsed.worker_role) == (
        ("a", "b"),
        "k8s-rendezvous.dev/enabled=true",
        None,
    )
    assert parsed.probes is None, "an interval of 0 turns probing off"
    assert parsed.webhook == settings.Webhook(
        host="op.system.svc",
        service=None,
        addr=None,
        port=9443,
        cert_dir=Path("/certs"),
        timeout_seconds=5,
        max_connections=64,
        config_name="torchrun-env.k8s-rendezvous.dev",
    )


def test_the_webhook_without_its_host_is_refused_before_anything_starts() -> None:
    answer = operator("--webhook", "--metrics-port=0")
    assert answer.returncode == 2
    assert "--webhook needs --webhook-host (the webhook Service's DNS name)" in answer.stderr
    assert "starting" not in answer.stderr
