"""What one hostile pod can make the operator spend, flood by flood (#30's findings 2, 3, 5).

    python -m bench.probes.floods --label after    # into results/floods.json, under "after"

The figures "before" are this script run from a checkout of the commit before #30's fixes
(1173ab1) with that tree on PYTHONPATH, the repository's --out given.

The real control plane with the admission policies, and the operator as its own process
(:class:`bench.cluster.Cluster`). One pod on a kwok node writes with its own pod-bound
token, as the worker role lets it; each flood runs in a namespace of its own:

- ``slices``: two Rendezvous admitting 100000 nodes, as any pod with the creator role may
  make (made here by the admin: the spec is what counts); RendezvousSlices in the
  namespace after a fixed window, with no node joining.
- ``leases``: 2,000 Leases for made-up rendezvous, each ``<name>.<pod>`` as the policy
  lets a pod name them, with a readable request. Made without an owner if the policy admits
  that, else owned by a Rendezvous that does not exist; how many remain after the window,
  and when the garbage collector has taken the last (if it takes them).
- ``webhook``: the operator started anew serving its admission webhook on 127.0.0.1, and 8
  clients that reach the port (any client can: no token is needed) posting AdmissionReviews
  of pods of made-up Jobs for 15 s, over kept-alive connections; reviews answered a second,
  the operator's share of a core, and the GETs of Jobs the API server received meanwhile.
  ``webhook-no-job``: the same with pods that name no Job as their controller.
- ``warnings``: 300 unreadable requests under 300 made-up rendezvous names, each after a
  readable one (so each is news); the Warning Events posted in the namespace after the
  window.

For each: the operator's CPU seconds and peak RSS from the first write to the end of the
window (psutil, :class:`bench.cluster.Sampler`). The window is a measurement span, the
same for every commit compared, not a wait for anything.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from bench.cluster import OPERATOR_METRICS_PORT, Cluster, Sampler, dump
from devkit.admission import pod_review
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.wire import leases, objects

RESULTS = Path(__file__).parents[1] / "results" / "floods.json"
WINDOW_SECONDS = 30.0
LEASES = 2000
WARNINGS = 300
NO_SUCH_UID = "00000000-0000-4000-8000-000000000000"
READABLE = leases.NodeEntry("flood", 1, "127.100.0.1", 29500).to_annotation()
"""A request the operator can read."""
WEBHOOK_SECONDS = 15.0
WEBHOOK_CLIENTS = 8


class Attacker:
    """One pod's API client, with its pod-bound token."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        (pod,) = cluster.create_pods(namespace, {"attacker": "none"}, {"attacker": "127.100.0.1"})
        self.name, self.uid, self.namespace = pod.name, pod.uid, namespace
        configuration = kubernetes.client.Configuration()
        configuration.host = cluster.server
        configuration.ssl_ca_cert = cluster.ca_file
        configuration.api_key = {"authorization": f"Bearer {pod.token}"}
        configuration.connection_pool_maxsize = 8
        self.custom = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))

    def lease(self, rendezvous: str, entry: str) -> str:
        """Create ``<rendezvous>.<pod>`` with ``entry``: without an owner if the policy
        admits it, else owned by a Rendezvous that does not exist. Says which."""
        metadata: dict[str, Any] = {
            "name": f"{rendezvous}.{self.name}",
            "labels": {objects.NODE_LABEL: rendezvous},
            "annotations": {objects.ENTRY_ANNOTATION: entry, objects.POD_UID_ANNOTATION: self.uid},
        }
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 30},
        }

        def create() -> None:
            self.custom.create_namespaced_custom_object(
                "coordination.k8s.io", "v1", self.namespace, "leases", body
            )

        try:
            create()
            return "no owner"
        except ApiException as error:
            if error.status != 403:
                raise
        metadata["ownerReferences"] = [
            {
                "apiVersion": objects.API_VERSION,
                "kind": objects.KIND,
                "name": rendezvous,
                "uid": NO_SUCH_UID,
            }
        ]
        create()
        return "owned by a Rendezvous that does not exist"


def count(cluster: Cluster, namespace: str, plural: str, group: str = objects.GROUP) -> int:
    custom = kubernetes.client.CustomObjectsApi(cluster.admin)
    version = "v1" if group == "coordination.k8s.io" else objects.VERSION
    found = cast(
        dict[str, Any], custom.list_namespaced_custom_object(group, version, namespace, plural)
    )
    return len(found["items"])


def warnings(cluster: Cluster, namespace: str) -> int:
    events = kubernetes.client.CoreV1Api(cluster.admin).list_namespaced_event(namespace)
    return sum(1 for event in events.items if event.type == "Warning")


