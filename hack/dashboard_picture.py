"""Draw the chart's Grafana dashboard from a real Prometheus' answers (Grafana's server is
not one the project may use): run the dashboard's test (tests/integration/test_dashboard.py),
which saves every panel query's answer over its short job into
docs/img/dashboard-answers.json, then plot one subplot per panel, laid out as the dashboard
lays them, into docs/img/dashboard.png.

    flock /tmp/k8s-rdzv-heavy.lock .venv/bin/python -m hack.dashboard_picture
    .venv/bin/python -m hack.dashboard_picture --draw-only   # from the answers saved
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from devkit import dashboard
from devkit.paths import REPO

PICTURE = REPO / "docs" / "img" / "dashboard.png"
ANSWERS = REPO / "docs" / "img" / "dashboard-answers.json"
TEST = "tests/integration/test_dashboard.py"


def record(answers: Path, hold: float) -> None:
    """Run the test with its answers saved to ``answers``, ``hold`` seconds after its job."""
    env = {
        **os.environ,
        "K8S_RDZV_DASHBOARD_ANSWERS": str(answers),
        "K8S_RDZV_DASHBOARD_HOLD": str(hold),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST]
    subprocess.run(command, cwd=REPO, env=env, check=True)


def draw(answers: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = dashboard.load()
    panels = [
        panel
        for panel in sorted(board["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
        if panel["type"] != "row"
    ]
    columns = 2
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(12, 3 * rows), squeeze=False)
    start = answers["start"]
    for axis, panel in zip(axes.flat[: len(panels)], panels, strict=True):
        bars = panel["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars"
        for target in (s for s in answers["series"] if s["panel"] == panel["title"]):
            by_label = "{{" in target["legend"]
            for series in target["result"]:
                if by_label and not any(float(v) for _, v in series["values"]):
                    continue  # a cause that never happened: eleven flat lines say nothing
                times = [float(t) - start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                name = dashboard.legend(target["legend"], series["metric"])
                axis.plot(times, values, label=name, drawstyle="steps-post" if bars else "default")
        axis.set_title(panel["title"], fontsize=10)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        axis.set_ylabel({"s": "seconds", "reqps": "requests/s"}.get(unit, ""))
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8, loc="upper left")
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis in axes[-1]:
        axis.set_xlabel("seconds since Prometheus started (its first scrape: about 5 s)")
    figure.suptitle(
        "The k8s-rendezvous dashboard's queries, answered by Prometheus during and after a "
        "short job\n"
        f"(1 s scrapes, rates over {dashboard.RATE_INTERVAL}; causes and budgets that stayed "
        "at zero are left out)",
        fontsize=11,
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--answers", type=Path, default=ANSWERS, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=PICTURE, help="default: %(default)s")
    parser.add_argument("--draw-only", action="store_true", help="run nothing, draw --answers")
    parser.add_argument(
        "--hold",
        type=float,
        default=75,
        help="seconds of scrapes after the job: the rates' windows (1m) end (default: %(default)s)",
    )
    args = parser.parse_args()
    args.answers = args.answers.resolve()  # the test runs from the repository's root
    if not args.draw_only:
        record(args.answers, args.hold)
    draw(json.loads(args.answers.read_text()), args.out)
    print(f"wrote {args.out} from {args.answers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
