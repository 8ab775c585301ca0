"""One repetition of each measured scenario, for each backend.

A trial starts fresh worker processes (torch imported before anything is timed), places
the simulated nodes on them, runs, and kills the workers by PID; for ``ours`` it also
gets a fresh namespace with one Running pod per node (pod-bound tokens) and deletes it
afterwards, waiting until it is gone so teardown never overlaps the next measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from bench import profiling
from bench.cluster import Cluster, Log, Metrics, Sampler, metrics_delta, rss_mb
from bench.pool import Json, Pool, Worker

OURS = "ours"
C10D = "c10d"
ETCD_V2 = "etcd-v2"

# torch's defaults are 5 s x 3 keep-alive and a 30 s last call; the smallest sensible
# setting (1 s x 2 expires healthy nodes, see bench/README.md) is 1 s x 4 and 1 s.
C10D_FAST = {"keep_alive_interval": 1, "keep_alive_max_attempt": 4, "last_call_timeout": 1}


@dataclasses.dataclass
class Env:
    cluster: Cluster | None
    log_dir: Path
    log: Log
    max_workers: int
    etcd_endpoint: str | None = None
    py_spy_dir: Path | None = None
    """Where the 1000-node rounds' py-spy samples go (``run.py --py-spy``); None: no sampling."""


def address(node: int) -> str:
    """A distinct loopback address per node (its store binds there), for ours its pod's IP."""
    return f"127.100.{node // 250}.{node % 250 + 1}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def summarize(samples: Sequence[float | None]) -> dict[str, Any]:
    """Median and spread of the successful samples; failures counted."""
    ok = sorted(s for s in samples if s is not None)
    result: dict[str, Any] = {
        "n": len(ok),
        "failures": len(samples) - len(ok),
        "samples": [round(s, 4) for s in ok],
    }
    if ok:
        quartiles = statistics.quantiles(ok, n=4) if len(ok) > 1 else [ok[0]] * 3
        result.update(
            median=round(statistics.median(ok), 4),
            min=round(ok[0], 4),
            max=round(ok[-1], 4),
            p25=round(quartiles[0], 4),
            p75=round(quartiles[2], 4),
        )
    return result


# -- placing nodes on workers ----------------------------------------------------------------


class Placement:
    """Nodes spread over worker processes; ``dedicated`` nodes get a process of their own
    (a victim to SIGKILL, a newcomer that arrives later)."""

    def __init__(self, workers: Pool, where: dict[int, int]) -> None:
        self.pool = workers
        self.where = where
        self.setup_seconds = 0.0
        """From building the handlers to their background setup done (``ready``)."""

    def worker_of(self, node: int) -> Worker:
        return self.pool.workers[self.where[node]]

    def call(self, op: str, ids: Sequence[int], timeout: float = 120, **args: Any) -> list[Json]:
        groups: dict[int, list[int]] = {}
        for node in ids:
            groups.setdefault(self.where[node], []).append(node)
        with ThreadPoolExecutor(max_workers=max(1, len(groups))) as executor:
            futures = [
                executor.submit(self.pool.workers[index].call, op, timeout, ids=group, **args)
                for index, group in groups.items()
            ]
            return [future.result() for future in futures]

    def join(self, ids: Sequence[int], go_at: float) -> None:
        self.call("join", ids, go_at=go_at)

    def collect(self, ids: Sequence[int], timeout: float) -> dict[int, Json]:
        answers = self.call("collect", ids, timeout=timeout + 30, within=timeout)
        return {r["id"]: r for answer in answers for r in answer["records"]}


