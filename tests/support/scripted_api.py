"""A stand-in for the handler's ``kube.RendezvousClient`` in fast unit tests of failure
paths a real API server produces only with unlucky timing: it holds one Rendezvous, lets a
test play the operator at each join, and streams the changes as a watch would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from k8s_rendezvous import config
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, specs, statuses


class ScriptedRendezvousClient:
    """Subclasses decide, in :meth:`on_join`, the status each join leads to."""

    namespace, name, reference = "ns", "r", "Rendezvous ns/r"

    def __init__(self, spec: specs.RendezvousSpec) -> None:
        self.spec = spec
        self.joins: list[leases.NodeEntry] = []
        self._changed = threading.Condition()
        self._object = self._versioned(1, None)

    def handler(self, node: str, **options: Any) -> KubernetesRendezvousHandler:
        """The handler of pod ``node`` on 127.0.0.1 over this client, for the spec's
        nodes and run id (``options``: more of the handler's arguments)."""
        return KubernetesRendezvousHandler(
            self,  # type: ignore[arg-type]
            run_id=self.spec.run_id,
            node=node,
            addr="127.0.0.1",
            min_nodes=self.spec.min_nodes,
            max_nodes=self.spec.max_nodes,
            settings=config.Settings(self.namespace, self.name, **options),
        )

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus | None:
        """The status the operator writes after ``entry``'s join (``None``: no change)."""
        raise NotImplementedError

    def _versioned(self, version: int, status: statuses.RendezvousStatus | None) -> dict[str, Any]:
        return {
            "metadata": {"name": self.name, "uid": "u-1", "resourceVersion": str(version)},
            "spec": self.spec.to_dict(),
            **({"status": status.to_dict()} if status else {}),
        }

    # -- what the handler calls -------------------------------------------------------------

    def get(self, budget_seconds: float | None = None) -> dict[str, Any]:
        return self._object

    def open_connection(self) -> None:
        """No server to connect to ahead."""

    def identity(self) -> tuple[str, str | None]:
        """A pod's bound token, as a pod's handler runs with."""
        return "system:serviceaccount:ns:default", None

    def pod_exists(self, pod: str) -> bool | None:
        return True

    def create(self, spec: specs.RendezvousSpec, creator: str) -> bool:
        """Already there: the script holds it from the start."""
        return True

    def write_lease(
        self,
        node: str,
        instance: str,
        duration_seconds: int,
        owner_uid: str,
        entry: leases.NodeEntry | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        if entry is None or entry.intent is not leases.NodeIntent.JOIN:
            return  # heartbeats, and the leave at shutdown
        self.joins.append(entry)
        status = self.on_join(node, entry)
        if status is not None:
            with self._changed:
                version = int(self._object["metadata"]["resourceVersion"]) + 1
                self._object = self._versioned(version, status)
                self._changed.notify_all()

    def watch_unless(
        self,
        round_key: str | None,
        resource_version: str | None,
        timeout_seconds: int,
        slice_name: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        if resource_version is None:  # from the current state, as the API server does
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
