"""Targets, the cost fit, the markdown table and the plots from a results dict."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Json = dict[str, Any]

BACKEND_STYLE = {
    "ours": ("tab:blue", "o", "k8s-rendezvous (ours)"),
    "c10d": ("tab:red", "s", "torch c10d"),
    "etcd-v2": ("tab:green", "^", "torch etcd-v2"),
}


def fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(N): 1 means O(N), 2 means O(N^2)."""
    points = [(x, y) for x, y in points if x > 0 and y > 0]
    if len(points) < 2:
        return None
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def cost_table(results: Json) -> list[Json]:
    """Per N: median API requests and watch bytes per round (ours), with ratios."""
    rows = []
    per_n: dict[int, list[Json]] = {int(n): list(c) for n, c in (results.get("cost") or {}).items()}
    scale = results.get("scale") or {}
    scale_costs = [r["cost"] for r in scale.get("runs", []) if r.get("cost")]
    if scale_costs:
        per_n.setdefault(int(scale["nodes"]), []).extend(scale_costs)
    for count in sorted(per_n):
        costs = per_n[count]
        if not costs:
            continue
        requests = _median([c["requests_rendezvous"] for c in costs])
        events = _median([c["watch_events"] for c in costs])
        size = _median([c["watch_bytes"] for c in costs])
        by: dict[str, float] = {}
        for key in {k for c in costs for k in c["requests_rendezvous_by"]}:
            by[key] = _median([c["requests_rendezvous_by"].get(key, 0.0) for c in costs])
        attempts = [c["attempts_per_patch"] for c in costs if c.get("attempts_per_patch")]
        patch_seconds = [c["patch_mean_seconds"] for c in costs if c.get("patch_mean_seconds")]
        rows.append(
            {
                "nodes": count,
                "attempts_per_patch": _median(attempts) if attempts else None,
                "patch_mean_seconds": _median(patch_seconds) if patch_seconds else None,
                "requests": requests,
                "requests_per_node": requests / count,
                "requests_by": dict(sorted(by.items())),
                "watch_events": events,
                "watch_bytes": size,
                "watch_bytes_per_node": size / count,
                "watch_bytes_per_node_squared": size / count**2,
                "all_requests": _median([c["requests_total"] for c in costs]),
            }
        )
    return rows


def finish(results: Json) -> None:
    """Add the cost analysis and the target verdicts."""
    rows = cost_table(results)
    results["cost_analysis"] = {
        "rows": rows,
        "requests_slope": fit_slope([(r["nodes"], r["requests"]) for r in rows]),
        "watch_bytes_slope": fit_slope([(r["nodes"], r["watch_bytes"]) for r in rows]),
        "watch_events_slope": fit_slope([(r["nodes"], r["watch_events"]) for r in rows]),
    }
    results["targets"] = targets(results, rows)


def _verdict(target: Json) -> Json:
    value, limit = target.get("value"), target.get("limit")
    if value is None or limit is None:
        target["met"] = None
        target["verdict"] = f"not measured ({target.get('note', 'no data')})"
    else:
        target["met"] = bool(value <= limit)
        target["verdict"] = (
            f"{'met' if target['met'] else 'MISSED'}: {value:.4g} {target['unit']} "
            f"(limit {limit:.4g} {target['unit']})"
            + (f"; {target['note']}" if target.get("note") else "")
        )
    return target


