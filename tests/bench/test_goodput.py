"""bench/goodput.py's schedule (fault_schedule.py) and its reading of the workers' lines
(goodput_measures.py), both pure: goodput, each fault's time without training, stall, time
to the full world, steps lost and rank churn, and the worlds' invariants. The run on real
nodes is the benchmark itself (bench/results/goodput)."""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from bench import fault_schedule, faults, goodput_report
from bench import goodput_measures as measures
from k8s_rendezvous.wire import codec, records

STEP = measures.STEP_SECONDS


def world(
    master: str, pods: Sequence[str], began: float, ended: float, round_: int | None = None
) -> list[dict[str, Any]]:
    """The lines of a world whose rank r is ``pods[r]``, one step every STEP from
    ``began`` until before ``ended``."""
    lines = []
    step = 0
    while began + step * STEP < ended:
        for rank, pod in enumerate(pods):
            lines.append(
                {
                    "pod": pod,
                    "rank": rank,
                    "world_size": len(pods),
                    "master": master,
                    "step": step,
                    "time": began + step * STEP,
                    **({"round": round_} if round_ is not None else {}),
                }
            )
        step += 1
    return lines


def assert_dealt_deck_by_deck(faults: Sequence[fault_schedule.Fault], kinds: Sequence[str]) -> None:
    """Each whole deck dealt holds every card of ``kinds`` once."""
    for start in range(0, len(faults) - len(kinds) + 1, len(kinds)):
        assert sorted(f.kind for f in faults[start : start + len(kinds)]) == sorted(kinds)


def test_the_schedule_is_seeded_spaced_and_deals_every_kind_in_turn() -> None:
    kinds = list(fault_schedule.FAULTS)
    faults = fault_schedule.schedule(7, 20 * 60, kinds)
    assert faults == fault_schedule.schedule(7, 20 * 60, kinds)
    assert faults != fault_schedule.schedule(8, 20 * 60, kinds)
    low, high = fault_schedule.GAP_SECONDS
    assert low <= faults[0].at <= high
    for earlier, later in itertools.pairwise(faults):
        assert low - 0.1 <= later.at - earlier.at <= high + 0.1
    assert faults[-1].at < 20 * 60
    assert_dealt_deck_by_deck(faults, kinds)


def test_a_soaks_schedule_brings_some_faults_two_at_once_from_the_same_deck() -> None:
    kinds = list(fault_schedule.FAULTS)
    single = fault_schedule.schedule(7, 60 * 60, kinds, (10.0, 15.0))
    faults = fault_schedule.schedule(7, 60 * 60, kinds, (10.0, 15.0), doubles=0.25)
    assert faults == fault_schedule.schedule(7, 60 * 60, kinds, (10.0, 15.0), doubles=0.25)
    moments = [fault.at for fault in faults]
    pairs = len(moments) - len(set(moments))
    assert 0.15 * len(set(moments)) < pairs < 0.35 * len(set(moments)), (pairs, len(moments))
    assert max(moments.count(at) for at in moments) == 2
    assert len({f.at for f in single}) == len(single), "none by default"
    assert_dealt_deck_by_deck(faults, kinds)


def test_a_weighted_deck_deals_its_kinds_as_often_as_weighed_and_keeps_every_kind() -> None:
    kinds = fault_schedule.deck("pod=3, worker=2")
    assert sorted(kinds) == sorted([*fault_schedule.FAULTS, "pod", "pod", "worker"])
    assert fault_schedule.deck() == list(fault_schedule.FAULTS)
    faults = fault_schedule.schedule(7, 60 * 60, kinds, (10.0, 15.0))
    assert_dealt_deck_by_deck(faults, kinds)


@pytest.mark.parametrize(
    ("weights", "named"), [("pods=3", "no fault kind 'pods'"), ("leader=0", "leader='0'")]
)
def test_a_deck_that_names_no_kind_or_drops_one_is_refused_by_name(
    weights: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        fault_schedule.deck(weights)


def test_an_undisturbed_run_has_a_goodput_of_one() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 100.0, 400.0)
    result = measures.analyze(lines, [], 100.0, 400.0)
    assert result["goodput"] == pytest.approx(1.0, abs=0.002)
    assert result["pace"] == pytest.approx(1 / STEP, rel=1e-3)
    assert result["violations"] == []


