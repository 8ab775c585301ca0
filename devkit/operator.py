"""Run the real operator as a separate process, the way a Deployment would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from devkit import processes


class OperatorProcess:
    """``python -m k8s_rendezvous_operator`` against a kubeconfig; stopped by PID.

    Args:
        kubeconfig: Credentials the operator runs with (admin, or a ServiceAccount token).
        log_path: Where its output goes (read it when a test fails).
        namespaces: Watch only these namespaces; all when empty.
        extra_args: More flags, after the defaults (``--liveness=``, ``--verbose``,
            ``--metrics-port=0``: several run side by side); a repeated flag wins over its
            default.
        env: More environment variables (e.g. a pod's POD_NAME and POD_NAMESPACE).
        verbose: ``--verbose`` (what a test's log wants; a Deployment runs without it).
    """

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        namespaces: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        verbose: bool = True,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.namespaces = namespaces
        self.extra_args = extra_args
        self.env = dict(env or {})
        self.verbose = verbose
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        assert self._process is None or self._process.poll() is not None, "already running"
        # Its temporary files (the webhook's self-signed certificate) beside its log, not
        # in /tmp: a process stopped with SIGKILL cannot remove them itself.
        temporary = self.log_path.with_name(f"{self.log_path.name}.tmp")
        temporary.mkdir(exist_ok=True)
        env = {
            **os.environ,
            **self.env,
            "KUBECONFIG": str(self.kubeconfig),
            "TMPDIR": str(temporary),
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        args = [sys.executable, "-m", "k8s_rendezvous_operator", "--liveness="]
        if self.verbose:
            args.append("--verbose")
        for namespace in self.namespaces:
            args += ["--namespace", namespace]
        if not any(arg.startswith("--metrics-port") for arg in self.extra_args):
            args.append("--metrics-port=0")  # tests run several operators side by side
        args += self.extra_args
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def pause(self) -> None:
        """SIGSTOP: a hung operator, whose sockets still accept connections and never
        answer (until :meth:`resume`; :meth:`stop` resumes it first)."""
        assert self._process is not None and self._process.poll() is None, "not running"
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL: what Kubernetes does to a pod."""
        self.resume()
        processes.terminate(self._process, timeout)

    def terminate(self) -> None:
        """SIGTERM without waiting (see :meth:`returncode`)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def returncode(self) -> int | None:
        """None while it runs (or was never started)."""
        return None if self._process is None else self._process.poll()

    def log(self) -> str:
        return processes.read_log(self.log_path)

    def log_tail(self, lines: int = 60) -> str:
        return processes.log_tail(self.log_path, lines)
