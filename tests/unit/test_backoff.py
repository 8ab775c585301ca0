"""The retry policy both sides share (``k8s_rendezvous.backoff``): each attempt's wait
stays within its capped exponential ceiling, full jitter spreads it over the whole window
(never in lockstep), a partial jitter keeps a floor, and the attempts start over after a
reset."""

from __future__ import annotations

import random
import statistics

import pytest

from k8s_rendezvous import backoff

POLICY = backoff.Backoff(base=0.5, cap=30.0)


def test_the_ceiling_doubles_from_the_base_up_to_the_cap() -> None:
    assert [POLICY.ceiling(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert POLICY.ceiling(10_000) == 30, "no overflow however long it fails"


def test_each_delay_stays_within_its_ceiling_and_is_never_zero() -> None:
    draw = random.Random(7).random
    for attempt in range(12):
        for _ in range(200):
            delay = POLICY.delay(attempt, draw)
            assert 0 < delay <= POLICY.ceiling(attempt)
    assert POLICY.delay(3, lambda: 0.0) == 4.0, "the top of the window"
    assert POLICY.delay(3, lambda: 0.999) == pytest.approx(0.004), "the bottom of it"


def test_full_jitter_spreads_clients_that_failed_together_over_the_whole_window() -> None:
    """1,000 clients at their 7th failure, each with its own generator: their retries
    cover the window evenly (as a uniform draw would), not one moment."""
    delays = [POLICY.delay(6, random.Random(seed).random) for seed in range(1000)]
    assert min(delays) < 1.5 and max(delays) > 28.5
    assert statistics.mean(delays) == pytest.approx(15, abs=1.5)
    assert len({round(d, 3) for d in delays}) > 950, "hardly two at the same millisecond"


def test_a_partial_jitter_keeps_a_floor_under_each_wait() -> None:
    policy = backoff.Backoff(base=60, cap=900, jitter=0.5)
    draw = random.Random(3).random
    delays = [policy.delay(0, draw) for _ in range(500)]
    assert min(delays) >= 30 and max(delays) <= 60
    assert backoff.Backoff(base=1, cap=1, jitter=0).delay(5, draw) == 1, "no jitter: exact"


def test_retries_count_failures_in_a_row_and_start_over_after_a_reset() -> None:
    retries = backoff.Retries(POLICY, draw=lambda: 0.0)  # the top of each window
    assert [retries.next_delay() for _ in range(4)] == [0.5, 1, 2, 4]
    assert retries.attempt == 4
    retries.reset()
    assert retries.next_delay() == 0.5


@pytest.mark.parametrize(
    ("base", "cap", "jitter"), [(0, 1, 1), (2, 1, 1), (1, 2, -0.1), (1, 2, 1.5)]
)
def test_a_policy_that_cannot_be_kept_is_refused_at_once(
    base: float, cap: float, jitter: float
) -> None:
    with pytest.raises(ValueError, match="backoff"):
        backoff.Backoff(base=base, cap=cap, jitter=jitter)
