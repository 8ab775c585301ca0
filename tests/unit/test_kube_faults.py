"""Failure paths of the pod side's API client, with faults injected at the HTTP level by a
scripted local server (fast, deterministic; the real API server covers the rest).

Aspects: 5xx and 429 (the shared vocabulary's Unavailable) are retried with backoff until
they pass, never sooner than a
Retry-After asks; an API server that stays down past the budget, or refuses connections,
becomes RendezvousConnectionError saying so; 401 and 403 are retried only briefly (a
restarted API server refuses until its authorizer is ready), then name the role to bind;
404 names the ways to make the Rendezvous; 422 is a state error; a join creates the node's
Lease once (a refused create is retried as a create), then merge-patches it without a
resourceVersion (joins never conflict), and re-creates it if it was deleted, with the node's
request even when a heartbeat finds it gone; a watch that cannot start, or ends with an
expired version, raises the pod side's own error, never the client library's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from tests.support.local_http import QuietHandler, serving
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousStateError,
)

from k8s_rendezvous import kube
from k8s_rendezvous.errors import ApiServerSilentError, RendezvousNotFoundError
from k8s_rendezvous.wire import leases, objects

OBJECT = {
    "apiVersion": objects.API_VERSION,
    "kind": objects.KIND,
    "metadata": {"name": "r", "namespace": "ns", "resourceVersion": "7"},
    "spec": {"minNodes": 1, "maxNodes": 1, "runId": "r"},
}


class Script:
    """Answers requests with the next scripted status; records what it received."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.requests: list[tuple[str, str, dict[str, Any] | None]] = []
        self.arrivals: list[float] = []
        self.retry_after: str | None = None
        """Sent with every error answer when set."""


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script([])

    class Handler(QuietHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            script.requests.append((self.command, self.headers.get("Content-Type", ""), body))
            script.arrivals.append(time.monotonic())
            status = script.statuses.pop(0) if script.statuses else 200
            payload = (
                OBJECT
                if status == 200
                else {"kind": "Status", "code": status, "message": f"scripted {status}"}
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status != 200 and script.retry_after is not None:
                self.send_header("Retry-After", script.retry_after)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_POST = _answer

    with serving(Handler) as host:
        yield host, script


def rendezvous_client(host: str, retry_seconds: float = 5) -> kube.RendezvousClient:
    configuration = client.Configuration(host=host)
    configuration.retries = 0  # our retries, not urllib3's
    return kube.RendezvousClient(
        client.ApiClient(configuration), "ns", "r", retry_seconds=retry_seconds
    )


@pytest.mark.parametrize("status", [500, 501, 503, 429])
def test_transient_errors_are_retried_until_they_pass(
    server: tuple[str, Script], status: int
) -> None:
    host, script = server
    script.statuses = [status, status, 200]
    assert rendezvous_client(host).get()["metadata"]["name"] == "r"
    assert len(script.requests) == 3


def test_api_server_down_past_the_budget_is_a_connection_error(server: tuple[str, Script]) -> None:
    host, script = server
    script.statuses = [503] * 1000
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="503"):
        rendezvous_client(host, retry_seconds=0.5).get()
    assert 0.5 <= time.monotonic() - started < 5, "bounded by the budget, not forever"
    assert len(script.requests) > 2, "retried with backoff"


def test_unreachable_api_server_is_a_connection_error_that_says_so() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RendezvousConnectionError, match="unreachable for 0 s") as raised:
        rendezvous_client(f"http://127.0.0.1:{port}", retry_seconds=0.3).get()
    assert not isinstance(raised.value, ApiServerSilentError), "a refusal is an answer"


@contextlib.contextmanager
def closing_each_connection() -> Iterator[int]:
    """A local port whose server reads what each connection sends first, then closes it,
    as a Service's proxy or a load balancer does in front of an API server restarting."""
    with socket.socket() as closing:
        closing.bind(("127.0.0.1", 0))
        closing.listen(8)

        def close_each() -> None:
            with contextlib.suppress(OSError):
                while True:
                    accepted, _ = closing.accept()
                    accepted.recv(1024)
                    accepted.close()

        threading.Thread(target=close_each, daemon=True).start()
        yield closing.getsockname()[1]


