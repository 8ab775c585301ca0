"""Which Leases of gone pods are collected (:mod:`k8s_rendezvous_operator.lease_sweep`).

Aspects: what marks a Lease for a check (its pod deleted or not found, or seen with
another uid than the one that wrote it; never a pod that failed or finished, nor one never
seen); which marked Leases a pass checks (never a node the round still needs, at most a
bounded few, in a stable order); the check itself, on the Pod read after the Lease; and
what a Lease as read holds for the delete's preconditions.
"""

from __future__ import annotations

import pytest

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import lease_sweep, membership, reasons, rounds

LEASE = lease_sweep.LeaseRead("r", "r.p1", "lease-uid", "7", "uid-a")


def seen(uid: str, gone_reason: str | None = None) -> rounds.PodObservation:
    identity = membership.PodIdentity(uid, None, (), frozenset({"10.0.0.1"}))
    return rounds.PodObservation(gone_reason, identity=identity)


def pod(uid: str) -> dict[str, object]:
    return {"metadata": {"name": "p1", "uid": uid}}


@pytest.mark.parametrize(
    ("name", "observation", "marked"),
    [
        ("deleted", seen("uid-a", reasons.LOST_POD_DELETED), True),
        ("not found", rounds.PodObservation(reasons.LOST_POD_NOT_FOUND), True),
        ("another pod of the name", seen("uid-b"), True),
        ("its pod running", seen("uid-a"), False),
        ("its pod failed: still there", seen("uid-a", reasons.LOST_POD_FAILED), False),
        ("its pod finished: still there", seen("uid-a", reasons.LOST_POD_SUCCEEDED), False),
        ("its pod terminating: not gone yet", seen("uid-a", reasons.LOST_POD_TERMINATING), False),
        ("its pod never seen", None, False),
    ],
)
def test_a_lease_is_marked_for_a_check_only_when_its_pod_seems_gone(
    name: str, observation: rounds.PodObservation | None, marked: bool
) -> None:
    assert lease_sweep.suspected(observation, LEASE) is marked, name


def test_a_lease_that_names_no_writer_is_marked_only_when_no_pod_has_its_name() -> None:
    unmarked = lease_sweep.LeaseRead("r", "r.p1", "lease-uid", "7", None)
    assert not lease_sweep.suspected(seen("uid-b"), unmarked)
    assert lease_sweep.suspected(seen("uid-b", reasons.LOST_POD_DELETED), unmarked)
    assert not lease_sweep.suspected(seen("uid-a", reasons.LOST_POD_DELETED), None)


def test_a_pass_checks_no_node_the_round_needs_and_a_bounded_few_in_name_order() -> None:
    marked = {f"p{n:03}" for n in range(100)}
    needed = frozenset({"p000", "p001"})
    picked = lease_sweep.to_check(marked, needed)
    assert len(picked) == lease_sweep.MAX_CHECKS_PER_PASS < len(marked)
    assert picked == sorted(picked) and picked[0] == "p002"
    assert not needed & set(picked)
    assert lease_sweep.to_check({"p1"}, frozenset({"p1"})) == []


@pytest.mark.parametrize(
    ("name", "found", "is_stale"),
    [
        ("no pod of its name", None, True),
        ("another pod of its name", pod("uid-b"), True),
        ("the pod that wrote it", pod("uid-a"), False),
    ],
)
def test_a_lease_is_stale_when_the_pod_read_after_it_is_not_its_writer(
    name: str, found: dict[str, object] | None, is_stale: bool
) -> None:
    assert lease_sweep.stale(LEASE, found) is is_stale, name


def test_a_lease_that_names_no_writer_is_stale_only_when_no_pod_has_its_name() -> None:
    unmarked = lease_sweep.LeaseRead("r", "r.p1", "lease-uid", "7", None)
    assert lease_sweep.stale(unmarked, None)
    assert not lease_sweep.stale(unmarked, pod("uid-b"))


def test_a_lease_read_holds_what_its_deletes_preconditions_need() -> None:
    body = {
        "metadata": {
            "name": "r.p1",
            "uid": "lease-uid",
            "resourceVersion": "7",
            "annotations": {objects.POD_UID_ANNOTATION: "uid-a"},
        }
    }
    assert lease_sweep.LeaseRead.from_body("r", body) == LEASE
    assert lease_sweep.LeaseRead.from_body("r", {"metadata": {"name": "r.p1"}}) is None
