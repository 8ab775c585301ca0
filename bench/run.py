"""Benchmarks of k8s-rendezvous against torch's own rendezvous, all in one run.

    python bench/run.py --mode quick   # minutes: checks that the harness works
    python bench/run.py --mode check   # the same, each figure measured once (tests/bench)
    python bench/run.py --mode full    # the published numbers, into bench/results/

Everything runs on this machine, side by side and interleaved (ours, c10d, etcd-v2 for
each repetition), so that ratios hold on a noisy machine. See bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/run.py` puts bench/, not the repo, on the path
    sys.path.insert(0, str(REPO))

from bench import pool, report, scenarios  # noqa: E402
from bench.cluster import Cluster, dump, rss_mb  # noqa: E402
from bench.scenarios import C10D, C10D_FAST, ETCD_V2, OURS, Env, summarize  # noqa: E402

Json = dict[str, Any]


def busy_share(machine: Json) -> float:
    """How much of the machine's CPU was busy from the go to the last return (1 = all)."""
    return float(machine["busy_cpu_seconds"] / (machine["seconds"] * machine["cores"]))


@dataclasses.dataclass(frozen=True)
class Plan:
    seal_ours: tuple[int, ...]
    seal_torch: tuple[int, ...]
    seal_reps: int
    seal_reps_large: int  # for N >= 128
    failure_reps: int
    failure_c10d_defaults_reps: int
    scaleup_reps: int
    scale_nodes: int
    scale_reps: int
    concurrent: tuple[int, int]  # rendezvous, nodes each
    concurrent_reps: int
    live: tuple[int, int]  # rendezvous, nodes each
    import_reps: int
    recovery_reps: int
    recovery_variants: tuple[str, ...]  # of bench/recovery.py's VARIANTS
    max_workers: int
    scale_workers: int  # worker processes the scale section's world is spread over
    torch_join_timeout: int  # seconds a torch round may take before it "did not survive"


QUICK = Plan(
    seal_ours=(2, 8),
    seal_torch=(2, 8),
    seal_reps=2,
    seal_reps_large=1,
    failure_reps=1,
    failure_c10d_defaults_reps=0,
    scaleup_reps=1,
    # A world as large as the full run's: a regression at scale shows in the regular run.
    scale_nodes=1000,
    scale_reps=1,
    concurrent=(4, 4),
    concurrent_reps=1,
    live=(10, 2),
    import_reps=3,
    recovery_reps=1,
    # c10d's variants wait out its keep-alive and last call: minutes, in every trial
    recovery_variants=("ours", "ours-warm", "ours-in-place"),
    max_workers=2,
    scale_workers=8,  # 1,000 nodes in 2 processes of 500 threads never reach rank 0's store
    torch_join_timeout=60,
)

PLANS = {
    "quick": QUICK,
    # tests/bench: every section and the report, each measured once, with a small world
    # in the scale section (minutes less).
    "check": dataclasses.replace(QUICK, seal_reps=1, import_reps=1, scale_nodes=24),
    "full": Plan(
        seal_ours=(2, 8, 32, 128, 256, 512),
        seal_torch=(2, 8, 32, 64, 128),
        seal_reps=5,
        seal_reps_large=3,
        failure_reps=5,
        failure_c10d_defaults_reps=3,
        scaleup_reps=5,
        scale_nodes=1000,
        scale_reps=2,
        concurrent=(100, 8),
        concurrent_reps=2,
        live=(200, 4),
        import_reps=30,
        recovery_reps=3,
        recovery_variants=("ours", "ours-warm", "ours-in-place", "c10d-defaults", "c10d-tuned"),
        max_workers=8,
        scale_workers=8,
        torch_join_timeout=240,
    ),
}


SECTIONS = ("import", "seal", "failure", "scaleup", "scale", "live", "recovery")
_SCALE_RUN_KEYS = (
    "setup_seconds",
    "processes",
    "machine",
    "breakdown",
    "cost",
    "call_spread",
    "workers",
    "py_spy",
)
"""What each 1000-node round keeps: its breakdown says which phase the time went to."""


