"""The invariant checker itself (devkit/invariants.py): each invariant, broken on
purpose, is reported; a correct history passes."""

from __future__ import annotations

import dataclasses

import pytest

from devkit import invariants
from k8s_rendezvous.wire import records, specs, statuses

SPEC = specs.RendezvousSpec(1, 3, "r")


def sealed(round_: int, *nodes: str, port: int = 1) -> statuses.RendezvousStatus:
    members = tuple(records.Member(n, f"i-{n}", 1, f"a-{n}") for n in nodes)
    return statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=round_,
        members=members,
        master=records.Master(f"a-{nodes[0]}", port),
    )


def outcome(
    node: str, round_: int, rank: int, world: int, port: int = 1, master: str = ""
) -> invariants.Outcome:
    return invariants.Outcome(node, round_, rank, world, (master or "a-a", port))


def test_a_correct_history_passes() -> None:
    history = [(1, statuses.RendezvousStatus()), (2, sealed(1, "a", "b")), (3, sealed(1, "a", "b"))]
    invariants.check(
        SPEC,
        history,
        [
            outcome("a", 1, 0, 2),
            outcome("b", 1, 1, 2),
            invariants.Outcome("c", error="RendezvousTimeoutError"),
        ],
    )


@pytest.mark.parametrize(
    ("history", "outcomes", "message"),
    [
        ([(1, sealed(2, "a")), (2, sealed(1, "a"))], [], "round went back"),
        ([(1, sealed(1, "a", "a"))], [], "holds two ranks"),
        ([(1, sealed(1, "a", "b", "c", "d"))], [], "outside"),
        ([(1, sealed(1, "a", "b")), (2, sealed(1, "a", "c"))], [], "sealed round 1 changed"),
        (
            [(1, sealed(1, "a", "b")), (2, sealed(1, "a", "b", port=2))],
            [],
            "sealed round 1 changed",
        ),
        (
            [(1, sealed(1, "a", "b"))],
            [outcome("a", 1, 0, 2), outcome("b", 1, 0, 2)],
            "both got rank 0",
        ),
        ([(1, sealed(1, "a", "b"))], [outcome("b", 1, 0, 2)], "the resource says"),
        ([(1, sealed(1, "a", "b"))], [outcome("a", 1, 0, 2, port=9)], "got master"),
        ([(1, sealed(1, "a"))], [outcome("a", 2, 0, 1)], "never seen sealed"),
        ([], [invariants.Outcome("a")], "neither a round nor an error"),
    ],
)
def test_each_broken_invariant_is_named(
    history: list[tuple[int, statuses.RendezvousStatus]],
    outcomes: list[invariants.Outcome],
    message: str,
) -> None:
    with pytest.raises(invariants.Violation, match=message):
        invariants.check(SPEC, history, outcomes)


def test_reforming_round_may_show_old_members() -> None:
    stale = dataclasses.replace(sealed(1, "a", "b"), state=statuses.RoundState.REFORMING)
    invariants.check(SPEC, [(1, sealed(1, "a", "b")), (2, stale), (3, sealed(2, "a"))])
