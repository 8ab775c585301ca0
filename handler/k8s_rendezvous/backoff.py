"""How long to wait before the next try: capped exponential backoff with jitter, as a pure
policy (attempt -> seconds), shared by both sides (the operator's reconcile retries, the
pod side's watch reconnects and request retries).

Without jitter, every client that failed at the same moment (an API server restart seen
by 16,384 nodes at once) tries again at the same moments, doubling in lockstep: each retry
is a herd as large as the first. "Full jitter" (a delay drawn uniformly below the capped
exponential) spreads them over the whole window, so the API server meets about as many
requests per second as the window allows, not all of them at its edges.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Attempt ``n`` (counted from 0) waits ``min(cap, base * 2**n)`` seconds, of which the
    last ``jitter`` fraction is drawn at random: ``jitter=1`` is full jitter (anywhere in
    ``(0, ceiling]``), ``jitter=0.5`` waits at least half the ceiling."""

    base: float
    """The ceiling of the first attempt's wait, in seconds."""
    cap: float
    """The ceiling no attempt's wait goes past, in seconds."""
    jitter: float = 1.0
    """The fraction of the ceiling drawn at random (0: none, 1: full jitter)."""

    def __post_init__(self) -> None:
        if not 0 < self.base <= self.cap:
            raise ValueError(f"backoff: need 0 < base <= cap, got {self.base} and {self.cap}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff: jitter is a fraction in [0, 1], got {self.jitter}")

    def ceiling(self, attempt: int) -> float:
        """The longest attempt ``attempt`` waits."""
        # 2**attempt overflows a float past attempt 1023: the cap is reached long before.
        return self.cap if attempt >= 64 else min(self.cap, self.base * 2.0**attempt)

    def delay(self, attempt: int, draw: Callable[[], float] = random.random) -> float:
        """The seconds attempt ``attempt`` waits. ``draw`` returns a number in [0, 1)
        (:func:`random.random`, or a seeded generator's in tests)."""
        return self.ceiling(attempt) * (1 - self.jitter * draw())


class Retries:
    """The attempts of one thing being retried (a watch, a request), under a
    :class:`Backoff`: :meth:`next_delay` after each failure, :meth:`reset` after a
    success or when what failed changed (a new version of the object)."""

    def __init__(self, policy: Backoff, draw: Callable[[], float] = random.random) -> None:
        self.policy = policy
        self.attempt = 0
        """The failures in a row so far."""
        self._draw = draw

    def next_delay(self) -> float:
        delay = self.policy.delay(self.attempt, self._draw)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