@pytest.mark.parametrize(
    ("scheme", "said"),
    [
        ("http", "unreachable for 1 s"),
        # Closed after the ClientHello: a soak saw nodes take this for a cut network, and
        # stop their workers, while the API server restarted.
        ("https", "EOF"),
    ],
)
def test_a_server_that_closes_each_connection_unanswered_is_no_silence(
    scheme: str, said: str
) -> None:
    with closing_each_connection() as port:
        reader = rendezvous_client(f"{scheme}://127.0.0.1:{port}")
        with pytest.raises(RendezvousConnectionError, match=said) as raised:
            reader.get(budget_seconds=1.0)
    assert not isinstance(raised.value, ApiServerSilentError)


@pytest.mark.timeout(60, method="thread")
def test_a_read_with_a_budget_gives_up_on_a_server_that_never_answers() -> None:
    # A request on a pooled connection into a cut network: accepted, never answered.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        reader = rendezvous_client(f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(ApiServerSilentError, match="unreachable for 1 s"):
            reader.get(budget_seconds=1.0)
        elapsed = time.monotonic() - started
    assert elapsed < kube.rest.DEFAULT_TIMEOUT[1] / 3, "bounded by the budget, not the read timeout"


ENTRY = leases.NodeEntry("i", 2, "10.0.0.1", 29500)


def write_lease(client_: kube.RendezvousClient, entry: leases.NodeEntry | None = ENTRY) -> None:
    client_.write_lease("pod-a", "i", 30, "uid-1", entry)


def test_lasting_refusal_is_retried_briefly_then_names_the_role(
    server: tuple[str, Script],
) -> None:
    host, script = server
    script.statuses = [403] * 1000
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="ClusterRole k8s-rendezvous-worker"):
        write_lease(rendezvous_client(host, retry_seconds=0.5))
    assert 0.5 <= time.monotonic() - started < 5, "bounded by the budget"
    assert len(script.requests) > 1


def test_refusal_of_a_restarting_api_server_passes(server: tuple[str, Script]) -> None:
    """Right after a restart, kube-apiserver answers 403 until its authorizer has loaded
    the roles; such a refusal must not cost the join."""
    host, script = server
    script.statuses = [403, 401, 200]
    assert rendezvous_client(host).get()["metadata"]["name"] == "r"
    assert len(script.requests) == 3


def test_missing_rendezvous_names_the_ways_to_make_it(server: tuple[str, Script]) -> None:
    host, script = server
    script.statuses = [404]
    with pytest.raises(RendezvousNotFoundError, match="Annotate the Job"):
        rendezvous_client(host).get()


def test_rejected_entry_is_a_state_error(server: tuple[str, Script]) -> None:
    host, script = server
    script.statuses = [422]
    with pytest.raises(RendezvousStateError, match="scripted 422"):
        write_lease(rendezvous_client(host))


def test_join_creates_the_own_lease_once_then_merge_patches_it(
    server: tuple[str, Script],
) -> None:
    host, script = server
    rendezvous = rendezvous_client(host)
    write_lease(rendezvous)
    write_lease(rendezvous, dataclasses.replace(ENTRY, attempt=3))
    write_lease(rendezvous, entry=None)  # a heartbeat
    (created, joined, beat) = script.requests
    assert created[0] == "POST"
    lease = created[2]
    assert lease is not None
    assert lease["metadata"]["name"] == "r.pod-a"
    assert lease["metadata"]["labels"] == {objects.NODE_LABEL: "r"}
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert lease["spec"]["holderIdentity"] == "pod-a"
    annotations = lease["metadata"]["annotations"]
    assert leases.NodeEntry.from_annotation(annotations[objects.ENTRY_ANNOTATION], "e") == ENTRY
    method, content_type, body = joined
    assert (method, content_type) == ("PATCH", "application/merge-patch+json")
    assert body is not None and "resourceVersion" not in body["metadata"]
    written = body["metadata"]["annotations"][objects.ENTRY_ANNOTATION]
    assert leases.NodeEntry.from_annotation(written, "e").attempt == 3
    assert beat[0] == "PATCH"
    assert (
        beat[2] is not None and objects.ENTRY_ANNOTATION not in beat[2]["metadata"]["annotations"]
    )


