"""The fanout probe works: ``bench.fanout`` delivers one sealed round to watchers running
the handler's own watch and node view, in worker processes, on the real API server, and
reports a figure for each layout only when every watcher held its own rank in it."""

from __future__ import annotations

import kubernetes
from tests.support.fixtures import rendezvous_crd  # noqa: F401  (fixture)

from bench import fanout


def test_every_watcher_holds_its_rank_in_the_delivered_round(
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    rendezvous_crd: None,  # noqa: F811
) -> None:
    found = fanout.measure(admin_api, namespace, layouts=((1, 1), (2, 3)), repeats=1, members=8)
    layouts = found["layouts"]
    assert [(row["processes"], row["nodes_per_process"]) for row in layouts] == [(1, 1), (2, 3)]
    for row in layouts:
        assert row["write_to_last_node_seconds"] > 0
        assert 0 < row["watch_cpu_ms_per_node_median"] <= row["watch_cpu_ms_per_node_max"]
