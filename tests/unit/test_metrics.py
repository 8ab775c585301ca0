"""The operator's Prometheus metrics (``k8s_rendezvous_operator.metrics``), without a server."""

from __future__ import annotations

import importlib

from prometheus_client import Counter

from k8s_rendezvous_operator import events, metrics, reasons


def served_labels(counter: Counter, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_each_cause_and_budget_is_served_before_it_first_counts() -> None:
    """A series Prometheus first scrapes at 1 shows no increase: the first loss of a
    reason, the first closure, or the first suppression of a budget, would be missing from
    the dashboard."""
    importlib.import_module("k8s_rendezvous_operator.reporting")  # declares the series
    assert served_labels(metrics.MEMBERS_LOST, "reason") >= set(reasons.LOST_REASONS)
    assert served_labels(metrics.CLOSED, "reason") >= set(reasons.CLOSED_REASONS)
    assert served_labels(metrics.EVENTS_SUPPRESSED, "budget") >= set(events.WARNING_BUDGETS)
    assert served_labels(metrics.NODES_REFUSED, "reason") >= set(reasons.REFUSED_REASONS)