def test_a_deleted_lease_is_created_again(server: tuple[str, Script]) -> None:
    host, script = server
    rendezvous = rendezvous_client(host)
    write_lease(rendezvous)
    script.statuses = [404]
    write_lease(rendezvous)
    assert [method for method, _, _ in script.requests] == ["POST", "PATCH", "POST"]


def test_a_heartbeat_that_finds_the_lease_deleted_makes_it_anew_with_the_request(
    server: tuple[str, Script],
) -> None:
    """Garbage collection takes a Lease with its deleted Rendezvous: the node's request
    must come back with the Lease, or nobody knows the node waits."""
    host, script = server
    rendezvous = rendezvous_client(host)
    write_lease(rendezvous, dataclasses.replace(ENTRY, attempt=3))
    script.statuses = [404]
    write_lease(rendezvous, entry=None)  # a heartbeat
    write_lease(rendezvous, entry=None)  # and one more, with the Lease there
    (_, patched, made, beat) = script.requests
    assert (patched[0], made[0], beat[0]) == ("PATCH", "POST", "PATCH")
    assert made[2] is not None
    written = made[2]["metadata"]["annotations"][objects.ENTRY_ANNOTATION]
    assert leases.NodeEntry.from_annotation(written, "e") == dataclasses.replace(ENTRY, attempt=3)
    # A renewal never writes the request: it could undo a newer join's.
    assert (
        beat[2] is not None and objects.ENTRY_ANNOTATION not in beat[2]["metadata"]["annotations"]
    )


@pytest.mark.parametrize("status", [429, 503])
def test_a_refused_create_is_retried_as_a_create(server: tuple[str, Script], status: int) -> None:
    """Many pods of one ServiceAccount joining at once meet API Priority and Fairness'
    429: the Lease was not made, so the retry creates it (one request, not a PATCH that
    fails with 404 and then a create)."""
    host, script = server
    script.statuses = [status, status, 201]
    write_lease(rendezvous_client(host))
    assert [method for method, _, _ in script.requests] == ["POST", "POST", "POST"]


def test_a_refusal_that_asks_to_wait_is_retried_no_sooner(server: tuple[str, Script]) -> None:
    """API Priority and Fairness answers a flow it cannot queue with 429 and Retry-After;
    retrying sooner only meets the full queue again."""
    host, script = server
    script.statuses, script.retry_after = [429, 200], "1"
    assert rendezvous_client(host).get()["metadata"]["name"] == "r"
    refused, served = script.arrivals
    assert served - refused >= 1.0


class ExpiredWatch(QuietHandler):
    """A watch that ends at once with the API server's 410: the version asked for is older
    than its watch cache keeps."""

    def do_GET(self) -> None:
        line = {
            "type": "ERROR",
            "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
        }
        data = (json.dumps(line) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_an_expired_watch_is_the_pod_sides_connection_error() -> None:
    with serving(ExpiredWatch) as host:
        events = rendezvous_client(host).watch_unless(None, "7", timeout_seconds=5)
        with pytest.raises(RendezvousConnectionError, match=r"answered 410 \(Expired: too old\)"):
            next(events)


def test_a_watch_refused_at_its_start_is_the_pod_sides_error(server: tuple[str, Script]) -> None:
    host, script = server
    script.statuses = [403]
    events = rendezvous_client(host).watch_unless(None, None, timeout_seconds=5)
    with pytest.raises(RendezvousConnectionError, match="ClusterRole k8s-rendezvous-worker"):
        next(events)
    assert len(script.requests) == 1, "the watcher's loop retries, not the client"


def test_a_watch_of_an_unreachable_api_server_says_so() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    events = rendezvous_client(f"http://127.0.0.1:{port}").watch_unless(None, None, 5)
    with pytest.raises(RendezvousConnectionError, match="was unreachable \\("):
        next(events)
