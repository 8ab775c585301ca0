"""Warm worker starts: torch imported once per node, and each worker forked from it.

When the world changes, torch's agent stops its workers and starts new ones, and each new
worker imports torch before its first step. On a node of few cores that import is most of
the time from a failure to training resumed (bench/results/recovery). With
``--rdzv-conf warm_start=1`` the handler starts a *zygote* beside the agent: a process
that imports torch (and the modules ``K8S_RDZV_WARM_PRELOAD`` names, comma-separated)
once, then forks a worker for each start, as torch's DataLoader forks its workers. The
workers' entrypoint is then this module, a thin client that imports no torch::

    torchrun --rdzv-backend=kubernetes --rdzv-conf warm_start=1 ... \\
        -m k8s_rendezvous.warm train.py ARGS...

The client hands the zygote its arguments, environment, working directory and standard
streams (the descriptors themselves, so torchrun's ``--redirects`` and ``--tee`` hold).
Towards the agent it stands in for the forked worker: it forwards the signals the agent
sends to the worker's process group (the agent signals its own worker's group alike), and
exits as the worker exits, by the same signal if one ended it. A client killed outright
(SIGKILL) closes its connection, and the zygote kills the worker's group; a worker dies
with its zygote. A client that comes while the zygote still imports waits for it (the
rest of one import, instead of one more beside it on the same cores). One that finds no
zygote, or loses it before its worker was forked, runs the script itself: a cold start,
as without this module.

The zygote listens on an abstract Unix socket of a random name (nothing in the filesystem
to outlive a node killed outright), and serves only processes of its own user that
descend from its agent; others are refused, and start cold.

What a worker inherits from the zygote instead of its own start: whatever torch and the
preloaded modules read from the environment at import (the agent's environment when the
handler started). torchrun's per-worker variables (``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ...) are read later, and are the client's.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import os
import runpy
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

SOCKET_ENV: Final = "K8S_RDZV_WARM_SOCKET"
"""Where the workers find the zygote (set in the agent's environment, which they inherit):
``@NAME`` for the abstract socket ``\\0NAME``, as ``ss`` shows it, or a path."""
WORKER_PID_ENV: Final = "K8S_RDZV_WARM_CLIENT_PID"
"""Set in a forked worker: the pid of the client that stands in for it, which is the pid
torch's agent knows the worker by (k8s_rendezvous.in_place reports itself under it)."""
PRELOAD_ENV: Final = "K8S_RDZV_WARM_PRELOAD"
"""More modules for the zygote to import ahead, comma-separated (torch always is)."""
READY_MESSAGE: Final = "k8s_rendezvous.warm: the zygote is ready"
"""Logged (stderr) once the zygote has imported ahead: workers forked from now start warm."""
SCHEMA_VERSION: Final = 1
_PRELOADED: Final = ("torch", "torch.distributed")
_STANDARD_STREAMS: Final = (0, 1, 2)
_MAX_MESSAGE_BYTES: Final = 16 << 20
_PR_SET_PDEATHSIG: Final = 1
_PEERCRED: Final = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""
_MAX_ANCESTRY: Final = 64
_FORWARDED_SIGNALS: Final = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class ProtocolError(Exception):
    """A message between a client and the zygote that cannot be read."""


@dataclasses.dataclass(frozen=True)
class StartRequest:
    """What a client asks the zygote to run, as ``python [-u] ARGV...`` would."""

    argv: tuple[str, ...]
    """The script and its arguments, or ``-m``, a module and its arguments."""
    env: Mapping[str, str]
    cwd: str
    unbuffered: bool
    """Whether the client runs with ``python -u`` (torchrun starts workers so)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schemaVersion": SCHEMA_VERSION,
            "argv": list(self.argv),
            "env": dict(self.env),
            "cwd": self.cwd,
            "unbuffered": self.unbuffered,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StartRequest:
        if data.get("schemaVersion") != SCHEMA_VERSION:
            raise ProtocolError(
                f"start request of schema version {data.get('schemaVersion')!r}, not "
                f"{SCHEMA_VERSION}: the client and the zygote are of different releases"
            )
        argv, env, cwd = data.get("argv"), data.get("env"), data.get("cwd")
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(arg, str) for arg in argv)
            or not isinstance(env, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            or not isinstance(cwd, str)
        ):
            raise ProtocolError(f"malformed start request: {sorted(data)}")
        return cls(tuple(argv), env, cwd, bool(data.get("unbuffered")))


# -- framing: a 4-byte length, then JSON; the client's streams ride on the length -----------


def _send(connection: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    header = struct.pack("!I", len(body))
    if fds:
        socket.send_fds(connection, [header], list(fds))
    else:
        connection.sendall(header)
    connection.sendall(body)


def _exactly(connection: socket.socket, size: int) -> bytes:
    chunks, missing = [], size
    while missing:
        chunk = connection.recv(missing)
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _receive(connection: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    if max_fds:
        header, fds, _, _ = socket.recv_fds(connection, 4, max_fds)
        if not header:
            raise EOFError("the other end closed the connection")
    else:
        header = b""
    try:
        header += _exactly(connection, 4 - len(header))
        (size,) = struct.unpack("!I", header)
        if size > _MAX_MESSAGE_BYTES:
            raise ProtocolError(f"a message of {size} bytes is more than a start request needs")
        message = json.loads(_exactly(connection, size))
        if not isinstance(message, dict):
            raise ProtocolError("a message is not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def _address(name: str) -> str:
    """The socket address ``name`` (a ``SOCKET_ENV`` value) stands for."""
    # An environment variable or an argument cannot hold the abstract name's leading NUL.
    return "\0" + name[1:] if name.startswith("@") else name


def _peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end (as of its connect or listen)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, _ = _PEERCRED.unpack(credentials)
    return pid, uid


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (``pid`` 0, a
    process of another pid namespace, is not)."""
    for _ in range(_MAX_ANCESTRY):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            return False
    return False


# -- the agent's side ----------------------------------------------------------------------


def start_zygote() -> subprocess.Popen[bytes]:
    """Start the zygote for this agent's workers, and point them at it (``SOCKET_ENV`` in
    this process' environment, which torch's agent gives each worker). It lives as long
    as this process: it exits when its standard input, a pipe from here, closes."""
    # Abstract: the kernel frees the name with the zygote's socket, where a socket file
    # would outlive a node killed outright (SIGKILL runs no clean-up). Random, so that no
    # other process can take the name first.
    name = f"@k8s-rdzv-warm-{secrets.token_hex(16)}"
    process = subprocess.Popen(
        [sys.executable, "-m", "k8s_rendezvous.warm", "--zygote", name],
        stdin=subprocess.PIPE,
    )
    os.environ[SOCKET_ENV] = name
    return process


# -- the zygote ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    pid: int
    client: socket.socket | None
    """``None`` once the client is gone (the worker was killed then)."""


class Zygote:
    """Imports ahead, then forks a worker per client; single-threaded, so that a fork
    copies no lock another thread holds."""

    def __init__(self, name: str) -> None:
        self._address = _address(name)
        self._agent = os.getppid()
        """Whose workers it serves: the process that started it, and its descendants."""
        self._selector = selectors.DefaultSelector()
        self._workers: dict[int, _Worker] = {}
        """By the pidfd that tells when each exits."""
        self._listener: socket.socket | None = None

    def serve(self) -> StartRequest | None:
        """Serve until the agent goes; returns only in a forked worker, with what it is
        to run (the zygote's own state closed)."""
        # Listening first: a client that comes while the imports run waits in the backlog
        # (the rest of one import) instead of importing torch beside it, on the same cores.
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._address)
        self._listener.listen(socket.SOMAXCONN)
        try:
            started = time.monotonic()
            preload = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",")]
            modules = (*_PRELOADED, *filter(None, preload))
            for module in modules:
                try:
                    importlib.import_module(module)
                except ImportError as error:
                    print(
                        f"k8s_rendezvous.warm: cannot import {module} ahead ({error}); "
                        f"fix {PRELOAD_ENV}. Workers start cold.",
                        file=sys.stderr,
                    )
                    raise SystemExit(1) from error
            # Said once, so that people (and tests) can tell a spare that waits warm.
            print(
                f"{READY_MESSAGE}: {', '.join(modules)} imported in "
                f"{time.monotonic() - started:.1f} s",
                file=sys.stderr,
            )
            self._selector.register(self._listener, selectors.EVENT_READ, "accept")
            self._selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "agent")
            while True:
                for key, _ in self._selector.select():
                    if key.data == "agent" and not os.read(sys.stdin.fileno(), 4096):
                        return None
                    if key.data == "accept":
                        request = self._accept()
                        if request is not None:
                            return request  # in the forked worker
                    elif isinstance(key.data, _Worker):
                        self._reap(key)
                    elif isinstance(key.data, int):
                        self._client_gone(key.data)
        finally:
            if self._listener is not None:  # still the zygote: a worker closed its own
                self._stop()

    def _accept(self) -> StartRequest | None:
        assert self._listener is not None
        client, _ = self._listener.accept()
        client.settimeout(10)  # a client stuck mid-request must not hold the others
        # An abstract socket has no file permissions: any process in this network
        # namespace (another container of the pod, too) can connect, and a worker runs
        # with its environment and as the zygote's user.
        pid, uid = _peer(client)
        if uid != os.getuid() or not _descends_from(pid, self._agent):
            print(
                f"k8s_rendezvous.warm: a connection from pid {pid} (uid {uid}) was refused: "
                f"only uid {os.getuid()}'s processes under pid {self._agent} are served",
                file=sys.stderr,
            )
            client.close()
            return None
        fds: list[int] = []
        try:
            message, fds = _receive(client, max_fds=len(_STANDARD_STREAMS))
            request = StartRequest.from_dict(message)
            if len(fds) != len(_STANDARD_STREAMS):
                raise ProtocolError(f"{len(fds)} descriptors sent, not the 3 standard streams")
        except (OSError, EOFError, ValueError, ProtocolError) as error:
            print(f"k8s_rendezvous.warm: a start request was refused: {error}", file=sys.stderr)
            client.close()
            for fd in fds:
                os.close(fd)
            return None
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_worker(zygote, fds)
            return request
        for fd in fds:
            os.close(fd)
        worker = _Worker(pid, client)
        pidfd = os.pidfd_open(pid)
        self._workers[pidfd] = worker
        self._selector.register(pidfd, selectors.EVENT_READ, worker)
        self._selector.register(client, selectors.EVENT_READ, pidfd)
        try:
            _send(client, {"schemaVersion": SCHEMA_VERSION, "pid": pid})
        except OSError:
            self._client_gone(pidfd)
        return None

    def _become_worker(self, zygote: int, fds: Sequence[int]) -> None:
        _die_with(zygote)
        os.setsid()  # its own group, which the client signals as the agent would
        for signum in _FORWARDED_SIGNALS:  # Python's own, which the zygote may have changed
            signal.signal(
                signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            )
        for target, fd in zip(_STANDARD_STREAMS, fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        self._selector.close()
        for pidfd, worker in self._workers.items():
            os.close(pidfd)
            if worker.client is not None:
                worker.client.close()
        self._workers.clear()
        assert self._listener is not None
        self._listener.close()
        self._listener = None

    def _reap(self, key: selectors.SelectorKey) -> None:
        pidfd = key.fd
        worker = self._workers.pop(pidfd)
        self._selector.unregister(pidfd)
        _, status = os.waitpid(worker.pid, 0)
        os.close(pidfd)
        if worker.client is not None:
            self._selector.unregister(worker.client)
            exited = {
                "schemaVersion": SCHEMA_VERSION,
                "exitCode": os.waitstatus_to_exitcode(status),
            }
            with contextlib.suppress(OSError):  # the client went meanwhile: nobody to tell
                _send(worker.client, exited)
            worker.client.close()

    def _client_gone(self, pidfd: int) -> None:
        """The client closed its connection while its worker runs (killed outright): the
        worker must not outlive it."""
        worker = self._workers[pidfd]
        assert worker.client is not None
        self._selector.unregister(worker.client)
        worker.client.close()
        worker.client = None
        _kill_group(worker.pid, signal.SIGKILL)

    def _stop(self) -> None:
        for worker in self._workers.values():
            _kill_group(worker.pid, signal.SIGKILL)
        for pidfd, worker in list(self._workers.items()):
            os.waitpid(worker.pid, 0)
            os.close(pidfd)
        if self._listener is not None:
            self._listener.close()


def _die_with(zygote: int) -> None:
    """Be killed when the zygote dies: a client that lost the zygote before learning its
    worker's pid starts cold, so a fork it never heard of must not run on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != zygote:  # it died before the request took
        os._exit(1)


def _kill_group(pid: int, signum: int) -> None:
    """Signal worker ``pid``'s process group (itself, if it has not made its group yet)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


# -- a worker, forked or cold --------------------------------------------------------------


def _run(request: StartRequest) -> None:
    """Run ``request`` in this process as ``python [-u] ARGV...`` would run it."""
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    if request.unbuffered:
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    argv = list(request.argv)
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit("k8s_rendezvous.warm: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = request.cwd
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


# -- the client ----------------------------------------------------------------------------


def _connect(name: str | None) -> socket.socket | None:
    if not name:
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(_address(name))
    except OSError:  # not started yet, still importing, or gone: a cold start
        connection.close()
        return None
    # The request carries this process' environment and streams: not to another user's
    # process that took the name of a zygote gone.
    _, uid = _peer(connection)
    if uid != os.getuid():
        print(
            f"k8s_rendezvous.warm: {name} is served by uid {uid}, not {os.getuid()}; starting cold",
            file=sys.stderr,
        )
        connection.close()
        return None
    return connection


def _start(argv: Sequence[str]) -> int:
    """Have the zygote run ``argv``, stand in for the worker, and return its exit code
    (negative: the signal that ended it); run it here if no zygote is ready."""
    request = StartRequest(
        tuple(argv),
        {**os.environ, WORKER_PID_ENV: str(os.getpid())},
        os.getcwd(),
        bool(getattr(sys.stdout, "write_through", False)),
    )
    connection = _connect(os.environ.get(SOCKET_ENV))
    if connection is None:
        _run(request)
        return 0
    with connection:
        try:
            _send(connection, request.to_dict(), _STANDARD_STREAMS)
            pid = int(_receive(connection)[0]["pid"])
        except (OSError, EOFError, KeyError, ValueError, ProtocolError) as error:
            # Nothing was forked for us (or it dies with the zygote): start cold.
            print(f"k8s_rendezvous.warm: no warm start ({error}); starting cold", file=sys.stderr)
            connection.close()
            _run(request)
            return 0
        for signum in _FORWARDED_SIGNALS:
            signal.signal(signum, lambda received, _frame: _kill_group(pid, received))
        try:
            return int(_receive(connection)[0]["exitCode"])
        except (EOFError, KeyError, ValueError) as error:
            _kill_group(pid, signal.SIGKILL)
            print(f"k8s_rendezvous.warm: lost the zygote ({error}); worker killed", file=sys.stderr)
            return 1


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m k8s_rendezvous.warm (SCRIPT | -m MODULE) [ARGS...]")
    if args[0] == "--zygote":
        request = Zygote(args[1]).serve()
        if request is not None:  # a forked worker: run it, then exit as Python does
            _run(request)
        return
    code = _start(args)
    if code < 0:  # die by the worker's signal, as the agent expects of its worker
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
