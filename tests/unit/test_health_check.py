"""The health gate's pure parts and its runner (k8s_rendezvous.health_check).

Aspects: ``--rdzv-conf health_check`` splits as a shell would and its bound is checked
(read with the other agent settings: tests/unit/test_agent_settings.py);
the report a node writes is bounded, printable and checked on read; a check that passes,
fails, cannot start or hangs is reported as such, a hanging one ended with its process
group at its bound and its output kept to a bounded tail; the operator reports each
failed join once, naming the pod, its node and the output's tail within an Event's size.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from k8s_rendezvous import config, health_check
from k8s_rendezvous.wire import codec, leases, tunables
from k8s_rendezvous_operator import failed_checks, reasons

FAILED = leases.HealthCheckReport(leases.HealthCheckOutcome.FAILED, 1.5, 3, "ECC error on GPU 3\n")


def _params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("kubernetes", "ns/r", "run", 1, 2, **conf)


# -- configuration ----------------------------------------------------------------------


def test_the_check_is_split_as_a_shell_would_and_run_without_one() -> None:
    settings = config.Settings.from_parameters(
        _params(health_check="nccl-check --size '1 G' --gpus=all", health_check_timeout="30"),
        "ns",
    )
    assert settings.health_check == ("nccl-check", "--size", "1 G", "--gpus=all")
    assert settings.health_check_timeout == 30


def test_no_check_is_run_by_default_and_the_bound_has_its_default() -> None:
    settings = config.Settings.from_parameters(_params(), "ns")
    assert settings.health_check == ()
    assert settings.health_check_timeout == tunables.DEFAULT_HEALTH_CHECK_SECONDS


def test_a_check_that_does_not_split_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"health_check=.* is refused: No closing quotation"):
        config.Settings.from_parameters(_params(health_check="check 'unclosed"), "ns")


@pytest.mark.parametrize(
    "timeout",
    ["0", "-5", "ten", "1.5", str(tunables.MAX_HEALTH_CHECK_SECONDS + 1)],
)
def test_a_bound_out_of_its_range_is_refused(timeout: str) -> None:
    with pytest.raises(ValueError, match=r"health_check_timeout=.* from 1 to 3600"):
        config.Settings.from_parameters(
            _params(health_check="true", health_check_timeout=timeout), "ns"
        )


# -- the report on the wire -------------------------------------------------------------


def test_a_leave_carries_its_report_and_reads_back_the_same() -> None:
    entry = leases.NodeEntry("i", 1, "10.0.0.1", 1, leases.NodeIntent.LEAVE, health_check=FAILED)
    assert leases.NodeEntry.from_annotation(entry.to_annotation(), "entry") == entry


def test_an_entry_without_a_report_is_written_as_before() -> None:
    entry = leases.NodeEntry("i", 1, "10.0.0.1", 1)
    assert "healthCheck" not in entry.to_dict()


def test_control_characters_of_the_output_are_never_written_or_read() -> None:
    report = leases.HealthCheckReport(
        leases.HealthCheckOutcome.FAILED, 1, 1, "ok\x1b[2J\x07\r\n\tend\x9b"
    )
    assert report.to_dict()["tail"] == "ok?[2J??\n\tend?"
    hostile = {**report.to_dict(), "tail": "\x1b]0;pwned\x07"}
    assert leases.HealthCheckReport.from_dict(hostile, "h").tail == "?]0;pwned?"


def test_the_tail_written_is_the_outputs_last_characters() -> None:
    report = leases.HealthCheckReport(
        leases.HealthCheckOutcome.FAILED, 1, 1, "x" * 5000 + "the reason"
    )
    tail = report.to_dict()["tail"]
    assert len(tail) == leases.MAX_HEALTH_CHECK_TAIL
    assert tail.endswith("the reason")


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        pytest.param("tail", "x" * 1025, "at most 1024 characters", id="tail too long"),
        pytest.param("exitCode", 256, "from -255 to 255", id="exit code out of range"),
        pytest.param("exitCode", True, "from -255 to 255", id="a boolean exit code"),
        pytest.param("outcome", "Fine", "is not one of", id="an unknown outcome"),
        pytest.param("milliseconds", 10**12, "must be at most", id="an endless run"),
        pytest.param("milliseconds", -1, "must be at least 0", id="a negative time"),
    ],
)
def test_a_report_a_pod_made_up_is_refused_naming_the_field(
    field: str, value: object, said: str
) -> None:
    data = {**FAILED.to_dict(), field: value}
    entry = leases.NodeEntry("i", 1, "10.0.0.1", 1, leases.NodeIntent.LEAVE).to_dict()
    with pytest.raises(codec.DecodeError, match=f"entry.healthCheck.{field}: .*{said}"):
        leases.NodeEntry.from_dict({**entry, "healthCheck": data}, "entry")


# -- running the check ------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_check_that_exits_zero_passes() -> None:
    assert health_check.run(_python("print('all GPUs fine')"), 30) is None


def test_a_check_that_fails_is_reported_with_its_code_and_output() -> None:
    report = health_check.run(
        _python("import sys; print('probing'); sys.stderr.write('NCCL WARN bad link\\n'); exit(4)"),
        30,
    )
    assert report is not None
    assert report.outcome is leases.HealthCheckOutcome.FAILED
    assert report.exit_code == 4
    assert report.tail == "probing\nNCCL WARN bad link\n"
    assert "exited with code 4" in report.summary()


def test_a_check_that_cannot_start_is_reported_as_such() -> None:
    report = health_check.run(["/nonexistent/gpu-check"], 30)
    assert report is not None
    assert report.outcome is leases.HealthCheckOutcome.NOT_STARTED
    assert "/nonexistent/gpu-check" in report.tail


def test_only_the_tail_of_endless_output_is_kept() -> None:
    report = health_check.run(
        _python("import sys; sys.stdout.write('x' * 10_000_000 + '\\nlast line'); exit(1)"), 60
    )
    assert report is not None
    assert len(report.tail) == leases.MAX_HEALTH_CHECK_TAIL
    assert report.tail.endswith("\nlast line")


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, killed and awaiting its reaper, does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_a_check_that_hangs_is_killed_with_its_children_at_its_bound(
    tmp_path: pathlib.Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    report = health_check.run(
        ["sh", "-c", f"sleep 600 & echo $! > {pid_file}; echo waiting for the GPU; wait"], 1
    )
    assert report is not None
    assert report.outcome is leases.HealthCheckOutcome.TIMED_OUT
    assert report.tail == "waiting for the GPU\n"
    assert "killed" in report.summary()
    child = int(pid_file.read_text())
    # SIGKILL is delivered at once, but the orphan's exit is the kernel's to finish.
    deadline = time.monotonic() + 30
    while _running(child) and time.monotonic() < deadline:
        os.sched_yield()
    assert not _running(child)


# -- the operator's report --------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "reported", "expected"),
    [
        pytest.param(None, None, None, id="no entry"),
        pytest.param(
            leases.NodeEntry("i", 2, "10.0.0.1", 1, leases.NodeIntent.LEAVE, health_check=FAILED),
            None,
            ("i", 2),
            id="a new failed check is reported",
        ),
        pytest.param(
            leases.NodeEntry("i", 2, "10.0.0.1", 1, leases.NodeIntent.LEAVE, health_check=FAILED),
            ("i", 2),
            None,
            id="the same one again (renewal, shutdown) is not",
        ),
        pytest.param(
            leases.NodeEntry("i", 3, "10.0.0.1", 1, leases.NodeIntent.LEAVE, health_check=FAILED),
            ("i", 2),
            ("i", 3),
            id="a later join's is",
        ),
        pytest.param(
            leases.NodeEntry("i", 2, "10.0.0.1", 1, leases.NodeIntent.LEAVE),
            None,
            None,
            id="a plain leave is not",
        ),
        pytest.param(
            leases.NodeEntry("i", 2, "10.0.0.1", 1, leases.NodeIntent.JOIN, health_check=FAILED),
            None,
            None,
            id="a join carrying a report is not: the node did not stay out",
        ),
    ],
)
def test_each_failed_check_is_reported_once(
    entry: leases.NodeEntry | None,
    reported: failed_checks.Reported | None,
    expected: failed_checks.Reported | None,
) -> None:
    assert failed_checks.to_report(entry, reported) == expected


def test_the_warning_names_the_pod_its_node_and_the_outputs_tail() -> None:
    message = reasons.health_check_failed("train-0", "gpu-node-7", FAILED)
    assert message.startswith("pod train-0 on node gpu-node-7 joins no round")
    assert "exited with code 3 after 1.500 s" in message
    assert message.endswith("Output ends: ECC error on GPU 3\n")


def test_the_warning_fits_an_event_and_keeps_the_outputs_last_lines() -> None:
    long = leases.HealthCheckReport(leases.HealthCheckOutcome.TIMED_OUT, 300, None, "y" * 1024)
    message = reasons.health_check_failed("p" * 253, "n" * 253, long)
    assert len(message) <= reasons.MAX_EVENT_MESSAGE
    assert message.endswith("y" * 100)
    assert "did not end within health_check_timeout" in message


def test_an_unscheduled_or_gone_pod_is_said_to_be_on_no_known_node() -> None:
    assert "on a node not known" in reasons.health_check_failed("train-0", None, FAILED)
