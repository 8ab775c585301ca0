"""The operator's lists page through the real API server: every object comes back, a
page at a time, whatever the page size, and only what the label selects."""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import kube


def test_the_node_leases_come_back_every_one_a_page_at_a_time(
    admin_api: kubernetes.client.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordination = kubernetes.client.CoordinationV1Api(admin_api)
    nodes = [f"r.p-{i}" for i in range(7)]
    for name in [*nodes, "not-a-node"]:
        labels = {} if name == "not-a-node" else {objects.NODE_LABEL: "r"}
        coordination.create_namespaced_lease(
            namespace, {"metadata": {"name": name, "labels": labels}, "spec": {}}
        )
    monkeypatch.setattr(kube, "LIST_PAGE", 3)
    api = kube.OperatorApi(admin_api)
    pages: list[Any] = []
    request = api._request

    def counted(method: str, path: str, body: object | None = None, **options: Any) -> Any:
        pages.append(dict(options.get("query", ())))
        return request(method, path, body, **options)

    monkeypatch.setattr(api, "_request", counted)
    listed = api.list_node_leases([namespace])
    assert sorted(lease["metadata"]["name"] for lease in listed) == nodes
    assert [page.get("limit") for page in pages] == ["3", "3", "3"]
    assert [bool(page.get("continue")) for page in pages] == [False, True, True]
