"""Goodput under a fault schedule, on real nodes, ours beside torch's c10d.

    python bench/goodput.py                               # c10d, ours, ours-spare: 20 min each
    python bench/goodput.py --minutes 4 --configs ours    # a short look at one
    python bench/goodput.py --configs soak --restart-delay-cap 1 --gap 8,12 --doubles 0.25 \
        --deck pod=3,container=3,drain=2,worker=2 --rounds 1000 --minutes 140 \
        --out bench/results/soak                          # the soak: dense faults, two at once
    python bench/goodput.py --report                      # the report again, from results.json

Needs root (the real nodes of devkit/cluster/nodes.py). It starts a control plane with two
real nodes, installs the chart with the operator image built here, and for each
configuration trains examples/elastic_train.py (gloo, one worker per pod, 4 pods in the
world) for ``--minutes`` while the same seeded schedule injects a fault every 60-90 s,
drawn in turn from a shuffled deck of every kind (:data:`FAULTS`; ``--deck`` deals some
kinds more than once). Configurations
(:data:`CONFIGS`): torch's c10d tuned as users run it without a cluster DNS; ours by
default; ours with warm worker starts, in-place re-forming and one spare pod (and, for the
soak, the same without the spare).

The workers append one JSON line per step to a file per pod on a hostPath, so that what a
deleted pod or a lost node trained is still counted. From those lines, for each
configuration:

- **goodput**: the steps trained, each weighed by its world's size over the full world's,
  over what the undisturbed pace (measured from the first full world's first step to the
  first fault) trains in the same wall time;
- per fault: the seconds **without training** until the full world trains again (the
  pauses, not what a smaller world trained between them), the **stall** (from the fault
  to the first step after the longest pause it caused; 0 when training never paused;
  none when it had not resumed by the next fault),
  the **full world** (to the first step of a world of 4 after that pause), the **steps
  lost** (the undisturbed pace's steps until the next fault, less those trained), and the
  **rank churn** (ranks held by another pod in the first full world after the fault than
  before it: 1 when a newcomer takes the lost rank); a node lost while the operator's
  leader ran on it has a row of its own (:func:`row_of`);
- the **invariant checks**: every world's ranks within 0..n-1, each held by one pod, and
  every step but the world's last logged by every rank (:func:`world_violations`); no two
  worlds training at once; for ours, the recorded Rendezvous history (tests/support/
  invariants.py) and no sealed round keeping a member whose Pod is gone or terminal for
  more than :data:`DEAD_MEMBER_GRACE` s while the operator has a leader; at the end, a
  full world training (no agent stuck); and what the run left behind once its pods are
  gone (processes in their cgroups, network namespaces, k8s-rdzv-* entries of /tmp).

Rank 0 (and c10d's store host) is never a victim, nor is its node drained or lost: c10d's
rendezvous does not survive losing its store. Every torchrun runs with
``--max-restarts=100`` (a budget for hours, as long runs set it) in an Indexed Job with
``backoffLimitPerIndex: 100``.

Results: bench/results/goodput/ (results.json, results.md, timeline.png).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kubernetes.client  # noqa: E402
from tests.support import fixtures, invariants  # noqa: E402

from bench import real_nodes  # noqa: E402
from devkit import chart, namespaces  # noqa: E402
from devkit.cluster.controlplane import dig, read_object  # noqa: E402
from devkit.nodepool import NodePool  # noqa: E402
from devkit.training import (  # noqa: E402
    TrainingJob,
    agent_pid,
    create_job,
    job_manifest,
    operator_leader,
    pod_processes,
    wait_webhook_served_by_leader_alone,
    worker_pid,
)
from devkit.waiting import WaitTimeout, wait_for  # noqa: E402
from k8s_rendezvous.wire import codec, objects, records, specs, statuses  # noqa: E402
from k8s_rendezvous_operator import leadership  # noqa: E402

FAULTS = {
    "worker": "a worker SIGKILLed",
    "container": "an agent's container SIGKILLed (restartPolicy Never: the pod fails)",
    "pod": "a pod deleted",
    "drain": "a node cordoned and the Job's pods on it evicted; uncordoned after REPAIR_SECONDS",
    "node": "a node lost (kubelet killed, network cut); restored after REPAIR_SECONDS",
    "leader": "the operator's leader SIGKILLed",
    "apiserver": "the API server stopped and started again",
}
NODE_FAULTS = ("drain", "node")
POD_FAULTS = ("worker", "container", "pod", *NODE_FAULTS)
"""Faults that take a pod of the Job (the others take the control plane's)."""
GAP_SECONDS = (60.0, 90.0)
REPAIR_SECONDS = 45.0
FULL = 4
STEP_SECONDS = 0.25
TORCHRUN_ARGS = ("--max-restarts=100",)
DEAD_MEMBER_GRACE = 5.0
"""A sealed round may name a member whose pod just went for as long as the operator takes
to notice (milliseconds), outside the operator's outages (:func:`operator_outages`)."""
LEADER_TAKEOVER_SECONDS = 15.0
"""From the operator's leader killed or its node lost, or the API server back, to a leader
acting again: the leader Lease's 10 s to expire and the new leader's start (12.5 s in a
trial soak)."""
OUT = REPO / "bench" / "results" / "goodput"
IN_PLACE_SCRIPT = REPO / "examples" / "elastic_train_in_place.py"
Json = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    description: str
    pods: int = FULL
    rdzv_conf: str = ""
    in_place: bool = False
    """Workers re-form in place (examples/elastic_train_in_place.py)."""
    warm: bool = False
    """Workers forked from the agent's zygote (``-m k8s_rendezvous.warm``)."""
    statefulset: bool = False
    """The pods are a StatefulSet's, in a Rendezvous their first pod makes, rather than an
    annotated Indexed Job's: a deleted pod is made anew at once and a crashed container is
    restarted in its pod, where the Job controller delays each replacement of an index by
    10 s x 2^(failures - 1), up to 10 min, and never forgets (docs/troubleshooting.md)."""

    @property
    def c10d(self) -> bool:
        return self.name == "c10d"


CONFIGS = {
    "c10d": Config(
        "c10d",
        "torch's c10d: the store host's pod IP, pod IPs as --local-addr, a store per round, "
        "last_call_timeout=5",
        rdzv_conf="last_call_timeout=5",
    ),
    "ours": Config("ours", "ours by default"),
    "ours-spare": Config(
        "ours-spare",
        "ours with warm worker starts, in-place re-forming and one spare pod",
        pods=FULL + 1,
        rdzv_conf="warm_start=1,in_place=1",
        in_place=True,
        warm=True,
    ),
    "ours-warm": Config(
        "ours-warm",
        "ours with warm worker starts and in-place re-forming, no spare: the soak's, since "
        "each loss then forms two rounds (the shrink, and the replacement's)",
        rdzv_conf="warm_start=1,in_place=1",
        in_place=True,
        warm=True,
    ),
}
CONFIGS["soak"] = dataclasses.replace(
    CONFIGS["ours-warm"],
    name="soak",
    description="ours-warm in a StatefulSet: its pods come back with no Job controller "
    "back-off, so that faults keep forming rounds for hours",
    statefulset=True,
)
GOODPUT_CONFIGS = ("c10d", "ours", "ours-spare")
"""What the goodput section compares; the others serve the soak."""


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the schedule starts."""
    kind: str


def deck(weights: str = "") -> list[str]:
    """The kinds a schedule deals, each as many times as ``weights`` says (``"pod=3,worker=2"``;
    a kind not named comes once). A weight below 1 is refused: a soak weighs the kinds that
    form rounds more, so as to reach its count of rounds within a session, but keeps every
    kind."""
    counts = dict.fromkeys(FAULTS, 1)
    for item in filter(None, (part.strip() for part in weights.split(","))):
        kind, _, count = item.partition("=")
        if kind not in FAULTS:
            raise ValueError(f"--deck: no fault kind {kind!r}; the kinds are {', '.join(FAULTS)}")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--deck: {kind}={count!r} is not a whole number of at least 1 "
                "(every kind stays in the deck)"
            )
        counts[kind] = int(count)
    return [kind for kind, count in counts.items() for _ in range(count)]


def schedule(
    seed: int,
    seconds: float,
    kinds: Sequence[str],
    gap: tuple[float, float] = GAP_SECONDS,
    doubles: float = 0.0,
) -> list[Fault]:
    """A fault every ``gap`` seconds (uniform) within ``seconds``, each kind in turn from a
    deck shuffled anew once dealt, so that every kind comes about as often; a share
    ``doubles`` of them come with the next card at the same moment (two at once)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    deck: list[str] = []

    def deal() -> str:
        nonlocal deck
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        return deck.pop()

    at = rng.uniform(*gap)
    while at < seconds:
        faults.append(Fault(round(at, 1), deal()))
        if doubles and rng.random() < doubles:
            faults.append(Fault(round(at, 1), deal()))
        at += rng.uniform(*gap)
    return faults


# -- what the workers' lines say (pure) -----------------------------------------------


def world_key(line: Json) -> tuple[str, int, int | None]:
    """A world: its master, its size and, re-formed in place, its round (the master
    stays while the world changes)."""
    return (str(line["master"]), int(line["world_size"]), line.get("round"))


def rank_zero_steps(lines: Iterable[Json]) -> list[Json]:
    """Rank 0's lines, by time: one per step every rank completed (its all-reduce)."""
    return sorted((line for line in lines if line["rank"] == 0), key=lambda line: line["time"])


def weighed(steps: Iterable[Json], full: int = FULL) -> float:
    return sum(int(line["world_size"]) / full for line in steps)


def undisturbed_pace(steps: Sequence[Json], until: float, full: int = FULL) -> tuple[float, float]:
    """(when the first full world took its first step, its steps per second until
    ``until``)."""
    full_steps = [line for line in steps if line["world_size"] == full]
    if not full_steps:
        raise ValueError("no world of the full size ever trained")
    began = full_steps[0]["time"]
    trained = [line for line in full_steps if began <= line["time"] < until]
    if until <= began or len(trained) < 2:
        raise ValueError("the first full world did not train before the first fault")
    return began, (len(trained) - 1) / (trained[-1]["time"] - began)


def trained_full_world(lines: Sequence[Json], full: int = FULL) -> dict[int, str] | None:
    """The pod of each rank of the latest world of ``full``, if every rank has trained."""
    steps = [line for line in rank_zero_steps(lines) if line["world_size"] == full]
    if not steps:
        return None
    ranks = ranks_at(lines, world_key(steps[-1]))
    return ranks if len(ranks) == full else None


def latest_world(lines: Sequence[Json]) -> dict[int, str] | None:
    """The pod of each rank of the world rank 0 trained in last."""
    steps = rank_zero_steps(lines)
    return ranks_at(lines, world_key(steps[-1])) if steps else None


def ranks_at(lines: Iterable[Json], key: tuple[str, int, int | None]) -> dict[int, str]:
    return {int(line["rank"]): str(line["pod"]) for line in lines if world_key(line) == key}


def fault_effect(
    steps: Sequence[Json],
    lines: Sequence[Json],
    at: float,
    until: float,
    pace: float,
    full: int = FULL,
) -> Json:
    """What a fault at ``at`` cost until ``until`` (the next fault or the end)."""
    before = [line for line in steps if line["time"] <= at]
    after = [line for line in steps if at < line["time"] < until]
    effect: Json = {
        "idle": None,
        "stall": None,
        "full_world": None,
        "steps_lost": round(pace * (until - at) - weighed(after, full), 1),
        "rank_churn": None,
        "world_before": before[-1]["world_size"] if before else None,
        "world_after": after[-1]["world_size"] if after else None,
    }
    if not after:
        return effect
    # The longest pause from the fault on, to the next fault included: a few steps the old
    # world still took right after the fault are no resumption. A pause shorter than three
    # steps is the pace.
    previous = before[-1]["time"] if before else at
    longest, resumed = 0.0, after[0]["time"]
    for line in after:
        if line["time"] - previous > longest:
            longest, resumed = line["time"] - previous, line["time"]
        previous = line["time"]
    if until - previous > longest and until - previous > 3 * STEP_SECONDS:
        return effect  # not resumed before the next fault: no stall, no full world
    paused = longest > 3 * STEP_SECONDS
    effect["stall"] = round(resumed - at, 3) if paused else 0.0
    since = resumed if paused else at
    first_full = next(
        (line for line in after if line["world_size"] == full and line["time"] >= since), None
    )
    end = first_full["time"] if first_full is not None else until
    effect["idle"] = idle_seconds([line["time"] for line in steps], at, end)
    if first_full is not None:
        effect["full_world"] = round(first_full["time"] - at, 3)
        if before:
            held = ranks_at(lines, world_key(before[-1]))
            now = ranks_at(lines, world_key(first_full))
            effect["rank_churn"] = sum(
                1 for rank in set(held) | set(now) if held.get(rank) != now.get(rank)
            )
    return effect


def idle_seconds(times: Sequence[float], at: float, end: float) -> float:
    """Seconds without a step from a fault at ``at`` to ``end`` (the full world's first
    step): the pauses longer than three steps, not what a smaller world trained between
    them. ``times``: rank 0's steps."""
    previous = max((t for t in times if t <= at), default=at)
    idle = 0.0
    for t in sorted(t for t in times if at < t <= end):
        if t - previous > 3 * STEP_SECONDS:
            idle += t - max(previous, at)
        previous = t
    return round(idle, 3)


def world_violations(lines: Sequence[Json], overlap: float = 1.0) -> list[str]:
    """Worlds with a rank outside 0..n-1 or held by two pods, a step some rank did not
    log though a later one was taken, and two worlds training at once (rank 0 of each
    within the other's span by more than ``overlap`` s).

    A rank logs a step after its all-reduce and before it enters the next, and nobody
    completes an all-reduce without every rank's part: a step followed by another was
    logged by every rank. The world's last step need not be: a collective is not atomic,
    and a rank killed in it can have sent its part and died before its line."""
    found: list[str] = []
    holders: dict[tuple[str, int, int | None], dict[int, set[str]]] = {}
    logged: dict[tuple[str, int, int | None], dict[int, set[int]]] = {}
    spans: dict[tuple[str, int, int | None], list[float]] = {}
    for line in lines:
        key = world_key(line)
        holders.setdefault(key, {}).setdefault(int(line["rank"]), set()).add(str(line["pod"]))
        logged.setdefault(key, {}).setdefault(int(line["step"]), set()).add(int(line["rank"]))
        if line["rank"] == 0:
            span = spans.setdefault(key, [line["time"], line["time"]])
            span[0], span[1] = min(span[0], line["time"]), max(span[1], line["time"])
    for key, ranks in holders.items():
        size = key[1]
        if outside := sorted(set(ranks) - set(range(size))):
            found.append(f"world {key}: ranks {outside} outside 0..{size - 1}")
        steps = logged[key]
        every_rank = set(range(size))
        if short := [step for step in sorted(steps)[:-1] if not every_rank <= steps[step]]:
            found.append(
                f"world {key}: step {short[0]} logged by ranks {sorted(steps[short[0]])} "
                "only, though a later step was taken"
            )
        for rank, pods in ranks.items():
            if len(pods) > 1:
                found.append(f"world {key}: rank {rank} held by {sorted(pods)}")
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    for (key, span), (other, later) in itertools.pairwise(ordered):
        if later[0] < span[1] - overlap:
            found.append(f"worlds {key} and {other} trained at once until {span[1]:.1f}")
    return found


def worlds(lines: Sequence[Json]) -> list[Json]:
    """Each world, in order: its key, the pod of each rank, when rank 0 trained in it."""
    spans: dict[tuple[str, int, int | None], list[float]] = {}
    for line in rank_zero_steps(lines):
        spans.setdefault(world_key(line), []).append(line["time"])
    return [
        {
            "world": list(key),
            "ranks": ranks_at(lines, key),
            "first": min(times),
            "last": max(times),
            "steps": len(times),
        }
        for key, times in sorted(spans.items(), key=lambda item: min(item[1]))
    ]


def leading_pod(lease: Json, now: float) -> str | None:
    """The pod holding the operator's leader Lease at ``now`` (the host's clock, the API
    server's too), if its hold has not expired: an expired holder is a leader killed whom
    no standby has replaced yet."""
    record = leadership.Record.from_lease(lease)
    if not record.holder or not record.renew_time:
        return None
    age = now - codec.parse_time(record.renew_time, "spec.renewTime").timestamp()
    return leadership.pod_of(record.holder) if age <= record.duration_seconds else None


def took_the_leader(fault: Json) -> bool:
    """A node lost while the operator's leader ran on it: no replica acts until its Lease
    expires (:data:`LEADER_TAKEOVER_SECONDS`)."""
    leader_node = fault.get("leader_node")
    return fault["kind"] == "node" and leader_node is not None and leader_node == fault.get("node")


def row_of(fault: Json) -> str:
    """The fault's row in the report: its kind, a node lost with the leader on its own."""
    return "node, with the operator's leader" if took_the_leader(fault) else str(fault["kind"])


def summarize(faults: Sequence[Json]) -> dict[str, Json]:
    """Per fault kind (:func:`row_of`): median and max of stall and full world, median
    steps lost and rank churn."""

    def stats(values: list[float]) -> Json:
        if not values:
            return {"median": None, "max": None}
        return {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}

    by_kind: dict[str, Json] = {}
    for kind in sorted({row_of(fault) for fault in faults}):
        of_kind = [fault for fault in faults if row_of(fault) == kind]
        by_kind[kind] = {
            "count": len(of_kind),
            "unresolved": sum(1 for fault in of_kind if fault["full_world"] is None),
            **{
                name: stats([f[name] for f in of_kind if f[name] is not None])
                for name in ("sealed", "idle", "stall", "full_world", "steps_lost", "rank_churn")
            },
        }
    return by_kind


def read_lines(directory: Path) -> list[Json]:
    """Every whole line the workers wrote (one being written when read is left out)."""
    lines: list[Json] = []
    for path in sorted(directory.glob("*.jsonl")):
        for text in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                lines.append(json.loads(text))
    return lines


def sealed_after(rounds: Sequence[tuple[float, str, int]], at: float, until: float) -> float | None:
    """From ``at`` to the first round sealed before ``until`` after the one of that time
    (ours only)."""
    before = [round_ for seen, _, round_ in rounds if seen <= at]
    current = before[-1] if before else 0
    return next(
        (
            round(seen - at, 3)
            for seen, phase, round_ in rounds
            if at < seen < until and phase == statuses.RoundState.SEALED.value and round_ > current
        ),
        None,
    )


def analyze(
    lines: list[Json],
    faults: Sequence[Json],
    began: float,
    ended: float,
    rounds: Sequence[tuple[float, str, int]] = (),
) -> Json:
    """Goodput, per-fault effects and the workers' invariants of one run; fault times
    are host clock, ``rounds`` the Rendezvous' (host clock, state, round) as seen."""
    steps = rank_zero_steps(line for line in lines if line["time"] >= began)
    first_fault = faults[0]["at"] if faults else ended
    start, pace = undisturbed_pace(steps, first_fault)
    trained = [line for line in steps if start <= line["time"] <= ended]
    effects = []
    for index, fault in enumerate(faults):
        until = faults[index + 1]["at"] if index + 1 < len(faults) else ended
        effect = fault_effect(steps, lines, fault["at"], until, pace)
        effect["sealed"] = sealed_after(rounds, fault["at"], until) if rounds else None
        effects.append({**fault, **effect})
    return {
        "pace": round(pace, 3),
        "goodput": round(weighed(trained) / (pace * (ended - start)), 4),
        "steps": len(trained),
        "seconds": round(ended - start, 1),
        "faults": effects,
        "by_kind": summarize(effects),
        "violations": world_violations(lines),
        "worlds": worlds(lines),
    }


# -- the run on real nodes --------------------------------------------------------------


def operator_outages(faults: Iterable[Json]) -> list[tuple[float, float]]:
    """When the operator had no leader acting, from the faults injected (host clock): after
    its leader was killed or its node lost, and while the API server was down and until a
    leader took over after it came back."""
    return [
        (fault["at"], fault.get("restored", fault["at"]) + LEADER_TAKEOVER_SECONDS)
        for fault in faults
        if fault["kind"] in ("leader", "apiserver") or took_the_leader(fault)
    ]


def dead_member_violations(
    dead: dict[tuple[int, str], tuple[float, float]], outages: Sequence[tuple[float, float]]
) -> list[str]:
    """The members sealed rounds kept dead for longer than :data:`DEAD_MEMBER_GRACE`, leaving
    out the time the operator had no leader. ``dead``: (round, pod) -> (first seen dead,
    last seen dead), host clock."""
    found = []
    for (round_, pod), (since, until) in sorted(dead.items()):
        covered = sum(
            max(0.0, min(until, end) - max(since, start)) for start, end in merged(outages)
        )
        if until - since - covered > DEAD_MEMBER_GRACE:
            found.append(
                f"round {round_}: member {pod} dead for {until - since:.1f} s "
                f"({until - since - covered:.1f} s with an operator leader acting)"
            )
    return found


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` with those that overlap joined, in order."""
    joined: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if joined and start <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], end))
        else:
            joined.append((start, end))
    return joined


def member_gone(member: records.Member, pod: Json | None) -> bool:
    """Whether the pod a sealed round's ``member`` joined from is gone, terminating or
    ended, or no longer runs the agent that joined: a StatefulSet makes a deleted pod anew
    under its name (another IP), and restarts a crashed container in its pod."""
    if pod is None:
        return True
    restarts = sum(
        int(container.get("restartCount") or 0)
        for container in dig(pod, "status", "containerStatuses", default=[])
    )
    return bool(
        pod["metadata"].get("deletionTimestamp")
        or dig(pod, "status", "phase") in ("Failed", "Succeeded")
        or dig(pod, "status", "podIP") != member.addr
        or restarts > member.pod_restarts
    )


def host_leftovers() -> dict[str, set[str]]:
    """Network namespaces and k8s-rdzv-* entries of /tmp on this host (the real nodes')."""
    netns = Path("/var/run/netns")
    return {
        "netns": {p.name for p in netns.iterdir()} if netns.is_dir() else set(),
        "tmp": {p.name for p in Path(tempfile.gettempdir()).glob("k8s-rdzv-*")},
    }


class Run:
    """One configuration: its Job training through the schedule."""

    def __init__(
        self,
        pool: NodePool,
        api: kubernetes.client.ApiClient,
        config: Config,
        seed: int,
        gap: tuple[float, float] = GAP_SECONDS,
        rounds: int | None = None,
        logs: Path | None = None,
        doubles: float = 0.0,
        kinds: Sequence[str] = tuple(FAULTS),
    ) -> None:
        self.pool = pool
        self.doubles = doubles
        self.kinds = list(kinds)
        """The deck the schedule deals from (:func:`deck`)."""
        self.logs = logs
        """Where each pod's log is kept at the end of the run (not committed: for reading a
        fault's cost)."""
        self.gap = gap
        self.rounds = rounds
        """Ours: end once the Rendezvous has sealed this many rounds (a soak)."""
        self.api = api
        self.config = config
        self.seed = seed
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = f"goodput-{uuid.uuid4().hex[:8]}"
        self.name = config.name
        self.shared = Path(tempfile.mkdtemp(prefix="k8s-rdzv-goodput-"))
        self.shared.chmod(0o755)
        self.progress = self.shared / "progress"
        self.progress.mkdir()
        self.progress.chmod(0o777)  # the workers' user writes its pod's file here
        self.violations: list[str] = []
        self._dead_members: dict[tuple[int, str], tuple[float, float]] = {}
        """(round, pod) of a sealed round's member seen dead -> (first, last) seen so."""
        self._pod_uids: set[str] = set()
        self._repairs: list[tuple[float, str, str]] = []
        self._rounds: list[tuple[float, str, int]] = []
        """(host clock, state, round) of each version of the Rendezvous seen."""
        self._trace: list[Json] = []
        """What each version of the Rendezvous said, for reading a fault's cost after."""
        self._placements: dict[str, str] = {}
        """Each pod of the run and the Kubernetes node it was bound to."""
        self.restarted: list[list[Any]] = []
        """(host clock, name) of each control plane component that exited and was started
        again, as a kubelet restarts a static pod (ControlPlane.restart_exited)."""

    def manifest(self) -> Json:
        script = str(IN_PLACE_SCRIPT) if self.config.in_place else "train.py"
        words = [
            "torchrun",
            "--nproc-per-node=1",
            *TORCHRUN_ARGS,
            *([f"--rdzv-conf={self.config.rdzv_conf}"] if not self.config.c10d else []),
            *(
                # Annotated Jobs' pods are given these by the operator's webhook.
                ["--rdzv-backend=kubernetes", f"--rdzv-endpoint={self.name}", f"--nnodes=2:{FULL}"]
                if self.config.statefulset
                else []
            ),
            *(["-m", "k8s_rendezvous.warm"] if self.config.warm else []),
            script,
            "--steps",
            "10000000",
            "--step-seconds",
            str(STEP_SECONDS),
        ]
        manifest = job_manifest(
            self.name,
            self.pool.images["trainer"].reference,
            parallelism=self.config.pods,
            nodes=f"2:{FULL}",
            command=words,
        )
        # The Job controller delays each replacement pod by 10 s x 2^(n-1), n the Job's
        # failed pods so far (at most 10 min, never reset while none succeeds): with one
        # count for the Job, the 16th fault of a run waits 10 min for its pod, whatever
        # the rendezvous. An Indexed Job with a budget per index counts each index's
        # failures apart (docs/troubleshooting.md), as long runs are advised to do.
        spec = manifest["spec"]
        del spec["backoffLimit"]
        spec.update(
            completions=self.config.pods,
            completionMode="Indexed",
            backoffLimitPerIndex=100,
        )
        pod_spec = manifest["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        container["env"] = [
            variable for variable in container["env"] if variable["name"] != "TRAIN_PROGRESS_FILE"
        ] + [
            # The progress lines name their pod by POD_NAME (an annotated Job's pods get it
            # from the operator), else the hostname: an Indexed Job's is <job>-<index>.
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "TRAIN_PROGRESS_FILE", "value": "/progress/$(POD_NAME).jsonl"},
        ]
        pod_spec["volumes"].append(
            {"name": "progress", "hostPath": {"path": str(self.progress), "type": "Directory"}}
        )
        container["volumeMounts"].append({"name": "progress", "mountPath": "/progress"})
        if self.config.c10d:
            real_nodes.as_c10d(manifest, self.name, f"2:{FULL}", self.shared, self.config.rdzv_conf)
        if self.config.statefulset:
            return self.as_statefulset(manifest)
        return manifest

    def as_statefulset(self, job: Json) -> Json:
        """The Job ``job``'s pods as a StatefulSet's, which restarts its containers in place."""
        labels = {"app": self.name}
        pod_spec = job["spec"]["template"]["spec"]
        pod_spec["restartPolicy"] = "Always"
        for constraint in pod_spec.get("topologySpreadConstraints") or ():
            constraint["labelSelector"] = {"matchLabels": labels}
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": self.name},
            "spec": {
                "replicas": self.config.pods,
                "serviceName": self.name,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }

    def create_workload(self) -> TrainingJob:
        manifest = self.manifest()
        if not self.config.statefulset:
            return create_job(self.api, self.namespace, manifest)
        # What docs/workloads.md has users do for a workload other than an annotated Job.
        namespaces.bind_worker_role(self.api, self.namespace)
        fixtures.bind_creator_role(self.pool.control_plane, self.namespace)
        kubernetes.client.AppsV1Api(self.api).create_namespaced_stateful_set(
            self.namespace, manifest
        )
        return TrainingJob(self.api, self.namespace, self.name, selector=f"app={self.name}")

    def run(self, minutes: float) -> Json:
        namespaces.create(self.api, self.namespace)
        job = self.create_workload()
        recorder = None
        stop = threading.Event()
        before = host_leftovers()
        threading.Thread(target=self._sample, args=(stop,), daemon=True).start()
        if not self.config.c10d:
            recorder = invariants.Recorder(self.api, self.namespace, self.name)
            custom = kubernetes.client.CustomObjectsApi(self.api)
            real_nodes.watch_in_thread(
                stop,
                lambda: (
                    custom.list_namespaced_custom_object,
                    (objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL),
                    {"field_selector": f"metadata.name={self.name}"},
                ),
                self._on_rendezvous,
            )
        try:
            protected = self._start(job)
            began = time.time()
            planned = schedule(self.seed, minutes * 60, self.kinds, self.gap, self.doubles)
            injected = self._follow(job, protected, planned, began, minutes * 60)
            ended = time.time()
            self._check_end()
        finally:
            stop.set()
            while self._repairs:
                self._repair(self._repairs[0][2])
            if recorder is not None:
                with contextlib.suppress(Exception):
                    recorder.catch_up()
                recorder.stop()
            try:  # for reading afterwards: never in the way of the cleanup below
                self._keep_logs()
            except Exception:
                traceback.print_exc()
            leases = self._leases()
            with contextlib.suppress(kubernetes.client.exceptions.ApiException):
                self.core.delete_namespace(self.namespace, grace_period_seconds=0)
            # Its workers write into the directory until their kubelets have stopped them.
            with contextlib.suppress(WaitTimeout):
                wait_for(
                    lambda: not job.pods(),
                    120,
                    "the Job's pods gone",
                    max_interval=2.0,
                    ignore=(kubernetes.client.exceptions.ApiException,),
                )
            lines = read_lines(self.progress)
            shutil.rmtree(self.shared, ignore_errors=True)
            leaks = self._leaks(before)
        if recorder is not None and recorder.spec is not None:
            try:
                invariants.check(specs.RendezvousSpec.from_dict(recorder.spec), recorder.statuses())
            except invariants.Violation as violation:
                self.violations.append(f"rendezvous history: {violation}")
        result = analyze(lines, injected, began, ended, self._rounds)
        result["leaks"] = leaks
        result["leases"] = leases
        result["components_restarted"] = self.restarted
        result["rounds"] = max((round_ for _, _, round_ in self._rounds), default=None)
        result["trace"] = self._trace
        result["placements"] = self._placements
        result["violations"] += self.violations + dead_member_violations(
            self._dead_members, operator_outages(injected)
        )
        return {
            "config": self.name,
            "description": self.config.description,
            "began": began,
            "ended": ended,
            **result,
            "timeline": [
                [line["time"] - began, line["world_size"]] for line in rank_zero_steps(lines)
            ],
        }

    def _start(self, job: TrainingJob) -> str:
        """Until a world of FULL trains; returns the pod never to be a victim."""
        protected = ""
        if self.config.c10d:
            pods = wait_for(
                lambda: pods if len(pods := job.running_pods()) == self.config.pods else None,
                180,
                "the Job's pods running",
                ignore=(kubernetes.client.exceptions.ApiException,),
            )
            host = pods[0]
            protected = host["metadata"]["name"]
            address = host["status"]["podIP"]
            host_address = f"[{address}]" if ":" in address else address
            (self.shared / "endpoint").write_text(f"{host_address}:{real_nodes.C10D_PORT}\n")
        ranks = wait_for(
            lambda: trained_full_world(read_lines(self.progress)),
            300,
            f"a world of {FULL} training (lines in {self.progress})",
            max_interval=2.0,
        )
        return protected or ranks[0]

    def _follow(
        self, job: TrainingJob, protected: str, planned: list[Fault], began: float, seconds: float
    ) -> list[Json]:
        """Inject each planned fault at its time and each repair at its own; returns the
        faults as injected (host clock, victim, what was done)."""
        injected: list[Json] = []
        pending = list(planned)
        while True:
            now = time.time() - began
            for node in {node for at, _, node in self._repairs if at <= now}:
                self._repair(node)
            if pending and pending[0].at <= now:
                fault = pending.pop(0)
                injected.append(self._inject(job, protected, fault, began))
                print(f"[goodput] {self.name}: {json.dumps(injected[-1])}", flush=True)
                behind = time.time() - began - (pending[0].at if pending else 0.0)
                if pending and pending[0].at != fault.at and behind > 0:
                    # An injection that outlasted the gap (an API server slow to come back)
                    # would otherwise bring every fault due meanwhile at once.
                    pending = [dataclasses.replace(f, at=round(f.at + behind, 1)) for f in pending]
                continue
            if now >= seconds or (
                self.rounds is not None
                and self._rounds
                and max(round_ for _, _, round_ in self._rounds) >= self.rounds
            ):
                return injected
            wakes = [seconds, *(r[0] for r in self._repairs), *(f.at for f in pending[:1])]
            time.sleep(min(max(0.0, min(wakes) - now), 1.0))

    def _inject(self, job: TrainingJob, protected: str, fault: Fault, began: float) -> Json:
        running = job.running_pods()
        # A member of the world training now (a waiting spare has no worker to lose).
        members = set((latest_world(read_lines(self.progress)) or {}).values())
        pods = [
            p
            for p in running
            if p["metadata"]["name"] in members and p["metadata"]["name"] != protected
        ]
        guarded = next((p for p in running if p["metadata"]["name"] == protected), None)
        kind = fault.kind
        rng = random.Random(f"{self.seed}-{fault.at}")
        if kind in NODE_FAULTS:
            away = [
                p
                for p in pods
                if guarded is not None
                and p["spec"]["nodeName"] != guarded["spec"]["nodeName"]
                and not any(r[2] == p["spec"]["nodeName"] for r in self._repairs)
            ]
            if not away:
                kind = "pod"  # every pod is on rank 0's node: nothing else to lose
            else:
                pods = away
        victim = None
        if kind in POD_FAULTS and pods:
            victim = rng.choice(sorted(pods, key=lambda p: p["metadata"]["name"]))
        record: Json = {"planned": fault.kind, "kind": kind, "victim": None, "node": None}
        if kind in POD_FAULTS and victim is None:
            record["at"] = time.time()
            record["kind"] = "none (no pod to take)"
            return record
        if victim is not None:
            record["victim"] = victim["metadata"]["name"]
            record["node"] = victim["spec"]["nodeName"]
        nodes = self.pool.nodes
        assert nodes is not None
        if kind in ("worker", "container"):
            assert victim is not None
            try:
                pid = (worker_pid if kind == "worker" else agent_pid)(victim)
            except ValueError:  # not one such process now: its agent is restarting workers
                record["at"] = time.time()
                record["kind"] = "none (no process to take)"
                return record
            record["at"] = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif kind == "pod":
            record["at"] = time.time()
            self.core.delete_namespaced_pod(record["victim"], self.namespace)
        elif kind == "drain":
            node = record["node"]
            record["at"] = time.time()
            self.pool.control_plane.kubectl("cordon", node)
            for pod in job.running_pods():
                if pod["spec"]["nodeName"] == node:
                    name = pod["metadata"]["name"]
                    with contextlib.suppress(kubernetes.client.exceptions.ApiException):
                        self.core.create_namespaced_pod_eviction(
                            name,
                            self.namespace,
                            {"metadata": {"name": name, "namespace": self.namespace}},
                        )
            self._repairs.append((record["at"] - began + REPAIR_SECONDS, "drain", node))
        elif kind == "node":
            node = record["node"]
            record["leader_node"] = self._operator_leader_node()
            record["at"] = time.time()
            nodes.kill_kubelet(node)
            nodes.cut_network(node)
            self._repairs.append((record["at"] - began + REPAIR_SECONDS, "node", node))
        elif kind == "leader":
            leader = operator_leader(self.api)
            pod = read_object(self.core.read_namespaced_pod, leader, chart.NAMESPACE)
            pids = [p for p, cmd in pod_processes(pod).items() if "rendezvous" in cmd]
            record["victim"], record["node"] = leader, dig(pod, "spec", "nodeName")
            record["at"] = time.time()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            record["at"] = time.time()
            try:
                self.pool.control_plane.stop_apiserver()
            finally:  # even when interrupted: the run's cleanup needs the API server
                self.pool.control_plane.start_apiserver()
            record["restored"] = time.time()
        return record

    def _operator_leader_node(self) -> str | None:
        """The node of the operator's leader by its Lease now (None: none held, its holder
        expired, or not known): a node lost with it costs the operator's takeover too."""
        try:
            lease = read_object(
                kubernetes.client.CoordinationV1Api(self.api).read_namespaced_lease,
                chart.OPERATOR,
                chart.NAMESPACE,
            )
            holder = leading_pod(lease, time.time())
            if holder is None:
                return None
            pod = read_object(self.core.read_namespaced_pod, holder, chart.NAMESPACE)
        except Exception:  # gone, or the API server unreachable: the record says not known
            return None
        node = dig(pod, "spec", "nodeName")
        return str(node) if node else None

    def _repair(self, node: str) -> None:
        nodes = self.pool.nodes
        assert nodes is not None
        lost = [r for r in self._repairs if r[2] == node]
        for repair in lost:
            self._repairs.remove(repair)
        with contextlib.suppress(Exception):
            nodes.restore_network(node)
        with contextlib.suppress(Exception):
            nodes.start_kubelet(node)
        with contextlib.suppress(Exception):
            self.pool.control_plane.kubectl("uncordon", node)
        with contextlib.suppress(Exception):
            wait_webhook_served_by_leader_alone(self.api)

    def _on_rendezvous(self, event: Json) -> None:
        status = event["object"].get("status") or {}
        now = time.time()
        self._rounds.append((now, str(status.get("state")), int(status.get("round") or 0)))
        self._trace.append(
            {
                "at": round(now, 3),
                "state": status.get("state"),
                "round": status.get("round"),
                "members": [member.get("node") for member in status.get("members") or ()],
                "nodesWaiting": status.get("nodesWaiting"),
                "spares": status.get("spares"),
                "formingCause": status.get("formingCause"),
                "formingCauseMessage": status.get("formingCauseMessage"),
                "lastCallDeadline": status.get("lastCallDeadline"),
            }
        )

    def _sample(self, stop: threading.Event) -> None:
        """Every second: a control plane component that exited started again, the uid of
        every pod of the run (for the leak check) and, ours, the sealed round's members
        against their Pods."""
        custom = kubernetes.client.CustomObjectsApi(self.api)
        while not stop.wait(1.0):
            for component in self.pool.control_plane.restart_exited():
                self.restarted.append([round(time.time(), 1), component])
                print(f"[goodput] {self.name}: {component} had exited; started again", flush=True)
            try:
                pods = {
                    p["metadata"]["name"]: p
                    for p in read_object(self.core.list_namespaced_pod, self.namespace)["items"]
                }
                self._pod_uids |= {p["metadata"]["uid"] for p in pods.values()}
                self._placements.update(
                    (name, node) for name, p in pods.items() if (node := dig(p, "spec", "nodeName"))
                )
                if self.config.c10d:
                    continue
                body: Json = custom.get_namespaced_custom_object(
                    objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL, self.name
                )
            except Exception:
                continue  # the API server restarting: the next sample sees
            status = statuses.RendezvousStatus.from_dict(body.get("status"))
            if status.state is not statuses.RoundState.SEALED:
                continue
            now = time.time()
            for member in status.members:
                dead = member_gone(member, pods.get(member.node))
                key = (status.round, member.node)
                if dead:
                    self._dead_members[key] = (self._dead_members.get(key, (now, now))[0], now)

    def _leases(self) -> Json:
        """The nodes' Leases left at the end, beside the pod names the run had: one per pod
        name that joined, each collected with its Rendezvous."""
        try:
            listed = read_object(
                kubernetes.client.CoordinationV1Api(self.api).list_namespaced_lease,
                self.namespace,
                label_selector=f"{objects.NODE_LABEL}={self.name}",
            )
        except Exception:  # the API server unreachable: not in the way of the cleanup
            traceback.print_exc()
            return {"left": None, "pod_names": len(self._placements)}
        return {"left": len(listed["items"]), "pod_names": len(self._placements)}

    def _keep_logs(self) -> None:
        """The Events of the run's namespace, and the logs of its pods that are still there
        and of the operator's."""
        if self.logs is None:
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(kubernetes.client.exceptions.ApiException):
            listed = self.core.list_namespaced_event(self.namespace, _preload_content=False)
            (self.logs / "events.json").write_bytes(listed.data)
        places = [(self.namespace, pod) for pod in self._placements] + [
            (chart.NAMESPACE, p["metadata"]["name"])
            for p in read_object(self.core.list_namespaced_pod, chart.NAMESPACE)["items"]
        ]
        for namespace, pod in places:
            for previous in (False, True):
                try:
                    text = self.core.read_namespaced_pod_log(pod, namespace, previous=previous)
                except kubernetes.client.exceptions.ApiException:
                    continue
                if text:  # None for a container that has written nothing yet
                    suffix = ".previous" if previous else ""
                    (self.logs / f"{pod}{suffix}.log").write_text(text)

    def _leaks(self, before: dict[str, set[str]]) -> Json:
        """What the run left once its pods are gone: processes in their cgroups, network
        namespaces and k8s-rdzv-* entries of /tmp that were not there before it."""
        processes = sorted(
            int(pid)
            for uid in self._pod_uids
            for procs in Path("/sys/fs/cgroup/pids").rglob(f"pod{uid}/*/cgroup.procs")
            for pid in procs.read_text().split()
        )
        try:
            left = wait_for(
                lambda: None if (now := host_leftovers())["netns"] - before["netns"] else now,
                60,
                "the pods' network namespaces removed",
                max_interval=2.0,
            )
        except WaitTimeout:
            left = host_leftovers()
        return {
            "processes": processes,
            **{kind: sorted(left[kind] - before[kind]) for kind in left},
        }

    def _check_end(self) -> None:
        """With every node repaired, a world of FULL trains within two minutes: no agent
        is stuck."""
        while self._repairs:
            self._repair(self._repairs[0][2])
        after = time.time()
        try:
            wait_for(
                lambda: any(
                    line["time"] > after and line["world_size"] == FULL
                    for line in rank_zero_steps(read_lines(self.progress))
                ),
                120,
                "a full world training after the last repair",
                max_interval=2.0,
            )
        except WaitTimeout:
            self.violations.append("no world of the full size trained within 120 s of the end")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(GOODPUT_CONFIGS))
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--gap",
        default=",".join(f"{g:g}" for g in GAP_SECONDS),
        help="seconds between faults, MIN,MAX (default: %(default)s; a soak: 10,15)",
    )
    parser.add_argument(
        "--rounds", type=int, help="ours: end a configuration once this many rounds sealed"
    )
    parser.add_argument(
        "--doubles",
        type=float,
        default=0.0,
        help="the share of faults that come with a second at once (a soak: 0.25)",
    )
    parser.add_argument(
        "--deck",
        default="",
        help="KIND=N,...: deal these kinds N times per deck, the others once (default: each "
        "once; the soak: pod=3,container=3,drain=2,worker=2, to reach 1,000 rounds in a session)",
    )
    parser.add_argument(
        "--restart-delay-cap",
        type=int,
        help="the kubelets' longest delay before restarting a crashing container, in seconds "
        "(1-300; default: the kubelet's 300; a soak: 1, since the operator's leader is killed "
        "every few minutes)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: read --out's results.json, add the figures an older harness did "
        "not compute from what it recorded, and write the report again",
    )
    args = parser.parse_args(argv)
    if args.report:
        recorded = json.loads((args.out / "results.json").read_text())
        write(recorded["meta"], [completed(result) for result in recorded["results"]], args.out)
        return 0
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    try:
        kinds = deck(args.deck)
    except ValueError as error:
        parser.error(str(error))
    low, high = (float(value) for value in args.gap.split(","))
    results: list[Json] = []
    started = time.time()
    with real_nodes.real_node_pool(args.restart_delay_cap) as (api, pool):
        for config in configs:
            print(f"[goodput] {config.name}: {args.minutes} min", flush=True)
            try:
                run = Run(
                    pool,
                    api,
                    config,
                    args.seed,
                    (low, high),
                    args.rounds,
                    logs=args.out / "logs" / config.name,
                    doubles=args.doubles,
                    kinds=kinds,
                )
                result = run.run(args.minutes)
            except Exception as error:
                traceback.print_exc()
                result = {"config": config.name, "error": f"{type(error).__name__}: {error}"}
            shown = {k: v for k, v in result.items() if k != "timeline"}
            print(f"[goodput] {json.dumps(shown)[:2000]}", flush=True)
            results.append(result)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/goodput.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.time() - started, 1),
        "schedule": [
            dataclasses.asdict(f)
            for f in schedule(args.seed, args.minutes * 60, kinds, (low, high), args.doubles)
        ],
    }
    write(meta, results, args.out)
    return 0


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


def completed(result: Json) -> Json:
    """A configuration's recorded result with each fault's seconds without training, from
    rank 0's step times (its ``timeline``), where the run that made it did not compute them."""
    if "error" in result or all("idle" in fault for fault in result["faults"]):
        return result
    times = [result["began"] + at for at, _ in result["timeline"]]
    faults = []
    for fault, later in itertools.zip_longest(result["faults"], result["faults"][1:]):
        until = later["at"] if later is not None else result["ended"]
        if fault["stall"] is None:  # not resumed before the next fault
            idle = None
        elif fault["full_world"] is None:
            idle = idle_seconds(times, fault["at"], until)
        else:  # its first step: the recorded figure is rounded
            idle = idle_seconds(times, fault["at"], fault["at"] + fault["full_world"] + 0.001)
        faults.append({**fault, "idle": idle})
    return {**result, "faults": faults, "by_kind": summarize(faults)}


if __name__ == "__main__":
    sys.exit(main())