class Runner:
    def __init__(
        self,
        mode: str,
        out: Path,
        backends: list[str],
        work: Path,
        sections: list[str],
        seal_sizes: tuple[int, ...] | None = None,
        py_spy: bool = False,
    ) -> None:
        self.mode = mode
        self.py_spy = py_spy
        self.sections = sections
        self.plan = PLANS[mode]
        if seal_sizes:
            self.plan = dataclasses.replace(
                self.plan,
                seal_ours=tuple(n for n in self.plan.seal_ours if n in seal_sizes),
                seal_torch=tuple(n for n in self.plan.seal_torch if n in seal_sizes),
            )
        self.out = out
        self.backends = backends
        self.work = work
        self.started = time.monotonic()
        self.log_file = (out / "run.log").open("w")
        self.results: Json = {
            "meta": {
                "mode": mode,
                "command": "python " + " ".join(sys.argv),
                "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
                "plan": dataclasses.asdict(self.plan),
                "machine": machine(),
            },
            "absent": {},
        }
        self.env: Env | None = None

    def log(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def attempt(self, what: str, action: Callable[[], Json]) -> Json:
        """One trial; a crash is recorded as a failed sample, not the end of the run."""
        began = time.monotonic()
        try:
            result = action()
        except Exception as error:
            traceback.print_exc()
            result = {"error": f"{type(error).__name__}: {error}"[:800], "latency": None}
        took = time.monotonic() - began
        latency = result.get("latency")
        shown = f"{latency:.3f} s" if isinstance(latency, float) else "-"
        failed = f" ERROR {result['error']}" if result.get("error") else ""
        self.log(f"{what}: {shown} ({took:.0f} s){failed}")
        return result

    # -- sections ------------------------------------------------------------------------

    def run(self) -> Json:
        from bench import etcdv2, importcost
        from bench.probes import micro

        cluster = Cluster(self.work, self.log)
        etcd: etcdv2.EtcdV2 | None = None
        try:
            if "import" in self.sections:
                self.log("import cost of the torchrun plugin")
                self.results["import"] = importcost.measure(self.plan.import_reps)
                self.log("probe: concurrent TCPStore client connects")
                self.results["tcpstore_connect"] = micro.tcpstore_connect()
            cluster.start()
            env = self.env = Env(cluster, self.work, self.log, self.plan.max_workers)
            if self.py_spy:
                env.py_spy_dir = self.work / "py-spy"
            time.sleep(3.0)
            self.results["footprint"] = {
                "operator_rss_idle_mb": round(rss_mb(cluster.pids()["operator"]), 1)
            }
            if ETCD_V2 in self.backends:
                etcd = self.start_etcd()
                if etcd is not None:
                    env.etcd_endpoint = etcd.endpoint
            # The sections most targets rest on first: a long run cut short keeps them.
            for name, section in (
                ("seal", self.seal_section),
                ("scale", self.scale_section),
                ("live", self.live_section),
                ("failure", self.failure_section),
                ("scaleup", self.scaleup_section),
                ("recovery", self.recovery_section),
            ):
                if name in self.sections:
                    section()
                    # A long run stopped later still leaves what it measured.
                    dump(self.out / "results.partial.json", self.results)
            self.results["footprint"]["operator_rss_end_mb"] = round(
                rss_mb(cluster.pids()["operator"]), 1
            )
        finally:
            if etcd is not None:
                etcd.stop()
            cluster.stop()
        self.results["meta"]["duration_s"] = round(time.monotonic() - self.started, 1)
        return self.results

    def start_etcd(self) -> Any:
        from bench import etcdv2

        missing = etcdv2.python_etcd_missing()
        if missing:
            self.results["absent"][ETCD_V2] = missing
            self.backends.remove(ETCD_V2)
            return None
        self.log("building/locating etcd 3.5 with the v2 API (bench/build_etcd_v2.sh)")
        binary, why = etcdv2.build()
        if binary is None:
            self.results["absent"][ETCD_V2] = why
            self.backends.remove(ETCD_V2)
            return None
        server = etcdv2.EtcdV2(binary, self.work / "etcd-v2.log")
        server.start()
        self.results["meta"]["etcd_v2"] = {"binary": str(binary), "endpoint": server.endpoint}
        self.log(f"etcd v2 API at {server.endpoint} (pid {server.pid})")
        return server

    def seal_section(self) -> None:
        env = self.env
        assert env is not None
        plan = self.plan
        raw: dict[str, dict[int, list[Json]]] = {b: {} for b in self.backends}
        dead: set[str] = set()
        sizes = sorted(set(plan.seal_ours) | set(plan.seal_torch))
        for count in sizes:
            reps = plan.seal_reps if count < 128 else plan.seal_reps_large
            for rep in range(reps):
                order = (
                    self.backends[rep % len(self.backends) :]
                    + self.backends[: rep % len(self.backends)]
                )
                for backend in order:
                    wanted = plan.seal_ours if backend == OURS else plan.seal_torch
                    if count not in wanted or backend in dead:
                        continue
                    timeout = (
                        180.0 + count * 0.5 if backend == OURS else plan.torch_join_timeout + 30.0
                    )
                    conf = None if backend == OURS else {"join_timeout": plan.torch_join_timeout}
                    result = self.attempt(
                        f"seal {backend} N={count} rep {rep + 1}/{reps}",
                        functools.partial(
                            scenarios.seal, env, backend, count, timeout=timeout, torch_conf=conf
                        ),
                    )
                    raw[backend].setdefault(count, []).append(result)
                    if result.get("latency") is None:
                        dead.add(backend)  # larger N would only take longer
                        self.log(f"{backend} did not survive N={count}; larger N skipped")
        section: Json = {}
        for backend, per_size in raw.items():
            section[backend] = {
                str(count): {
                    **summarize([r.get("latency") for r in results]),
                    "errors": [r["error"] for r in results if r.get("error")],
                    "first_call_to_last_return": summarize(
                        [r.get("first_call_to_last_return") for r in results]
                    ),
                    "machine_busy_share": summarize(
                        [busy_share(r["machine"]) for r in results if r.get("machine")]
                    ),
                    "machine_busy_cpu_seconds": summarize(
                        [r["machine"]["busy_cpu_seconds"] for r in results if r.get("machine")]
                    ),
                    "cpu_seconds_by_process": {
                        name: summarize(
                            [
                                r["machine"]["cpu_seconds_by_process"][name]
                                for r in results
                                if r.get("machine")
                            ]
                        )
                        for name in (results[0].get("machine") or {}).get(
                            "cpu_seconds_by_process", {}
                        )
                    },
                }
                for count, results in per_size.items()
            }
        self.results["seal_latency"] = section
        self.results["seal_breakdown"] = {
            str(count): [r["breakdown"] for r in results if r.get("breakdown")]
            for count, results in raw.get(OURS, {}).items()
        }
        self.results["seal_nodes_cpu_by_thread"] = {
            str(count): [r["nodes_cpu_by_thread"] for r in results if "nodes_cpu_by_thread" in r]
            for count, results in raw.get(OURS, {}).items()
        }
        self.results["cost"] = {
            str(count): [r["cost"] for r in results if "cost" in r]
            for count, results in raw.get(OURS, {}).items()
        }

    def failure_section(self) -> None:
        env = self.env
        assert env is not None
        configs: list[tuple[str, str, Json | None, int]] = [
            ("ours", OURS, None, self.plan.failure_reps),
            ("c10d (1 s x 4, last call 1 s)", C10D, C10D_FAST, self.plan.failure_reps),
            ("c10d (defaults)", C10D, None, self.plan.failure_c10d_defaults_reps),
        ]
        if ETCD_V2 in self.backends:
            configs.append(
                ("etcd-v2 (1 s x 4, last call 1 s)", ETCD_V2, C10D_FAST, self.plan.failure_reps)
            )
        raw: dict[str, list[Json]] = {name: [] for name, *_ in configs}
        for rep in range(max(c[3] for c in configs)):
            for name, backend, conf, reps in configs:
                if rep >= reps or backend not in self.backends:
                    continue
                raw[name].append(
                    self.attempt(
                        f"failure {name} rep {rep + 1}/{reps}",
                        functools.partial(scenarios.failure, env, backend, torch_conf=conf),
                    )
                )
        section: Json = {}
        for name, results in raw.items():
            if not results:
                section[name] = {"skipped": f"not run in {self.mode} mode"}
                continue
            section[name] = {
                **summarize([r.get("latency") for r in results]),
                "errors": [r["error"] for r in results if r.get("error")],
            }
            if name == "ours":
                section[name]["from_pod_deletion"] = summarize(
                    [r.get("latency_from_deletion") for r in results]
                )
                section[name]["notice"] = summarize([r.get("notice") for r in results])
                costs = [r["cost"] for r in results if r.get("cost")]
                section[name]["requests"] = summarize([c["requests_rendezvous"] for c in costs])
                section[name]["requests_by"] = [c["requests_rendezvous_by"] for c in costs]
        self.results["failure_to_new_world"] = section

    def scaleup_section(self) -> None:
        env = self.env
        assert env is not None
        raw: dict[str, list[Json]] = {b: [] for b in self.backends}
        for rep in range(self.plan.scaleup_reps):
            for backend in self.backends:
                raw[backend].append(
                    self.attempt(
                        f"scale-up {backend} rep {rep + 1}/{self.plan.scaleup_reps}",
                        functools.partial(scenarios.scale_up, env, backend),
                    )
                )
        self.results["scaleup_notice"] = {
            backend: {
                **summarize([r.get("latency") for r in results]),
                "first_node": summarize([r.get("first_notice") for r in results]),
                "errors": [r["error"] for r in results if r.get("error")],
            }
            for backend, results in raw.items()
        }

    def scale_section(self) -> None:
        env = self.env
        assert env is not None
        count = self.plan.scale_nodes
        runs = [
            self.attempt(
                f"scale {count} nodes rep {rep + 1}/{self.plan.scale_reps}",
                lambda: scenarios.seal(
                    env, OURS, count, timeout=600, sample=True, workers=self.plan.scale_workers
                ),
            )
            for rep in range(self.plan.scale_reps)
        ]
        groups, size = self.plan.concurrent
        together = [
            self.attempt(
                f"concurrent {groups} x {size} rep {rep + 1}/{self.plan.concurrent_reps}",
                lambda: scenarios.concurrent(env, groups, size, timeout=600),
            )
            for rep in range(self.plan.concurrent_reps)
        ]
        self.results["scale"] = {
            "nodes": count,
            "seal": summarize([r.get("latency") for r in runs]),
            "first_call_to_last_return": summarize(
                [r.get("first_call_to_last_return") for r in runs]
            ),
            "errors": [r["error"] for r in runs if r.get("error")],
            "runs": [{k: v for k, v in r.items() if k in _SCALE_RUN_KEYS} for r in runs],
            "concurrent": {
                "rendezvous": groups,
                "nodes_each": size,
                "per_rendezvous_median": summarize(
                    [(r.get("per_rendezvous") or {}).get("median") for r in together]
                ),
                "per_rendezvous_max": summarize(
                    [(r.get("per_rendezvous") or {}).get("max") for r in together]
                ),
                "all_sealed": summarize([r.get("latency") for r in together]),
                "errors": [r["error"] for r in together if r.get("error")],
                "runs": [
                    {k: v for k, v in r.items() if k in ("processes", "cost", "per_rendezvous")}
                    for r in together
                ],
            },
        }

    def recovery_section(self) -> None:
        from bench import recovery

        assert self.env is not None and self.env.cluster is not None
        variants = [
            name
            for name in self.plan.recovery_variants
            if (OURS if recovery.VARIANTS[name].backend == "kubernetes" else C10D) in self.backends
        ]
        self.log(f"recovery: {', '.join(variants)}, {self.plan.recovery_reps} repetitions")
        self.results["recovery"] = recovery.measure(
            self.env.cluster,
            self.work / "recovery",
            self.log,
            self.plan.recovery_reps,
            variants,
            pool.NODE_ENV.get("LD_PRELOAD"),
        )

    def live_section(self) -> None:
        env = self.env
        assert env is not None
        groups, size = self.plan.live
        result = self.attempt(
            f"operator footprint with {groups} live rendezvous of {size}",
            lambda: scenarios.live_footprint(env, groups, size, timeout=600),
        )
        self.results["footprint"].update(
            live_rendezvous=groups,
            live_nodes_each=size,
            operator_rss_live_mb=result.get("operator_rss_mb"),
            live_error=result.get("error"),
        )


def machine() -> Json:
    import kubernetes
    import psutil
    import torch

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kubernetes_client": kubernetes.__version__,
        "platform": platform.platform(),
    }