def targets(results: Json, rows: list[Json]) -> list[Json]:
    found: list[Json] = []
    seal = results.get("seal_latency") or {}
    for count in ("8", "32"):
        ours = (seal.get("ours") or {}).get(count, {}).get("median")
        c10d = (seal.get("c10d") or {}).get(count, {}).get("median")
        found.append(
            {
                "name": f"seal latency N={count} <= 1/10 of c10d",
                "value": ours,
                "limit": c10d / 10 if c10d else None,
                "unit": "s",
                "note": f"c10d median {c10d:.3f} s" if c10d else "N not run in this mode",
            }
        )
    failure = (results.get("failure_to_new_world") or {}).get("ours") or {}
    found.append(
        {
            "name": "failure to new world <= 2 s after the pod deletion",
            "value": (failure.get("from_pod_deletion") or {}).get("median"),
            "limit": 2.0,
            "unit": "s",
            "note": f"max {(failure.get('from_pod_deletion') or {}).get('max')}",
        }
    )
    scaleup = (results.get("scaleup_notice") or {}).get("ours") or {}
    found.append(
        {
            "name": "scale-up notice <= 0.3 s",
            "value": scaleup.get("median"),
            "limit": 0.3,
            "unit": "s",
            "note": f"max {scaleup.get('max')}",
        }
    )
    scale = results.get("scale")
    nodes = (scale or {}).get("nodes")
    found.append(
        {
            "name": f"{nodes or 1000} nodes sealed and released <= 10 s",
            "value": ((scale or {}).get("seal") or {}).get("median"),
            "limit": 10.0,
            "unit": "s",
            "note": _partial_note(scale, nodes == 1000, "fewer than 1000 nodes"),
        }
    )
    if rows:
        worst = max(rows, key=lambda r: r["requests_per_node"])
        found.append(
            {
                "name": "API requests per round <= 3N",
                "value": worst["requests_per_node"],
                "limit": 3.0,
                "unit": "x N",
                "note": f"worst at N={worst['nodes']}",
            }
        )
    footprint = results.get("footprint") or {}
    live = footprint.get("live_rendezvous")
    found.append(
        {
            "name": f"operator RSS with {live or 200} live rendezvous <= 150 MB",
            "value": footprint.get("operator_rss_live_mb"),
            "limit": 150.0,
            "unit": "MB",
            "note": _partial_note(live, live == 200, "fewer than 200"),
        }
    )
    plugin = ((results.get("import") or {}).get("plugin_load_ms") or {}).get("median")
    found.append(
        {
            "name": "plugin adds <= 50 ms to importing torch's rendezvous",
            "value": plugin,
            "limit": 50.0,
            "unit": "ms",
            "note": _partial_note(results.get("import"), True, "")
            or f"A/B wall-clock difference {results['import'].get('ab_difference_ms')} ms",
        }
    )
    return [_verdict(t) for t in found]


def _partial_note(measured: object, in_full: bool, short_of_full: str) -> str:
    if measured is None:
        return "section not run"
    return "" if in_full else f"quick mode: {short_of_full}"


# -- markdown -------------------------------------------------------------------------------


def _cell(stats: Json | None, digits: int = 3) -> str:
    if not stats:
        return "-"
    if stats.get("skipped"):
        return "skipped"
    if stats.get("median") is None:
        return f"failed ({stats.get('failures', '?')})"
    text = f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"
    if stats.get("failures"):
        text += f", {stats['failures']} failed"
    return text


Row = Json
Column = tuple[str, Callable[[Row], str]]
"""A table's column: its header, and its cell from a row."""


def _table(columns: Sequence[Column], rows: Iterable[Row]) -> list[str]:
    """A markdown table: one line per row, each cell from its column."""
    return [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows),
    ]


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _key(key: str, digits: int | None = None) -> Callable[[Row], str]:
    """A cell showing ``row[key]``, as it is or with ``digits`` decimals."""
    if digits is None:
        return lambda row: f"{row[key]}"
    return lambda row: _number(row.get(key), digits)


def _stats(key: str | None = None) -> Callable[[Row], str]:
    """A cell showing the statistics in ``row[key]`` (the row itself without a key)."""
    return lambda row: _cell(row if key is None else row.get(key))


def _backend(row: Row) -> str:
    return str(BACKEND_STYLE[row["backend"]][2])


def _seal_rows(seal: Json, backends: Sequence[str], sizes: Sequence[int]) -> list[Row]:
    rows = []
    for count in sizes:
        ours = seal.get("ours", {}).get(str(count)) or {}
        c10d = (seal.get("c10d", {}).get(str(count)) or {}).get("median")
        rows.append(
            {
                "nodes": count,
                **{backend: seal[backend].get(str(count)) for backend in backends},
                "ratio": f"{c10d / ours['median']:.1f}x" if ours.get("median") and c10d else "-",
                "busy": ours.get("machine_busy_share"),
            }
        )
    return rows


