"""A node admitted to a round whose rank 0 is gone before it connects (the soak found it:
rank 0 left between the seal and the others' connect) gets our named connection error,
not torch's DistNetworkError, and a message that says what happened.

The API side is a scripted client (a fast unit test of a failure path); the store side is
torch's real TCPStore, connecting to a port where nothing listens.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_rendezvous import state
from k8s_rendezvous.errors import KubernetesRendezvousConnectionError
from k8s_rendezvous.handler import KubernetesRendezvousHandler

SPEC = state.RendezvousSpec(2, 2, "run", join_timeout_seconds=30)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ScriptedClient:
    """Answers like the API server would once the operator sealed a round of two in which
    this node is rank 1 and rank 0's store is at ``master_port``."""

    namespace, name, reference = "ns", "r", "Rendezvous ns/r"

    def __init__(self, master_port: int) -> None:
        self._master_port = master_port
        self._sealed: dict[str, Any] | None = None
        self._written = threading.Event()

    def _object(self, version: int, status: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "metadata": {"name": "r", "uid": "u-1", "resourceVersion": str(version)},
            "spec": SPEC.to_dict(),
            **({"status": status} if status else {}),
        }

    def get(self) -> dict[str, Any]:
        return self._object(1, None)

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
        if entry is None or self._sealed is not None:
            return
        members = (
            state.Member("pod-0", "other", 1, "127.0.0.1"),
            state.Member(node, entry.instance, entry.attempt, entry.addr),
        )
        status = state.RendezvousStatus(
            state=state.RoundState.SEALED,
            round=1,
            members=members,
            master=state.Master("127.0.0.1", self._master_port),
        )
        self._sealed = self._object(2, status.to_dict())
        self._written.set()

    def watch_unless(
        self, round_key: str | None, resource_version: str | None, timeout_seconds: int
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if resource_version is None:  # from the current state, as the API server does
            yield "ADDED", self._sealed or self.get()
            return
        self._written.wait(timeout_seconds)
        if self._sealed is not None and resource_version != "2":
            yield "MODIFIED", self._sealed


def test_unreachable_store_of_rank_0_is_a_named_connection_error() -> None:
    port = closed_port()
    handler = KubernetesRendezvousHandler(
        ScriptedClient(port),  # type: ignore[arg-type]
        run_id="run",
        node="pod-1",
        addr="127.0.0.1",
        min_nodes=2,
        max_nodes=2,
        read_timeout=1,
    )
    try:
        with pytest.raises(KubernetesRendezvousConnectionError) as error:
            handler.next_rendezvous()
    finally:
        handler.shutdown()
    message = str(error.value)
    assert "node pod-1 is rank 1 of round 1 of Rendezvous ns/r" in message
    assert f"could not reach the round's store at 127.0.0.1:{port} (rank 0, pod pod-0)" in message
    assert "the next next_rendezvous() joins a new round" in message
    assert isinstance(error.value.__cause__, RuntimeError)