def build_numeric_getnameinfo(into: Path) -> Path:
    library = into / "numeric_getnameinfo.so"
    source = REPO / "bench" / "numeric_getnameinfo.c"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True
    )
    return library


def _interrupt(signum: int, _frame: object) -> None:
    # SIGTERM like Ctrl-C: unwind, so every process this run started is stopped by PID.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=sorted(PLANS), default="quick")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: bench/results (full), bench/results/quick (quick)",
    )
    parser.add_argument(
        "--backends",
        default=f"{OURS},{C10D},{ETCD_V2}",
        help="comma-separated subset of ours,c10d,etcd-v2 (default: all)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all; for development)",
    )
    parser.add_argument(
        "--seal-sizes",
        default="",
        help="comma-separated subset of the mode's N for the seal section (default: all)",
    )
    parser.add_argument(
        "--reverse-dns",
        choices=("system", "numeric"),
        default="system",
        help="numeric: the simulated nodes of every backend get bench/numeric_getnameinfo.c "
        "preloaded, so TCPStore's reverse lookups never reach this machine's resolver "
        "(default: system, as the machine resolves)",
    )
    parser.add_argument(
        "--py-spy",
        action="store_true",
        help="sample worker 0 and the operator with py-spy during the 1000-node rounds "
        "(diagnosis: sampling slows the round; raw samples in the logs directory)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out or (
        REPO / "bench" / "results" / ("" if args.mode == "full" else args.mode)
    )
    out.mkdir(parents=True, exist_ok=True)
    backends = [b for b in args.backends.split(",") if b]
    work = out / "logs"  # operator, worker and etcd logs (git-ignored)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    seal_sizes = tuple(int(n) for n in args.seal_sizes.split(",") if n)
    if args.reverse_dns == "numeric":
        pool.NODE_ENV["LD_PRELOAD"] = str(build_numeric_getnameinfo(work))
    runner = Runner(
        args.mode, out, backends, work, args.sections.split(","), seal_sizes, args.py_spy
    )
    runner.results["meta"]["reverse_dns"] = args.reverse_dns
    runner.log(f"mode {args.mode}: results into {out}; logs in {work}")
    results = runner.run()
    report.finish(results)
    dump(out / "results.json", results)
    (out / "results.md").write_text(report.markdown(results))
    report.plots(results, out)
    runner.log(f"wrote {out / 'results.json'}, results.md and plots")
    for target in results["targets"]:
        runner.log(f"target {target['name']}: {target['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
