"""What one hostile pod can make the operator spend, flood by flood (#30's findings 2, 3, 5).

    python -m bench.floods --label after    # into results/floods.json, under "after"

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
- ``warnings``: 300 unreadable requests under 300 made-up rendezvous names, each after a
  readable one (so each is news); the Warning Events posted in the namespace after the
  window.

For each: the operator's CPU seconds and peak RSS from the first write to the end of the
window (psutil, :class:`bench.cluster.Sampler`). The window is a measurement span, the
same for every commit compared, not a wait for anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from bench.cluster import Cluster, Sampler, dump
from devkit.waiting import wait_for
from k8s_rendezvous import state

RESULTS = Path(__file__).parent / "results" / "floods.json"
WINDOW_SECONDS = 30.0
LEASES = 2000
WARNINGS = 300
NO_SUCH_UID = "00000000-0000-4000-8000-000000000000"


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
            "labels": {state.NODE_LABEL: rendezvous},
            "annotations": {state.ENTRY_ANNOTATION: entry, state.POD_UID_ANNOTATION: self.uid},
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
                "apiVersion": state.API_VERSION,
                "kind": state.KIND,
                "name": rendezvous,
                "uid": NO_SUCH_UID,
            }
        ]
        create()
        return "owned by a Rendezvous that does not exist"


def count(cluster: Cluster, namespace: str, plural: str, group: str = state.GROUP) -> int:
    custom = kubernetes.client.CustomObjectsApi(cluster.admin)
    version = "v1" if group == "coordination.k8s.io" else state.VERSION
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


def run(cluster: Cluster, log: Callable[[str], None]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    namespace = cluster.new_namespace("slices")

    def slices() -> dict[str, Any]:
        for name in ("huge-a", "huge-b"):
            cluster.create_rendezvous(namespace, name, 1, 100_000)
        return {}

    results["slices"] = measured(cluster, slices) | {
        "slices_written": count(cluster, namespace, state.SLICE_PLURAL)
    }
    log(f"slices: {results['slices']}")

    namespace = cluster.new_namespace("leases")
    attacker = Attacker(cluster, namespace)
    entry = state.NodeEntry("flood", 1, "127.100.0.1", 29500).to_annotation()

    def leases() -> dict[str, Any]:
        with ThreadPoolExecutor(8) as writers:
            kinds = list(
                writers.map(lambda i: attacker.lease(f"made-up-{i}", entry), range(LEASES))
            )
        return {"leases_created": len(kinds), "leases_made": sorted(set(kinds))}

    started = time.monotonic()
    results["leases"] = measured(cluster, leases) | {
        "leases_left": count(cluster, namespace, "leases", "coordination.k8s.io")
    }
    if "no owner" not in results["leases"]["leases_made"]:
        results["leases"]["all_collected_after_seconds"] = round(
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
    log(f"leases: {results['leases']}")

    namespace = cluster.new_namespace("warnings")
    attacker = Attacker(cluster, namespace)

    def flood_warnings() -> dict[str, Any]:
        # A readable request between two unreadable ones makes the second news again.
        for i in range(WARNINGS):
            attacker.lease(f"bad-{i}", "{not json")
            attacker.lease(f"good-{i}", entry)
        return {"unreadable_requests": WARNINGS}

    results["warnings"] = measured(cluster, flood_warnings) | {
        "warning_events": warnings(cluster, namespace)
    }
    log(f"warnings: {results['warnings']}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the key the results go under")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="k8s-rdzv-floods-"))
    cluster = Cluster(workdir, lambda line: print(line, flush=True))
    try:
        cluster.start()
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=False,
        ).stdout.strip()
        results = {"commit": commit, "window_seconds": WINDOW_SECONDS} | run(
            cluster, lambda line: print(line, flush=True)
        )
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    dump(args.out, recorded | {args.label: results})
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
