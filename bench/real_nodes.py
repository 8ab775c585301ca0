"""Real nodes: from a real fault to training resumed, ours beside torch's c10d.

    python bench/real_nodes.py                 # every fault, both backends, 1 repetition
    python bench/real_nodes.py --faults pod,node --reps 3

Needs root (the real nodes of devkit/cluster/nodes.py). It starts a control plane with two
real nodes, installs the chart with the operator image built here, and for each fault and
backend runs a Job of 4 pods (2 per node, ``--nnodes=2:4``, one gloo worker each) training
examples/elastic_train.py, injects the fault once the world trains, and records, by this
host's clock, when the API server first shows:

- the kubelet's report: the killed container terminated, a deleted or evicted pod gone
  (its kubelet has stopped it), or a lost node not Ready (by the node controller, which
  notices the kubelet's silence);
- the member lost (ours only): the Rendezvous turns Reforming;
- the round sealed (ours only): the next round Sealed;
- the first training step in the new world: the workers' own progress lines (the last
  rank's first step of the first world whose workers started after the fault).

The victim is never rank 0 or c10d's store host: losing those is another scenario, and
c10d's rendezvous does not survive it at all. torchrun runs with --max-restarts=3 for both
backends and their defaults otherwise. There is no DNS here, so c10d runs as users run it
without one: its endpoint is the host pod's IP (the pods get it from a file this script
writes once that pod runs, where a cluster would resolve a headless Service's name), and
each node gives its pod's IP as ``--local-addr`` (c10d otherwise hands out hostnames,
which nothing resolves: its workers then never reach rank 0's store), and with a store per
round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; bench/recovery.py says why).

Results: bench/results/real-nodes/ (results.json, results.md, timeline.png).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kubernetes.client  # noqa: E402
import kubernetes.watch  # noqa: E402

from bench import faults, recovery  # noqa: E402
from devkit import chart, namespaces  # noqa: E402
from devkit.cluster.controlplane import (  # noqa: E402
    ControlPlane,
    build_binaries,
    build_helm,
    dig,
    read_object,
)
from devkit.nodepool import NodePool, build_node_images  # noqa: E402
from devkit.training import (  # noqa: E402
    TrainingJob,
    World,
    agent_pid,
    create_job,
    job_manifest,
    operator_leader,
    wait_webhook_served_by_leader_alone,
    worker_pid,
)
from devkit.waiting import WaitTimeout, wait_for  # noqa: E402
from k8s_rendezvous.wire import objects, statuses  # noqa: E402

FAULTS = {
    "worker": "a worker SIGKILLed in its container",
    "container": "the agent's container SIGKILLed (restartPolicy Never)",
    "pod": "the pod deleted",
    "drain": "its node drained (eviction API)",
    "node": "its node lost (kubelet killed, network cut)",
}
BACKENDS = ("ours", "c10d")
PODS = 4
TORCHRUN_ARGS = ("--max-restarts=3",)
C10D_PORT = 29400
CAP_SECONDS = {"node": 480.0}
DEFAULT_CAP_SECONDS = 180.0
OUT = REPO / "bench" / "results" / "real-nodes"
Json = dict[str, Any]


class Milestones:
    """The first time (host clock) each named event is seen after ``since``."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, name: str, at: float | None = None) -> None:
        with self._lock:
            self.seen.setdefault(name, time.time() if at is None else at)

    def after(self) -> dict[str, float]:
        return {name: round(t - self.since, 3) for name, t in sorted(self.seen.items())}


def watch_in_thread(
    stop: threading.Event, stream: Callable[[], Any], on: Callable[[Json], None]
) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            watcher = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
            try:
                for event in stream_with(watcher, stream):
                    if stop.is_set():
                        break
                    on(event)
            except Exception:  # a watch dropped: start it again, until stopped
                time.sleep(0.1)
            finally:
                watcher.stop()  # type: ignore[no-untyped-call]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def stream_with(watcher: kubernetes.watch.Watch, stream: Callable[[], Any]) -> Any:
    method, args, kwargs = stream()
    return watcher.stream(method, *args, timeout_seconds=60, **kwargs)  # type: ignore[no-untyped-call]


