"""What a pod writes, read by the operator within bounds: whatever a pod puts in its Lease
(or, with the creator role, in a Rendezvous), and whatever any client sends the webhook,
is either read or refused with a named problem, and never raises anything else.

Aspects: the bounded JSON reader (size, depth far beyond the interpreter's recursion,
values); the Lease, its request and its marks fuzzed (Hypothesis) with pathological
nesting, sizes and types; each poison of the shared corpus named as the operator's Warning
says it; a holder that is not a pod's name speaks for nobody; at start, one poisoned Lease
is its own refusal among the others; a pod-made Rendezvous' spec and creator, and the
webhook's body, fuzzed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st
from tests.support.poison import POISONS, WELL_FORMED, Poison

from k8s_rendezvous.wire import codec, leases, objects, specs
from k8s_rendezvous_operator import membership, names, reasons, reconciler, webhook

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
NESTED = st.builds(
    lambda opener, depth, tail: opener * depth + tail,
    st.sampled_from(["[", '{"a":', '[{"healthCheck":', '{"healthCheck":[']),
    st.integers(1, 30_000),
    st.sampled_from(["", "1", "]" * 5, "}"]),
)
"""Pathological nesting: up to ten times deeper than json's recursion allows, closed or not."""
MUTATED = st.builds(
    lambda key, value: json.dumps(WELL_FORMED | {key: value}),
    st.sampled_from([*WELL_FORMED, "healthCheck"]),
    JSON_VALUES,
)
"""A well-formed request with one field anything at all."""
ENTRY_TEXTS = st.one_of(st.text(), JSON_VALUES.map(json.dumps), NESTED, MUTATED)
NAMES = st.one_of(
    st.sampled_from(["pod-a", "a/../../x", "A", "", "." * 300, "a" * 254, "w-0.train"]),
    st.text(max_size=300),
)


def lease_body(
    holder: object, annotations: dict[str, Any], rendezvous: object = "train"
) -> dict[str, Any]:
    name = (
        objects.lease_name(rendezvous, holder)
        if isinstance(holder, str) and isinstance(rendezvous, str)
        else holder
    )
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {objects.NODE_LABEL: rendezvous},
            "annotations": annotations,
        },
        "spec": {"holderIdentity": holder},
    }


def test_json_is_read_only_within_its_bounds() -> None:
    def problem(text: str, **bounds: int) -> str:
        with pytest.raises(codec.DecodeError) as refused:
            codec.decode_json(text, "f", **{"max_length": 100, "max_depth": 2, **bounds})
        return str(refused.value)

    assert codec.decode_json("[[1], {}]", "f", max_length=100, max_depth=2) == [[1], {}]
    assert problem("[[[1]]]") == "f: nested more than 2 deep"
    assert problem("[" * 50, max_length=1000).startswith("f: not JSON (")
    assert problem("[" * 100_000, max_length=100_000) == "f: nested more than 2 deep"
    assert problem("[1, 2, 3]", max_values=3) == "f: more than 3 values"
    assert problem("1" * 101) == "f: 101 characters long, more than 100"
    assert problem("{not json").startswith("f: not JSON (")
    with pytest.raises(codec.DecodeError, match="bytes long"):
        codec.decode_json(b"[]" * 60, "f", max_length=100, max_depth=2)


@hypothesis.given(ENTRY_TEXTS)
@hypothesis.settings(max_examples=300, deadline=None)
def test_any_entry_text_is_a_request_or_a_named_problem(text: str) -> None:
    try:
        entry = leases.NodeEntry.from_annotation(text, "entry")
    except codec.DecodeError as error:
        assert str(error).startswith("entry")
        return
    assert leases.NodeEntry.from_annotation(entry.to_annotation(), "again") == entry


@hypothesis.given(
    holder=NAMES,
    rendezvous=st.one_of(st.just("train"), st.text(max_size=70)),
    entry=ENTRY_TEXTS,
    instance=st.one_of(st.none(), st.just("i-1"), st.text(max_size=100)),
    pod_uid=st.one_of(st.none(), st.just("uid-a"), st.text(max_size=100)),
)
@hypothesis.settings(max_examples=300, deadline=None)
def test_any_lease_speaks_for_no_node_or_for_its_holder_within_bounds(
    holder: str, rendezvous: str, entry: str, instance: str | None, pod_uid: str | None
) -> None:
    annotations = {objects.ENTRY_ANNOTATION: entry}
    for key, value in (
        (objects.INSTANCE_ANNOTATION, instance),
        (objects.POD_UID_ANNOTATION, pod_uid),
    ):
        if value is not None:
            annotations[key] = value
    lease = leases.NodeLease.from_body(lease_body(holder, annotations, rendezvous))
    if lease is None:
        return
    assert objects.is_object_name(lease.node) and lease.node == holder
    assert objects.rendezvous_name_problem(lease.rendezvous) is None
    if lease.entry is None:
        assert lease.entry_problem is not None and lease.entry_problem.startswith("Lease ")
        return
    assert lease.entry_problem is None
    assert lease.instance is None or (
        0 < len(lease.instance) <= 64 and lease.instance.isprintable()
    )


@hypothesis.given(
    st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["metadata", "spec"]), JSON_VALUES))
)
@hypothesis.settings(max_examples=200, deadline=None)
def test_a_lease_of_any_shape_is_read_without_raising(body: Any) -> None:
    """What kopf hands the handler is the API server's, well typed; still, the reader
    assumes nothing of it."""
    if isinstance(body, dict):
        assert leases.NodeLease.from_body(body) is None


