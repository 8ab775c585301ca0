"""A node in its own OS process, so a test can freeze it (SIGSTOP), thaw it (SIGCONT) or
kill it like a real agent.

The child (``python -m tests.support.node_process --endpoint NAME --nnodes MIN:MAX``)
builds our handler exactly as torchrun does (``from_parameters``, the pod's environment:
an in-cluster token bound to its pod, ``POD_NAME``, ``POD_NAMESPACE``, ``POD_IP``) and
obeys one command per line on stdin, answering each with one JSON line on stdout:

* ``next``: ``next_rendezvous()``; ``{"round", "rank", "world_size", "master"}`` or
  ``{"error": <exception type>, "message": ...}``;
* ``waiting``: ``{"waiting": num_nodes_waiting()}``;
* ``exit``: ``shutdown()``, ``{"left": <its result>}``, and the process ends.

:class:`NodeProcess` is the test's side: it starts the child, sends commands, reads the
answers with a deadline, signals the child by its PID and always kills it on close.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


# -- the child ------------------------------------------------------------------------------


def _answer(payload: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.node_process")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--nnodes", required=True, help="MIN:MAX")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--read-timeout", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    # Imported here: the test's side must not pay for torch.
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from k8s_rendezvous.handler import KubernetesRendezvousHandler

    low, high = (int(n) for n in args.nnodes.split(":"))
    handler = KubernetesRendezvousHandler.from_parameters(
        RendezvousParameters(
            backend="kubernetes",
            endpoint=args.endpoint,
            run_id=args.run_id or args.endpoint.rpartition("/")[2],
            min_nodes=low,
            max_nodes=high,
            local_addr=os.environ.get("POD_IP"),
            read_timeout=args.read_timeout,
        )
    )
    _answer({"ready": os.getpid()})
    for line in sys.stdin:
        command = line.strip()
        if command == "next":
            try:
                info = handler.next_rendezvous()
            except Exception as error:
                _answer({"error": type(error).__name__, "message": str(error)})
                continue
            joined = handler._joined
            _answer(
                {
                    "round": joined.round if joined else None,
                    "rank": info.rank,
                    "world_size": info.world_size,
                    "master": [
                        info.bootstrap_store_info.master_addr,
                        info.bootstrap_store_info.master_port,
                    ],
                }
            )
        elif command == "waiting":
            _answer({"waiting": handler.num_nodes_waiting()})
        elif command == "exit":
            _answer({"left": handler.shutdown()})
            return 0
        else:
            _answer({"error": "UnknownCommand", "message": command})
    return 0


# -- the test's side ------------------------------------------------------------------------


class NodeProcess:
    """One node process. Use as a context manager: it is killed (SIGKILL, by PID) on exit
    whatever state it is in, frozen included.

    Args:
        env: The pod's environment (``pod_environment`` fixture).
        endpoint: ``NAME`` or ``NAMESPACE/NAME`` of the Rendezvous.
        nnodes: ``MIN:MAX`` as given to torchrun.
        log_path: Where the child's log (stderr) goes.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        endpoint: str,
        nnodes: str,
        log_path: Path,
        read_timeout: int = 20,
    ) -> None:
        self.log_path = log_path
        args = [
            sys.executable,
            "-m",
            "tests.support.node_process",
            f"--endpoint={endpoint}",
            f"--nnodes={nnodes}",
            f"--read-timeout={read_timeout}",
        ]
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        full_env.pop("KUBECONFIG", None)  # the in-cluster token, nothing else
        with log_path.open("ab") as log:
            self._process = subprocess.Popen(
                args,
                cwd=REPO,
                env=full_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.pid = self._process.pid
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"node-{self.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                self._answers.put(json.loads(line))
            except ValueError:
                continue  # a stray print; answers are JSON lines
        self._answers.put(None)

    def send(self, command: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()

    def answer(self, timeout: float) -> dict[str, Any]:
        """The next answer; AssertionError naming the log if none comes in time."""
        try:
            found = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"node process {self.pid}: no answer within {timeout} s\n{self.log_tail()}"
            ) from None
        if found is None:
            raise AssertionError(f"node process {self.pid} ended\n{self.log_tail()}")
        return found

    def ask(self, command: str, timeout: float) -> dict[str, Any]:
        self.send(command)
        return self.answer(timeout)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self._process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)  # works on a stopped process too
            self._process.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.kill()


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
