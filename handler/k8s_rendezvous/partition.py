"""A member cut off from the cluster stops its workers within seconds, rather than when its
network comes back.

A member whose node's network is cut is dropped by the operator once its agent answers
no probe for the probe window (:mod:`k8s_rendezvous.probes`), and the others re-form
without it. Its own agent hears nothing of that: its watch is silent, and its workers hang
in a collective. When the network returns, a worker's first packet to a peer that
restarted meets a reset, and it fails before the watch says the round was replaced:
torch counts that against the agent's ``--max-restarts``, and with none left the pod
fails. So the agent tells itself: when the operator's probes stop, it asks the API server
for its Rendezvous; when nothing answers at the API server's address either (a timeout,
no route) this node is cut off, and ``num_nodes_waiting()`` says so, so that torch's agent
stops the workers and joins anew (a planned restart, which spends nothing).

Either silence alone is no cut: probes stop while the operator's leader changes. Nor is
an API server that restarts: its operator loses the leadership within seconds, so probes
stop too, but the API server's address still answers, with a connection refused, reset
or closed (:class:`k8s_rendezvous.errors.ApiServerSilentError` is raised only when
nothing does); neither stops the workers.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from torch.distributed.elastic.rendezvous import RendezvousError

from k8s_rendezvous.errors import ApiServerSilentError

log = logging.getLogger(__name__)

SILENCE_SECONDS: Final = 5.0
"""Probe silence after which the API server is asked: beyond the operator's probe window
(``--probe-window``, 3 probes a second apart by default), so the operator has dropped the
member by then if it could not reach it either."""
CHECK_BUDGET_SECONDS: Final = 2.0
"""Of one read of the Rendezvous, retries included: a node cut off is told within
:data:`SILENCE_SECONDS` plus this."""
MAX_RECHECK_SECONDS: Final = 60.0
"""The longest wait between reads while probes stay silent and the API server answers (an
operator without a leader for long): each wait doubles, so 1,000 members cost the API
server a few reads each, not one a second."""


class ProbeClock(Protocol):
    def silent_for(self) -> float | None:
        """Seconds since the last probe, ``None`` if none came since the node joined."""


def cut_off(silent_for: float | None, api_answered: bool | None) -> bool:
    """Whether a member is cut off: probes came, then stopped for :data:`SILENCE_SECONDS`,
    and nothing answered at the API server's address since (``None``: not asked yet)."""
    return silent_for is not None and silent_for >= SILENCE_SECONDS and api_answered is False


def recheck_after(answered_checks: int) -> float:
    """Seconds of further silence before the API server is asked again, after it answered
    ``answered_checks`` reads in this silence: doubling, up to :data:`MAX_RECHECK_SECONDS`."""
    return min(MAX_RECHECK_SECONDS, SILENCE_SECONDS * 2.0 ** (answered_checks - 1))


class Sentinel:
    """Asks the API server when probes go silent, from a background thread; :attr:`cut_off`
    says what it found. ``read`` is the Rendezvous read, bounded by its budget; what it
    returns is given to ``offer`` (the watcher), so that a node back on the network reads
    at once that its round was replaced."""

    def __init__(
        self,
        node: str,
        probes: ProbeClock,
        read: Callable[[float], Mapping[str, Any]],
        offer: Callable[[Mapping[str, Any]], None],
    ) -> None:
        self._node = node
        self._probes = probes
        self._read = read
        self._offer = offer
        self._answered: bool | None = None
        self._answered_checks = 0
        self._read_at = SILENCE_SECONDS
        """The probe silence at which the next read is due."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"k8s-rendezvous-sentinel-{node}", daemon=True
        )

    @property
    def cut_off(self) -> bool:
        return cut_off(self._probes.silent_for(), self._answered)

    def start(self) -> None:
        """Starts checking, once; later calls do nothing."""
        if not self._thread.is_alive() and not self._stopped.is_set():
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def check(self) -> None:
        """One step: read the Rendezvous if probes have been silent long enough."""
        silent = self._probes.silent_for()
        if silent is None or silent < SILENCE_SECONDS:
            self._answered, self._answered_checks, self._read_at = None, 0, SILENCE_SECONDS
            return
        if silent < self._read_at:
            return
        found: Mapping[str, Any] | None = None
        try:
            found = self._read(CHECK_BUDGET_SECONDS)
        except ApiServerSilentError as error:
            if self._answered is not False:
                log.warning(
                    "node %s is cut off: no probe for %.1f s and nothing answers at the API "
                    "server's address (%s); its workers are stopped and it joins anew once "
                    "back",
                    self._node,
                    silent,
                    error,
                )
            self._answered = False  # and read again at the next step, to see it back
            return
        except RendezvousError as error:
            # Refused, reset or an HTTP error: the network reaches the API server's end.
            log.info("node %s: no probe for %.1f s; the API server: %s", self._node, silent, error)
        self._answered = True
        self._answered_checks += 1
        self._read_at = silent + recheck_after(self._answered_checks)
        if found is not None:
            self._offer(found)

    def _run(self) -> None:
        # A second apart, spread: probes come about a second apart too.
        while not self._stopped.wait(random.uniform(0.75, 1.25)):
            try:
                self.check()
            except Exception:  # never ends the thread: the agent relies on its answer
                log.exception("node %s: checking for a cut failed", self._node)
