"""Parent side of the node-hosting worker processes (see :mod:`bench.nodehost`).

Each worker is ``python -m bench.nodehost`` in its own session, driven over the kit's
JSON-line protocol (:mod:`devkit.child`); it is stopped by its PID (``exit``, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from devkit import child
from devkit.paths import REPO

Json = child.Json

NODE_ENV: dict[str, str] = {}
"""Extra environment of every worker process (``--reverse-dns numeric`` sets LD_PRELOAD)."""


class Worker(child.ChildProcess):
    """One ``bench.nodehost`` process."""

    def __init__(self, name: str, log_dir: Path) -> None:
        env = {
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "OMP_NUM_THREADS": "1",
            **NODE_ENV,
        }
        super().__init__(
            "bench.nodehost",
            log_path=log_dir / f"{name}.log",
            env=env,
            unset=["KUBERNETES_SERVICE_HOST"],
            name=name,
        )


class Pool:
    """``count`` workers, all started and warmed (torch imported) before anything is timed."""

    def __init__(self, count: int, log_dir: Path, backend: str, prefix: str = "w") -> None:
        self.workers = [Worker(f"{prefix}{i}", log_dir) for i in range(count)]
        try:
            for worker in self.workers:
                worker.answer(60)  # {"ready": pid}: started, nothing imported yet
            self.each("prepare", timeout=300, backend=backend)
        except BaseException:
            self.stop()
            raise

    def each(self, op: str, timeout: float = 120, **args: Any) -> list[Json]:
        return self.map(op, [args] * len(self.workers), timeout=timeout)

    def map(self, op: str, per_worker: Sequence[Json], timeout: float = 120) -> list[Json]:
        """``op`` on every worker concurrently, with per-worker arguments."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.workers))) as executor:
            futures = [
                executor.submit(worker.call, op, timeout, **args)
                for worker, args in zip(self.workers, per_worker, strict=True)
            ]
            return [future.result() for future in futures]

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    def stop(self) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(self.workers))) as executor:
            list(executor.map(lambda w: w.stop(), self.workers))


@contextlib.contextmanager
def pool(count: int, log_dir: Path, backend: str, prefix: str = "w") -> Iterator[Pool]:
    started = Pool(count, log_dir, backend, prefix)
    try:
        yield started
    finally:
        started.stop()


def spread(ids: Sequence[int], workers: int) -> list[list[int]]:
    """Round-robin ``ids`` over ``workers`` lists."""
    lists: list[list[int]] = [[] for _ in range(workers)]
    for position, node in enumerate(ids):
        lists[position % workers].append(node)
    return lists
