"""The admission webhook's port, as any client that reaches it sees it (the real operator,
its real TLS port on 127.0.0.1): what a flood of requests makes the operator ask the API
server (nothing: it answers from the Jobs it watches), how long an idle connection is kept,
what happens to connections beyond the limit (they wait, unanswered, for a free slot), and
what an unknown path gets (404)."""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import kubernetes.client
import pytest
from tests.support.fixtures import Rendezvous
from tests.support.jobs import make_job, wait_webhook_registered

from devkit.admission import pod_review
from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous_operator import webhook

pytestmark = pytest.mark.usefixtures("operator_process")

IDLE_SECONDS = webhook.Limits().idle_seconds
MARGIN_SECONDS = 10.0
"""On top of a bound, for a loaded 2-core machine: the bounds are checked, not the speed."""
LIMIT = 4
API_REQUESTS = "k8s_rendezvous_api_requests_total"


def flag(operator: OperatorProcess, name: str) -> str:
    return next(a.split("=", 1)[1] for a in operator.extra_args if a.startswith(f"--{name}="))


def attacker_tls() -> ssl.SSLContext:
    """An attacker does not check the certificate."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def connect(operator: OperatorProcess) -> http.client.HTTPSConnection:
    return http.client.HTTPSConnection(
        "127.0.0.1", int(flag(operator, "webhook-port")), context=attacker_tls(), timeout=60
    )


def post(
    connection: http.client.HTTPSConnection, path: str, body: object
) -> tuple[int, dict[str, Any] | None]:
    connection.request(
        "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    answer = connection.getresponse()
    text = answer.read()
    return answer.status, json.loads(text) if answer.status == 200 else None


def patched_env(answer: dict[str, Any] | None) -> set[str]:
    """The env names the webhook's answer adds."""
    assert answer is not None and answer["response"]["allowed"] is True, answer
    patch = answer["response"].get("patch")
    if patch is None:
        return set()
    text = json.dumps(json.loads(base64.b64decode(patch)))
    return set(re.findall(r'"name": "([A-Z_]+)"', text))


def get_requests(operator: OperatorProcess, resource: str) -> float:
    """How many GETs of ``resource`` the operator sent the API server (its own metric)."""
    port = flag(operator, "metrics-port")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except urllib.error.URLError:
        return -1.0
    wanted = f'{API_REQUESTS}{{resource="{resource}",verb="GET"}} '
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted)
    )


@pytest.mark.metrics
@pytest.mark.webhook
def test_a_flood_of_reviews_makes_the_operator_read_no_job_from_the_api(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    control_plane: ControlPlane,
    operator_process: OperatorProcess,
) -> None:
    """Reviews for an annotated Job, a plain one and made-up ones: each answered from the
    Jobs the operator watches (the annotated Job's pods get the env, the others none), and
    not one GET of a Job or a Rendezvous (kopf's watches and Events are not counted)."""
    wait_webhook_registered(control_plane, workers_namespace)
    annotated = make_job(
        admin_api, workers_namespace, "flooded", 1, {"k8s-rendezvous.dev/nodes": "1"}, suspend=True
    )
    plain = make_job(admin_api, workers_namespace, "plain", 1, {}, suspend=True)
    wait_for(
        lambda: _exists(Rendezvous(admin_api, workers_namespace, "flooded")),
        30,
        "the annotated Job's Rendezvous (its watch event handled)",
    )
    (before,) = wait_for(
        lambda: (n,) if (n := get_requests(operator_process, "jobs")) >= 0 else None,
        30,
        "the operator's metrics",
    )
    reviews = [
        pod_review(workers_namespace, "flooded", annotated["metadata"]["uid"]),
        pod_review(workers_namespace, "plain", plain["metadata"]["uid"]),
    ]

    def flood(reviewed: dict[str, Any]) -> list[set[str]]:
        connection = connect(operator_process)
        try:
            return [patched_env(post(connection, "/torchrun-env", reviewed)[1]) for _ in range(50)]
        finally:
            connection.close()

    made_up = [pod_review(workers_namespace, f"made-up-{i}", str(uuid.uuid4())) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(LIMIT) as pool:
        annotated_env, plain_env, *made_up_env = pool.map(flood, reviews + made_up)
    assert all("PET_RDZV_ENDPOINT" in env for env in annotated_env), annotated_env[0]
    assert plain_env == [set()] * 50
    assert made_up_env == [[set()] * 50] * 2
    assert get_requests(operator_process, "jobs") == before, "GETs of Jobs for 200 reviews"


def _exists(rdzv: Rendezvous) -> bool:
    try:
        rdzv.body()
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


@pytest.mark.webhook
def test_an_unknown_path_or_method_is_404_or_405_and_a_body_not_a_pod_review_is_400(
    control_plane: ControlPlane, workers_namespace: str, operator_process: OperatorProcess
) -> None:
    wait_webhook_registered(control_plane, workers_namespace)
    connection = connect(operator_process)
    try:
        for path in ("/", "/healthz", "/torchrun-env/x", "/mutate", "/torchrun-env-x"):
            assert post(connection, path, {})[0] == 404, path
        connection.request("GET", "/torchrun-env")
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 405
        for body in ({}, [], "x", {"request": {"operation": "UPDATE"}}):
            assert post(connection, "/torchrun-env", body)[0] == 400, body
        connection.request("POST", "/torchrun-env", b"{not json")
        answer = connection.getresponse()
        answer.read()
        assert answer.status == 400
    finally:
        connection.close()


def closed(sock: socket.socket) -> bool:
    """Block until the other end closes ``sock`` (its read returns nothing, or a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def closed_by_peer(held: socket.socket) -> bool:
    """Whether the other end closed ``held`` (without waiting)."""
    held.setblocking(False)
    try:
        return held.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        held.setblocking(True)


@pytest.mark.webhook
def test_an_idle_connection_is_closed_within_the_idle_timeout(
    control_plane: ControlPlane, workers_namespace: str, operator_process: OperatorProcess
) -> None:
    """Before its TLS handshake, and after it (and after a request): each closed by the
    operator within the idle timeout (plus a margin for a loaded machine)."""
    wait_webhook_registered(control_plane, workers_namespace)
    port = int(flag(operator_process, "webhook-port"))
    started = time.monotonic()
    silent = socket.create_connection(("127.0.0.1", port), timeout=60)
    shaken = attacker_tls().wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=60))
    served = connect(operator_process)
    assert post(served, "/unknown", {})[0] == 404
    try:
        assert closed(silent) and closed(shaken)
        assert served.sock is not None and closed(served.sock)
        took = time.monotonic() - started
    finally:
        silent.close()
        shaken.close()
        served.close()
    assert took < IDLE_SECONDS + MARGIN_SECONDS, f"closed after {took:.1f} s"


@pytest.mark.webhook(f"--webhook-max-connections={LIMIT}")
def test_a_connection_beyond_the_limit_waits_unanswered_for_a_free_slot(
    control_plane: ControlPlane, workers_namespace: str, operator_process: OperatorProcess
) -> None:
    """LIMIT silent connections take every slot; the next one is served only once the
    operator closed one of them as idle: by the time it is answered, a held one is closed."""
    wait_webhook_registered(control_plane, workers_namespace)
    port = int(flag(operator_process, "webhook-port"))
    held = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(LIMIT)]
    try:
        connection = connect(operator_process)
        try:
            assert post(connection, "/unknown", {})[0] == 404
        finally:
            connection.close()
        assert any(closed_by_peer(sock) for sock in held), "answered while every slot was held"
    finally:
        for sock in held:
            sock.close()
