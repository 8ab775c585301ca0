"""A goodput run's report: the tables of bench/results/goodput*/results.md and the timeline
of each configuration's training (timeline.png), from its results.json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bench.fault_schedule import FAULTS
from bench.goodput_measures import FULL, Json


def write(meta: Json, results: Sequence[Json], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    trained = any("error" not in result for result in results)
    if trained:
        plot(results, out / "timeline.png")
    (out / "results.md").write_text(
        f"# Goodput under a fault schedule, on real nodes\n\n{meta['date']}, `{meta['command']}` "
        f"({meta['seconds']:.0f} s); how it is measured: bench/goodput.py.\n\n"
        + table(results)
        + ("\n\n![timeline](timeline.png)\n" if trained else "\n")
    )
    print(table(results))


def table(results: Sequence[Json]) -> str:
    lines = [
        "| configuration | goodput | steps | pace (steps/s) | faults | rounds | violations "
        "| left behind | Leases at the end (pod names) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['config']} | error: {result['error'][:200]} | | | | | | | |")
            continue
        leases = result.get("leases")
        lines.append(
            f"| {result['config']} | {result['goodput']:.1%} | {result['steps']} | "
            f"{result['pace']} | {len(result['faults'])} | {result.get('rounds') or '-'} | "
            f"{len(result['violations'])} | "
            f"{sum(len(found) for found in result.get('leaks', {}).values())} | "
            + (f"{leases['left']} ({leases['pod_names']}) |" if leases else "- |")
        )
    lines += [
        "",
        "Per fault kind, seconds (median / max): from the fault to the round sealed (ours); "
        "without training until the full world trains again (the pauses, not what a "
        "smaller world trained between them); from the fault to the end of its longest "
        "pause (the stall) and to the full world training again; steps lost and rank churn "
        "(median).",
        "",
        "| fault | configuration | n | sealed | without training | stall | full world "
        "| steps lost | rank churn |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(row: Json, name: str) -> str:
        value = row[name]
        return "-" if value["median"] is None else f"{value['median']} / {value['max']}"

    shown = [r for r in results if "error" not in r]
    for kind in sorted({k for r in shown for k in r["by_kind"]}):
        for result in shown:
            row = result["by_kind"].get(kind)
            if row is None:
                continue
            full = spread(row, "full_world")
            if row["unresolved"]:
                full += f" ({row['unresolved']} never)"
            lines.append(
                f"| {kind} | {result['config']} | {row['count']} | {spread(row, 'sealed')} | "
                f"{spread(row, 'idle')} | {spread(row, 'stall')} | {full} | "
                f"{row['steps_lost']['median']} | {row['rank_churn']['median']} |"
            )
    return "\n".join(lines)


def plot(results: Sequence[Json], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shown = [r for r in results if "error" not in r]
    height = 2.6 * len(shown) + 0.5
    figure, axes = plt.subplots(len(shown), 1, figsize=(11, height), squeeze=False)
    colors = dict(zip(FAULTS, plt.get_cmap("tab10").colors, strict=False))  # type: ignore[attr-defined]
    for axis, result in zip(axes[:, 0], shown, strict=True):
        total = 0.0
        xs, ys = [], []
        for at, size in result["timeline"]:
            total += size / FULL
            xs.append(at / 60)
            ys.append(total)
        axis.plot(xs, ys, color="black", linewidth=1)
        for fault in result["faults"]:
            kind = fault["kind"] if fault["kind"] in FAULTS else "pod"
            axis.axvline((fault["at"] - result["began"]) / 60, color=colors[kind], linewidth=1)
        axis.set_title(f"{result['config']}: goodput {result['goodput']:.1%}", fontsize=10)
        axis.set_ylabel("steps (full-world)")
    axes[-1, 0].set_xlabel("minutes")
    handles = [Line2D([], [], color=colors[kind], label=kind) for kind in FAULTS]
    figure.legend(handles=handles, loc="upper center", ncol=len(FAULTS), fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))  # room for the legend
    figure.savefig(path, dpi=100)
    plt.close(figure)
