"""``KubernetesRendezvousHandler``: torchrun's ``--rdzv-backend=kubernetes``.

A node joins by writing its entry into its own Lease and waits, on a watch of the
Rendezvous filtered by the API server, for the operator to seal a round that includes it.
Each join offers a fresh listening socket and reports its port; the round's rank 0 serves
the round's TCPStore on it (the agents' keys prefixed per round) for its workers too, who
expect a new store every round. MASTER_ADDR and MASTER_PORT come from the resource, per
round, never from a cache.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Final

import torch

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.agent.server.api import ElasticAgent, WorkerState
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from k8s_rendezvous import BACKEND_NAME, kube, reforming, rest, state
from k8s_rendezvous.errors import (
    KubernetesRendezvousClosedError,
    KubernetesRendezvousConnectionError,
    KubernetesRendezvousStateError,
    KubernetesRendezvousTimeoutError,
    NodeNotAPodError,
    RendezvousNotFoundError,
)

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_SECONDS: Final = 60
_SPEC_TIMEOUT = "seconds; used if this node creates the Rendezvous, else its spec wins"
CONFIG_KEYS: Final = {
    "read_timeout": "seconds to retry the API server and to wait on the round's store (60)",
    "join_timeout": _SPEC_TIMEOUT,
    "last_call_timeout": _SPEC_TIMEOUT,
    "close_timeout": _SPEC_TIMEOUT,
    "heartbeat_timeout": _SPEC_TIMEOUT,
    "in_place": "1 to keep the workers running through a change of the world when they "
    "re-form in place through k8s_rendezvous.in_place (torch >= 2.14); 0, the default, "
    "restarts them as torch does",
}
_IGNORED_CONFIG_KEYS: Final = {"timeout"}  # torchrun adds it for every backend
C10D_KEYS_NOT_USED: Final = {
    "is_host": "no node hosts the rendezvous: the operator keeps it in the Rendezvous, and "
    "the round's rank 0 serves the workers' store",
    "store_type": "the rendezvous is no store here; the round's store is always rank 0's TCPStore",
    "use_libuv": "the round's store server is chosen by torch version (libuv where it can "
    "serve a socket it is handed)",
    "keep_alive_interval": "liveness is the pod's Lease, renewed three times per "
    "heartbeat_timeout (spec.heartbeatTimeoutSeconds), and Kubernetes' own pod status",
    "keep_alive_max_attempt": "liveness is the pod's Lease, renewed three times per "
    "heartbeat_timeout (spec.heartbeatTimeoutSeconds), and Kubernetes' own pod status",
    "cas_backoff_max_seconds": "nodes never compare-and-set a shared state: each writes its "
    "own Lease, and only the operator writes the Rendezvous",
}
"""Keys torch's c10d backend accepts: taken, so that switching only ``--rdzv-backend``
works, and each logged once as having no use here, with the reason."""
_LOOPBACK: Final = "127.0.0.1"
_FIRST_EVENT_SECONDS: Final = 2.0
"""How long the first join waits for the watch to deliver the Rendezvous before reading it
(the watch says nothing while the Rendezvous is missing, e.g. until a pod creates it)."""
_REMADE_WITHIN_SECONDS: Final = 10.0
"""How long a node whose Rendezvous was deleted while it waited gives the operator (for an
annotated Job's) or its own pod's creator role to make it anew, before it gives up."""
_NODE_CHECK_SECONDS: Final = 5.0
"""How long a node waits unadmitted before it checks, once, that it is the pod it names:
a node no Pod stands for is never admitted, and would otherwise wait out its join
timeout. Joins admitted sooner (the usual) pay no request for it."""
_AGENT_FRAMES: Final = 4
"""How far up its callers ``shutdown()`` and ``next_rendezvous()`` look for torch's agent
(it is the caller's caller at most: ``launch_agent``, or the agent's ``_shutdown`` from
its ``run``; the agent's ``_rendezvous``, under its profiling wrapper)."""
_STALE_ROUND_POLL_SECONDS: Final = 0.05
"""How often a node still connecting to rank 0's store looks whether the round went stale."""
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LIBUV_SERVES_A_GIVEN_SOCKET: Final = torch.__version__ >= "2.8"
"""torch's libuv store server listens on a socket it is handed only since 2.8 (pytorch
#150215); before, only its classic server does. (``torch.__version__`` is a TorchVersion:
it compares as a version, so 2.13 is above 2.8.)"""


class RendezvousReplaced(Exception):
    """The Rendezvous a node joined (its uid here) was deleted, perhaps made anew: its
    rounds are gone with it, and the node's request too."""

    def __init__(self, uid: str) -> None:
        super().__init__(uid)
        self.uid = uid


def parse_endpoint(endpoint: str, default_namespace: str | None) -> tuple[str, str]:
    """``NAME`` or ``NAMESPACE/NAME`` to ``(namespace, name)``."""
    namespace, _, name = endpoint.strip().rpartition("/")
    namespace = namespace or default_namespace or ""
    if not _NAME.match(name) or not _NAME.match(namespace):
        raise ValueError(
            f"--rdzv-endpoint={endpoint!r} does not name a Rendezvous: use NAME or "
            "NAMESPACE/NAME (lowercase DNS names; the namespace defaults to the pod's own"
            + ("" if default_namespace else ", which is unknown here: set POD_NAMESPACE")
            + ")."
        )
    return namespace, name


def _own_pod_name(client: kube.RendezvousClient) -> str:
    """This node's name when ``POD_NAME`` is not set: the pod its bound token was issued
    for (one SelfSubjectReview at start), else the hostname. Not the hostname first: the
    pods of an Indexed Job with a subdomain (JobSet's, Kubeflow Trainer's) are named
    ``<job>-<index>-<suffix>`` but have ``<job>-<index>`` as their hostname."""
    try:
        _, pod = client.identity()
    except RendezvousError as error:
        log.warning(
            "POD_NAME is not set and this node could not ask whose token it holds (%s); "
            "taking the hostname %s as its pod's name",
            error,
            socket.gethostname(),
        )
        pod = None
    return pod or socket.gethostname()


def _route_address(towards: str | None) -> str:
    """The local address that routes to the API server: no DNS involved."""
    with socket.socket(
        socket.AF_INET6 if towards and ":" in towards else socket.AF_INET, socket.SOCK_DGRAM
    ) as probe:
        probe.connect((towards or "10.255.255.255", 443))
        return str(probe.getsockname()[0])


def _connect_to_store(
    master: state.Master, timeout: float, round_is_stale: Callable[[], bool]
) -> TCPStore | None:
    """A client of rank 0's store; ``None`` as soon as ``round_is_stale()`` while still
    connecting; or ``RuntimeError`` by ``timeout`` (and a second, to let torch's own error
    through when connecting fails).

    A round goes stale when the operator learns its rank 0 is gone (pod deleted, evicted,
    node lost). Without this check a connection refused, or accepted by a kernel whose
    process will never serve, would end only at ``timeout`` and fail the agent with a
    connection error, where joining the next round takes a fraction of a second.

    torch bounds connecting by ``timeout`` but then waits for the server's first answer
    without a bound: against a rank 0 frozen after the seal (SIGSTOP, a stalled host),
    whose kernel still completes the TCP handshake, the client waits until it thaws
    (torch 2.13: 20 s against a 3 s timeout when thawed after 20 s; never, if it is not).
    So the client is built in a thread this node gives up on; if the call ever returns,
    the client it made is dropped with the thread.
    """
    made: list[TCPStore | RuntimeError] = []

    def connect() -> None:
        try:
            made.append(
                TCPStore(
                    host_name=master.addr,
                    port=master.port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=timeout),
                )
            )
        except RuntimeError as error:
            made.append(error)

    connecting = threading.Thread(target=connect, name="k8s-rendezvous-round-store", daemon=True)
    connecting.start()
    deadline = time.monotonic() + timeout + 1
    while not made and (remaining := deadline - time.monotonic()) > 0:
        # Returns the moment the client is made: the poll only bounds noticing staleness.
        connecting.join(min(remaining, _STALE_ROUND_POLL_SECONDS))
        if not made and round_is_stale():
            return None
    if not made:
        raise RuntimeError("it accepted the connection but did not answer")
    if isinstance(made[0], RuntimeError):
        raise made[0]
    return made[0]


def _calling_agent(frame: FrameType | None) -> ElasticAgent | None:
    """torch's elastic agent among the callers from ``frame`` up (it is the caller's
    caller at most: ``launch_agent`` holds it as ``agent``, its own methods as ``self``)."""
    for _ in range(_AGENT_FRAMES):
        if frame is None:
            return None
        for name in ("agent", "self"):
            candidate = frame.f_locals.get(name)
            if isinstance(candidate, ElasticAgent):
                return candidate
        frame = frame.f_back
    return None


def _called_by_a_succeeded_agent() -> bool:
    """Whether the caller is torch's elastic agent ending with its workers succeeded:
    ``launch_agent`` (which holds it as ``agent``) calls ``shutdown()`` after the agent
    ran, whether its workers succeeded or failed, and before torch 2.8 so does the agent's
    own ``_shutdown``. Only the worker group's state tells the two apart."""
    agent = _calling_agent(sys._getframe(1).f_back)  # shutdown()'s caller
    if agent is None:
        return False
    try:
        return agent.get_worker_group().state is WorkerState.SUCCEEDED
    except Exception:  # an agent of its own kind, without a worker group
        return False


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

    def __init__(self, client: kube.RendezvousClient, node: str) -> None:
        self._client = client
        self._node = node
        self._changed = threading.Condition()
        self._object: Mapping[str, Any] | None = None
        self._decode_error: state.DecodeError | None = None
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
        self._recent: collections.deque[tuple[int, state.NodeView]] = collections.deque(maxlen=8)
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
    def status(self) -> state.NodeView | None:
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
        version = state.resource_version(obj)
        with self._changed:
            if version <= self._version:
                return
            try:
                uid: str | None = state.rendezvous_uid(obj)
            except state.DecodeError:
                uid = self._uid  # a slice naming no Rendezvous: the status says why
            if uid != self._uid:
                # Made anew (or the first): its rounds start afresh, its slices too.
                self._uid, self._gone = uid, False
                if self._slice is not None and obj.get("kind") != state.SLICE_KIND:
                    self._slice = None
            self._version = version
            self._object = obj
            self._version_text = str((obj.get("metadata") or {}).get("resourceVersion"))
            self._raw_round_key = _raw_round_key(obj)
            try:
                status = state.NodeView.from_dict(obj.get("status"), self._node)
                self._decode_error = None
                self._offered += 1
                self._recent.append((self._offered, status))
                if status.slices and self._slice is None and status.slices <= _slices_allowed(obj):
                    index = state.slice_index(self._node, status.slices)
                    self._slice = state.slice_name(self._client.name, index)
                    # The slice is another object: its versions are not comparable with
                    # the Rendezvous' (it may have been written last before), start afresh.
                    self._version, self._version_text, self._raw_round_key = -1, None, None
            except state.DecodeError as error:
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
        done: Callable[[state.NodeView], bool],
        deadline: float,
        since: int | None = None,
        uid: str | None = None,
    ) -> state.NodeView | None:
        """The first status for which ``done(status)``, or ``None`` at the monotonic
        ``deadline``. Statuses are judged in the order they arrived: the latest at
        ``since`` (a :meth:`mark`; default: now) and each after it. So the answer does not
        depend on how far the watch has read ahead of the caller, e.g. a node thawed with
        several rounds waiting in its socket gets the first that admitted it.

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
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def _run(self) -> None:
        backoff = 0.1
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
                backoff = 0.1
            except Exception as error:  # keep serving the last status; the agent polls us
                if self._stopped.is_set():
                    return
                self._lose_track()
                log.warning("watching %s failed, retrying: %s", self._client.reference, error)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _bookmark(self, obj: Mapping[str, Any]) -> None:
        """Nothing of ours changed up to this version: resume from it next time."""
        with self._changed:
            if state.resource_version(obj) > self._version:
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
    return state.slices_needed(max_nodes) if type(max_nodes) is int else state.MAX_SLICES


def _raw_round_key(obj: Mapping[str, Any]) -> str:
    return str((obj.get("status") or {}).get("roundKey") or "")


class Heartbeat:
    """Renews this node's Lease from a background thread until stopped, like torch's
    keep-alive timer; failures are logged and retried on the next beat. The first beat
    comes one period after the join, which wrote the Lease itself."""

    def __init__(self, client: kube.RendezvousClient, node: str, instance: str) -> None:
        self._client = client
        self._node = node
        self._instance = instance
        self._period = 10.0
        self._timeout = state.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
        self._owner_uid = ""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, spec: state.RendezvousSpec, owner_uid: str) -> None:
        self._period = spec.heartbeat_interval_seconds
        self._timeout = spec.heartbeat_timeout_seconds
        self._owner_uid = owner_uid
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"k8s-rendezvous-heartbeat-{self._node}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._client.write_lease(self._node, self._instance, self._timeout, self._owner_uid)
            except RendezvousError as error:
                log.warning("node %s could not renew its heartbeat: %s", self._node, error)


def _listen_for_store() -> socket.socket:
    """A socket listening on every address, at a port the kernel picks, that a join offers
    as its store: the round's rank 0 serves the round's TCPStore on it (torch takes it
    over), the other members close it. The kernel completes their connects to rank 0 even
    before rank 0 serves, so none of them waits for it to be ready. A listening socket
    costs microseconds; a TCPStore server, made by every node for every join, cost about
    1 ms of CPU, a thread and a reverse DNS lookup, for a store one node of the round uses.
    """
    try:  # dual-stack, as torch's own server listens
        return _listening(socket.AF_INET6, "::")
    except OSError:  # this pod has no IPv6
        return _listening(socket.AF_INET, "0.0.0.0")


def _listening(family: socket.AddressFamily, address: str) -> socket.socket:
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((address, 0))
        # Every other member may connect before rank 0 serves; the kernel caps this at
        # net.core.somaxconn.
        listener.listen(65535)
    except OSError:
        listener.close()
        raise
    return listener


def _serve_store(listener: socket.socket, timeout: float) -> TCPStore:
    """The round's TCPStore, served by this node (its rank 0) on the socket it offered."""
    port = int(listener.getsockname()[1])
    # host_name is only where the server's own client connects: loopback always answers,
    # whether or not this node can reach the address it advertises to the others.
    return TCPStore(
        host_name=_LOOPBACK,
        port=port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),
        use_libuv=_LIBUV_SERVES_A_GIVEN_SOCKET,
    )