def test_a_replacement_at_the_lost_rank_churns_one_rank_and_costs_its_pause() -> None:
    pods = ["p0", "p1", "p2", "p3"]
    lines = world("a:1", pods, 0.0, 100.0) + world("a:2", ["p0", "new", "p2", "p3"], 110.0, 200.0)
    fault = {"kind": "pod", "at": 100.0}
    result = measures.analyze(lines, [fault], 0.0, 200.0)
    (effect,) = result["faults"]
    assert effect["stall"] == pytest.approx(10.0)
    assert effect["full_world"] == pytest.approx(10.0)
    assert effect["rank_churn"] == 1
    assert effect["steps_lost"] == pytest.approx(10.0 / STEP, abs=2)
    assert result["goodput"] == pytest.approx(190 / 200, abs=0.005)


def test_survivors_compacted_with_the_newcomer_appended_churn_every_moved_rank() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "p2", "p3"], 101.0, 130.0)
    lines += world("a:3", ["p0", "p2", "p3", "new"], 131.0, 200.0)
    (effect,) = measures.analyze(lines, [{"kind": "pod", "at": 100.0}], 0.0, 200.0)["faults"]
    assert effect["full_world"] == pytest.approx(31.0)
    assert effect["rank_churn"] == 3  # ranks 1 and 2 moved, rank 3 is the newcomer
    # The world of 3 trained three quarters of a full world's samples per step.
    assert effect["steps_lost"] == pytest.approx((1 + 1 + 29 * 0.25) / STEP, abs=2)


def test_a_fault_that_never_paused_training_has_no_stall() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 200.0)
    (effect,) = measures.analyze(lines, [{"kind": "leader", "at": 100.0}], 0.0, 200.0)["faults"]
    assert (effect["stall"], effect["full_world"], effect["rank_churn"]) == (0.0, 0.25, 0)


def test_a_full_world_that_never_came_back_is_counted_unresolved() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "p1", "p2"], 105.0, 200.0)
    result = measures.analyze(lines, [{"kind": "node", "at": 100.0}], 0.0, 200.0)
    assert result["faults"][0]["full_world"] is None
    assert result["by_kind"]["node"]["unresolved"] == 1


def test_a_node_lost_with_the_operators_leader_has_a_row_of_its_own() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "p2", "p3"], 103.0, 150.0)
    lines += world("a:3", ["p0", "p3"], 163.0, 200.0)
    faults = [
        {"kind": "node", "at": 100.0, "node": "n1", "leader_node": "n0"},
        {"kind": "node", "at": 150.0, "node": "n1", "leader_node": "n1"},
    ]
    by_kind = measures.analyze(lines, faults, 0.0, 200.0)["by_kind"]
    assert by_kind["node"]["idle"]["median"] == pytest.approx(3.0, abs=STEP)
    assert by_kind["node, with the operator's leader"]["idle"]["median"] == pytest.approx(
        13.0, abs=STEP
    )


def test_the_leader_is_the_lease_holder_until_its_hold_expires() -> None:
    renewed = datetime.datetime(2026, 12, 6, 17, 0, tzinfo=datetime.timezone.utc)
    lease = {
        "spec": {
            "holderIdentity": "operator-7d9f-abcde_1f2e3d",
            "leaseDurationSeconds": 10,
            "renewTime": codec.format_time(renewed),
        }
    }
    at = renewed.timestamp()
    assert faults.leading_pod(lease, at + 2.0) == "operator-7d9f-abcde"
    assert faults.leading_pod(lease, at + 10.5) is None, "killed, not yet replaced"
    assert faults.leading_pod({"spec": {"holderIdentity": None}}, at) is None, "released"


def test_a_stall_that_outlasts_the_next_fault_is_no_resumption() -> None:
    # The old world takes two more steps after the fault, then nothing until the next one.
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0 + 2 * STEP)
    lines += world("a:2", ["p0", "p1", "p2", "p3"], 250.0, 300.0)
    faults = [{"kind": "node", "at": 99.9}, {"kind": "pod", "at": 200.0}]
    lost, _ = measures.analyze(lines, faults, 0.0, 300.0)["faults"]
    assert (lost["stall"], lost["full_world"], lost["rank_churn"]) == (None, None, None)
    assert lost["steps_lost"] == pytest.approx(100.0 / STEP, abs=2)


