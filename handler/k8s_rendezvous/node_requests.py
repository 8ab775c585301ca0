"""What this node writes: its requests, into its own Lease (a Join, and the Leave, Close
or Finish that end it), and the Rendezvous it writes them under: read, or made from
torchrun's parameters where the node may, its spec checked against torchrun's. A node
whose health check fails writes a Leave that says why, and joins no round.

A request names this agent's instance and its attempt (one per join request written), so
that the operator never admits a request the node has given up on.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError

from k8s_rendezvous import api, config, health_check, messages, watch
from k8s_rendezvous.errors import (
    KubernetesRendezvousStateError,
    NodeUnhealthyError,
    RendezvousNotFoundError,
)
from k8s_rendezvous.wire import codec, leases, objects, specs

log = logging.getLogger(__name__)


class NodeRequests:
    """Writes this node's requests into its Lease, under its Rendezvous.

    Args:
        client: Reads and writes the Rendezvous (:class:`k8s_rendezvous.api.RendezvousApi`).
        watcher: The round watcher, whose Rendezvous is read before the API is asked.
        node: This node's name, the key of its entry (the pod name).
        addr: The address other nodes reach this node at.
        probe_port: Where the node answers the operator's reachability probes.
        instance: This agent's instance id.
        run_id: torchrun's ``--rdzv-id``; must match the resource's ``spec.runId``.
        nnodes: torchrun's ``--nnodes`` minimum and maximum.
        settings: What ``--rdzv-conf`` says: the spec fields it sets, the health check.
    """

    def __init__(
        self,
        client: api.RendezvousApi,
        watcher: watch.RoundWatcher,
        *,
        node: str,
        addr: str,
        probe_port: int,
        instance: str,
        run_id: str,
        nnodes: tuple[int, int],
        settings: config.Settings,
    ) -> None:
        self._client = client
        self._watcher = watcher
        self._node = node
        self._addr = addr
        self._probe_port = probe_port
        self.instance = instance
        """This agent's instance id, in its every request: a restarted agent is a new one."""
        self._run_id = run_id
        self._nnodes = nnodes
        self._settings = settings
        self._configured_spec = settings.configured_spec
        self.attempt = 0
        """How many join requests this instance has written (0: none yet)."""
        self.store_port = 0
        """The port of the store the current join offers."""
        self.failed_check: leases.HealthCheckReport | None = None
        """Why this node's health check failed: every Leave it writes from then says so,
        shutdown()'s too, so that a later write cannot hide it from the operator."""
        self._spec_checked = False

    def check_health(self) -> None:
        """Run the health check, if configured; if it fails, say why in this node's Lease
        (a Leave the operator reports in a HealthCheckFailed Warning) and end the agent.

        Raises:
            NodeUnhealthyError: The check failed: no join request is written.
        """
        command = self._settings.health_check
        if not command:
            return
        report = health_check.run(command, self._settings.health_check_timeout)
        if report is None:
            return
        self.failed_check = report
        how = report.summary()
        log.error(
            "node %s does not join %s: its health check %s %s; its output ends:\n%s",
            self._node,
            self._client.reference,
            shlex.join(command),
            how,
            report.tail,
        )
        try:
            self.write(leases.NodeIntent.LEAVE)
        except RendezvousError as error:
            log.warning("node %s could not report its failed health check: %s", self._node, error)
        raise NodeUnhealthyError(
            messages.unhealthy(
                self._node, self._client.reference, shlex.join(command), how, report.tail
            )
        )

    def request(self, intent: leases.NodeIntent) -> leases.NodeEntry:
        """This node's request of its current attempt. The store port only matters to a
        Join (made after the port is offered); the others repeat the last one, if any."""
        return leases.NodeEntry(
            self.instance,
            max(self.attempt, 1),
            self._addr,
            self.store_port or 1,
            intent,
            probe_port=self._probe_port,
            health_check=self.failed_check if intent is leases.NodeIntent.LEAVE else None,
        )

    def ask(self, spec: specs.RendezvousSpec, owner_uid: str) -> tuple[leases.NodeEntry, int]:
        """Write this node's join request of the current attempt; returns it, and the
        watcher's mark from before the write (the seal that admits it cannot be missed)."""
        request = self.request(leases.NodeIntent.JOIN)
        since = self._watcher.mark()
        self._client.write_lease(
            self._node, self.instance, spec.heartbeat_timeout_seconds, owner_uid, request
        )
        return request, since

    def write(self, intent: leases.NodeIntent) -> None:
        """Write ``intent`` (a Leave, Close or Finish) into this node's Lease."""
        entry = self.request(intent)
        obj = self._watcher.latest or self.read_or_create()  # c10d's set_closed() creates
        spec = self.check_spec(obj)
        self._client.write_lease(
            self._node,
            self.instance,
            spec.heartbeat_timeout_seconds,
            self.owner_uid(obj),
            entry,
            # c10d's close timeout bounds set_closed() and shutdown() alike.
            budget_seconds=self._configured_spec.get(
                "closeTimeoutSeconds", spec.close_timeout_seconds
            ),
        )

    def withdraw(self) -> None:
        """Take back this node's join request, as it stops waiting (best effort)."""
        try:
            self.write(leases.NodeIntent.LEAVE)
        except RendezvousError as error:
            log.warning("node %s could not withdraw its join: %s", self._node, error)

    def read_or_create(self) -> Mapping[str, Any]:
        """The Rendezvous, made first if it is missing and this node may make it.

        Raises:
            RendezvousNotFoundError: It is missing, and not this node's to make.
        """
        try:
            return self._client.get()
        except RendezvousNotFoundError:
            if not self._create_rendezvous():
                raise
            return self._client.get()

    def _create_rendezvous(self) -> bool:
        """Make the missing Rendezvous from torchrun's parameters, to be owned by this
        pod's controller, so any workload (JobSet, PyTorchJob, StatefulSet) works by changing
        only the rendezvous backend. ``False`` if this service account may not."""
        spec = config.spec_to_create(*self._nnodes, self._run_id, self._configured_spec)
        if not self._client.create(spec, self._node):
            return False
        log.info(
            "node %s created %s (%d:%d nodes); the operator makes its pod's controller the owner",
            self._node,
            self._client.reference,
            spec.min_nodes,
            spec.max_nodes,
        )
        return True

    def owner_uid(self, obj: Mapping[str, Any]) -> str:
        """The uid of the Rendezvous, which owns this node's Lease."""
        try:
            return objects.rendezvous_uid(obj)
        except codec.DecodeError as error:
            raise KubernetesRendezvousStateError(f"{self._client.reference}: {error}") from error

    def check_spec(self, obj: Mapping[str, Any]) -> specs.RendezvousSpec:
        """The Rendezvous' spec, if it is of this node's run; the first time, where it
        differs from torchrun's parameters, said in the log (the resource wins).

        Raises:
            KubernetesRendezvousStateError: The spec is invalid, or of another run id.
        """
        try:
            spec = specs.RendezvousSpec.from_dict(obj.get("spec"))
        except codec.DecodeError as error:
            raise KubernetesRendezvousStateError(
                messages.invalid_spec(self._client.reference, error)
            ) from error
        if spec.run_id != self._run_id:
            # Merged into one round, nodes of two run ids would wait on different store
            # prefixes for ever; c10d keeps them in two rendezvous.
            raise KubernetesRendezvousStateError(
                messages.other_run(self._client.reference, spec.run_id, self._run_id)
            )
        if not self._spec_checked:
            self._spec_checked = True
            for disagreement in config.disagreements(spec, self._nnodes, self._configured_spec):
                log.warning("%s %s; the resource wins", self._client.reference, disagreement)
        return spec

    def join_timeout(self, spec: specs.RendezvousSpec) -> int:
        """This node's join deadline in seconds: its own ``--rdzv-conf join_timeout`` if
        given (a local deadline, as in torch's c10d), else the spec's."""
        return self._configured_spec.get("joinTimeoutSeconds", spec.join_timeout_seconds)
