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
judged members go silent at once, the operator is more likely cut off than they are, and
nobody is. Nodes waiting to be admitted (spares) are probed too, so that one cut off with
the member it would replace is known to be; they are judged as members are, but not
counted in that majority: a lost Kubernetes node that holds half the members and a spare
is still judged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Set

from k8s_rendezvous.wire import leases, statuses
from k8s_rendezvous_operator import rounds


@dataclasses.dataclass(frozen=True)
class Target:
    """One member's agent, where its request says it answers probes."""

    namespace: str
    rendezvous: str
    node: str
    instance: str
    addr: str
    port: int
    waiting: bool = False
    """A node waiting to be admitted, not a member."""


def unreachable(
    unanswered: Mapping[Target, int], answered: Set[Target], misses: int
) -> frozenset[Target]:
    """The targets whose last ``misses`` probes or more went unanswered (``unanswered``:
    each target's probes sent since its last answer), among those of a rendezvous with a
    target that ever ``answered``; none while more than half of the judged members are."""
    heard_from = {(target.namespace, target.rendezvous) for target in answered}
    judged = [
        target for target in unanswered if (target.namespace, target.rendezvous) in heard_from
    ]
    silent = frozenset(target for target in judged if unanswered[target] >= misses)
    members = [target for target in judged if not target.waiting]
    if 2 * sum(1 for target in silent if not target.waiting) > len(members):
        return frozenset()
    return silent


def targets(
    key: tuple[str, str],
    status: statuses.RendezvousStatus,
    requests: Mapping[str, leases.NodeEntry],
) -> tuple[Target, ...]:
    """What to probe of Rendezvous ``key`` (namespace, name): the members of a sealed
    round (a stale round's are re-joining, or lost), and the nodes waiting, in any state:
    a spare cut off with the member it would replace must be known unreachable when that
    member is, not admitted in its place."""
    members = [
        (member.node, entry, False)
        for member in status.members
        if status.state is statuses.RoundState.SEALED
        and (entry := requests.get(member.node))
        and member.admits(entry)
    ]
    waiters = [(name, requests[name], True) for name in rounds.waiting(status, requests)]
    return tuple(
        Target(*key, node, entry.instance, entry.addr, entry.probe_port, waiting)
        for node, entry, waiting in (*members, *waiters)
        if entry.probe_port
    )
