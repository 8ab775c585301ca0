"""torchrun's parameters against the Rendezvous (k8s_rendezvous.config): the spec a node
creates from them, and where the spec of one it finds disagrees (the resource wins, and
the node says so once).

The parsing of the parameters themselves is tested with the plugin (test_plugin.py), as
torch hands them over.
"""

from __future__ import annotations

import logging

import pytest
from tests.support.scripted_api import ScriptedRendezvousClient

from k8s_rendezvous import config, state
from k8s_rendezvous.handler import KubernetesRendezvousHandler

SPEC = state.RendezvousSpec(
    2,
    4,
    "run",
    join_timeout_seconds=600,
    last_call_timeout_seconds=30,
    close_timeout_seconds=30,
    heartbeat_timeout_seconds=30,
)


def test_a_created_rendezvous_takes_the_configured_timeouts_and_defaults_for_the_rest() -> None:
    spec = config.spec_to_create(1, 3, "run-7", {"join_timeout": 60, "heartbeat_timeout": 9})
    assert spec == state.RendezvousSpec(
        1,
        3,
        "run-7",
        join_timeout_seconds=60,
        last_call_timeout_seconds=state.DEFAULT_LAST_CALL_TIMEOUT_SECONDS,
        close_timeout_seconds=state.DEFAULT_CLOSE_TIMEOUT_SECONDS,
        heartbeat_timeout_seconds=9,
    )


@pytest.mark.parametrize(
    ("nnodes", "configured", "said"),
    [
        pytest.param((2, 4), {}, [], id="parameters that match say nothing"),
        pytest.param(
            (1, 4),
            {},
            ["admits 2:4 nodes but torchrun was given --nnodes=1:4"],
            id="other node counts are named",
        ),
        pytest.param(
            (2, 4),
            {"join_timeout": 600, "close_timeout": 5, "heartbeat_timeout": 12},
            [
                "sets close_timeout=30 but --rdzv-conf gave close_timeout=5",
                "sets heartbeat_timeout=30 but --rdzv-conf gave heartbeat_timeout=12",
            ],
            id="each other timeout is named, the heartbeat's too",
        ),
    ],
)
def test_where_the_resource_and_torchruns_parameters_disagree_each_is_named(
    nnodes: tuple[int, int], configured: dict[str, int], said: list[str]
) -> None:
    assert config.disagreements(SPEC, nnodes, configured) == said


class SealsAlone(ScriptedRendezvousClient):
    def on_join(self, node: str, entry: state.NodeEntry) -> state.RendezvousStatus:
        return state.RendezvousStatus(
            state=state.RoundState.SEALED,
            round=1,
            members=(state.Member(node, entry.instance, entry.attempt, entry.addr),),
            master=state.Master(entry.addr, entry.store_port),
        )


def test_a_node_given_every_spec_timeout_joins_and_says_where_the_resource_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = KubernetesRendezvousHandler(
        SealsAlone(state.RendezvousSpec(1, 1, "run")),
        run_id="run",
        node="pod-0",
        addr="127.0.0.1",
        min_nodes=1,
        max_nodes=1,
        configured_timeouts=dict.fromkeys(config.SPEC_TIMEOUT_KEYS, 45),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="k8s_rendezvous.handler"):
            assert handler.next_rendezvous().rank == 0
    finally:
        handler.shutdown()
    wins = sorted(r.getMessage() for r in caplog.records if "the resource wins" in r.getMessage())
    assert [message.split()[3] for message in wins] == [
        "close_timeout=30",
        "heartbeat_timeout=30",
        "last_call_timeout=30",
    ], "join_timeout is the node's own deadline, as in c10d: nothing to overrule"
