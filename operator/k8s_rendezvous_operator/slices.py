"""Which RendezvousSlices to write for a decided status (pure). A slice carries the round
(its members, master and key), the spec and the close; a forming round's bookkeeping (its
first join, its last call, conditions) writes no slice, and neither does a join."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous import state

Publication = tuple[state.RendezvousSpec, state.RendezvousStatus]
"""What the slices are made from: the spec and the status without what no slice carries.
Equal publications make equal slices, so one compare skips the per-slice diff."""


def publication(spec: state.RendezvousSpec, status: state.RendezvousStatus) -> Publication:
    return spec, dataclasses.replace(
        status,
        conditions=(),
        observed_generation=0,
        forming_since=None,
        last_call_deadline=None,
    )


def contents(spec: state.RendezvousSpec, status: state.RendezvousStatus) -> list[dict[str, Any]]:
    """Each slice's spec and status, by index (none when ``status.slices`` is 0). A merge
    patch of the spec removes a rank order dropped since (``None``)."""
    spec_fields = {"rankOrder": None} | {
        field: value for field, value in spec.to_dict().items() if field != "podSelector"
    }
    return [{"spec": spec_fields, "status": fields} for fields in status.slice_fields()]


def changed(
    spec: state.RendezvousSpec,
    status: state.RendezvousStatus,
    written: Mapping[int, Mapping[str, Any]],
) -> dict[int, dict[str, Any]]:
    """The slices whose content differs from what each was last ``written`` with."""
    return {
        index: content
        for index, content in enumerate(contents(spec, status))
        if written.get(index) != content
    }
