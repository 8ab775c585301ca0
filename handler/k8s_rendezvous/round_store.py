"""The round's store, as sockets: each join offers a listening socket (:func:`listen`), the
round's rank 0 serves torch's TCPStore on it (:func:`serve`) and the other members reach it
(:func:`connect`), giving up as soon as the round goes stale.

torch's workers expect a new store every round (they write their keys unprefixed), and
the agents' keys are prefixed per round: so every join offers a fresh socket, served on
only if this node becomes rank 0.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

import torch

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from k8s_rendezvous.wire import records

log = logging.getLogger(__name__)

_LOOPBACK: Final = "127.0.0.1"
_STALE_ROUND_POLL_SECONDS: Final = 0.05
"""How often a node still connecting to rank 0's store looks whether the round went stale."""
_LIBUV_SERVES_A_GIVEN_SOCKET: Final = torch.__version__ >= "2.8"
"""torch's libuv store server listens on a socket it is handed only since 2.8 (pytorch
#150215); before, only its classic server does. (``torch.__version__`` is a TorchVersion:
it compares as a version, so 2.13 is above 2.8.)"""
_EXIT_BARRIER_KEY: Final = "torchelastic/agent/terminal_state/num_members"
"""The counter torch's elastic agent adds to, in its round's store, as it enters its exit
barrier (``_TERMINAL_STATE_SYNC_ID`` with ``store_util.barrier``'s ``/num_members``): it
enters it only once its workers succeeded, in torch 2.6 to 2.15 alike."""
_FINISH_CHECK_SECONDS: Final = 5.0
"""Bound on reading that counter at ``shutdown()``: rank 0's store is this node's own or
on a live peer's (a dead one refuses at once); only a partitioned rank 0 takes this long."""


def route_address(towards: str | None) -> str:
    """The local address that routes to ``towards`` (the API server's host): the address
    other nodes reach this one at, when neither ``--local-addr`` nor ``POD_IP`` says. No
    DNS involved, and no packet sent."""
    with socket.socket(
        socket.AF_INET6 if towards and ":" in towards else socket.AF_INET, socket.SOCK_DGRAM
    ) as probe:
        probe.connect((towards or "10.255.255.255", 443))
        return str(probe.getsockname()[0])


def listen() -> socket.socket:
    """A socket listening on every address, at a port the kernel picks, that a join offers
    as its store: the round's rank 0 serves the round's TCPStore on it (torch takes it
    over), the other members close it. The kernel completes their connects to rank 0 even
    before rank 0 serves, so none of them waits for it to be ready. A listening socket
    costs microseconds; a TCPStore server, made by every node for every join, cost about
    1 ms of CPU, a thread and a reverse DNS lookup, for a store one node of the round uses.

    Raises:
        OSError: No socket could be opened (the open-file limit, most likely).
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


def serve(listener: socket.socket, timeout: float) -> TCPStore:
    """The round's TCPStore, served by this node (its rank 0) on the socket it offered.

    Raises:
        RuntimeError: torch's DistNetworkError or DistStoreError.
    """
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


def connect(
    master: records.Master, timeout: float, round_is_stale: Callable[[], bool]
) -> TCPStore | None:
    """A client of rank 0's store; ``None`` as soon as ``round_is_stale()`` while still
    connecting.

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

    Raises:
        RuntimeError: By ``timeout`` (and a second, to let torch's own error through when
            connecting fails).
    """
    made: list[TCPStore | RuntimeError] = []

    def make() -> None:
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

    connecting = threading.Thread(target=make, name="k8s-rendezvous-round-store", daemon=True)
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


class Kept:
    """The round stores a node holds on to: the one it serves as its round's rank 0 (and
    the one before, one more round, for agents still finishing with it), and its last
    round's as its agent uses it (under the round's prefix)."""

    def __init__(self) -> None:
        self.serving: TCPStore | None = None
        """The store of the round this node is rank 0 of."""
        self._retired: TCPStore | None = None
        self.agents: Store | None = None
        """The last round's store as its agent uses it (under the round's prefix)."""

    def keep(self, store: TCPStore, served: bool, prefix: str) -> Store:
        """Hold ``store``, the new round's (``served``: by this node), and return it as its
        agent uses it, under ``prefix``."""
        self._retired, self.serving = self.serving, store if served else None
        self.agents = PrefixStore(prefix, store)
        return self.agents

    def finishing(self, node: str) -> bool:
        """Whether an agent of node ``node``'s last round entered torch's exit barrier,
        which it does only once its workers succeeded: the round's work is ending, and the
        node finishes rather than leaves (whoever calls ``shutdown()``, and however).
        Unknown (no round, rank 0 unreachable) is ``False``: the node leaves, and the node
        that finished, rank 0's included, closes the rendezvous."""
        store = self.agents
        if store is None:
            return False
        try:
            store.set_timeout(datetime.timedelta(seconds=_FINISH_CHECK_SECONDS))
            return bool(store.check([_EXIT_BARRIER_KEY]))
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError
            log.info("node %s could not read its round's exit barrier: %s", node, error)
            return False

    def drop(self) -> None:
        self.serving = self._retired = self.agents = None
