"""The chart's alerts (templates/prometheusrule.yaml) through promtool, Prometheus' own rule
tester (the distribution's package, as hack/tools.sh fetches it): ``promtool check rules``
on what the chart renders, then ``promtool test rules`` with, for each alert, the series
that fire it and those that must not. tests/integration/test_dashboard.py loads the same
rules into a real Prometheus scraping a real operator, and sees one fire.

Aspects: every alert has a case that fires and one that does not; every metric an alert
reads is one the operator serves; the selector value reaches every expression; off by
default.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from devkit import dashboard, prometheus
from devkit.chart import OPERATOR, Helm, find, sets

ALERTS = (
    "K8sRendezvousOperatorAbsent",
    "K8sRendezvousNoLeader",
    "K8sRendezvousPodsNotInjected",
    "K8sRendezvousRestartsExhausted",
    "K8sRendezvousNodesWaiting",
    "K8sRendezvousMembersUnreachable",
    "K8sRendezvousReconcileBacklog",
)

OPERATOR_UP = {"series": 'k8s_rendezvous_build_info{version="0.1.0"}', "values": "1x30"}
"""A scraped operator: the series every case but the absent operator's has."""

# Each alert: (series that fire it, evaluated at, series that do not). Values are one sample
# a minute (promtool's expanding notation: "0x5" is six zeros, "1+1x3" is 1 2 3 4).
CASES: dict[str, tuple[list[dict[str, str]], str, list[dict[str, str]]]] = {
    "K8sRendezvousOperatorAbsent": (
        [{"series": 'up{job="k8s-rendezvous"}', "values": "0x10"}],
        "6m",
        [OPERATOR_UP],
    ),
    "K8sRendezvousNoLeader": (
        [
            OPERATOR_UP,
            {"series": 'k8s_rendezvous_leader{pod="a"}', "values": "1 0x10"},
            {"series": 'k8s_rendezvous_leader{pod="b"}', "values": "0x10"},
        ],
        "4m",
        [  # a takeover: a minute without a leader, then the standby leads
            OPERATOR_UP,
            {"series": 'k8s_rendezvous_leader{pod="a"}', "values": "1 0x10"},
            {"series": 'k8s_rendezvous_leader{pod="b"}', "values": "0 0 1x10"},
        ],
    ),
    "K8sRendezvousPodsNotInjected": (
        [OPERATOR_UP, {"series": "k8s_rendezvous_pods_not_injected_total", "values": "0 0 1x5"}],
        "3m",
        [OPERATOR_UP, {"series": "k8s_rendezvous_pods_not_injected_total", "values": "0x10"}],
    ),
    "K8sRendezvousRestartsExhausted": (
        [
            OPERATOR_UP,
            {
                "series": 'k8s_rendezvous_closed_total{reason="RestartsExhausted"}',
                "values": "0 0 1x5",
            },
        ],
        "3m",
        [
            OPERATOR_UP,
            {"series": 'k8s_rendezvous_closed_total{reason="RestartsExhausted"}', "values": "0x5"},
            {"series": 'k8s_rendezvous_closed_total{reason="NodeFinished"}', "values": "0 1+1x5"},
        ],
    ),
    "K8sRendezvousNodesWaiting": (
        [OPERATOR_UP, {"series": "k8s_rendezvous_nodes_waiting", "values": "2x15"}],
        "11m",
        [  # nodes admitted, others waiting anew: never 10 minutes on end
            OPERATOR_UP,
            {"series": "k8s_rendezvous_nodes_waiting", "values": "2x6 0 1x6"},
        ],
    ),
    "K8sRendezvousMembersUnreachable": (
        [OPERATOR_UP, {"series": "k8s_rendezvous_unreachable_members", "values": "1x8"}],
        "6m",
        [
            OPERATOR_UP,
            {"series": "k8s_rendezvous_unreachable_members", "values": "1 1 0 1 1 0 1 1"},
        ],
    ),
    "K8sRendezvousReconcileBacklog": (
        [OPERATOR_UP, {"series": "k8s_rendezvous_reconcile_queue_depth", "values": "150x12"}],
        "11m",
        [OPERATOR_UP, {"series": "k8s_rendezvous_reconcile_queue_depth", "values": "80x12"}],
    ),
}


