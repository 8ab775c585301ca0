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
drawn in turn from a shuffled deck of every kind (``fault_schedule.FAULTS``; ``--deck``
deals some kinds more than once). Configurations
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
  leader ran on it has a row of its own (``goodput_measures.row_of``);
- the **invariant checks**: every world's ranks within 0..n-1, each held by one pod, and
  every step but the world's last logged by every rank (``goodput_measures.world_violations``);
  no two worlds training at once; for ours, the recorded Rendezvous history
  (devkit/invariants.py) and no sealed round keeping a member whose Pod is gone or terminal
  for more than ``goodput_measures.DEAD_MEMBER_GRACE`` s while the operator has a leader; at
  the end, a full world training (no agent stuck); and what the run left behind once its
  pods are gone (processes in their cgroups, network namespaces, k8s-rdzv-* entries of /tmp).

Rank 0 (and c10d's store host) is never a victim, nor is its node drained or lost: c10d's
rendezvous does not survive losing its store. Every torchrun runs with
``--max-restarts=100`` (a budget for hours, as long runs set it) in an Indexed Job with
``backoffLimitPerIndex: 100``.

Results: bench/results/goodput/ (results.json, results.md, timeline.png).

This module runs a configuration (:class:`Run`) and the command; the rest, by concern:
bench/fault_schedule.py (which faults, when), bench/faults.py (injected and repaired on the
real nodes), bench/goodput_measures.py (what the records say) and bench/goodput_report.py
(the tables and the timeline).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kubernetes.client  # noqa: E402

from bench import real_nodes  # noqa: E402
from bench.fault_schedule import FAULTS, GAP_SECONDS, Fault, deck, schedule  # noqa: E402
from bench.faults import Injector  # noqa: E402
from bench.goodput_measures import (  # noqa: E402
    FULL,
    STEP_SECONDS,
    Json,
    analyze,
    completed,
    dead_member_violations,
    member_gone,
    operator_outages,
    rank_zero_steps,
    read_lines,
    trained_full_world,
)
from bench.goodput_report import write  # noqa: E402
from devkit import chart, invariants, namespaces  # noqa: E402
from devkit.cluster.controlplane import dig, read_object, to_model  # noqa: E402
from devkit.nodepool import NodePool  # noqa: E402
from devkit.training import TrainingJob, create_job, job_manifest  # noqa: E402
from devkit.waiting import WaitTimeout, wait_for  # noqa: E402
from k8s_rendezvous.wire import objects, specs, statuses  # noqa: E402

TORCHRUN_ARGS = ("--max-restarts=100",)
OUT = REPO / "bench" / "results" / "goodput"
IN_PLACE_SCRIPT = REPO / "examples" / "elastic_train_in_place.py"


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
        self.faults = Injector(pool, api, self.namespace, seed, self.progress)
        self.violations: list[str] = []
        self._dead_members: dict[tuple[int, str], tuple[float, float]] = {}
        """(round, pod) of a sealed round's member seen dead -> (first, last) seen so."""
        self._pod_uids: set[str] = set()
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
        namespaces.bind_creator_role(self.api, self.namespace)
        kubernetes.client.AppsV1Api(self.api).create_namespaced_stateful_set(
            self.namespace, to_model(kubernetes.client.V1StatefulSet, manifest)
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
            self.faults.repair_all()
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
            self.faults.repair_due(now)
            if pending and pending[0].at <= now:
                fault = pending.pop(0)
                injected.append(self.faults.inject(job, protected, fault, began))
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
            wakes = [seconds, *(r[0] for r in self.faults.repairs), *(f.at for f in pending[:1])]
            time.sleep(min(max(0.0, min(wakes) - now), 1.0))

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
                body = read_object(
                    custom.get_namespaced_custom_object,
                    objects.GROUP,
                    objects.VERSION,
                    self.namespace,
                    objects.PLURAL,
                    self.name,
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
            listed = read_object(self.core.list_namespaced_event, self.namespace)
            (self.logs / "events.json").write_text(json.dumps(listed))
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
        self.faults.repair_all()
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


if __name__ == "__main__":
    sys.exit(main())