def _seal_cpu_rows(seal: Json, backends: Sequence[str], sizes: Sequence[int]) -> list[Row]:
    rows = []
    for count in sizes:
        for backend in backends:
            stats = seal[backend].get(str(count)) or {}
            by_process = stats.get("cpu_seconds_by_process") or {}
            if by_process:
                rows.append(
                    {
                        "nodes": count,
                        "backend": backend,
                        "busy": (stats.get("machine_busy_cpu_seconds") or {}).get("median") or 0.0,
                        "by_process": ", ".join(
                            f"{name} {(v or {}).get('median') or 0:.2f}"
                            for name, v in by_process.items()
                        ),
                    }
                )
    return rows


def _failure_note(row: Row) -> str:
    if row["name"] == "ours" and row.get("from_pod_deletion"):
        return (
            f"from pod deletion {_cell(row['from_pod_deletion'])}; all survivors "
            f"noticed after {_cell(row.get('notice'))}"
        )
    return ""


COST_COLUMNS: tuple[Column, ...] = (
    ("N", _key("nodes")),
    ("requests", _key("requests", 0)),
    ("per N", _key("requests_per_node", 2)),
    ("watch events", _key("watch_events", 0)),
    ("watch bytes", _key("watch_bytes", 0)),
    ("bytes / N", _key("watch_bytes_per_node", 0)),
    ("bytes / N^2", _key("watch_bytes_per_node_squared", 1)),
    ("etcd attempts per PATCH", _key("attempts_per_patch", 2)),
    ("mean PATCH s", _key("patch_mean_seconds", 3)),
)
FAILURE_COLUMNS: tuple[Column, ...] = (
    ("configuration", _key("name")),
    ("from the kill", _stats()),
    ("notes", _failure_note),
)
SCALEUP_COLUMNS: tuple[Column, ...] = (
    ("backend", _backend),
    ("every running node sees num_nodes_waiting() > 0", _stats()),
    ("first node", _stats("first_node")),
)
SEAL_CPU_COLUMNS: tuple[Column, ...] = (
    ("N", _key("nodes")),
    ("backend", _backend),
    ("machine busy", _key("busy", 2)),
    ("by process", _key("by_process")),
)
PROCESS_COLUMNS: tuple[Column, ...] = (
    ("process", _key("name")),
    ("CPU seconds", _key("cpu_seconds")),
    ("mean CPU %", _key("mean_cpu_percent")),
    ("peak CPU %", _key("peak_cpu_percent")),
    ("peak RSS MB", _key("peak_rss_mb")),
)


def _header(results: Json) -> list[str]:
    meta = results["meta"]
    return [
        f"# Benchmark results ({meta['mode']} mode)",
        "",
        f"`{meta['command']}` on {meta['machine']['cpus']} CPUs, started {meta['started']}, "
        f"took {meta.get('duration_s', 0) / 60:.1f} min. Medians with (min-max) over "
        "repetitions, in seconds unless stated. See bench/README.md for the method.",
        "",
        *(
            [
                "Reverse DNS: **numeric**. The simulated nodes of every backend had "
                "`bench/numeric_getnameinfo.c` preloaded: TCPStore's reverse lookups never "
                "reached this machine's resolver, which drops bursts of them (see "
                "bench/FINDINGS.md).",
                "",
            ]
            if meta.get("reverse_dns") == "numeric"
            else []
        ),
        "## Targets",
        "",
        *_table(
            (("target", _key("name")), ("verdict", _key("verdict"))), results.get("targets", [])
        ),
    ]


def _seal_section(results: Json) -> list[str]:
    seal = results.get("seal_latency") or {}
    backends = [b for b in ("ours", "c10d", "etcd-v2") if b in seal]
    sizes = sorted({int(n) for b in backends for n in seal[b]})
    seal_columns: list[Column] = [
        ("N", _key("nodes")),
        *((BACKEND_STYLE[b][2], _stats(b)) for b in backends),
        ("c10d / ours", _key("ratio")),
        ("machine CPU busy, ours", lambda row: _cell(row["busy"], digits=2)),
    ]
    lines = [
        "## 1. Seal latency (min = max = N; last call to last return)",
        "",
        *_table(seal_columns, _seal_rows(seal, backends, sizes)),
        "",
        "Machine CPU busy: the share of all cores busy from the go to the last return "
        "(`/proc/stat`; 1.00 = every core busy the whole time), on a machine running "
        "nothing but the benchmark.",
    ]
    cpu_rows = _seal_cpu_rows(seal, backends, sizes)
    if cpu_rows:
        lines += [
            "",
            "CPU seconds from the go to the last return (medians): the whole machine, and by "
            "process.",
            "",
            *_table(SEAL_CPU_COLUMNS, cpu_rows),
        ]
    return lines


