"""The join step (k8s_rendezvous.join), table-driven and without any I/O: statuses as the
operator writes them, read as a node reads them.

Aspects: what a join does next for each status (admitted, closed, released as a spare,
refused, asked again, wait);
which requests a round admits (this very attempt of this very agent, nothing older); what
num_nodes_waiting() answers after a join; when a joined round is stale; whether a node
waiting unadmitted is the pod it names.
"""

from __future__ import annotations

import dataclasses

import pytest

from k8s_rendezvous import join
from k8s_rendezvous.wire import leases, objects, records, statuses, views

NODE = "pod-1"
REQUEST = leases.NodeEntry("agent-a", 2, "10.0.0.1", 29500)
"""This node's current join request (its agent's second)."""
OTHER = records.Member("pod-0", "agent-z", 1, "10.0.0.9")
MASTER = records.Master(OTHER.addr, 4242)


def admitted_as(entry: leases.NodeEntry) -> records.Member:
    return records.Member(NODE, entry.instance, entry.attempt, entry.addr)


def view(**status: object) -> views.NodeView:
    """``NODE``'s view of a status with these fields, through the wire format."""
    written = statuses.RendezvousStatus(**status).to_dict()  # type: ignore[arg-type]
    return views.NodeView.from_dict(written, NODE)


SEALED = statuses.RoundState.SEALED
REFORMING = statuses.RoundState.REFORMING
CLOSED = statuses.RoundState.CLOSED


@pytest.mark.parametrize(
    ("status", "decision"),
    [
        pytest.param(
            view(),
            join.Wait(),
            id="before the operator's first write the join waits",
        ),
        pytest.param(
            view(round=1, members=(OTHER,), master=MASTER, state=SEALED),
            join.Wait(),
            id="a round sealed without the request waits for the next",
        ),
        pytest.param(
            view(round=2, members=(OTHER, admitted_as(REQUEST)), master=MASTER, state=SEALED),
            join.Admitted(round=2, rank=1, world_size=2, master=MASTER),
            id="a round that holds the request admits it to its rank",
        ),
        pytest.param(
            view(
                round=2,
                members=(OTHER, admitted_as(REQUEST)),
                master=MASTER,
                state=REFORMING,
                nodes_waiting=1,
            ),
            join.Admitted(round=2, rank=1, world_size=2, master=MASTER),
            id="a round gone stale still admits its members, who meet at its store",
        ),
        pytest.param(
            view(
                round=2,
                members=(OTHER, admitted_as(dataclasses.replace(REQUEST, attempt=1))),
                master=MASTER,
                state=SEALED,
            ),
            join.Wait(),
            id="a rank held by the agent's earlier request does not admit this one",
        ),
        pytest.param(
            view(
                round=2,
                members=(OTHER, admitted_as(dataclasses.replace(REQUEST, instance="agent-b"))),
                master=MASTER,
                state=SEALED,
            ),
            join.Wait(),
            id="a rank held by another agent of the same pod does not admit this one",
        ),
        pytest.param(
            view(
                round=3,
                members=(OTHER,),
                master=MASTER,
                state=SEALED,
                left_behind=(admitted_as(REQUEST),),
            ),
            join.Rejoin("it was admitted to a round it never saw, and round 3 sealed without it"),
            id="a request left behind by a later round is spent and asked again",
        ),
        pytest.param(
            view(
                round=2,
                members=(admitted_as(REQUEST),),
                master=MASTER,
                state=CLOSED,
                closed_reason="Finished",
                closed_message="every member finished",
            ),
            join.Closed("Finished", "every member finished"),
            id="a closed rendezvous ends the join even where it lists the request",
        ),
    ],
)
def test_the_join_step_decides_from_the_status_and_the_request(
    status: views.NodeView, decision: join.Decision
) -> None:
    assert join.decide(status, REQUEST) == decision
    assert join.is_decided(status, REQUEST) is not isinstance(decision, join.Wait)


