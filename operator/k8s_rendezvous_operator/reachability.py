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

Silence is judged against the others. Only members of a rendezvous one of whose members
has answered are judged: where none ever did, UDP from the operator does not reach them (a
NetworkPolicy) or they are long gone, and their heartbeats judge them. And when most of the
judged go silent at once, the operator is more likely cut off than they are, and nobody is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Set


@dataclasses.dataclass(frozen=True)
class Target:
    """One member's agent, where its request says it answers probes."""

    namespace: str
    rendezvous: str
    node: str
    instance: str
    addr: str
    port: int


def unreachable(
    unanswered: Mapping[Target, int], answered: Set[Target], misses: int
) -> frozenset[Target]:
    """The targets whose last ``misses`` probes or more went unanswered (``unanswered``:
    each target's probes sent since its last answer), among those of a rendezvous with a
    member that ever ``answered``; none while more than half of those are silent."""
    heard_from = {(target.namespace, target.rendezvous) for target in answered}
    judged = [
        target for target in unanswered if (target.namespace, target.rendezvous) in heard_from
    ]
    silent = frozenset(target for target in judged if unanswered[target] >= misses)
    if 2 * len(silent) > len(judged):
        return frozenset()
    return silent
