"""Which members' agents the operator can no longer reach: the pure judgement over the
probes :mod:`.probing` sends and the answers it gets.

A member is unreachable once it has answered none of its last few probes in a row
(``--probe-window`` over ``--probe-interval``: 3 by default). Kubernetes says nothing of a
node whose network is cut or whose host stalls until its kubelet's Lease runs out (40 s or
more), and the pods' own heartbeats are API writes, spaced out to spare the API server
(30 s by default); a probe costs the API server nothing, so it can be sent every second.

Probes are counted, not timed: judged by the age of its last answer, a member is dropped a
round early whenever rounds come a little later than the interval (they take time to
send), after as few as two lost datagrams of three.

Silence is judged against the others: when most members go silent at once, the operator is
more likely cut off than they are, and nobody is judged (their heartbeats still are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Target:
    """One member's agent, where its request says it answers probes."""

    namespace: str
    rendezvous: str
    node: str
    instance: str
    addr: str
    port: int


def unreachable(unanswered: Mapping[Target, int], misses: int) -> frozenset[Target]:
    """The targets whose last ``misses`` probes or more went unanswered (``unanswered``:
    each target's probes sent since its last answer); none while more than half of all
    targets are."""
    silent = frozenset(target for target, count in unanswered.items() if count >= misses)
    if 2 * len(silent) > len(unanswered):
        return frozenset()
    return silent
