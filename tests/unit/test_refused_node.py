"""A node whose request the operator refused ends with the operator's reason, even when its
watch never shows the refusal: the watch passes only round changes, and a refusal is
written within a round. The node reads the status itself after a few seconds unadmitted.

The API side is a scripted client whose watch never shows the refusal (what a real watch
filtered by round key does); the store is torch's real TCPStore."""

from __future__ import annotations

from typing import Any

import pytest
from tests.support.scripted_api import ScriptedRendezvousClient

from k8s_rendezvous.errors import NodeRefusedError
from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(2, 2, "run", join_timeout_seconds=60)
MESSAGE = "pod pod-1 is controlled by Job/other, not by Job/run: only that workload's pods"


class RefusedUnseen(ScriptedRendezvousClient):
    """Plays the operator: the join is refused in the stored status, which a read shows
    and the watch does not."""

    def __init__(self, spec: specs.RendezvousSpec) -> None:
        super().__init__(spec)
        self.refusal: records.Refusal | None = None
        self.withdrawn: list[leases.NodeEntry] = []

    def on_join(self, node: str, entry: leases.NodeEntry) -> None:
        self.refusal = records.Refusal(
            node, entry.instance, entry.attempt, "OtherWorkload", MESSAGE
        )

    def get(self, budget_seconds: float | None = None) -> dict[str, Any]:
        if self.refusal is None:
            return super().get(budget_seconds)
        return self._versioned(2, statuses.RendezvousStatus(refused=(self.refusal,)))

    def write_lease(
        self,
        node: str,
        instance: str,
        duration_seconds: int,
        owner_uid: str,
        entry: leases.NodeEntry | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        if entry is not None and entry.intent is leases.NodeIntent.LEAVE:
            self.withdrawn.append(entry)
        super().write_lease(node, instance, duration_seconds, owner_uid, entry, budget_seconds)


def test_a_refused_node_ends_with_the_operators_reason_its_watch_never_showed() -> None:
    client = RefusedUnseen(SPEC)
    handler = client.handler("pod-1", read_timeout=5)
    try:
        with pytest.raises(NodeRefusedError) as refused:
            handler.next_rendezvous()
        withdrawn = list(client.withdrawn)
    finally:
        handler.shutdown()
    assert str(refused.value) == (
        f"the operator refused node pod-1's request to join Rendezvous ns/r (OtherWorkload): "
        f"{MESSAGE}"
    )
    assert [entry.attempt for entry in withdrawn] == [1], "its request taken back at once"
