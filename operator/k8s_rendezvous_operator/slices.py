"""Which RendezvousSlices to write for a decided status (pure). A slice carries the round
(its members, master and key), the spec and the close; a forming round's bookkeeping (its
first join, its last call, conditions) writes no slice, and neither does a join to a slice
already written.

Only slices that some node needs are written: those its pods hash to, once a pod asked to
join or the status names it. So what a Rendezvous costs the operator is bounded by the pods
that join, not by ``maxNodes`` (any pod that may make a Rendezvous sets that, up to 100000:
1,000 slices written with no node ever joining). A node watches its slice before its own
request is seen; the slice appears, with the round, in the write that follows it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from k8s_rendezvous.wire import objects, specs, statuses

Publication = tuple[specs.RendezvousSpec, statuses.RendezvousStatus, frozenset[int]]
"""What the slices are made from: the spec, the status without what no slice carries, and
which slices are written. Equal publications make equal slices, so one compare skips the
per-slice diff."""


def needed(
    status: statuses.RendezvousStatus, requesters: Iterable[str], written: Iterable[int]
) -> frozenset[int]:
    """The slices to write: each that carries a pod which asked to join (``requesters``)
    or that the status names, and each ``written`` before, kept in step while the
    Rendezvous lives so that none goes stale under a node watching it."""
    if not status.slices:
        return frozenset()
    nodes = {*requesters, *status.named_nodes()}
    return frozenset({objects.slice_index(node, status.slices) for node in nodes} | set(written))


def publication(
    spec: specs.RendezvousSpec, status: statuses.RendezvousStatus, indexes: frozenset[int]
) -> Publication:
    return (
        spec,
        dataclasses.replace(
            status,
            conditions=(),
            observed_generation=0,
            forming_since=None,
            last_call_deadline=None,
        ),
        indexes,
    )


def contents(
    spec: specs.RendezvousSpec, status: statuses.RendezvousStatus, indexes: Iterable[int]
) -> dict[int, dict[str, Any]]:
    """The spec and status of each slice of ``indexes``. A merge patch of the spec removes
    a rank order dropped since (``None``)."""
    spec_fields = {"rankOrder": None} | {
        field: value for field, value in spec.to_dict().items() if field != "podSelector"
    }
    return {
        index: {"spec": spec_fields, "status": fields}
        for index, fields in status.slice_fields(indexes).items()
    }


def changed(
    spec: specs.RendezvousSpec,
    status: statuses.RendezvousStatus,
    indexes: Iterable[int],
    written: Mapping[int, Mapping[str, Any]],
) -> dict[int, dict[str, Any]]:
    """The slices of ``indexes`` whose content differs from what each was last
    ``written`` with."""
    return {
        index: content
        for index, content in contents(spec, status, indexes).items()
        if written.get(index) != content
    }
