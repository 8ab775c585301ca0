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


OLDEST_TORCH = "2.6"
"""torch discovers torchrun backends (the ``torchrun.handlers`` group) only since 2.6."""


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler for ``--rdzv-backend=kubernetes`` (imports the client lazily)."""
    import torch

    if torch.__version__ < OLDEST_TORCH:  # a TorchVersion: compared as a version
        raise RuntimeError(
            f"k8s-rendezvous needs torch {OLDEST_TORCH} or newer, not {torch.__version__}: "
            "older torch cannot discover the kubernetes backend, and this one is untested. "
            "Upgrade torch in the training image."
        )
    from k8s_rendezvous.handler import KubernetesRendezvousHandler

    return KubernetesRendezvousHandler.from_parameters(params)
