"""Small probes that explain numbers of the main sections.

``tcpstore_connect``: ``n`` TCPStore clients connecting at once to one TCPStore server,
which is what the non-rank-0 nodes of ours do inside ``next_rendezvous()`` every time the
master changes. No Kubernetes involved. torch's TCPStore resolves addresses (reverse DNS
lookups) when a client connects and when the server accepts; on a machine whose resolver
drops bursts of queries, some connects then wait for glibc's resolver timeout (5 s).

``sealed_status_decode``: the CPU one node spends on the event of a sealed round of ``n``
members, step by step as the handler takes it: decoding the line (one ``json.loads`` of its
bytes; for reference, the kubernetes client's ``Watch``, which the handler used before and
which decodes it three times), the whole status codec and finding a rank in it (what the
operator does; nodes did it too before), and a node's own view of the status (what nodes
do: decode only their own entry). It is paid by every node at every round change, so the
round's total grows as N^2; this says how much of a node's CPU that is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SCRIPT = r"""
import datetime, json, sys, threading, time
from torch.distributed import TCPStore
count, host = int(sys.argv[1]), sys.argv[2]
timeout = datetime.timedelta(seconds=60)
server = TCPStore(host_name=host, port=0, is_master=True, multi_tenant=True,
                  wait_for_workers=False, timeout=timeout)
took, keep = [], []
go = time.monotonic() + 0.3
def connect():
    time.sleep(max(0.0, go - time.monotonic()))
    started = time.monotonic()
    keep.append(TCPStore(host_name=host, port=server.port, is_master=False, timeout=timeout))
    took.append(time.monotonic() - started)
threads = [threading.Thread(target=connect) for _ in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(120)
took.sort()
print(json.dumps({"clients": count, "median": took[len(took) // 2], "max": took[-1]}))
"""


def tcpstore_connect(counts: tuple[int, ...] = (8, 32, 64)) -> list[dict[str, Any]]:
    results = []
    for count in counts:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(count), "127.100.0.1"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            results.append({"clients": count, "error": proc.stderr.strip()[-400:]})
        else:
            results.append({k: round(v, 4) for k, v in json.loads(lines[-1]).items()})
    return results


def sealed_status_decode(counts: tuple[int, ...] = (32, 128, 1000)) -> list[dict[str, Any]]:
    return [_decode_costs(count) for count in counts]


def _decode_costs(count: int) -> dict[str, Any]:
    from kubernetes import client, watch

    from k8s_rendezvous.wire import leases, objects, records, statuses, views

    members = tuple(
        records.Member(
            node=f"bench-{count}-node-{i:04d}",
            instance=f"{i:08x}-1f3a-4c2b-9d7e-5a6b7c8d9e0f",
            attempt=1,
            addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
        )
        for i in range(count)
    )
    sealed = statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=1,
        members=members,
        master=records.Master(members[0].addr, 29500),
    )
    obj = {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": "train", "namespace": "bench", "resourceVersion": "1"},
        "spec": {"minNodes": count, "maxNodes": count, "runId": "train"},
        "status": sealed.operator_fields(),
    }
    line = json.dumps({"type": "MODIFIED", "object": obj})
    watcher = watch.Watch()  # type: ignore[no-untyped-call]
    watcher._api_client = client.ApiClient()
    raw = watcher.unmarshal_event(line, "object")["raw_object"]  # type: ignore[no-untyped-call]
    decoded = statuses.RendezvousStatus.from_dict(raw["status"])
    last = members[-1]
    entry = leases.NodeEntry(last.instance, last.attempt, last.addr, 29500)
    line_bytes = line.encode()
    steps: dict[str, Callable[[], object]] = {
        "kubernetes_watch_decode_ms": lambda: watcher.unmarshal_event(line, "object"),  # type: ignore[no-untyped-call]
        "event_decode_ms": lambda: json.loads(line_bytes),
        "status_codec_ms": lambda: statuses.RendezvousStatus.from_dict(raw["status"]),
        "rank_of_ms": lambda: decoded.rank_of(last.node, entry),
        "node_view_ms": lambda: views.NodeView.from_dict(raw["status"], last.node).rank_of(entry),
    }
    repeats = max(20, 20000 // count)
    return {
        "members": count,
        "event_bytes": len(line),
        **{name: _best_ms(step, repeats) for name, step in steps.items()},
    }


def _best_ms(step: Callable[[], object], repeats: int) -> float:
    """Milliseconds per call in the best of 5 batches: the cost when not interrupted."""
    batches = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(repeats):
            step()
        batches.append((time.process_time() - started) / repeats)
    return round(min(batches) * 1000, 3)


def main() -> None:
    found = {"tcpstore_connect": tcpstore_connect(), "sealed_status_decode": sealed_status_decode()}
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
