"""Bounded polling for tests against the real control plane.

Every wait in the suite has a deadline and a message that says what did not happen, so a
hang turns into a readable failure long before pytest-timeout fires.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline (an AssertionError, so pytest shows it)."""


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float,
    message: str,
    *,
    interval: float = 0.1,
    max_interval: float = 1.0,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something truthy; return that value.

    The poll interval grows from ``interval`` to ``max_interval``. Exceptions listed in
    ``ignore`` count as "not yet" (the last one is reported on timeout). On timeout raises
    :class:`WaitTimeout` with ``message``, the elapsed time and the last value seen.
    """
    start = time.monotonic()
    deadline = start + timeout
    delay = interval
    last: object = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        now = time.monotonic()
        if now >= deadline:
            raise WaitTimeout(f"{message} (waited {now - start:.1f}s; last result: {last!r})")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 1.5, max_interval)
