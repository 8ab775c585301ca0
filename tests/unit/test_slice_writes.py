"""Which RendezvousSlices a decided status rewrites (``k8s_rendezvous_operator.slices``).

Aspects: every slice is written the first time; nothing is rewritten when nothing a slice
carries changed; a forming round's bookkeeping (its first join, its last call, conditions)
changes no slice; a sealed round rewrites every slice (its key is in each); a node left
behind rewrites only the slice it hashes to.
"""

from __future__ import annotations

import dataclasses
import datetime

from k8s_rendezvous import state
from k8s_rendezvous_operator import slices

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
SPEC = state.RendezvousSpec(2, 3 * state.SLICE_MEMBERS, "run")
FORMING = state.RendezvousStatus(slices=state.slice_count(SPEC.max_nodes))


def written(status: state.RendezvousStatus) -> dict[int, dict[str, object]]:
    return slices.changed(SPEC, status, {})


def sealed(*nodes: str) -> state.RendezvousStatus:
    return dataclasses.replace(
        FORMING,
        state=state.RoundState.SEALED,
        round=1,
        members=tuple(state.Member(node, f"i-{node}", 1, "10.0.0.1") for node in nodes),
        master=state.Master("10.0.0.1", 29500),
        sealed_at=T0,
    )


def test_every_slice_is_written_the_first_time() -> None:
    assert sorted(written(FORMING)) == [0, 1, 2]


def test_nothing_is_rewritten_when_nothing_a_slice_carries_changed() -> None:
    assert slices.changed(SPEC, FORMING, written(FORMING)) == {}


def test_a_forming_rounds_bookkeeping_changes_no_slice() -> None:
    bookkeeping = dataclasses.replace(
        FORMING,
        forming_since=T0,
        last_call_deadline=T0 + datetime.timedelta(seconds=30),
        observed_generation=4,
    )
    assert slices.publication(SPEC, bookkeeping) == slices.publication(SPEC, FORMING)
    assert slices.changed(SPEC, bookkeeping, written(FORMING)) == {}


def test_a_sealed_round_rewrites_every_slice() -> None:
    before = written(FORMING)
    after = sealed("a", "b")
    assert sorted(slices.changed(SPEC, after, before)) == [0, 1, 2]
    assert slices.publication(SPEC, after) != slices.publication(SPEC, FORMING)


def test_a_member_leaving_a_slice_rewrites_only_that_slice_and_the_round_fields() -> None:
    one = sealed("a", "b")
    two = dataclasses.replace(one, left_behind=(state.Member("c", "i-c", 1, "10.0.0.3"),))
    changed = slices.changed(SPEC, two, written(one))
    assert list(changed) == [state.slice_index("c", one.slices)]
    assert changed[state.slice_index("c", one.slices)]["status"]["leftBehind"][0]["node"] == "c"
