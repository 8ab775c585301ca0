"""Keep training through a change of the world: re-form the process group in place.

Opt-in, for torch >= 2.14 and a backend that can reconfigure (gloo; NCCL >= 2.28). Run
torchrun with ``--rdzv-backend=kubernetes --rdzv-conf in_place=1`` and let the training
script join the world through this module instead of ``dist.init_process_group``::

    from k8s_rendezvous import in_place

    world = in_place.init_process_group("gloo")
    while step < steps:
        try:
            if world.reformed():          # a collective: call it at every step boundary
                step = share_state_from_rank_0(step)
            train_step()
            step += 1
        except world.failures as error:   # a peer was lost in a collective
            world.recover(error)          # re-forms in place; the next reformed() is True

When a node is lost, the surviving workers' collectives fail (a peer cut off from the
network closes nothing: once the round without it is published, each worker shuts its
connections to it down, :mod:`k8s_rendezvous.cut_peers`); :meth:`World.recover` closes
this worker's connections (so that peers still blocked on it fail too), waits for the
round the operator seals without the lost node, and reconfigures the default process
group around the new member set (``dist._reconfigure``), with the ranks torch's agent
would have given. When a node arrives, its workers join the round it was admitted to, and
the running workers switch to it together at a step boundary (:meth:`World.reformed`
agrees on it with one small all-reduce), once every newcomer is ready: they keep training
until then. Nobody restarts: the workers' processes, their memory and their CUDA context
survive.

Anything this path cannot do falls back to torch's restart, named in the logs (``in-place
re-forming failed``): the worker says so to its node's handler, which then tells torch's
agent that the node must re-join, and the agent restarts the workers as it always does.
Without ``in_place=1`` (or on an older torch, or another backend), :func:`init_process_group`
is ``dist.init_process_group``, :meth:`World.reformed` is always False and
:meth:`World.recover` re-raises: the same script runs on the restart path.

How the agent, its handler and the workers share the work: see docs/in-place.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

# Exported by torch.distributed at run time but missing from its type stubs.
from torch.distributed import HashStore, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed import distributed_c10d as c10d

from k8s_rendezvous import cut_peers, handoff, warm

log = logging.getLogger(__name__)

__all__ = ["InPlaceFallback", "World", "init_process_group"]

KEY_PREFIX: Final = "k8s-rendezvous/in-place"
"""Where workers exchange their reconfigure handles in a round's store (the agents' keys
are under ``torch.rendezvous.<run id>.<round>``)."""
POLL_SECONDS: Final = 0.005
"""How often a waiting worker looks at the round's store and at its node's published
round: a check is one request to rank 0's store (tens of microseconds on a LAN)."""
DEFAULT_TIMEOUT: Final = datetime.timedelta(minutes=10)
"""Bound on each wait of the in-place path: for the next round after a failure (the
operator seals it when every survivor is back, or drops a hung node after the heartbeat
timeout), for every worker of a round to be ready (a newcomer imports torch first), and
for one reconfigure. Beyond it the worker falls back to torch's restart."""
RECONFIGURE_TIMEOUT: Final = datetime.timedelta(seconds=60)
"""Bound on ``dist._reconfigure`` itself, once every worker has published its handle (it
takes milliseconds; it hangs only if a worker died in between)."""
_RESTART_WAIT_SECONDS: Final = 60.0
"""How long a worker that gave up waits for torch's agent to stop it (the agent polls its
handler every ``--monitor-interval``) before it raises instead."""


class InPlaceFallback(Exception):
    """This worker could not re-form in place and torch's agent did not restart it in
    time; the message says why. Not one of :attr:`World.failures`: let it end the worker,
    which ends in torch's restart."""


class SwitchedStore(Store):
    """A store that passes every call to :attr:`inner`, which can be switched: the
    workers' process group keeps the store it was created with, the agent keeps the
    store of the round it started the workers in, and each round has its own."""

    def __init__(self, inner: Store) -> None:
        super().__init__()
        self.inner: Any = inner

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout  # type: ignore[no-any-return]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [bytes(value) for value in self.inner.multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, values)


