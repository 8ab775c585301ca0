"""A node's Lease as a wire type (``k8s_rendezvous.wire.leases.NodeLease``): what the pod side
writes reads back the same; only the Lease named after its holder speaks for that node,
and an entry that cannot be read is reported, never guessed at."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from k8s_rendezvous.wire import leases, objects

ENTRY = leases.NodeEntry("i-1", 2, "10.0.0.7", 29500)


def lease(name: str = "train.pod-a", holder: str = "pod-a", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {objects.NODE_LABEL: "train"},
            "annotations": {objects.INSTANCE_ANNOTATION: "i-1", **annotations},
        },
        "spec": {"holderIdentity": holder},
    }


def test_a_lease_written_whole_reads_back_the_same() -> None:
    written = leases.NodeLease(
        "train",
        "pod-a",
        "i-1",
        ENTRY,
        pod_uid="uid-a",
        owner_uid="uid-r",
        duration_seconds=30,
        renew_time=datetime.datetime(2026, 12, 4, 3, 0, 0, 123456, datetime.timezone.utc),
    )
    body = written.to_body()
    assert body["metadata"]["name"] == "train.pod-a"
    assert body["metadata"]["ownerReferences"] == [
        objects.owner_reference(
            objects.API_VERSION, objects.KIND, "train", "uid-r", controller=False
        )
    ]
    assert leases.NodeLease.from_body(body) == written


def test_a_renewal_leaves_the_request_and_the_owner_unless_given() -> None:
    renewal = leases.NodeLease("train", "pod-a", "i-1", owner_uid="uid-r", duration_seconds=30)
    patch = renewal.to_patch(owner=False)
    assert patch == {
        "metadata": {"annotations": {objects.INSTANCE_ANNOTATION: "i-1"}},
        "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 30},
    }
    asked = dataclasses.replace(renewal, entry=ENTRY).to_patch(owner=True)
    assert asked["metadata"]["annotations"][objects.ENTRY_ANNOTATION] == ENTRY.to_annotation()
    assert [owner["uid"] for owner in asked["metadata"]["ownerReferences"]] == ["uid-r"]


def test_a_lease_gives_the_node_its_instance_and_its_request() -> None:
    seen = leases.NodeLease.from_body(lease(**{objects.ENTRY_ANNOTATION: ENTRY.to_annotation()}))
    assert seen == leases.NodeLease("train", "pod-a", "i-1", ENTRY)


def test_a_heartbeat_before_any_request_has_no_entry() -> None:
    seen = leases.NodeLease.from_body(lease())
    assert seen is not None and seen.entry is None and seen.entry_problem is None


def test_a_lease_not_named_after_its_holder_speaks_for_nobody() -> None:
    assert leases.NodeLease.from_body(lease(name="train.pod-b")) is None
    assert leases.NodeLease.from_body(lease(holder="pod-b")) is None
    too_long = "p" * 254
    assert (
        leases.NodeLease.from_body(lease(objects.lease_name("train", too_long), too_long)) is None
    )
    unlabelled = lease()
    del unlabelled["metadata"]["labels"]
    assert leases.NodeLease.from_body(unlabelled) is None


def test_long_names_use_the_hashed_lease_name() -> None:
    pod = "p" * 253
    name = objects.lease_name("train", pod)
    assert len(name) <= 253
    seen = leases.NodeLease.from_body(lease(name=name, holder=pod))
    assert seen is not None and seen.node == pod


def test_an_unreadable_entry_is_a_named_problem() -> None:
    for raw, words in [
        ("{not json", "not JSON"),
        ('{"instance": "i"}', "attempt"),
        (leases.NodeEntry("i" * 65, 1, "a", 1).to_annotation(), "1 to 64 characters"),
        (leases.NodeEntry("i", 1, "a" * 254, 1).to_annotation(), "1 to 253 characters"),
        (leases.NodeEntry("i", 1, "a", 1).to_annotation(), "not an IP address"),
        (leases.NodeEntry("i", 1, "10.0.0.1", 70000).to_annotation(), "at most 65535"),
        # Each would stall every status write, or make every round stale at once.
        (leases.NodeEntry("i", 2**64, "10.0.0.1", 1).to_annotation(), "at most 2147483647"),
        ('{"instance": "\\ud800", "attempt": 1, "addr": "10.0.0.1", "storePort": 1}', "UTF-8"),
        (leases.NodeEntry("i", 1, "[fd00::1]", 1).to_annotation(), "not an IP address"),
        (leases.NodeEntry("i", 1, "FD00::1", 1).to_annotation(), "write 'fd00::1'"),
        (leases.NodeEntry("a b", 1, "10.0.0.1", 1).to_annotation(), "printable ASCII"),
    ]:
        seen = leases.NodeLease.from_body(lease(**{objects.ENTRY_ANNOTATION: raw}))
        assert seen is not None and seen.entry is None
        assert seen.entry_problem is not None and words in seen.entry_problem, (
            raw,
            seen.entry_problem,
        )
        assert objects.ENTRY_ANNOTATION in seen.entry_problem


def test_a_lease_for_a_rendezvous_name_with_a_dot_speaks_for_nobody() -> None:
    """``team.train.w-0`` would be pod ``train.w-0`` of rendezvous ``team`` and pod ``w-0``
    of ``team.train``: no Rendezvous has a dot, so only the first reading stands."""
    dotted = lease(name="team.train.w-0", holder="w-0")
    dotted["metadata"]["labels"][objects.NODE_LABEL] = "team.train"
    assert leases.NodeLease.from_body(dotted) is None
    plain = lease(name="team.train.w-0", holder="train.w-0")
    plain["metadata"]["labels"][objects.NODE_LABEL] = "team"
    seen = leases.NodeLease.from_body(plain)
    assert seen is not None and (seen.rendezvous, seen.node) == ("team", "train.w-0")
