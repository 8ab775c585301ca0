"""The `kubernetes` Service for real pods: a TCP forwarder from its ClusterIP to the API server.

A real pod finds the API server the way every in-cluster client does, at
``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT``, which the kubelet sets to the
`kubernetes` Service's ClusterIP and port 443. A cluster routes that with kube-proxy; this
one has none (it would rewrite the host's netfilter tables), so the ClusterIP is an address
of the host (on a bridge of its own, see nodes.py) and this process forwards its port 443 to
the API server on 127.0.0.1, bytes unchanged: TLS stays end to end between the pod and the
API server, whose certificate names the ClusterIP.

    python -m devkit.cluster.serviceproxy LISTEN_HOST:PORT TARGET_HOST:PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        # Half-close: the other direction may still be sending (a watch's last events).
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


async def _forward(
    target: tuple[str, int], client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
) -> None:
    try:
        upstream_reader, upstream = await asyncio.open_connection(*target)
    except OSError:
        client.close()
        return
    try:
        await asyncio.gather(_pump(client_reader, upstream), _pump(upstream_reader, client))
    finally:
        for writer in (client, upstream):
            writer.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    server = await asyncio.start_server(
        lambda reader, writer: _forward(target, reader, writer), *listen, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"forwarding {listen[0]}:{listen[1]} to {target[0]}:{target[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(_address(argv[0]), _address(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