@pytest.mark.parametrize(
    ("closed_reason", "spare", "decision"),
    [
        pytest.param(
            "Finished",
            True,
            join.Released("Finished", "every member finished"),
            id="a spare the work's end closes on is released gracefully",
        ),
        pytest.param(
            statuses.CLOSED_RESTARTS_EXHAUSTED,
            True,
            join.Closed(statuses.CLOSED_RESTARTS_EXHAUSTED, "every member finished"),
            id="a spare closed on in failure fails with the job",
        ),
        pytest.param(
            "Finished",
            False,
            join.Closed("Finished", "every member finished"),
            id="a node that was no spare is closed on, not released",
        ),
    ],
)
def test_a_closure_releases_a_node_that_waited_as_a_spare_unless_the_job_failed(
    closed_reason: str, spare: bool, decision: join.Decision
) -> None:
    status = view(
        round=2,
        members=(OTHER,),
        master=MASTER,
        state=CLOSED,
        closed_reason=closed_reason,
        closed_message="every member finished",
    )
    assert join.decide(status, REQUEST, spare=spare) == decision
    assert join.is_decided(status, REQUEST), "a closure ends the wait, spare or not"


def test_being_a_spare_changes_nothing_but_a_closure() -> None:
    sealed_with_it = view(
        round=2, members=(OTHER, admitted_as(REQUEST)), master=MASTER, state=SEALED
    )
    sealed_full = view(round=2, members=(OTHER,), master=MASTER, state=SEALED)
    for status in (sealed_with_it, sealed_full, view()):
        assert join.decide(status, REQUEST, spare=True) == join.decide(status, REQUEST)


def test_a_member_list_without_a_master_is_asked_again_not_trusted() -> None:
    # A hand-edited status: the decoder takes a Reforming round without its master.
    status = views.NodeView(
        NODE, REFORMING, round=4, world_size=1, own_ranks=((0, admitted_as(REQUEST)),)
    )
    assert join.decide(status, REQUEST) == join.Rejoin("round 4 admitted it but names no master")


def test_a_node_of_a_sliced_round_is_admitted_to_the_rank_its_slice_gives() -> None:
    members = (OTHER, *(records.Member(f"pod-{i}", "x", 1, "10.0.1.1") for i in range(2, 9)))
    members += (admitted_as(REQUEST),)
    sealed = statuses.RendezvousStatus(SEALED, 5, members, MASTER, slices=3)
    own = objects.slice_index(NODE, 3)
    piece = {k: v for k, v in sealed.slice_fields()[own].items() if v is not None}
    assert join.decide(views.NodeView.from_dict(piece, NODE), REQUEST) == join.Admitted(
        round=5, rank=len(members) - 1, world_size=len(members), master=MASTER
    )


JOINED = join.Joined(
    view(round=2, members=(OTHER,), master=MASTER, state=SEALED), rank=1, uid="uid-1"
)


@pytest.mark.parametrize(
    ("status", "joined", "uid", "waiting"),
    [
        pytest.param(
            view(round=1, members=(OTHER,), master=MASTER, state=SEALED),
            None,
            "uid-1",
            0,
            id="a node that never joined has nothing to re-rendezvous into",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=SEALED),
            JOINED,
            "uid-1",
            0,
            id="the node's own sealed round has nobody waiting",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=REFORMING, nodes_waiting=3),
            JOINED,
            "uid-1",
            3,
            id="the node's round gone stale counts those who made it so",
        ),
        pytest.param(
            view(round=3, members=(OTHER,), master=MASTER, state=SEALED),
            JOINED,
            "uid-1",
            1,
            id="a later round sealed without the node tells it to re-rendezvous",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=SEALED),
            JOINED,
            "uid-2",
            1,
            id="a rendezvous made anew tells the node to re-rendezvous",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=REFORMING, nodes_waiting=1),
            JOINED,
            None,
            0,
            id="a deleted rendezvous leaves the members training",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=CLOSED),
            JOINED,
            "uid-1",
            0,
            id="a rendezvous closed as its work ends leaves the members finishing it",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=CLOSED, nodes_waiting=2),
            JOINED,
            "uid-1",
            2,
            id="a rendezvous closed in failure sends every member into the closure",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=CLOSED, nodes_waiting=2),
            None,
            "uid-1",
            0,
            id="a node that never joined is not sent anywhere by a closure",
        ),
    ],
)
def test_nodes_waiting_is_positive_exactly_when_the_joined_round_is_over(
    status: views.NodeView, joined: join.Joined | None, uid: str | None, waiting: int
) -> None:
    assert join.nodes_waiting(status, joined, uid) == waiting


