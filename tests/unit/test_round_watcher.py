"""The round watcher's requests: one watch from the current state, re-armed (with the round
key as its filter) only when a later round's bookkeeping gets through; a failed watch is
re-opened under the jittered backoff, counted anew after a stream that ended well."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from k8s_rendezvous import backoff, watch
from k8s_rendezvous.wire import leases, objects, records, statuses


def rendezvous(version: int, round_key: str | None) -> dict[str, Any]:
    return {
        "metadata": {"name": "r", "uid": "u-1", "resourceVersion": str(version)},
        "spec": {},
        "status": {"roundKey": round_key} if round_key else {},
    }


class ScriptedWatches:
    """Stands in for the API server's watches, as the watcher reads them
    (:class:`k8s_rendezvous.api.RendezvousReader`): each call plays the next script."""

    def __init__(self, *scripts: list[tuple[str, dict[str, Any]]] | Exception) -> None:
        self.name = "r"
        self.reference = "Rendezvous ns/r"
        self.calls: list[tuple[str | None, str | None]] = []
        self.watched: list[str | None] = []
        """The slice each call watched (``None``: the Rendezvous)."""
        self._scripts = list(scripts)
        self.exhausted = threading.Event()
        self.released = threading.Event()

    def get(self, budget_seconds: float | None = None) -> Mapping[str, Any]:
        raise AssertionError("no script deletes the Rendezvous: nothing to read")

    def watch_unless(
        self,
        round_key: str | None,
        resource_version: str | None,
        timeout_seconds: int,
        slice_name: str | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.calls.append((round_key, resource_version))
        self.watched.append(slice_name)
        if not self._scripts:
            self.exhausted.set()
            self.released.wait(timeout_seconds)  # an idle watch, until the test ends
            return
        script = self._scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        yield from script


def watch_until_idle(client: ScriptedWatches, **options: Any) -> watch.RoundWatcher:
    """A watcher run through every script, then stopped."""
    watcher = watch.RoundWatcher(client, "n-0", **options)
    watcher.start()
    try:
        assert client.exhausted.wait(10)
    finally:
        watcher.stop()
        client.released.set()
    return watcher


def test_the_first_watch_goes_on_through_its_rounds_bookkeeping_and_later_rounds() -> None:
    client = ScriptedWatches(
        [
            ("ADDED", rendezvous(5, "0-Forming")),
            ("MODIFIED", rendezvous(6, "0-Forming")),  # the first join's formingSince
            ("MODIFIED", rendezvous(8, "1-Sealed")),
            ("MODIFIED", rendezvous(9, "1-Reforming")),
            ("MODIFIED", rendezvous(10, "1-Reforming")),  # bookkeeping of a later round
            ("MODIFIED", rendezvous(12, "2-Sealed")),  # not read: the stream was left
        ],
    )
    watcher = watch_until_idle(client)
    # One request from no version for the object and two rounds; re-armed, with the round
    # key as the server-side filter, only when a later round's bookkeeping got through.
    assert client.calls == [(None, None), ("1-Reforming", "10")]
    latest = watcher.latest
    assert latest is not None and latest["metadata"]["resourceVersion"] == "10"


def test_a_filtered_watch_goes_on_through_round_changes() -> None:
    client = ScriptedWatches(
        [("ADDED", rendezvous(5, "1-Sealed")), ("MODIFIED", rendezvous(7, "1-Reforming"))],
        [
            ("MODIFIED", rendezvous(9, "2-Sealed")),
            ("MODIFIED", rendezvous(11, "2-Reforming")),
            ("MODIFIED", rendezvous(12, "3-Sealed")),
        ],
    )
    watcher = watch_until_idle(client)
    # Filtered on 1-Reforming, the second stream passed every later round: no re-arm
    # until it ended.
    assert client.calls == [(None, None), ("1-Reforming", "7"), ("3-Sealed", "12")]
    latest = watcher.latest
    assert latest is not None and latest["metadata"]["resourceVersion"] == "12"


def test_a_change_that_keeps_the_round_key_re_arms_a_stale_filter() -> None:
    client = ScriptedWatches(
        [("ADDED", rendezvous(5, "1-Sealed")), ("MODIFIED", rendezvous(7, "1-Reforming"))],
        [
            ("MODIFIED", rendezvous(9, "2-Sealed")),
            ("MODIFIED", rendezvous(10, "2-Sealed")),  # bookkeeping within round 2
            ("MODIFIED", rendezvous(12, "2-Reforming")),  # not read: the stream was left
        ],
    )
    watcher = watch_until_idle(client)
    assert client.calls == [(None, None), ("1-Reforming", "7"), ("2-Sealed", "10")]
    latest = watcher.latest
    assert latest is not None and latest["metadata"]["resourceVersion"] == "10"


def test_a_sliced_rendezvous_is_watched_through_the_nodes_own_slice() -> None:
    slices = 3
    members = tuple(records.Member(f"n-{i}", f"i-{i}", 1, f"10.0.0.{i}") for i in range(8))
    sealed = statuses.RendezvousStatus(
        statuses.RoundState.SEALED, 1, members, records.Master("10.0.0.0", 29500), slices=slices
    )
    index = objects.slice_index("n-0", slices)
    own = objects.slice_name("r", index)
    forming = {"kind": objects.KIND, **rendezvous(7, None)}
    forming["status"] = statuses.RendezvousStatus(slices=slices).to_dict()
    piece = {
        "kind": objects.SLICE_KIND,
        # Written before the Rendezvous' last bookkeeping: an older version, still taken.
        "metadata": {
            "name": own,
            "resourceVersion": "4",
            "ownerReferences": [{"kind": objects.KIND, "name": "r", "uid": "u-1"}],
        },
        "spec": {},
        "status": {k: v for k, v in sealed.slice_fields()[index].items() if v is not None},
    }
    client = ScriptedWatches(
        [("ADDED", forming), ("MODIFIED", {"kind": objects.KIND, **rendezvous(8, "1-Sealed")})],
        [("ADDED", piece)],
    )
    watcher = watch_until_idle(client)
    # The Rendezvous said "sliced": the stream was left at once, for the node's own slice,
    # from its current state; the slice's stream then ran to its end.
    assert client.watched == [None, own, own]
    assert client.calls[:2] == [(None, None), (None, None)]
    status = watcher.status
    assert status is not None
    assert (status.round_key, status.world_size) == ("1-Sealed", 8)
    assert status.rank_of(leases.NodeEntry("i-0", 1, "10.0.0.0", 1)) == 0
    latest = watcher.latest
    assert latest is not None and objects.rendezvous_uid(latest) == "u-1"


def test_wait_for_object_times_out_while_the_rendezvous_is_missing() -> None:
    client = ScriptedWatches()
    watcher = watch.RoundWatcher(client, "n-0")
    watcher.start()
    try:
        started = time.monotonic()
        assert watcher.wait_for_object(started + 0.2) is None
        assert time.monotonic() - started >= 0.2
    finally:
        watcher.stop()
        client.released.set()


def sealed(version: int, round_number: int) -> dict[str, Any]:
    obj = rendezvous(version, None)
    member = records.Member(node="n-0", instance="i-1", attempt=1, addr="10.0.0.7")
    obj["status"] = statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=round_number,
        members=(member,),
        master=records.Master("10.0.0.7", 29500),
    ).operator_fields()
    return obj


def test_wait_judges_statuses_in_the_order_they_arrived() -> None:
    watcher = watch.RoundWatcher(ScriptedWatches(), "n-0")
    since = watcher.mark()
    # Two rounds arrive before the waiter looks (a node thawed with both in its socket).
    watcher.offer(sealed(5, 1))
    watcher.offer(sealed(7, 2))
    first = watcher.wait(lambda s: s.state is statuses.RoundState.SEALED, time.monotonic(), since)
    assert first is not None and first.round == 1
    latest = watcher.wait(lambda s: s.state is statuses.RoundState.SEALED, time.monotonic())
    assert latest is not None and latest.round == 2


@dataclasses.dataclass(frozen=True)
class RecordedBackoff(backoff.Backoff):
    attempts: list[int] = dataclasses.field(default_factory=list)

    def delay(self, attempt: int, draw: Callable[[], float] = lambda: 0.0) -> float:
        self.attempts.append(attempt)
        return super().delay(attempt, draw)


def test_a_failed_watch_is_reopened_under_the_jittered_backoff_counted_anew_after_a_stream() -> (
    None
):
    """Each failure in a row waits under a higher ceiling (the policy's full jitter spreads
    the nodes that failed together); a stream that ended well starts the count over."""
    reconnect = RecordedBackoff(base=0.001, cap=0.004)
    client = ScriptedWatches(
        ConnectionError("API server restarting"),
        ConnectionError("API server restarting"),
        ConnectionError("API server restarting"),
        [("ADDED", rendezvous(5, "0-Forming"))],
        ConnectionError("API server restarting"),
    )
    watcher = watch_until_idle(client, reconnect=reconnect)
    assert reconnect.attempts == [0, 1, 2, 0]
    assert len(client.calls) == 6, "five scripts, then the idle watch"
    assert watcher.latest is not None, "what the one stream gave is kept"
