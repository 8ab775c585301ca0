"""The chart's Grafana dashboard and alerts against a real Prometheus (Grafana's server is not
one the project may use): Prometheus scrapes the operator, and evaluates the chart's alert
rules, while a short job seals rounds, loses a member, leaves nodes waiting, refuses a pod
of another workload, spends a restart budget and a Warning budget; then every query of
every panel, its variables put as Grafana puts them, must answer with a number, and the
alert of the spent budget fires (tests/chart/test_alerts.py tests every rule with promtool).

K8S_RDZV_DASHBOARD_ANSWERS=<file> also saves each query's answer over the job
(``query_range``) there, for hack/dashboard_picture.py to draw, after Prometheus has
scraped on for K8S_RDZV_DASHBOARD_HOLD more seconds (default 0): what the rates do once
the job is over.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from tests.support import fixtures
from tests.support.fixtures import Node, Rendezvous, delete_pod
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from devkit import dashboard
from devkit.chart import OPERATOR, Helm, find
from devkit.operator import OperatorProcess
from devkit.prometheus import Prometheus, binary, has_data
from devkit.waiting import wait_for
from k8s_rendezvous.errors import NodeRefusedError
from k8s_rendezvous.wire import objects

pytestmark = pytest.mark.usefixtures("operator_process")

ANSWERS_ENV = "K8S_RDZV_DASHBOARD_ANSWERS"
HOLD_ENV = "K8S_RDZV_DASHBOARD_HOLD"
SCRAPE_JOB = "k8s-rendezvous-operator"


def metrics_port(operator: OperatorProcess) -> int:
    return next(
        int(arg.split("=", 1)[1])
        for arg in operator.extra_args
        if arg.startswith("--metrics-port=")
    )


def write_unreadable_requests(
    api: kubernetes.client.ApiClient, rendezvous: Rendezvous, count: int
) -> None:
    """``count`` Leases in the shape of nodes' requests whose entries cannot be read: one
    Warning each (InvalidEntry), more than the rendezvous' budget allows in a minute."""
    coordination = kubernetes.client.CoordinationV1Api(api)
    for i in range(count):
        node = f"unreadable-{i}"
        coordination.create_namespaced_lease(
            rendezvous.namespace,
            {
                "metadata": {
                    "name": objects.lease_name(rendezvous.name, node),
                    "labels": {objects.NODE_LABEL: rendezvous.name},
                    "annotations": {objects.ENTRY_ANNOTATION: '{"instance": 7}'},
                },
                "spec": {"holderIdentity": node},
            },
        )


def run_short_job(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    prometheus: Prometheus,
) -> None:
    """Two rounds of three then two nodes, the member lost between them seen waiting by
    Prometheus, a third round after a worker failure, a rendezvous closed by its first
    failure (a restart budget of 0), and one flooded with unreadable requests."""
    rdzv = make_rendezvous(2, 3)
    nodes = make_nodes(rdzv, 3)
    fixtures.join_all(nodes)
    delete_pod(admin_api, rdzv.namespace, nodes[2].pod)
    fixtures.wait_told_to_rejoin(nodes[:2], "survivors told to re-rendezvous")
    # The survivors' rejoin ends the wait: first let a scrape see it.
    wait_for(
        lambda: prometheus.query(
            f'max_over_time(k8s_rendezvous_nodes_waiting{{job="{SCRAPE_JOB}"}}[1m]) > 0'
        ),
        20,
        "Prometheus saw nodes waiting",
    )
    fixtures.join_all(nodes[:2])
    # The second node's workers fail: its agent re-rendezvouses, a restart after a failure.
    rejoining = nodes[1].join_in_background()
    fixtures.wait_told_to_rejoin(nodes[:1], "the survivor told to re-rendezvous")
    fixtures.join_all(nodes[:1])
    rejoining.wait(30)
    assert rdzv.status().restarts == 1
    no_budget = make_rendezvous(1, 1, maxRestarts=0)
    (alone,) = make_nodes(no_budget, 1)
    fixtures.join_all([alone])
    with pytest.raises(RendezvousClosedError):
        alone.handler.next_rendezvous()  # its workers failed: the budget of 0 is spent
    flooded = make_rendezvous(1, 1)
    write_unreadable_requests(admin_api, flooded, 11)


def refuse_a_stranger(
    rdzv: Rendezvous, admin_api: kubernetes.client.ApiClient, attach: Callable[..., list[Node]]
) -> None:
    """A pod of another workload (not of the Rendezvous' podSelector) asks to join."""
    pods = fixtures.create_pods(admin_api, rdzv.namespace, ["stranger"], labels={"app": "other"})
    (stranger,) = attach(rdzv, pods)
    with pytest.raises(NodeRefusedError):
        stranger.handler.next_rendezvous()


def variables_as_grafana_fills_them(
    board: dict[str, Any], prometheus: Prometheus
) -> dict[str, str]:
    """Each query variable, in order, as Grafana fills it: label_values() over what was
    scraped (with the variables before it put in), every value selected."""
    variables = {"__rate_interval": dashboard.RATE_INTERVAL}
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        selector, label = dashboard.variable_query(board, variable["name"])
        found = prometheus.label_values(label, dashboard.promql(selector, variables))
        assert found, f"variable {variable['name']}: no values"
        variables[variable["name"]] = dashboard.multi_value(found)
    return variables


