"""The operator's settings: what its flags say, parsed and checked once by ``__main__``
and carried to the kopf handlers (:mod:`.handlers`) in kopf's memo as one frozen value.
The flags, their defaults and the reasons for them are ``__main__``'s (``--help``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Probes:
    """The UDP probes of each member's agent (``--probe-interval``, ``--probe-window``)."""

    interval: float
    """Seconds between probes of each agent."""
    window: float
    """A member whose agent answered none of this many seconds' probes in a row is
    dropped: at least twice ``interval``, so that one lost datagram drops nobody."""


@dataclasses.dataclass(frozen=True)
class Webhook:
    """The mutating admission webhook that gives pods of annotated Jobs torchrun's
    environment (``--webhook`` and the ``--webhook-*`` flags)."""

    host: str
    """The host name the API server reaches it at (its Service's DNS name)."""
    service: str | None
    """``NAMESPACE/NAME`` of the Service in front of it: registered by Service reference
    (its port is :attr:`port`) instead of by URL."""
    addr: str | None
    """The address it listens on (``None``: every address)."""
    port: int
    cert_dir: Path | None
    """Where its ``ca.crt``, ``tls.crt`` and ``tls.key`` are (``None``: a self-signed set
    is made at start)."""
    timeout_seconds: int
    """How long the API server waits for it before it admits a pod without the env."""
    max_connections: int
    """The connections it serves at once; more wait in the kernel's queue."""
    config_name: str
    """The MutatingWebhookConfiguration the operator keeps it in."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the kopf handlers are told by the command line."""

    namespaces: tuple[str, ...]
    """The namespaces watched (empty: the whole cluster)."""
    job_label_selector: str | None
    """Only Jobs with these labels are watched, filtered by the API server (``None``:
    every Job, opted in by annotation)."""
    worker_role: str | None
    """The ClusterRole bound to the ServiceAccount of annotated Jobs (``None``: binding
    is left to the user)."""
    probes: Probes | None
    """``None``: no probes, a silent agent is dropped only when its Lease expires."""
    webhook: Webhook | None
    """``None``: no webhook is served."""
