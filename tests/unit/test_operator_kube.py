"""How the operator's API door maps the API server's answers to its own errors, with a
scripted local server (the real API server covers the successful paths)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from tests.support.local_http import QuietHandler, serving

from k8s_rendezvous_operator import kube

WEBHOOKS = [{"name": "torchrun-env.k8s-rendezvous.dev"}]


@pytest.fixture
def answers() -> Iterator[tuple[str, list[int], list[tuple[str, str]]]]:
    """A server answering each request with the next status of the list (a Status body
    naming it); records (method, path)."""
    statuses: list[int] = []
    seen: list[tuple[str, str]] = []

    class Handler(QuietHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.command, self.path))
            code = statuses.pop(0)
            data = json.dumps({"kind": "Status", "code": code, "message": f"said {code}"}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_PATCH = do_POST = _answer

    with serving(Handler) as host:
        yield host, statuses, seen


def door(host: str) -> kube.OperatorApi:
    configuration = client.Configuration(host=host)
    configuration.retries = 0
    return kube.OperatorApi(client.ApiClient(configuration))


def test_registering_patches_and_creates_only_what_is_missing(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    host, statuses, seen = answers
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    statuses += [200]
    door(host).register_webhooks("c", WEBHOOKS)
    statuses += [404, 201]
    door(host).register_webhooks("c", WEBHOOKS)
    assert seen == [("PATCH", f"{path}/c"), ("PATCH", f"{path}/c"), ("POST", path)]


@pytest.mark.parametrize("status", [400, 403, 422])
def test_a_lasting_refusal_is_refused_with_the_api_servers_words(
    answers: tuple[str, list[int], list[tuple[str, str]]], status: int
) -> None:
    host, statuses, _ = answers
    statuses += [status]
    with pytest.raises(kube.Refused, match=f"^{status}: said {status}$"):
        door(host).register_webhooks("c", WEBHOOKS)


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_what_may_pass_later_is_unavailable(
    answers: tuple[str, list[int], list[tuple[str, str]]], status: int
) -> None:
    host, statuses, _ = answers
    statuses += [404, status] if status == 409 else [status]  # 409: made meanwhile
    with pytest.raises(kube.Unavailable, match=f"^{status}: said {status}$"):
        door(host).register_webhooks("c", WEBHOOKS)


def test_no_answer_is_unavailable() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(kube.Unavailable):
        door(f"http://127.0.0.1:{port}").register_webhooks("c", WEBHOOKS)


def test_adopting_a_rendezvous_made_anew_meanwhile_is_a_conflict(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    host, statuses, seen = answers
    owner: dict[str, Any] = {"kind": "StatefulSet", "name": "s", "uid": "u"}
    statuses += [409, 404]
    with pytest.raises(kube.Conflict):
        door(host).adopt_rendezvous("ns", "r", "uid-1", owner)
    with pytest.raises(kube.NotFound):
        door(host).adopt_rendezvous("ns", "r", "uid-1", owner)
    assert seen[0] == ("PATCH", "/apis/k8s-rendezvous.dev/v1alpha1/namespaces/ns/rendezvous/r")
