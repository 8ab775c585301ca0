"""One sealed round of 1000 members delivered to 1000 watching nodes, and nothing else.

``python -m bench.probes.fanout`` (output committed as ``results/fanout.json``) isolates the part
of the 1000-node round that comes after the seal: every node's watch receives the sealed
status (about 124 kB) and the node reads its own entry from it
(:class:`k8s_rendezvous.wire.views.NodeView`), exactly as the handler's round watcher does,
through :meth:`k8s_rendezvous.kube.RendezvousClient.watch_unless`. No operator, no joins,
no store: one status write by the admin, watched on the real API server.

The watchers are threads in worker processes, as the scale section's simulated nodes are;
the probe varies how they are packed (1 node alone; 125 in one process; 1000 in 8
processes of 125, the scale section's layout; 1000 in 16 of 63), and whether the round is
delivered whole or, as the operator publishes a rendezvous above 100 nodes, in 10
RendezvousSlices, each node watching its own. For each it reports the time from the
status write to the last node holding the round (the slices' writes included), and the
CPU that each node's watch thread spent (``time.thread_time()``) from the write to
holding it. A node in a pod of its own pays the first figure; the difference is what
packing nodes into threads on two cores adds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

MEMBERS = 1000
LAYOUTS = ((1, 1, 0), (1, 125, 0), (8, 125, 0), (16, 63, 0), (8, 125, 10), (16, 63, 10))
"""(processes, watching nodes in each, slices: 0 for the round whole)"""
REPEATS = 2
RESULTS = Path(__file__).parents[1] / "results" / "fanout.json"


def watch_in_threads(
    host: str, ca: str, cert: str, key: str, namespace: str, count: int, slices: int
) -> None:
    """Child process: ``count`` watching nodes; prints READY, then their CPU seconds."""
    import kubernetes.client

    from k8s_rendezvous import kube
    from k8s_rendezvous.wire import leases, objects, views

    configuration = kubernetes.client.Configuration()
    configuration.host, configuration.ssl_ca_cert = host, ca
    configuration.cert_file, configuration.key_file = cert, key
    configuration.connection_pool_maxsize = count + 4
    api = kubernetes.client.ApiClient(configuration)
    cpu: list[float] = []
    lock = threading.Lock()
    armed = threading.Barrier(count + 1)

    def node(index: int) -> None:
        client = kube.RendezvousClient(api, namespace, "fanout", retry_seconds=30)
        # Connect first (TCP and TLS, about 3 ms of CPU), so that the figure is the round's
        # delivery alone: the watch takes this connection back from the pool.
        kubernetes.client.VersionApi(api).get_code()
        own = objects.slice_index(member_name(index), slices) if slices else None
        # A generator: closed below, which ends the watch's request.
        events = cast(
            Generator[tuple[str, dict[str, Any]], None, None],
            client.watch_unless(
                "1-Sealed",
                None,
                timeout_seconds=120,
                slice_name=None if own is None else objects.slice_name("fanout", own),
            ),
        )
        armed.wait()
        started = time.thread_time()  # the request goes out on the first next(), below
        # The round enters the filter as ADDED; a BOOKMARK may come first.
        obj = next(obj for kind, obj in events if kind in ("ADDED", "MODIFIED"))
        view = views.NodeView.from_dict(obj.get("status"), member_name(index))
        entry = leases.NodeEntry(f"{index:016x}", 1, member_address(index), 29500)
        assert view.round == 2 and view.rank_of(entry) == index, "not this node's round"
        with lock:
            cpu.append(time.thread_time() - started)
        events.close()

    threads = [threading.Thread(target=node, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    armed.wait()
    print("READY", flush=True)
    for thread in threads:
        thread.join()
    print(json.dumps(cpu), flush=True)


def open_watches(admin: Any) -> float:
    """The watches of Rendezvous and their slices the API server serves (its own gauge)."""
    metrics = admin.call_api("GET", f"{admin.configuration.host}/metrics").read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.decode().splitlines()
        if line.startswith("apiserver_longrunning_requests{")
        and ('resource="rendezvous"' in line or 'resource="rendezvousslices"' in line)
        and 'verb="WATCH"' in line
    )


def wait_for_watches(admin: Any, count: float) -> None:
    """Until the API server serves ``count`` watches of Rendezvous and slices."""
    deadline = time.monotonic() + 120
    while (found := open_watches(admin)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{found:.0f} of {count:.0f} watches open after 120 s")
        time.sleep(0.1)


def member_name(index: int) -> str:
    return f"train-worker-{index}-abcde"


def member_address(index: int) -> str:
    return f"10.0.{index // 256}.{index % 256}"


def measure(
    admin: Any,
    namespace: str,
    layouts: tuple[tuple[int, int, int], ...] = LAYOUTS,
    repeats: int = REPEATS,
    members: int = MEMBERS,
) -> dict[str, Any]:
    """Deliver one sealed round of ``members`` to each layout of (processes, watchers in
    each, slices); the CRDs must be installed."""
    from concurrent.futures import ThreadPoolExecutor

    import kubernetes.client

    from devkit import manifests
    from devkit.cluster.controlplane import read_object
    from k8s_rendezvous.wire import objects, records, statuses
    from k8s_rendezvous_operator.kube import OperatorApi

    custom = kubernetes.client.CustomObjectsApi(admin)
    operator_api = OperatorApi(admin)
    rendezvous = read_object(
        custom.create_namespaced_custom_object,
        objects.GROUP,
        objects.VERSION,
        namespace,
        objects.PLURAL,
        manifests.rendezvous(namespace, "fanout", members, members),
    )
    round_members = tuple(
        records.Member(member_name(i), f"{i:016x}", 1, member_address(i)) for i in range(members)
    )

    def seal(round_number: int, slices: int) -> None:
        """Write the round as the operator does: the status, then its slices at once."""
        status = statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=round_number,
            members=round_members,
            master=records.Master(round_members[0].addr, 29500),
            slices=slices,
        )
        custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            namespace,
            objects.PLURAL,
            "fanout",
            {"status": status.operator_fields()},
            _content_type="application/merge-patch+json",
        )
        pieces = {
            i: {"spec": rendezvous["spec"], "status": f} for i, f in status.slice_fields().items()
        }
        with ThreadPoolExecutor(max(1, slices)) as writers:
            list(
                writers.map(
                    lambda index: operator_api.write_slice(
                        namespace,
                        rendezvous["metadata"]["name"],
                        rendezvous["metadata"]["uid"],
                        index,
                        pieces[index],
                    ),
                    range(slices),
                )
            )

    configuration = admin.configuration
    found: dict[str, Any] = {
        "command": ".venv/bin/python -m bench.probes.fanout",
        "members": members,
        "layouts": [],
    }
    for processes, per_process, slices in layouts:
        for repeat in range(repeats):
            seal(1, slices)
            already_open = open_watches(admin)
            children = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.probes.fanout",
                        "child",
                        configuration.host,
                        configuration.ssl_ca_cert,
                        configuration.cert_file,
                        configuration.key_file,
                        namespace,
                        str(per_process),
                        str(slices),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for _ in range(processes)
            ]
            for child in children:
                assert child.stdout is not None and child.stdout.readline().strip() == "READY"
            wait_for_watches(admin, already_open + processes * per_process)
            written = time.monotonic()
            seal(2, slices)
            cpu: list[float] = []
            for child in children:
                assert child.stdout is not None
                cpu += json.loads(child.stdout.readline())
                if child.wait() != 0:
                    raise RuntimeError(f"a watcher process failed (exit {child.returncode})")
            delivered = time.monotonic() - written
            if len(cpu) != processes * per_process:
                raise RuntimeError(f"{len(cpu)} of {processes * per_process} nodes had the round")
            found["layouts"].append(
                {
                    "processes": processes,
                    "nodes_per_process": per_process,
                    "slices": slices,
                    "repeat": repeat + 1,
                    "write_to_last_node_seconds": round(delivered, 3),
                    "watch_cpu_ms_per_node_median": round(statistics.median(cpu) * 1000, 2),
                    "watch_cpu_ms_per_node_max": round(max(cpu) * 1000, 2),
                    "watch_cpu_seconds_all_nodes": round(sum(cpu), 2),
                }
            )
            print(json.dumps(found["layouts"][-1]), file=sys.stderr, flush=True)
    return found


def main() -> dict[str, Any]:
    from devkit import manifests
    from devkit.cluster.controlplane import ControlPlane, build_binaries

    plane = ControlPlane(build_binaries())
    plane.start()
    try:
        manifests.install(plane)
        return measure(plane.api_client(), "default")
    finally:
        plane.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        host, ca, cert, key, namespace = sys.argv[2:7]
        watch_in_threads(host, ca, cert, key, namespace, int(sys.argv[7]), int(sys.argv[8]))
    else:
        RESULTS.write_text(json.dumps(main(), indent=1) + "\n")
