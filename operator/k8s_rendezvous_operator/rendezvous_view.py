"""A Rendezvous as the operator's reconcile reads it (pure): its spec, status and
metadata decoded once, into one immutable value that every part of a reconcile pass is
given instead of the object's body. The pod side reads the same objects as a
:class:`k8s_rendezvous.wire.views.NodeView`."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous.wire import codec, objects, specs, statuses
from k8s_rendezvous_operator import events, membership, names, rounds


@dataclasses.dataclass(frozen=True)
class RendezvousView:
    """One version of a Rendezvous, read (:func:`read`). Of its body it keeps only what
    the writes made from it need: :attr:`resource_version` and :attr:`uid`."""

    namespace: str
    name: str
    uid: str
    """The precondition of its deletion, and the owner of its RendezvousSlices."""
    resource_version: str
    """The version read: a status decided on it is written only over it."""
    generation: int
    spec: specs.RendezvousSpec
    status: statuses.RendezvousStatus
    status_written: bool
    """The operator wrote its status before (``status.state`` is set)."""
    holding: names.Holding
    """Who holds its name: the pod that made it, its owners."""
    workload: membership.Workload
    """Whose pods it admits."""
    creator_to_adopt: str | None
    """The pod whose controller is to own it (:func:`membership.creator_to_adopt`)."""
    exclusions_cleared_at: datetime.datetime | None
    """The user's clear annotation (:data:`objects.CLEAR_EXCLUDED_NODES_ANNOTATION`)."""
    exclusions_clear_problem: str | None
    """Why that annotation is not a time, if it is not: it then clears nothing, and is
    reported, as a typo there must not stop the rendezvous."""
    targets: tuple[Mapping[str, Any], ...]
    """Where its Events go (:func:`events.rendezvous_targets`)."""

    @property
    def key(self) -> events.Key:
        return self.namespace, self.name

    @property
    def reference(self) -> Mapping[str, Any]:
        """The Rendezvous itself, to post an Event on."""
        return self.targets[0]


def read(body: Mapping[str, Any]) -> RendezvousView:
    """Decode the Rendezvous ``body`` as the watch or the API server gave it.

    Raises:
        codec.DecodeError: its spec or status does not decode, or its status asks for
            more slices than its nodes can need (an edit by hand); the message names the
            field.
    """
    metadata = body.get("metadata") or {}
    spec = specs.RendezvousSpec.from_dict(body.get("spec"))
    status = statuses.RendezvousStatus.from_dict(body.get("status"))
    if problem := rounds.slices_problem(spec, status):
        raise codec.DecodeError(problem)
    cleared_at, clear_problem = _exclusions_cleared_at(metadata)
    return RendezvousView(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        resource_version=str(metadata.get("resourceVersion") or ""),
        generation=int(metadata.get("generation", 0)),
        spec=spec,
        status=status,
        status_written="state" in (body.get("status") or {}),
        holding=names.holding(body),
        workload=membership.workload_of(body, spec),
        creator_to_adopt=membership.creator_to_adopt(body, spec),
        exclusions_cleared_at=cleared_at,
        exclusions_clear_problem=clear_problem,
        targets=tuple(events.rendezvous_targets(body)),
    )


def _exclusions_cleared_at(
    metadata: Mapping[str, Any],
) -> tuple[datetime.datetime | None, str | None]:
    raw = (metadata.get("annotations") or {}).get(objects.CLEAR_EXCLUDED_NODES_ANNOTATION)
    if raw is None:
        return None, None
    try:
        return codec.parse_time(raw, objects.CLEAR_EXCLUDED_NODES_ANNOTATION), None
    except codec.DecodeError as error:
        return None, str(error)
