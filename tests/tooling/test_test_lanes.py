"""make test's lanes (hack/test_lanes.py): every tier runs in exactly one lane; a lane's
failure fails the run, names the failed tests last and keeps the lanes' output and the
tests' files; the report covers every lane."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from hack import test_lanes

REPO = Path(__file__).resolve().parents[2]


def test_every_folder_of_tests_runs_in_exactly_one_lane() -> None:
    tiers = [tier for lane in test_lanes.LANES for tier in lane.tiers]
    with_tests = {path.parent.name for path in (REPO / "tests").glob("*/test_*.py")}
    assert len(tiers) == len(set(tiers)), tiers
    assert set(tiers) == with_tests


def test_no_two_test_files_share_a_name() -> None:
    """pytest imports test files by their basename (tests/ has no packages): two of one
    name in one lane stop the lane at collection, whichever tiers they are in."""
    names = sorted(path.name for path in (REPO / "tests").glob("*/test_*.py"))
    assert not {name for name in names if names.count(name) > 1}


def test_lanes_give_their_pods_addresses_apart() -> None:
    cidrs = [lane.pod_cidr for lane in test_lanes.LANES]
    assert len(set(cidrs)) == len(cidrs)
    assert all(cidr.startswith("127.") for cidr in cidrs)


def _repo(tmp_path: Path, second_tier_passes: bool) -> Path:
    repo = tmp_path / "repo"
    (repo / "tests" / "first").mkdir(parents=True)
    (repo / "tests" / "second").mkdir()
    (repo / "conftest.py").write_text('pytest_plugins = ("tests.support.timing",)\n')
    (repo / "tests" / "first" / "test_one.py").write_text(
        "def test_passes():\n    pass\n\ndef test_passes_too():\n    pass\n"
    )
    (repo / "tests" / "second" / "test_two.py").write_text(
        f"def test_this():\n    assert {second_tier_passes}\n"
    )
    return repo


LANES = (
    test_lanes.Lane("x", ("first",), "127.250.0.0/16"),
    test_lanes.Lane("y", ("second",), "127.251.0.0/16"),
)


@pytest.fixture
def files_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the driver makes its directory for the tests' files (not /tmp itself)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    return root


def test_lanes_that_pass_leave_no_files_and_report_every_tier(
    tmp_path: Path, files_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert test_lanes.run(["-p", "no:cacheprovider"], LANES, _repo(tmp_path, True)) == 0
    out = capsys.readouterr().out
    assert list(files_root.iterdir()) == []
    assert re.search(r"^x: first +2 ", out, re.MULTILINE), out
    assert re.search(r"^y: second +1 ", out, re.MULTILINE), out
    assert re.search(r"^all +3 ", out, re.MULTILINE), out
    assert "[x] " in out and "[y] " in out  # each lane's own output, named


def test_one_failing_lane_fails_the_run_and_keeps_the_files(
    tmp_path: Path, files_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = test_lanes.run(["-p", "no:cacheprovider"], LANES, _repo(tmp_path, False))
    assert code == pytest.ExitCode.TESTS_FAILED
    (kept,) = files_root.iterdir()
    out = capsys.readouterr().out.splitlines()
    # The failed test is named at the very end, which is all some CIs show.
    assert out[-2] == "FAILED [y] tests/second/test_two.py::test_this (call)"
    assert out[-1].endswith(f"their output and the tests' files are in {kept}")
    assert "assert False" in (kept / "y.log").read_text()  # the lane's whole output
