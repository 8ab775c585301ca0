"""Nothing left in the temporary directory when a start fails: the dev kit's control plane
whose start stops after etcd (its kube-apiserver exits at once), and ``make demo``
(examples/demo.py) failing at that same start. Each runs with a temporary directory of its
own, listed after; /tmp is listed before and after too, for a path written there by name.

The failure is real: a build cache (``K8S_RDZV_CACHE``) holding the pinned binaries,
etcd's included, but a kube-apiserver that exits with an error, as a broken build would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.cluster.controlplane import ControlPlane, ControlPlaneError, build_binaries
from devkit.paths import REPO

FAILING_APISERVER = """#!/bin/sh
echo "kube-apiserver: this one exits at once (tests/integration/test_leftovers.py)" >&2
exit 1
"""
OURS = ("k8s-rdzv", "krdzv")
"""The prefixes of what the dev kit and the tests make in a temporary directory."""


def ours_in(directory: Path) -> set[str]:
    return {entry.name for entry in directory.iterdir() if entry.name.startswith(OURS)}


def processes_naming(path: Path) -> list[str]:
    """The command lines of running processes that name ``path`` (etcd names its data
    directory)."""
    found = []
    for process in Path("/proc").iterdir():
        try:
            words = (process / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # not a process, or gone meanwhile
            continue
        if any(str(path) in word for word in words):
            found.append(" ".join(words))
    return found


@pytest.fixture
def failing_cache(tmp_path: Path) -> tuple[Path, Path]:
    """``(cache, binaries)``: a build cache whose control-plane directory holds the real
    binaries but a kube-apiserver that exits; everything else linked from the real cache,
    so that build.sh finds all it needs built."""
    real = build_binaries()
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in real.parent.iterdir():
        if entry.name != real.name:
            (cache / entry.name).symlink_to(entry.resolve())
    binaries = cache / real.name
    binaries.mkdir()
    for entry in real.iterdir():
        if entry.name not in ("kube-apiserver", "logs"):
            (binaries / entry.name).symlink_to(entry.resolve())
    (binaries / "kube-apiserver").write_text(FAILING_APISERVER)
    (binaries / "kube-apiserver").chmod(0o755)
    return cache, binaries


@pytest.fixture
def own_tmp(tmp_path: Path) -> Iterator[Path]:
    """A temporary directory of the test's own, where ``tempfile`` makes everything; and
    /tmp, compared after the test."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    before = ours_in(Path("/tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(directory))
        yield directory
    assert not ours_in(Path("/tmp")) - before, "written to /tmp by name"


def test_a_control_plane_whose_start_stops_after_etcd_leaves_nothing(
    failing_cache: tuple[Path, Path], own_tmp: Path
) -> None:
    _, binaries = failing_cache
    plane = ControlPlane(binaries)
    workdir = plane.workdir
    assert workdir.parent == own_tmp
    with pytest.raises(ControlPlaneError, match="kube-apiserver exited") as failed:
        plane.start()
    # kube-apiserver starts only once etcd answered healthy: etcd ran, and was stopped.
    assert processes_naming(workdir) == [], "etcd stopped by its PID"
    assert not workdir.exists() and not list(own_tmp.iterdir())
    assert "this one exits at once" in str(failed.value), "the log's tail, in the message"
    assert f"its work directory {workdir} is removed" in "\n".join(failed.value.__notes__)


def test_the_demo_failing_to_start_its_control_plane_leaves_nothing(
    failing_cache: tuple[Path, Path], own_tmp: Path
) -> None:
    cache, _ = failing_cache
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("K8S_RDZV_")},
        "K8S_RDZV_CACHE": str(cache),
        "TMPDIR": str(own_tmp),
    }
    env.pop("KUBEBUILDER_ASSETS", None)
    demo = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert "DEMO FAILED: ControlPlaneError: kube-apiserver exited" in demo.stderr, demo.stderr
    assert "stopped everything" in demo.stdout
    assert not list(own_tmp.iterdir()), "the demo's and its control plane's directories"
