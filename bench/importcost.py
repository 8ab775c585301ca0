"""What our torchrun plugin adds to ``import torch.distributed.elastic.rendezvous``.

torch loads every ``torchrun.handlers`` entry point when that package is imported, so our
plugin's cost is paid by every torchrun on a machine where k8s-rendezvous is installed.
Fresh interpreters, A and B interleaved:

* direct: with our entry point hidden from that import, the time of doing afterwards
  exactly what torch's ``_register_out_of_tree_handlers`` does for it (``ep.load()``,
  call it, register the creator), cold. ``python -X importtime`` cannot show this:
  ``EntryPoint.load()`` imports through ``importlib.import_module``, which bypasses the
  interpreter's import-time report.
* A/B wall clock: the whole import with our entry point visible (A) and hidden (B, by a
  filter over ``importlib.metadata.entry_points``; A runs the same filter, passing all).
  It includes everything but is noisy on a busy 2-core machine (torch's own import takes
  seconds), so the target is checked against the direct figure.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.metadata as metadata, json, sys, time
hide = sys.argv[1] == "hide"
original = metadata.entry_points
def entry_points(**selection):
    found = original(**selection)
    if selection.get("group") == "torchrun.handlers":
        return metadata.EntryPoints(e for e in found if not (hide and e.name == "kubernetes"))
    return found
metadata.entry_points = entry_points
started = time.perf_counter()
import torch.distributed.elastic.rendezvous
took = time.perf_counter() - started
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
answer = {"seconds": took, "registered": "kubernetes" in registry._registry}
if hide:
    assert "k8s_rendezvous" not in sys.modules
    started = time.perf_counter()
    for ep in original(group="torchrun.handlers"):
        if ep.name == "kubernetes":
            registry.register(ep.name, ep.load()())
    answer["plugin_seconds"] = time.perf_counter() - started
    answer["modules"] = sorted(m for m in sys.modules if m.startswith("k8s_rendezvous"))
print(json.dumps(answer))
"""


def measure(repetitions: int) -> dict[str, Any]:
    shown: list[float] = []
    hidden: list[float] = []
    plugin: list[float] = []
    registered = True
    modules: list[str] = []
    for index in range(2 * repetitions):
        hide = index % 2 == 1
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, "hide" if hide else "show"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
            check=True,
        )
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        if hide:
            hidden.append(answer["seconds"])
            plugin.append(answer["plugin_seconds"])
            modules = answer["modules"]
        else:
            shown.append(answer["seconds"])
            registered = registered and bool(answer["registered"])
    return {
        "repetitions": repetitions,
        "plugin_registered": registered,
        "plugin_modules_loaded": modules,
        "plugin_load_ms": {
            "median": round(statistics.median(plugin) * 1000, 3),
            "min": round(min(plugin) * 1000, 3),
            "max": round(max(plugin) * 1000, 3),
        },
        "import_rendezvous_ms_with_plugin": round(statistics.median(shown) * 1000, 1),
        "import_rendezvous_ms_without_plugin": round(statistics.median(hidden) * 1000, 1),
        "ab_difference_ms": round((statistics.median(shown) - statistics.median(hidden)) * 1000, 1),
        "ab_range_ms": {
            "with": [round(min(shown) * 1000, 1), round(max(shown) * 1000, 1)],
            "without": [round(min(hidden) * 1000, 1), round(max(hidden) * 1000, 1)],
        },
    }


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 5), indent=1))