@dataclasses.dataclass
class _Joined:
    round: int
    rank: int
    uid: str
    """Of the Rendezvous the round belongs to."""


class KubernetesRendezvousHandler(RendezvousHandler):
    """A ``RendezvousHandler`` whose state lives in a ``Rendezvous`` resource.

    Args:
        client: Reads and writes the Rendezvous.
        run_id: torchrun's ``--rdzv-id``; must match the resource's ``spec.runId``.
        node: This node's name, the key of its entry (the pod name).
        addr: The address other nodes reach this node at (pod IP or ``--local-addr``).
        min_nodes: torchrun's ``--nnodes`` minimum, checked against the spec.
        max_nodes: torchrun's ``--nnodes`` maximum, checked against the spec.
        read_timeout: Seconds to retry the API server and to wait on the round's store.
        configured_timeouts: Timeouts given in ``--rdzv-conf``, compared with the spec.
        in_place: Re-form the node's round in place, keeping the workers, when they are
            on the in-place path (:mod:`k8s_rendezvous.reforming`).
    """

    def __init__(
        self,
        client: kube.RendezvousClient,
        *,
        run_id: str,
        node: str,
        addr: str,
        min_nodes: int,
        max_nodes: int,
        read_timeout: float = DEFAULT_READ_TIMEOUT_SECONDS,
        configured_timeouts: Mapping[str, int] | None = None,
        in_place: bool = False,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._node = node
        self._addr = addr
        self._nnodes = (min_nodes, max_nodes)
        self._read_timeout = read_timeout
        self._configured_timeouts = dict(configured_timeouts or {})
        self._instance = uuid.uuid4().hex[:16]
        self._attempt = 0
        self._joined: _Joined | None = None
        # Watching starts now, as torch's c10d handler connects to its store when built: the
        # first join finds the Rendezvous already read.
        self._watcher = RoundWatcher(client, node)
        self._watcher.start()
        threading.Thread(
            target=self._open_connection_ahead, name="k8s-rendezvous-connect", daemon=True
        ).start()
        self._heartbeat = Heartbeat(client, node, self._instance)
        self._serving: TCPStore | None = None
        """The store of the round this node is rank 0 of."""
        self._retired: TCPStore | None = None
        """The previous one, kept one more round for agents still finishing with it."""
        self._entry_port = 0
        self._spec_checked = False
        self._node_checked = False
        self._closed_locally = False
        self._join_lock = threading.Lock()
        """Held by every join: next_rendezvous()'s, and one in place."""
        self._reformer = (
            reforming.Reformer(node, self._wait_for_change, self._rejoin_in_place, self._join_lock)
            if in_place
            else None
        )

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> KubernetesRendezvousHandler:
        """Build a handler from torchrun's parameters and the pod's environment."""
        unknown = (
            set(params.config) - set(CONFIG_KEYS) - _IGNORED_CONFIG_KEYS - set(C10D_KEYS_NOT_USED)
        )
        if unknown:
            valid = "; ".join(f"{key}: {meaning}" for key, meaning in CONFIG_KEYS.items())
            accepted = ", ".join(sorted(C10D_KEYS_NOT_USED))
            raise ValueError(
                f"unknown --rdzv-conf key(s) {', '.join(sorted(unknown))} for the kubernetes "
                f"rendezvous backend. Valid keys: {valid}. Also accepted, as torch's c10d "
                f"backend takes them, but not used here: {accepted}."
            )
        for key in sorted(set(params.config) & set(C10D_KEYS_NOT_USED)):
            log.info(
                "--rdzv-conf %s is not used by the kubernetes backend: %s",
                key,
                (C10D_KEYS_NOT_USED[key]),
            )
        namespace, name = parse_endpoint(params.endpoint, rest.own_namespace())
        in_place = bool(params.get_as_bool("in_place", False))
        read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_SECONDS)
        if read_timeout is None or read_timeout <= 0:
            raise ValueError("--rdzv-conf read_timeout must be a positive number of seconds")
        configured = {
            key: value
            for key in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
            if (value := params.get_as_int(key)) is not None
        }
        api_client = kube.load_api_client()
        host = api_client.configuration.host.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        addr = params.local_addr or os.environ.get("POD_IP") or _route_address(host)
        client = kube.RendezvousClient(api_client, namespace, name, retry_seconds=read_timeout)
        return cls(
            client,
            run_id=params.run_id,
            node=os.environ.get("POD_NAME") or _own_pod_name(client),
            addr=addr,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            read_timeout=read_timeout,
            configured_timeouts=configured,
            in_place=in_place,
        )

    # -- RendezvousHandler --------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        # torch's workers expect a new store every round (they write their keys unprefixed):
        # each join offers a fresh socket, served on only if this node becomes rank 0.
        try:
            offered = _listen_for_store()
        except OSError as error:
            raise KubernetesRendezvousConnectionError(
                f"node {self._node} could not open a port for its store to join "
                f"{self._client.reference}: {error}. Check the pod's open-file limit."
            ) from error
        with self._join_lock:
            try:
                joined = self._next_round(offered)
            finally:
                offered.close()  # a no-op once the round's store has taken it over
            status = joined.status
            assert status.master is not None
            store = joined.store
            if self._reformer is not None:
                agent = _calling_agent(sys._getframe(1))
                store = self._reformer.started(joined, agent)
            return RendezvousInfo(
                store,
                joined.rank,
                status.world_size,
                RendezvousStoreInfo(status.master.addr, status.master.port),
            )

    def _rejoin_in_place(self) -> reforming.Joined:
        """The next round, joined as next_rendezvous() joins one, for the in-place path
        (the caller holds the join lock)."""
        try:
            offered = _listen_for_store()
        except OSError as error:
            raise KubernetesRendezvousConnectionError(
                f"node {self._node} could not open a port for its store: {error}"
            ) from error
        try:
            return self._next_round(offered)
        finally:
            offered.close()

    def _wait_for_change(self, deadline: float) -> bool:
        """Whether the watched status shows, by the monotonic ``deadline``, a change the
        agent would restart its workers for (what makes num_nodes_waiting() positive)."""
        return self._watcher.wait(lambda status: self._waiting(status) > 0, deadline) is not None

    def _next_round(self, offered: socket.socket) -> reforming.Joined:
        self._attempt += 1
        self._entry_port = int(offered.getsockname()[1])
        entry = state.NodeEntry(self._instance, self._attempt, self._addr, self._entry_port)
        started = time.monotonic()
        obj = self._watcher.latest
        if obj is None:  # the first join, before the watch has delivered the Rendezvous
            obj = self._watcher.wait_for_object(time.monotonic() + _FIRST_EVENT_SECONDS)
            if obj is None:  # missing (or a slow server): read it, or make it
                obj = self._read_or_create()
                self._watcher.offer(obj)
        spec = self._check_spec(obj)
        owner_uid = self._owner_uid(obj)
        # The watch began before this write: the seal that admits this entry cannot be
        # missed.
        since = self._watcher.mark()
        self._client.write_lease(
            self._node, self._instance, spec.heartbeat_timeout_seconds, owner_uid, entry
        )
        self._heartbeat.start(spec, owner_uid)
        log.info("node %s joins %s (attempt %d)", self._node, self._client.reference, self._attempt)

        def decided(status: state.NodeView) -> bool:
            return (
                status.state is state.RoundState.CLOSED
                or status.rank_of(entry) is not None
                or status.left_behind_with(entry)
            )

        while True:
            deadline = started + spec.join_timeout_seconds
            try:
                status = self._wait(decided, deadline, since, owner_uid)
            except RendezvousReplaced as replaced:
                obj = self._made_anew(replaced.uid, deadline)
                spec, owner_uid = self._check_spec(obj), self._owner_uid(obj)
                self._heartbeat.start(spec, owner_uid)
            else:
                if status is None:
                    raise self._timed_out(spec)
                if status.state is state.RoundState.CLOSED:
                    raise self._closed_error(status)
                rank = status.rank_of(entry)
                if rank is None:
                    # Admitted to a round this watch never showed (it lost track, e.g.
                    # across an API server restart) and left behind when the next sealed
                    # without us: that request is spent, so ask again rather than wait out
                    # the join timeout.
                    log.warning(
                        "node %s was admitted to a round it never saw, and round %d of %s "
                        "sealed without it; joining again",
                        self._node,
                        status.round,
                        self._client.reference,
                    )
                else:
                    assert status.master is not None
                    log.info(
                        "node %s is rank %d of %d in round %d of %s (master %s, %.3f s)",
                        self._node,
                        rank,
                        status.world_size,
                        status.round,
                        self._client.reference,
                        status.master.endpoint,
                        time.monotonic() - started,
                    )
                    round_store = self._round_store(status, rank, offered)
                    if round_store is not None:
                        break
                    # Stale before rank 0 answered (most likely its pod is gone): this
                    # round is spent, and the next forms without waiting out read_timeout.
                    log.warning(
                        "node %s: round %d of %s went stale before its rank 0 (pod %s) "
                        "answered at %s; joining again",
                        self._node,
                        status.round,
                        self._client.reference,
                        status.rank_zero_node,
                        status.master.endpoint,
                    )
            self._attempt += 1
            entry = dataclasses.replace(entry, attempt=self._attempt)
            since = self._watcher.mark()
            self._client.write_lease(
                self._node, self._instance, spec.heartbeat_timeout_seconds, owner_uid, entry
            )
        assert status.master is not None
        self._joined = _Joined(status.round, rank, owner_uid)
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{status.round}", round_store)
        return reforming.Joined(status, rank, owner_uid, store)

    def _wait(
        self,
        decided: Callable[[state.NodeView], bool],
        deadline: float,
        since: int,
        uid: str,
    ) -> state.NodeView | None:
        """The watcher's wait, with the one check that this node is a pod once it has
        waited ``_NODE_CHECK_SECONDS`` unadmitted."""
        if not self._node_checked:
            soon = min(deadline, time.monotonic() + _NODE_CHECK_SECONDS)
            status = self._watcher.wait(decided, soon, since, uid)
            if status is not None or time.monotonic() >= deadline:
                return status
            self._node_checked = True
            if (problem := self._not_this_pod()) is not None:
                self._withdraw()
                raise NodeNotAPodError(problem)
        return self._watcher.wait(decided, deadline, since, uid)

    def _not_this_pod(self) -> str | None:
        """Why this node is not the pod it names, if it can tell."""
        namespace = self._client.namespace
        try:
            user, pod = self._client.identity()
            exists = None if pod is not None else self._client.pod_exists(self._node)
        except RendezvousError as error:
            log.warning("node %s could not check that it is a pod: %s", self._node, error)
            return None
        if pod is not None:
            if pod != self._node:
                return (
                    f"node {self._node} runs with the token of pod {pod}, so it is not the "
                    f"node it names: no round of {self._client.reference} can include it. "
                    "Set POD_NAME to the pod's own name (the downward API's "
                    "metadata.name), or leave it unset: the node then takes its pod's name "
                    "from its token."
                )
            return None  # a token bound to this very pod: it exists
        if exists is False:
            return (
                f"no Pod {self._node} exists in namespace {namespace}, and node "
                f"{self._node} runs as {user}, not as a pod: the operator admits only pods "
                f"of the Rendezvous' workload, so no round of {self._client.reference} can "
                "include it. Run torchrun in the workload's pods, with their service "
                "account token, and POD_NAME set to the pod's name."
            )
        if exists is None:
            log.warning(
                "node %s has waited %.0f s to join %s and runs as %s, not as a pod, which "
                "may not read pods: it cannot check that a Pod %s exists. The operator "
                "admits only pods of the Rendezvous' workload.",
                self._node,
                _NODE_CHECK_SECONDS,
                self._client.reference,
                user,
                self._node,
            )
        return None

    def _made_anew(self, uid: str, deadline: float) -> Mapping[str, Any]:
        """The Rendezvous that replaces the deleted one of ``uid``: made anew by the
        operator (an annotated Job's) or by this node (its creator role), else
        :class:`KubernetesRendezvousClosedError` within seconds."""
        log.warning(
            "node %s: %s was deleted while this node waited to join; waiting for it to be "
            "made anew",
            self._node,
            self._client.reference,
        )
        if self._watcher.uid is None:
            with contextlib.suppress(RendezvousNotFoundError):  # not ours to make
                self._watcher.offer(self._read_or_create())
        obj = self._watcher.wait_for_other(
            uid, min(deadline, time.monotonic() + _REMADE_WITHIN_SECONDS)
        )
        if obj is None:
            namespace, name = self._client.namespace, self._client.name
            raise KubernetesRendezvousClosedError(
                f"{self._client.reference} was deleted while node {self._node} waited to "
                f"join, and was not made anew within {_REMADE_WITHIN_SECONDS:.0f} s: no "
                "round can form. An annotated Job's Rendezvous is made anew by the operator "
                "while the Job runs (check it runs: kubectl get events -n "
                f"{namespace} --field-selector involvedObject.name={name}); any other is "
                "made by torchrun when its pod may create it (the creator role), or by "
                "hand."
            )
        return obj

    def _round_store(
        self, status: state.NodeView, rank: int, offered: socket.socket
    ) -> Store | None:
        """The round's store: served on the offered socket by rank 0, else reached at rank
        0's; ``None`` if the round went stale before rank 0 answered."""
        assert status.master is not None
        if rank == 0:
            try:
                served = _serve_store(offered, self._read_timeout)
            except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
                raise KubernetesRendezvousConnectionError(
                    f"node {self._node} is rank 0 of round {status.round} of "
                    f"{self._client.reference} but could not serve the round's store on port "
                    f"{self._entry_port}: {error}. The next next_rendezvous() joins a new round."
                ) from error
            self._retired, self._serving = self._serving, served
            return served
        try:
            client = _connect_to_store(
                status.master, self._read_timeout, lambda: self._is_stale(status.round)
            )
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
            raise KubernetesRendezvousConnectionError(
                f"node {self._node} is rank {rank} of round {status.round} of "
                f"{self._client.reference} but could not reach the round's store at "
                f"{status.master.endpoint} (rank 0, pod {status.rank_zero_node}) within "
                f"{self._read_timeout:.0f} s: {error}. Rank 0 has probably left, died or "
                "stalled since the round was sealed; the next next_rendezvous() joins a new "
                "round."
            ) from error
        if client is not None:
            self._retired, self._serving = self._serving, None
        return client

    def _is_stale(self, round_number: int) -> bool:
        status = self._watcher.status
        return status is not None and not (
            status.round == round_number and status.state is state.RoundState.SEALED
        )

    def num_nodes_waiting(self) -> int:
        """Answered from the watched status: no API call, never raises. On the in-place
        path, 0 while the change is re-formed in place."""
        status = self._watcher.status
        waiting = 0 if status is None else self._waiting(status)
        if self._reformer is None:
            return waiting
        if self._reformer.handles_changes():
            return 0
        # Given up (a worker may have, in a round that did not change): the agent must
        # restart the workers, and the node join anew.
        return max(1, waiting) if self._reformer.gave_up is not None else waiting

    def _waiting(self, status: state.NodeView) -> int:
        """What num_nodes_waiting() answers for ``status``, as torch's agent reads it."""
        joined = self._joined
        if joined is None or status.state is state.RoundState.CLOSED:
            return 0
        uid = self._watcher.uid
        if uid is None:
            return 0  # deleted: nothing to join, so the members train on
        if (
            uid == joined.uid
            and status.round == joined.round
            and status.state is state.RoundState.SEALED
        ):
            return status.nodes_waiting
        return max(1, status.nodes_waiting)

    def is_closed(self) -> bool:
        status = self._watcher.status
        if status is None:
            status = state.NodeView.from_dict(self._client.get().get("status"), self._node)
        return self._closed_locally or status.state is state.RoundState.CLOSED

    def set_closed(self) -> None:
        self._write_intent(state.NodeIntent.CLOSE)
        self._closed_locally = True

    def shutdown(self) -> bool:
        """This node leaves. If torch's agent calls it because its workers succeeded, the
        node finished: no further round forms (as torch's c10d closes at any agent's
        shutdown), and the other members finish their work undisturbed. Otherwise (a
        failed agent, or any other caller) it is lost to the round, and the others go on
        in a new one; the rendezvous closes once every member has left."""
        self._watcher.stop()
        self._heartbeat.stop()
        if self._reformer is not None:
            self._reformer.stop()
        finished = _called_by_a_succeeded_agent()
        try:
            if self._attempt > 0 and not self._closed_locally:
                self._write_intent(state.NodeIntent.FINISH if finished else state.NodeIntent.LEAVE)
            return True
        except RendezvousError as error:
            log.warning("node %s could not record leaving: %s", self._node, error)
            return False
        finally:
            self._serving = self._retired = None

    # -- internals ------------------------------------------------------------------------

    def _open_connection_ahead(self) -> None:
        # Once the watch holds its connection (its first object is here), or has given up
        # waiting for one: else the watch could take the idle connection this leaves.
        self._watcher.wait_for_object(time.monotonic() + _FIRST_EVENT_SECONDS)
        self._client.open_connection()

    def _write_intent(self, intent: state.NodeIntent) -> None:
        # The store port only matters to a Join; Leave and Close repeat the last one.
        entry = state.NodeEntry(
            self._instance, max(self._attempt, 1), self._addr, self._entry_port or 1, intent
        )
        obj = self._watcher.latest or self._client.get()
        spec = self._check_spec(obj)
        self._client.write_lease(
            self._node,
            self._instance,
            spec.heartbeat_timeout_seconds,
            self._owner_uid(obj),
            entry,
        )

    def _read_or_create(self) -> Mapping[str, Any]:
        try:
            return self._client.get()
        except RendezvousNotFoundError:
            if not self._create_rendezvous():
                raise
            return self._client.get()

    def _create_rendezvous(self) -> bool:
        """Make the missing Rendezvous from torchrun's parameters, to be owned by this
        pod's controller, so any workload (JobSet, PyTorchJob, StatefulSet) works by changing
        only the rendezvous backend. ``False`` if this service account may not."""
        conf = self._configured_timeouts
        spec = state.RendezvousSpec(
            min_nodes=self._nnodes[0],
            max_nodes=self._nnodes[1],
            run_id=self._run_id,
            join_timeout_seconds=conf.get("join_timeout", state.DEFAULT_JOIN_TIMEOUT_SECONDS),
            last_call_timeout_seconds=conf.get(
                "last_call_timeout", state.DEFAULT_LAST_CALL_TIMEOUT_SECONDS
            ),
            close_timeout_seconds=conf.get("close_timeout", state.DEFAULT_CLOSE_TIMEOUT_SECONDS),
            heartbeat_timeout_seconds=conf.get(
                "heartbeat_timeout", state.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
            ),
        )
        if not self._client.create(spec, self._node):
            return False
        log.info(
            "node %s created %s (%d:%d nodes); the operator makes its pod's controller the owner",
            self._node,
            self._client.reference,
            spec.min_nodes,
            spec.max_nodes,
        )
        return True

    def _owner_uid(self, obj: Mapping[str, Any]) -> str:
        """The uid of the Rendezvous, which owns this node's Lease."""
        try:
            return state.rendezvous_uid(obj)
        except state.DecodeError as error:
            raise KubernetesRendezvousStateError(f"{self._client.reference}: {error}") from error

    def _check_spec(self, obj: Mapping[str, Any]) -> state.RendezvousSpec:
        try:
            spec = state.RendezvousSpec.from_dict(obj.get("spec"))
        except state.DecodeError as error:
            raise KubernetesRendezvousStateError(
                f"{self._client.reference} has an invalid spec: {error}"
            ) from error
        if not self._spec_checked:
            self._spec_checked = True
            if spec.run_id != self._run_id:
                log.warning(
                    "%s has runId %r but torchrun was given --rdzv-id=%r; the resource wins",
                    self._client.reference,
                    spec.run_id,
                    self._run_id,
                )
            if (spec.min_nodes, spec.max_nodes) != self._nnodes:
                log.warning(
                    "%s admits %d:%d nodes but torchrun was given --nnodes=%d:%d; the "
                    "resource wins",
                    self._client.reference,
                    spec.min_nodes,
                    spec.max_nodes,
                    *self._nnodes,
                )
            from_spec = {
                "join_timeout": spec.join_timeout_seconds,
                "last_call_timeout": spec.last_call_timeout_seconds,
                "close_timeout": spec.close_timeout_seconds,
            }
            for key, value in self._configured_timeouts.items():
                if from_spec[key] != value:
                    log.warning(
                        "%s sets %s=%d but --rdzv-conf gave %s=%d; the resource wins",
                        self._client.reference,
                        key,
                        from_spec[key],
                        key,
                        value,
                    )
        return spec

    def _timed_out(self, spec: state.RendezvousSpec) -> KubernetesRendezvousTimeoutError:
        status = self._watcher.status or state.NodeView(self._node)
        self._withdraw()
        members = ", ".join(status.member_nodes) or (
            f"{status.world_size}, listed in its status" if status.world_size else "none"
        )
        namespace, name = self._client.namespace, self._client.name
        return KubernetesRendezvousTimeoutError(
            f"no round of {self._client.reference} included node {self._node} within "
            f"{spec.join_timeout_seconds} s (minNodes={spec.min_nodes}, "
            f"maxNodes={spec.max_nodes}); it is {status.state.value} after round "
            f"{status.round} (members: {members}). The nodes that asked to join hold the "
            f"Leases of `kubectl get leases -n {namespace} -l {state.NODE_LABEL}={name}`; "
            f"check that the operator runs (kubectl describe rdzv {name} -n {namespace}) and "
            "that enough pods are scheduled."
        )

    def _withdraw(self) -> None:
        """Take back this node's join request, as it stops waiting (best effort)."""
        try:
            self._write_intent(state.NodeIntent.LEAVE)
        except RendezvousError as error:
            log.warning("node %s could not withdraw its join: %s", self._node, error)

    def _closed_error(self, status: state.NodeView) -> KubernetesRendezvousClosedError:
        return KubernetesRendezvousClosedError(
            f"{self._client.reference} is closed ({status.closed_reason}: "
            f"{status.closed_message}); no further round will be formed. Create a new "
            "Rendezvous (or a new Job) to run again."
        )