@contextlib.contextmanager
def placed(
    env: Env,
    backend: str,
    specs: list[Json],
    common: Json,
    *,
    dedicated: Sequence[int] = (),
    workers: int | None = None,
) -> Iterator[Placement]:
    regular = [s["id"] for s in specs if s["id"] not in dedicated]
    count = max(1, min(len(regular), workers or env.max_workers))
    where = {node: position % count for position, node in enumerate(regular)}
    for extra, node in enumerate(dedicated):
        where[node] = count + extra
    common = {**common, "backend": backend}
    with contextlib.ExitStack() as stack:
        pool = Pool(count + len(dedicated), env.log_dir / "workers", backend)
        stack.callback(pool.stop)
        placement = Placement(pool, where)
        by_worker: list[list[Json]] = [[] for _ in pool.workers]
        for spec in specs:
            by_worker[where[spec["id"]]].append(spec)
        host = [s for s in specs if (s.get("conf") or {}).get("is_host") == "true"]
        if host:  # torch's c10d store must be listening before anyone connects
            pool.workers[where[host[0]["id"]]].call("add_nodes", 120, nodes=host, common=common)
            by_worker = [[s for s in group if s not in host] for group in by_worker]
        started = time.monotonic()
        pool.map(
            "add_nodes",
            [{"nodes": group, "common": common} for group in by_worker],
            timeout=600,
        )
        unready = sum(reply["pending"] for reply in pool.each("ready", timeout=330, within=300))
        if unready:
            raise RuntimeError(f"{unready} nodes' handlers did not finish their setup in 300 s")
        placement.setup_seconds = time.monotonic() - started
        yield placement


# -- backends: what a trial needs -------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    specs: list[Json]
    common: Json
    namespace: str | None = None
    rendezvous: list[str] = dataclasses.field(default_factory=list)
    pods: dict[int, str] = dataclasses.field(default_factory=dict)


def setup_ours(
    env: Env, groups: Sequence[tuple[int, int, int]], spec: Json | None = None, prefix: str = "b"
) -> Setup:
    """One namespace; per group ``(nodes, min, max)`` a Rendezvous and its pods, each pod
    at its node's :func:`address`."""
    cluster = env.cluster
    assert cluster is not None
    namespace = cluster.new_namespace(prefix)
    specs: list[Json] = []
    rendezvous_of: dict[str, str] = {}
    address_of: dict[str, str] = {}
    rendezvous: list[str] = []
    node = 0
    plan: list[tuple[int, str, str, int, int]] = []
    for index, (count, low, high) in enumerate(groups):
        rdzv = f"r{index}" if len(groups) > 1 else "train"
        rendezvous.append(rdzv)
        cluster.create_rendezvous(namespace, rdzv, low, high, **(spec or {}))
        for i in range(count):
            pod = f"{rdzv}-node-{i}"
            plan.append((node, pod, rdzv, low, high))
            rendezvous_of[pod] = rdzv
            address_of[pod] = address(node)
            node += 1
    pods = {p.name: p for p in cluster.create_pods(namespace, rendezvous_of, address_of)}
    cluster.wait_initialised(namespace, rendezvous)
    for node_id, pod, rdzv, low, high in plan:
        specs.append(
            {
                "id": node_id,
                "token": pods[pod].token,
                "namespace": namespace,
                "rendezvous": rdzv,
                "pod": pod,
                "addr": address_of[pod],
                "min_nodes": low,
                "max_nodes": high,
            }
        )
    return Setup(
        specs,
        {"server": cluster.server, "ca_file": cluster.ca_file, "read_timeout": 60},
        namespace,
        rendezvous,
        {node_id: pod for node_id, pod, *_ in plan},
    )


def setup_torch(
    env: Env, backend: str, count: int, low: int, high: int, conf: Json | None = None
) -> Setup:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    if backend == C10D:
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        assert env.etcd_endpoint is not None
        endpoint = env.etcd_endpoint
    specs = []
    for node in range(count):
        node_conf: Json = {"read_timeout": 60, **(conf or {})}
        if backend == C10D:
            node_conf["is_host"] = "true" if node == 0 else "false"
        specs.append(
            {
                "id": node,
                "endpoint": endpoint,
                "run_id": run_id,
                "min_nodes": low,
                "max_nodes": high,
                "addr": address(node),
                "conf": node_conf,
            }
        )
    return Setup(specs, {})


def setup(
    env: Env,
    backend: str,
    count: int,
    low: int,
    high: int,
    *,
    ours_spec: Json | None = None,
    torch_conf: Json | None = None,
    prefix: str = "b",
) -> Setup:
    if backend == OURS:
        return setup_ours(env, [(count, low, high)], ours_spec, prefix)
    return setup_torch(env, backend, count, low, high, torch_conf)


def teardown(env: Env, done: Setup) -> None:
    if done.namespace and env.cluster is not None:
        env.cluster.delete_namespace(done.namespace)


