"""Section "recovery": from a node's loss, or a node's arrival, to training resumed.

A real elastic job, as the README's demo runs it: ``torchrun`` on 4 local nodes of 2 gloo
workers each (``--nnodes=3:4``) running examples/elastic_train.py, every node a process
tree of its own at its own loopback address, under :mod:`bench.probes.agent` (torch's
launcher with its agent's steps recorded). Each trial:

1. starts 4 nodes and waits until the world of 8 has trained a few steps;
2. **kill**: SIGKILLs the last node's process tree (for ours, then deletes its Pod, grace 0,
   which is what the kubelet reports for a dead pod) and waits for the 6 survivors to
   complete a step in the new world;
3. **add**: starts a fifth node (for ours, its Pod was made Running before: scheduling and
   pulling an image are no part of it) and waits for a step in the world of 8.

Each event is broken down from the agents' records and the workers' progress lines, as
the time after the event by which the last node involved (the critical path) had:
noticed the change (its agent began restarting the workers), stopped its workers, got
its next round, started its workers; and the last worker had imported torch, joined the
process group, and completed a training step in the new world.

Ours runs against the real control plane and operator the benchmark starts; torch's c10d
runs on the same machine in the same run, with its defaults and tuned (keep-alive 1 s x 4,
last call 1 s: the smallest setting that does not expire healthy nodes).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.cluster import Cluster
from devkit.processes import (
    LocalProcess,
    container_environment,
    json_lines,
    local_environment,
    wait_world,
)

Json = dict[str, Any]
Log = Callable[[str], None]

REPO = Path(__file__).resolve().parents[1]
RESTARTING_SCRIPT = REPO / "examples" / "elastic_train.py"
IN_PLACE_SCRIPT = REPO / "examples" / "elastic_train_in_place.py"
NPROC_PER_NODE = 2
NODES = 4
MIN_NODES = 3
STEP_SECONDS = 0.1
FORM_TIMEOUT = 240.0
"""Bound on every wait for a world: c10d with its defaults takes about 45 s to re-form."""

C10D_TUNED = "keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=1"
C10D_OWN_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Every c10d variant runs with a new store per round, as ours does. With torch 2.15's
default, rank 0's agent serves one store for every round and the workers use it without
a per-round prefix, so a new world's gloo group reads the previous world's peer addresses
(same keys), connects to ports that are closed and fails (``Gloo connectFullMesh failed
... Connection refused``), round after round: no world of 6 within 240 s after a node was
killed (bench/results/recovery/README.md)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    backend: str
    """``kubernetes`` (ours) or ``c10d``."""
    rdzv_conf: str = ""
    label: str = ""
    script: Path = RESTARTING_SCRIPT
    warm: bool = False
    """Workers forked from the node's zygote (``-m k8s_rendezvous.warm``, ``warm_start=1``)."""

    @property
    def in_place(self) -> bool:
        return self.script == IN_PLACE_SCRIPT


VARIANTS: dict[str, Variant] = {
    "ours": Variant("ours", "kubernetes", label="ours (workers restarted)"),
    "ours-warm": Variant(
        "ours-warm",
        "kubernetes",
        "warm_start=1",
        "ours, workers restarted warm (forked from a zygote)",
        warm=True,
    ),
    "ours-in-place": Variant(
        "ours-in-place", "kubernetes", "in_place=1", "ours, in place", IN_PLACE_SCRIPT
    ),
    "c10d-defaults": Variant("c10d-defaults", "c10d", label="c10d, defaults (store per round)"),
    "c10d-tuned": Variant(
        "c10d-tuned",
        "c10d",
        C10D_TUNED,
        "c10d, keep-alive 1 s x 4, last call 1 s (store per round)",
    ),
}

STAGES: tuple[tuple[str, str], ...] = (
    ("joined", "newcomer's agent up, joining"),
    ("noticed", "change noticed"),
    ("stopped", "workers stopped"),
    ("reformed", "round re-formed"),
    ("started", "workers started"),
    ("imported", "torch imported"),
    ("initialized", "init_process_group done"),
    ("reconfigured", "group reconfigured in place"),
    ("first_step", "first step completed"),
)
"""The stages, in order: each is when the last node (or worker) on the critical path had
done it, in seconds after the event. For a node added, first its torchrun starts and its
agent calls ``next_rendezvous()``. On the restart path: the agent began restarting its
workers, had stopped them, had its next round (``next_rendezvous()`` and torch's rank
assignment), had started the new workers; the new workers had imported torch (interpreter
start included), joined the process group; every rank had completed a step in the new
world. In place: a survivor's collective failed (kill) or its handler began re-joining
(add); the handler had published the re-formed round to its workers (a newcomer: its
``next_rendezvous()`` returned); a newcomer's workers started, imported torch and created
their group; every worker had reconfigured the group; every rank had completed a step."""


