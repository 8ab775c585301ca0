"""The transport both sides send their requests through (``k8s_rendezvous.rest``), against
a local HTTP server: the answer comes back as JSON, the credentials are the client's and
are asked for at every request, a failed answer raises the shared error of its status with
the API server's message and its Retry-After, no answer raises Unavailable chained from the
transport's error (saying whether the other end answered at all), a watch's Status event
is the error of its code, and a timeout given as one number bounds the whole request."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator

import pytest
import urllib3
from kubernetes import client
from tests.support.local_http import QuietHandler, serving

from k8s_rendezvous import rest


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Answers ``GET /ok`` with ``{"ok": true}`` and anything else with a 409 Status;
    records each request's headers (names lowercased: HTTP's are case-insensitive)."""
    seen: list[dict[str, str]] = []

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            seen.append({name.lower(): value for name, value in self.headers.items()})
            ok = self.path == "/ok"
            data = json.dumps(
                {"ok": True} if ok else {"kind": "Status", "code": 409, "message": "taken"}
            ).encode()
            self.send_response(200 if ok else 409)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Retry-After", "2")
            self.end_headers()
            self.wfile.write(data)

    with serving(Handler) as host:
        yield host, seen


def token_key() -> str:
    """The ``api_key`` entry this client's ``auth_settings()`` reads: its own loaders fill
    ``authorization`` in older clients (31), ``BearerToken`` in newer ones."""
    probe = client.Configuration()
    for key in ("BearerToken", "authorization"):
        probe.api_key = {key: "probe"}
        if probe.auth_settings():
            return key
    raise AssertionError("this kubernetes client reads a bearer token from no known key")


def configuration(host: str, token: str) -> client.Configuration:
    made = client.Configuration(host=host)
    made.api_key = {token_key(): token}
    made.api_key_prefix = {token_key(): "Bearer"}
    made.retries = 0
    return made


def test_each_request_carries_the_token_the_configuration_holds_then(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    host, seen = server
    settings = configuration(host, "first")
    transport = rest.Rest(client.ApiClient(settings))
    assert transport.request("GET", "/ok") == {"ok": True}
    settings.api_key = {token_key(): "rotated"}  # as a pod's refreshed token file does
    transport.request("GET", "/ok")
    assert [headers["authorization"] for headers in seen] == ["Bearer first", "Bearer rotated"]
    assert all(headers["accept"] == "application/json" for headers in seen)


def test_a_failed_answer_raises_its_statuss_error_with_the_api_servers_words(
    server: tuple[str, list[dict[str, str]]],
) -> None:
    host, _ = server
    with pytest.raises(rest.Conflict) as raised:
        rest.Rest(client.ApiClient(configuration(host, "t"))).request("GET", "/taken")
    assert raised.value.status == 409
    assert str(raised.value) == "taken"
    assert raised.value.retry_after == 2.0
    assert raised.value.answered


def test_a_watchs_status_event_is_the_error_of_its_code_with_its_words() -> None:
    expired = rest.status_failure(
        {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    )
    assert type(expired) is rest.Expired and expired.status == 410
    assert str(expired) == "Expired: too old"
    uncoded = rest.status_failure({"kind": "Status", "reason": "InternalError"})
    assert isinstance(uncoded, rest.Unavailable) and uncoded.answered, "answered, code or not"
    assert isinstance(rest.status_failure({"code": 403}), rest.Forbidden)


def test_a_refused_connection_is_unavailable_and_answered() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = rest.Rest(client.ApiClient(configuration(f"http://127.0.0.1:{port}", "t")))
    with pytest.raises(rest.Unavailable) as raised:
        transport.request("GET", "/ok")
    assert raised.value.status is None
    assert raised.value.answered, "a refused connection is the other end's answer"
    assert isinstance(raised.value.__cause__, urllib3.exceptions.HTTPError)


@pytest.mark.timeout(30, method="thread")
def test_one_number_bounds_the_whole_request() -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        transport = rest.Rest(client.ApiClient(configuration(host, "t")))
        with pytest.raises(rest.Unavailable) as raised:
            transport.request("GET", "/ok", timeout=0.5)
        assert not raised.value.answered, "a timeout shows nothing answered"


def test_the_claims_of_a_jwt_bearer_token_are_read_and_anything_else_is_none() -> None:
    claims = {"kubernetes.io": {"pod": {"name": "train-0", "uid": "u-1"}}}
    payload = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    as_jwt = rest.Rest(client.ApiClient(configuration("http://127.0.0.1:1", f"h.{payload}.s")))
    assert as_jwt.bearer_claims() == claims
    for opaque in ("not-a-jwt", "a.!!!.c", "a.bnVsbA.c"):  # the last is JSON null
        transport = rest.Rest(client.ApiClient(configuration("http://127.0.0.1:1", opaque)))
        assert transport.bearer_claims() is None
    assert rest.Rest(client.ApiClient(client.Configuration())).bearer_claims() is None


@pytest.mark.parametrize(
    ("status", "message"),
    [
        pytest.param(413, "Request entity too large: limit is 3145728", id="body-over-3MiB"),
        pytest.param(500, "etcdserver: request is too large", id="etcd-max-request-bytes"),
        pytest.param(
            500,
            "rpc error: code = ResourceExhausted desc = trying to send message larger than "
            "max (2300000 vs. 2097152)",
            id="etcd-client-limit",
        ),
    ],
)
def test_a_write_too_large_to_store_is_a_lasting_refusal_not_a_server_error(
    status: int, message: str
) -> None:
    """etcd's refusal reaches clients as a 500 with etcd's words, which would otherwise be
    retried as an API server in trouble: the same write would be refused for ever."""
    error = rest.failure(status, message)
    assert type(error) is rest.TooLarge and isinstance(error, rest.Refused)
    assert error.status == status and str(error) == message


def test_a_server_error_that_is_not_about_size_stays_retryable() -> None:
    assert type(rest.failure(500, "etcdserver: leader changed")) is rest.Unavailable
    assert type(rest.failure(400, "the body is not JSON")) is rest.Refused
