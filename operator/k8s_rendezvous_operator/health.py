"""The operator's liveness endpoint, served on every address family the pod has.

The kubelet probes a pod at its first IP, which is IPv6 on IPv6-first and IPv6-only
clusters. kopf's own endpoint binds the one host its URL names, and asyncio makes an IPv6
socket IPv6-only, so ``http://0.0.0.0:8080`` never answers an IPv6 probe and ``[::]`` never
an IPv4 one: the kubelet would restart a healthy operator forever. A wildcard host here
("0.0.0.0", "::" or none) gets one socket for both families instead (IPv4 alone where the
kernel has no IPv6); any other host is bound as named.

The same server answers while the replica stands by for leadership and while it leads:
``status()`` says which.
"""

from __future__ import annotations

import contextlib
import socket
import urllib.parse
from collections.abc import Callable, Mapping

import aiohttp.web

WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket: dual-stack for a wildcard ``host``."""
    if host in WILDCARDS and socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:
            pass  # no IPv6 in this kernel: IPv4 alone, below
        else:
            with contextlib.ExitStack() as failed:
                failed.callback(sock.close)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(("::", port))
                sock.listen(64)
                failed.pop_all()
                return sock
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    with contextlib.ExitStack() as failed:
        failed.callback(sock.close)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host if host not in WILDCARDS else "0.0.0.0", port))
        sock.listen(64)
        failed.pop_all()
    return sock


async def serve(endpoint: str, status: Callable[[], Mapping[str, object]]) -> aiohttp.web.AppRunner:
    """Answer GET ``endpoint``'s path with ``status()`` as JSON; ``cleanup()`` the runner
    to stop."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "http":
        raise ValueError(f"unsupported liveness endpoint {endpoint!r}: only http is served")

    async def health(request: aiohttp.web.Request) -> aiohttp.web.Response:
        del request
        return aiohttp.web.json_response(dict(status()))

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get(parts.path or "/", health)])
    runner = aiohttp.web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    port = 80 if parts.port is None else parts.port  # 0: any free port (runner.addresses)
    site = aiohttp.web.SockSite(runner, listening_socket(parts.hostname or "", port))
    await site.start()
    return runner
