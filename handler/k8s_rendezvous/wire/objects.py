"""The objects both sides read and write: the API group and kinds, the labels and
annotations, and the names of a Rendezvous, a node's Lease and the RendezvousSlices, with
the owner references that tie them together."""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from collections.abc import Mapping
from typing import Any, Final, TypeGuard

from k8s_rendezvous.wire import codec

GROUP: Final = "k8s-rendezvous.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "rendezvous"
KIND: Final = "Rendezvous"
API_VERSION: Final = f"{GROUP}/{VERSION}"

SLICE_KIND: Final = "RendezvousSlice"
SLICE_PLURAL: Final = "rendezvousslices"
SLICE_MEMBERS: Final = 100
"""A rendezvous admitting more nodes than this is published in slices of about this many
members. Every node receives every sealed round: whole, that is O(N) bytes per node and
O(N^2) per round (122 MB at 1000 nodes); sliced, about 14 kB per node. Smaller rendezvous
are not sliced: a slice costs one more write after each round change."""
MAX_SLICES: Final = 1000
"""The CRD's bound on ``status.slices``: 100000 nodes (maxNodes' bound) in slices of 100."""
MAX_NAME: Final = 253
"""The most characters of a Kubernetes object's name (a DNS subdomain)."""
MAX_UID: Final = 64
"""The most characters of an object's uid as a pod may mark it (Kubernetes writes 36)."""
NODE_LABEL: Final = f"{GROUP}/rendezvous"
"""On a node's pod (set by the operator) and Lease (set by the node): the Rendezvous name."""
INSTANCE_ANNOTATION: Final = f"{GROUP}/instance"
"""On a node's Lease: the agent instance that renews it."""
ENTRY_ANNOTATION: Final = f"{GROUP}/entry"
"""On a node's Lease: its :class:`leases.NodeEntry` as JSON, the node's request to the operator."""
CLEAR_EXCLUDED_NODES_ANNOTATION: Final = f"{GROUP}/clear-excluded-nodes"
"""On a Rendezvous, an RFC 3339 time: the operator forgets the nodes it keeps out that
failed at or before it (``status.excludedNodes``). The user writes the annotation; the
operator alone writes the status."""
CREATED_BY_ANNOTATION: Final = f"{GROUP}/created-by-pod"
"""On a Rendezvous a pod made (not an annotated Job's): that pod's name. The admission
policy holds it to the creator's token; the operator then sets the Rendezvous' owner to
that pod's controller, as the Pod object says."""
POD_UID_ANNOTATION: Final = f"{GROUP}/pod-uid"
"""On a node's Lease: the uid of the pod that wrote it, from its bound token. The admission
policy holds it to the token's, so the operator can tell the pod that wrote a Lease from a
later pod of the same name (a StatefulSet's, a PyTorchJob's) that has not written yet."""
_RENDEZVOUS_NAME: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


def rendezvous_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a Rendezvous, else ``None``. It must be a DNS label (at
    most 63 lowercase letters, digits and '-', no dots; the CRD holds the same): it is a
    label value, and a node's Lease ``<rendezvous>.<pod>`` must read one way, while pod
    names may have dots."""
    if _RENDEZVOUS_NAME.match(name):
        return None
    return (
        f"{name!r} cannot name a Rendezvous: it must be a DNS label (at most 63 lowercase "
        "letters, digits and '-', no dots), as a node's Lease <rendezvous>.<pod> must name "
        "one rendezvous and one pod"
    )


_OBJECT_NAME: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z"
)


def is_object_name(text: object) -> TypeGuard[str]:
    """Whether ``text`` can name a pod (or most objects): a DNS subdomain of at most 253
    characters. A name a pod wrote is checked so before it goes into an API path or a
    message: a '/' or '..' in it could otherwise name another object."""
    return isinstance(text, str) and len(text) <= MAX_NAME and bool(_OBJECT_NAME.match(text))


def lease_name(rendezvous: str, node: str) -> str:
    """The name of a node's heartbeat Lease: ``<rendezvous>.<pod>``, shortened with a hash
    when that exceeds the 253 characters of a Kubernetes name. The rendezvous has no dot
    (:func:`rendezvous_name_problem`), so the name reads one way."""
    name = f"{rendezvous}.{node}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    # A DNS subdomain's labels end in an alphanumeric: no "-." or ".." at the cut.
    return f"{name[:236].rstrip('-.')}.{digest}"


def slice_count(max_nodes: int) -> int:
    """How many slices a Rendezvous admitting ``max_nodes`` is published in (0: none)."""
    return 0 if max_nodes <= SLICE_MEMBERS else math.ceil(max_nodes / SLICE_MEMBERS)


def slices_needed(max_nodes: int, nodes: int = 0) -> int:
    """The most slices a Rendezvous can need: as many as ``max_nodes`` fill, or its
    ``nodes`` (members and left behind) if ``maxNodes`` was lowered since. More is a status
    edited by hand: neither side follows it."""
    return slice_count(max(max_nodes, nodes))


def slice_index(node: str, count: int) -> int:
    """The slice that carries pod ``node``'s entries: a stable hash, so that a node knows
    its slice before it has a rank (both sides compute it)."""
    return zlib.crc32(node.encode()) % count


def slice_name(rendezvous: str, index: int) -> str:
    """``<rendezvous>.slice-<index>`` (Rendezvous names have at most 63 characters)."""
    return f"{rendezvous}.slice-{index}"


def resource_version(obj: Mapping[str, Any]) -> int:
    """``obj``'s resourceVersion as a number, -1 if it has none.

    resourceVersions are opaque, but on every API server backed by etcd they are its
    revisions: comparing them is how a watch event and a write's response of the same
    object are told apart by age.
    """
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", -1))
    except (TypeError, ValueError):
        return -1


def owner_reference(
    api_version: str, kind: str, name: str, uid: str, *, controller: bool = True
) -> dict[str, Any]:
    """An ownerReference that never blocks the owner's deletion: blocking would need
    ``update`` on the owner's finalizers, and nothing we make must outlive its owner."""
    reference: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid}
    if controller:
        reference["controller"] = True
    reference["blockOwnerDeletion"] = False
    return reference


def rendezvous_uid(obj: Mapping[str, Any]) -> str:
    """The uid of the Rendezvous ``obj`` is, or is a slice of (its owner)."""
    metadata = obj.get("metadata") or {}
    if obj.get("kind") != SLICE_KIND:
        return str(metadata["uid"])
    for owner in metadata.get("ownerReferences") or []:
        if owner.get("kind") == KIND and owner.get("uid"):
            return str(owner["uid"])
    raise codec.DecodeError(
        f"metadata.ownerReferences: RendezvousSlice {metadata.get('name')!r} names no "
        "Rendezvous. Slices are written by the k8s-rendezvous operator alone: delete this "
        "one, and the operator writes it anew at the next round change or restart"
    )
