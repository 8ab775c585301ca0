"""The wire format (``k8s_rendezvous.wire``).

Aspects: codecs round-trip; camelCase on the wire; decode errors name the field; a status
not yet touched by the operator decodes; the schema version is checked; IPv6 masters are
bracketed for display only; a node's entry round-trips through its Lease annotation; the
status of a large round stays within a size budget; a node's own view of the status
answers as the whole status does; and,
fuzzed, no input makes the decoder raise anything but ``DecodeError``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib

import hypothesis
import pytest
import yaml
from hypothesis import strategies as st

from k8s_rendezvous.wire import codec, leases, objects, records, specs, statuses, tunables, views

NOW = datetime.datetime(2026, 11, 30, 9, 0, 0, 123456, tzinfo=datetime.timezone.utc)


def sealed_status(nodes: int) -> statuses.RendezvousStatus:
    entries = {
        f"train-job-worker-{i}-abcde": leases.NodeEntry(
            f"{i:016x}", 3, f"10.244.{i // 250}.{i % 250}", 40000 + i
        )
        for i in range(nodes)
    }
    members = tuple(
        records.Member(name, entry.instance, entry.attempt, entry.addr)
        for name, entry in entries.items()
    )
    return statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=7,
        members=members,
        master=records.Master(members[0].addr, 40000),
        sealed_at=NOW,
        conditions=(
            records.Condition("Ready", "True", "RoundSealed", "ok", NOW.replace(microsecond=0), 2),
        ),
        observed_generation=2,
    )


def test_status_round_trips_through_json() -> None:
    status = sealed_status(5)
    wire = json.loads(json.dumps(status.to_dict()))
    assert statuses.RendezvousStatus.from_dict(wire) == status


def test_wire_names_are_camel_case() -> None:
    wire = sealed_status(2).to_dict()
    assert {"roundKey", "worldSize", "nodesWaiting", "sealedAt", "schemaVersion"} <= set(wire)
    assert wire["roundKey"] == "7-Sealed"
    assert wire["worldSize"] == 2


def test_spec_round_trips_and_defaults_timeouts() -> None:
    spec = specs.RendezvousSpec.from_dict({"minNodes": 2, "maxNodes": 4, "runId": "r"})
    assert spec.join_timeout_seconds == 600
    assert spec.last_call_timeout_seconds == 30
    assert spec.close_timeout_seconds == 30
    assert specs.RendezvousSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"minNodes": 3, "maxNodes": 2, "runId": "r"}, "minNodes (3) must not exceed maxNodes (2)"),
        ({"minNodes": 0, "maxNodes": 2, "runId": "r"}, "spec.minNodes: must be at least 1"),
        ({"minNodes": "2", "maxNodes": 2, "runId": "r"}, "spec.minNodes: expected an integer"),
        ({"minNodes": 1, "maxNodes": 2}, "spec.runId: expected a string"),
        ([], "spec: expected an object"),
    ],
)
def test_spec_errors_name_the_field(raw: object, message: str) -> None:
    with pytest.raises(codec.DecodeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        specs.RendezvousSpec.from_dict(raw)


def test_status_not_yet_written_by_the_operator_is_the_initial_one() -> None:
    status = statuses.RendezvousStatus.from_dict({})
    assert status == statuses.RendezvousStatus()
    assert status.state is statuses.RoundState.FORMING and status.round_key == "0-Forming"


def test_entry_round_trips_through_its_lease_annotation() -> None:
    entry = leases.NodeEntry("i-1", 3, "fd00::7", 29500, leases.NodeIntent.LEAVE, 41000)
    text = entry.to_annotation()
    assert json.loads(text) == {
        "instance": "i-1",
        "attempt": 3,
        "addr": "fd00::7",
        "storePort": 29500,
        "intent": "Leave",
        "probePort": 41000,
    }
    assert leases.NodeEntry.from_annotation(text, "entry") == entry


def test_other_schema_version_is_refused_with_upgrade_advice() -> None:
    raw = sealed_status(1).to_dict() | {"schemaVersion": 99}
    with pytest.raises(codec.DecodeError, match="upgrade them together"):
        statuses.RendezvousStatus.from_dict(raw)


def test_member_rank_must_match_its_position() -> None:
    raw = sealed_status(2).to_dict()
    raw["members"][1]["rank"] = 0
    with pytest.raises(codec.DecodeError, match=r"status.members\[1\].rank"):
        statuses.RendezvousStatus.from_dict(raw)


def test_bad_member_names_the_field() -> None:
    raw = sealed_status(2).to_dict()
    raw["members"][1]["attempt"] = 0
    with pytest.raises(codec.DecodeError, match=r"status.members\[1\].attempt: must be at least 1"):
        statuses.RendezvousStatus.from_dict(raw)


def test_ipv6_master_is_bracketed_for_display_only() -> None:
    master = records.Master("fd00::1", 29500)
    assert master.endpoint == "[fd00::1]:29500"
    assert master.to_dict()["addr"] == "fd00::1"


def test_round_key_of_closed_rendezvous() -> None:
    assert (
        statuses.RendezvousStatus(state=statuses.RoundState.CLOSED, round=3).round_key == "Closed"
    )


def test_status_of_a_1000_node_round_stays_under_budget() -> None:
    # Every pod receives this object once per round it waits for; keep it lean. Measured
    # 129 bytes per node with 28-character pod names (its member entry); guard against growth.
    size = len(json.dumps(sealed_status(1000).to_dict(), separators=(",", ":")))
    assert size < 140_000, size


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(value=json_values)
def test_decoder_raises_only_decode_error(value: object) -> None:
    for decode in (
        statuses.RendezvousStatus.from_dict,
        specs.RendezvousSpec.from_dict,
        lambda raw: views.NodeView.from_dict(raw, "train-job-worker-1-abcde"),
    ):
        with contextlib.suppress(codec.DecodeError):
            decode(value)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    mutation=st.tuples(
        st.sampled_from(
            ["state", "round", "members", "master", "leftBehind", "conditions", "sealedAt"]
        ),
        json_values,
    )
)
def test_decoder_survives_any_field_corruption(mutation: tuple[str, object]) -> None:
    raw = sealed_status(3).to_dict()
    raw[mutation[0]] = mutation[1]
    with contextlib.suppress(codec.DecodeError):
        statuses.RendezvousStatus.from_dict(raw)
    with contextlib.suppress(codec.DecodeError):
        views.NodeView.from_dict(raw, "train-job-worker-1-abcde")


def test_sealed_round_without_master_is_refused() -> None:
    raw = sealed_status(2).to_dict()
    del raw["master"]
    with pytest.raises(codec.DecodeError, match="a Sealed round needs members and a master"):
        statuses.RendezvousStatus.from_dict(raw)


MEMBER_ATTRIBUTES = {
    "node": "node",
    "instance": "instance",
    "attempt": "attempt",
    "addr": "addr",
    "podRestarts": "pod_restarts",
    "replaces": "replaces",
}


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(key=st.sampled_from(["rank", *MEMBER_ATTRIBUTES]), value=json_values)
def test_a_member_is_taken_exactly_when_each_of_its_fields_is_valid(
    key: str, value: object
) -> None:
    raw = sealed_status(2).to_dict()
    raw["members"][1][key] = value
    if key == "rank":
        valid = value == 1
    elif key == "attempt":
        valid = type(value) is int and value >= 1
    elif key == "podRestarts":
        valid = type(value) is int and value >= 0
    elif key == "replaces":
        valid = value is None or isinstance(value, str)
    else:
        valid = isinstance(value, str)
    if not valid:
        with pytest.raises(codec.DecodeError, match=rf"status.members\[1\].{key}"):
            statuses.RendezvousStatus.from_dict(raw)
        return
    member = statuses.RendezvousStatus.from_dict(raw).members[1]
    if key in MEMBER_ATTRIBUTES:
        assert getattr(member, MEMBER_ATTRIBUTES[key]) == value


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    members=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from("xy"), st.integers(1, 2)), max_size=6
    ),
    left_behind=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from("xy"), st.integers(1, 2)), max_size=3
    ),
    round_state=st.sampled_from(list(statuses.RoundState)),
    node=st.sampled_from("abcd"),
    slices=st.integers(0, 3),
)
def test_a_node_view_answers_as_the_whole_status_does(
    members: list[tuple[str, str, int]],
    left_behind: list[tuple[str, str, int]],
    round_state: statuses.RoundState,
    node: str,
    slices: int,
) -> None:
    """A node decodes only its own entries, of the status or of its own slice, and answers
    every question the handler asks as the full decode would (a pod may hold two entries:
    an agent restarted unnoticed)."""

    def member(fields: tuple[str, str, int]) -> records.Member:
        return records.Member(fields[0], fields[1], fields[2], f"10.0.0.{ord(fields[0])}")

    status = statuses.RendezvousStatus(
        state=round_state
        if members or round_state is not statuses.RoundState.SEALED
        else statuses.RoundState.FORMING,
        round=3,
        members=tuple(member(fields) for fields in members),
        master=records.Master("10.0.0.1", 29500),
        nodes_waiting=2,
        left_behind=tuple(member(fields) for fields in left_behind),
        closed_reason="Done",
        closed_message="finished",
        slices=slices,
    )
    view = views.NodeView.from_dict(json.loads(json.dumps(status.to_dict())), node)
    assert view.member_nodes == tuple(m.node for m in status.members)
    assert view.member_addresses == tuple(m.addr for m in status.members)
    seen = [view]
    if slices:
        own = status.slice_fields()[objects.slice_index(node, slices)]
        stored = {key: value for key, value in own.items() if value is not None}
        seen.append(views.NodeView.from_dict(json.loads(json.dumps(stored)), node))
    for view in seen:
        assert (view.state, view.round, view.round_key, view.world_size, view.slices) == (
            status.state,
            status.round,
            status.round_key,
            status.world_size,
            status.slices,
        )
        assert (view.master, view.nodes_waiting, view.closed_reason, view.closed_message) == (
            status.master,
            status.nodes_waiting,
            status.closed_reason,
            status.closed_message,
        )
        assert view.rank_zero_node == (status.members[0].node if status.members else None)
        for instance in "xy":
            for attempt in (1, 2):
                entry = leases.NodeEntry(instance, attempt, "10.0.0.9", 29500)
                assert view.rank_of(entry) == status.rank_of(node, entry)
                assert view.left_behind_with(entry) == status.left_behind_with(node, entry)


def test_slices_hold_each_member_once_and_only_above_a_hundred_nodes() -> None:
    assert [objects.slice_count(n) for n in (1, 100, 101, 200, 201, 1000)] == [0, 0, 2, 2, 3, 10]
    members = tuple(
        records.Member(f"worker-{i}", "x", 1, f"10.0.{i // 256}.{i % 256}") for i in range(1000)
    )
    status = statuses.RendezvousStatus(
        statuses.RoundState.SEALED, 4, members, records.Master("10.0.0.0", 29500), slices=10
    )
    pieces = list(status.slice_fields().values())
    ranks = sorted(member["rank"] for piece in pieces for member in piece["members"])
    assert ranks == list(range(1000))
    sizes = [len(piece["members"]) for piece in pieces]
    assert max(sizes) < 150, f"a pod-name hash spreads the members: {sizes}"
    whole = len(json.dumps(status.to_dict()))
    assert max(len(json.dumps(piece)) for piece in pieces) < whole / 5


def test_a_slice_member_ranked_beyond_the_world_is_refused() -> None:
    status = statuses.RendezvousStatus(
        statuses.RoundState.SEALED,
        1,
        (records.Member("a", "x", 1, "10.0.0.1"),),
        records.Master("10.0.0.1", 29500),
        slices=2,
    )
    piece = status.slice_fields()[objects.slice_index("a", 2)]
    piece["members"][0]["rank"] = 1
    with pytest.raises(codec.DecodeError, match=r"status.members\[0\].rank: must be at most 0"):
        views.NodeView.from_dict(piece, "a")


def test_a_node_view_checks_its_own_entry_and_every_pod_name() -> None:
    raw = sealed_status(3).to_dict()
    raw["members"][1]["attempt"] = 0
    with pytest.raises(codec.DecodeError, match=r"status.members\[1\].attempt: must be at least"):
        views.NodeView.from_dict(raw, "train-job-worker-1-abcde")
    # Another node's entry is not this node's to check: the operator wrote it, under the
    # CRD's schema.
    assert (
        views.NodeView.from_dict(raw, "train-job-worker-2-abcde").rank_of(
            leases.NodeEntry(f"{2:016x}", 3, "10.244.0.2", 40002)
        )
        == 2
    )
    raw["members"][0]["node"] = 7
    with pytest.raises(codec.DecodeError, match=r"status.members\[0\].node: expected a string"):
        views.NodeView.from_dict(raw, "train-job-worker-2-abcde")


def test_a_slice_that_names_no_rendezvous_is_refused_with_the_fix() -> None:
    owned = {
        "kind": objects.SLICE_KIND,
        "metadata": {
            "name": "r.slice-0",
            "uid": "slice-uid",
            "ownerReferences": [{"kind": objects.KIND, "name": "r", "uid": "rdzv-uid"}],
        },
    }
    assert objects.rendezvous_uid(owned) == "rdzv-uid"
    assert (
        objects.rendezvous_uid({"kind": objects.KIND, "metadata": {"uid": "rdzv-uid"}})
        == "rdzv-uid"
    )
    owned["metadata"]["ownerReferences"] = []
    with pytest.raises(codec.DecodeError, match=r"names no Rendezvous\. .* delete this one"):
        objects.rendezvous_uid(owned)


def test_the_crd_holds_each_spec_tunable_as_the_table_describes_it() -> None:
    """The CRD is written by hand; the codec, the ``--rdzv-conf`` keys and the Job
    annotations are derived from :data:`tunables.SPEC_TUNABLES`: this keeps the four in step."""
    crd_path = (
        pathlib.Path(__file__).parents[2]
        / "charts/k8s-rendezvous/crds/k8s-rendezvous.dev_rendezvous.yaml"
    )
    crd = yaml.safe_load(crd_path.read_text())
    properties = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    numbers = {t.field for t in tunables.SPEC_TUNABLES} | {
        name for name in properties if name.endswith("TimeoutSeconds")
    }
    in_crd = {
        name: tuple(properties[name].get(bound) for bound in ("default", "minimum", "maximum"))
        for name in numbers
    }
    assert in_crd == {t.field: (t.default, t.minimum, t.maximum) for t in tunables.SPEC_TUNABLES}
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    for listed in ("members", "leftBehind"):
        attempt = status["properties"][listed]["items"]["properties"]["attempt"]
        assert attempt["maximum"] == leases.MAX_ATTEMPT, "a request no status can hold is refused"
    for tunable in tunables.SPEC_TUNABLES:
        base = {"minNodes": 1, "maxNodes": 1, "runId": "r"}
        with pytest.raises(codec.DecodeError, match=f"{tunable.field}: must be at least"):
            specs.RendezvousSpec.from_dict(base | {tunable.field: tunable.minimum - 1})
        if tunable.maximum is not None:
            with pytest.raises(codec.DecodeError, match=f"{tunable.field}: must be at most"):
                specs.RendezvousSpec.from_dict(base | {tunable.field: tunable.maximum + 1})
        unset = specs.RendezvousSpec.from_dict(base)
        assert getattr(unset, tunable.attribute) == tunable.default
        assert (tunable.field in unset.to_dict()) == (tunable.default is not None)
