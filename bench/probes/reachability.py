"""The steady-state cost of the operator's reachability probes at scale, and how soon they
drop a member that goes silent (``python -m bench.probes.reachability``, about 45 s).

A real :class:`~k8s_rendezvous_operator.probing.Prober` probes N members (1,000 by default)
once a second; their answers come from one child process, one UDP socket per member on
127.0.0.1 served by one epoll loop with the agent's own codec, so that the operator's
figures and the responders' are those of separate processes. After the measurement the
child stops answering one member, and the time until the Prober's verdict names it is
taken. Writes ``bench/results/probe-cost/`` (results.json, README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import resource
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any

from k8s_rendezvous.wire import datagrams
from k8s_rendezvous_operator.probing import Prober
from k8s_rendezvous_operator.reachability import Target

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench/results/probe-cost"
INTERVAL, WINDOW = 1.0, 3.0
COUNTS = ("requests", "replies", "bytes_in", "bytes_out")


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):  # unlimited: the kernel caps it
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def responders(count: int) -> None:
    """The child: answers like ``ProbeResponder``; obeys ``stats`` and ``mute <port>``."""
    selector = selectors.DefaultSelector()
    ports = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        ports.append(sock.getsockname()[1])
        selector.register(sock, selectors.EVENT_READ, ports[-1])
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    print(json.dumps({"ports": ports}), flush=True)
    muted: set[int] = set()
    counts = dict.fromkeys(COUNTS, 0)
    pending = b""
    while True:
        for key, _ in selector.select():
            if isinstance(key.fileobj, socket.socket):
                sock = key.fileobj
                with contextlib.suppress(BlockingIOError):
                    while True:
                        datagram, sender = sock.recvfrom(datagrams.Probe.REQUEST_BYTES + 1)
                        counts["requests"] += 1
                        counts["bytes_in"] += len(datagram)
                        probe = datagrams.Probe.from_request(datagram)
                        if probe is None or key.data in muted:
                            continue
                        with contextlib.suppress(OSError):
                            counts["bytes_out"] += sock.sendto(probe.reply(), sender)
                            counts["replies"] += 1
                continue
            # Read raw, not with readline: a buffered second line would not wake the selector.
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:  # the parent is gone
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                command = line.decode().split()
                if command[0] == "mute":
                    muted.add(int(command[1]))
                reply = {**counts, "cpu": time.process_time(), "at": time.monotonic()}
                print(json.dumps(reply), flush=True)


async def measure(nodes: int, warmup: float, seconds: float) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench.probes.reachability", "--child", str(nodes)),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=1 << 22,  # the line of ports
    )
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    async def ask(command: str) -> dict[str, Any]:
        stdin.write(command.encode() + b"\n")
        return dict(json.loads(await asyncio.wait_for(stdout.readline(), 60)))

    async def snapshot() -> tuple[float, float, int, dict[str, Any]]:
        return time.monotonic(), time.process_time(), prober.answers, await ask("stats")

    # Each round as (targets asked, verdict given, verdict). A round judges, then sends;
    # the Prober sleeps the interval after sending, so the period beyond the interval is
    # the round's own time on the event loop.
    rounds: list[tuple[float, float, frozenset[Target]]] = []
    opened = [0.0]

    def targets() -> list[Target]:
        opened[0] = time.monotonic()
        return members

    def judged(verdict: frozenset[Target]) -> None:
        rounds.append((opened[0], time.monotonic(), verdict))

    prober = Prober(targets, judged, interval=INTERVAL, window=WINDOW)
    try:
        ports = json.loads(await asyncio.wait_for(stdout.readline(), 60))["ports"]
        members = [
            Target("bench", "r", f"node-{i}", "i", "127.0.0.1", p) for i, p in enumerate(ports)
        ]
        prober.start()
        await asyncio.sleep(warmup)  # past the first window, after which every member is judged
        t0, cpu0, answers0, child0 = await snapshot()
        await asyncio.sleep(seconds)
        t1, cpu1, answers1, child1 = await snapshot()
        victim = members[len(members) // 2]
        muted_at = (await ask(f"mute {victim.port}"))["at"]
        caught = None
        while caught is None and time.monotonic() < muted_at + WINDOW + 5 * INTERVAL:
            await asyncio.sleep(0.01)
            caught = next((r for r in rounds if victim in r[2]), None)
    finally:
        await prober.stop()
        if child.returncode is None:
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 5)
            except asyncio.TimeoutError:
                child.kill()
                await child.wait()
    measured = [r for r in rounds if t0 <= r[1] < t1]
    starts = [start for start, _, _ in measured]
    busy = sorted(later - earlier - INTERVAL for earlier, later in itertools.pairwise(starts))
    child_wall = child1["at"] - child0["at"]
    per_s = {f"{k}_per_s": round((child1[k] - child0[k]) / child_wall, 1) for k in COUNTS}
    return {
        "members": len(members),
        "interval_s": INTERVAL,
        "window_s": WINDOW,
        "warmup_s": warmup,
        "measured_s": round(t1 - t0, 2),
        "rounds": len(measured),
        "round_period_s": round((measured[-1][0] - measured[0][0]) / (len(measured) - 1), 4),
        "round_busy_ms_median": round(busy[len(busy) // 2] * 1e3, 2),
        "round_busy_ms_max": round(busy[-1] * 1e3, 2),
        "operator_cpu_per_s": round((cpu1 - cpu0) / (t1 - t0), 4),
        "responders_cpu_per_s": round((child1["cpu"] - child0["cpu"]) / child_wall, 4),
        **per_s,
        "answers_taken_per_s": round((answers1 - answers0) / (t1 - t0), 1),
        "rounds_with_nonempty_verdict": sum(1 for r in measured if r[2]),
        "detection_s": None if caught is None else round(caught[1] - muted_at, 3),
        "muted_into_round_s": round(muted_at - max(r[0] for r in rounds if r[0] <= muted_at), 3),
        "detection_verdict_size": None if caught is None else len(caught[2]),
    }


def report(f: dict[str, Any], command: str) -> str:
    n = f["members"]
    rows = [
        ("members probed", f"{n:,}"),
        ("rounds measured (mean period)", f"{f['rounds']} ({f['round_period_s']:.3f} s)"),
        (
            "time per round beyond the interval, median / max",
            f"{f['round_busy_ms_median']} / {f['round_busy_ms_max']} ms",
        ),
        ("operator CPU (the Prober's process)", f"{f['operator_cpu_per_s']:.1%} of a core"),
        ("responders' CPU (one process, epoll)", f"{f['responders_cpu_per_s']:.1%} of a core"),
        ("probes in / replies out per s", f"{f['requests_per_s']:,} / {f['replies_per_s']:,}"),
        ("payload bytes in / out per s", f"{f['bytes_in_per_s']:,} / {f['bytes_out_per_s']:,}"),
        ("answers taken by the Prober per s", f"{f['answers_taken_per_s']:,}"),
        ("rounds with a non-empty verdict", f"{f['rounds_with_nonempty_verdict']}"),
        (
            "muted member in the verdict after",
            f"{f['detection_s']} s (muted {f['muted_into_round_s']} s into a round; judged "
            f"once {f['window_s'] / f['interval_s']:g} probes in a row went unanswered)",
        ),
    ]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), "?")
    table = "| figure | value |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    return f"""# Probe cost: {n:,} members probed every {INTERVAL} s

    flock /tmp/k8s-rdzv-heavy.lock {command}