class Run:
    """One fault, one backend: a Job, its world, the fault, and what followed."""

    def __init__(
        self, pool: NodePool, api: kubernetes.client.ApiClient, backend: str, fault: str
    ) -> None:
        self.pool = pool
        self.api = api
        self.backend = backend
        self.fault = fault
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = f"bench-{uuid.uuid4().hex[:8]}"
        self.name = f"{backend}-{fault}"
        self.shared = Path(tempfile.mkdtemp(prefix="k8s-rdzv-bench-"))
        self.shared.chmod(0o755)
        self.formed = False
        """Whether the Job's first world formed (else the fault was never injected)."""

    def manifest(self) -> Json:
        trainer = self.pool.images["trainer"].reference
        common: Json = {
            "parallelism": PODS,
            "nodes": f"2:{PODS}",
            "torchrun_args": TORCHRUN_ARGS,
        }
        manifest = job_manifest(self.name, trainer, **common)
        if self.backend == "c10d":
            as_c10d(manifest, self.name, f"2:{PODS}", self.shared)
        return manifest

    def start(self) -> tuple[TrainingJob, World, str]:
        """The Job training in a world of PODS; returns it, its world and the pod that
        must not be the victim (rank 0, or c10d's store host)."""
        namespaces.create(self.api, self.namespace)
        job = create_job(self.api, self.namespace, self.manifest())
        protected = ""
        if self.backend == "c10d":
            pods = _wait(
                lambda: job.running_pods() if len(job.running_pods()) == PODS else None,
                120,
                "pods running",
            )
            host = pods[0]
            protected = host["metadata"]["name"]
            address = host["status"]["podIP"]
            (self.shared / "endpoint").write_text(f"{_bracketed(address)}:{C10D_PORT}\n")
        world = job.wait_world(PODS, after=0, timeout=300)
        return job, world, protected or world.pods[0]

    def victim(self, job: TrainingJob, protected: str) -> Json:
        pods = job.running_pods()
        if self.fault in ("drain", "node"):
            guarded = next(p for p in pods if p["metadata"]["name"] == protected)
            return next(p for p in pods if p["spec"]["nodeName"] != guarded["spec"]["nodeName"])
        return next(p for p in pods if p["metadata"]["name"] != protected)

    def measure_or_error(self) -> Json:
        """What :meth:`measure` found, or the error that ended it (the next run goes on)."""
        try:
            return self.measure()
        except Exception as error:
            with contextlib.suppress(kubernetes.client.exceptions.ApiException):
                self.core.delete_namespace(self.namespace, grace_period_seconds=0)
            return {
                "backend": self.backend,
                "fault": self.fault,
                "error": f"{type(error).__name__}: {error}"[:2000],
                "formed": self.formed,
                "milestones": {},
                "world_before": None,
                "world_after": None,
                "cap_seconds": CAP_SECONDS.get(self.fault, DEFAULT_CAP_SECONDS),
            }

    def measure(self) -> Json:
        job, world, protected = self.start()
        self.formed = True
        victim = self.victim(job, protected)
        victim_name = victim["metadata"]["name"]
        node = victim["spec"]["nodeName"]
        stop = threading.Event()
        rendezvous_before = self._round() if self.backend == "ours" else None
        leader_node = self._leader_node()
        milestones = Milestones(time.time())
        self._observe(stop, milestones, victim, node, rendezvous_before)
        try:
            milestones.since = self._inject(job, victim, node)
            cap = CAP_SECONDS.get(self.fault, DEFAULT_CAP_SECONDS)
            first = _wait_or_none(lambda: job.first_world(after=milestones.since), cap)
            if first is not None:
                milestones.mark("first step", first.first_step)
        finally:
            stop.set()
            self._repair(node)
        return {
            "backend": self.backend,
            "fault": self.fault,
            "victim": victim_name,
            "node": node,
            "leader_node": leader_node,
            "world_before": world.size,
            "world_after": first.size if first is not None else None,
            "milestones": milestones.after(),
            "cap_seconds": CAP_SECONDS.get(self.fault, DEFAULT_CAP_SECONDS),
        }

    def _leader_node(self) -> str:
        """The node of the operator's leader: losing it, the other replica takes over
        (after the leader's Lease runs out) before anything is noticed."""
        leader = operator_leader(self.api)
        return str(
            dig(
                read_object(self.core.read_namespaced_pod, leader, chart.NAMESPACE),
                "spec",
                "nodeName",
            )
        )

    def _round(self) -> int:
        body = kubernetes.client.CustomObjectsApi(self.api).get_namespaced_custom_object(
            objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL, self.name
        )
        return int(dig(body, "status", "round", default=0))

    def _observe(
        self,
        stop: threading.Event,
        marks: Milestones,
        victim: Json,
        node: str,
        round_before: int | None,
    ) -> None:
        name = victim["metadata"]["name"]

        def on_pod(event: Json) -> None:
            pod = event["object"]
            if pod.metadata.name != name:
                return
            if event["type"] == "DELETED":
                marks.mark("kubelet report")
                return
            for status in pod.status.container_statuses or []:
                ended = (status.state and status.state.terminated) or (
                    status.last_state and status.last_state.terminated
                )
                if ended and self.fault == "container":
                    marks.mark("kubelet report")

        watch_in_thread(
            stop,
            lambda: (
                self.core.list_namespaced_pod,
                (self.namespace,),
                {"field_selector": f"metadata.name={name}"},
            ),
            on_pod,
        )
        if round_before is not None:
            custom = kubernetes.client.CustomObjectsApi(self.api)

            def on_rendezvous(event: Json) -> None:
                status = event["object"].get("status") or {}
                if status.get("state") == statuses.RoundState.REFORMING.value:
                    marks.mark("member lost")
                if (
                    status.get("state") == statuses.RoundState.SEALED.value
                    and int(status.get("round", 0)) > round_before
                ):
                    marks.mark("round sealed")

            watch_in_thread(
                stop,
                lambda: (
                    custom.list_namespaced_custom_object,
                    (objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL),
                    {"field_selector": f"metadata.name={self.name}"},
                ),
                on_rendezvous,
            )
        if self.fault == "node":

            def on_node(event: Json) -> None:
                for condition in event["object"].status.conditions or []:
                    if condition.type == "Ready" and condition.status != "True":
                        marks.mark("kubelet report")

            watch_in_thread(
                stop,
                lambda: (self.core.list_node, (), {"field_selector": f"metadata.name={node}"}),
                on_node,
            )

    def _inject(self, job: TrainingJob, victim: Json, node: str) -> float:
        nodes = self.pool.nodes
        assert nodes is not None
        name = victim["metadata"]["name"]
        if self.fault == "worker":
            pid = worker_pid(victim)
            at = time.time()
            _kill(pid)
        elif self.fault == "container":
            pid = agent_pid(victim)
            at = time.time()
            _kill(pid)
        elif self.fault == "pod":
            at = time.time()
            self.core.delete_namespaced_pod(name, self.namespace)
        elif self.fault == "drain":
            at = time.time()
            self.pool.control_plane.kubectl("cordon", node)
            faults.evict(self.core, self.namespace, name)
        else:
            at = time.time()
            faults.lose_node(nodes, node)
        return at

    def _repair(self, node: str) -> None:
        nodes = self.pool.nodes
        assert nodes is not None
        if self.fault == "node":
            nodes.restore_network(node)
            nodes.start_kubelet(node)
            wait_webhook_served_by_leader_alone(self.core.api_client)
        if self.fault == "drain":
            self.pool.control_plane.kubectl("uncordon", node)
        with contextlib.suppress(kubernetes.client.exceptions.ApiException):
            self.core.delete_namespace(self.namespace, grace_period_seconds=0)
        shutil.rmtree(self.shared, ignore_errors=True)


