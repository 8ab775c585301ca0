"""The faults a goodput run injects and when (pure): the kinds, the deck a schedule deals
them from, and the seeded schedule itself (bench/goodput.py's ``--seed``, ``--gap``,
``--doubles`` and ``--deck``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

FAULTS = {
    "worker": "a worker SIGKILLed",
    "container": "an agent's container SIGKILLed (restartPolicy Never: the pod fails)",
    "pod": "a pod deleted",
    "drain": "a node cordoned and the Job's pods on it evicted; uncordoned after REPAIR_SECONDS",
    "node": "a node lost (kubelet killed, network cut); restored after REPAIR_SECONDS",
    "leader": "the operator's leader SIGKILLed",
    "apiserver": "the API server stopped and started again",
}
NODE_FAULTS = ("drain", "node")
POD_FAULTS = ("worker", "container", "pod", *NODE_FAULTS)
"""Faults that take a pod of the Job (the others take the control plane's)."""
GAP_SECONDS = (60.0, 90.0)


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float
    """Seconds after the schedule starts."""
    kind: str


def deck(weights: str = "") -> list[str]:
    """The kinds a schedule deals, each as many times as ``weights`` says (``"pod=3,worker=2"``;
    a kind not named comes once). A weight below 1 is refused: a soak weighs the kinds that
    form rounds more, so as to reach its count of rounds within a session, but keeps every
    kind."""
    counts = dict.fromkeys(FAULTS, 1)
    for item in filter(None, (part.strip() for part in weights.split(","))):
        kind, _, count = item.partition("=")
        if kind not in FAULTS:
            raise ValueError(f"--deck: no fault kind {kind!r}; the kinds are {', '.join(FAULTS)}")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--deck: {kind}={count!r} is not a whole number of at least 1 "
                "(every kind stays in the deck)"
            )
        counts[kind] = int(count)
    return [kind for kind, count in counts.items() for _ in range(count)]


def schedule(
    seed: int,
    seconds: float,
    kinds: Sequence[str],
    gap: tuple[float, float] = GAP_SECONDS,
    doubles: float = 0.0,
) -> list[Fault]:
    """A fault every ``gap`` seconds (uniform) within ``seconds``, each kind in turn from a
    deck shuffled anew once dealt, so that every kind comes about as often; a share
    ``doubles`` of them come with the next card at the same moment (two at once)."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    deck: list[str] = []

    def deal() -> str:
        nonlocal deck
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        return deck.pop()

    at = rng.uniform(*gap)
    while at < seconds:
        faults.append(Fault(round(at, 1), deal()))
        if doubles and rng.random() < doubles:
            faults.append(Fault(round(at, 1), deal()))
        at += rng.uniform(*gap)
    return faults
