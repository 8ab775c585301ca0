"""Small probes that explain numbers of the main sections.

``tcpstore_connect``: ``n`` TCPStore clients connecting at once to one TCPStore server,
which is what the non-rank-0 nodes of ours do inside ``next_rendezvous()`` every time the
master changes. No Kubernetes involved. torch's TCPStore resolves addresses (reverse DNS
lookups) when a client connects and when the server accepts; on a machine whose resolver
drops bursts of queries, some connects then wait for glibc's resolver timeout (5 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
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


if __name__ == "__main__":
    print(json.dumps(tcpstore_connect(), indent=1))