class _Target:
    """A round this worker is to re-form into: what its handler published and, once
    reached, a client of the round's store (rank 0's)."""

    def __init__(self, published: handoff.PublishedRound, rank: int, world_size: int) -> None:
        self.published = published
        self.rank = rank
        self.world_size = world_size
        self.store: Store | None = None
        self.announced = False

    @property
    def round(self) -> int:
        return self.published.round

    def key(self, kind: str, rank: int | None = None) -> str:
        return f"{KEY_PREFIX}/{self.round}/{kind}/{self.rank if rank is None else rank}"

    def keys(self, kind: str) -> list[str]:
        return [self.key(kind, rank) for rank in range(self.world_size)]


class _StepBoundaryStop:
    """SIGTERM taken at a step boundary: the step in flight is finished, with every peer,
    and the worker then leaves, so that a planned removal (a drain, an eviction) costs the
    others no step. Between steps (re-forming, or waiting for the agent to restart it) the
    worker leaves at once, as without it; a step not done within
    :data:`~k8s_rendezvous.handoff.STOP_GRACE_SECONDS` is given up.

    A Python signal handler runs only when the main thread returns to the interpreter,
    never while it is blocked in a collective, so the signal is watched from a thread,
    through the byte its C handler writes to :func:`signal.set_wakeup_fd`."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.in_step = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        """The socket pair whose writer end is the signal wakeup fd (kept open)."""

    def install(self) -> bool:
        """Take SIGTERM (main thread only); ``False`` if another wakeup fd is in use."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            log.warning("a signal wakeup fd is in use: SIGTERM ends this worker mid-step")
            return False
        signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # the watcher acts
        self._wakeup = (reader, writer)
        threading.Thread(
            target=self._watch, args=(reader,), name="k8s-rdzv-stop", daemon=True
        ).start()
        return True

    def _watch(self, reader: socket.socket) -> None:
        while signal.SIGTERM not in reader.recv(64):
            pass
        if not self.in_step:
            leave("SIGTERM between steps: leaving now")
        self.requested.set()
        grace = handoff.STOP_GRACE_SECONDS
        log.warning(
            "SIGTERM: finishing the step in flight, then leaving at the step boundary "
            "(at most %.0f s)",
            grace,
        )
        time.sleep(grace)
        leave(f"SIGTERM: the step in flight did not end within {grace:.0f} s")


def leave(reason: str) -> None:
    """End this worker now, as SIGTERM would have (its connections close with it, so peers
    blocked on it fail at once and re-form)."""
    log.warning("%s", reason)
    logging.shutdown()
    os._exit(128 + signal.SIGTERM)


