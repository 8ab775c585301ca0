"""The health gate: a command a node runs before each join (``--rdzv-conf health_check``),
bounded in time and in the output kept. A node whose check fails joins no round.

The command runs without a shell (``shlex.split`` of what was given), in its own process
group, so that a check that hangs is ended whole, the programs it started included.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Final

from k8s_rendezvous.wire import leases

log = logging.getLogger(__name__)

_KEPT_BYTES: Final = 4 * leases.MAX_HEALTH_CHECK_TAIL
"""Output bytes kept while the check runs: its last ones, enough for the tail's characters
even where each takes several bytes; the rest is read and dropped, so that a check that
prints without end costs no memory."""
_READ_BYTES: Final = 65536


def _keep_tail(stream: io.BufferedReader, kept: bytearray) -> None:
    """Read ``stream`` to its end, keeping only its last :data:`_KEPT_BYTES` in ``kept``."""
    while chunk := stream.read1(_READ_BYTES):
        kept.extend(chunk)
        del kept[:-_KEPT_BYTES]


def tail_of(output: bytes) -> str:
    """What of ``output`` a report carries: its last characters, printable."""
    return leases.printable_tail(output.decode("utf-8", errors="replace"))


def run(command: Sequence[str], timeout_seconds: float) -> leases.HealthCheckReport | None:
    """Run the check; ``None`` if it passed (exit code 0 within ``timeout_seconds``), else
    why it failed. Its time is logged either way."""
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed whole at the bound
        )
    except OSError as error:
        seconds = time.monotonic() - started
        log.warning("health check %s could not start: %s", command[0], error)
        return leases.HealthCheckReport(
            leases.HealthCheckOutcome.NOT_STARTED, seconds, tail=leases.printable_tail(str(error))
        )
    assert isinstance(process.stdout, io.BufferedReader)
    kept = bytearray()
    reader = threading.Thread(
        target=_keep_tail,
        args=(process.stdout, kept),
        name="k8s-rendezvous-health-check",
        daemon=True,  # a grandchild that keeps the pipe open must not hold the agent's exit
    )
    reader.start()
    timed_out = False
    try:
        process.wait(timeout_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        # The group, not the process: a shell's children would hold the output open, and
        # the GPU, after their parent is gone.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # Its group may have left a child holding the pipe open (one that made its own
    # session): the output read by the bound is what is reported.
    reader.join(timeout=1)
    seconds = time.monotonic() - started
    tail = tail_of(bytes(kept))
    if timed_out:
        log.warning(
            "health check %s ran past its bound of %.0f s and was killed", command[0], seconds
        )
        return leases.HealthCheckReport(leases.HealthCheckOutcome.TIMED_OUT, seconds, tail=tail)
    code = process.returncode
    log.info("health check %s exited %d after %.3f s", command[0], code, seconds)
    if code == 0:
        return None
    return leases.HealthCheckReport(leases.HealthCheckOutcome.FAILED, seconds, code, tail)
