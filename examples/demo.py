"""k8s-rendezvous end to end on this machine, as a user runs it: ``python examples/demo.py``
(repo root, venv, as root).

It starts a real Kubernetes control plane and two real nodes as local processes
(devkit/cluster: etcd, kube-apiserver, controller manager, scheduler; on each node a
kubelet, containerd and runc), builds the operator image from the Dockerfile, and then
does what a user does: ``helm install`` the chart, and create a Job annotated with
``k8s-rendezvous.dev/nodes`` whose 3 pods run plain ``torchrun examples/elastic_train.py``
with no rendezvous flag, in the Job docs/annotations.md recommends (Indexed, failures
counted per pod, disruptions not counted). It follows the world from the workers' own
progress lines, evicts one pod as a node drain does (the Job replaces it and counts no
failure), raises the Job's parallelism to 4, and prints
``kubectl get rdzv -o wide`` after each change. Everything it started is stopped by PID at
the end, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the demo runs on the dev kit (devkit/)

import kubernetes.client  # noqa: E402
import yaml  # noqa: E402

from devkit import chart  # noqa: E402
from devkit.cluster.controlplane import ControlPlane, build_binaries, build_helm  # noqa: E402
from devkit.cluster.nodes import build_node_binaries  # noqa: E402
from devkit.nodepool import NodePool, build_node_images  # noqa: E402
from devkit.training import TrainingJob, World, create_job, job_manifest  # noqa: E402
from devkit.waiting import wait_for  # noqa: E402

NAMESPACE = "demo"
JOB = "demo-train"
WAIT = 300.0
_t0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _t0:6.1f}s] {message}", flush=True)


def show(plane: ControlPlane, *args: str) -> None:
    result = plane.kubectl(*args, check=False)
    for line in (result.stdout or result.stderr).rstrip().splitlines():
        print(f"        {line}", flush=True)


def describe(world: World, job: TrainingJob) -> None:
    nodes = {pod["metadata"]["name"]: pod["spec"]["nodeName"] for pod in job.running_pods()}
    for rank, pod in sorted(world.pods.items()):
        say(f"    rank {rank}: pod {pod} on {nodes.get(pod, '?')}")


def run(plane: ControlPlane, workdir: Path) -> None:
    say("starting the control plane")
    plane.start()
    say(f"control plane up at {plane.server} in {plane.startup_seconds:.1f} s")
    say("building/locating the nodes' binaries and images (kubelet, containerd, runc; operator)")
    build_node_binaries()
    images = build_node_images()
    with plane.api_client() as api:
        helm = chart.Helm(build_helm(), workdir / "helm", plane.kubeconfig)
        pool = NodePool(plane, helm, api, images, workdir)
        try:
            say("starting 2 real nodes and: helm install k8s-rendezvous charts/k8s-rendezvous")
            pool.get(ipv6=False)
            show(plane, "get", "nodes", "-l", "k8s-rendezvous.dev/real-node", "-o", "wide")
            show(plane, "-n", chart.NAMESPACE, "get", "pods", "-o", "wide")
            train(plane, api, images["trainer"].reference)
        finally:
            say("stopping the nodes and the control plane")
            pool.close()


def train(plane: ControlPlane, api: kubernetes.client.ApiClient, trainer: str) -> None:
    plane.kubectl("create", "namespace", NAMESPACE)
    manifest = job_manifest(JOB, trainer, parallelism=3, nodes="2:4", production=True)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    say("creating the Job (its pods' container, abridged; the image is host userland):")
    print(
        "        "
        + yaml.safe_dump(
            {
                "metadata": manifest["metadata"],
                "spec": {k: v for k, v in manifest["spec"].items() if k != "template"},
                "command": container["command"],
            },
            sort_keys=False,
        ).replace("\n", "\n        "),
        flush=True,
    )
    started = time.time()
    job = create_job(api, NAMESPACE, manifest)
    world = job.wait_world(3, after=started, timeout=WAIT)
    say(
        f"training in a world of 3, {world.first_step - started:.1f} s after the Job was "
        f"created; master {world.master}"
    )
    describe(world, job)
    show(plane, "-n", NAMESPACE, "get", "rdzv", "-o", "wide")

    victim = world.pods[1]
    say(f"evicting pod {victim} (rank 1), as a node drain does: the Job makes a new one")
    deleted = time.time()
    kubernetes.client.CoreV1Api(api).create_namespaced_pod_eviction(
        victim,
        NAMESPACE,
        kubernetes.client.V1Eviction(
            metadata=kubernetes.client.V1ObjectMeta(name=victim, namespace=NAMESPACE)
        ),
    )
    first = wait_for(
        lambda: job.first_world(after=deleted), WAIT, "a world after the eviction", interval=0.5
    )
    took = first.first_step - deleted
    say(f"training in a world of {first.size}, {took:.1f} s after the eviction")
    world = job.wait_world(3, after=deleted, timeout=WAIT)
    say(f"training in a world of 3 again, {world.first_step - deleted:.1f} s after the eviction")
    describe(world, job)
    say("the Job counted no failure (its podFailurePolicy ignores disruptions):")
    show(
        plane,
        "-n",
        NAMESPACE,
        "get",
        "job",
        JOB,
        "-o",
        "custom-columns=ACTIVE:.status.active,FAILED:.status.failed,"
        "FAILED-INDEXES:.status.failedIndexes",
    )

    say("raising the Job's parallelism (and its completions: it is Indexed) to 4")
    raised = time.time()
    kubernetes.client.BatchV1Api(api).patch_namespaced_job(
        JOB, NAMESPACE, {"spec": {"parallelism": 4, "completions": 4}}
    )
    world = job.wait_world(4, after=raised, timeout=WAIT)
    say(f"training in a world of 4, {world.first_step - raised:.1f} s after the change")
    describe(world, job)
    show(plane, "-n", NAMESPACE, "get", "rdzv", "-o", "wide")
    show(
        plane,
        "-n",
        NAMESPACE,
        "get",
        "events",
        "--field-selector",
        "involvedObject.kind=Rendezvous",
    )
    kubernetes.client.BatchV1Api(api).delete_namespaced_job(
        JOB, NAMESPACE, propagation_policy="Foreground"
    )


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, _interrupt)
    say("building/locating the control-plane binaries (devkit/cluster/build.sh)")
    plane = ControlPlane(build_binaries(stream_log=True), keep_workdir=args.keep)
    workdir = Path(tempfile.mkdtemp(prefix="k8s-rdzv-demo-"))
    failure: BaseException | None = None
    try:
        run(plane, workdir)
    except KeyboardInterrupt:
        say("interrupted: stopping everything")
    except Exception as error:  # a wait that timed out, a step that did not start
        failure = error
    finally:
        plane.stop()
        if args.keep:
            say(f"stopped everything (logs in {plane.workdir}/logs and {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)  # helm's home and values: no mounts
            say("stopped everything")
    if failure is not None:
        notes = "".join(f"\n{note}" for note in getattr(failure, "__notes__", ()))
        print(f"\nDEMO FAILED: {type(failure).__name__}: {failure}{notes}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
