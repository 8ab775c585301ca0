"""How the operator's API door maps the API server's answers to its own errors, with a
scripted local server (the real API server covers the successful paths).

Aspects: every status and a failed transport leave the door as one kind of
``kube.ApiError`` (so the error metric's label names what happened), never as the client
library's exception; the calls that expect an answer (404 for a read, 409 for a create)
turn it into a result; registering the webhook tells a lasting refusal from a passing one;
the leader-election Lease's conflicts are ``Taken``.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tests.support.local_http import QuietHandler, serving

from k8s_rendezvous.wire.specs import RendezvousSpec
from k8s_rendezvous_operator import kube, workloads

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

        do_GET = do_PATCH = do_POST = do_PUT = _answer

    with serving(Handler) as host:
        yield host, statuses, seen


def door_client(host: str) -> client.ApiClient:
    configuration = client.Configuration(host=host)
    configuration.retries = 0
    return client.ApiClient(configuration)


def door(host: str) -> kube.OperatorApi:
    return kube.OperatorApi(door_client(host))


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


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, kube.Refused),
        (401, kube.Unauthorized),
        (403, kube.Forbidden),
        (404, kube.NotFound),
        (409, kube.Conflict),
        (413, kube.TooLarge),
        (422, kube.Invalid),
        (429, kube.Unavailable),
        (500, kube.Unavailable),
        (503, kube.Unavailable),
    ],
)
def test_every_answer_leaves_the_door_as_one_of_its_own_errors(
    answers: tuple[str, list[int], list[tuple[str, str]]], status: int, kind: type
) -> None:
    host, statuses, _ = answers
    statuses += [status]
    with pytest.raises(kube.ApiError) as raised:
        door(host).write_status("ns", "r", "7", {"round": 1})
    assert type(raised.value) is kind, "the error metric is labelled with this name"
    assert raised.value.status == status
    assert str(raised.value) == f"said {status}", "the API server's own words"
    assert not isinstance(raised.value, ApiException)


def test_an_invalid_object_is_a_lasting_refusal(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    host, statuses, _ = answers
    statuses += [422]
    with pytest.raises(kube.Refused):
        door(host).write_status("ns", "r", "7", {"round": 1})


def test_no_answer_to_any_call_is_unavailable() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(kube.Unavailable) as raised:
        door(f"http://127.0.0.1:{port}").get_rendezvous("ns", "r")
    assert raised.value.status is None


def test_expected_answers_are_results_not_errors(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    host, statuses, seen = answers
    api = door(host)
    statuses += [404, 404, 404, 404, 409, 409]
    assert api.get_job("ns", "j") is None
    leader = workloads.Reference("v1", "Pod", "train-0", "u")
    assert api.get_owner("ns", leader) is None
    assert api.get_pod("ns", "p") is None
    assert api.service_account_exists("ns", "sa") is False
    assert api.create_rendezvous("ns", "r", RendezvousSpec(1, 1, "run"), {}) is None
    api.bind_worker_role("ns", "j", "uid", "sa", "role")  # bound already
    assert [method for method, _ in seen] == ["GET", "GET", "GET", "GET", "POST", "POST"]
    assert seen[1][1] == "/api/v1/namespaces/ns/pods/train-0"


@pytest.mark.parametrize(("call", "status"), [("create", 409), ("update", 409), ("update", 404)])
def test_a_leader_lease_written_by_someone_else_is_taken(
    answers: tuple[str, list[int], list[tuple[str, str]]], call: str, status: int
) -> None:
    host, statuses, _ = answers
    lock = kube.LeaseLock(door_client(host), "ns", "leader")
    statuses += [status]
    lease = {"metadata": {"name": "leader", "resourceVersion": "1"}, "spec": {}}
    with pytest.raises(kube.Taken) as raised:
        if call == "create":
            lock.create({"holderIdentity": "me"}, timeout=5)
        else:
            lock.update(lease, {"holderIdentity": "me"}, timeout=5)
    assert isinstance(raised.value, kube.Conflict)


def test_a_missing_leader_lease_reads_as_none(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    host, statuses, _ = answers
    statuses += [404]
    assert kube.LeaseLock(door_client(host), "ns", "leader").get(timeout=5) is None


def test_a_name_a_pod_wrote_is_one_segment_of_the_path_it_goes_into(
    answers: tuple[str, list[int], list[tuple[str, str]]],
) -> None:
    """A pod chooses its Lease's holder and the pod a Rendezvous it made names: with '/'
    and '..' in it, the request would otherwise name another object, maybe in another
    namespace (urllib3 removes dot segments)."""
    host, statuses, seen = answers
    api = door(host)
    statuses += [404, 404]
    assert api.get_pod("ns", "a/../../other/pods/victim") is None
    with pytest.raises(kube.NotFound):
        api.label_pod("ns", "../../other/pods/victim", "train")
    assert [path for _, path in seen] == [
        "/api/v1/namespaces/ns/pods/a%2F..%2F..%2Fother%2Fpods%2Fvictim",
        "/api/v1/namespaces/ns/pods/..%2F..%2Fother%2Fpods%2Fvictim",
    ]


def test_a_list_whose_continue_token_expired_ends_in_one_list_without_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pages themselves are the real API server's (tests/integration/test_lists.py);
    its 410 for a token past etcd's compaction needs minutes of a busy etcd, so it is
    scripted here."""
    monkeypatch.setattr(kube, "LIST_PAGE", 2)
    seen: list[str] = []

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            if "continue=" in self.path:
                code, body = 410, {"kind": "Status", "code": 410, "message": "too old"}
            elif "limit=" in self.path:
                code, body = 200, {"items": [{"n": 1}, {"n": 2}], "metadata": {"continue": "t"}}
            else:
                code, body = 200, {"items": [{"n": 1}, {"n": 2}, {"n": 3}], "metadata": {}}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with serving(Handler) as host:
        assert door(host).list_node_leases(["ns"]) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert ["limit=2" in path for path in seen] == [True, True, False]
    assert "continue=t" in seen[1]
