"""Wake a worker whose collective is blocked on a peer that was cut off.

A peer whose process dies closes its connections, and a collective waiting on it fails
within milliseconds. A peer whose node is lost (its kubelet dead, its network cut) closes
nothing: a gloo collective waiting on it blocks until the process group's timeout (30
minutes by default), and neither ``dist._reconfigure`` nor gloo's ``abort()`` from another
thread wakes it. Shutting the connection down from another thread does: the blocked call
fails at once ("Connection closed by peer"), as if the peer had died, and the worker
re-forms in place (:meth:`k8s_rendezvous.in_place.World.recover`). Measured with two gloo
workers: 7 ms from the shutdown to the failed all-reduce.

So each in-place worker runs :class:`Watch`: when its node's handler publishes a round
that dropped members (:attr:`k8s_rendezvous.handoff.PublishedRound.lost_addresses`, the
pod IPs the operator checked them by) while the worker is still in an older world, it
shuts down this process's TCP connections to those addresses. Only connections to a
member the operator has already dropped are touched: the world they belong to is over. A
member dropped because its pod is being deleted (a drain, an eviction:
:attr:`~k8s_rendezvous.handoff.PublishedRound.leaving_addresses`) is finishing the step in
flight with this worker, and leaves at the step boundary: it is cut off only if still
connected :data:`~k8s_rendezvous.handoff.STOP_GRACE_SECONDS` later (its pod deleted while
its node was cut off), and not at all once this worker re-formed without it.
Linux only (``/proc``); elsewhere nothing is cut and ``in_place_loss_timeout`` bounds the
wait as before. NCCL's transports are not TCP sockets of this process and are not cut.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from k8s_rendezvous import handoff

log = logging.getLogger(__name__)

POLL_SECONDS: Final = 0.05
"""How often the watch looks at the published round: a ``stat`` (about a microsecond),
and a few hundred bytes read when it changed."""
_TCP_TABLES: Final = (Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6"))


def addresses_to_cut(
    published: handoff.PublishedRound | None,
    world_round: int,
    cut_round: int,
    *,
    leaving: bool = False,
) -> frozenset[str]:
    """The addresses whose connections to shut down, given the round the node's handler
    published, the round of the worker's current world and the last round already acted
    on: those the published round lost (``leaving``: those it lost that are leaving, to
    be cut after the grace), once per round, while the world is older."""
    if published is None or published.round <= max(world_round, cut_round):
        return frozenset()
    listed = published.leaving_addresses if leaving else published.lost_addresses
    return frozenset(filter(None, map(_canonical, listed)))


def remote_addresses(table: str) -> dict[int, str]:
    """Socket inode to remote IP, from a ``/proc/net/tcp`` or ``tcp6`` table (addresses in
    hex, each 32-bit word as the host stores it). Listening sockets have none."""
    remotes: dict[int, str] = {}
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or not fields[9].isdigit():
            continue
        address = _hex_address(fields[2].partition(":")[0])
        if address is not None and not address.is_unspecified:
            remotes[int(fields[9])] = str(_unmapped(address))
    return remotes


def shut_down_connections(addresses: Iterable[str]) -> int:
    """Shut down (both ways) this process's TCP connections to ``addresses``; how many.
    A descriptor closed or reused meanwhile is left alone."""
    wanted = frozenset(addresses)
    remotes: dict[int, str] = {}
    for table in _TCP_TABLES:
        try:
            remotes.update(remote_addresses(table.read_text()))
        except OSError:
            continue  # no IPv6 in this network namespace, or not Linux
    inodes = {inode for inode, address in remotes.items() if address in wanted}
    shut = 0
    for descriptor, inode in _socket_descriptors():
        if inode not in inodes:
            continue
        try:
            duplicate = os.dup(descriptor)
        except OSError:
            continue
        try:
            if os.fstat(duplicate).st_ino != inode:
                os.close(duplicate)
                continue
        except OSError:
            os.close(duplicate)
            continue
        # shutdown() acts on the connection, which the duplicate shares; close() below
        # closes only the duplicate, so the owner's descriptor stays valid.
        with socket.socket(fileno=duplicate) as connection:
            try:
                connection.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass  # already closed by its peer
    return shut


class Watch:
    """Cuts this worker's connections to the members each newly published round lost.

    Args:
        directory: The node's handoff directory.
        world_round: The round of the worker's current world (read from the watch's
            thread: an ``int`` read is atomic).
    """

    def __init__(self, directory: Path, world_round: Callable[[], int]) -> None:
        self._path = directory / handoff.ROUND_FILE
        self._world_round = world_round
        self._cut_round = 0
        self._leaving_round = 0
        self._leavers: tuple[int, float, frozenset[str]] | None = None
        """Members the latest round dropped while they leave: (round, when they are cut
        off by ``time.monotonic()``, their addresses)."""
        self._seen: tuple[int, int] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-rendezvous-cut", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            try:
                self._once()
            except (OSError, handoff.HandoffError) as error:
                # The in-place path reads the same file and says what is wrong with it.
                log.debug("could not read the published round: %s", error)
            self._cut_leavers()

    def _once(self) -> None:
        status = self._path.stat()
        seen = (status.st_ino, status.st_mtime_ns)
        if seen == self._seen:
            return
        self._seen = seen
        published = handoff.read_round(self._path.parent)
        world_round = self._world_round()
        leaving = addresses_to_cut(published, world_round, self._leaving_round, leaving=True)
        if published is not None and leaving:
            self._leaving_round = published.round
            due = time.monotonic() + handoff.STOP_GRACE_SECONDS
            self._leavers = (published.round, due, leaving)
        addresses = addresses_to_cut(published, world_round, self._cut_round)
        if published is None or not addresses:
            return
        self._cut_round = published.round
        shut = shut_down_connections(addresses)
        log.warning(
            "round %d dropped %s: shut down %d connection(s) to it, so that a collective "
            "blocked on it fails now",
            published.round,
            ", ".join(sorted(addresses)),
            shut,
        )

    def _cut_leavers(self) -> None:
        """Cut the leaving members still connected once their grace is over, unless this
        worker re-formed without them meanwhile."""
        if self._leavers is None or time.monotonic() < self._leavers[1]:
            return
        round_number, _, addresses = self._leavers
        self._leavers = None
        if self._world_round() >= round_number:
            return
        shut = shut_down_connections(addresses)
        log.warning(
            "round %d dropped %s while leaving, still in this worker's world %.0f s later: "
            "shut down %d connection(s) to it",
            round_number,
            ", ".join(sorted(addresses)),
            handoff.STOP_GRACE_SECONDS,
            shut,
        )


def _socket_descriptors() -> list[tuple[int, int]]:
    """This process's socket descriptors with their inodes."""
    found: list[tuple[int, int]] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found.append((int(name), int(target[8:-1])))
    return found


def _hex_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    if len(raw) not in (4, 16):
        return None
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _unmapped(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _canonical(text: str) -> str | None:
    try:
        return str(_unmapped(ipaddress.ip_address(text.strip("[]"))))
    except ValueError:
        return None