def test_the_full_world_is_timed_to_its_first_step_after_the_pause() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0 + 2 * STEP)
    lines += world("a:2", ["p0", "p1", "p2", "p3"], 120.0, 200.0)
    (effect,) = measures.analyze(lines, [{"kind": "worker", "at": 99.9}], 0.0, 200.0)["faults"]
    assert effect["stall"] == pytest.approx(20.1)
    assert effect["full_world"] == pytest.approx(20.1)


def test_time_without_training_counts_the_pauses_not_a_smaller_worlds_steps() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "p2", "p3"], 106.0, 130.0)  # restarted without the lost pod
    lines += world("a:3", ["p0", "new", "p2", "p3"], 138.0, 200.0)  # and with its replacement
    (effect,) = measures.analyze(lines, [{"kind": "pod", "at": 100.0}], 0.0, 200.0)["faults"]
    assert effect["idle"] == pytest.approx(6.0 + (138.0 - (130.0 - STEP)), abs=0.01)
    assert effect["stall"] == effect["full_world"] == pytest.approx(38.0)


def test_the_report_adds_time_without_training_to_a_result_recorded_without_it() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "p2", "p3"], 106.0, 130.0)
    lines += world("a:3", ["p0", "new", "p2", "p3"], 138.0, 150.0)
    lines += world("a:4", ["p0", "new", "p2", "p3"], 170.0, 200.0)
    faults = [{"kind": "pod", "at": 100.0}, {"kind": "worker", "at": 150.0}]
    analyzed = measures.analyze(lines, faults, 0.0, 200.0)
    steps = measures.rank_zero_steps(lines)
    recorded = {
        "config": "ours",
        "began": 0.0,
        "ended": 200.0,
        "faults": [{k: v for k, v in f.items() if k != "idle"} for f in analyzed["faults"]],
        "timeline": [[line["time"], line["world_size"]] for line in steps],
    }
    completed = measures.completed(recorded)
    assert [f["idle"] for f in completed["faults"]] == [f["idle"] for f in analyzed["faults"]]
    assert completed["by_kind"] == analyzed["by_kind"]
    assert measures.completed(completed) is completed, "a complete result is left as it is"


def test_two_worlds_at_once_and_a_rank_held_twice_are_violations() -> None:
    lines = world("a:1", ["p0", "p1"], 0.0, 50.0) + world("b:1", ["p2", "p3"], 20.0, 60.0)
    assert any("trained at once" in v for v in measures.world_violations(lines))
    twice = world("a:1", ["p0", "p1"], 0.0, 10.0) + world("a:1", ["p0", "p9"], 10.0, 20.0)
    assert any("rank 1 held by" in v for v in measures.world_violations(twice))
    beyond = world("a:1", ["p0", "p1"], 0.0, 10.0)
    beyond.append({**beyond[-1], "pod": "p2", "rank": 2})
    assert any("ranks [2] outside 0..1" in v for v in measures.world_violations(beyond))


def test_a_rank_may_miss_only_the_last_step_of_its_world() -> None:
    """A rank killed in an all-reduce can have sent its part first: its peers log the step
    and it does not. Nobody takes a step after that one without it."""
    lines = world("a:1", ["p0", "p1", "p2"], 0.0, 10.0, round_=1)
    last = max(line["step"] for line in lines)
    cut_short = [line for line in lines if line["rank"] != 1 or line["step"] < last]
    assert measures.world_violations(cut_short) == []
    only_step = [line for line in lines if line["step"] == 0 and line["rank"] != 1]
    assert measures.world_violations(only_step) == [], "a world that lived one step"
    gap = [line for line in lines if line["rank"] != 1 or line["step"] != 3]
    assert measures.world_violations(gap) == [
        "world ('a:1', 3, 1): step 3 logged by ranks [0, 2] only, though a later step was taken"
    ]


def test_worlds_re_formed_in_place_are_told_apart_by_their_round() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0, round_=1)
    lines += world("a:1", ["p0", "new", "p2", "p3"], 100.5, 200.0, round_=2)
    result = measures.analyze(lines, [{"kind": "pod", "at": 100.0}], 0.0, 200.0)
    assert result["violations"] == []
    (effect,) = result["faults"]
    assert (effect["stall"], effect["rank_churn"]) == (0.0, 1)
    assert [(w["world"][2], w["ranks"][1], w["steps"]) for w in result["worlds"]] == [
        (1, "p1", 400),
        (2, "new", 398),
    ]


