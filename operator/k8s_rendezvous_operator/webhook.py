"""The mutating admission webhook that gives pods of annotated Jobs torchrun's
environment: its configuration and server (registered with kopf by
:func:`.handlers.register_webhook` when ``--webhook`` is on).

The operator registers it itself, not through kopf's managed configuration (which fixes
the timeout at 30 s and sends pods of every namespace): only pods with the
``batch.kubernetes.io/job-name`` label, only in the namespaces it watches, failure policy
``Ignore`` and a timeout of a few seconds, so that a down or hung operator never blocks a
pod, and delays one by that much at most.

It is served by :class:`BoundedServer`, not kopf's server: anyone who reaches the port can
send it requests, so what one client can hold there is bounded (:class:`Limits`), and only
the webhook's own path is served (anything else is a 404, before any parsing). What one
request can cost the operator is bounded by :meth:`.jobs.Jobs.rendezvous_for_pod`, which
answers from the Jobs the operator watches and never calls the API.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import dataclasses
import hashlib
import logging
import shutil
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from k8s_rendezvous.wire import codec
from k8s_rendezvous_operator import kube, settings

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
HANDLER_ID = "torchrun-env"
WEBHOOK_NAME = f"{HANDLER_ID}.k8s-rendezvous.dev"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace: a namespace selector by name."""
SYSTEM_NAMESPACES = ("kube-system", "kube-node-lease", "kube-public")


def webhooks(
    client_config: Mapping[str, Any], *, timeout_seconds: int, namespaces: Sequence[str]
) -> list[dict[str, Any]]:
    """The webhooks of the operator's MutatingWebhookConfiguration, reached at
    ``client_config`` (what kopf's server yields, without the handler's path)."""
    reached = dict(client_config)
    if "url" in reached:
        reached["url"] = f"{reached['url'].rstrip('/')}/{HANDLER_ID}"
    if "service" in reached:
        reached["service"] = {**reached["service"], "path": f"/{HANDLER_ID}"}
    in_namespaces = (
        {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(namespaces)}
        if namespaces
        else {"key": NAMESPACE_NAME_LABEL, "operator": "NotIn", "values": list(SYSTEM_NAMESPACES)}
    )
    return [
        {
            "name": WEBHOOK_NAME,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Ignore",
            "matchPolicy": "Equivalent",
            "reinvocationPolicy": "Never",
            "timeoutSeconds": timeout_seconds,
            "rules": [
                {
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "operations": ["CREATE"],
                    "scope": "Namespaced",
                }
            ],
            "objectSelector": {"matchExpressions": [{"key": JOB_NAME_LABEL, "operator": "Exists"}]},
            "namespaceSelector": {"matchExpressions": [in_namespaces]},
            "clientConfig": reached,
        }
    ]