def check_round(records: dict[int, Json], ids: Sequence[int], world: int) -> str | None:
    """``None`` if every node returned with a dense, unique rank in a world of ``world``."""
    problems = [
        f"node {i}: "
        + (records[i].get("error") or ("still blocked" if records[i]["pending"] else "no result"))
        for i in ids
        if records[i].get("ret") is None
    ]
    if problems:
        return "; ".join(problems[:3]) + (
            f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        )
    worlds = {records[i]["world"] for i in ids}
    ranks = sorted(records[i]["rank"] for i in ids)
    if worlds != {world} or ranks != list(range(world)):
        return f"bad round: worlds {worlds}, ranks {ranks[:10]}..."
    return None


def go_time(placement: Placement) -> float:
    return time.monotonic() + 0.5 + 0.02 * len(placement.pool.workers)


# -- 1. seal latency (and 4. cost, 5. scale) ----------------------------------------------------


def seal(
    env: Env,
    backend: str,
    count: int,
    *,
    timeout: float,
    torch_conf: Json | None = None,
    sample: bool = False,
    workers: int | None = None,
) -> Json:
    """min = max = count: from the last node's call to the last node's return."""
    prepared = setup(env, backend, count, count, count, torch_conf=torch_conf, prefix="seal")
    result: Json = {"backend": backend, "nodes": count}
    try:
        with placed(env, backend, prepared.specs, prepared.common, workers=workers) as place:
            ids = [s["id"] for s in prepared.specs]
            before = env.cluster.metrics() if backend == OURS and env.cluster else None
            sampler = None
            if sample and env.cluster is not None:
                groups = {k: [v] for k, v in env.cluster.pids().items()}
                groups["nodes (workers)"] = place.pool.pids
                sampler = Sampler(groups).__enter__()
            processes = {"nodes (workers)": place.pool.pids}
            if env.cluster is not None and backend == OURS:
                processes.update({k: [v] for k, v in env.cluster.pids().items()})
            go_at = go_time(place)
            place.join(ids, go_at)
            time.sleep(max(0.0, go_at - time.monotonic()))
            with contextlib.ExitStack() as profiled:
                if sample and env.py_spy_dir is not None and env.cluster is not None:
                    spied = {
                        "worker 0": place.pool.pids[0],
                        "operator": env.cluster.pids()["operator"],
                    }
                    out_dir = env.py_spy_dir / f"{count}-{time.time():.0f}"
                    result["py_spy"] = profiled.enter_context(profiling.recording(spied, out_dir))
                cpu_at_go, go_wall = machine_cpu_seconds(), time.monotonic()
                by_process_at_go = processes_cpu_seconds(processes)
                records = place.collect(ids, timeout)
                by_process = processes_cpu_seconds(processes)
            result["machine"] = {
                "seconds": time.monotonic() - go_wall,
                "busy_cpu_seconds": machine_cpu_seconds() - cpu_at_go,
                "cores": os.cpu_count(),
                "cpu_seconds_by_process": {
                    name: round(by_process[name] - by_process_at_go[name], 3) for name in processes
                },
            }
            if sampler is not None:
                sampler.__exit__()
                result["processes"] = sampler.summary()
            result["setup_seconds"] = place.setup_seconds
            result.update(timing(records, ids))
            result["error"] = check_round(records, ids, count)
            if before is not None and env.cluster is not None:
                time.sleep(1.0)  # a watch is counted when it ends: let those ending now end
                result["cost"] = metrics_delta(before, env.cluster.metrics())
                assert prepared.namespace is not None
                result["breakdown"] = breakdown(
                    records, ids, env.cluster.rendezvous(prepared.namespace, "train")
                )
            result["workers"] = place.pool.each("stats")
            result["nodes_cpu_by_thread"] = nodes_cpu_by_thread(result["workers"])
    finally:
        teardown(env, prepared)
    return result


def nodes_cpu_by_thread(workers: list[Json]) -> Json:
    """The simulated nodes' CPU seconds since the go, by kind of thread, over all workers:
    which of a node's jobs (its join, its watch, its connection to rank 0's store) the
    round's CPU went to."""
    total: dict[str, float] = {}
    for stats in workers:
        for kind, seconds in stats["cpu_seconds_since_join_by_thread"].items():
            total[kind] = total.get(kind, 0.0) + seconds
    return {kind: round(seconds, 4) for kind, seconds in sorted(total.items())}


