"""Errors of the pod side. Each subclasses the torch error the agent expects and says
what to do about it."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "KubernetesRendezvousClosedError",
    "KubernetesRendezvousConnectionError",
    "KubernetesRendezvousStateError",
    "KubernetesRendezvousTimeoutError",
    "NodeNotAPodError",
    "RendezvousNotFoundError",
]


class KubernetesRendezvousConnectionError(RendezvousConnectionError):
    """The API server could not be reached, or refused us, within the retry budget."""


class RendezvousNotFoundError(KubernetesRendezvousConnectionError):
    """The Rendezvous named by --rdzv-endpoint does not exist."""


class KubernetesRendezvousStateError(RendezvousStateError):
    """The stored Rendezvous does not decode; the message names the field."""


class KubernetesRendezvousTimeoutError(RendezvousTimeoutError):
    """No round including this node was sealed within the join timeout."""


class KubernetesRendezvousClosedError(RendezvousClosedError):
    """The rendezvous is closed; no further round will be formed."""


class NodeNotAPodError(RendezvousError):
    """This node is not the pod it names (``POD_NAME``, else its token's pod or the
    hostname): the operator admits only pods of the rendezvous' workload, so no round can
    include it."""
