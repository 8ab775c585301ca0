"""The round watcher against the real API server, the operator's status writes made by hand.

Aspects: a stream armed with an older round key goes on through later rounds (a round
costs no watch request); bookkeeping that gets through such a stale filter re-arms it; a
status set back to the filter's key (a hand edit: the operator's rounds only go forward)
still reaches the watcher, because the API server ends the object's match with DELETED;
a resourceVersion too old to resume from is raised as 410, for the watcher to start afresh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from k8s_rendezvous import kube, watch
from k8s_rendezvous.wire import objects, records, statuses, views

MERGE = "application/merge-patch+json"
NAME = "train"


class RecordingClient(kube.RendezvousClient):
    """The real client, recording the (filter, resourceVersion) of each watch it opens."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        super().__init__(api, namespace, NAME, retry_seconds=5)
        self.calls: list[tuple[str | None, str | None]] = []
        self._opened = threading.Condition()

    def watch_unless(
        self,
        round_key: str | None,
        resource_version: str | None,
        timeout_seconds: int,
        slice_name: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        with self._opened:
            self.calls.append((round_key, resource_version))
            self._opened.notify_all()
        yield from super().watch_unless(round_key, resource_version, timeout_seconds, slice_name)

    def wait_for_calls(self, count: int) -> list[tuple[str | None, str | None]]:
        with self._opened:
            assert self._opened.wait_for(lambda: len(self.calls) >= count, 20), self.calls
            return list(self.calls)


def round_status(
    round_state: statuses.RoundState, round_number: int, node: str = "worker-0", generation: int = 1
) -> dict[str, Any]:
    member = records.Member(node=node, instance="i-1", attempt=round_number, addr="10.0.0.7")
    return statuses.RendezvousStatus(
        state=round_state,
        round=round_number,
        members=(member,),
        master=records.Master("10.0.0.7", 29500),
        observed_generation=generation,
    ).operator_fields()


def test_a_stream_armed_with_an_older_round_key_goes_on_through_later_rounds(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    custom.create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        workers_namespace,
        objects.PLURAL,
        {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": NAME},
            "spec": {"minNodes": 1, "maxNodes": 2, "runId": NAME},
        },
    )

    def write(fields: dict[str, Any]) -> str:
        written = custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            workers_namespace,
            objects.PLURAL,
            NAME,
            {"status": fields},
            _content_type=MERGE,
        )
        return str(written["metadata"]["resourceVersion"])

    sealed, reforming = statuses.RoundState.SEALED, statuses.RoundState.REFORMING
    write(round_status(sealed, 1))
    client = RecordingClient(admin_api, workers_namespace)
    watcher = watch.RoundWatcher(client, "worker-0")
    watcher.start()
    try:

        def holds(key: str, node: str = "worker-0") -> views.NodeView:
            status = watcher.wait(
                lambda s: s.round_key == key and s.member_nodes[0] == node,
                time.monotonic() + 20,
            )
            assert status is not None, (key, node, watcher.status)
            return status

        holds("1-Sealed")
        write(round_status(reforming, 1))
        write(round_status(sealed, 2))
        first_bookkeeping = write(round_status(sealed, 2, generation=2))
        # The first watch, unfiltered, went on through two round changes and was left only
        # at bookkeeping within a later round.
        assert client.wait_for_calls(2) == [(None, None), ("2-Sealed", first_bookkeeping)]

        for round_state, round_number in ((reforming, 2), (sealed, 3)):
            write(round_status(round_state, round_number))
        bookkeeping = write(round_status(sealed, 3, generation=2))
        holds("3-Sealed")
        # Filtered on 2-Sealed, the second watch passed two more round changes.
        assert client.wait_for_calls(3)[2] == ("3-Sealed", bookkeeping)

        # Back to the filter's key by hand: the stream filtered on 3-Sealed hears of it
        # as DELETED, reads the object afresh (it may be gone), and watches on from there.
        write(round_status(reforming, 3))
        moved = write(round_status(sealed, 3, node="worker-1"))
        holds("3-Sealed", node="worker-1")
        assert client.wait_for_calls(4)[3] == ("3-Sealed", moved)
    finally:
        watcher.stop()


def test_a_watch_from_a_version_too_old_raises_410_gone(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> None:
    client = kube.RendezvousClient(admin_api, workers_namespace, NAME, retry_seconds=5)
    # The API server answers 200 and sends the refusal as the stream's ERROR event.
    with pytest.raises(RendezvousConnectionError, match="answered 410") as error:
        next(client.watch_unless(None, "1", timeout_seconds=10))
    assert "too old resource version" in str(error.value)