@pytest.mark.parametrize(
    ("status", "stale"),
    [
        pytest.param(None, False, id="no status seen yet judges nothing"),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=SEALED),
            False,
            id="the round still sealed is not stale",
        ),
        pytest.param(
            view(round=2, members=(OTHER,), master=MASTER, state=REFORMING, nodes_waiting=1),
            True,
            id="the round re-forming is stale",
        ),
        pytest.param(
            view(round=3, members=(OTHER,), master=MASTER, state=SEALED),
            True,
            id="a later round makes the joined one stale",
        ),
    ],
)
def test_a_joined_round_is_stale_once_it_is_no_longer_the_sealed_one(
    status: views.NodeView | None, stale: bool
) -> None:
    assert join.is_stale(status, 2) is stale


@pytest.mark.parametrize(
    ("status", "spare"),
    [
        pytest.param(
            view(round=1, members=(OTHER,), master=MASTER, state=SEALED),
            True,
            id="a round sealed full without the request",
        ),
        pytest.param(
            view(round=1, members=(OTHER,), master=MASTER, state=REFORMING, nodes_waiting=1),
            False,
            id="a round re-forming has room",
        ),
        pytest.param(
            view(round=2, members=(OTHER, admitted_as(REQUEST)), master=MASTER, state=SEALED),
            False,
            id="a member is no spare",
        ),
        pytest.param(view(), False, id="nothing formed yet"),
    ],
)
def test_a_node_is_a_spare_only_while_a_full_round_is_sealed_without_it(
    status: views.NodeView, spare: bool
) -> None:
    assert join.is_spare(status, REQUEST, max_nodes=1) is spare
    assert join.is_spare(status, REQUEST, max_nodes=2) is False or status.world_size >= 2


def test_a_refused_request_ends_the_join_with_the_operators_reason() -> None:
    refusal = records.Refusal(NODE, REQUEST.instance, REQUEST.attempt, "OtherWorkload", "why")
    assert join.decide(view(refused=(refusal,)), REQUEST) == join.Refused("OtherWorkload", "why")
    closed = view(state=CLOSED, closed_reason="Done", closed_message="m", refused=(refusal,))
    assert isinstance(join.decide(closed, REQUEST), join.Closed), "a close says more"


@pytest.mark.parametrize(
    "refused",
    [
        records.Refusal(NODE, REQUEST.instance, REQUEST.attempt - 1, "OtherWorkload", "older"),
        records.Refusal(NODE, "agent-before-restart", REQUEST.attempt, "OtherWorkload", "older"),
        records.Refusal("pod-9", REQUEST.instance, REQUEST.attempt, "OtherWorkload", "another"),
    ],
    ids=["an-earlier-attempt", "an-earlier-agent", "another-pod"],
)
def test_a_refusal_of_another_request_is_not_this_ones(refused: records.Refusal) -> None:
    assert join.decide(view(refused=(refused,)), REQUEST) == join.Wait()


def test_a_sliced_round_carries_each_refusal_in_the_refused_nodes_slice() -> None:
    refusal = records.Refusal(NODE, REQUEST.instance, REQUEST.attempt, "OtherWorkload", "why")
    status = statuses.RendezvousStatus(slices=3, refused=(refusal,))
    pieces = status.slice_fields()
    own = objects.slice_index(NODE, 3)
    for index, piece in pieces.items():
        found = views.NodeView.from_dict(piece, NODE).refusal_of(REQUEST)
        assert (found is not None) == (index == own)


@pytest.mark.parametrize(
    ("token_pod", "pod_exists", "check"),
    [
        pytest.param(NODE, None, join.PodCheck.IS_THE_POD, id="a token bound to the pod itself"),
        pytest.param("pod-9", None, join.PodCheck.ANOTHER_POD, id="a token of another pod"),
        pytest.param(None, True, join.PodCheck.IS_THE_POD, id="no pod's token, the pod exists"),
        pytest.param(None, False, join.PodCheck.NO_SUCH_POD, id="no pod's token, no such pod"),
        pytest.param(None, None, join.PodCheck.CANNOT_TELL, id="no pod's token, pods unreadable"),
    ],
)
def test_a_node_is_the_pod_it_names_only_if_its_token_or_the_pods_say_so(
    token_pod: str | None, pod_exists: bool | None, check: join.PodCheck
) -> None:
    assert join.check_pod(NODE, token_pod, pod_exists) is check
