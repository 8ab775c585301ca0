"""The round watcher: this node's view of the Rendezvous, kept fresh by one background watch.

The watch is filtered by the API server on ``status.roundKey``, so a node hears of round
changes (a seal, a stale round, a close) and not of the other nodes' joins. The join step
(:mod:`k8s_rendezvous.join`) and ``num_nodes_waiting()`` judge what it holds; nothing here
decides anything about the round.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from k8s_rendezvous import api, backoff
from k8s_rendezvous.errors import KubernetesRendezvousStateError, RendezvousNotFoundError
from k8s_rendezvous.wire import codec, objects, views

log = logging.getLogger(__name__)

RECONNECT: Final = backoff.Backoff(base=0.1, cap=5.0)
"""How a failed watch is re-opened: at once the first time, at most 5 s apart, with full
jitter. Every node of a rendezvous loses its watch at the same moment when the API server
restarts; without jitter all of them (16,384 at the largest) would come back at the same
instants, each retry a herd. The node keeps answering from its last status meanwhile, and
torch's timeouts are the join loop's, not this."""


class RendezvousReplaced(Exception):
    """The Rendezvous a node joined (its uid here) was deleted, perhaps made anew: its
    rounds are gone with it, and the node's request too."""

    def __init__(self, uid: str) -> None:
        super().__init__(uid)
        self.uid = uid


