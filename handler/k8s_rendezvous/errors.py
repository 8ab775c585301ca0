"""Errors of the pod side. Each subclasses the torch error the agent expects and says
what to do about it."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "ApiServerSilentError",
    "KubernetesRendezvousClosedError",
    "KubernetesRendezvousConnectionError",
    "KubernetesRendezvousGracefulExitError",
    "KubernetesRendezvousStateError",
    "KubernetesRendezvousTimeoutError",
    "NodeNotAPodError",
    "NodeRefusedError",
    "NodeUnhealthyError",
    "RendezvousNotFoundError",
]


class KubernetesRendezvousConnectionError(RendezvousConnectionError):
    """The API server could not be reached, or refused us, within the retry budget."""


class ApiServerSilentError(KubernetesRendezvousConnectionError):
    """Nothing answered at the API server's address within the budget (a timeout, or no
    route): what a node cut off from the network sees. A refused, reset or closed
    connection (a proxy in front of a restarting API server closes it, even in the TLS
    handshake), or any HTTP status, is an answer from the other end, and raises the plain
    connection error."""


class RendezvousNotFoundError(KubernetesRendezvousConnectionError):
    """The Rendezvous named by --rdzv-endpoint does not exist."""


class KubernetesRendezvousStateError(RendezvousStateError):
    """The stored Rendezvous does not decode; the message names the field."""


class KubernetesRendezvousTimeoutError(RendezvousTimeoutError):
    """No round including this node was sealed within the join timeout."""


class KubernetesRendezvousClosedError(RendezvousClosedError):
    """The rendezvous is closed; no further round will be formed."""


class KubernetesRendezvousGracefulExitError(RendezvousGracefulExitError):
    """The rendezvous closed while this node waited as a spare: it was not needed. torch's
    agent logs it and ends without error; its launcher (torch 2.6 to 2.15) then fails on
    the missing run result and exits 1, as it does with c10d's spares."""


class NodeNotAPodError(RendezvousError):
    """This node is not the pod it names (``POD_NAME``, else its token's pod or the
    hostname): the operator admits only pods of the rendezvous' workload, so no round can
    include it."""


class NodeRefusedError(RendezvousError):
    """The operator refused this node's join request (its pod is not of the rendezvous'
    workload, or offers an address that is not its pod's): no round can include it. The
    message is the operator's, naming the fix."""


class NodeUnhealthyError(RendezvousError):
    """This node's health check (``--rdzv-conf health_check``) failed before a join: it
    joins no round, and its agent ends in failure so that its workload replaces the pod
    (a ``RendezvousClosedError`` would end the whole job's rendezvous, a graceful exit
    would end the pod as if it had done its work). The message says how the check failed
    and the tail of its output; the operator posts it as a HealthCheckFailed Warning."""
