"""The records a node's handler and its workers hand each other on the in-place path
(k8s_rendezvous.handoff): they round-trip, go on the wire in camelCase with a schema
version, are replaced whole, refuse what they cannot read naming the field, and every
node of a round computes the same reconfigure UUID, a new one per round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k8s_rendezvous import handoff

ROUND = handoff.PublishedRound(
    round=3, uuid=12345, master="10.0.0.1:4242", group_rank=1, group_world_size=3
)


def test_a_published_round_and_a_worker_record_read_back_as_written(tmp_path: Path) -> None:
    in_place = handoff.PublishedRound(
        round=4,
        uuid=7,
        master="[fd00::1]:4242",
        group_rank=0,
        group_world_size=2,
        base_rank=0,
        world_size=4,
        lost_addresses=("10.0.0.2",),
        leaving_addresses=("10.0.0.3",),
    )
    handoff.write(tmp_path, handoff.ROUND_FILE, in_place)
    handoff.write(tmp_path, handoff.worker_file(1), handoff.WorkerRecord(1, 99, 4, "why"))

    assert handoff.read_round(tmp_path) == in_place
    assert in_place.in_place and not ROUND.in_place
    assert handoff.read_worker(tmp_path, 1) == handoff.WorkerRecord(1, 99, 4, "why")
    assert handoff.read_worker(tmp_path, 0) is None


def test_a_record_is_replaced_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    handoff.write(tmp_path, handoff.ROUND_FILE, ROUND)
    handoff.write(tmp_path, handoff.ROUND_FILE, handoff.PublishedRound(4, 1, "a:1", 0, 1))

    assert [path.name for path in tmp_path.iterdir()] == [handoff.ROUND_FILE]
    published = handoff.read_round(tmp_path)
    assert published is not None and published.round == 4


def test_records_go_on_the_wire_in_camel_case_with_their_schema_version() -> None:
    assert ROUND.to_dict() == {
        "schemaVersion": 1,
        "round": 3,
        "uuid": 12345,
        "master": "10.0.0.1:4242",
        "groupRank": 1,
        "groupWorldSize": 3,
        "baseRank": None,
        "worldSize": None,
        "fallback": None,
        "lostAddresses": [],
        "leavingAddresses": [],
    }
    assert handoff.WorkerRecord(1, 99, 4).to_dict() == {
        "schemaVersion": 1,
        "localRank": 1,
        "pid": 99,
        "round": 4,
        "fallback": None,
    }


def test_an_unreadable_worker_record_is_refused_naming_the_field(tmp_path: Path) -> None:
    record = {**handoff.WorkerRecord(1, 99, 4).to_dict(), "localRank": -1}
    (tmp_path / handoff.worker_file(1)).write_text(json.dumps(record))
    with pytest.raises(handoff.HandoffError, match=r"worker\.localRank: must be at least 0"):
        handoff.read_worker(tmp_path, 1)


def test_nothing_published_reads_as_none(tmp_path: Path) -> None:
    assert handoff.read_round(tmp_path) is None


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ("{", "not JSON"),
        ("[]", "not an object"),
        (json.dumps({**ROUND.to_dict(), "schemaVersion": 2}), "schemaVersion: 2 is not 1"),
        (json.dumps({**ROUND.to_dict(), "round": "3"}), "round: expected an integer"),
        (json.dumps({**ROUND.to_dict(), "master": None}), "master: expected a string"),
        (json.dumps({**ROUND.to_dict(), "groupRank": True}), "round.groupRank: expected an int"),
    ],
    ids=["truncated", "a list", "another version", "a string round", "no master", "a bool"],
)
def test_an_unreadable_round_is_refused_with_what_is_wrong(
    tmp_path: Path, content: str, complaint: str
) -> None:
    (tmp_path / handoff.ROUND_FILE).write_text(content)
    with pytest.raises(handoff.HandoffError, match=complaint):
        handoff.read_round(tmp_path)


def test_every_node_computes_the_same_uuid_for_a_round_and_a_new_one_for_the_next() -> None:
    uuid = handoff.round_uuid("uid-1", 3, "10.0.0.1:4242")

    assert uuid == handoff.round_uuid("uid-1", 3, "10.0.0.1:4242")
    assert 0 <= uuid < 2**56
    others = {
        handoff.round_uuid("uid-1", 4, "10.0.0.1:4242"),
        handoff.round_uuid("uid-2", 3, "10.0.0.1:4242"),  # the Rendezvous made anew
        handoff.round_uuid("uid-1", 3, "10.0.0.2:4242"),
    }
    assert uuid not in others and len(others) == 3