def _failure_section(results: Json) -> list[str]:
    failure = results.get("failure_to_new_world") or {}
    lines = [
        "## 2. Failure to new world (8 nodes, min 7; one killed)",
        "",
        *_table(
            FAILURE_COLUMNS, ({**(stats or {}), "name": name} for name, stats in failure.items())
        ),
    ]
    ours_requests = (failure.get("ours") or {}).get("requests")
    if ours_requests and ours_requests.get("median") is not None:
        by = (failure["ours"].get("requests_by") or [{}])[0]
        lines += [
            "",
            f"API requests for the re-formed round of ours (7 survivors; from the kill to 1 s "
            f"after the last return): {_cell(ours_requests, digits=0)}; the first repetition "
            "by verb and resource: "
            + ", ".join(f"{key} {value:.0f}" for key, value in by.items())
            + ".",
        ]
    return lines


def _scaleup_section(results: Json) -> list[str]:
    scaleup = results.get("scaleup_notice") or {}
    return [
        "## 3. Scale-up notice (4 running, maxNodes 5; a fifth calls next_rendezvous())",
        "",
        *_table(
            SCALEUP_COLUMNS,
            ({**(stats or {}), "backend": backend} for backend, stats in scaleup.items()),
        ),
    ]


def _cost_section(results: Json) -> list[str]:
    analysis = results.get("cost_analysis") or {}

    def slope(key: str) -> str:
        value = analysis.get(key)
        return f"{value:.2f}" if isinstance(value, float) else "-"

    lines = [
        "## 4. Cost per round (ours, API server /metrics)",
        "",
        *_table(COST_COLUMNS, analysis.get("rows", [])),
        "",
        f"Log-log slopes against N: requests {slope('requests_slope')}, watch events "
        f"{slope('watch_events_slope')}, watch bytes {slope('watch_bytes_slope')} "
        "(1 = O(N), 2 = O(N^2)).",
    ]
    rows = analysis.get("rows") or []
    if rows:
        last = rows[-1]
        by = ", ".join(f"{k} {v:.0f}" for k, v in last["requests_by"].items())
        lines += ["", f"Requests at N={last['nodes']} by verb and resource: {by}."]
    return lines


def _scale_section(results: Json) -> list[str]:
    scale = results["scale"]
    runs = scale.get("runs") or []
    processes = (runs[0].get("processes") or {}) if runs else {}
    together = scale.get("concurrent") or {}
    return [
        f"## 5. Scale: {scale['nodes']} nodes, min = max = {scale['nodes']}",
        "",
        f"Sealed and released (last call to last return): {_cell(scale.get('seal'))}; "
        f"first call to last return: {_cell(scale.get('first_call_to_last_return'))}.",
        "",
        *_table(PROCESS_COLUMNS, ({**usage, "name": name} for name, usage in processes.items())),
        "",
        f"{together.get('rendezvous')} concurrent rendezvous of {together.get('nodes_each')} "
        "nodes: per-rendezvous seal latency median "
        f"{_cell(together.get('per_rendezvous_median'))}, "
        f"worst {_cell(together.get('per_rendezvous_max'))}; all sealed "
        f"{_cell(together.get('all_sealed'))}.",
    ]