def measured(cluster: Cluster, flood: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``flood`` and keep sampling to the end of the window."""
    assert cluster.operator is not None and cluster.operator.pid is not None
    started = time.monotonic()
    with Sampler({"operator": [cluster.operator.pid]}) as sampler:
        result = flood()
        written = time.monotonic() - started
        time.sleep(max(0.0, WINDOW_SECONDS - written))  # the measurement span
    operator = sampler.summary()["operator"]
    return result | {
        "writes_seconds": round(written, 1),
        "operator_cpu_seconds": operator["cpu_seconds"],
        "operator_peak_rss_mb": operator["peak_rss_mb"],
    }


def review(namespace: str, of_a_job: bool = True) -> bytes:
    """A review of a pod of a made-up Job (its controller, unless not ``of_a_job``)."""
    job = f"made-up-{uuid.uuid4().hex[:8]}"
    return json.dumps(pod_review(namespace, job, str(uuid.uuid4()), controller=of_a_job)).encode()


def serve_webhook(cluster: Cluster) -> int:
    """Start the operator anew with its webhook on 127.0.0.1; its port once it answers."""
    assert cluster.plane is not None and cluster.operator is not None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    cluster.operator.stop()
    cluster.operator = OperatorProcess(
        cluster.plane.kubeconfig,
        cluster.workdir / "operator-webhook.log",
        extra_args=(
            f"--metrics-port={OPERATOR_METRICS_PORT}",
            "--webhook",
            "--webhook-host=127.0.0.1",
            "--webhook-addr=127.0.0.1",
            f"--webhook-port={port}",
        ),
        verbose=False,
    )
    cluster.operator.start()

    def answers() -> bool:
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=TLS, timeout=5)
        try:
            connection.request("POST", "/torchrun-env", review("default"))
            return connection.getresponse().status == 200
        finally:
            connection.close()

    wait_for(answers, 180, "the webhook answers", ignore=(OSError, http.client.HTTPException))
    return port


TLS = ssl.create_default_context()
TLS.check_hostname = False
TLS.verify_mode = ssl.CERT_NONE  # whoever reaches the port need not trust its certificate


def flood_webhook(cluster: Cluster, of_a_job: bool) -> dict[str, Any]:
    port = serve_webhook(cluster)
    assert cluster.operator is not None and cluster.operator.pid is not None
    answered = [0] * WEBHOOK_CLIENTS
    stop = threading.Event()

    def client(index: int) -> None:
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=TLS, timeout=30)
        while not stop.is_set():
            connection.request("POST", "/torchrun-env", review("default", of_a_job))
            connection.getresponse().read()
            answered[index] += 1
        connection.close()

    gets_before = cluster.metrics().requests().get("GET jobs", 0.0)
    with Sampler({"operator": [cluster.operator.pid]}) as sampler:
        clients = [threading.Thread(target=client, args=(i,)) for i in range(WEBHOOK_CLIENTS)]
        for thread in clients:
            thread.start()
        stop.wait(WEBHOOK_SECONDS)  # the measurement span
        stop.set()
        for thread in clients:
            thread.join()
    operator = sampler.summary()["operator"]
    return {
        "reviews_per_second": round(sum(answered) / WEBHOOK_SECONDS, 1),
        "operator_cpu_percent": operator["mean_cpu_percent"],
        "operator_peak_rss_mb": operator["peak_rss_mb"],
        "job_gets": cluster.metrics().requests().get("GET jobs", 0.0) - gets_before,
    }


def run(cluster: Cluster, log: Callable[[str], None], cases: set[str]) -> dict[str, Any]:
    floods: dict[str, Callable[[Cluster], dict[str, Any]]] = {
        "slices": flood_slices,
        "leases": flood_leases,
        "warnings": flood_warnings,
        # Last: they start the operator anew.
        "webhook": lambda cluster: flood_webhook(cluster, of_a_job=True),
        "webhook-no-job": lambda cluster: flood_webhook(cluster, of_a_job=False),
    }
    results: dict[str, Any] = {}
    for name, flood in floods.items():
        if name in cases:
            results[name] = flood(cluster)
            log(f"{name}: {results[name]}")
    return results


def flood_slices(cluster: Cluster) -> dict[str, Any]:
    namespace = cluster.new_namespace("slices")

    def slices() -> dict[str, Any]:
        for name in ("huge-a", "huge-b"):
            cluster.create_rendezvous(namespace, name, 1, 100_000)
        return {}

    return measured(cluster, slices) | {
        "slices_written": count(cluster, namespace, objects.SLICE_PLURAL)
    }


def flood_leases(cluster: Cluster) -> dict[str, Any]:
    namespace = cluster.new_namespace("leases")
    attacker = Attacker(cluster, namespace)

    def leases() -> dict[str, Any]:
        with ThreadPoolExecutor(8) as writers:
            kinds = list(
                writers.map(lambda i: attacker.lease(f"made-up-{i}", READABLE), range(LEASES))
            )
        return {"leases_created": len(kinds), "leases_made": sorted(set(kinds))}

    started = time.monotonic()
    results = measured(cluster, leases) | {
        "leases_left": count(cluster, namespace, "leases", "coordination.k8s.io")
    }
    if "no owner" not in results["leases_made"]:
        results["all_collected_after_seconds"] = round(
            wait_for(
                lambda: (
                    count(cluster, namespace, "leases", "coordination.k8s.io") == 0
                    and time.monotonic() - started
                ),
                600,
                "the garbage collector takes every Lease",
                interval=1,
                max_interval=1,
            ),
            1,
        )
    return results


def flood_warnings(cluster: Cluster) -> dict[str, Any]:
    namespace = cluster.new_namespace("warnings")
    attacker = Attacker(cluster, namespace)

    def unreadable() -> dict[str, Any]:
        # A readable request between two unreadable ones makes the second news again.
        for i in range(WARNINGS):
            attacker.lease(f"bad-{i}", "{not json")
            attacker.lease(f"good-{i}", READABLE)
        return {"unreadable_requests": WARNINGS}

    return measured(cluster, unreadable) | {"warning_events": warnings(cluster, namespace)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the key the results go under")
    parser.add_argument("--out", type=Path, default=RESULTS)
    cases = ("slices", "leases", "warnings", "webhook", "webhook-no-job")
    parser.add_argument("--cases", nargs="+", choices=cases, default=list(cases))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="k8s-rdzv-floods-"))
    cluster = Cluster(workdir, lambda line: print(line, flush=True))
    try:
        cluster.start()
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[1],
            check=False,
        ).stdout.strip()
        results = {"commit": commit, "window_seconds": WINDOW_SECONDS} | run(
            cluster, lambda line: print(line, flush=True), set(args.cases)
        )
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    dump(args.out, recorded | {args.label: recorded.get(args.label, {}) | results})
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
