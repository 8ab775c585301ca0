"""The join loop: how a node gets into the next round, as torch's dynamic rendezvous does,
sync -> decide -> apply.

It writes the node's join request into its Lease (ask), waits on the round watcher
(:mod:`k8s_rendezvous.watch`) for a status the join step (:func:`k8s_rendezvous.join.decide`)
has something to say about (sync), and applies what the step says (decide, apply): serve
or reach the round's store (:mod:`k8s_rendezvous.round_store`), ask again, or raise. While
it waits unadmitted it checks, now and then, that it is the pod it names and that the
operator has not refused its request; a Rendezvous deleted under it is waited for anew.
What the node writes, and the Rendezvous it writes under, are
:mod:`k8s_rendezvous.node_requests`'.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import RendezvousError

from k8s_rendezvous import (
    api,
    heartbeat,
    join,
    messages,
    node_requests,
    round_store,
    watch,
)
from k8s_rendezvous.errors import (
    KubernetesRendezvousClosedError,
    KubernetesRendezvousConnectionError,
    KubernetesRendezvousGracefulExitError,
    KubernetesRendezvousTimeoutError,
    NodeNotAPodError,
    NodeRefusedError,
    RendezvousNotFoundError,
)
from k8s_rendezvous.wire import codec, leases, specs, views

log = logging.getLogger(__name__)

FIRST_EVENT_SECONDS: Final = 2.0
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


def _until(deadline: Callable[[], float], moment: float) -> Callable[[], float]:
    """``deadline``, or ``moment`` if that comes first."""
    return lambda: min(deadline(), moment)


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


class JoinLoop:
    """Joins this node to round after round of its Rendezvous.

    Args:
        client: Reads and writes the Rendezvous (:class:`k8s_rendezvous.api.RendezvousApi`).
        watcher: The round watcher, started.
        renewal: Renews the node's Lease; (re)started by each join request.
        requests: Writes the node's requests (:class:`k8s_rendezvous.node_requests.NodeRequests`).
        node: This node's name, the key of its entry (the pod name).
        run_id: torchrun's ``--rdzv-id``, which prefixes the agents' keys in each round's store.
        read_timeout: Seconds to wait on the round's store (``--rdzv-conf read_timeout``).
    """

    def __init__(
        self,
        client: api.RendezvousApi,
        watcher: watch.RoundWatcher,
        renewal: heartbeat.Heartbeat,
        requests: node_requests.NodeRequests,
        *,
        node: str,
        run_id: str,
        read_timeout: float,
    ) -> None:
        self._client = client
        self._watcher = watcher
        self._renewal = renewal
        self._requests = requests
        self._node = node
        self._run_id = run_id
        self._read_timeout = read_timeout
        self.joined: join.Joined | None = None
        """The round this node last joined, ``None`` before its first."""
        self.stores = round_store.Kept()
        self._node_checked = False

    def offer(self) -> socket.socket:
        """A fresh listening socket, the round's store if this node becomes rank 0:
        torch's workers expect a new store every round (they write their keys unprefixed).

        Raises:
            KubernetesRendezvousConnectionError: No socket could be opened.
        """
        try:
            return round_store.listen()
        except OSError as error:
            raise KubernetesRendezvousConnectionError(
                messages.no_store_port(self._node, self._client.reference, error)
            ) from error

    def next_round(self, offered: socket.socket) -> tuple[join.Joined, Store]:
        """Join the next round offering ``offered`` (closed after); returns the round and
        its store as its agent uses it."""
        try:
            joined = self._until_admitted(offered)
        finally:
            offered.close()  # a no-op once the round's store has taken it over
        assert self.stores.agents is not None
        return joined, self.stores.agents

    def _until_admitted(self, offered: socket.socket) -> join.Joined:
        """Join the next round: ask (write a join request), then sync -> decide -> apply
        until the join step (:func:`k8s_rendezvous.join.decide`) admits the request to a
        round whose store answers; ask again whenever it says the request is spent."""
        requests = self._requests
        requests.attempt += 1
        requests.store_port = int(offered.getsockname()[1])
        started = time.monotonic()
        obj = self._watcher.latest
        if obj is None:  # the first join, before the watch has delivered the Rendezvous
            obj = self._watcher.wait_for_object(time.monotonic() + FIRST_EVENT_SECONDS)
            if obj is None:  # missing (or a slow server): read it, or make it
                obj = requests.read_or_create()
                self._watcher.offer(obj)
        spec = requests.check_spec(obj)
        owner_uid = requests.owner_uid(obj)
        request, since = requests.ask(spec, owner_uid)
        self._renewal.start(spec, owner_uid)
        log.info(
            "node %s joins %s (attempt %d)", self._node, self._client.reference, requests.attempt
        )
        deadline = _JoinDeadline(self._node, requests.join_timeout(spec))
        while True:
            # Sync: the first status, since the request was written, that the join step
            # has something to say about.
            deadline.follow(request, spec.max_nodes)
            try:
                status = self._wait(deadline.judge, deadline, since, owner_uid, request)
            except watch.RendezvousReplaced as replaced:
                obj = self._made_anew(replaced.uid, deadline())
                spec, owner_uid = requests.check_spec(obj), requests.owner_uid(obj)
                # The request's Lease was owned by the deleted Rendezvous, so garbage
                # collection takes it with it: ask the new one, and let it own the Lease.
                request, since = requests.ask(spec, owner_uid)
                self._renewal.start(spec, owner_uid)
                continue
            if status is None:
                raise self._timed_out(spec)
            # Decide, then apply.
            decision = join.decide(status, request, spare=deadline.spare)
            outcome = self._apply(decision, status, offered, owner_uid, started)
            if isinstance(outcome, join.Joined):
                return outcome
            log.warning(
                "node %s joins %s again: %s", self._node, self._client.reference, outcome.reason
            )
            requests.attempt += 1
            request, since = requests.ask(spec, owner_uid)

    def _apply(
        self,
        decision: join.Decision,
        status: views.NodeView,
        offered: socket.socket,
        owner_uid: str,
        started: float,
    ) -> join.Joined | join.Rejoin:
        """Apply the join step's ``decision`` about ``status``: raise what ends the join,
        or meet the round admitted to at its store (the round joined, which the Rendezvous
        of ``owner_uid`` holds); else the request is spent (:class:`join.Rejoin`, why).
        ``started``: when the join began, for the log."""
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
            self._requests.withdraw()
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
                self.joined = join.Joined(status, decision.rank, owner_uid)
                prefix = f"torch.rendezvous.{self._run_id}.{decision.round}"
                self.stores.keep(store, decision.rank == 0, prefix)
                return self.joined
            # Stale before rank 0 answered (most likely its pod is gone): this round is
            # spent, and the next forms without waiting out read_timeout.
            return join.Rejoin(
                messages.rank_zero_silent(
                    decision.round, status.rank_zero_node, decision.master.endpoint
                )
            )
        assert isinstance(decision, join.Rejoin)  # the wait returns no status to wait on
        return decision

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
                    self._requests.withdraw()
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
        check = join.check_pod(self._node, pod, exists)
        if check is join.PodCheck.ANOTHER_POD:
            return messages.token_of_another_pod(self._node, self._client.reference, str(pod))
        if check is join.PodCheck.NO_SUCH_POD:
            return messages.not_a_pod(self._node, self._client.reference, namespace, user)
        if check is join.PodCheck.CANNOT_TELL:
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
                self._watcher.offer(self._requests.read_or_create())
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
    ) -> TCPStore | None:
        """The round's store: served on the offered socket by rank 0, else
        reached at rank 0's; ``None`` if the round went stale before rank 0 answered."""
        if admitted.rank == 0:
            try:
                return round_store.serve(offered, self._read_timeout)
            except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
                raise KubernetesRendezvousConnectionError(
                    messages.store_not_served(
                        self._node,
                        self._client.reference,
                        admitted.round,
                        self._requests.store_port,
                        error,
                    )
                ) from error
        try:
            return round_store.connect(
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

    def _timed_out(self, spec: specs.RendezvousSpec) -> KubernetesRendezvousTimeoutError:
        self._requests.withdraw()
        return KubernetesRendezvousTimeoutError(
            messages.timed_out(
                self._node,
                self._client.reference,
                self._client.namespace,
                self._client.name,
                self._requests.join_timeout(spec),
                spec,
                self._watcher.status or views.NodeView(self._node),
            )
        )
