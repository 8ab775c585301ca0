"""The chart's Grafana dashboard read as the queries its panels send, with Grafana's
variables put in the way Grafana does, so that a real Prometheus can answer them
(tests/integration/test_dashboard.py; hack/dashboard_picture.py draws the answers)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devkit import paths

DASHBOARD = paths.CHART / "dashboards" / "k8s-rendezvous.json"

RATE_INTERVAL = "1m"
"""What Grafana puts for ``$__rate_interval`` with its default scrape interval of 15 s
(four of them): the window every rate of the dashboard is taken over."""

VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
LABEL_VALUES = re.compile(r"^label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")


@dataclasses.dataclass(frozen=True)
class Target:
    """One query of one panel."""

    panel: str
    legend: str
    expr: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def targets(dashboard: Mapping[str, Any]) -> list[Target]:
    """Every query of every panel, rows' folded panels included, in the dashboard's order."""
    found: list[Target] = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", ())]:
            found += [
                Target(inner["title"], target.get("legendFormat", ""), target["expr"])
                for target in inner.get("targets", ())
            ]
    return found


def variable_query(dashboard: Mapping[str, Any], name: str) -> tuple[str, str]:
    """(series selector, label) of a ``label_values(...)`` query variable."""
    (variable,) = (v for v in dashboard["templating"]["list"] if v["name"] == name)
    parsed = LABEL_VALUES.match(variable["definition"])
    if parsed is None:
        raise ValueError(f"variable {name}: not label_values(...): {variable['definition']}")
    return parsed["match"].strip(), parsed["label"]


REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def multi_value(values: list[str]) -> str:
    """A multi-value variable with these values selected, as Grafana's Prometheus data
    source puts it into a ``=~`` matcher: alternatives, each regex character escaped with
    a backslash that the PromQL string itself escapes (``a.b`` becomes ``a\\\\.b``)."""
    return "(" + "|".join(REGEX_SPECIAL.sub(r"\\\\\1", value) for value in values) + ")"


def promql(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with its ``$name`` and ``${name}`` variables replaced; a variable not in
    ``variables`` is an error, so that no query reaches Prometheus with Grafana's syntax."""

    def put(found: re.Match[str]) -> str:
        name = found[1] or found[2]
        if name not in variables:
            raise KeyError(f"{expr}: no value for the variable ${name}")
        return variables[name]

    return VARIABLE.sub(put, expr)


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name as the panel's legendFormat makes it (``{{reason}}``)."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda found: labels.get(found[1], ""), template)


def served_metrics() -> set[str]:
    """The series names the operator serves (``k8s_rendezvous_operator.metrics``): a
    counter's ``_total``, a gauge's name, a histogram's ``_bucket``, ``_sum`` and ``_count``:
    what a panel or an alert may ask for."""
    from prometheus_client.metrics import MetricWrapperBase

    from k8s_rendezvous_operator import metrics

    return {
        f"{family.name}{suffix}"
        for value in vars(metrics).values()
        if isinstance(value, MetricWrapperBase)
        for family in value.describe()
        for suffix in {
            "counter": ("_total",),
            "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count"),
        }[family.type]
    }


METRIC = re.compile(r"\bk8s_rendezvous_\w+")
"""A metric name of the operator's, in a query."""
