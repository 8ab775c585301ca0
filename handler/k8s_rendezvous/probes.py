"""Answers the operator's reachability probes (:class:`k8s_rendezvous.wire.datagrams.Probe`) from a
background thread, for as long as the agent lives.

Heartbeats are API writes, so their window is long (30 s by default): 1,000 nodes renewing
every second would be 1,000 writes a second. A probe costs the API server nothing, so the
operator can probe every member each second and drop one that stops answering (a node
whose network is cut, or whose host stalls) within seconds. The answer comes from the
agent's process itself: a live pod whose agent is stopped does not answer either.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from k8s_rendezvous.wire import datagrams

log = logging.getLogger(__name__)


def _bind() -> socket.socket:
    """A UDP socket on every address of the pod, IPv6 and IPv4 alike where the host has
    IPv6 (an IPv6-only or IPv6-first pod's address is IPv6), on a port of the kernel's
    choosing (the node's request names it)."""
    try:
        bound = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    except OSError:  # no IPv6 in this kernel
        bound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        bound.bind(("0.0.0.0", 0))
        return bound
    bound.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    bound.bind(("::", 0))
    return bound


class ProbeResponder:
    """Echoes each probe to its sender until stopped; anything else is ignored."""

    def __init__(self, node: str) -> None:
        self._socket = _bind()
        self.port = int(self._socket.getsockname()[1])
        self._last_probe: float | None = None
        """When the last probe came (monotonic), since the node last joined."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"k8s-rendezvous-probes-{node}", daemon=True
        )
        self._thread.start()

    def silent_for(self) -> float | None:
        """Seconds since the last probe, ``None`` if none came since :meth:`forget` (a node
        not yet probed, or whose probes never reach it, is not silent)."""
        last = self._last_probe
        return None if last is None else time.monotonic() - last

    def forget(self) -> None:
        """A new membership begins (a join): probes come once its round is sealed."""
        self._last_probe = None

    def stop(self) -> None:
        self._stopped.set()
        # Wakes the thread from its receive (Linux does so even for an unconnected UDP
        # socket, though it says ENOTCONN).
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._thread.join()
        self._socket.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                datagram, sender = self._socket.recvfrom(datagrams.Probe.REQUEST_BYTES + 1)
            except OSError as error:
                if not self._stopped.is_set():
                    log.warning("answering the operator's probes stopped: %s", error)
                return
            probe = datagrams.Probe.from_request(datagram)
            if probe is None:
                continue
            self._last_probe = time.monotonic()
            with contextlib.suppress(OSError):  # e.g. no route back: the next probe retries
                self._socket.sendto(probe.reply(), sender)