class RegisteringWebhookServer:
    """kopf's webhook server, and the registration of what it serves: each client config
    the server yields (at start, and on a new certificate) is written to the operator's
    MutatingWebhookConfiguration before kopf gets it.

    Args:
        server: The server (TLS, the listening socket, the routing to kopf):
            :class:`BoundedServer`.
        service: ``NAMESPACE/NAME`` of the Service in front of the webhook, to register by
            Service reference (kube-apiserver reaches Services through its own service
            resolution, but usually cannot resolve their DNS names in a URL); ``""`` to
            register the server's URL (local runs).
        service_port: The Service's port.
    """

    def __init__(
        self,
        server: kopf.WebhookServerProtocol,
        api: kube.OperatorApi,
        configuration: str,
        *,
        service: str,
        service_port: int,
        timeout_seconds: int,
        namespaces: Sequence[str],
    ) -> None:
        self._server = server
        self._api = api
        self._configuration = configuration
        self._service = service
        self._service_port = service_port
        self._timeout_seconds = timeout_seconds
        self._namespaces = tuple(namespaces)

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async for config in self._server(fn):
            reached = config
            if self._service:
                namespace, _, name = self._service.rpartition("/")
                reached = kopf.WebhookClientConfig(
                    service=kopf.WebhookClientConfigService(
                        namespace=namespace, name=name, port=self._service_port
                    )
                )
                if config.get("caBundle"):
                    reached["caBundle"] = config["caBundle"]
            await self._register(reached)
            yield reached

    async def _register(self, reached: Mapping[str, Any]) -> None:
        registered = webhooks(
            reached, timeout_seconds=self._timeout_seconds, namespaces=self._namespaces
        )
        delay = 1.0
        while True:
            try:
                await asyncio.to_thread(
                    self._api.register_webhooks, self._configuration, registered
                )
                log.info("webhook registered in %s", self._configuration)
                return
            except kube.Refused as error:
                raise RuntimeError(
                    f"cannot register the webhook in MutatingWebhookConfiguration "
                    f"{self._configuration} ({error}). The operator's ClusterRole needs "
                    "create and patch on it (the chart's rbac-operator.yaml)."
                ) from error
            except kube.Unavailable as error:
                log.warning("registering the webhook failed (%s); retrying in %.0f s", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the clients of the webhook port can hold of the operator, all of them
    together: the port is reachable from wherever the cluster's network lets in (the
    chart's NetworkPolicy narrows that where the cluster can express it)."""

    max_connections: int = 64
    """Connections served at once, TLS handshakes included. More wait in the kernel's
    listen queue (as many again), unanswered until a served one ends; beyond that the
    kernel drops them. The API server opens one per admission request in flight and
    keeps it for the next, so a few per API server serve a burst of pod creations. A
    client that holds them all only delays the webhook: its failure policy (Ignore) then
    admits a pod without the env, which the operator reports (PodNotInjected)."""

    idle_seconds: float = 5.0
    """A connection that sends nothing for this long is closed: before its TLS handshake
    is done, before its first request is complete, or between requests (the API server
    opens a new one when it needs one). Also how long a TLS shutdown may wait for the
    client, so a closed connection gives its slot back within twice this."""

    request_seconds: float = 5.0
    """The most one request may take from its headers to its answer, its body included:
    the webhook's timeout (``--webhook-timeout-seconds``), after which the API server has
    given up on it anyway."""

    max_body_bytes: int = 3 * 1024 * 1024
    """A larger body is refused (413) unread: the API server's own bound on a request's
    body is 3 MiB, and a pod's AdmissionReview holds one pod."""


class _Slot(asyncio.Protocol):
    """aiohttp's protocol for one connection, giving the connection's slot back when the
    connection ends (aiohttp's own server has no bound on its connections)."""

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release = release

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._release()

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


MAX_REVIEW_DEPTH = 64
"""How deep an AdmissionReview's objects may nest: a pod's deepest fields (its managed
fields, its affinity terms) are about 15 levels down. Anyone who reaches the port chooses
the body, and kopf copies the review recursively."""


def decode_review(body: bytes, max_bytes: int = Limits.max_body_bytes) -> Any:
    """A request's body as JSON, within the webhook's bounds.

    Raises:
        k8s_rendezvous.wire.codec.DecodeError: Not JSON, or beyond a bound (a ``ValueError``).
    """
    return codec.decode_json(
        body, "AdmissionReview", max_length=max_bytes, max_depth=MAX_REVIEW_DEPTH
    )


def _is_pod_creation(review: object) -> bool:
    """Whether ``review`` is what the API server sends this webhook: an AdmissionReview of
    a pod's creation (the only one it is registered for). Anything else is refused before
    kopf sees it: kopf keeps a memo per object uid for any other operation."""
    if not isinstance(review, dict) or not isinstance(request := review.get("request"), dict):
        return False
    return (
        request.get("operation") == "CREATE"
        and request.get("resource") == {"group": "", "version": "v1", "resource": "pods"}
        and isinstance(request.get("uid"), str)
        and isinstance(request.get("object"), dict)
        and isinstance(request.get("userInfo"), dict)
    )


def _url(host: str, port: int) -> str:
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class BoundedServer:
    """The webhook's HTTPS server (what kopf calls a webhook server): only the path
    ``/torchrun-env``, within :class:`Limits`. It serves ``certfile`` and ``pkeyfile``,
    registers ``cafile``, and starts anew when they change (a renewal).

    Connections are accepted here, not by asyncio's server, so that one still in its TLS
    handshake holds a slot too: asyncio tells nobody about a handshake that never ends.
    """

    def __init__(
        self,
        *,
        addr: str | None,
        port: int,
        host: str,
        cafile: Path,
        certfile: Path,
        pkeyfile: Path,
        limits: Limits,
        file_check_interval: float = 60.0,
    ) -> None:
        self._addr = addr
        self._port = port
        self._host = host
        self._files = (cafile, certfile, pkeyfile)
        self._limits = limits
        self._file_check_interval = file_check_interval

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        async def serve(request: aiohttp.web.Request) -> aiohttp.web.Response:
            return await self._serve(fn, request)

        cafile, certfile, pkeyfile = self._files
        while True:
            digest = self._digest()
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(certfile, pkeyfile)
            app = aiohttp.web.Application(client_max_size=self._limits.max_body_bytes)
            app.add_routes([aiohttp.web.post(f"/{HANDLER_ID}", serve)])
            runner = aiohttp.web.AppRunner(
                app,
                handle_signals=False,
                access_log=None,
                keepalive_timeout=self._limits.idle_seconds,
                handler_cancellation=True,
            )
            await runner.setup()
            listening = self._listen()
            accepting = asyncio.create_task(self._accept(listening, runner, context))
            try:
                yield kopf.WebhookClientConfig(
                    url=_url(self._host, self._port),
                    caBundle=base64.b64encode(cafile.read_bytes()).decode("ascii"),
                )
                while self._digest() == digest:
                    await asyncio.sleep(self._file_check_interval)
                log.info("the webhook's certificate changed: serving the new one")
            finally:
                accepting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await accepting
                listening.close()
                await runner.cleanup()

    def _digest(self) -> str:
        hasher = hashlib.sha256()
        for path in self._files:
            hasher.update(path.read_bytes())
        return hasher.hexdigest()

    def _listen(self) -> socket.socket:
        """The listening socket: ``addr``, or every address of both families (IPv4 alone
        where the kernel has no IPv6). Its queue is as long as the connection limit."""
        backlog = self._limits.max_connections
        if self._addr:
            family = socket.AF_INET6 if ":" in self._addr else socket.AF_INET
            listening = socket.create_server(
                (self._addr, self._port), family=family, backlog=backlog
            )
        else:
            try:
                listening = socket.create_server(
                    ("", self._port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True
                )
            except (OSError, ValueError):
                listening = socket.create_server(("", self._port), backlog=backlog)
        listening.setblocking(False)
        return listening

    async def _accept(
        self, listening: socket.socket, runner: aiohttp.web.AppRunner, context: ssl.SSLContext
    ) -> None:
        """Accept a connection only while a slot is free (a semaphore of
        ``max_connections``); each gives its slot back when it ends, or when its TLS
        handshake fails or outlasts ``idle_seconds``."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self._limits.max_connections)
        starting: set[asyncio.Task[None]] = set()
        assert runner.server is not None, "set up"
        protocol = runner.server
        try:
            while True:
                await slots.acquire()
                try:
                    connection, _ = await loop.sock_accept(listening)
                except OSError as error:  # e.g. out of descriptors: the queue keeps them
                    slots.release()
                    log.warning("the webhook could not accept a connection: %s", error)
                    await asyncio.sleep(self._limits.idle_seconds)
                    continue
                except BaseException:
                    slots.release()
                    raise
                task = loop.create_task(self._start(connection, protocol, context, slots.release))
                starting.add(task)
                task.add_done_callback(starting.discard)
        finally:
            for task in starting:
                task.cancel()

    async def _start(
        self,
        connection: socket.socket,
        protocol: Callable[[], asyncio.BaseProtocol],
        context: ssl.SSLContext,
        release: Callable[[], None],
    ) -> None:
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                release()

        def slot() -> _Slot:
            return _Slot(protocol(), release_once)  # type: ignore[arg-type]

        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                slot,
                connection,
                ssl=context,
                ssl_handshake_timeout=self._limits.idle_seconds,
                ssl_shutdown_timeout=self._limits.idle_seconds,
            )
        except Exception as error:  # a failed or timed-out handshake: the client's doing
            connection.close()
            release_once()
            log.debug("a webhook connection ended before its TLS handshake: %r", error)
        except BaseException:  # the server stopping
            connection.close()
            release_once()
            raise

    async def _serve(
        self, fn: kopf.WebhookFn, request: aiohttp.web.Request
    ) -> aiohttp.web.Response:
        try:
            async with asyncio.timeout(self._limits.request_seconds):
                review = decode_review(await request.read(), self._limits.max_body_bytes)
                if not _is_pod_creation(review):
                    raise aiohttp.web.HTTPBadRequest(
                        reason="not an AdmissionReview of a pod's creation"
                    )
                transport = request.transport
                answer = await fn(
                    review,
                    webhook=kopf.HandlerId(HANDLER_ID),
                    headers=dict(request.headers),
                    sslpeer=transport.get_extra_info("peercert") if transport else None,
                )
        except TimeoutError:
            raise aiohttp.web.HTTPServiceUnavailable(reason="the request took too long") from None
        except ValueError:  # not JSON, not UTF-8, or beyond the bounds
            raise aiohttp.web.HTTPBadRequest(reason="not JSON within bounds") from None
        return aiohttp.web.json_response(answer)


def server(options: settings.Webhook, namespaces: Sequence[str]) -> RegisteringWebhookServer:
    """The webhook server ``options`` describe: its certificate from their ``cert_dir``,
    or self-signed for their ``host`` (and ``addr``)."""
    # Imported here: cryptography costs every operator its memory, and only this needs it.
    from k8s_rendezvous_operator import certificates

    if options.cert_dir is not None:
        directory = options.cert_dir
        ca, cert, key = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    else:
        directory = Path(tempfile.mkdtemp(prefix="k8s-rendezvous-webhook-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        ca, cert, key = certificates.write_self_signed(
            directory, [options.host, *([options.addr] if options.addr else [])]
        )
    listening = BoundedServer(
        addr=options.addr,
        port=options.port,
        host=options.host,
        cafile=ca,
        certfile=cert,
        pkeyfile=key,
        limits=Limits(
            max_connections=options.max_connections,
            request_seconds=options.timeout_seconds,
        ),
    )
    return RegisteringWebhookServer(
        listening,
        kube.OperatorApi(kube.load_api_client()),
        options.config_name,
        service=options.service or "",
        service_port=options.port,
        timeout_seconds=options.timeout_seconds,
        namespaces=namespaces,
    )