def _footprint_section(results: Json) -> list[str]:
    footprint = results.get("footprint") or {}
    plugin = results.get("import") or {}
    load = plugin.get("plugin_load_ms") or {}
    lines = [
        "## 6. Footprint",
        "",
        f"- Operator RSS idle: {footprint.get('operator_rss_idle_mb')} MB; with "
        f"{footprint.get('live_rendezvous')} live rendezvous of {footprint.get('live_nodes_each')} "
        f"nodes: {footprint.get('operator_rss_live_mb')} MB; at the end of the run: "
        f"{footprint.get('operator_rss_end_mb')} MB.",
        f"- Plugin load (cold, what torch does for our entry point): "
        f"{load.get('median')} ms median ({load.get('min')}-{load.get('max')}); `import "
        f"torch.distributed.elastic.rendezvous` {plugin.get('import_rendezvous_ms_with_plugin')} "
        f"ms with it, {plugin.get('import_rendezvous_ms_without_plugin')} ms without (A/B "
        f"medians, {plugin.get('repetitions')} runs each; the difference, "
        f"{plugin.get('ab_difference_ms')} ms, is dominated by noise).",
    ]
    probe = results.get("tcpstore_connect") or []
    if probe:
        shown = "; ".join(
            f"{p['clients']} clients: median {p.get('median')} s, max {p.get('max')} s"
            for p in probe
        )
        lines += [
            "",
            "Probe, no Kubernetes involved: TCPStore clients connecting at once to one "
            f"TCPStore server (what ours does in every round): {shown}.",
        ]
    return lines


def _recovery_section(results: Json) -> list[str]:
    from bench import recovery

    return recovery.markdown(results["recovery"])


# -- plots ------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)


def _draw_seal(results: Json, path: Path) -> None:
    """Seal latency against N, per backend (and the scale section's point)."""
    plt = _pyplot()
    seal = results.get("seal_latency") or {}
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for backend, per_size in seal.items():
        color, marker, label = BACKEND_STYLE[backend]
        points = sorted((int(n), s) for n, s in per_size.items() if s.get("median") is not None)
        if not points:
            continue
        xs = [n for n, _ in points]
        ys = [s["median"] for _, s in points]
        low = [s["median"] - s["min"] for _, s in points]
        high = [s["max"] - s["median"] for _, s in points]
        axis.errorbar(xs, ys, yerr=[low, high], color=color, marker=marker, label=label, capsize=3)
    scale = results.get("scale") or {}
    if (scale.get("seal") or {}).get("median") is not None:
        stats = scale["seal"]
        axis.errorbar(
            [scale["nodes"]],
            [stats["median"]],
            yerr=[[stats["median"] - stats["min"]], [stats["max"] - stats["median"]]],
            color="tab:blue",
            marker="D",
            linestyle="none",
            capsize=3,
            label=f"ours, {scale['nodes']} nodes (section 5)",
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("nodes N (min = max = N)")
    axis.set_ylabel("last call to last return (s)")
    axis.set_title("Seal latency: median, min-max")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    _save(figure, path)


def _draw_failure_scaleup(results: Json, path: Path) -> None:
    """Failure to new world and scale-up notice, side by side."""
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for axis, data, title in (
        (left, results.get("failure_to_new_world") or {}, "Failure to new world (8 nodes)"),
        (right, results.get("scaleup_notice") or {}, "Scale-up notice (4 + 1 nodes)"),
    ):
        names = [n for n, s in data.items() if s.get("median") is not None]
        medians = [data[n]["median"] for n in names]
        errors = [
            [data[n]["median"] - data[n]["min"] for n in names],
            [data[n]["max"] - data[n]["median"] for n in names],
        ]
        colors = [BACKEND_STYLE[n.split(" ")[0]][0] for n in names]
        axis.bar(range(len(names)), medians, yerr=errors, color=colors, capsize=4)
        axis.set_xticks(range(len(names)))
        axis.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=8)
        axis.set_yscale("log")
        axis.set_ylabel("seconds (median, min-max)")
        axis.set_title(title)
        for position, value in enumerate(medians):
            axis.annotate(f"{value:.2f} s", (position, value), ha="center", va="bottom", fontsize=8)
    _save(figure, path)


