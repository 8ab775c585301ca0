"""A node that waits as a spare (its round sealed full without it) and sees the rendezvous
close ends as torch's c10d ends a node of its redundancy list: gracefully when the work
ended, with the closure's error when the job failed. The join loop applies what the join
step decides (join.Released, join.Closed), from the statuses in the order it saw them.

The API side is a scripted client that plays the operator; no store is reached.
"""

from __future__ import annotations

import threading

from tests.support.scripted_api import ScriptedRendezvousClient

from devkit.waiting import wait_for
from k8s_rendezvous.errors import (
    KubernetesRendezvousClosedError,
    KubernetesRendezvousGracefulExitError,
)
from k8s_rendezvous.wire import leases, records, specs, statuses

SPEC = specs.RendezvousSpec(1, 1, "run", join_timeout_seconds=60)
MEMBER = records.Member("pod-0", "agent-z", 1, "127.0.0.1")
SEALED_FULL = statuses.RendezvousStatus(
    state=statuses.RoundState.SEALED,
    round=1,
    members=(MEMBER,),
    master=records.Master(MEMBER.addr, 1),
)


class FullRound(ScriptedRendezvousClient):
    """A round sealed full without the joining node, then closed when the test says."""

    def on_join(self, node: str, entry: leases.NodeEntry) -> statuses.RendezvousStatus:
        return SEALED_FULL

    def close(self, reason: str) -> None:
        closed = statuses.RendezvousStatus(
            state=statuses.RoundState.CLOSED,
            round=1,
            members=(MEMBER,),
            master=SEALED_FULL.master,
            closed_reason=reason,
            closed_message="closed by the test",
        )
        with self._changed:
            version = int(self._object["metadata"]["resourceVersion"]) + 1
            self._object = self._versioned(version, closed)
            self._changed.notify_all()


def error_of_a_spare_closed_on(reason: str) -> BaseException:
    """What ``next_rendezvous()`` of a node waiting as a spare raises once the
    rendezvous closes for ``reason``."""
    client = FullRound(SPEC)
    handler = client.handler("pod-1")
    raised: list[BaseException] = []

    def join() -> None:
        try:
            handler.next_rendezvous()
        except BaseException as error:  # what the test asserts on
            raised.append(error)

    joining = threading.Thread(target=join, name="spare-join", daemon=True)
    joining.start()
    try:
        # The watcher hands the join loop each status in the order it saw them: the
        # full round first, so the node waited as a spare when the close comes.
        wait_for(
            lambda: (s := handler.watcher.status) is not None and s.round == 1,
            10,
            "the spare sees the full round",
        )
        client.close(reason)
        joining.join(10)
        assert not joining.is_alive(), "next_rendezvous() still blocked after the close"
    finally:
        handler.shutdown()
    (error,) = raised
    return error


def test_a_spare_ends_gracefully_when_the_work_ends() -> None:
    error = error_of_a_spare_closed_on("Finished")
    assert isinstance(error, KubernetesRendezvousGracefulExitError)
    assert "waited as a spare" in str(error)


def test_a_spare_fails_with_the_job_when_its_restart_budget_is_spent() -> None:
    error = error_of_a_spare_closed_on(statuses.CLOSED_RESTARTS_EXHAUSTED)
    assert isinstance(error, KubernetesRendezvousClosedError)
    assert not isinstance(error, KubernetesRendezvousGracefulExitError)