QUIET_PANELS = {"Reconcile queue depth"}
"""Panels the job need not move (a queue drained between two scrapes): they must only
answer. Every other panel must have shown more than zero at some point of the job."""


def panel_queries(
    targets: list[dashboard.Target], variables: dict[str, str]
) -> dict[str, list[str]]:
    panels: dict[str, list[str]] = {}
    for target in targets:
        panels.setdefault(target.panel, []).append(dashboard.promql(target.expr, variables))
    return panels


@pytest.mark.metrics
def test_every_panel_of_the_dashboard_answers_after_a_short_job(
    make_rendezvous: Callable[..., Rendezvous],
    make_nodes: Callable[..., list[Node]],
    attach_nodes: Callable[..., list[Node]],
    admin_api: kubernetes.client.ApiClient,
    operator_process: OperatorProcess,
    helm: Helm,
    tmp_path: Path,
) -> None:
    board = dashboard.load()
    targets = dashboard.targets(board)
    scraped = {SCRAPE_JOB: [f"127.0.0.1:{metrics_port(operator_process)}"]}
    rule = helm.template_objects("--set", "metrics.prometheusRule.enabled=true")
    rules = {"groups": find(rule, "PrometheusRule", OPERATOR)["spec"]["groups"]}
    with Prometheus(binary(), tmp_path / "prometheus", scraped, rules) as prometheus:
        began = time.time()
        wait_for(
            lambda: prometheus.query(f'up{{job="{SCRAPE_JOB}"}} == 1'),
            30,
            f"Prometheus scraping the operator (log: {prometheus.log_tail()})",
        )
        run_short_job(make_rendezvous, make_nodes, admin_api, prometheus)
        refuse_a_stranger(make_rendezvous(1, 1), admin_api, attach_nodes)

        variables = variables_as_grafana_fills_them(board, prometheus)
        assert variables["job"] == dashboard.multi_value([SCRAPE_JOB])
        panels = panel_queries(targets, variables)
        assert len(panels) == 13, list(panels)
        for panel, queries in panels.items():
            for query in queries:
                wait_for(
                    lambda query=query: has_data(prometheus.query(query)),
                    20,
                    f"panel {panel!r}: {query} answered with a number",
                )
            if panel in QUIET_PANELS:
                continue
            # The highest point each query drew over the job, as the panel's graph shows it.
            peaks = [f"max_over_time(({query})[1m:1s]) > 0" for query in queries]
            wait_for(
                lambda peaks=peaks: any(prometheus.query(peak) for peak in peaks),
                20,
                f"panel {panel!r} showed more than zero: {peaks}",
            )
        # Each cause and budget is drawn as itself.
        lost = prometheus.query(
            "sum by (reason) (increase(k8s_rendezvous_members_lost_total"
            f'{{job="{SCRAPE_JOB}"}}[1m])) > 0'
        )
        assert {s["metric"]["reason"] for s in lost} <= {"PodDeleted", "PodTerminating"}, lost
        assert lost, "the deleted pod's loss"
        suppressed = prometheus.query(
            f'increase(k8s_rendezvous_events_suppressed_total{{job="{SCRAPE_JOB}"}}[1m]) > 0'
        )
        assert [s["metric"]["budget"] for s in suppressed] == ["rendezvous"], suppressed
        closed = prometheus.query(
            f'increase(k8s_rendezvous_closed_total{{job="{SCRAPE_JOB}"}}[1m]) > 0'
        )
        assert [s["metric"]["reason"] for s in closed] == ["RestartsExhausted"], closed
        (spent,) = [t for t in targets if t.legend == "closed, budget spent"]
        spent_peak = f"max_over_time(({dashboard.promql(spent.expr, variables)})[1m:1s]) > 0"
        assert prometheus.query(spent_peak), f"the spent budget drawn: {spent_peak}"
        refused = prometheus.query(f'k8s_rendezvous_nodes_refused_total{{job="{SCRAPE_JOB}"}} > 0')
        assert [s["metric"]["reason"] for s in refused] == ["SelectorMismatch"], refused
        # The chart's alert on a spent restart budget, evaluated by Prometheus itself; the
        # operator leads (an unelected one acts), so no alert says it does not.
        wait_for(
            lambda: "K8sRendezvousRestartsExhausted" in prometheus.firing(),
            30,
            f"K8sRendezvousRestartsExhausted firing (log: {prometheus.log_tail()})",
        )
        assert not prometheus.firing() & {"K8sRendezvousNoLeader", "K8sRendezvousOperatorAbsent"}

        if answers := os.environ.get(ANSWERS_ENV):
            hold = float(os.environ.get(HOLD_ENV, "0"))
            ended = time.time() + hold
            wait_for(
                lambda: prometheus.query(f'timestamp(up{{job="{SCRAPE_JOB}"}}) >= {ended}'),
                hold + 30,
                f"Prometheus scraping on for {hold} s after the job",
                max_interval=5,
            )
            recorded = [
                {
                    "panel": target.panel,
                    "legend": target.legend,
                    "query": (query := dashboard.promql(target.expr, variables)),
                    "result": prometheus.query_range(query, began, ended, 1),
                }
                for target in targets
            ]
            Path(answers).write_text(json.dumps({"start": began, "series": recorded}))
