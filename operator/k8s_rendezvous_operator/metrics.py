"""Prometheus metrics of the operator (``--metrics-port``, ``/metrics``)."""

from __future__ import annotations

import contextlib
from typing import Final

from prometheus_client import Counter, Gauge, Histogram, start_http_server

ROUNDS_SEALED: Final = Counter(
    "k8s_rendezvous_rounds_sealed_total", "Rounds sealed by the operator."
)
SEAL_LATENCY: Final = Histogram(
    "k8s_rendezvous_seal_latency_seconds",
    "From the first join of a round to its seal, by the operator's clock.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
RANK_CHANGES: Final = Counter(
    "k8s_rendezvous_rank_changes_total",
    "Ranks that changed hands at a seal (a newcomer at a lost member's rank, a survivor "
    "moved into a free one): the rank churn recoveries cost; ranks appended are not counted.",
)
MEMBERS_LOST: Final = Counter(
    "k8s_rendezvous_members_lost_total", "Members dropped from a sealed round.", ["reason"]
)
WAITERS_EXPIRED: Final = Counter(
    "k8s_rendezvous_waiters_expired_total",
    "Join requests not counted because their agents stopped renewing their Leases.",
)
CLOSED: Final = Counter("k8s_rendezvous_closed_total", "Rendezvous closed.", ["reason"])
RESTARTS: Final = Counter(
    "k8s_rendezvous_restarts_total",
    "Re-forms caused by a failure: each spends one of its rendezvous' spec.maxRestarts.",
)
NODES_WAITING: Final = Gauge(
    "k8s_rendezvous_nodes_waiting", "Sum of status.nodesWaiting over all rendezvous."
)
SPARES_SHORT: Final = Gauge(
    "k8s_rendezvous_spares_short",
    "Rendezvous whose SparesReady condition is False: fewer nodes wait beyond the full round "
    "than their spec.spares declares.",
)
API_ERRORS: Final = Counter(
    "k8s_rendezvous_api_errors_total", "Failed API calls of the operator.", ["kind"]
)
API_REQUESTS: Final = Counter(
    "k8s_rendezvous_api_requests_total",
    "Requests the operator sent the API server, besides kopf's watches and Events, by verb "
    "and resource (the webhook sends none: it answers from the watches).",
    ["verb", "resource"],
)
WRITE_CONFLICTS: Final = Counter(
    "k8s_rendezvous_write_conflicts_total",
    "Status writes refused because the object changed since it was read (then retried).",
)
STATUS_WRITES_REFUSED: Final = Counter(
    "k8s_rendezvous_status_writes_refused_total",
    "Status writes the API server refused for good, by kind (TooLarge: more than etcd "
    "stores; Invalid: against the CRD's schema). Each holds its rendezvous until it changes "
    "or a long wait ends: a steady rate means a rendezvous stuck, not retried in a loop.",
    ["kind"],
)
for _kind in ("TooLarge", "Invalid"):  # served at 0 from the start, so the first one shows
    STATUS_WRITES_REFUSED.labels(_kind)
NODES_REFUSED: Final = Counter(
    "k8s_rendezvous_nodes_refused_total",
    "Requests never counted: the pod is not of the rendezvous' workload, or offers an "
    "address that is not its own.",
    ["reason"],
)
PODS_UNINJECTED: Final = Counter(
    "k8s_rendezvous_pods_not_injected_total",
    "Pods of annotated Jobs found made without the rendezvous env (no webhook served).",
)
EVENTS_SUPPRESSED: Final = Counter(
    "k8s_rendezvous_events_suppressed_total",
    "Warning Events about bad input left out, by the budget that was spent (rendezvous, "
    "pod, namespace, operator).",
    ["budget"],
)
PROBED_MEMBERS: Final = Gauge(
    "k8s_rendezvous_probed_members",
    "Members whose agents the operator probes each interval (--probe-interval).",
)
UNREACHABLE_MEMBERS: Final = Gauge(
    "k8s_rendezvous_unreachable_members",
    "Probed members that answered no probe within --probe-window.",
)
QUEUE_DEPTH: Final = Gauge(
    "k8s_rendezvous_reconcile_queue_depth", "Rendezvous being reconciled or waiting to be."
)
LEADER: Final = Gauge(
    "k8s_rendezvous_leader",
    "1 on the replica that acts (it holds the leader-election Lease, or runs without "
    "election), 0 on a standby.",
)
RECOVERY: Final = Histogram(
    "k8s_rendezvous_recovery_seconds",
    "From a failure or a member's loss, as the operator noticed it, to the seal of the "
    "round formed after it (status.history's formingMilliseconds of a round whose cause is "
    "neither FirstRound, NodesJoined nor SpecChanged).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)

# Per rendezvous: one series each of these for at most PER_RENDEZVOUS_LIMIT rendezvous,
# dropped with their rendezvous.
PER_RENDEZVOUS_LIMIT: Final = 500
"""How many rendezvous get series of their own. A pod with the creator role can make
rendezvous, so their number is not the operator's to choose: past this, a rendezvous
counts only in the sums (the first ones seen keep theirs), and a scrape stays bounded."""
WORLD_SIZE: Final = Gauge(
    "k8s_rendezvous_world_size",
    "Nodes in the sealed round of each rendezvous (0 while a round forms or once closed).",
    ["namespace", "rendezvous"],
)
MAX_NODES: Final = Gauge(
    "k8s_rendezvous_max_nodes", "Each rendezvous' spec.maxNodes.", ["namespace", "rendezvous"]
)
LAST_RECOVERY: Final = Gauge(
    "k8s_rendezvous_last_recovery_seconds",
    "Each rendezvous' latest recovery (k8s_rendezvous_recovery_seconds).",
    ["namespace", "rendezvous"],
)
PER_RENDEZVOUS: Final = (WORLD_SIZE, MAX_NODES, LAST_RECOVERY)


class RendezvousSeries:
    """Which rendezvous have series of their own (at most :data:`PER_RENDEZVOUS_LIMIT`)."""

    def __init__(self, limit: int = PER_RENDEZVOUS_LIMIT) -> None:
        self._limit = limit
        self._kept: set[tuple[str, str]] = set()

    def set(
        self, key: tuple[str, str], world_size: int, max_nodes: int, recovery: float | None
    ) -> None:
        if key not in self._kept:
            if len(self._kept) >= self._limit:
                return
            self._kept.add(key)
        WORLD_SIZE.labels(*key).set(world_size)
        MAX_NODES.labels(*key).set(max_nodes)
        if recovery is not None:
            LAST_RECOVERY.labels(*key).set(recovery)

    def forget(self, key: tuple[str, str]) -> None:
        if key in self._kept:
            self._kept.discard(key)
            for gauge in PER_RENDEZVOUS:
                with contextlib.suppress(KeyError):  # never recovered: no series
                    gauge.remove(*key)

    def __len__(self) -> int:
        return len(self._kept)


BUILD_INFO: Final = Gauge(
    "k8s_rendezvous_build_info", "Always 1; the running operator's version.", ["version"]
)


def serve(port: int) -> None:
    """Serve /metrics on every address family: a scraper reaches a pod at its first IP,
    IPv6 on IPv6-first clusters (an IPv6 socket here also takes IPv4 unless the kernel
    forbids it; IPv4 alone where it has no IPv6)."""
    try:
        start_http_server(port, addr="::")
    except OSError:
        start_http_server(port, addr="0.0.0.0")
