"""A worker process hosting many simulated nodes, each a real rendezvous handler in threads.

Started by :mod:`bench.pool` as ``python -m bench.nodehost``, and driven over the kit's
JSON-line protocol (:mod:`devkit.child`: everything else the process prints goes to its
log file). Long operations (joins,
polling ``num_nodes_waiting()``) run in threads and are collected by a later command, so
the parent can, meanwhile, kill another worker or delete a pod.

Backends:

* ``ours``: :class:`k8s_rendezvous.handler.KubernetesRendezvousHandler` with its own API
  client authenticated by the pod's bound token (what a pod does).
* ``c10d`` / ``etcd-v2``: torch's ``DynamicRendezvousHandler``, built through
  ``rendezvous_handler_registry.create_handler(RendezvousParameters(...))`` with string
  conf values, as torchrun builds it.

Every time is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for all processes).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

from devkit import child

Json = dict[str, Any]


@dataclasses.dataclass
class Slot:
    """One simulated node."""

    id: int
    handler: Any
    call: float | None = None
    ret: float | None = None
    call_wall: float | None = None  # time.time(), to compare with the operator's timestamps
    ret_wall: float | None = None
    written_wall: float | None = None  # ours: when the join's write returned
    seen_wall: float | None = None  # ours: when the watcher last took a new status
    rank: int | None = None
    world: int | None = None
    master: str | None = None
    error: str | None = None
    first_waiting: float | None = None
    info: Any = None  # keeps the round's store (and its connections) alive
    thread: threading.Thread | None = None
    joins: int = 0

    def record(self) -> Json:
        return {
            "id": self.id,
            "call": self.call,
            "ret": self.ret,
            "call_wall": self.call_wall,
            "ret_wall": self.ret_wall,
            "written_wall": self.written_wall,
            "seen_wall": self.seen_wall,
            "rank": self.rank,
            "world": self.world,
            "master": self.master,
            "error": self.error,
            "first_waiting": self.first_waiting,
            "joins": self.joins,
        }


def _build_ours(spec: Json, common: Json) -> Any:
    import kubernetes.client

    from k8s_rendezvous import config, kube
    from k8s_rendezvous.handler import KubernetesRendezvousHandler

    configuration = kubernetes.client.Configuration(host=common["server"])
    configuration.ssl_ca_cert = common["ca_file"]
    configuration.verify_ssl = True
    configuration.api_key = {"BearerToken": spec["token"]}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    api = kubernetes.client.ApiClient(configuration)
    read_timeout = int(common.get("read_timeout", 60))
    client = kube.RendezvousClient(
        api, spec["namespace"], spec["rendezvous"], retry_seconds=read_timeout
    )
    return KubernetesRendezvousHandler(
        client,
        run_id=spec["rendezvous"],
        node=spec["pod"],
        addr=spec["addr"],
        min_nodes=int(spec["min_nodes"]),
        max_nodes=int(spec["max_nodes"]),
        settings=config.Settings(spec["namespace"], spec["rendezvous"], read_timeout=read_timeout),
    )


def _build_torch(spec: Json, common: Json) -> Any:
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    conf = {key: str(value) for key, value in (spec.get("conf") or {}).items()}
    params = RendezvousParameters(
        backend=common["backend"],
        endpoint=spec["endpoint"],
        run_id=spec["run_id"],
        min_nodes=int(spec["min_nodes"]),
        max_nodes=int(spec["max_nodes"]),
        local_addr=spec["addr"],
        **conf,
    )
    return rendezvous_handler_registry.create_handler(params)


def _time_join_writes(slot: Slot) -> None:
    """Record when the node's own entry was written and when its watcher took a new round
    key (for the latency breakdown; private attributes, read only)."""
    client = slot.handler.client
    write = client.write_lease

    def timed(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)
        entry = args[4] if len(args) > 4 else kwargs.get("entry")
        if entry is not None:  # a join, not a heartbeat
            slot.written_wall = time.time()

    client.write_lease = timed
    watcher = slot.handler.watcher
    offer = watcher.offer

    def round_key() -> str | None:
        status = watcher.status
        return None if status is None else status.round_key

    def seen(obj: Any) -> None:
        key = round_key()
        offer(obj)
        if round_key() != key:
            slot.seen_wall = time.time()

    watcher.offer = seen


class Host:
    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}
        self._pollers: list[threading.Thread] = []
        self._cpu_at_join: dict[int, float] = {}
        self._process_cpu_at_join = 0.0
        self._joined_at = 0.0

    # -- commands --------------------------------------------------------------------------

    def add_nodes(self, nodes: list[Json], common: Json) -> Json:
        backend = common["backend"]
        build: Callable[[Json, Json], Any] = _build_ours if backend == "ours" else _build_torch
        started = time.monotonic()
        for spec in nodes:
            slot = Slot(int(spec["id"]), build(spec, common))
            if backend == "ours":
                _time_join_writes(slot)
            self._slots[slot.id] = slot
        return {"added": len(nodes), "seconds": time.monotonic() - started}

    def ready(self, within: float) -> Json:
        """Wait until what building our handlers started in the background is done: the
        watch has delivered the Rendezvous, the connection ahead is open. Timed rounds then
        start from built handlers for every backend, as torch's, which connect to their
        store while being built, always do."""
        started = time.monotonic()
        deadline = started + within
        pending = 0
        for slot in self._slots.values():
            watcher = getattr(slot.handler, "_watcher", None)
            if watcher is not None and watcher.wait_for_object(deadline) is None:
                pending += 1
        for thread in threading.enumerate():
            if thread.name.startswith("k8s-rendezvous-connect"):
                thread.join(max(0.0, deadline - time.monotonic()))
                pending += thread.is_alive()
        return {"seconds": time.monotonic() - started, "pending": pending}

    def join(self, ids: list[int], go_at: float) -> Json:
        """Each node's ``next_rendezvous()`` in its own thread, all released at ``go_at``."""
        self._cpu_at_join = {tid: cpu for tid, (_, cpu) in _threads_cpu_seconds().items()}
        self._process_cpu_at_join = _process_cpu_seconds()
        self._joined_at = time.monotonic()
        for node in ids:
            slot = self._slots[node]
            slot.thread = threading.Thread(
                target=self._join_one, args=(slot, go_at), name=f"join-{node}", daemon=True
            )
            slot.thread.start()
        return {"started": len(ids)}

    def rejoin_when_waiting(self, ids: list[int], interval: float, within: float) -> Json:
        """What an agent does: poll ``num_nodes_waiting()`` and, once it is > 0, call
        ``next_rendezvous()`` at once (``first_waiting`` records when it turned > 0)."""
        for node in ids:
            slot = self._slots[node]
            slot.thread = threading.Thread(
                target=self._rejoin_one,
                args=(slot, interval, time.monotonic() + within),
                name=f"rejoin-{node}",
                daemon=True,
            )
            slot.thread.start()
        return {"started": len(ids)}

    def watch_waiting(self, ids: list[int], interval: float, within: float) -> Json:
        """Poll ``num_nodes_waiting()`` of ``ids`` until each has been > 0 once."""
        for node in ids:
            self._slots[node].first_waiting = None
        deadline = time.monotonic() + within
        thread = threading.Thread(
            target=self._poll_waiting, args=(ids, interval, deadline), daemon=True
        )
        thread.start()
        self._pollers.append(thread)
        return {"started": len(ids)}

    def collect(self, ids: list[int], within: float) -> Json:
        """The records of ``ids`` once their threads ended (or ``within`` seconds passed)."""
        deadline = time.monotonic() + within
        for node in ids:
            thread = self._slots[node].thread
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        for poller in self._pollers:
            poller.join(max(0.0, deadline - time.monotonic()))
        self._pollers = [p for p in self._pollers if p.is_alive()]
        records = []
        for node in ids:
            slot = self._slots[node]
            record = slot.record()
            record["pending"] = slot.thread is not None and slot.thread.is_alive()
            records.append(record)
        return {"records": records}

    def shutdown(self, ids: list[int], within: float) -> Json:
        results: dict[int, Any] = {}

        def one(slot: Slot) -> None:
            try:
                results[slot.id] = bool(slot.handler.shutdown())
            except Exception as error:
                results[slot.id] = repr(error)

        threads = [threading.Thread(target=one, args=(self._slots[i],), daemon=True) for i in ids]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + within
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return {"shutdown": sum(1 for v in results.values() if v is True), "of": len(ids)}

    def stats(self) -> Json:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "pid": os.getpid(),
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "cpu_seconds_since_join_by_thread": self._cpu_since_join_by_thread(),
            "max_rss_mb": usage.ru_maxrss / 1024,
            "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")),
        }

    def _cpu_since_join_by_thread(self) -> Json:
        """CPU seconds since the last ``join`` command by kind of thread: which of a node's
        jobs (its join, its watch, its heartbeat, its connection to rank 0's store) pays.
        Live threads are read from /proc; Python threads that ended reported their CPU as
        they ended; threads not started by Python (torch's C++ threads) go by their OS
        name. What is left is native threads that ended."""
        used: dict[str, float] = {}

        def count(name: str, seconds: float) -> None:
            kind = next((k for k in _THREAD_KINDS if name.startswith(k)), "other Python")
            used[kind] = used.get(kind, 0.0) + seconds

        for ended in list(_ENDED_THREADS):
            if ended.at > self._joined_at:
                count(ended.name, ended.cpu_seconds - self._cpu_at_join.get(ended.native_id, 0.0))
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        for native_id, (os_name, seconds) in _threads_cpu_seconds().items():
            since = seconds - self._cpu_at_join.get(native_id, 0.0)
            if native_id in names:
                count(names[native_id], since)
            else:
                used[f"native {os_name}"] = used.get(f"native {os_name}", 0.0) + since
        total = _process_cpu_seconds() - self._process_cpu_at_join
        used["rest (ended native threads)"] = total - sum(used.values())
        used["process"] = total
        return {kind: round(seconds, 3) for kind, seconds in used.items()}

    # -- threads ---------------------------------------------------------------------------

    def _join_one(self, slot: Slot, go_at: float) -> None:
        delay = go_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next(slot)

    def _next(self, slot: Slot) -> None:
        slot.call_wall = time.time()
        slot.call = time.monotonic()
        slot.ret = slot.ret_wall = None
        slot.error = None
        slot.joins += 1
        try:
            info = slot.handler.next_rendezvous()
            slot.ret = time.monotonic()
            slot.ret_wall = time.time()
            slot.info = info
            slot.rank = int(info.rank)
            slot.world = int(info.world_size)
            store_info = info.bootstrap_store_info
            if store_info is not None:
                slot.master = f"{store_info.master_addr}:{store_info.master_port}"
        except Exception as error:
            slot.ret = None
            slot.error = f"{type(error).__name__}: {error}"[:500]

    def _rejoin_one(self, slot: Slot, interval: float, deadline: float) -> None:
        slot.first_waiting = None
        while time.monotonic() < deadline:
            try:
                waiting = slot.handler.num_nodes_waiting()
            except Exception as error:
                slot.error = f"num_nodes_waiting: {type(error).__name__}: {error}"[:500]
                return
            if waiting > 0:
                slot.first_waiting = time.monotonic()
                self._next(slot)
                return
            time.sleep(interval)
        slot.error = "num_nodes_waiting() stayed 0"

    def _poll_waiting(self, ids: list[int], interval: float, deadline: float) -> None:
        pending = list(ids)
        while pending and time.monotonic() < deadline:
            still = []
            for node in pending:
                slot = self._slots[node]
                try:
                    if slot.handler.num_nodes_waiting() > 0:
                        slot.first_waiting = time.monotonic()
                        continue
                except Exception as error:
                    slot.error = f"num_nodes_waiting: {type(error).__name__}: {error}"[:500]
                    continue
                still.append(node)
            pending = still
            if pending:
                time.sleep(interval)

    # -- operations --------------------------------------------------------------------------

    def operations(self) -> dict[str, Callable[..., Json]]:
        """What the parent may ask for (:func:`devkit.child.serve`)."""
        return {
            "ping": lambda: {"pid": os.getpid()},
            "prepare": self.prepare,
            "add_nodes": self.add_nodes,
            "ready": self.ready,
            "join": self.join,
            "rejoin_when_waiting": self.rejoin_when_waiting,
            "watch_waiting": self.watch_waiting,
            "collect": self.collect,
            "shutdown": self.shutdown,
            "stats": self.stats,
        }

    def prepare(self, backend: str) -> Json:
        """Import what the backend needs before anything is timed."""
        started = time.monotonic()
        import torch.distributed.elastic.rendezvous

        if backend == "ours":
            import k8s_rendezvous.handler  # noqa: F401
        elif backend == "etcd-v2":
            import torch.distributed.elastic.rendezvous.etcd_rendezvous_backend  # noqa: F401
        return {"seconds": time.monotonic() - started}


