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
from torch.distributed.elastic import events
from torch.distributed.elastic.events import handlers as event_handlers
from torch.distributed.elastic.events.api import NodeState, RdzvEvent

from k8s_rendezvous import config
from k8s_rendezvous.wire import leases, records, specs, statuses, tunables

SPEC = specs.RendezvousSpec(
    2,
    4,
    "run",
    join_timeout_seconds=600,
    last_call_timeout_seconds=30,
    close_timeout_seconds=30,
    heartbeat_timeout_seconds=30,
)


def test_a_created_rendezvous_takes_the_configured_spec_and_defaults_for_the_rest() -> None:
    spec = config.spec_to_create(
        1, 3, "run-7", {"joinTimeoutSeconds": 60, "heartbeatTimeoutSeconds": 9}
    )
    assert spec == specs.RendezvousSpec(
        1,
        3,
        "run-7",
        join_timeout_seconds=60,
        last_call_timeout_seconds=tunables.DEFAULT_LAST_CALL_TIMEOUT_SECONDS,
        close_timeout_seconds=tunables.DEFAULT_CLOSE_TIMEOUT_SECONDS,
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
            {
                "joinTimeoutSeconds": 600,
                "lastCallTimeoutSeconds": 5,
                "closeTimeoutSeconds": 5,
                "heartbeatTimeoutSeconds": 12,
            },
            [
                "sets last_call_timeout=30 but --rdzv-conf gave last_call_timeout=5",
                "sets keep_alive_interval x keep_alive_max_attempt=30 but --rdzv-conf gave "
                "keep_alive_interval x keep_alive_max_attempt=12",
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
    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus:
        return statuses.RendezvousStatus(
            state=statuses.RoundState.SEALED,
            round=1,
            members=(records.Member(node, entry.instance, entry.attempt, entry.addr),),
            master=records.Master(entry.addr, entry.store_port),
        )


def test_a_node_given_every_spec_tunable_joins_and_says_where_the_resource_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = SealsAlone(specs.RendezvousSpec(1, 1, "run")).handler(
        "pod-0", configured_spec={tunable.field: 45 for tunable in tunables.SPEC_TUNABLES}
    )
    try:
        with caplog.at_level(logging.WARNING, logger="k8s_rendezvous.node_requests"):
            assert handler.next_rendezvous().rank == 0
    finally:
        handler.shutdown()
    wins = sorted(r.getMessage() for r in caplog.records if "the resource wins" in r.getMessage())
    assert [message.split()[3] for message in wins] == [
        "job_max_restarts=none",
        "keep_alive_interval",
        "last_call_timeout=30",
        "spares=none",
    ], "join and close timeouts are the node's own deadlines, as in c10d: nothing to overrule"


def test_a_join_records_torchelastics_rendezvous_events_as_c10d_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's ``dynamic_rendezvous`` event handler (a deployment's, replacing its
    default NullHandler) sees each join, as it sees c10d's."""
    seen: list[RdzvEvent] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(RdzvEvent.deserialize(record.getMessage()))

    monkeypatch.setitem(event_handlers._log_handlers, "dynamic_rendezvous", Collect())
    monkeypatch.delitem(events._events_loggers, "dynamic_rendezvous", raising=False)
    handler = SealsAlone(specs.RendezvousSpec(1, 1, "run")).handler("pod-0")
    try:
        handler.next_rendezvous()
    finally:
        handler.shutdown()
        logger = events._events_loggers.pop("dynamic_rendezvous", None)
        if logger is not None:
            for attached in list(logger.handlers):
                logger.removeHandler(attached)
    assert [(e.name.rpartition(":")[2], e.message, e.node_state, e.rank) for e in seen] == [
        (
            "KubernetesRendezvousHandler.next_rendezvous",
            "node pod-0 attempts to join the next round of run",
            NodeState.RUNNING,
            None,
        ),
        (
            "KubernetesRendezvousHandler.next_rendezvous",
            "node pod-0 joined round 1 of run as rank 0 in a world of 1",
            NodeState.RUNNING,
            0,
        ),
        ("KubernetesRendezvousHandler.shutdown", "node pod-0 left run", NodeState.SUCCEEDED, None),
    ]
