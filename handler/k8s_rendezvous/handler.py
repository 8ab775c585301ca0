"""``KubernetesRendezvousHandler``: torchrun's ``--rdzv-backend=kubernetes``.

A node joins by writing its entry into its own Lease and waits, on a watch of the
Rendezvous filtered by the API server, for the operator to seal a round that includes it.
Each join offers a fresh listening socket and reports its port; the round's rank 0 serves
the round's TCPStore on it (the agents' keys prefixed per round) for its workers too, who
expect a new store every round. MASTER_ADDR and MASTER_PORT come from the resource, per
round, never from a cache.

This module maps torch's ``RendezvousHandler`` onto the parts that do the work: the join
loop (:mod:`k8s_rendezvous.join_loop`: sync -> decide -> apply, as torch's dynamic
rendezvous does, with the join step :func:`k8s_rendezvous.join.decide`), the node's
requests (:mod:`k8s_rendezvous.node_requests`), the round watcher
(:mod:`k8s_rendezvous.watch`), the heartbeat (:mod:`k8s_rendezvous.heartbeat`), the round's
store (:mod:`k8s_rendezvous.round_store`), re-forming in place
(:mod:`k8s_rendezvous.reforming`), the parameters (:mod:`k8s_rendezvous.config`), the API
(:mod:`k8s_rendezvous.api`, implemented by :mod:`k8s_rendezvous.kube`), what its errors
say (:mod:`k8s_rendezvous.messages`).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from types import FrameType

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
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
    heartbeat,
    join,
    join_loop,
    kube,
    messages,
    node_requests,
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
    RendezvousNotFoundError,
)
from k8s_rendezvous.wire import leases, statuses, views

log = logging.getLogger(__name__)


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
        instance = uuid.uuid4().hex[:16]
        # Watching starts now, as torch's c10d handler connects to its store when built: the
        # first join finds the Rendezvous already read.
        self._watcher = watch.RoundWatcher(client, node)
        self._watcher.start()
        threading.Thread(
            target=self._open_connection_ahead, name="k8s-rendezvous-connect", daemon=True
        ).start()
        self._heartbeat = heartbeat.Heartbeat(client, node, instance, settings.heartbeat_timeout)
        self._probes = probes.ProbeResponder(node)
        self._sentinel = partition.Sentinel(
            node,
            self._probes,
            lambda budget: client.get(budget_seconds=budget),
            self._watcher.offer,
        )
        self._requests = node_requests.NodeRequests(
            client,
            self._watcher,
            node=node,
            addr=addr,
            probe_port=self._probes.port,
            instance=instance,
            run_id=run_id,
            nnodes=(min_nodes, max_nodes),
            settings=settings,
        )
        self._loop = join_loop.JoinLoop(
            client,
            self._watcher,
            self._heartbeat,
            self._requests,
            node=node,
            run_id=run_id,
            read_timeout=settings.read_timeout,
        )
        self._node_claim: socket.socket | None = None
        """Held while this agent lives (:func:`k8s_rendezvous.config.claim_node`), if
        built by torchrun."""
        self._closed_locally = False
        self._shut_down = False
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
        claim = config.claim_node(client.reference, node)
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
        return self._requests.instance

    @property
    def attempt(self) -> int:
        """How many join requests this instance has written (0: none yet); a round missed
        or gone stale before its store answered costs one more."""
        return self._requests.attempt

    @property
    def joined(self) -> join.Joined | None:
        """The round this node last joined, ``None`` before its first."""
        return self._loop.joined

    @property
    def watcher(self) -> watch.RoundWatcher:
        """The round watcher: the Rendezvous' status as this node last saw it."""
        return self._watcher

    @property
    def heartbeat(self) -> heartbeat.Heartbeat:
        """Renews this node's Lease in the background (from its first join on)."""
        return self._heartbeat

    @property
    def probes(self) -> probes.ProbeResponder:
        """Answers the operator's reachability probes (until ``shutdown()``)."""
        return self._probes

    @property
    def served_store(self) -> TCPStore | None:
        """The store of the round this node serves as its rank 0, ``None`` if it is not."""
        return self._loop.stores.serving

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
        joined = self._loop.joined
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
        self._requests.check_health()
        self._probes.forget()  # the round this node was probed in is behind it
        self._sentinel.start()
        offered = self._loop.offer()
        with self._join_lock:
            joined, store = self._loop.next_round(offered)
            if self._reformer is not None:
                agent = reforming.calling_agent(caller)
                store = self._reformer.started(joined, store, agent)
            status = joined.status
            assert status.master is not None
            return RendezvousInfo(
                store,
                joined.rank,
                status.world_size,
                RendezvousStoreInfo(status.master.addr, status.master.port),
            )

    def _rejoin_in_place(self) -> tuple[join.Joined, Store]:
        """The next round, joined as next_rendezvous() joins one, and its store, for the
        in-place path (the caller holds the join lock)."""
        return self._loop.next_round(self._loop.offer())

    def _wait_for_change(self, deadline: float) -> bool:
        """Whether the watched status shows, by the monotonic ``deadline``, a change the
        agent would restart its workers for (what makes num_nodes_waiting() positive)."""
        return self._watcher.wait(lambda status: self._waiting(status) > 0, deadline) is not None

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
        return join.nodes_waiting(status, self._loop.joined, self._watcher.uid)

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
        self._requests.write(leases.NodeIntent.CLOSE)
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
        finished = self._loop.stores.finishing(self._node)
        try:
            if self._requests.attempt > 0 and not self._closed_locally:
                self._requests.write(
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
            self._loop.stores.drop()
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

    def _open_connection_ahead(self) -> None:
        # Once the watch holds its connection (its first object is here), or has given up
        # waiting for one: else the watch could take the idle connection this leaves.
        self._watcher.wait_for_object(time.monotonic() + join_loop.FIRST_EVENT_SECONDS)
        self._client.open_connection()