_THREAD_KINDS = (
    "join-",
    "rejoin-",
    "k8s-rendezvous-watch",
    "k8s-rendezvous-heartbeat",
    "k8s-rendezvous-round-store",
    "k8s-rendezvous-connect",
    "MainThread",
)


@dataclasses.dataclass(frozen=True)
class _EndedThread:
    name: str
    native_id: int
    cpu_seconds: float
    at: float


_ENDED_THREADS: collections.deque[_EndedThread] = collections.deque(maxlen=100_000)
"""Every Python thread of this process, as it ends (deque.append is thread-safe)."""
_run_thread = threading.Thread.run


def _run_and_report(thread: threading.Thread) -> None:
    try:
        _run_thread(thread)
    finally:
        _ENDED_THREADS.append(
            _EndedThread(
                thread.name, threading.get_native_id(), time.thread_time(), time.monotonic()
            )
        )


def _threads_cpu_seconds() -> dict[int, tuple[str, float]]:
    """The OS name and CPU seconds of each live thread of this process, by native id. The
    CPU is the scheduler's nanoseconds (``schedstat``): ``stat``'s clock ticks are 10 ms,
    and a thousand watch threads each using a few ms would round to nothing."""
    used = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat", encoding="ascii") as schedstat:
                on_cpu_ns = int(schedstat.read().split()[0])
            with open(f"/proc/self/task/{task}/comm", encoding="ascii", errors="replace") as comm:
                os_name = comm.read().strip()
        except OSError:  # ended meanwhile
            continue
        used[int(task)] = (os_name, on_cpu_ns / 1e9)
    return used


def _process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    # The handlers start their threads with a target, so wrapping run() sees them all.
    threading.Thread.run = _run_and_report  # type: ignore[method-assign, assignment]
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    child.serve(Host().operations())


if __name__ == "__main__":
    main()
