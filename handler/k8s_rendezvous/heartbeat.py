"""The heartbeat: renews this node's Lease from a background thread, as torch's c10d
handler runs its keep-alive timer. The operator drops a member whose Lease expires."""

from __future__ import annotations

import logging
import threading

from torch.distributed.elastic.rendezvous import RendezvousError

from k8s_rendezvous import api
from k8s_rendezvous.wire import specs, tunables

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews this node's Lease from a background thread until stopped, like torch's
    keep-alive timer; failures are logged and retried on the next beat. The first beat
    comes one period after the join, which wrote the Lease itself."""

    def __init__(
        self, client: api.LeaseWriter, node: str, instance: str, budget_seconds: float
    ) -> None:
        self._client = client
        self._node = node
        self._instance = instance
        self._budget = budget_seconds
        """Of one renewal, retries included (c10d's ``heartbeat_timeout``): a renewal
        that cannot be made in time gives way to the next, one period later."""
        self._period = 10.0
        self._timeout = tunables.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
        self._owner_uid = ""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, spec: specs.RendezvousSpec, owner_uid: str) -> None:
        self._period = spec.heartbeat_interval_seconds
        self._timeout = spec.heartbeat_timeout_seconds
        self._owner_uid = owner_uid
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"k8s-rendezvous-heartbeat-{self._node}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._client.write_lease(
                    self._node,
                    self._instance,
                    self._timeout,
                    self._owner_uid,
                    budget_seconds=self._budget,
                )
            except RendezvousError as error:
                log.warning("node %s could not renew its heartbeat: %s", self._node, error)
