"""Helper processes driven over one protocol: a JSON line per request and per answer.

The parent starts ``python -m MODULE`` in a session of its own and writes one request per
line on its stdin, ``{"op": NAME, ...arguments}``. The child answers each request with one
line on its stdout, in order: ``{"ok": true, ...result}``, or ``{"ok": false, "error":
<exception type>, "message": ...}`` when the operation raised. Its first line, before
any request, is ``{"ok": true, "ready": <its PID>}``. ``exit`` is answered, then the
child ends. Whatever else the child prints goes to stderr, its log.

:func:`serve` is the child's side; :class:`ChildProcess` is the parent's: it sends,
reads answers with a deadline, signals the child by its PID and kills it on close.
Users: the benchmark's node-hosting workers (bench/nodehost.py) and the tests' node that
can be frozen (tests/support/node_process.py).
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
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from devkit import processes
from devkit.paths import REPO

Json = dict[str, Any]
Operation = Callable[..., Json | None]


class ChildError(AssertionError):
    """The child did not answer in time, ended, or answered that an operation failed (an
    AssertionError, so pytest shows it as a failure with the child's log)."""


# -- the child ------------------------------------------------------------------------------


def serve(operations: Mapping[str, Operation]) -> None:
    """Answer requests from stdin until ``exit`` or its end.

    Each request's arguments are passed by keyword to ``operations[op]``, whose result
    (``None`` for nothing) is the answer; ``exit`` needs no entry. stdout is kept for the
    answers: from here on, anything printed goes to stderr.
    """
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def answer(reply: Json) -> None:
        answers.write(json.dumps(reply) + "\n")
        answers.flush()

    answer({"ok": True, "ready": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "exit" and op not in operations:
                result = None
            elif op not in operations:
                raise LookupError(f"no operation {op!r}")
            else:
                result = operations[op](**request)
            reply: Json = {"ok": True, **(result or {})}
        except Exception as error:
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "error": type(error).__name__, "message": str(error)}
        answer(reply)
        if op == "exit":
            return


# -- the parent -----------------------------------------------------------------------------


class ChildProcess:
    """``python -m module *args`` speaking the protocol above, from the repository root.

    Use as a context manager, or call :meth:`stop`: the child is killed (SIGKILL, by PID)
    whatever state it is in, frozen included.

    Args:
        module: The child's module (its ``__main__`` calls :func:`serve`).
        args: Its command-line arguments.
        log_path: Where its stderr goes.
        env: Its environment on top of this process's (and ``PYTHONUNBUFFERED=1``).
        unset: Variables of this process's environment it must not see.
        name: How errors name it (default: the module and its PID).
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        unset: Sequence[str] = (),
        name: str | None = None,
    ) -> None:
        self.log_path = log_path
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        for variable in unset:
            full_env.pop(variable, None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO,
                env=full_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.pid = self._process.pid
        self.name = name or f"{module} (pid {self.pid})"
        self._answers: queue.Queue[Json | None] = queue.Queue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"child-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                self._answers.put(json.loads(line))
            except ValueError:
                continue  # not an answer: answers are JSON lines
        self._answers.put(None)

    def send(self, op: str, **args: Any) -> None:
        """One request; its answer is read by :meth:`answer`."""
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._process.stdin.flush()

    def answer(self, timeout: float) -> Json:
        """The next answer, as the child wrote it; :class:`ChildError` naming the log's
        end if none comes in time or the child ended."""
        try:
            found = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(
                f"{self.name}: no answer within {timeout:.0f} s\n{self.log_tail()}"
            ) from None
        if found is None:
            raise ChildError(
                f"{self.name} ended (exit code {self._process.poll()})\n{self.log_tail()}"
            )
        return found

    def ask(self, op: str, timeout: float, **args: Any) -> Json:
        """One request and its answer, as the child wrote it (a failure included)."""
        with self._lock:
            self.send(op, **args)
            return self.answer(timeout)

    def call(self, op: str, timeout: float = 120, **args: Any) -> Json:
        """One request and its answer; :class:`ChildError` if the operation failed."""
        if self._process.poll() is not None:
            raise ChildError(f"{self.name} exited with {self._process.returncode}")
        reply = self.ask(op, timeout, **args)
        if not reply.get("ok"):
            raise ChildError(f"{self.name}: {op} failed: {reply['error']}: {reply['message']}")
        return reply

    def freeze(self) -> None:
        """SIGSTOP: a hung node, whose sockets stay open and never answer."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL by PID (it works on a frozen process too): a node that dies."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(10)

    def stop(self, timeout: float = 3) -> None:
        """``exit``, then SIGKILL if it has not ended within ``timeout`` seconds."""
        if self._process.poll() is None:
            try:
                self.send("exit")
                self._process.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def log_tail(self, lines: int = 30) -> str:
        return processes.log_tail(self.log_path, lines)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()