def as_c10d(manifest: Json, run_id: str, nnodes: str, shared: Path, conf: str = "") -> None:
    """``manifest`` (a Job of :func:`devkit.training.job_manifest`) changed in place to run
    torch's c10d backend as users run it without a cluster DNS: not annotated (the operator
    leaves it alone), its endpoint the host pod's IP, read from ``shared``/endpoint once
    the harness writes it there, each node's pod IP as ``--local-addr``, a store per round;
    ``conf`` is its ``--rdzv-conf``."""
    spec = manifest["spec"]["template"]["spec"]
    container = spec["containers"][0]
    manifest["metadata"]["annotations"] = {}
    torchrun = container["command"]
    command = " ".join(
        [
            torchrun[0],
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$(cat /bench/endpoint)"',
            # c10d hands out each node's hostname, which only a cluster DNS (a headless
            # Service) resolves; without one, users give the pod's IP.
            '--local-addr="$POD_IP"',
            f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}",
            *([f"--rdzv-conf={conf}"] if conf else []),
            *torchrun[1:],
        ]
    )
    container["command"] = [
        "/bin/sh",
        "-c",
        f"while [ ! -s /bench/endpoint ]; do sleep 0.1; done; exec {command}",
    ]
    container["env"] += [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # A store per round: with c10d's shared one, a new world's gloo group reads the
        # last world's addresses and never forms (bench/recovery.py).
        *({"name": name, "value": value} for name, value in recovery.C10D_OWN_STORE_ENV.items()),
    ]
    spec["volumes"].append(
        {"name": "bench", "hostPath": {"path": str(shared), "type": "Directory"}}
    )
    container["volumeMounts"].append({"name": "bench", "mountPath": "/bench", "readOnly": True})


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """``predicate``'s first truthy value, polled every 0.2 s (an API error counts as
    not yet)."""
    return wait_for(
        predicate,
        timeout,
        what,
        interval=0.2,
        max_interval=0.2,
        ignore=(kubernetes.client.exceptions.ApiException,),
    )


def _wait_or_none(predicate: Callable[[], Any], timeout: float) -> Any:
    """As :func:`_wait`, but None once ``timeout`` has passed."""
    try:
        return _wait(predicate, timeout, "")
    except WaitTimeout:
        return None


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _leader_lost(result: Json) -> bool:
    node = result.get("node")
    lost = result["fault"] in ("node", "drain") and node is not None
    return lost and result.get("leader_node") == node


