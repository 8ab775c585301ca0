"""A node whose watch lost track while the round that admitted it was sealed, and which
was left behind when the next round sealed without it, asks again instead of waiting out
its join timeout.

The API side is a scripted client (a fast unit test of a path a real API server produces
only with a well-timed watch failure); the store is torch's real TCPStore.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from k8s_rendezvous import state
from k8s_rendezvous.handler import KubernetesRendezvousHandler

SPEC = state.RendezvousSpec(2, 2, "run", join_timeout_seconds=20)
OTHER = state.Member("pod-0", "other", 1, "10.0.0.1")


class ScriptedClient:
    """Plays the operator: the first join is admitted to round 1, which this node never
    sees, and left behind by round 2; a new join is admitted to round 3 as rank 0."""

    namespace, name, reference = "ns", "r", "Rendezvous ns/r"

    def __init__(self) -> None:
        self.entries: list[state.NodeEntry] = []
        self._changed = threading.Condition()
        self._object = self._versioned(1, state.RendezvousStatus())

    def _versioned(self, version: int, status: state.RendezvousStatus) -> dict[str, Any]:
        return {
            "metadata": {"name": "r", "uid": "u-1", "resourceVersion": str(version)},
            "spec": SPEC.to_dict(),
            "status": status.to_dict(),
        }

    def get(self) -> dict[str, Any]:
        return self._object

    def open_connection(self) -> None:
        """No server to connect to ahead."""

    def write_lease(
        self,
        node: str,
        instance: str,
        duration_seconds: int,
        owner_uid: str,
        entry: state.NodeEntry | None = None,
    ) -> None:
        if entry is None or entry.intent is not state.NodeIntent.JOIN:
            return  # heartbeats, and the leave at shutdown
        self.entries.append(entry)
        this = state.Member(node, entry.instance, entry.attempt, entry.addr)
        if len(self.entries) == 1:
            status = state.RendezvousStatus(
                state=state.RoundState.SEALED,
                round=2,
                members=(OTHER, state.Member("pod-2", "third", 1, "10.0.0.2")),
                master=state.Master(OTHER.addr, 1),
                left_behind=(this,),
            )
            version = 3  # round 1, version 2, went by while the watch had lost track
        else:
            status = state.RendezvousStatus(
                state=state.RoundState.SEALED,
                round=3,
                members=(this, OTHER),
                master=state.Master(entry.addr, entry.store_port),
            )
            version = 4
        with self._changed:
            self._object = self._versioned(version, status)
            self._changed.notify_all()

    def watch_unless(
        self, round_key: str | None, resource_version: str | None, timeout_seconds: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if resource_version is None:
            yield "ADDED", self._object
            resource_version = self._object["metadata"]["resourceVersion"]
        with self._changed:
            self._changed.wait_for(
                lambda: self._object["metadata"]["resourceVersion"] != resource_version,
                timeout_seconds,
            )
            changed = self._object
        if changed["metadata"]["resourceVersion"] != resource_version:
            yield "MODIFIED", changed


def test_a_node_left_behind_by_a_round_it_missed_joins_again() -> None:
    client = ScriptedClient()
    handler = KubernetesRendezvousHandler(
        client,  # type: ignore[arg-type]
        run_id="run",
        node="pod-1",
        addr="127.0.0.1",
        min_nodes=2,
        max_nodes=2,
        read_timeout=5,
    )
    try:
        info = handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert (info.rank, info.world_size) == (0, 2)
    assert [entry.attempt for entry in client.entries] == [1, 2]
    assert client.entries[0].instance == client.entries[1].instance
    assert client.entries[1].store_port == client.entries[0].store_port
