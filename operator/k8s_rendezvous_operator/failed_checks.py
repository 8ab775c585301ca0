"""Which failed health checks to report: a node whose check fails before a join writes a
Leave carrying the report (:attr:`k8s_rendezvous.wire.leases.NodeEntry.health_check`), and the
operator, which alone may post Events, says so once per failed join.

Pure: the reconciler looks up the pod's Kubernetes node and posts.
"""

from __future__ import annotations

from k8s_rendezvous.wire import leases

Reported = tuple[str, int]
"""(agent instance, attempt): one failed check of one join."""


def to_report(entry: leases.NodeEntry | None, reported: Reported | None) -> Reported | None:
    """The failed check ``entry`` reports, if it is one not reported yet: a Leave with a
    report. A renewal or a later Leave repeating the same report (its agent's shutdown)
    is the same failure, said once."""
    if (
        entry is None
        or entry.intent is not leases.NodeIntent.LEAVE
        or entry.health_check is None
        or (entry.instance, entry.attempt) == reported
    ):
        return None
    return entry.instance, entry.attempt
