"""The fanout probe works: ``bench.probes.fanout`` delivers one sealed round to watchers running
the handler's own watch and node view, in worker processes, on the real API server, and
reports a figure for each layout, the round whole or in slices each watcher watches its
own of, only when every watcher held its own rank in it."""

from __future__ import annotations

import kubernetes
from bench.probes import fanout


def test_every_watcher_holds_its_rank_in_the_delivered_round(
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    rendezvous_crd: None,
) -> None:
    chosen = ((1, 1, 0), (2, 3, 0), (2, 3, 2))
    found = fanout.measure(admin_api, namespace, layouts=chosen, repeats=1, members=8)
    layouts = found["layouts"]
    assert [(r["processes"], r["nodes_per_process"], r["slices"]) for r in layouts] == list(chosen)
    for row in layouts:
        assert row["write_to_last_node_seconds"] > 0
        assert 0 < row["watch_cpu_ms_per_node_median"] <= row["watch_cpu_ms_per_node_max"]