class Node(LocalProcess):
    """One node: a ``torchrun`` process tree under :mod:`bench.probes.agent` (for ours, the
    container of a Running Pod), in the environment :meth:`Trial.make_nodes` gives it."""

    def __init__(self, name: str, addr: str, directory: Path) -> None:
        super().__init__(name, directory, log_name="torchrun.log")
        self.addr = addr
        self.progress_path = directory / "progress.jsonl"
        self.events_path = directory / "events.jsonl"
        self.env: dict[str, str] = {}

    def environment(self) -> dict[str, str]:
        return self.env

    def start(self, args: Sequence[str]) -> None:
        self.spawn(
            [sys.executable, "-m", "bench.probes.agent", *args],
            {
                "LOGLEVEL": "INFO",
                "TRAIN_PROGRESS_FILE": str(self.progress_path),
                "RECOVERY_EVENTS": str(self.events_path),
            },
        )

    def lines(self) -> list[Json]:
        return json_lines(self.progress_path)

    def events(self) -> list[Json]:
        return json_lines(self.events_path)


def lines_of(nodes: Iterable[Node]) -> list[Json]:
    return [line for node in nodes for line in node.lines()]


def restart_reason(node: Node, after: float) -> str | None:
    """The worker group's state when ``node``'s agent first restarted after ``after``:
    FAILED (a worker exited) or HEALTHY (``num_nodes_waiting() > 0``)."""
    restarts = (e for e in node.events() if e["event"] == "restart" and e["time"] > after)
    return next((str(e["state"]) for e in restarts), None)


def breakdown(
    event_at: float,
    nodes: Sequence[Node],
    world: list[Json],
    before: Sequence[Json],
    newcomer: Node | None = None,
) -> Json:
    """When the last of ``nodes`` had done each stage after ``event_at``, from the agents'
    records (the first of each after the event) and the progress lines of the new world
    (``world``) and of the one before (``before``)."""

    def first(node: Node, event: str, **fields: Any) -> float | None:
        times = [
            e["time"]
            for e in node.events()
            if e["event"] == event
            and e["time"] > event_at
            and all(e.get(k) == v for k, v in fields.items())
        ]
        return min(times) if times else None

    def last(times: Iterable[float | None]) -> float | None:
        known = [t for t in times if t is not None]
        return max(known) - event_at if known else None

    def of_nodes(event: str, among: Sequence[Node] = nodes, **fields: Any) -> float | None:
        return last(first(node, event, **fields) for node in among)

    first_lines: dict[tuple[str, int], Json] = {}
    first_steps: dict[int, float] = {}
    for line in sorted(world, key=lambda line: line["time"]):
        first_lines.setdefault((line["pod"], line["pid"]), line)
        first_steps.setdefault(line["rank"], line["time"])
    kept = {key: line for key, line in first_lines.items() if line.get("started", 0) < event_at}
    fresh = [line for key, line in first_lines.items() if key not in kept]
    in_place = bool(kept)  # the workers of the world before are still there

    def of_workers(key: str, lines: Iterable[Json]) -> float | None:
        return last(line.get(key) for line in lines)

    if in_place:
        survivors = [node for node in nodes if node is not newcomer]
        stages: Json = {
            "noticed": of_workers("failed_at", kept.values())
            if newcomer is None
            else of_nodes("reform", survivors),
            "reformed": last(
                [first(node, "published", in_place=True) for node in survivors]
                + ([first(newcomer, "rendezvous_done")] if newcomer is not None else [])
            ),
            "started": of_nodes("started", [newcomer]) if newcomer is not None else None,
            "imported": of_workers("imported", fresh) if fresh else None,
            "initialized": of_workers("initialized", fresh) if fresh else None,
            "reconfigured": of_workers("reformed_at", first_lines.values()),
        }
    else:
        stages = {
            "noticed": of_nodes("restart"),
            "stopped": of_nodes("stopped"),
            "reformed": of_nodes("rendezvous_done"),
            "started": of_nodes("started"),
            "imported": of_workers("imported", first_lines.values()),
            "initialized": of_workers("initialized", first_lines.values()),
        }
    stages["first_step"] = max(first_steps.values()) - event_at
    last_before: dict[tuple[str, int], float] = {}
    for line in before:
        key = (line["pod"], line["pid"])
        if line["time"] <= event_at:
            last_before[key] = max(last_before.get(key, 0.0), line["time"])
    pauses = [
        line["time"] - last_before[key] for key, line in first_lines.items() if key in last_before
    ]
    return {
        "in_place": in_place,
        "stages": {k: None if v is None else round(v, 4) for k, v in stages.items()},
        # The longest a worker that trained before the event went without a step.
        "pause": round(max(pauses), 4) if pauses else None,
        "restart_reasons": {node.name: restart_reason(node, event_at) for node in nodes},
    }


