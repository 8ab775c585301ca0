"""Warning budgets (``k8s_rendezvous_operator.events.WarningBudgets``), without I/O.

Aspects: a pod's Warnings are bounded whatever names it writes under; a namespace's
whatever pods it has; the operator's whatever namespaces; the window frees them again;
and the memory kept for made-up names is bounded.
"""

from __future__ import annotations

import datetime

from k8s_rendezvous_operator import events

T0 = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)


def allowed(budgets: events.WarningBudgets, calls: list[tuple[str, str, str | None]]) -> int:
    return sum(budgets.allow(T0, namespace, rdzv, pod) for namespace, rdzv, pod in calls)


def test_a_pod_writing_under_made_up_rendezvous_names_gets_its_own_budget_only() -> None:
    budgets = events.WarningBudgets()
    flood = [("team", f"made-up-{index}", "attacker") for index in range(300)]
    assert allowed(budgets, flood) == events.WARNING_BUDGETS["pod"]
    assert budgets.allow(T0, "team", "train", "honest"), "another pod still reports"


def test_a_namespace_of_many_pods_is_bounded_and_others_are_not_starved() -> None:
    budgets = events.WarningBudgets()
    flood = [("team", f"r-{index}", f"pod-{index}") for index in range(300)]
    assert allowed(budgets, flood) == events.WARNING_BUDGETS["namespace"]
    assert budgets.allow(T0, "other-team", "train", "pod-0")


def test_the_operator_as_a_whole_is_bounded() -> None:
    budgets = events.WarningBudgets()
    flood = [(f"ns-{index}", "r", f"pod-{index}") for index in range(1000)]
    assert allowed(budgets, flood) == events.WARNING_BUDGETS["operator"]


def test_the_window_frees_the_budget_and_the_memory_of_made_up_names() -> None:
    budgets = events.WarningBudgets()
    for index in range(2000):
        budgets.allow(T0, f"ns-{index}", f"r-{index}", f"pod-{index}")
    later = T0 + events.WARNING_WINDOW
    assert budgets.allow(later, "ns-0", "r-0", "pod-0")
    for index in range(events.WARNING_BUDGETS["operator"]):
        budgets.allow(later, f"x-{index}", "r", "p")
    assert len(budgets) <= events.BUDGETS_KEPT + 4 * events.WARNING_BUDGETS["operator"]
