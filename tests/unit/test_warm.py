"""Warm worker starts (k8s_rendezvous.warm), with real processes: one zygote (torch imported
once) serves the tests' clients as torch's agent would start them.

Aspects: a worker started warm runs forked from the zygote, with torch already imported,
and with the client's arguments, environment, working directory and standard streams, and
the client exits with its exit code (a script, or ``-m`` and a module); a signal sent to
the client's process group (what the agent sends) reaches the worker, and the client dies
by the same signal; a client killed outright takes its worker with it; a malformed request
is refused and the zygote goes on serving; a request sent while the zygote still imports
is served once it is done; without a zygote, or with one whose preloads fail (named), the
client runs the script itself (a cold start); the zygote ends, with its workers and its
socket, when the agent's pipe closes; killed outright, it leaves no file behind; it refuses
a process of another user, or one not descended from its agent, and a client does not
hand its request to another user's listener (it starts cold).
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devkit.cluster.controlplane import pid_alive
from devkit.waiting import wait_for
from k8s_rendezvous import warm

NOBODY = 65534

REPORT = """\
import json, os, sys, time
started = {
    "argv": sys.argv[1:], "cwd": os.getcwd(), "value": os.environ.get("WARM_TEST_VALUE"),
    "pid": os.getpid(), "ppid": os.getppid(), "torch": "torch" in sys.modules,
    "gate": "gate_module" in sys.modules,
}
print(json.dumps(started), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    with open(sys.argv[2], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def zygote() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    saved = os.environ.get(warm.SOCKET_ENV)
    process = warm.start_zygote()
    path = os.environ[warm.SOCKET_ENV]
    try:
        wait_for(lambda: _listening(path), 120, "the zygote listens")
        yield process, path
    finally:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(60)
        if saved is None:
            os.environ.pop(warm.SOCKET_ENV, None)
        else:
            os.environ[warm.SOCKET_ENV] = saved


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "report.py"
    path.write_text(REPORT)
    return path


def run_client(*args: str, socket_path: str | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != warm.SOCKET_ENV}
    env["WARM_TEST_VALUE"] = "from the client"
    if socket_path is not None:
        env[warm.SOCKET_ENV] = socket_path
    return subprocess.run(
        [sys.executable, "-u", "-m", "k8s_rendezvous.warm", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_warm_worker_runs_forked_from_the_zygote_as_the_client_asked(
    zygote: tuple[subprocess.Popen[bytes], str], script: Path, tmp_path: Path
) -> None:
    process, path = zygote
    done = run_client(str(script), "3", "two words", socket_path=path, cwd=tmp_path)
    started = json.loads(done.stdout)
    assert started["ppid"] == process.pid, "forked by the zygote"
    assert started["torch"], "torch imported before the script ran"
    assert started["argv"] == ["3", "two words"]
    assert (started["cwd"], started["value"]) == (str(tmp_path), "from the client")
    assert done.stderr == "to stderr\n"
    assert done.returncode == 3


def test_a_module_runs_warm_as_python_m_runs_it(
    zygote: tuple[subprocess.Popen[bytes], str], script: Path, tmp_path: Path
) -> None:
    process, path = zygote
    done = run_client("-m", "report", "0", socket_path=path, cwd=script.parent)
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout.splitlines()[0])
    assert (started["ppid"], started["argv"]) == (process.pid, ["0"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_clients_group_ends_its_worker(
    zygote: tuple[subprocess.Popen[bytes], str],
    script: Path,
    tmp_path: Path,
    signum: signal.Signals,
) -> None:
    """SIGTERM is forwarded to the worker's group, and the client dies by it as the
    worker did; SIGKILL cannot be forwarded: the zygote sees the client's connection
    close and kills the worker."""
    _, path = zygote
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, warm.SOCKET_ENV: path}
    waiting = subprocess.Popen(
        [sys.executable, "-u", "-m", "k8s_rendezvous.warm", str(script), "wait", str(pid_file)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # as torch's agent starts its workers
    )
    try:
        worker = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "worker up"))
        assert worker != waiting.pid
        os.killpg(waiting.pid, signum)
        assert waiting.wait(60) == -signum
        wait_for(lambda: not pid_alive(worker), 30, f"worker {worker} ended with its client")
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()


def test_a_malformed_request_is_refused_and_the_zygote_serves_on(
    zygote: tuple[subprocess.Popen[bytes], str], script: Path, tmp_path: Path
) -> None:
    _, path = zygote
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(warm._address(path))
        body = json.dumps({"schemaVersion": 99, "argv": ["x"]}).encode()
        connection.sendall(len(body).to_bytes(4, "big") + body)
        assert connection.recv(1) == b"", "closed without starting anything"
    done = run_client(str(script), "0", socket_path=path, cwd=tmp_path)
    assert done.returncode == 0


def test_without_a_zygote_the_client_runs_the_script_itself(script: Path, tmp_path: Path) -> None:
    done = run_client(str(script), "5", socket_path=str(tmp_path / "none.sock"), cwd=tmp_path)
    started = json.loads(done.stdout)
    assert started["ppid"] == os.getpid(), "the client is the worker"
    assert (started["argv"], started["value"]) == (["5"], "from the client")
    assert done.returncode == 5


def test_the_zygote_ends_with_its_workers_when_the_agent_goes(script: Path, tmp_path: Path) -> None:
    saved = os.environ.get(warm.SOCKET_ENV)
    process = warm.start_zygote()
    path = os.environ[warm.SOCKET_ENV]
    if saved is not None:
        os.environ[warm.SOCKET_ENV] = saved
    pid_file = tmp_path / "worker.pid"
    waiting: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _listening(path), 120, "the zygote listens")
        waiting = subprocess.Popen(
            [sys.executable, "-u", "-m", "k8s_rendezvous.warm", str(script), "wait", str(pid_file)],
            env={**os.environ, warm.SOCKET_ENV: path},
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
        )
        worker = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "up"))
        assert worker != waiting.pid, "forked by the zygote"
        assert process.stdin is not None
        process.stdin.close()
        assert process.wait(60) == 0
        assert not pid_alive(worker)
        assert not _listening(path), "its socket closed"
    finally:
        for running in (waiting, process):
            if running is None:
                continue
            if running.poll() is None:
                running.kill()
            running.wait()
        if saved is None:
            os.environ.pop(warm.SOCKET_ENV, None)