class RoundWatcher:
    """Keeps the latest Rendezvous status, as this node reads it, fresh from a background watch.

    The watch asks the API server only for versions whose ``status.roundKey`` differs
    from the key it was armed with, so the operator's bookkeeping within a round never
    reaches this pod. A round key never comes back once left (rounds only go forward), so
    a stream armed with an older key goes on through later round changes: a round costs
    no request, and no new connection (a watch left early cannot give its connection
    back). It re-arms with the current key only when a change that keeps a later key gets
    through (the filter is stale), at a stream's end, or when the object stops matching
    (DELETED: a key back at the filter's, or the object gone; a read tells which, and a
    Rendezvous deleted and made anew is followed under its new uid). The first watch, from no
    version, has no filter: the bookkeeping of the round it began in reaches it (the
    forming round, while the nodes join, when a re-arm would cost every node a request).

    A large rendezvous (``status.slices`` > 0) is published in RendezvousSlices: once the
    Rendezvous says so, the watch moves, for good, to this node's slice, which carries the
    same round with only its own share of the members (and a copy of the spec).
    """

    def __init__(
        self,
        client: api.RendezvousReader,
        node: str,
        *,
        reconnect: backoff.Backoff = RECONNECT,
    ) -> None:
        self._client = client
        self._node = node
        self._reconnects = backoff.Retries(reconnect)
        self._changed = threading.Condition()
        self._object: Mapping[str, Any] | None = None
        self._decode_error: codec.DecodeError | None = None
        self._raw_round_key: str | None = None
        self._version = -1
        self._version_text: str | None = None
        """The resourceVersion of what we hold, to watch from; None: the current state."""
        self._offered = 0
        self._uid: str | None = None
        """The uid of the Rendezvous held: a new one means it was deleted and made anew."""
        self._gone = False
        """The Rendezvous held was deleted, and none of its name exists now."""
        self._slice: str | None = None
        """The RendezvousSlice watched instead of the Rendezvous, once it says it has some."""
        self._recent: collections.deque[tuple[int, views.NodeView]] = collections.deque(maxlen=8)
        """The latest statuses, numbered in the order they arrived (the last is the current
        one), for wait() to judge. A few are enough: a join sees two or three round changes
        at most before it looks."""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"k8s-rendezvous-watch-{self._client.name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    @property
    def status(self) -> views.NodeView | None:
        with self._changed:
            return self._recent[-1][1] if self._recent else None

    @property
    def latest(self) -> Mapping[str, Any] | None:
        """The newest Rendezvous (or slice of it) seen: its spec is as fresh as the last
        round change."""
        with self._changed:
            return self._object

    @property
    def uid(self) -> str | None:
        """The uid of the Rendezvous held, ``None`` if it was deleted and not made anew."""
        with self._changed:
            return None if self._gone else self._uid

    def offer(self, obj: Mapping[str, Any]) -> None:
        """Take ``obj`` if it is newer than what we hold (watch events, reads)."""
        version = objects.resource_version(obj)
        with self._changed:
            if version <= self._version:
                return
            try:
                uid: str | None = objects.rendezvous_uid(obj)
            except codec.DecodeError:
                uid = self._uid  # a slice naming no Rendezvous: the status says why
            if uid != self._uid:
                # Made anew (or the first): its rounds start afresh, its slices too.
                self._uid, self._gone = uid, False
                if self._slice is not None and obj.get("kind") != objects.SLICE_KIND:
                    self._slice = None
            self._version = version
            self._object = obj
            self._version_text = str((obj.get("metadata") or {}).get("resourceVersion"))
            self._raw_round_key = _raw_round_key(obj)
            try:
                status = views.NodeView.from_dict(obj.get("status"), self._node)
                self._decode_error = None
                self._offered += 1
                self._recent.append((self._offered, status))
                if status.slices and self._slice is None and status.slices <= _slices_allowed(obj):
                    index = objects.slice_index(self._node, status.slices)
                    self._slice = objects.slice_name(self._client.name, index)
                    # The slice is another object: its versions are not comparable with
                    # the Rendezvous' (it may have been written last before), start afresh.
                    self._version, self._version_text, self._raw_round_key = -1, None, None
            except codec.DecodeError as error:
                self._decode_error = error
            self._changed.notify_all()

    def mark(self) -> int:
        """This point in the statuses' arrival, for ``wait(since=...)``."""
        with self._changed:
            return self._offered

    def wait_for_object(self, deadline: float) -> Mapping[str, Any] | None:
        """The first object the watch delivers, or ``None`` by the monotonic ``deadline``."""
        with self._changed:
            while self._object is None and (remaining := deadline - time.monotonic()) > 0:
                self._changed.wait(remaining)
            return self._object

    def wait_for_other(self, uid: str, deadline: float) -> Mapping[str, Any] | None:
        """The Rendezvous once it is one other than ``uid`` (made anew), or ``None`` by the
        monotonic ``deadline``."""
        with self._changed:
            while self._gone or self._uid == uid:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._object

    def wait(
        self,
        done: Callable[[views.NodeView], bool],
        deadline: float | Callable[[], float],
        since: int | None = None,
        uid: str | None = None,
    ) -> views.NodeView | None:
        """The first status for which ``done(status)``, or ``None`` at the monotonic
        ``deadline`` (a callable is asked again after every status: a spare's deadline
        moves with the round, and may be ``math.inf``). Statuses are judged in the order
        they arrived: the latest at ``since`` (a :meth:`mark`; default: now) and each after
        it. So the answer does not depend on how far the watch has read ahead of the
        caller, e.g. a node thawed with several rounds waiting in its socket gets the
        first that admitted it.

        Raises :class:`RendezvousReplaced` once the Rendezvous is no longer the one of
        ``uid`` (deleted, perhaps made anew): its statuses cannot answer for that one's."""
        with self._changed:
            judged = (self._offered if since is None else since) - 1
            while True:
                if uid is not None and (self._gone or self._uid != uid):
                    raise RendezvousReplaced(uid)
                for number, status in self._recent:
                    if number > judged:
                        judged = number
                        if done(status):
                            return status
                if self._decode_error is not None:
                    raise KubernetesRendezvousStateError(
                        f"{self._client.reference} has a status this node cannot read: "
                        f"{self._decode_error}"
                    )
                remaining = (deadline() if callable(deadline) else deadline) - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(None if math.isinf(remaining) else remaining)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                with self._changed:
                    first_key, version = self._raw_round_key, self._version_text
                    watched = self._slice
                key = first_key
                # From a known version the watch misses nothing after it; from none (the
                # start, or lost track) it begins with the current object: never a LIST.
                for kind, obj in self._client.watch_unless(
                    first_key, version, timeout_seconds=60, slice_name=watched
                ):
                    if self._stopped.is_set():
                        return
                    if kind in ("ADDED", "MODIFIED"):
                        self.offer(obj)
                        if self._slice != watched:
                            break  # the Rendezvous is sliced: watch this node's slice
                        previous_key, key = key, _raw_round_key(obj)
                        if kind == "ADDED" and version is None:
                            # The current object, first event of a watch from no version:
                            # the same stream goes on with its changes (one request, not two).
                            first_key = key
                        elif key == previous_key and key != first_key:
                            break  # bookkeeping got through a stale filter: re-arm it
                    elif kind == "BOOKMARK":
                        self._bookmark(obj)
                    elif kind == "DELETED":
                        self._after_deleted()
                        break
                self._reconnects.reset()
            except Exception as error:  # keep serving the last status; the agent polls us
                if self._stopped.is_set():
                    return
                self._lose_track()
                log.warning("watching %s failed, retrying: %s", self._client.reference, error)
                self._stopped.wait(self._reconnects.next_delay())

    def _bookmark(self, obj: Mapping[str, Any]) -> None:
        """Nothing of ours changed up to this version: resume from it next time."""
        with self._changed:
            if objects.resource_version(obj) > self._version:
                self._version_text = str((obj.get("metadata") or {}).get("resourceVersion"))

    def _lose_track(self) -> None:
        with self._changed:
            self._version_text = None

    def _after_deleted(self) -> None:
        """The watched object stopped matching: its key came back to the filter's (the
        API server sends the object as it was), or it, or the Rendezvous of the slice, is
        gone. One read tells which, and is where the next watch starts from."""
        self._lose_track()
        try:
            current = self._client.get()
        except RendezvousNotFoundError:
            with self._changed:
                if not self._gone:
                    log.warning("%s was deleted", self._client.reference)
                self._gone = True
                # Watch for one made anew, under any round key, from its creation.
                self._raw_round_key, self._slice = None, None
                self._changed.notify_all()
            return
        self.offer(current)


def _slices_allowed(obj: Mapping[str, Any]) -> int:
    """The most slices ``obj``'s spec can need (the operator refuses a status with more,
    and so no node follows it to slices that are never made)."""
    max_nodes = (obj.get("spec") or {}).get("maxNodes")
    return objects.slices_needed(max_nodes) if type(max_nodes) is int else objects.MAX_SLICES


def _raw_round_key(obj: Mapping[str, Any]) -> str:
    return str((obj.get("status") or {}).get("roundKey") or "")
