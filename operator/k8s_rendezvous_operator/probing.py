"""Probes every member's agent once per interval over UDP
(:class:`k8s_rendezvous.wire.datagrams.Probe`) and hands the verdict of
:func:`.reachability.unreachable` to the reconciler after each round of probes.

Each probe's nonce is a secret of its own, new each round, so an answer names its target
whatever address it comes from (a pod answers from the address its kernel picks), and
nobody who did not see that very probe can answer it. Not one secret per round with the
target's index after it: a pod that got its own probe then knew every other member's
(the same secret, the next indexes) and could keep members of any rendezvous, in any
namespace, from being judged unreachable.

The wire format (:class:`k8s_rendezvous.wire.datagrams.Probe`, version 1) is unchanged: an agent
echoes the nonce whatever it holds, so agents of every handler version answer these.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import socket
from collections.abc import Callable, Iterable

from k8s_rendezvous.wire import datagrams
from k8s_rendezvous_operator import metrics
from k8s_rendezvous_operator.reachability import Target, unreachable

log = logging.getLogger(__name__)

_BATCH = 64
"""Probes sent between two reads of the answers: all at once, 1,000 answers would
overflow a socket's default receive buffer (about 200 of them) before the loop reads one."""
_MAX_READ = 4096
"""Answers read at one go: a flood of datagrams cannot hold the event loop."""


class Prober:
    """Sends the probes and keeps the records; started and stopped with the reconciler.

    Args:
        targets: The members to probe now (asked before each round of probes).
        judged: Given the unreachable targets after each round of probes.
        interval: Seconds between rounds of probes.
        window: A target is unreachable once it answered none of the probes of this many
            seconds' worth of rounds.
    """

    def __init__(
        self,
        targets: Callable[[], Iterable[Target]],
        judged: Callable[[frozenset[Target]], None],
        *,
        interval: float,
        window: float,
    ) -> None:
        self._targets = targets
        self._judged = judged
        self._interval = interval
        self._misses = math.ceil(window / interval - 1e-9)
        self._unanswered: dict[Target, int] = {}
        """Each target's probes sent since its last answer."""
        self._ever_answered: set[Target] = set()
        """The targets that ever answered."""
        self._sent: tuple[dict[bytes, Target], ...] = ()
        """Each target by the nonce of its probe, this round's and the last one's: an
        answer to the last round's probe, come late, still counts."""
        self._sockets: dict[socket.AddressFamily, socket.socket | None] = {}
        """Each address family's socket, once made (``None``: it cannot be, as said once)."""
        self._task: asyncio.Task[None] | None = None
        self.answers = 0
        """Answers taken so far (an answer to no probe sent is not one)."""

    def start(self) -> None:
        """Start probing, if not started yet."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for sock in self._sockets.values():
            if sock is not None:
                loop.remove_reader(sock)
                sock.close()

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval)

    async def probe_once(self) -> None:
        """One round: judge by the answers to the rounds before, then probe every target."""
        targets = list(dict.fromkeys(self._targets()))
        self._unanswered = {target: self._unanswered.get(target, 0) for target in targets}
        self._ever_answered.intersection_update(targets)
        verdict = unreachable(self._unanswered, self._ever_answered, self._misses)
        metrics.PROBED_MEMBERS.set(len(targets))
        metrics.UNREACHABLE_MEMBERS.set(len(verdict))
        self._judged(verdict)
        sent: dict[bytes, Target] = {}
        self._sent = (sent, *self._sent[:1])
        for index, target in enumerate(targets):
            if index and not index % _BATCH:
                await asyncio.sleep(0)
            if (sock := self._socket(target.addr)) is None:
                continue
            probe = datagrams.Probe(secrets.token_bytes(datagrams.PROBE_NONCE_BYTES))
            sent[probe.nonce] = target
            self._unanswered[target] += 1
            with contextlib.suppress(OSError):  # a full buffer: silence this once
                sock.sendto(probe.request(), (target.addr, target.port))

    def unanswered(self, target: Target) -> int | None:
        """``target``'s probes sent since its last answer (``None``: not probed)."""
        return self._unanswered.get(target)

    def _answered(self, nonce: bytes) -> None:
        target = next((sent[nonce] for sent in self._sent if nonce in sent), None)
        if target is not None and target in self._unanswered:
            self._unanswered[target] = 0
            self._ever_answered.add(target)
            self.answers += 1

    def _socket(self, addr: str) -> socket.socket | None:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        if family not in self._sockets:
            sock: socket.socket | None = None
            try:
                sock = socket.socket(family, socket.SOCK_DGRAM)
                sock.setblocking(False)
                with contextlib.suppress(OSError):  # what the kernel allows beyond its default
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
                asyncio.get_running_loop().add_reader(sock, self._read, sock)
            except OSError as error:
                log.warning("cannot probe members at %s (only heartbeats count): %s", addr, error)
                if sock is not None:
                    sock.close()
                sock = None
            self._sockets[family] = sock
        return self._sockets[family]

    def _read(self, sock: socket.socket) -> None:
        for _ in range(_MAX_READ):
            try:
                data = sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error queued for an earlier probe: read on
                continue
            if (probe := datagrams.Probe.from_reply(data)) is not None:
                self._answered(probe.nonce)