def rule_groups(helm: Helm, *flags: str) -> dict[str, Any]:
    """The chart's PrometheusRule, as a rule file's content (its ``groups``)."""
    objects = helm.template_objects(*sets({"metrics.prometheusRule.enabled": "true"}), *flags)
    return {"groups": find(objects, "PrometheusRule", OPERATOR)["spec"]["groups"]}


def rules_of(groups: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in groups["groups"] for rule in group["rules"]}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(prometheus.binary("promtool")), *args], capture_output=True, text=True, check=False
    )


def test_the_rules_are_off_by_default(helm: Helm) -> None:
    assert not [o for o in helm.template_objects() if o["kind"] == "PrometheusRule"]


def test_every_alert_reads_only_metrics_the_operator_serves(helm: Helm) -> None:
    rules = rules_of(rule_groups(helm))
    assert tuple(rules) == ALERTS
    served = dashboard.served_metrics()
    for alert, rule in rules.items():
        names = set(dashboard.METRIC.findall(rule["expr"]))
        assert names and names <= served, (alert, names - served)


def test_the_selector_reaches_every_expression(helm: Helm) -> None:
    matcher = 'namespace="k8s-rendezvous-system"'
    rules = rules_of(
        rule_groups(helm, "--set-string", f"metrics.prometheusRule.selector={matcher}")
    )
    for alert, rule in rules.items():
        assert rule["expr"].count("{" + matcher) == 1, (alert, rule["expr"])


def test_each_alert_fires_on_its_series_and_not_on_others(helm: Helm, tmp_path: Path) -> None:
    """One promtool run: for each alert, its firing case expects exactly it (with its labels
    and annotations) and the other case expects nothing."""
    groups = rule_groups(helm)
    rules = rules_of(groups)
    assert set(CASES) == set(rules), "a case for every alert"
    (tmp_path / "rules.yml").write_text(json.dumps(groups))
    checked = promtool("check", "rules", str(tmp_path / "rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tests = []
    for alert, (firing, at, quiet) in CASES.items():
        rule = rules[alert]
        expected = [{"exp_labels": rule["labels"], "exp_annotations": rule["annotations"]}]
        tests.append(
            {
                "name": f"{alert} fires",
                "interval": "1m",
                "input_series": firing,
                "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
            }
        )
        tests.append(
            {
                "name": f"{alert} stays quiet",
                "interval": "1m",
                "input_series": quiet,
                "alert_rule_test": [
                    {"eval_time": at, "alertname": name, "exp_alerts": []} for name in ALERTS
                ],
            }
        )
    (tmp_path / "tests.yml").write_text(
        json.dumps({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests})
    )
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


@pytest.mark.parametrize("alert", ["K8sRendezvousNoLeader", "K8sRendezvousNodesWaiting"])
def test_a_case_that_should_fire_and_does_not_fails_promtool(
    helm: Helm, tmp_path: Path, alert: str
) -> None:
    """promtool does fail a wrong expectation: the firing series of an alert, expected to
    fire before its ``for`` has passed."""
    groups = rule_groups(helm)
    rule = rules_of(groups)[alert]
    (tmp_path / "rules.yml").write_text(json.dumps(groups))
    firing, _, _ = CASES[alert]
    early = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": firing,
                "alert_rule_test": [
                    {
                        "eval_time": "1m",
                        "alertname": alert,
                        "exp_alerts": [
                            {"exp_labels": rule["labels"], "exp_annotations": rule["annotations"]}
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(json.dumps(early))
    result = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