@pytest.mark.parametrize("poison", POISONS, ids=[poison.name for poison in POISONS])
def test_each_poison_is_a_named_problem_and_no_request(poison: Poison) -> None:
    lease = leases.NodeLease.from_body(lease_body("pod-a", poison.annotations("10.0.0.7")))
    assert lease is not None and lease.entry is None
    assert lease.entry_problem is not None and poison.problem in lease.entry_problem
    assert len(lease.entry_problem) < 400, "a problem quotes what it refuses, cut"


def test_a_holder_that_is_not_a_pods_name_speaks_for_nobody() -> None:
    """Its name goes into API paths (the pod is labelled and read): with '/' or '..' in
    it, a long one whose Lease name is shortened with a hash could name another object."""
    traversal = "a/../../../namespaces/other/pods/" + "x" * 200
    for holder in (traversal, "Pod-A", "pod_a", "a" * 254):
        body = lease_body(holder, {objects.ENTRY_ANNOTATION: json.dumps(WELL_FORMED)})
        assert leases.NodeLease.from_body(body) is None, holder


class Posted:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, targets: Any, *, warning: bool, reason: str, message: str) -> None:
        self.events.extend((target["metadata"]["name"], reason, message) for target in targets)


class StatusWrites:
    """The API door of a reconciler to which no request counts: it writes statuses only."""

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        written = rendezvous(name)
        written["metadata"]["resourceVersion"] = str(int(resource_version) + 1)
        return written | {"status": fields}

    def get_owner(self, namespace: str, reference: object) -> None:
        raise AssertionError("no pod to climb from")


def rendezvous(name: str) -> dict[str, Any]:
    return {
        "apiVersion": objects.API_VERSION,
        "kind": objects.KIND,
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "minNodes": 1,
            "maxNodes": 1,
            "runId": name,
            "podSelector": {"matchLabels": {"a": "b"}},
        },
    }


def test_a_poisoned_lease_listed_at_start_is_its_own_refusal_and_the_others_are_read() -> None:
    """Issue 55: one Lease nested thousands deep stopped the start (RecursionError), so
    no Rendezvous anywhere got a status. Each is now read on its own, and said once, on
    its Rendezvous, as soon as that is known (two rendezvous: a budget is 10 a minute)."""
    asyncio.run(_a_poisoned_lease_listed_at_start())


async def _a_poisoned_lease_listed_at_start() -> None:
    posted = Posted()
    operator = reconciler.Reconciler(
        StatusWrites(),  # type: ignore[arg-type]
        posted,
        clock=lambda: datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
    )
    good = leases.NodeEntry("i-1", 1, "10.0.0.8", 29500)
    poisoned = {poison.name: f"poisoned-{index % 2}" for index, poison in enumerate(POISONS)}
    bodies = [
        lease_body(f"pod-{poison.name}", poison.annotations("10.0.0.7"), poisoned[poison.name])
        for poison in POISONS
    ]
    bodies.insert(
        3, lease_body("honest", {objects.ENTRY_ANNOTATION: good.to_annotation()}, "other")
    )
    bodies.append({"metadata": "not an object"})  # not a node's Lease: passed over
    operator.leases_listed(bodies)
    assert operator.remembers(("ns", "other"))
    assert not operator.remembers(("ns", "poisoned-0")), "no request read, nothing kept"
    operator.started()
    for name in sorted(set(poisoned.values())):
        await operator.rendezvous_seen(("ns", name), rendezvous(name), deleted=False)
    await operator.idle()
    said = {
        message.split()[1]: (name, message)
        for name, reason, message in posted.events
        if reason == reasons.INVALID_ENTRY
    }
    assert len(said) == len(POISONS)
    for poison in POISONS:
        name, message = said[f"pod-{poison.name}"]
        assert name == poisoned[poison.name] and poison.problem in message, message


@hypothesis.given(st.dictionaries(st.text(max_size=20), JSON_VALUES, max_size=6) | JSON_VALUES)
@hypothesis.settings(max_examples=200, deadline=None)
def test_a_pod_made_rendezvous_spec_of_any_shape_is_read_or_named(spec: Any) -> None:
    """The creator role lets a pod write a whole spec (the CRD bounds it first)."""
    try:
        specs.RendezvousSpec.from_dict(spec)
    except codec.DecodeError as error:
        assert str(error).startswith("spec")


@pytest.mark.parametrize("creator", ["a/../../x", "", "Pod", "a" * 254, 7, ["pod-a"]])
def test_a_creator_annotation_that_is_not_a_pods_name_names_no_creator(creator: object) -> None:
    body = rendezvous("train")
    body["metadata"]["annotations"] = {objects.CREATED_BY_ANNOTATION: creator}
    spec = specs.RendezvousSpec.from_dict(body["spec"] | {"podSelector": None})
    assert names.holding(body).creator is None
    assert membership.creator_to_adopt(body, spec) is None


@hypothesis.given(
    st.one_of(
        st.binary(max_size=64),
        NESTED.map(str.encode),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    )
)
@hypothesis.settings(max_examples=200, deadline=None)
def test_any_webhook_body_is_a_review_or_a_bad_request(body: bytes) -> None:
    with contextlib.suppress(ValueError):  # answered 400
        webhook.decode_review(body)


def test_a_webhook_body_nested_deeper_than_a_pod_is_a_bad_request() -> None:
    with pytest.raises(ValueError, match=f"nested more than {webhook.MAX_REVIEW_DEPTH} deep"):
        webhook.decode_review(b"[" * 100_000)
    with pytest.raises(ValueError, match="nested more than"):
        webhook.decode_review(b'{"request":' * (webhook.MAX_REVIEW_DEPTH + 1) + b"0" + b"}" * 65)
