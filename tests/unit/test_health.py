"""The liveness endpoint answers on both address families a pod may be probed at."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from k8s_rendezvous_operator import health


def _get(host: str, port: int) -> dict[str, object]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        client.connect((host, port))
        client.sendall(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := client.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"200", head
    result: dict[str, object] = json.loads(body)
    return result


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_endpoint_answers_on_ipv4_and_ipv6(host: str) -> None:
    # Port 0, the bound one read back: a port found free beforehand on one family may be
    # taken on the other by the time the dual-stack socket binds it.
    endpoint = f"http://{f'[{host}]' if ':' in host else host}:0/healthz"

    async def probe() -> tuple[dict[str, object], dict[str, object]]:
        runner = await health.serve(endpoint, lambda: {"leader": True})
        port = runner.addresses[0][1]
        try:
            return (
                await asyncio.to_thread(_get, "127.0.0.1", port),
                await asyncio.to_thread(_get, "::1", port),
            )
        finally:
            await runner.cleanup()

    assert asyncio.run(probe()) == ({"leader": True}, {"leader": True})


def test_a_named_host_is_bound_as_named() -> None:
    sock = health.listening_socket("127.0.0.1", 0)
    try:
        assert sock.family == socket.AF_INET
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


def test_only_http_is_served() -> None:
    with pytest.raises(ValueError, match="only http is served"):
        asyncio.run(health.serve("https://0.0.0.0:1/healthz", dict))
