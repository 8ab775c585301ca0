"""Which RendezvousSlices a decided status rewrites (``k8s_rendezvous_operator.slices``).

Aspects: only the slices of pods that asked to join or that the status names are written
(a maxNodes of 100000 with nobody joining writes none), and one written stays in step;
nothing is rewritten when nothing a slice carries changed; a forming round's bookkeeping
(its first join, its last call, conditions) changes no slice; a sealed round rewrites every
slice written (its key is in each); a node left behind rewrites only the slice it hashes to.
"""

from __future__ import annotations

import dataclasses
import datetime

from k8s_rendezvous.wire import objects, records, specs, statuses
from k8s_rendezvous_operator import slices

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
SPEC = specs.RendezvousSpec(2, 3 * objects.SLICE_MEMBERS, "run")
FORMING = statuses.RendezvousStatus(slices=objects.slice_count(SPEC.max_nodes))


NODES = tuple(f"worker-{i}" for i in range(40))
"""Pods that hash to every one of the 3 slices."""


def written(
    status: statuses.RendezvousStatus, requesters: tuple[str, ...] = NODES
) -> dict[int, dict[str, object]]:
    return slices.changed(SPEC, status, slices.needed(status, requesters, ()), {})


def rewritten(
    status: statuses.RendezvousStatus, before: dict[int, dict[str, object]]
) -> dict[int, dict[str, object]]:
    return slices.changed(SPEC, status, slices.needed(status, NODES, before), before)


def sealed(*nodes: str) -> statuses.RendezvousStatus:
    return dataclasses.replace(
        FORMING,
        state=statuses.RoundState.SEALED,
        round=1,
        members=tuple(records.Member(node, f"i-{node}", 1, "10.0.0.1") for node in nodes),
        master=records.Master("10.0.0.1", 29500),
        sealed_at=T0,
    )


def test_no_slice_is_written_before_a_pod_asks_to_join_however_large_max_nodes() -> None:
    large = specs.RendezvousSpec(1, 100_000, "run")
    status = statuses.RendezvousStatus(slices=objects.slice_count(large.max_nodes))
    assert status.slices == objects.MAX_SLICES
    assert slices.needed(status, (), ()) == frozenset()
    assert slices.changed(large, status, slices.needed(status, (), ()), {}) == {}


def test_a_slice_is_written_for_each_pod_that_asks_and_each_the_status_names() -> None:
    asking, member, left, refused = "worker-1", "worker-2", "worker-3", "worker-4"
    status = dataclasses.replace(
        sealed(member),
        left_behind=(records.Member(left, "i", 1, "10.0.0.3"),),
        refused=(records.Refusal(refused, "i", 1, "OtherWorkload", "why"),),
    )
    expected = {objects.slice_index(node, 3) for node in (asking, member, left, refused)}
    assert slices.needed(status, [asking], ()) == expected
    assert set(written(status, (asking,))) == expected


def test_a_slice_once_written_stays_in_step_after_its_pods_are_gone() -> None:
    before = written(FORMING, ("worker-1",))
    assert slices.needed(sealed("worker-2"), (), before) >= set(before)


def test_every_slice_is_written_the_first_time() -> None:
    assert sorted(written(FORMING)) == [0, 1, 2]


def test_nothing_is_rewritten_when_nothing_a_slice_carries_changed() -> None:
    assert rewritten(FORMING, written(FORMING)) == {}


def test_a_forming_rounds_bookkeeping_changes_no_slice() -> None:
    bookkeeping = dataclasses.replace(
        FORMING,
        forming_since=T0,
        last_call_deadline=T0 + datetime.timedelta(seconds=30),
        observed_generation=4,
    )
    every = frozenset(range(3))
    assert slices.publication(SPEC, bookkeeping, every) == slices.publication(SPEC, FORMING, every)
    assert rewritten(bookkeeping, written(FORMING)) == {}


def test_a_sealed_round_rewrites_every_slice() -> None:
    before = written(FORMING)
    after = sealed("a", "b")
    assert sorted(rewritten(after, before)) == [0, 1, 2]
    every = frozenset(range(3))
    assert slices.publication(SPEC, after, every) != slices.publication(SPEC, FORMING, every)


def test_a_member_leaving_a_slice_rewrites_only_that_slice_and_the_round_fields() -> None:
    one = sealed("a", "b")
    two = dataclasses.replace(one, left_behind=(records.Member("c", "i-c", 1, "10.0.0.3"),))
    changed = rewritten(two, written(one))
    assert list(changed) == [objects.slice_index("c", one.slices)]
    assert changed[objects.slice_index("c", one.slices)]["status"]["leftBehind"][0]["node"] == "c"