def test_the_seal_is_timed_from_the_fault_to_the_next_round_sealed() -> None:
    rounds = [(10.0, "Sealed", 1), (100.2, "Reforming", 1), (100.4, "Joining", 2)]
    rounds += [(100.9, "Sealed", 2)]
    assert measures.sealed_after(rounds, 100.0, 200.0) == pytest.approx(0.9)
    assert measures.sealed_after(rounds, 100.0, 100.5) is None  # the next fault came first
    assert measures.sealed_after(rounds, 150.0, 200.0) is None


def test_the_report_has_a_row_per_fault_kind_and_configuration() -> None:
    lines = world("a:1", ["p0", "p1", "p2", "p3"], 0.0, 100.0)
    lines += world("a:2", ["p0", "new", "p2", "p3"], 110.0, 200.0)
    rounds = [(0.0, "Sealed", 1), (100.5, "Sealed", 2)]
    result = measures.analyze(lines, [{"kind": "pod", "at": 100.0}], 0.0, 200.0, rounds)
    report = goodput_report.table(
        [{"config": "ours", **result}, {"config": "c10d", "error": "boom"}]
    )
    assert "| ours | 95.0% | 760 | 4.0 | 1 | - | 0 | 0 |" in report
    assert "| c10d | error: boom |" in report
    row = "| pod | ours | 1 | 0.5 / 0.5 | 10.0 / 10.0 | 10.0 / 10.0 | 10.0 / 10.0 | 40.0 | 1 |"
    assert row in report


def pod(ip: str, restarts: int = 0, **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": metadata,
        "status": {
            "phase": "Running",
            "podIP": ip,
            "containerStatuses": [{"restartCount": restarts}],
        },
    }


def test_a_member_is_gone_with_its_pod_its_incarnation_or_its_agent() -> None:
    """A StatefulSet's pod made anew keeps its name but not its IP, and a container it
    restarts keeps both: the member that joined from either is gone all the same."""
    member = records.Member("train-1", "instance", 0, "10.0.0.7", pod_restarts=1)
    assert not measures.member_gone(member, pod("10.0.0.7", restarts=1))
    assert measures.member_gone(member, None)
    assert measures.member_gone(member, pod("10.0.0.9", restarts=0)), "made anew"
    assert measures.member_gone(member, pod("10.0.0.7", restarts=2)), "its agent restarted"
    terminating = pod("10.0.0.7", restarts=1, deletionTimestamp="2026-12-06T09:00:00Z")
    assert measures.member_gone(member, terminating)


def test_a_dead_member_is_a_violation_only_beyond_the_grace_with_a_leader_acting() -> None:
    outages = measures.operator_outages(
        [
            {"kind": "leader", "at": 100.0},
            {"kind": "apiserver", "at": 200.0, "restored": 230.0},
            {"kind": "pod", "at": 300.0},
            {"kind": "node", "at": 400.0, "node": "n1", "leader_node": "n1"},
            {"kind": "node", "at": 500.0, "node": "n1", "leader_node": "n0"},
            {"kind": "node", "at": 600.0, "node": "n1", "leader_node": None},
        ]
    )
    assert outages == [(100.0, 115.0), (200.0, 245.0), (400.0, 415.0)]
    dead = {
        (1, "quick"): (300.0, 304.0),  # within the grace
        (2, "slow"): (300.0, 306.0),  # beyond it, a leader acting throughout
        (3, "taken-over"): (98.0, 116.0),  # 3 s of it with a leader acting
        (4, "outlasted"): (110.0, 125.0),  # 10 s after the takeover
        (5, "api-server-down"): (199.0, 246.0),
    }
    found = measures.dead_member_violations(dead, outages)
    assert [v.split(":")[0] for v in found] == ["round 2", "round 4"], found
    assert "dead for 15.0 s (10.0 s with an operator leader acting)" in found[1]


def test_overlapping_spans_are_merged_before_they_are_counted() -> None:
    assert measures.merged([(5, 9), (0, 2), (1, 3), (9, 10)]) == [(0, 3), (5, 10)]
    assert (
        measures.dead_member_violations({(1, "p"): (0.0, 20.0)}, [(0.0, 10.0), (5.0, 15.0)]) == []
    )
