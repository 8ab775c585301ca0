"""A Rendezvous read once (``k8s_rendezvous_operator.rendezvous_view``), without any I/O.

Aspects: what a reconcile needs is read from one body, and of the body only the
resourceVersion and uid its writes are conditioned on are kept; Events go to the
Rendezvous and its controlling Job; a clear annotation that is not a time is a problem
named, not a refusal; a spec or status that does not decode, or a status asking for more
slices than its nodes need, is refused naming the field.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import pytest

from k8s_rendezvous.wire import codec, objects, records, specs, statuses
from k8s_rendezvous_operator import rendezvous_view

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
JOB = {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "uid-job"}


def body(**metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {
            "name": "train",
            "namespace": "ns",
            "uid": "uid-r",
            "resourceVersion": "42",
            "generation": 3,
            **metadata,
        },
        "spec": specs.RendezvousSpec(1, 4, "run").to_dict(),
    }


def test_one_read_holds_what_a_pass_needs_and_of_the_body_only_the_write_preconditions() -> None:
    sealed = statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=1,
        members=(records.Member("p1", "i1", 1, "10.0.0.1"),),
        master=records.Master("10.0.0.1", 29500),
        sealed_at=T0,
    )
    owned = body(ownerReferences=[JOB | {"controller": True}]) | {
        "status": sealed.operator_fields()
    }
    view = rendezvous_view.read(owned)
    assert (view.key, view.uid, view.resource_version, view.generation) == (
        ("ns", "train"),
        "uid-r",
        "42",
        3,
    )
    assert view.spec == specs.RendezvousSpec(1, 4, "run")
    assert view.status == sealed
    assert view.status_written
    assert view.holding.owner_uids == frozenset({"uid-job"})
    assert (view.workload.owner, view.workload.selector) == ("Job/train", None)
    assert view.creator_to_adopt is None, "owned already"
    assert [(t["kind"], t["metadata"]["name"]) for t in view.targets] == [
        ("Rendezvous", "train"),
        ("Job", "train"),
    ]
    assert set(view.reference) == {"apiVersion", "kind", "metadata"}, "a reference, no body"
    kept = {field.name for field in dataclasses.fields(view)}
    assert not kept & {"body", "metadata", "raw"}


def test_a_status_the_operator_never_wrote_is_the_initial_one() -> None:
    view = rendezvous_view.read(body())
    assert view.status == statuses.RendezvousStatus()
    assert not view.status_written


def test_a_clear_annotation_that_is_not_a_time_is_named_and_clears_nothing() -> None:
    annotation = objects.CLEAR_EXCLUDED_NODES_ANNOTATION
    cleared = rendezvous_view.read(body(annotations={annotation: "2026-01-01T01:00:00Z"}))
    assert cleared.exclusions_cleared_at == T0 + datetime.timedelta(hours=1)
    assert cleared.exclusions_clear_problem is None
    typo = rendezvous_view.read(body(annotations={annotation: "yesterday"}))
    assert typo.exclusions_cleared_at is None
    assert typo.exclusions_clear_problem is not None
    assert typo.exclusions_clear_problem.startswith(annotation)


@pytest.mark.parametrize(
    ("part", "value", "field"),
    [
        ("spec", {"minNodes": "one", "maxNodes": 4, "runId": "run"}, "spec.minNodes"),
        ("status", {"state": "Forming", "schemaVersion": 1, "round": "one"}, "status.round"),
        ("status", {"state": "Forming", "schemaVersion": 1, "slices": 7}, "status.slices"),
    ],
)
def test_what_does_not_decode_is_refused_naming_the_field(
    part: str, value: dict[str, Any], field: str
) -> None:
    with pytest.raises(codec.DecodeError) as refused:
        rendezvous_view.read(body() | {part: value})
    assert str(refused.value).startswith(field), refused.value
