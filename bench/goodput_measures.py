"""What a goodput run's records say (pure): from the workers' progress lines (one per step
and rank), the faults as injected and the Rendezvous' versions as seen, the goodput, each
fault's cost and the invariants of the worlds that trained (bench/goodput.py says what
each figure means).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from k8s_rendezvous.wire import records, statuses

FULL = 4
"""The full world: pods in the Job, one worker each."""
STEP_SECONDS = 0.25
"""The workers' pace: a pause of more than three steps is no longer the pace."""
DEAD_MEMBER_GRACE = 5.0
"""A sealed round may name a member whose pod just went for as long as the operator takes
to notice (milliseconds), outside the operator's outages (:func:`operator_outages`)."""
LEADER_TAKEOVER_SECONDS = 15.0
"""From the operator's leader killed or its node lost, or the API server back, to a leader
acting again: the leader Lease's 10 s to expire and the new leader's start (12.5 s in a
trial soak)."""
Json = dict[str, Any]


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


def operator_outages(faults: Iterable[Json]) -> list[tuple[float, float]]:
    """When the operator had no leader acting, from the faults injected (host clock): after
    its leader was killed or its node lost, and while the API server was down and until a
    leader took over after it came back."""
    return [
        (fault["at"], float(fault.get("restored") or fault["at"]) + LEADER_TAKEOVER_SECONDS)
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
    status = pod.get("status") or {}
    restarts = sum(
        int(container.get("restartCount") or 0)
        for container in status.get("containerStatuses") or ()
    )
    return bool(
        pod["metadata"].get("deletionTimestamp")
        or status.get("phase") in ("Failed", "Succeeded")
        or status.get("podIP") != member.addr
        or restarts > member.pod_restarts
    )


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