class Trial:
    """The nodes of one trial of one variant, stopped by PID at the end."""

    def __init__(self, variant: Variant, cluster: Cluster, work: Path, preload: str | None):
        self.variant = variant
        self.cluster = cluster
        self.work = work
        self.preload = preload
        self.nodes: list[Node] = []
        self.namespace: str | None = None
        self.rendezvous = "train"
        self.c10d_port = 0

    def __enter__(self) -> Trial:
        if self.variant.backend == "kubernetes":
            self.namespace = self.cluster.new_namespace("recovery")
            self.cluster.create_rendezvous(self.namespace, self.rendezvous, MIN_NODES, NODES)
            self.cluster.wait_initialised(self.namespace, [self.rendezvous])
        else:
            from bench.scenarios import free_port

            self.c10d_port = free_port()
        return self

    def __exit__(self, *_: object) -> None:
        for node in self.nodes:
            node.kill()
        if self.namespace is not None:
            self.cluster.delete_namespace(self.namespace)

    def make_nodes(self, names_and_addresses: Mapping[str, str]) -> list[Node]:
        made = [Node(name, addr, self.work / name) for name, addr in names_and_addresses.items()]
        preload = {"LD_PRELOAD": self.preload} if self.preload else {}
        if self.namespace is not None:
            assert self.cluster.plane is not None
            pods = self.cluster.create_pods(
                self.namespace,
                {node.name: self.rendezvous for node in made},
                {node.name: node.addr for node in made},
            )
            for node, pod in zip(made, pods, strict=True):
                node.env = container_environment(
                    self.cluster.plane,
                    self.namespace,
                    pod.name,
                    pod.uid,
                    node.addr,
                    node.directory / "serviceaccount",
                )
                node.env.update(preload)
        else:
            for node in made:
                # POD_NAME: each node's name, as its pod's hostname would give it (the
                # progress lines tell the nodes apart by it). C10D_OWN_STORE_ENV: c10d's
                # default, one store shared by every round, never resumed training here.
                node.env = local_environment(
                    {**preload, "POD_NAME": node.name, **C10D_OWN_STORE_ENV}
                )
        self.nodes.extend(made)
        return made

    def torchrun_args(self, node: Node, host: bool) -> list[str]:
        args = [
            f"--nnodes={MIN_NODES}:{NODES}",
            f"--nproc-per-node={NPROC_PER_NODE}",
            f"--rdzv-backend={self.variant.backend}",
            "--max-restarts=10",
            "--monitor-interval=0.1",
        ]
        conf = self.variant.rdzv_conf
        if self.variant.backend == "kubernetes":
            args += [f"--rdzv-endpoint={self.rendezvous}", f"--rdzv-id={self.rendezvous}"]
        else:
            host_conf = f"is_host={'1' if host else '0'}"
            conf = f"{conf},{host_conf}" if conf else host_conf
            args += [
                f"--rdzv-endpoint=127.0.0.1:{self.c10d_port}",
                "--rdzv-id=recovery",
                f"--local-addr={node.addr}",
            ]
        if conf:
            args.append(f"--rdzv-conf={conf}")
        return [
            *args,
            *(["-m", "k8s_rendezvous.warm"] if self.variant.warm else []),
            str(self.variant.script),
            "--steps",
            "1000000",
            "--step-seconds",
            str(STEP_SECONDS),
        ]

    def delete_pod(self, node: Node) -> None:
        assert self.namespace is not None
        self.cluster.delete_pod(self.namespace, node.name)


