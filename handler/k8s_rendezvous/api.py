"""What the pod side needs of the Kubernetes API, as Protocols.

:class:`k8s_rendezvous.kube.RendezvousClient` is the one implementation that talks to an
API server; tests hand the handler, the round watcher and the heartbeat their own stand-ins
(a scripted operator, scripted watches). Each part is typed against the least it uses:

- :class:`RendezvousReader`: the round watcher (reads and watches one Rendezvous);
- :class:`LeaseWriter`: the heartbeat (renews the node's Lease);
- :class:`RendezvousApi`: the handler (both, and what a join needs besides).

Errors are the pod side's own (:mod:`k8s_rendezvous.errors`), whatever the implementation:
a caller never sees the client library's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from k8s_rendezvous.wire import leases, specs


class RendezvousReader(Protocol):
    """Reads and watches one Rendezvous (and its RendezvousSlices)."""

    @property
    def name(self) -> str:
        """The Rendezvous' name."""

    @property
    def reference(self) -> str:
        """``Rendezvous <namespace>/<name>``, for messages."""

    def get(self, budget_seconds: float | None = None) -> Mapping[str, Any]:
        """The Rendezvous as stored, within ``budget_seconds``, retries and each request
        included (the client's read budget if ``None``). Raises ``RendezvousNotFoundError``
        if it is missing."""

    def watch_unless(
        self,
        round_key: str | None,
        resource_version: str | None,
        timeout_seconds: int,
        slice_name: str | None = None,
    ) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """``(event type, object)`` for the changes whose ``status.roundKey`` is not
        ``round_key``, from ``resource_version`` (``None``: the current object first), of
        the Rendezvous or of its slice ``slice_name``. Raises on a broken or expired stream:
        the caller watches again."""


class LeaseWriter(Protocol):
    """Writes this node's own Lease: its heartbeat and its join request."""

    def write_lease(
        self,
        node: str,
        instance: str,
        duration_seconds: int,
        owner_uid: str,
        entry: leases.NodeEntry | None = None,
        budget_seconds: float | None = None,
    ) -> None:
        """Renew node ``node``'s Lease (owned by the Rendezvous of ``owner_uid``) and, if
        given, replace its entry, within ``budget_seconds`` (default: the client's)."""


class RendezvousApi(RendezvousReader, LeaseWriter, Protocol):
    """Everything the handler asks of the API."""

    @property
    def namespace(self) -> str:
        """The Rendezvous' namespace."""

    def open_connection(self) -> None:
        """Leave an idle connection to the API server in the pool; never raises."""

    def identity(self) -> tuple[str, str | None]:
        """The user these credentials are, and the pod a bound token was issued for."""

    def pod_exists(self, pod: str) -> bool | None:
        """Whether Pod ``pod`` exists in the namespace; ``None`` if these credentials may
        not tell."""

    def create(self, spec: specs.RendezvousSpec, creator: str) -> bool:
        """Create the Rendezvous (made by pod ``creator``); ``True`` if made or already
        there, ``False`` if these credentials may not."""
