"""A Job's rendezvous annotations (``k8s_rendezvous_operator.annotations.parse``).

Aspects: no annotation means no opt-in; torchrun's ``N`` and ``MIN:MAX`` forms; every
optional key; each malformed or contradictory value yields an error naming the key, the
value and the accepted forms, and no spec; fuzzed, no input raises.
"""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st

from k8s_rendezvous.wire import specs
from k8s_rendezvous_operator import job_annotations as ann


def parse(parallelism: int | None = 4, **values: str) -> object:
    keys = {f"{ann.PREFIX}{key.replace('_', '-')}": value for key, value in values.items()}
    return ann.parse(keys, job_name="train", parallelism=parallelism)


def test_job_without_our_annotations_is_not_opted_in() -> None:
    assert ann.parse({"other.io/nodes": "2"}, job_name="train", parallelism=2) is None


@pytest.mark.parametrize(("nodes", "bounds"), [("4", (4, 4)), ("2:4", (2, 4)), (" 1 : 8 ", (1, 8))])
def test_nodes_in_torchrun_form(nodes: str, bounds: tuple[int, int]) -> None:
    spec = parse(nodes=nodes)
    assert isinstance(spec, specs.RendezvousSpec)
    assert (spec.min_nodes, spec.max_nodes) == bounds
    assert spec.run_id == "train"
    assert spec.join_timeout_seconds == 600


def test_every_optional_key() -> None:
    spec = parse(
        nodes="2:4",
        join_timeout="120s",
        last_call_timeout="0",
        close_timeout="5",
        heartbeat_timeout="9",
        run_id="exp-7",
        rank_order="topology.kubernetes.io/zone",
        max_restarts="0",
        spares="0",
    )
    assert spec == specs.RendezvousSpec(
        2,
        4,
        "exp-7",
        120,
        0,
        5,
        9,
        rank_order_node_label="topology.kubernetes.io/zone",
        max_restarts=0,
        spares=0,
    )


@pytest.mark.parametrize(
    ("parallelism", "values", "spares"),
    [
        (6, {}, 2),  # its pods beyond MAX are its declaration
        (4, {}, None),
        (None, {}, None),
        (6, {"spares": "1"}, 1),  # the annotation wins
        (6, {"spares": "0"}, 0),
        (4, {"spares": "3"}, 3),  # more than it makes: the condition will say so
    ],
)
def test_a_jobs_spares_are_its_pods_beyond_max_unless_annotated(
    parallelism: int | None, values: dict[str, str], spares: int | None
) -> None:
    spec = parse(parallelism, nodes="2:4", **values)
    assert isinstance(spec, specs.RendezvousSpec)
    assert spec.spares == spares


@pytest.mark.parametrize(
    ("values", "key", "problem"),
    [
        ({"nodes": "4:2"}, "nodes", "needs 1 <= MIN <= MAX"),
        ({"nodes": "x"}, "nodes", "not a count or a range"),
        ({"nodes": "0"}, "nodes", "needs 1 <= MIN <= MAX"),
        ({"nodes": "5:8"}, "nodes", "MIN is above the Job's parallelism (4)"),
        ({"nodes": "2", "colour": "red"}, "colour", "unknown key"),
        ({"join_timeout": "10"}, "nodes", "missing"),
        ({"nodes": "2", "join_timeout": "ten"}, "join-timeout", "not a whole number of seconds"),
        ({"nodes": "2", "heartbeat_timeout": "1"}, "heartbeat-timeout", ">= 3"),
        ({"nodes": "2", "rank_order": "not a key!"}, "rank-order", "not a label key"),
        # What parses but the CRD would refuse is refused here, where the Job shows it.
        ({"nodes": "1:999999"}, "nodes", "needs 1 <= MIN <= MAX <= 100000"),
        ({"nodes": "2", "rank_order": "a" * 318 + "/zone"}, "rank-order", "not a label key"),
        # ASCII digits only.
        ({"nodes": "\u0663"}, "nodes", "not a count or a range"),
        ({"nodes": "\uff12:\uff14"}, "nodes", "not a count or a range"),
        ({"nodes": "2", "join_timeout": "\u0661\u0660"}, "join-timeout", "not a whole number"),
        ({"nodes": "2\n"}, "nodes", "not a count or a range"),
        # A run id becomes PET_RDZV_ID and a store key prefix.
        ({"nodes": "2", "run_id": "exp\n7"}, "run-id", "printable ASCII characters"),
        ({"nodes": "2", "run_id": "exp\x007"}, "run-id", "printable ASCII characters"),
        ({"nodes": "2", "run_id": "exp 7"}, "run-id", "without spaces"),
        ({"nodes": "2", "max_restarts": "-1"}, "max-restarts", "number of restarts >= 0"),
        ({"nodes": "2", "max_restarts": "2147483648"}, "max-restarts", "<= 2147483647"),
        ({"nodes": "2", "max_restarts": "\u0663"}, "max-restarts", "not a whole number"),
        ({"nodes": "2", "max_restarts": "5s"}, "max-restarts", "not a whole number"),
    ],
)
def test_bad_annotation_names_key_value_and_accepted_forms(
    values: dict[str, str], key: str, problem: str
) -> None:
    errors = parse(**values)
    assert isinstance(errors, tuple) and errors
    error = next(e for e in errors if e.key == f"{ann.PREFIX}{key}")
    assert problem in error.message
    assert repr(error.value) in error.message
    assert "accepted:" in error.message


@hypothesis.given(
    annotations=st.dictionaries(
        st.sampled_from([*ann.ACCEPTED, f"{ann.PREFIX}x", "other"]), st.text(max_size=12)
    ),
    parallelism=st.none() | st.integers(0, 10),
)
def test_parser_never_raises(annotations: dict[str, str], parallelism: int | None) -> None:
    result = ann.parse(annotations, job_name="j", parallelism=parallelism)
    assert result is None or isinstance(result, (tuple, specs.RendezvousSpec))


def test_a_job_whose_name_has_a_dot_is_told_to_rename_it() -> None:
    errors = ann.parse({ann.NODES: "2"}, job_name="team.train", parallelism=2)
    assert isinstance(errors, tuple)
    (error,) = errors
    assert error.key == ann.NODES
    assert "the Job's name 'team.train' cannot name a Rendezvous" in error.message
    assert "no dots" in error.message and "rename the Job" in error.message
