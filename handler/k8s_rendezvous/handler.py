"""``KubernetesRendezvousHandler``: torchrun's ``--rdzv-backend=kubernetes``.

A node joins by writing its entry into its own Lease and waits, on a watch of the
Rendezvous filtered by the API server, for the operator to seal a round that includes it.
Each join offers a fresh listening socket and reports its port; the round's rank 0 serves
the round's TCPStore on it (the agents' keys prefixed per round) for its workers too, who
expect a new store every round. MASTER_ADDR and MASTER_PORT come from the resource, per
round, never from a cache.

A join loops sync -> decide -> apply, as torch's dynamic rendezvous does: it waits on the
round watcher (:mod:`k8s_rendezvous.watch`) for a status the join step
(:func:`k8s_rendezvous.join.decide`) has something to say about, and applies what it says.
The other concerns live beside it: the parameters (:mod:`k8s_rendezvous.config`), the
heartbeat (:mod:`k8s_rendezvous.heartbeat`), the round's store
(:mod:`k8s_rendezvous.round_store`), the API (:mod:`k8s_rendezvous.api`, implemented by
:mod:`k8s_rendezvous.kube`), what its errors say (:mod:`k8s_rendezvous.messages`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import logging
import math
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Final

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.agent.server.api import ElasticAgent
from torch.distributed.elastic.events import construct_and_record_rdzv_event
from torch.distributed.elastic.events.api import NodeState
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from k8s_rendezvous import (
    BACKEND_NAME,
    api,
    config,
    health_check,
    heartbeat,
    join,
    kube,
    messages,
    partition,
    probes,
    reforming,
    rest,
    round_store,
    warm,
    watch,
)
from k8s_rendezvous.errors import (
    KubernetesRendezvousClosedError,
    KubernetesRendezvousConnectionError,
    KubernetesRendezvousGracefulExitError,
    KubernetesRendezvousStateError,
    KubernetesRendezvousTimeoutError,
    NodeNotAPodError,
    NodeRefusedError,
    NodeUnhealthyError,
    RendezvousNotFoundError,
)
from k8s_rendezvous.wire import codec, leases, objects, specs, statuses, views

log = logging.getLogger(__name__)

_FIRST_EVENT_SECONDS: Final = 2.0
"""How long the first join waits for the watch to deliver the Rendezvous before reading it
(the watch says nothing while the Rendezvous is missing, e.g. until a pod creates it)."""
_REMADE_WITHIN_SECONDS: Final = 10.0
"""How long a node whose Rendezvous was deleted while it waited gives the operator (for an
annotated Job's) or its own pod's creator role to make it anew, before it gives up."""
_NODE_CHECK_SECONDS: Final = 5.0
"""How long a node waits unadmitted before it checks, once, that it is the pod it names:
a node no Pod stands for is never admitted, and would otherwise wait out its join
timeout. Joins admitted sooner (the usual) pay no request for it. It is also when it
first reads the Rendezvous for a refusal of its request (see
:data:`_REFUSAL_CHECK_MAX_SECONDS`)."""
_REFUSAL_CHECK_MAX_SECONDS: Final = 60.0
"""A node that waits unadmitted reads the Rendezvous for a refusal of its request
(``status.refused``) after :data:`_NODE_CHECK_SECONDS`, then twice as long each time up
to this: its watch shows only round changes, not a refusal written within a round. So a
refused node ends within seconds of the refusal it asked for, a spare waiting for hours
costs one read a minute, and a join admitted within 5 s none."""
_EXIT_BARRIER_KEY: Final = "torchelastic/agent/terminal_state/num_members"
"""The counter torch's elastic agent adds to, in its round's store, as it enters its exit
barrier (``_TERMINAL_STATE_SYNC_ID`` with ``store_util.barrier``'s ``/num_members``): it
enters it only once its workers succeeded, in torch 2.6 to 2.15 alike."""
_FINISH_CHECK_SECONDS: Final = 5.0
"""Bound on reading that counter at ``shutdown()``: rank 0's store is this node's own or
on a live peer's (a dead one refuses at once); only a partitioned rank 0 takes this long."""
_AGENT_FRAMES: Final = 4
"""How far up its callers ``next_rendezvous()`` looks for torch's agent on the in-place
path (the agent's ``_rendezvous``, under its profiling wrapper)."""


def _until(deadline: Callable[[], float], moment: float) -> Callable[[], float]:
    """``deadline``, or ``moment`` if that comes first."""
    return lambda: min(deadline(), moment)


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


def _claim_node(reference: str, node: str) -> socket.socket:
    """Hold the name ``node`` for this agent, in ``reference``, while it lives: an abstract
    Unix socket, which every container of the pod sees (they share its network namespace)
    and the kernel frees with the process, however it ends.

    Raises:
        KubernetesRendezvousStateError: Another agent of this pod holds it.
    """
    key = hashlib.sha256(f"{reference}/{node}".encode()).hexdigest()[:32]
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0k8s-rendezvous-node-{key}")
    except OSError as error:
        claim.close()
        if error.errno != errno.EADDRINUSE:
            raise
        # Two agents under one node name would share its Lease: each join would overwrite
        # the other's request, and neither would ever be admitted.
        raise KubernetesRendezvousStateError(messages.another_agent(node, reference)) from error
    return claim


class _JoinDeadline:
    """When a join gives up, as a monotonic time. As torch's c10d treats a node in its
    redundancy list, a spare (the round is sealed full without it,
    :func:`k8s_rendezvous.join.is_spare`) has no deadline, and one that stops being a
    spare gets the whole join timeout afresh. Without this, spares would time out and
    fail their pods, and a Job's ``backoffLimit`` with them."""

    def __init__(self, node: str, timeout: float) -> None:
        self._node = node
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._request: leases.NodeEntry | None = None
        self._max_nodes = 0
        self.spare = False
        """Whether the node waits as a spare, as of the latest status judged."""

    def follow(self, request: leases.NodeEntry, max_nodes: int) -> None:
        """Judge ``request`` (the node's current one) against a round of ``max_nodes``."""
        self._request, self._max_nodes = request, max_nodes

    def judge(self, view: views.NodeView) -> bool:
        """Whether the join step has something to say about ``view``; each status the
        wait judges, in order, also tells whether the node is a spare."""
        assert self._request is not None, "follow() comes first"
        if join.is_decided(view, self._request):
            return True  # what it was before this status (a close) is what counts
        spare = join.is_spare(view, self._request, self._max_nodes)
        if spare != self.spare:
            self.spare = spare
            if spare:
                log.info(
                    "node %s waits as a spare: round %d is full (%d nodes); it joins, with "
                    "no deadline meanwhile, when a member is lost or the round re-forms",
                    self._node,
                    view.round,
                    self._max_nodes,
                )
            else:
                self._deadline = time.monotonic() + self._timeout
        return False

    def __call__(self) -> float:
        return math.inf if self.spare else self._deadline


class KubernetesRendezvousHandler(RendezvousHandler):
    """A ``RendezvousHandler`` whose state lives in a ``Rendezvous`` resource.

    Args:
        client: Reads and writes the Rendezvous (:class:`k8s_rendezvous.kube.RendezvousClient`,
            or a stand-in that satisfies :class:`k8s_rendezvous.api.RendezvousApi`).
        run_id: torchrun's ``--rdzv-id``; must match the resource's ``spec.runId``.
        node: This node's name, the key of its entry (the pod name).
        addr: The address other nodes reach this node at (pod IP or ``--local-addr``).
        min_nodes: torchrun's ``--nnodes`` minimum, checked against the spec.
        max_nodes: torchrun's ``--nnodes`` maximum, checked against the spec.
        settings: What ``--rdzv-endpoint`` and ``--rdzv-conf`` say
            (:class:`k8s_rendezvous.config.Settings`; none: every default, for the
            client's Rendezvous).
    """

    def __init__(
        self,
        client: api.RendezvousApi,
        *,
        run_id: str,
        node: str,
        addr: str,
        min_nodes: int,
        max_nodes: int,
        settings: config.Settings | None = None,
    ) -> None:
        self._client = client
        settings = settings or config.Settings(client.namespace, client.name)
        # First: it imports torch while this node joins, so that the first workers are
        # forked from it too.
        self._zygote = warm.start_zygote() if settings.warm_start else None
        self._run_id = run_id
        self._node = node
        self._addr = addr
        self._nnodes = (min_nodes, max_nodes)
        self._read_timeout = settings.read_timeout
        self._configured_spec = settings.configured_spec
        self._instance = uuid.uuid4().hex[:16]
        self._attempt = 0
        self._joined: join.Joined | None = None
        # Watching starts now, as torch's c10d handler connects to its store when built: the
        # first join finds the Rendezvous already read.
        self._watcher = watch.RoundWatcher(client, node)
        self._watcher.start()
        threading.Thread(
            target=self._open_connection_ahead, name="k8s-rendezvous-connect", daemon=True
        ).start()
        self._heartbeat = heartbeat.Heartbeat(
            client, node, self._instance, settings.heartbeat_timeout
        )
        self._probes = probes.ProbeResponder(node)
        self._sentinel = partition.Sentinel(
            node,
            self._probes,
            lambda budget: client.get(budget_seconds=budget),
            self._watcher.offer,
        )
        self._serving: TCPStore | None = None
        """The store of the round this node is rank 0 of."""
        self._retired: TCPStore | None = None
        """The previous one, kept one more round for agents still finishing with it."""
        self._node_claim: socket.socket | None = None
        """Held while this agent lives (:func:`_claim_node`), if built by torchrun."""
        self._round_store_handle: Store | None = None
        """The last round's store as its agent uses it (under the round's prefix)."""
        self._entry_port = 0
        self._spec_checked = False
        self._node_checked = False
        self._closed_locally = False
        self._shut_down = False
        self._health_check = settings.health_check
        self._health_check_timeout = settings.health_check_timeout
        self._failed_check: leases.HealthCheckReport | None = None
        """Why this node's health check failed: every Leave it writes from then says so,
        shutdown()'s too, so that a later write cannot hide it from the operator."""
        self._join_lock = threading.Lock()
        """Held by every join: next_rendezvous()'s, and one in place."""
        self._reformer = (
            reforming.Reformer(
                node,
                self._wait_for_change,
                self._rejoin_in_place,
                self._join_lock,
                settings.in_place_loss_timeout,
            )
            if settings.in_place
            else None
        )

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> KubernetesRendezvousHandler:
        """Build a handler from torchrun's parameters and the pod's environment."""
        settings = config.Settings.from_parameters(params, rest.own_namespace())
        api_client = kube.load_api_client()
        pod_ip = os.environ.get("POD_IP") or None
        addr = (
            config.local_address(params.local_addr, pod_ip)
            if params.local_addr
            else pod_ip or round_store.route_address(kube.server_host(api_client))
        )
        client = kube.RendezvousClient(
            api_client, settings.namespace, settings.name, retry_seconds=settings.read_timeout
        )
        node = os.environ.get("POD_NAME") or config.own_pod_name(client)
        claim = _claim_node(client.reference, node)
        try:
            handler = cls(
                client,
                run_id=params.run_id,
                node=node,
                addr=addr,
                min_nodes=params.min_nodes,
                max_nodes=params.max_nodes,
                settings=settings,
            )
        except BaseException:
            claim.close()
            raise
        handler._node_claim = claim
        return handler

    # -- what this node is and holds (read-only) ------------------------------------------

    @property
    def client(self) -> api.RendezvousApi:
        """Reads and writes the Rendezvous for this node."""
        return self._client

    @property
    def node(self) -> str:
        """This node's name: its pod's, the key of its entry."""
        return self._node

    @property
    def addr(self) -> str:
        """The address other nodes reach this node at: its store's, if it is rank 0."""
        return self._addr

    @property
    def instance(self) -> str:
        """This agent's instance id, in its every join request: a restarted agent is a new
        instance."""
        return self._instance

    @property
    def attempt(self) -> int:
        """How many join requests this instance has written (0: none yet); a round missed
        or gone stale before its store answered costs one more."""
        return self._attempt

    @property
    def joined(self) -> join.Joined | None:
        """The round this node last joined, ``None`` before its first."""
        return self._joined

    @property
    def watcher(self) -> watch.RoundWatcher:
        """The round watcher: the Rendezvous' status as this node last saw it."""
        return self._watcher

    @property
    def heartbeat(self) -> heartbeat.Heartbeat:
        """Renews this node's Lease in the background (from its first join on)."""
        return self._heartbeat

    @property
    def served_store(self) -> TCPStore | None:
        """The store of the round this node serves as its rank 0, ``None`` if it is not."""
        return self._serving

    @property
    def reformer(self) -> reforming.Reformer | None:
        """Re-forms this node's round in place, if built with ``in_place``."""
        return self._reformer

    @property
    def zygote(self) -> subprocess.Popen[bytes] | None:
        """The process its workers are forked from, if built with ``warm_start``."""
        return self._zygote

    # -- RendezvousHandler --------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        # torchelastic's rendezvous events, as c10d records them (its event handler logs them).
        self._record(f"node {self._node} attempts to join the next round of {self._run_id}")
        try:
            info = self._join_next(sys._getframe(1))
        except Exception as error:
            self._record(f"{type(error).__name__}: {error}", NodeState.FAILED)
            raise
        joined = self._joined
        self._record(
            f"node {self._node} joined round {joined.round if joined else 0} of "
            f"{self._run_id} as rank {info.rank} in a world of {info.world_size}",
            rank=info.rank,
        )
        return info

    def _join_next(self, caller: FrameType | None) -> RendezvousInfo:
        """next_rendezvous() but for its events; ``caller`` is its caller's frame."""
        # As with torch's c10d, a node that closed the rendezvous or shut down joins
        # nothing: a join request now would overwrite its Close, or join a round nobody
        # serves.
        if self._closed_locally or self._shut_down:
            called = "shutdown()" if self._shut_down else "set_closed()"
            raise KubernetesRendezvousClosedError(
                messages.joins_no_more(self._node, self._client.reference, called)
            )
        if self._health_check:
            self._check_health()
        self._probes.forget()  # the round this node was probed in is behind it
        self._sentinel.start()
        # torch's workers expect a new store every round (they write their keys unprefixed):
        # each join offers a fresh socket, served on only if this node becomes rank 0.
        try:
            offered = round_store.listen()
        except OSError as error:
            raise KubernetesRendezvousConnectionError(
                messages.no_store_port(self._node, self._client.reference, error)
            ) from error
        with self._join_lock:
            try:
                joined = self._next_round(offered)
            finally:
                offered.close()  # a no-op once the round's store has taken it over
            store = self._round_store_handle
            assert store is not None
            if self._reformer is not None:
                agent = _calling_agent(caller)
                store = self._reformer.started(joined, store, agent)
            status = joined.status
            assert status.master is not None
            return RendezvousInfo(
                store,
                joined.rank,
                status.world_size,
                RendezvousStoreInfo(status.master.addr, status.master.port),
            )

    def _check_health(self) -> None:
        """Run the health check; if it fails, say why in this node's Lease (a Leave the
        operator reports in a HealthCheckFailed Warning) and end the agent.

        Raises:
            NodeUnhealthyError: The check failed: no join request is written.
        """
        report = health_check.run(self._health_check, self._health_check_timeout)
        if report is None:
            return
        self._failed_check = report
        how = report.summary()
        log.error(
            "node %s does not join %s: its health check %s %s; its output ends:\n%s",
            self._node,
            self._client.reference,
            shlex.join(self._health_check),
            how,
            report.tail,
        )
        try:
            self._write_intent(leases.NodeIntent.LEAVE)
        except RendezvousError as error:
            log.warning("node %s could not report its failed health check: %s", self._node, error)
        raise NodeUnhealthyError(
            messages.unhealthy(
                self._node,
                self._client.reference,
                shlex.join(self._health_check),
                how,
                report.tail,
            )
        )

    def _rejoin_in_place(self) -> tuple[join.Joined, Store]:
        """The next round, joined as next_rendezvous() joins one, and its store, for the
        in-place path (the caller holds the join lock)."""
        try:
            offered = round_store.listen()
        except OSError as error:
            raise KubernetesRendezvousConnectionError(
                messages.no_store_port(self._node, self._client.reference, error)
            ) from error
        try:
            joined = self._next_round(offered)
        finally:
            offered.close()
        assert self._round_store_handle is not None
        return joined, self._round_store_handle

    def _wait_for_change(self, deadline: float) -> bool:
        """Whether the watched status shows, by the monotonic ``deadline``, a change the
        agent would restart its workers for (what makes num_nodes_waiting() positive)."""
        return self._watcher.wait(lambda status: self._waiting(status) > 0, deadline) is not None

    def _next_round(self, offered: socket.socket) -> join.Joined:
        """Join the next round: ask (write a join request), then sync -> decide -> apply
        until the join step (:func:`k8s_rendezvous.join.decide`) admits the request to a
        round whose store answers; ask again whenever it says the request is spent."""
        self._attempt += 1
        self._entry_port = int(offered.getsockname()[1])
        started = time.monotonic()
        obj = self._watcher.latest
        if obj is None:  # the first join, before the watch has delivered the Rendezvous
            obj = self._watcher.wait_for_object(time.monotonic() + _FIRST_EVENT_SECONDS)
            if obj is None:  # missing (or a slow server): read it, or make it
                obj = self._read_or_create()
                self._watcher.offer(obj)
        spec = self._check_spec(obj)
        owner_uid = self._owner_uid(obj)
        request, since = self._ask(spec, owner_uid)
        self._heartbeat.start(spec, owner_uid)
        log.info("node %s joins %s (attempt %d)", self._node, self._client.reference, self._attempt)
        deadline = _JoinDeadline(self._node, self._join_timeout(spec))
        while True:
            # Sync: the first status, since the request was written, that the join step
            # has something to say about.
            deadline.follow(request, spec.max_nodes)
            try:
                status = self._wait(deadline.judge, deadline, since, owner_uid, request)
            except watch.RendezvousReplaced as replaced:
                obj = self._made_anew(replaced.uid, deadline())
                spec, owner_uid = self._check_spec(obj), self._owner_uid(obj)
                # The request's Lease was owned by the deleted Rendezvous, so garbage
                # collection takes it with it: ask the new one, and let it own the Lease.
                request, since = self._ask(spec, owner_uid)
                self._heartbeat.start(spec, owner_uid)
                continue
            if status is None:
                raise self._timed_out(spec)
            # Decide, then apply.
            decision = join.decide(status, request, spare=deadline.spare)
            if isinstance(decision, join.Released):
                raise KubernetesRendezvousGracefulExitError(
                    messages.spare_released(
                        self._node, self._client.reference, decision.reason, decision.message
                    )
                )
            if isinstance(decision, join.Closed):
                raise KubernetesRendezvousClosedError(
                    messages.closed(self._client.reference, decision.reason, decision.message)
                )
            if isinstance(decision, join.Refused):
                self._withdraw()
                raise NodeRefusedError(
                    messages.refused(
                        self._node, self._client.reference, decision.reason, decision.message
                    )
                )
            if isinstance(decision, join.Admitted):
                log.info(
                    "node %s is rank %d of %d in round %d of %s (master %s, %.3f s)",
                    self._node,
                    decision.rank,
                    decision.world_size,
                    decision.round,
                    self._client.reference,
                    decision.master.endpoint,
                    time.monotonic() - started,
                )
                store = self._round_store(decision, status.rank_zero_node, offered)
                if store is not None:
                    self._joined = join.Joined(status, decision.rank, owner_uid)
                    prefix = f"torch.rendezvous.{self._run_id}.{decision.round}"
                    self._round_store_handle = PrefixStore(prefix, store)
                    return self._joined
                # Stale before rank 0 answered (most likely its pod is gone): this round
                # is spent, and the next forms without waiting out read_timeout.
                decision = join.Rejoin(
                    messages.rank_zero_silent(
                        decision.round, status.rank_zero_node, decision.master.endpoint
                    )
                )
            assert isinstance(decision, join.Rejoin)  # the wait returns no status to wait on
            log.warning(
                "node %s joins %s again: %s", self._node, self._client.reference, decision.reason
            )
            self._attempt += 1
            request, since = self._ask(spec, owner_uid)

    def _ask(self, spec: specs.RendezvousSpec, owner_uid: str) -> tuple[leases.NodeEntry, int]:
        """Write this node's join request of the current attempt; returns it, and the
        watcher's mark from before the write (the seal that admits it cannot be missed)."""
        request = self._request(leases.NodeIntent.JOIN)
        since = self._watcher.mark()
        self._client.write_lease(
            self._node, self._instance, spec.heartbeat_timeout_seconds, owner_uid, request
        )
        return request, since

    def _wait(
        self,
        decided: Callable[[views.NodeView], bool],
        deadline: Callable[[], float],
        since: int,
        uid: str,
        request: leases.NodeEntry,
    ) -> views.NodeView | None:
        """The watcher's wait, with the checks of a node that waits unadmitted: once, after
        :data:`_NODE_CHECK_SECONDS`, that it is a pod; then and later (see
        :data:`_REFUSAL_CHECK_MAX_SECONDS`) a read of the status, returned if it refuses
        ``request``."""
        interval = _NODE_CHECK_SECONDS
        while True:
            check_at = time.monotonic() + interval
            status = self._watcher.wait(decided, _until(deadline, check_at), since, uid)
            if status is not None or time.monotonic() >= deadline():
                return status
            # Judged up to about now: on from the latest (judging it again changes nothing).
            since = self._watcher.mark()
            if not self._node_checked:
                self._node_checked = True
                if (problem := self._not_this_pod()) is not None:
                    self._withdraw()
                    raise NodeNotAPodError(problem)
            if (refusing := self._read_refusal(request)) is not None:
                return refusing
            interval = min(interval * 2, _REFUSAL_CHECK_MAX_SECONDS)

    def _read_refusal(self, request: leases.NodeEntry) -> views.NodeView | None:
        """The stored status, if it refuses ``request`` (one read; a failed one says
        nothing: the next check reads again)."""
        try:
            view = views.NodeView.from_dict(self._client.get().get("status"), self._node)
        except (RendezvousError, codec.DecodeError) as error:
            log.debug("node %s could not read %s: %s", self._node, self._client.reference, error)
            return None
        return view if view.refusal_of(request) is not None else None

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
                return messages.token_of_another_pod(self._node, self._client.reference, pod)
            return None  # a token bound to this very pod: it exists
        if exists is False:
            return messages.not_a_pod(self._node, self._client.reference, namespace, user)
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
            raise KubernetesRendezvousClosedError(
                messages.deleted(
                    self._node,
                    self._client.reference,
                    self._client.namespace,
                    self._client.name,
                    _REMADE_WITHIN_SECONDS,
                )
            )
        return obj

    def _round_store(
        self, admitted: join.Admitted, rank_zero_node: str | None, offered: socket.socket
    ) -> Store | None:
        """The round's store: served on the offered socket by rank 0, else reached at rank
        0's; ``None`` if the round went stale before rank 0 answered."""
        if admitted.rank == 0:
            try:
                served = round_store.serve(offered, self._read_timeout)
            except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
                raise KubernetesRendezvousConnectionError(
                    messages.store_not_served(
                        self._node, self._client.reference, admitted.round, self._entry_port, error
                    )
                ) from error
            self._retired, self._serving = self._serving, served
            return served
        try:
            client = round_store.connect(
                admitted.master,
                self._read_timeout,
                lambda: join.is_stale(self._watcher.status, admitted.round),
            )
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
            raise KubernetesRendezvousConnectionError(
                messages.store_unreachable(
                    self._node,
                    self._client.reference,
                    rank=admitted.rank,
                    round_number=admitted.round,
                    endpoint=admitted.master.endpoint,
                    rank_zero_node=rank_zero_node,
                    timeout=self._read_timeout,
                    error=error,
                )
            ) from error
        if client is not None:
            self._retired, self._serving = self._serving, None
        return client

    def num_nodes_waiting(self) -> int:
        """Answered from the watched status: no API call, never raises. On the in-place
        path, 0 while the change is re-formed in place."""
        status = self._watcher.status
        waiting = 0 if status is None else self._waiting(status)
        if self._sentinel.cut_off:
            # Its workers hang in a group the others left: stopped now, not failed later.
            return max(1, waiting)
        if self._reformer is None or (
            waiting and status and status.state is statuses.RoundState.CLOSED
        ):
            return waiting  # a closure in failure ends in-place re-forming too
        if self._reformer.handles_changes():
            return 0
        # Given up (a worker may have, in a round that did not change): the agent must
        # restart the workers, and the node join anew.
        return max(1, waiting) if self._reformer.gave_up is not None else waiting

    def _waiting(self, status: views.NodeView) -> int:
        """What num_nodes_waiting() answers for ``status``, as torch's agent reads it."""
        return join.nodes_waiting(status, self._joined, self._watcher.uid)

    def is_closed(self) -> bool:
        if self._closed_locally:
            return True
        status = self._watcher.status
        if status is None:
            try:
                obj = self._client.get()
            except RendezvousNotFoundError:
                return False  # as c10d's: nothing closed it yet
            status = views.NodeView.from_dict(obj.get("status"), self._node)
        return status.state is statuses.RoundState.CLOSED

    def set_closed(self) -> None:
        self._write_intent(leases.NodeIntent.CLOSE)
        self._closed_locally = True
        self._record(f"node {self._node} closed {self._run_id}", NodeState.SUCCEEDED)

    def shutdown(self) -> bool:
        """This node leaves. If an agent of its last round entered torch's exit barrier
        (its workers succeeded), the node finished: no further round forms (as torch's
        c10d closes at any agent's shutdown), and the other members finish their work
        undisturbed. Otherwise (workers failed, or never ran) it is lost to the round, and
        the others go on in a new one; the rendezvous closes once every member has left."""
        self._shut_down = True
        self._watcher.stop()
        self._heartbeat.stop()
        self._sentinel.stop()
        if self._reformer is not None:
            self._reformer.stop()
        if self._zygote is not None and self._zygote.stdin is not None:
            self._zygote.stdin.close()  # it exits, with any worker it still runs
        finished = self._round_finishing()
        try:
            if self._attempt > 0 and not self._closed_locally:
                self._write_intent(
                    leases.NodeIntent.FINISH if finished else leases.NodeIntent.LEAVE
                )
            self._record(
                f"node {self._node} {'finished' if finished else 'left'} {self._run_id}",
                NodeState.SUCCEEDED,
            )
            return True
        except RendezvousError as error:
            log.warning("node %s could not record leaving: %s", self._node, error)
            return False
        finally:
            # Last: a member silent to the operator's probes before its Leave or Finish is
            # written would be taken for lost, and a finished round re-formed.
            self._probes.stop()
            self._serving = self._retired = self._round_store_handle = None
            if self._node_claim is not None:
                self._node_claim.close()

    # -- internals ------------------------------------------------------------------------

    def _record(
        self,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        rank: int | None = None,
    ) -> None:
        construct_and_record_rdzv_event(
            run_id=self._run_id,
            message=message,
            node_state=node_state,
            name=f"{type(self).__name__}.{sys._getframe(1).f_code.co_name}",
            hostname=self._node,
            pid=os.getpid(),
            rank=rank,
        )

    def _round_finishing(self) -> bool:
        """Whether an agent of this node's last round entered torch's exit barrier, which
        it does only once its workers succeeded: the round's work is ending, and this node
        finishes rather than leaves (whoever calls ``shutdown()``, and however). Unknown
        (no round, rank 0 unreachable) is ``False``: the node leaves, and the node that
        finished, rank 0's included, closes the rendezvous."""
        store = self._round_store_handle
        if store is None:
            return False
        try:
            store.set_timeout(datetime.timedelta(seconds=_FINISH_CHECK_SECONDS))
            return bool(store.check([_EXIT_BARRIER_KEY]))
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
            log.info("node %s could not read its round's exit barrier: %s", self._node, error)
            return False

    def _open_connection_ahead(self) -> None:
        # Once the watch holds its connection (its first object is here), or has given up
        # waiting for one: else the watch could take the idle connection this leaves.
        self._watcher.wait_for_object(time.monotonic() + _FIRST_EVENT_SECONDS)
        self._client.open_connection()

    def _request(self, intent: leases.NodeIntent) -> leases.NodeEntry:
        """This node's request of its current attempt. The store port only matters to a
        Join (made after the port is offered); the others repeat the last one, if any."""
        return leases.NodeEntry(
            self._instance,
            max(self._attempt, 1),
            self._addr,
            self._entry_port or 1,
            intent,
            probe_port=self._probes.port,
            health_check=self._failed_check if intent is leases.NodeIntent.LEAVE else None,
        )

    def _write_intent(self, intent: leases.NodeIntent) -> None:
        entry = self._request(intent)
        obj = self._watcher.latest or self._read_or_create()  # c10d's set_closed() creates
        spec = self._check_spec(obj)
        self._client.write_lease(
            self._node,
            self._instance,
            spec.heartbeat_timeout_seconds,
            self._owner_uid(obj),
            entry,
            # c10d's close timeout bounds set_closed() and shutdown() alike.
            budget_seconds=self._configured_spec.get(
                "closeTimeoutSeconds", spec.close_timeout_seconds
            ),
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
        spec = config.spec_to_create(*self._nnodes, self._run_id, self._configured_spec)
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
            return objects.rendezvous_uid(obj)
        except codec.DecodeError as error:
            raise KubernetesRendezvousStateError(f"{self._client.reference}: {error}") from error

    def _check_spec(self, obj: Mapping[str, Any]) -> specs.RendezvousSpec:
        try:
            spec = specs.RendezvousSpec.from_dict(obj.get("spec"))
        except codec.DecodeError as error:
            raise KubernetesRendezvousStateError(
                messages.invalid_spec(self._client.reference, error)
            ) from error
        if spec.run_id != self._run_id:
            # Merged into one round, nodes of two run ids would wait on different store
            # prefixes for ever; c10d keeps them in two rendezvous.
            raise KubernetesRendezvousStateError(
                messages.other_run(self._client.reference, spec.run_id, self._run_id)
            )
        if not self._spec_checked:
            self._spec_checked = True
            for disagreement in config.disagreements(spec, self._nnodes, self._configured_spec):
                log.warning("%s %s; the resource wins", self._client.reference, disagreement)
        return spec

    def _join_timeout(self, spec: specs.RendezvousSpec) -> int:
        """This node's join deadline in seconds: its own ``--rdzv-conf join_timeout`` if
        given (a local deadline, as in torch's c10d), else the spec's."""
        return self._configured_spec.get("joinTimeoutSeconds", spec.join_timeout_seconds)

    def _timed_out(self, spec: specs.RendezvousSpec) -> KubernetesRendezvousTimeoutError:
        self._withdraw()
        return KubernetesRendezvousTimeoutError(
            messages.timed_out(
                self._node,
                self._client.reference,
                self._client.namespace,
                self._client.name,
                self._join_timeout(spec),
                spec,
                self._watcher.status or views.NodeView(self._node),
            )
        )

    def _withdraw(self) -> None:
        """Take back this node's join request, as it stops waiting (best effort)."""
        try:
            self._write_intent(leases.NodeIntent.LEAVE)
        except RendezvousError as error:
            log.warning("node %s could not withdraw its join: %s", self._node, error)
