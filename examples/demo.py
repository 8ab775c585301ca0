"""k8s-rendezvous end to end on this machine: ``python examples/demo.py`` (repo root, venv).

It starts a real Kubernetes control plane as local processes (tests/cluster: etcd,
kube-apiserver, controller manager, scheduler and kwok's simulated nodes), installs the
Rendezvous CRD and the worker role, runs the operator, creates a Rendezvous admitting 2 to
4 nodes and starts three "pods": Pod objects on kwok nodes, each with a local ``torchrun
--rdzv-backend=kubernetes`` (2 gloo workers running examples/elastic_train.py) using that
pod's own credentials. Then it kills one node (its processes, and its Pod is deleted) and
adds another, printing every round the operator seals and ``kubectl get rdzv -o wide``.
Everything it started is stopped by PID at the end, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the demo reuses the test harness (tests/)

from tests.cluster.controlplane import ControlPlane, build_binaries  # noqa: E402
from tests.cluster.waiting import wait_for  # noqa: E402
from tests.e2e.harness import LocalPod, LocalPods, wait_all_exit, wait_world  # noqa: E402
from tests.support.fixtures import WORKLOAD_LABELS, Rendezvous  # noqa: E402
from tests.support.operator import OperatorProcess  # noqa: E402

from k8s_rendezvous import state  # noqa: E402

NAMESPACE = "demo"
RENDEZVOUS = "demo-job"
RENDEZVOUS_MANIFEST = f"""
apiVersion: {state.API_VERSION}
kind: {state.KIND}
metadata:
  name: {RENDEZVOUS}
  namespace: {NAMESPACE}
spec:
  runId: {RENDEZVOUS}
  minNodes: 2
  maxNodes: 4
  lastCallTimeoutSeconds: 5   # after minNodes joined, wait this long for more
  podSelector:                # the pods that may join: the demo's trainers
    matchLabels: {json.dumps(WORKLOAD_LABELS)}