def _listening(name: str) -> bool:
    """Whether a socket listens on ``name`` (``@NAME`` for an abstract one, as
    /proc/net/unix shows it)."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]
        if len(fields) == 8 and fields[7] == name and int(fields[3], 16) & 0x10000:  # ACCEPTCON
            return True
    return False


GATE_MODULE = """\
import os
with open(os.environ["WARM_TEST_GATE"]) as gate:  # until the test opens it for writing
    gate.read()
"""


@pytest.fixture
def own_zygote_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote of the test's own (its environment restored afterwards)."""
    monkeypatch.delenv(warm.SOCKET_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), *sys.path])))


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.stdin is not None:
        process.stdin.close()
    return process.wait(60)


def test_a_request_sent_while_the_zygote_imports_is_served_once_it_is_done(
    own_zygote_env: None, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    (tmp_path / "gate_module.py").write_text(GATE_MODULE)
    monkeypatch.setenv("WARM_TEST_GATE", str(gate))
    monkeypatch.setenv(warm.PRELOAD_ENV, "gate_module")
    process = warm.start_zygote()
    path = os.environ[warm.SOCKET_ENV]
    read_end, write_end = os.pipe()
    try:
        wait_for(lambda: _listening(path), 60, "the zygote listens")
        request = warm.StartRequest((str(script), "0"), dict(os.environ), str(tmp_path), True)
        body = json.dumps(request.to_dict()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(warm._address(path))  # while the zygote waits on the gate
            socket.send_fds(connection, [len(body).to_bytes(4, "big")], [0, write_end, 2])
            connection.sendall(body)
            os.close(write_end)
            write_end = -1
            with open(gate, "w"):
                pass  # the import ends
            with os.fdopen(read_end) as output:
                read_end = -1
                started = json.loads(output.readline())
        assert started["ppid"] == process.pid and started["gate"] and started["torch"]
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        _stop(process)


def test_a_preload_that_fails_is_named_and_workers_start_cold(
    own_zygote_env: None,
    script: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(warm.PRELOAD_ENV, "no_such_module_here")
    process = warm.start_zygote()
    path = os.environ[warm.SOCKET_ENV]
    try:
        done = run_client(str(script), "0", socket_path=path, cwd=tmp_path)
        assert done.returncode == 0
        assert json.loads(done.stdout.splitlines()[-1])["ppid"] == os.getpid(), "cold"
    finally:
        code = _stop(process)
    assert code == 1
    assert "cannot import no_such_module_here ahead" in capfd.readouterr().err


def _warm_entries() -> set[str]:
    return {
        entry
        for directory in {tempfile.gettempdir(), "/tmp"}
        for entry in glob.glob(os.path.join(directory, "k8s-rdzv-warm-*"))
    }


def test_a_zygote_killed_outright_leaves_nothing_behind(
    own_zygote_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _warm_entries()
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    (tmp_path / "gate_module.py").write_text(GATE_MODULE)
    monkeypatch.setenv("WARM_TEST_GATE", str(gate))
    monkeypatch.setenv(warm.PRELOAD_ENV, "gate_module")
    process = warm.start_zygote()
    name = os.environ[warm.SOCKET_ENV]
    try:
        with open(gate, "w"):  # returns once the zygote imports: it listens
            assert _listening(name)
            os.kill(process.pid, signal.SIGKILL)
            assert process.wait(60) == -signal.SIGKILL
        assert not _listening(name)
        assert _warm_entries() - before == set()
    finally:
        if process.poll() is None:
            process.kill()
        _stop(process)


def _request(name: str, script: Path, stream: int) -> list[dict[str, object]]:
    """Ask the zygote at ``name`` to run ``script 0`` with ``stream`` as the three standard
    streams; the replies until it closes the connection (none: refused)."""
    request = warm.StartRequest((str(script), "0"), dict(os.environ), str(script.parent), True)
    body = json.dumps(request.to_dict()).encode()
    received = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(120)  # the zygote accepts once it has imported torch
        connection.connect(warm._address(name))
        try:
            socket.send_fds(connection, [len(body).to_bytes(4, "big")], [stream] * 3)
            connection.sendall(body)
            while chunk := connection.recv(4096):
                received += chunk
        except (BrokenPipeError, ConnectionResetError):  # closed with the request unread
            pass
    replies = []
    while received:
        size = int.from_bytes(received[:4], "big")
        replies.append(json.loads(received[4 : 4 + size]))
        received = received[4 + size :]
    return replies


def _forked(body: Callable[[], int]) -> int:
    """Run ``body`` in a child forked from this process; its result is the exit code (3 if
    it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = body()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing uid needs root")


@needs_root
def test_a_process_of_another_user_is_refused(
    zygote: tuple[subprocess.Popen[bytes], str], script: Path
) -> None:
    _, name = zygote
    with open(os.devnull, "r+b") as devnull:

        def as_nobody() -> int:
            os.setuid(NOBODY)
            return len(_request(name, script, devnull.fileno()))

        assert _forked(as_nobody) == 0, "closed without a reply"
        served = _request(name, script, devnull.fileno())
    assert [sorted(reply) for reply in served] == [
        ["pid", "schemaVersion"],
        ["exitCode", "schemaVersion"],
    ], "the same request from the agent's own user is served"


def test_a_process_not_descended_from_the_agent_is_refused(
    zygote: tuple[subprocess.Popen[bytes], str], script: Path
) -> None:
    _, name = zygote
    go_read, go_write = os.pipe()
    answer_read, answer_write = os.pipe()
    open_fds = {go_read, go_write, answer_read, answer_write}

    def orphan() -> int:
        if os.fork() == 0:  # orphaned once its parent is reaped, before it is let go
            code = 3
            try:
                os.close(go_write)
                if os.read(go_read, 1):
                    with open(os.devnull, "r+b") as devnull:
                        replies = _request(name, script, devnull.fileno())
                    answer = {"ppid": os.getppid(), "replies": len(replies)}
                    os.write(answer_write, json.dumps(answer).encode())
                code = 0
            finally:
                os._exit(code)
        return 0

    try:
        assert _forked(orphan) == 0
        for fd in (go_read, answer_write):
            os.close(fd)
            open_fds.discard(fd)
        os.write(go_write, b"go")
        with os.fdopen(answer_read) as answers:
            open_fds.discard(answer_read)
            answer = json.loads(answers.read() or "null")  # to its end: the orphan exited
    finally:
        for fd in open_fds:
            os.close(fd)
    assert answer is not None, "the orphan answered"
    assert answer["ppid"] != os.getpid(), "not a descendant of the zygote's agent"
    assert answer["replies"] == 0, "closed without a reply"


@needs_root
def test_a_client_does_not_hand_its_request_to_another_users_listener(
    script: Path, tmp_path: Path
) -> None:
    name = f"@k8s-rdzv-warm-test-{secrets.token_hex(8)}"
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    listener = os.fork()
    if listener == 0:
        try:
            os.close(ready_read)
            os.close(done_write)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as impostor:
                impostor.bind(warm._address(name))
                impostor.listen()
                os.write(ready_write, b"x")
                os.read(done_read, 1)  # until the test closes its end
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(done_read)
    try:
        assert os.read(ready_read, 1) == b"x", "the impostor listens"
        done = run_client(str(script), "0", socket_path=name, cwd=tmp_path)
    finally:
        os.close(ready_read)
        os.close(done_write)
        os.waitpid(listener, 0)
    assert done.returncode == 0
    assert json.loads(done.stdout)["ppid"] == os.getpid(), "cold: the client ran it"
    assert f"{name} is served by uid {NOBODY}" in done.stderr