def _draw_cost(results: Json, path: Path) -> None:
    """Requests and watch bytes per round against N."""
    plt = _pyplot()
    analysis = results.get("cost_analysis") or {}
    rows = analysis.get("rows") or []
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if rows:
        xs = [r["nodes"] for r in rows]
        for axis, key, reference, label, slope_key in (
            (left, "requests", 3.0, "API requests per round", "requests_slope"),
            (right, "watch_bytes", None, "bytes pushed to watchers per round", "watch_bytes_slope"),
        ):
            ys = [r[key] for r in rows]
            slope = analysis.get(slope_key)
            axis.plot(
                xs,
                ys,
                "o-",
                color="tab:blue",
                label=f"ours (log-log slope {slope:.2f})" if slope else "ours",
            )
            if reference:
                axis.plot(xs, [reference * x for x in xs], "--", color="gray", label="target 3N")
            else:
                first = rows[0]
                axis.plot(
                    xs,
                    [first["watch_bytes"] * (x / first["nodes"]) ** 2 for x in xs],
                    "--",
                    color="gray",
                    label="O(N^2) through the first point",
                )
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.set_xlabel("nodes N")
            axis.set_title(label)
            axis.grid(True, which="both", alpha=0.3)
            axis.legend()
    _save(figure, path)


def _draw_scale(results: Json, path: Path) -> None:
    """CPU and RSS by process during the scale section's round."""
    plt = _pyplot()
    runs = (results.get("scale") or {}).get("runs") or []
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if runs and runs[0].get("processes"):
        for name, usage in runs[0]["processes"].items():
            series = usage["series"]
            left.plot([s[0] for s in series], [s[1] for s in series], label=name)
            right.plot([s[0] for s in series], [s[2] for s in series], label=name)
    left.set_title(f"CPU during the {(results.get('scale') or {}).get('nodes')}-node round")
    left.set_xlabel("s since sampling began (nodes released ~0.5 s in)")
    left.set_ylabel("CPU % (100 = one core)")
    right.set_title("RSS")
    right.set_xlabel("s since sampling began (nodes released ~0.5 s in)")
    right.set_ylabel("MB")
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    _save(figure, path)


def _draw_recovery(results: Json, path: Path) -> None:
    from bench import recovery

    recovery.plot(results["recovery"], path)


def plots(results: Json, out: Path) -> None:
    """Each plot of :data:`SECTIONS` the run has data for, into ``out``."""
    for section in _shown(results):
        if section.plot is not None:
            section.plot.draw(results, out / section.plot.name)


# -- the report ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plot:
    name: str
    draw: Callable[[Json, Path], None]


@dataclasses.dataclass(frozen=True)
class Section:
    """A part of the report: shown when the run has any of ``shown_by`` in its results."""

    shown_by: tuple[str, ...]
    render: Callable[[Json], list[str]]
    plot: Plot | None = None


SECTIONS: tuple[Section, ...] = (
    Section(("seal_latency", "scale"), _seal_section, Plot("seal_latency.png", _draw_seal)),
    Section(
        ("failure_to_new_world", "scaleup_notice"),
        _failure_section,
        Plot("failure_scaleup.png", _draw_failure_scaleup),
    ),
    Section(("failure_to_new_world", "scaleup_notice"), _scaleup_section),
    Section(("cost",), _cost_section, Plot("cost.png", _draw_cost)),
    Section(("scale",), _scale_section, Plot("scale.png", _draw_scale)),
    Section(("footprint", "import", "tcpstore_connect"), _footprint_section),
    Section(("recovery",), _recovery_section, Plot("recovery_timeline.png", _draw_recovery)),
)
"""The report's sections in order; a run of a few sections shows and draws only theirs."""


def _shown(results: Json) -> list[Section]:
    return [s for s in SECTIONS if any(results.get(key) for key in s.shown_by)]


def markdown(results: Json) -> str:
    lines = _header(results)
    for section in _shown(results):
        lines += ["", *section.render(results)]
    for backend, why in (results.get("absent") or {}).items():
        lines += ["", f"**{backend} absent:** {why}"]
    lines += ["", f"Plots: {', '.join(_plot_names(results))}.", ""]
    return "\n".join(lines)


def _plot_names(results: Json) -> list[str]:
    return [section.plot.name for section in _shown(results) if section.plot is not None]


if __name__ == "__main__":
    import json
    import sys

    # python -m bench.report DIR: redo the analysis, results.md and plots of a run's JSON.
    directory = Path(sys.argv[1])
    data = json.loads((directory / "results.json").read_text())
    finish(data)
    (directory / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (directory / "results.md").write_text(markdown(data))
    plots(data, directory)