"""
FIRST_NODES = {"trainer-0": "127.0.0.11", "trainer-1": "127.0.0.12", "trainer-2": "127.0.0.13"}
LATE_NODE = {"trainer-3": "127.0.0.14"}
WAIT = 180.0
_SEALED = re.compile(r"round (\d+) sealed .*?;(?: ([\d.]+) s after the first join;)?")

_t0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _t0:6.1f}s] {message}", flush=True)


class RoundReporter:
    """Prints each round as the operator seals it, and the MemberLost/Closed events."""

    def __init__(self, rendezvous: Rendezvous, plane: ControlPlane) -> None:
        self._rendezvous = rendezvous
        self._plane = plane
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-reporter", daemon=True)
        self.rounds_sealed = 0

    def __enter__(self) -> RoundReporter:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        seen_events: set[tuple[str, str, str]] = set()
        reported_round = 0
        while not self._stop.wait(0.1):
            try:
                status = self._rendezvous.status()
                events = self._rendezvous.events()
            except Exception as error:  # the demo goes on; the control plane may be stopping
                say(f"(could not read the Rendezvous: {error})")
                continue
            for event in events:
                if event not in seen_events and event[1] in ("MemberLost", "Closed"):
                    say(f"event {event[1]}: {event[2]}")
                seen_events.add(event)
            if status.round > reported_round and status.state is not state.RoundState.FORMING:
                took = {
                    int(match[1]): match[2]
                    for _, reason, message in events
                    if reason == "RoundSealed" and (match := _SEALED.search(message))
                }
                if status.round not in took and not self._stop.wait(0.2):
                    continue  # the RoundSealed event follows the status write: read it next
                reported_round = status.round
                self.rounds_sealed += 1
                self._print_round(status, took.get(status.round))

    def _print_round(self, status: state.RendezvousStatus, took: str | None) -> None:
        master = status.master.endpoint if status.master else "?"
        duration = f" {took} s after its first join" if took else ""
        say(f"round {status.round} sealed{duration}: {status.world_size} nodes, master {master}")
        for rank, member in enumerate(status.members):
            say(f"    group rank {rank}: {member.node} ({member.addr})")
        table = self._plane.kubectl("get", "rdzv", "-n", NAMESPACE, "-o", "wide", check=False)
        for line in (table.stdout or table.stderr).rstrip().splitlines():
            print(f"        {line}", flush=True)


def install(plane: ControlPlane) -> None:
    """What a cluster admin does once: CRD and worker role; a namespace whose pods may join."""
    crds = str(REPO / "manifests" / "crds")
    plane.kubectl("apply", "--server-side", "-f", crds)
    plane.kubectl("wait", "--for=condition=established", "-f", crds, "--timeout=60s")
    plane.kubectl(
        "apply", "--server-side", "-f", str(REPO / "manifests" / "rbac" / "worker-clusterrole.yaml")
    )
    plane.kubectl("create", "namespace", NAMESPACE)
    plane.kubectl(
        "-n",
        NAMESPACE,
        "create",
        "rolebinding",
        "k8s-rendezvous-worker",
        "--clusterrole=k8s-rendezvous-worker",
        f"--serviceaccount={NAMESPACE}:default",
    )
    wait_for(
        lambda: plane.kubectl("-n", NAMESPACE, "get", "sa", "default", check=False).returncode == 0,
        60,
        f"ServiceAccount {NAMESPACE}/default",
    )


def run(plane: ControlPlane, workdir: Path, steps: int) -> None:
    say("starting the control plane (etcd, kube-apiserver, controller manager, scheduler, kwok)")
    plane.start()
    say(f"control plane up at {plane.server} in {plane.startup_seconds:.1f} s")
    install(plane)
    operator = OperatorProcess(plane.kubeconfig, workdir / "operator.log", namespaces=(NAMESPACE,))
    operator.start()
    say(f"operator running (pid {operator.pid}); log {workdir / 'operator.log'}")
    api = plane.api_client()
    pods = LocalPods(plane, api, NAMESPACE, workdir / "pods")
    try:
        plane.kubectl("apply", "-f", "-", input=RENDEZVOUS_MANIFEST)
        rendezvous = Rendezvous(api, NAMESPACE, RENDEZVOUS)
        say(f"created Rendezvous {NAMESPACE}/{RENDEZVOUS} (minNodes 2, maxNodes 4)")
        with RoundReporter(rendezvous, plane) as reporter:
            script = ["--steps", str(steps)]
            started = time.time()
            say(
                f"starting {len(FIRST_NODES)} pods, each: torchrun --nnodes=2:4 "
                f"--nproc-per-node=2 --rdzv-backend=kubernetes --rdzv-endpoint={RENDEZVOUS} "
                "examples/elastic_train.py"
            )
            nodes = pods.start(RENDEZVOUS, FIRST_NODES, script_args=script)
            world = wait_world(nodes, 6, after=started, timeout=WAIT)
            say(
                f"training in a world of 6 ranks ({world.first_step_at - started:.1f} s after "
                f"the pods started); master {world.masters.pop()}"
            )

            victim = next(n for n in nodes if world.group_ranks[n.name] == 1)
            survivors = [n for n in nodes if n is not victim]
            say(f"killing {victim.name} (group rank 1): SIGKILL its processes, delete its Pod")
            killed = time.time()
            victim.kill()
            world = wait_world(survivors, 4, after=killed, timeout=WAIT)
            say(
                f"training in a world of 4 ranks, {world.first_step_at - killed:.1f} s after "
                "the kill"
            )

            say(f"adding {next(iter(LATE_NODE))}")
            added = time.time()
            late = pods.start(RENDEZVOUS, LATE_NODE, script_args=script)
            everyone: list[LocalPod] = [*survivors, *late]
            world = wait_world(everyone, 6, after=added, timeout=WAIT)
            say(
                f"training in a world of 6 ranks, {world.first_step_at - added:.1f} s after "
                "the new pod started"
            )

            codes = wait_all_exit(everyone, WAIT)
            say(f"torchrun exit codes: {codes}")
            wait_for(
                lambda: rendezvous.status().state is state.RoundState.CLOSED,
                30,
                "the rendezvous to close once every node left",
            )
            time.sleep(0.3)  # let the reporter print the last events
            say(f"{reporter.rounds_sealed} rounds sealed; final state:")
        print(plane.kubectl("get", "rdzv", "-n", NAMESPACE, "-o", "wide").stdout, flush=True)
        if any(codes.values()):
            raise SystemExit(f"some torchrun failed: {codes}")
    finally:
        pods.stop_all()
        operator.stop()
        api.close()  # type: ignore[no-untyped-call]


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=100,
        help="training steps per world (0.2 s each); enough for a pod to join",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, _interrupt)
    say("building/locating the control-plane binaries (tests/cluster/build.sh)")
    binaries = build_binaries(stream_log=True)
    workdir = Path(tempfile.mkdtemp(prefix="k8s-rdzv-demo-"))
    plane = ControlPlane(binaries, keep_workdir=args.keep)
    failure: BaseException | None = None
    try:
        run(plane, workdir, args.steps)
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
    except (AssertionError, SystemExit) as error:  # a wait that timed out, a failed torchrun
        failure = error
    finally:
        plane.stop()
        if failure is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
            say("stopped everything")
        else:
            say(f"stopped everything; logs of the operator and the pods in {workdir}")
    if failure is not None:
        print(f"\nDEMO FAILED: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