class World:
    """This worker's place in the world, kept through changes of the world.

    Attributes:
        failures: What a collective raises when a peer is lost (catch these and call
            :meth:`recover`).
    """

    failures: tuple[type[BaseException], ...] = (RuntimeError,)

    def __init__(
        self,
        directory: Path | None,
        published: handoff.PublishedRound | None,
        switched: SwitchedStore | None,
        timeout: datetime.timedelta,
    ) -> None:
        self._directory = directory
        self._switched = switched
        self._timeout = timeout
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._round = published.round if published is not None else 0
        self._group_rank = int(os.environ.get("GROUP_RANK", "0"))
        self._master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        self._fresh = True
        self._target: _Target | None = None
        self._seen: tuple[int, int] | None = None
        """(inode, mtime) of the round file last read: it is read again only when changed."""
        self._latest = published
        self._stop = _StepBoundaryStop()

    # -- what the training loop reads ----------------------------------------------------

    @property
    def in_place(self) -> bool:
        """Whether changes of the world are re-formed in place (else torch restarts)."""
        return self._switched is not None

    @property
    def rank(self) -> int:
        return int(dist.get_rank())

    @property
    def world_size(self) -> int:
        return int(dist.get_world_size())

    @property
    def group_rank(self) -> int:
        """This node's rank among the nodes of the current round."""
        return self._group_rank

    @property
    def round(self) -> int:
        """The rendezvous round whose world this worker is in (0 off the in-place path)."""
        return self._round

    @property
    def master(self) -> str:
        """``addr:port`` of the current round's store."""
        return self._master

    # -- the training loop's two calls ---------------------------------------------------

    def reformed(self) -> bool:
        """Call at every step boundary, on every rank (on the in-place path it is a small
        all-reduce). True once after each change of the world, and at the first call: the
        world may have new members, so share the training state (e.g. broadcast it from
        rank 0, always a worker that was there before) before the next step.

        If the node was admitted to a newer round (a node arrived) and every worker of
        that round is there, the workers switch to it here, together.
        """
        if self._stop.requested.is_set():
            leave("SIGTERM: the step in flight is done; leaving at the step boundary")
        self._stop.in_step = False
        try:
            return self._reformed()
        finally:
            self._stop.in_step = True

    def _reformed(self) -> bool:
        if self._fresh:
            self._fresh = False
            return True
        if self._switched is None:
            return False
        target = self._follow()
        mine = target.round if target is not None and self._everyone_there(target) else 0
        agreed = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if target is None or mine == 0 or int(agreed[0]) != -int(agreed[1]):
            return False  # not every worker of this world is there for the same round
        try:
            self._reform(target)
        except InPlaceFallback:
            raise
        except Exception as failure:
            self._fall_back(f"{type(failure).__name__}: {failure}")
        log.warning(
            "re-formed in place at a step boundary: round %d, rank %d of %d",
            self._round,
            *self._ranks(),
        )
        return True

    def recover(self, error: BaseException | None = None) -> None:
        """Call when a collective raised one of :attr:`failures`: re-forms the world in
        place around the workers that remain, then returns (the next :meth:`reformed` is
        True). Off the in-place path it re-raises ``error``; when the in-place path fails
        it asks torch's agent to restart the workers and waits for that (bounded, then
        :class:`InPlaceFallback`)."""
        if self._switched is None:
            if error is not None:
                raise error
            raise InPlaceFallback("this worker is not on the in-place path")
        self._stop.in_step = False
        log.warning("a collective failed (%s); re-forming the world in place", error)
        started = time.monotonic()
        _release(error)
        try:
            self._solo()
            deadline = time.monotonic() + self._timeout.total_seconds()
            while (target := self._follow()) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no round after round {self._round} reached this node within "
                        f"{self._timeout.total_seconds():.0f} s"
                    )
                time.sleep(POLL_SECONDS)
            self._reform(target)
        except InPlaceFallback:
            raise
        except Exception as failure:
            self._fall_back(f"{type(failure).__name__}: {failure}", cause=error)
        self._fresh = True
        log.warning(
            "re-formed in place in round %d: rank %d of %d, %.3f s after the failure",
            self._round,
            *self._ranks(),
            time.monotonic() - started,
        )

    # -- the path ------------------------------------------------------------------------

    def _ranks(self) -> tuple[int, int]:
        return self.rank, self.world_size

    def _follow(self) -> _Target | None:
        """The latest round this node's handler re-formed in place, if newer than this
        worker's; :class:`InPlaceFallback` once the handler gave up."""
        assert self._directory is not None
        path = self._directory / handoff.ROUND_FILE
        status = path.stat()
        seen = (status.st_ino, status.st_mtime_ns)
        if seen != self._seen:
            self._seen = seen
            self._latest = handoff.read_round(self._directory)
        latest = self._latest
        if latest is None:
            return None
        if latest.fallback is not None:
            self._fall_back(f"the node's handler gave up: {latest.fallback}")
        if latest.round <= self._round or latest.base_rank is None or latest.world_size is None:
            return None  # not newer, or a round torch's agent joined (it restarts us)
        if self._target is None or self._target.round != latest.round:
            self._target = _Target(latest, latest.base_rank + self._local_rank, latest.world_size)
        return self._target

    def _announce(self, target: _Target) -> Store:
        """Reach ``target``'s store and say this worker is there (once)."""
        if target.store is None:
            target.store = _client(target.published.master)
        if not target.announced:
            target.store.set(target.key("present"), str(os.getpid()))
            target.announced = True
        return target.store

    def _everyone_there(self, target: _Target) -> bool:
        """Whether every worker of ``target`` is there (a newcomer is, once it has started
        and joined; the workers already training, once they saw the round)."""
        try:
            return bool(self._announce(target).check(target.keys("present")))
        except RuntimeError as error:  # its store is gone: a newer round will come
            log.info("round %d's store did not answer (%s)", target.round, error)
            return False

    def _solo(self) -> None:
        """Reconfigure into a world of this worker alone. That drops the old communicator
        and every connection it held, so peers still blocked on this worker in a
        collective fail at once and recover too (gloo's abort() does not wake them)."""
        assert self._switched is not None
        self._switched.inner = HashStore()
        c10d._reconfigure(random.getrandbits(62), [c10d._get_reconfigure_handle()]).wait()

    def _reform(self, target: _Target) -> None:
        """Publish this worker's handle in ``target``'s store, wait for every worker's and
        reconfigure the default group with them in rank order. While some are missing, a
        newer round (one without a node lost meanwhile) replaces ``target``."""
        assert self._switched is not None
        deadline = time.monotonic() + self._timeout.total_seconds()
        target, store = self._handles(target, deadline)
        keys = target.keys("handle")
        handles = [bytes(value).decode() for value in store.multi_get(keys)]
        self._switched.inner = PrefixStore(f"{KEY_PREFIX}/{target.round}/group", store)
        c10d._reconfigure(target.published.uuid, handles, timeout=RECONFIGURE_TIMEOUT).wait()
        if self._ranks() != (target.rank, target.world_size):
            raise RuntimeError(
                f"reconfigured as rank {self.rank} of {self.world_size}, expected "
                f"{target.rank} of {target.world_size}"
            )
        self._round = target.round
        self._group_rank = target.published.group_rank
        self._master = target.published.master
        self._target = None
        self._register()

    def _handles(self, target: _Target, deadline: float) -> tuple[_Target, Store]:
        """The round whose every worker published its handle (``target``, or a newer one
        that replaced it), and its store. A round whose store stops answering (its rank 0
        died since) is waited out: the next one comes without it."""
        while True:
            store: Store | None = None
            try:
                store = self._announce(target)
                # Published only now: nothing changes this worker's handle until it
                # reconfigures, so no peer can read a stale one.
                store.set(target.key("handle"), c10d._get_reconfigure_handle())
            except RuntimeError as error:
                log.info("round %d's store did not answer (%s)", target.round, error)
                store = None
            while True:
                try:
                    if store is not None and store.check(target.keys("handle")):
                        return target, store
                except RuntimeError as error:
                    log.info("round %d's store did not answer (%s)", target.round, error)
                    store = None
                newer = self._follow()
                if newer is not None and newer is not target:
                    log.info(
                        "round %d replaced round %d before it formed", newer.round, target.round
                    )
                    target = newer
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"not every worker of round {target.round} published its handle "
                        f"within {self._timeout.total_seconds():.0f} s"
                    )
                time.sleep(POLL_SECONDS)

    def _register(self, fallback: str | None = None) -> None:
        assert self._directory is not None
        handoff.write(
            self._directory,
            handoff.worker_file(self._local_rank),
            handoff.WorkerRecord(self._local_rank, _agents_pid(), self._round, fallback),
        )

    def _fall_back(self, reason: str, cause: BaseException | None = None) -> None:
        """Give up: tell the node's handler, whose agent then restarts the workers, and
        wait for that (the agent's SIGTERM ends the wait), bounded."""
        log.error("in-place re-forming failed (%s); falling back to torch's restart", reason)
        if self._directory is not None:
            try:
                self._register(fallback=reason)
            except OSError as error:
                log.error("could not tell the node's handler: %s", error)
        time.sleep(_RESTART_WAIT_SECONDS)
        raise InPlaceFallback(
            f"in-place re-forming failed ({reason}) and torch's agent did not restart this "
            f"worker within {_RESTART_WAIT_SECONDS:.0f} s"
        ) from cause