def run_trial(variant: Variant, cluster: Cluster, work: Path, preload: str | None) -> Json:
    """One trial: a world of 4 nodes, one killed, one added. Raises if a world does not
    form (the caller records the error)."""
    result: Json = {"variant": variant.name}
    with Trial(variant, cluster, work, preload) as trial:
        first = {f"n{i}": f"127.101.0.{i + 1}" for i in range(NODES)}
        nodes = trial.make_nodes(first)
        started = time.time()
        for index, node in enumerate(nodes):
            node.start(trial.torchrun_args(node, host=index == 0))
        before = wait_world(nodes, NODES * NPROC_PER_NODE, after=started, timeout=FORM_TIMEOUT)
        result["first_world_seconds"] = round(max(line["time"] for line in before) - started, 3)
        ranks = {line["pod"]: line["group_rank"] for line in before}
        victim = max(nodes[1:], key=lambda node: ranks[node.name])
        survivors = [node for node in nodes if node is not victim]
        # A few steps in the world of 8 before the kill, every rank.
        wait_world(nodes, NODES * NPROC_PER_NODE, after=time.time() + 3 * STEP_SECONDS, timeout=60)

        killed = time.time()
        victim.kill()
        kill: Json = {"victim_group_rank": ranks[victim.name]}
        if variant.backend == "kubernetes":
            kill["pod_deleted"] = round(time.time() - killed, 4)
            trial.delete_pod(victim)
            kill["pod_deletion_returned"] = round(time.time() - killed, 4)
        smaller = wait_world(
            survivors, (NODES - 1) * NPROC_PER_NODE, after=killed, timeout=FORM_TIMEOUT
        )
        kill.update(breakdown(killed, survivors, smaller, lines_of(nodes)))
        if "pod_deleted" in kill:
            kill["from_pod_deletion"] = round(kill["stages"]["first_step"] - kill["pod_deleted"], 4)
        result["kill"] = kill

        (newcomer,) = trial.make_nodes({"n4": f"127.101.0.{NODES + 1}"})
        everyone = [*survivors, newcomer]
        wait_world(
            survivors,
            (NODES - 1) * NPROC_PER_NODE,
            after=time.time() + 3 * STEP_SECONDS,
            timeout=60,
        )
        added = time.time()
        newcomer.start(trial.torchrun_args(newcomer, host=False))
        larger = wait_world(everyone, NODES * NPROC_PER_NODE, after=added, timeout=FORM_TIMEOUT)
        add = breakdown(added, everyone, larger, lines_of(survivors), newcomer)
        joining = [
            e["time"] for e in newcomer.events() if e["event"] == "rendezvous" and e["time"] > added
        ]
        add["stages"]["joined"] = round(min(joining) - added, 4) if joining else None
        result["add"] = add
    return result


def summarize(samples: Sequence[float | None]) -> Json:
    ok = sorted(s for s in samples if s is not None)
    if not ok:
        return {"n": 0}
    return {
        "n": len(ok),
        "median": round(statistics.median(ok), 4),
        "min": round(ok[0], 4),
        "max": round(ok[-1], 4),
        "samples": [round(s, 4) for s in ok],
    }


