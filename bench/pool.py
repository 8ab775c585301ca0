"""Parent side of the node-hosting worker processes (see :mod:`bench.nodehost`).

Each worker is ``python -m bench.nodehost`` in its own session, talked to with one JSON
line per request and per answer; it is stopped by its PID (``exit``, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

Json = dict[str, Any]

NODE_ENV: dict[str, str] = {}
"""Extra environment of every worker process (``--reverse-dns numeric`` sets LD_PRELOAD)."""


class WorkerError(RuntimeError):
    pass


class Worker:
    """One ``bench.nodehost`` process."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name = name
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **NODE_ENV,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = (log_dir / f"{name}.log").open("ab")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.nodehost"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self._process.pid

    def _read(self) -> None:
        assert self._process.stdout is not None
        for raw in self._process.stdout:
            self._answers.put(raw.decode())
        self._answers.put(None)

    def call(self, op: str, timeout: float = 120, **args: Any) -> Json:
        with self._lock:
            if self._process.poll() is not None:
                raise WorkerError(f"{self.name} exited with {self._process.returncode}")
            assert self._process.stdin is not None
            self._process.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self._process.stdin.flush()
            try:
                line = self._answers.get(timeout=timeout)
            except queue.Empty:
                raise WorkerError(
                    f"{self.name}: no answer to {op} within {timeout:.0f} s"
                ) from None
            if line is None:
                raise WorkerError(f"{self.name} exited during {op}")
            answer: Json = json.loads(line)
            if not answer.get("ok"):
                raise WorkerError(f"{self.name}: {op} failed: {answer.get('error')}")
            return answer

    def kill(self) -> None:
        """SIGKILL by PID: a node that dies."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10)

    def stop(self) -> None:
        if self._process.poll() is None:
            try:
                assert self._process.stdin is not None
                self._process.stdin.write(b'{"op": "exit"}\n')
                self._process.stdin.flush()
                self._process.wait(3)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._log.close()


class Pool:
    """``count`` workers, all started and warmed (torch imported) before anything is timed."""

    def __init__(self, count: int, log_dir: Path, backend: str, prefix: str = "w") -> None:
        self.workers = [Worker(f"{prefix}{i}", log_dir) for i in range(count)]
        try:
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


def wait_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)
