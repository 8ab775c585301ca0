"""py-spy around a round, for diagnosis (``run.py --py-spy``): where the CPU goes.

Sampling costs CPU of its own on a 2-core machine, so a profiled round is slower than an
unprofiled one: its latency is not a published figure, its shares of samples are.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_LINE_NUMBER = re.compile(r":\d+\)$")
_DIRECTORIES = re.compile(r"\((?:[^()]*/)?([^/()]+/[^/()]+)\)$")  # keep "package/module.py"


@contextlib.contextmanager
def recording(pids: dict[str, int], out_dir: Path, rate: int = 50) -> Iterator[dict[str, Any]]:
    """Sample each named process until the block ends; the summary fills the yielded dict."""
    spy = shutil.which("py-spy") or str(Path(__file__).resolve().parents[1] / ".venv/bin/py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    options = ("--rate", str(rate), "--nonblocking", "--format", "raw")
    recorders = {
        name: subprocess.Popen(
            [spy, "record", "--pid", str(pid), *options, "--output", str(out_dir / f"{name}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }
    summary: dict[str, Any] = {}
    try:
        yield summary
    finally:
        for recorder in recorders.values():
            recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for name, recorder in recorders.items():
            try:
                recorder.wait(60)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()
            path = out_dir / f"{name}.txt"
            summary[name] = top_frames(path) if path.exists() else {"error": "no output"}


def top_frames(path: Path, count: int = 25) -> dict[str, Any]:
    """Samples by function: where a sample was (self) and what it was inside (inclusive)."""
    own: collections.Counter[str] = collections.Counter()
    inside: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            continue
        frames = [
            _DIRECTORIES.sub(r"(\1)", _LINE_NUMBER.sub(")", frame)) for frame in stack.split(";")
        ]
        if not frames:
            continue
        weight = int(samples)
        total += weight
        own[frames[-1]] += weight
        for frame in set(frames):
            inside[frame] += weight

    def shares(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(n / total, 3)) for frame, n in counter.most_common(count)]

    return {"samples": total, "self": shares(own), "inclusive": shares(inside)}