def _agents_pid() -> int:
    """The pid torch's agent knows this worker by: its warm start's client, if it was
    forked warm (the agent started the client), else its own."""
    return int(os.environ.get(warm.WORKER_PID_ENV, os.getpid()))


def _release(error: BaseException | None) -> None:
    """Drop ``error``'s tracebacks (its chain's too). Their frames hold the failed
    collective's work, which holds the old communicator: while it lives, its connections
    stay open, and peers blocked on this worker are not woken by :meth:`World._solo`
    (seen: five of six survivors blocked for minutes)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _client(master: str) -> Store:
    """A client of a round's store. Bounded like a reconfigure: the round was just sealed
    and its rank 0 serves it, unless it died since (then a newer round comes)."""
    host, _, port = master.rpartition(":")
    return TCPStore(
        host_name=host.strip("[]"),
        port=int(port),
        is_master=False,
        timeout=RECONFIGURE_TIMEOUT,
        wait_for_workers=False,
    )


def _why_not(directory: str | None) -> str | None:
    """Why this worker cannot re-form in place, if it cannot."""
    if not directory:
        return f"{handoff.DIRECTORY_ENV} is not set: run torchrun with --rdzv-conf in_place=1"
    if not hasattr(c10d, "_reconfigure"):
        return f"torch {torch.__version__} cannot reconfigure a process group (2.14 adds it)"
    return None


def init_process_group(
    backend: str = "gloo",
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    **options: Any,
) -> World:
    """Join the world torchrun started this worker in, able to re-form it in place.

    Replaces ``dist.init_process_group(backend)``: with ``--rdzv-conf in_place=1`` the
    default group is created for reconfiguring and formed with every worker of the
    round; otherwise, or if this torch or backend cannot reconfigure, it is created as
    usual from torchrun's environment (logged), and changes go through torch's restart.

    Args:
        backend: The process group backend (gloo; nccl with NCCL >= 2.28).
        timeout: Bound on each wait of the in-place path (see :data:`DEFAULT_TIMEOUT`).
        options: Passed on to ``dist.init_process_group``.
    """
    directory = os.environ.get(handoff.DIRECTORY_ENV)
    reason = _why_not(directory)
    published = None
    if reason is None:
        assert directory is not None
        published = handoff.read_round(Path(directory))
        master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        if published is None or published.master != master:
            reason = (
                f"the node's handler published {published}, not the round this worker was "
                f"started in (its store at {master})"
            )
    if reason is not None:
        log.warning("in-place re-forming is off (%s); torch's restart handles changes", reason)
        dist.init_process_group(backend, **options)
        return World(None, None, None, timeout)
    assert directory is not None and published is not None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = _client(published.master)
    switched = SwitchedStore(PrefixStore(f"{KEY_PREFIX}/{published.round}/group", client))
    dist.init_process_group(
        backend,
        store=PrefixStore("default_pg", switched),
        rank=rank,
        world_size=world_size,
        enable_reconfigure=True,
        **options,
    )
    if not c10d._supports_reconfigure():
        # The backend ignored enable_reconfigure, and so needs the store to form now.
        dist.destroy_process_group()
        log.warning(
            "in-place re-forming is off (the %s backend cannot reconfigure); torch's "
            "restart handles changes",
            backend,
        )
        dist.init_process_group(backend, **options)
        return World(None, None, None, timeout)
    world = World(Path(directory), published, switched, timeout)
    target = _Target(published, rank, world_size)
    target.store = client
    try:
        world._reform(target)
    except InPlaceFallback:
        raise
    except Exception as failure:
        world._fall_back(f"{type(failure).__name__}: {failure}")
    # For the life of the worker: the world it watches for is the process's default group.
    cut_peers.Watch(Path(directory), lambda: world.round).start()
    world._stop.install()
    return world