def machine_cpu_seconds() -> float:
    """CPU time every core of the machine has spent busy since boot (``/proc/stat``): the
    seal's share of a machine that runs nothing else tells whether it waited for CPU."""
    with open("/proc/stat", encoding="ascii") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is in user


def processes_cpu_seconds(groups: dict[str, list[int]]) -> dict[str, float]:
    """User and system CPU seconds each named group of processes has used so far."""
    used = {}
    for name, pids in groups.items():
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
        used[name] = total
    return used


def timing(records: dict[int, Json], ids: Sequence[int]) -> Json:
    calls = [records[i]["call"] for i in ids if records[i]["call"] is not None]
    rets = [records[i]["ret"] for i in ids if records[i]["ret"] is not None]
    if len(rets) < len(ids) or not calls:
        return {"latency": None}
    return {
        "latency": max(rets) - max(calls),
        "first_call_to_last_return": max(rets) - min(calls),
        "call_spread": max(calls) - min(calls),
    }


def breakdown(records: dict[int, Json], ids: Sequence[int], body: Json) -> Json:
    """Where a round of ours spends its time, from the last node's call (wall clock):
    joins written, operator's decision (status.sealedAt), round seen by the watchers,
    returned (after connecting to rank 0's store)."""
    if any(records[i].get("ret_wall") is None for i in ids):
        return {}
    last_call = max(records[i]["call_wall"] for i in ids)
    sealed_at = (body.get("status") or {}).get("sealedAt")
    result: Json = {
        "last_join_written": max(records[i]["written_wall"] or last_call for i in ids) - last_call,
        "last_round_seen": max(records[i]["seen_wall"] or last_call for i in ids) - last_call,
        "last_returned": max(records[i]["ret_wall"] for i in ids) - last_call,
        "max_seen_to_return": max(
            records[i]["ret_wall"] - (records[i]["seen_wall"] or records[i]["ret_wall"])
            for i in ids
        ),
    }
    if sealed_at:
        moment = datetime.datetime.fromisoformat(sealed_at.replace("Z", "+00:00"))
        result["sealed"] = moment.timestamp() - last_call
    return {k: round(v, 4) for k, v in result.items()}


def concurrent(env: Env, rendezvous: int, size: int, *, timeout: float) -> Json:
    """``rendezvous`` Rendezvous of ``size`` nodes each, all joining at once."""
    prepared = setup_ours(env, [(size, size, size)] * rendezvous, prefix="conc")
    result: Json = {"rendezvous": rendezvous, "nodes_each": size}
    try:
        with placed(env, OURS, prepared.specs, prepared.common) as place:
            assert env.cluster is not None
            ids = [s["id"] for s in prepared.specs]
            groups = {k: [v] for k, v in env.cluster.pids().items()}
            groups["nodes (workers)"] = place.pool.pids
            before = env.cluster.metrics()
            with Sampler(groups) as sampler:
                place.join(ids, go_time(place))
                records = place.collect(ids, timeout)
            result["processes"] = sampler.summary()
            per = []
            errors = []
            for index in range(rendezvous):
                members = [s["id"] for s in prepared.specs if s["rendezvous"] == f"r{index}"]
                per.append(timing(records, members)["latency"])
                if problem := check_round(records, members, size):
                    errors.append(f"r{index}: {problem}")
            result["per_rendezvous"] = summarize(per)
            result["setup_seconds"] = place.setup_seconds
            result.update(timing(records, ids))
            result["error"] = "; ".join(errors[:3]) or None
            time.sleep(1.0)
            result["cost"] = metrics_delta(before, env.cluster.metrics())
    finally:
        teardown(env, prepared)
    return result


def live_footprint(env: Env, rendezvous: int, size: int, *, timeout: float) -> Json:
    """Operator RSS with ``rendezvous`` sealed, heart-beating rendezvous."""
    assert env.cluster is not None
    operator = env.cluster.pids()["operator"]
    prepared = setup_ours(env, [(size, size, size)] * rendezvous, prefix="live")
    result: Json = {"rendezvous": rendezvous, "nodes_each": size}
    try:
        with placed(env, OURS, prepared.specs, prepared.common) as place:
            ids = [s["id"] for s in prepared.specs]
            place.join(ids, go_time(place))
            records = place.collect(ids, timeout)
            sealed = sum(1 for i in ids if records[i]["ret"] is not None)
            result["nodes_returned"] = sealed
            time.sleep(5.0)  # heartbeats and watches settle
            readings = []
            for _ in range(10):
                readings.append(rss_mb(operator))
                time.sleep(0.5)
            result["operator_rss_mb"] = round(max(readings), 1)
            result["error"] = None if sealed == len(ids) else f"{len(ids) - sealed} nodes blocked"
    finally:
        teardown(env, prepared)
    return result