def _row(label: str, backend: str, rows: list[Json], columns: tuple[str, ...]) -> str:
    cells = []
    for column in columns:
        values = [r["milestones"][column] for r in rows if column in r["milestones"]]
        if values:
            cell = f"{statistics.median(values):.2f}"
            if len(values) > 1:
                cell += f" ({min(values):.2f}-{max(values):.2f})"
        elif column == "first step" and any(r.get("error") for r in rows):
            cell = "error (results.json)"
        elif column == "first step":
            cell = f"none within {rows[0]['cap_seconds']:.0f}"
        else:
            cell = "-"
        cells.append(cell)
    after = ", ".join(str(r["world_after"]) for r in rows)
    world = f"{rows[0]['world_before']} → {after}"
    return f"| {label} | {backend} | " + " | ".join(cells) + f" | {world} |"


def table(results: list[Json]) -> str:
    columns = ("kubelet report", "member lost", "round sealed", "first step")
    lines = [
        "| fault | backend | " + " | ".join(columns) + " | world before → after |",
        "|---|---|" + "---|" * len(columns) + "---|",
    ]
    for fault in FAULTS:
        for backend in BACKENDS:
            # Losing the node of the operator's leader is another scenario: its own row.
            for leader_lost in (False, True):
                rows = [
                    r
                    for r in results
                    if (r["fault"], r["backend"]) == (fault, backend)
                    and _leader_lost(r) == leader_lost
                ]
                if rows:
                    label = FAULTS[fault] + (", the operator's leader on it" if leader_lost else "")
                    lines.append(_row(label, backend, rows, columns))
    return "\n".join(lines)


def plot(results: list[Json], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = list(results)
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    markers = {"kubelet report": "s", "member lost": "v", "round sealed": "D", "first step": "o"}
    for y, row in enumerate(rows):
        end = row["milestones"].get("first step", row["cap_seconds"])
        ax.barh(y, end, color="tab:blue" if row["backend"] == "ours" else "tab:orange", alpha=0.3)
        for name, marker in markers.items():
            if name in row["milestones"]:
                ax.plot(
                    row["milestones"][name],
                    y,
                    marker=marker,
                    color="black",
                    linestyle="none",
                    label=name if y == 0 else None,
                )
    ax.set_yticks(range(len(rows)), [f"{r['fault']} / {r['backend']}" for r in rows])
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("seconds after the fault (symlog)")
    handles = [Line2D([], [], marker=m, color="black", linestyle="none") for m in markers.values()]
    ax.legend(handles, list(markers), loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def real_node_pool(
    restart_delay_cap: int | None = None,
) -> Iterator[tuple[kubernetes.client.ApiClient, NodePool]]:
    """A control plane with two real nodes (their kubelets' ``restart_delay_cap``, see
    RealNodes) and the chart installed with the operator image built here; everything
    stopped on the way out."""
    images = build_node_images()
    plane = ControlPlane(build_binaries())
    plane.start()
    try:
        with (
            plane.api_client() as api,
            tempfile.TemporaryDirectory(prefix="helm-", ignore_cleanup_errors=True) as helm_home,
            tempfile.TemporaryDirectory(
                prefix="bench-nodes-", ignore_cleanup_errors=True
            ) as nodes_home,
        ):
            plane.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "crds"))
            helm = chart.Helm(build_helm(), Path(helm_home), plane.kubeconfig)
            pool = NodePool(plane, helm, api, images, Path(nodes_home), restart_delay_cap)
            pool.get(ipv6=False)
            try:
                yield api, pool
            finally:
                pool.close()
    finally:
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    faults = args.faults.split(",")
    backends = args.backends.split(",")
    results: list[Json] = []
    unformed: dict[str, Json] = {}  # backend -> its run whose first world never formed
    started = time.time()
    with real_node_pool() as (api, pool):
        for rep in range(args.reps):
            for fault in faults:
                for backend in backends:
                    print(f"[real-nodes] rep {rep + 1}: {fault} / {backend}", flush=True)
                    if backend in unformed:  # minutes each, to fail the same way
                        results.append({**unformed[backend], "fault": fault})
                        continue
                    result = Run(pool, api, backend, fault).measure_or_error()
                    if result.get("formed") is False:
                        unformed[backend] = result
                    print(f"[real-nodes]   {json.dumps(result)[:600]}", flush=True)
                    results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/real_nodes.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.time() - started, 1),
    }
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
    )
    plot(results, args.out / "timeline.png")
    (args.out / "results.md").write_text(
        f"# Real nodes: from a fault to training resumed\n\n{meta['date']}, `{meta['command']}` "
        f"({meta['seconds']:.0f} s). Seconds after the fault, median (range) of "
        f"{args.reps} repetition(s); how they are measured: bench/real_nodes.py.\n\n"
        + table(results)
        + "\n\n![timeline](timeline.png)\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