def measure(
    cluster: Cluster,
    work: Path,
    log: Log,
    reps: int,
    variants: Sequence[str],
    preload: str | None,
) -> Json:
    """``reps`` trials of each variant, interleaved; the per-stage summaries and every
    trial's record."""
    trials: dict[str, list[Json]] = {name: [] for name in variants}
    for rep in range(reps):
        for name in variants:
            variant = VARIANTS[name]
            began = time.monotonic()
            try:
                result = run_trial(variant, cluster, work / f"{name}-{rep + 1}", preload)
            except Exception as error:
                result = {"variant": name, "error": f"{type(error).__name__}: {error}"[:2000]}
            trials[name].append(result)
            kill = (result.get("kill") or {}).get("stages", {}).get("first_step")
            add = (result.get("add") or {}).get("stages", {}).get("first_step")
            log(
                f"recovery {name} rep {rep + 1}/{reps}: kill -> step {kill} s, add -> step "
                f"{add} s ({time.monotonic() - began:.0f} s)"
                + (f" ERROR {result['error'][:300]}" if result.get("error") else "")
            )
    summary: Json = {}
    for name, results in trials.items():
        summary[name] = {"label": VARIANTS[name].label}
        for event in ("kill", "add"):
            stages = [(r.get(event) or {}).get("stages", {}) for r in results]
            summary[name][event] = {
                stage: summarize([found.get(stage) for found in stages]) for stage, _ in STAGES
            }
            summary[name][event]["pause"] = summarize(
                [(r.get(event) or {}).get("pause") for r in results]
            )
        summary[name]["kill"]["from_pod_deletion"] = summarize(
            [(r.get("kill") or {}).get("from_pod_deletion") for r in results]
        )
        summary[name]["errors"] = [r["error"] for r in results if r.get("error")]
    return {
        "nodes": NODES,
        "min_nodes": MIN_NODES,
        "workers_per_node": NPROC_PER_NODE,
        "summary": summary,
        "trials": trials,
    }


# -- report ---------------------------------------------------------------------------------


def _cell(stats: Json | None) -> str:
    if not stats or not stats.get("n"):
        return "-"
    return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def markdown(section: Json) -> list[str]:
    summary = section["summary"]
    names = list(summary)
    lines = [
        f"## Recovery: node lost or added to training resumed ({section['nodes']} nodes x "
        f"{section['workers_per_node']} gloo workers, min {section['min_nodes']})",
        "",
        "Seconds after the event by which the last node (or worker) on the critical path had "
        "done each stage (bench/recovery.py says what each means on each path); medians "
        "(min-max). Kill: the node's processes SIGKILLed (ours: then its Pod deleted). Add: a "
        "fifth node's torchrun started (its Pod already Running).",
    ]
    for event, title in (("kill", "Node killed"), ("add", "Node added")):
        lines += [
            "",
            f"### {title}",
            "",
            "| stage | " + " | ".join(summary[n]["label"] for n in names) + " |",
            "|---|" + "---|" * len(names),
        ]
        rows = [*STAGES, ("pause", "longest a worker running before went without a step")]
        if event == "kill":
            rows.append(("from_pod_deletion", "first step completed, after the Pod's deletion"))
        for stage, meaning in rows:
            lines.append(
                f"| {meaning} | "
                + " | ".join(_cell(summary[n][event].get(stage)) for n in names)
                + " |"
            )
    errors = {n: summary[n]["errors"] for n in names if summary[n]["errors"]}
    if errors:
        lines += ["", "Failed trials:", ""]
        lines += [f"- {n}: {e[:300]}" for n, errs in errors.items() for e in errs]
    return lines


def plot(section: Json, path: Path) -> None:
    """One horizontal bar per variant and event, split at each stage's median, the total
    written at its end; linear and log time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = section["summary"]
    colors = plt.get_cmap("tab10")
    rows: list[tuple[str, Json]] = [
        (f"{summary[n]['label']}: {event}", summary[n][event])
        for event in ("kill", "add")
        for n in summary
    ]
    figure, axes = plt.subplots(1, 2, figsize=(14, 1.8 + 0.5 * len(rows)))
    for axis, log_scale in zip(axes, (False, True), strict=True):
        for row, (_label, stages) in enumerate(rows):
            previous = 0.0
            for index, (stage, meaning) in enumerate(STAGES):
                value = (stages.get(stage) or {}).get("median")
                if value is None:
                    continue
                axis.barh(
                    row,
                    max(value - previous, 0.0),
                    left=previous,
                    color=colors(index),
                    label=meaning,
                )
                previous = max(previous, value)
            if previous:
                axis.annotate(f" {previous:.2f} s", (previous, row), va="center", fontsize=8)
        axis.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("seconds after the event (median)" + (", log scale" if log_scale else ""))
        if log_scale:
            axis.set_xscale("symlog", linthresh=0.1)
        axis.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    order = [meaning for _, meaning in STAGES if meaning in unique]
    figure.legend(
        [unique[m] for m in order], order, loc="lower center", ncol=5, fontsize=8, frameon=False
    )
    axes[0].set_title("From a node killed or added to training resumed")
    axes[1].set_title("The same, log scale")
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