Run {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} on {os.cpu_count()} cores
({model}), holding the lock that keeps the other heavy jobs of this machine off it. A real
`Prober` (interval {INTERVAL} s, window {WINDOW} s) probed {n:,} responders on 127.0.0.1,
all in one child process (an epoll loop answering with `datagrams.Probe`, as `ProbeResponder`
does); {f["warmup_s"]} s of warm-up, then {f["measured_s"]} s measured. The responders
count datagrams and bytes (UDP payload: IP and UDP headers add 28 bytes a datagram). Then
the child stopped answering one member, at whatever point of a round the measurement ended.

{table}
The alternative, a {WINDOW:g} s window on the Lease heartbeats, renewed every window / 3 =
{WINDOW / 3:g} s, is arithmetic, not measured: {n:,} nodes renewing every {WINDOW / 3:g} s =
{n / (WINDOW / 3):,.0f} Lease writes a second to the API server (each also an etcd write and
a watch event to the operator), where probing costs the API server nothing.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    _raise_nofile()
    if args.child is not None:
        responders(args.child)
        return
    found = asyncio.run(measure(args.nodes, args.warmup, args.seconds))
    text = report(found, " ".join([".venv/bin/python -m bench.probes.reachability", *sys.argv[1:]]))
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(found, indent=1) + "\n")
    (OUT / "README.md").write_text(text)
    if found["rounds_with_nonempty_verdict"] or found["detection_verdict_size"] != 1:
        sys.exit("FAILED: a verdict during the measurement, or the muted member not judged alone")


if __name__ == "__main__":
    main()
