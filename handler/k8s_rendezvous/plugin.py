"""The ``torchrun.handlers`` entry point.

torch calls :func:`handler_creator` with no arguments when
``torch.distributed.elastic.rendezvous`` is imported and registers what it returns under
the entry-point name. Keep this module cheap: it runs in every torchrun, ours or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_handler


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``--rdzv-backend=kubernetes`` (imports the client lazily)."""
    from k8s_rendezvous.handler import KubernetesRendezvousHandler

    return KubernetesRendezvousHandler.from_parameters(params)
