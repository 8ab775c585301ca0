"""An etcd 3.5 with the v2 API on 127.0.0.1, for torch's ``etcd-v2`` rendezvous backend.

etcd 3.6 (the control plane's) serves no v2 API, so bench/build_etcd_v2.sh
builds 3.5 from the Go module proxy. Started in its own session, stopped by PID.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.scenarios import free_port

HERE = Path(__file__).resolve().parent


def build() -> tuple[Path | None, str]:
    """The binary, or ``None`` and why not."""
    if shutil.which("go") is None:
        return None, "Go is not on the PATH: etcd 3.5 cannot be built"
    proc = subprocess.run(
        ["bash", str(HERE / "build_etcd_v2.sh")],
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        return None, f"building etcd 3.5 failed: {proc.stderr.strip()[-600:]}"
    return Path(lines[-1]), ""


def python_etcd_missing() -> str:
    try:
        import etcd  # noqa: F401
        import torch.distributed.elastic.rendezvous.etcd_rendezvous_backend  # noqa: F401
    except ImportError as error:
        return f"python-etcd does not import: {error}"
    return ""


class EtcdV2:
    def __init__(self, binary: Path, log_path: Path) -> None:
        self.binary = binary
        self.log_path = log_path
        self.port = free_port()
        self.peer_port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="bench-etcd-v2-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def start(self) -> None:
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    "--enable-v2=true",
                    "--name=bench",
                    f"--data-dir={self._dir / 'data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=bench={peer}",
                    "--unsafe-no-fsync=true",
                    "--log-level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self._process.returncode}; see {self.log_path}"
                )
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{client}/v2/keys/", timeout=2) as answer,
            ):
                json.loads(answer.read())
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd v2 API not ready within 60 s; see {self.log_path}")

    def stop(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)