# -- 2. failure to new world ----------------------------------------------------------------------


def failure(env: Env, backend: str, *, torch_conf: Json | None = None, size: int = 8) -> Json:
    """A sealed world of ``size`` (min = size - 1); the last node dies; survivors re-form."""
    victim = size - 1
    survivors = list(range(size - 1))
    timeout = 150.0
    prepared = setup(env, backend, size, size - 1, size, torch_conf=torch_conf, prefix="fail")
    result: Json = {"backend": backend, "nodes": size, "conf": torch_conf or {}}
    try:
        with placed(env, backend, prepared.specs, prepared.common, dedicated=[victim]) as place:
            everyone = [*survivors, victim]
            place.join(everyone, go_time(place))
            first = place.collect(everyone, 120)
            if problem := check_round(first, everyone, size):
                result["error"] = f"first round: {problem}"
                return result
            before = None
            if backend == OURS:
                place.call("rejoin_when_waiting", survivors, interval=0.005, within=timeout)
                before = metrics_or_none(env)
            killed = time.monotonic()
            place.worker_of(victim).kill()
            deleted = None
            if backend == OURS:
                assert env.cluster is not None and prepared.namespace is not None
                deleted = time.monotonic()
                env.cluster.delete_pod(prepared.namespace, prepared.pods[victim])
            else:
                place.join(survivors, time.monotonic())
            records = place.collect(survivors, timeout)
            result["error"] = check_round(records, survivors, size - 1)
            rets = [records[i]["ret"] for i in survivors]
            if result["error"] is None:
                result["latency"] = max(rets) - killed
                if deleted is not None:
                    result["latency_from_deletion"] = max(rets) - deleted
                    noticed = [records[i]["first_waiting"] for i in survivors]
                    result["notice"] = max(noticed) - killed
                if before is not None and env.cluster is not None:
                    time.sleep(1.0)  # a watch is counted when it ends: let those ending now end
                    result["cost"] = metrics_delta(before, env.cluster.metrics())
            else:
                result["latency"] = None
    finally:
        teardown(env, prepared)
    return result


# -- 3. scale-up notice ------------------------------------------------------------------------


def scale_up(env: Env, backend: str, *, size: int = 4) -> Json:
    """A sealed world of ``size`` with maxNodes ``size + 1``; a newcomer calls
    ``next_rendezvous()``: until every running node's ``num_nodes_waiting()`` > 0."""
    newcomer = size
    running = list(range(size))
    prepared = setup(
        env,
        backend,
        size + 1,
        size,
        size + 1,
        ours_spec={"lastCallTimeoutSeconds": 1},
        torch_conf={"last_call_timeout": 1},
        prefix="up",
    )
    result: Json = {"backend": backend, "nodes": size}
    try:
        with placed(env, backend, prepared.specs, prepared.common, dedicated=[newcomer]) as place:
            place.join(running, go_time(place))
            first = place.collect(running, 120)
            if problem := check_round(first, running, size):
                result["error"] = f"first round: {problem}"
                return result
            place.call("watch_waiting", running, interval=0.005, within=60)
            place.join([newcomer], time.monotonic() + 0.2)
            records = place.collect(running, 60)
            arrival = place.collect([newcomer], 0)[newcomer]["call"]
            noticed = [records[i]["first_waiting"] for i in running]
            if arrival is None or any(n is None for n in noticed):
                result["error"] = f"not every running node noticed: {noticed}"
                result["latency"] = None
            else:
                result["error"] = None
                result["latency"] = max(noticed) - arrival
                result["first_notice"] = min(noticed) - arrival
    finally:
        teardown(env, prepared)
    return result


def metrics_or_none(env: Env) -> Metrics | None:
    return env.cluster.metrics() if env.cluster is not None else None
