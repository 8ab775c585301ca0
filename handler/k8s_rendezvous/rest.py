"""One request to the Kubernetes API server, answered as plain JSON: through the official
client's connection pool and credentials, not through its typed API classes.

The typed classes validate every call with pydantic. Each method builds its validator at
its first call, for about 3 ms of CPU, and each thread that makes that first call at the
same moment builds its own. Every body also goes to a model and back. A node paid that on
the write of its first join, while the other nodes waited for it; the operator paid the
validation on every status write (bench/FINDINGS.md). Both sides' ``kube`` modules send
their requests through here.

A request that does not succeed raises one of this module's errors, on both sides:
:class:`RequestFailed` and its kinds by the answer's status (:class:`NotFound`,
:class:`Conflict`, :class:`Unauthorized`, :class:`Refused` and its :class:`Forbidden`,
:class:`Invalid` and :class:`TooLarge`, :class:`Unavailable`), carrying the API server's
own message (:func:`status_message`), or :class:`Unavailable` with no status when nothing
answered, chained from the transport's error. Neither side sees the client library's
exceptions, and no other module matches a status number: each asks for the kind.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import os
import ssl
import urllib.parse
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, cast

import urllib3
from kubernetes import client, config

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
DEFAULT_TIMEOUT: Final = (5.0, 30.0)
"""Connect and read timeouts of every request but watches: a request caught by an API
server restart must fail and be retried, not hang forever."""

SERVICE_ACCOUNT_DIR_ENV: Final = "K8S_RENDEZVOUS_SERVICE_ACCOUNT_DIR"
"""Where the pod's service-account files are, if not at the standard path."""
DEFAULT_SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"


_MAX_RETRY_AFTER_SECONDS: Final = 10.0
_MAX_CHAIN: Final = 16
"""Errors followed down a failure's chain of causes: urllib3's are three deep."""


class RequestFailed(Exception):
    """A request to the API server that did not succeed: refused, or not answered."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        retry_after: float | None = None,
        answered: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status of the answer; ``None``: there was no answer."""
        self.retry_after = retry_after
        """The seconds a 429 or 503 asked to wait (``Retry-After``), at most 10."""
        self.answered = status is not None if answered is None else answered
        """Whether the other end of the network answered at all: with a status, or by
        refusing or resetting the connection, or closing it without a response (an API
        server restarting, behind its Service or load balancer). A timeout or an
        unreachable network shows that nothing did."""


class NotFound(RequestFailed):
    """The object does not exist (any more): 404."""


class Conflict(RequestFailed):
    """The object changed since it was read, or exists already: 409. Read it again and
    decide again."""


class Unauthorized(RequestFailed):
    """The API server did not accept the credentials (401): an expired token, or an API
    server that has just started and not yet loaded what checks them."""


class Refused(RequestFailed):
    """The API server refused the request for good (400, 403, 413, 422); the message says
    why."""


class Forbidden(Refused):
    """These credentials may not do this (403): a missing role binding, or an admission
    policy; also, for a few seconds, an API server that has just started and not yet
    loaded its roles."""


class Invalid(Refused):
    """The API server refused the object as invalid (422); the message says why."""


class TooLarge(Refused):
    """The object, or the request, is larger than the API server or its etcd stores
    (:func:`too_large`): the same write is refused again, however often it is sent."""


class Unavailable(RequestFailed):
    """The request may succeed later: no answer, or a 429 or 5xx."""


class Expired(RequestFailed):
    """What the request continues from is older than the API server keeps (410 Gone): a
    watch's resourceVersion, or a paginated list's continue token. Asking again from it
    fails again; start over from a fresh list."""


class NoCredentials(Exception):
    """Neither a service account's token nor a kubeconfig could be loaded; the message
    says where each was looked for."""


_TOO_LARGE_SAID: Final = (
    "request is too large",
    "trying to send message larger than max",
)
"""How the API server passes on etcd's refusal of a write larger than etcd takes: not as
a 413 but as etcd's own error in a 500 (its Status reason Unknown), "etcdserver: request
is too large" past etcd's --max-request-bytes (1.5 MiB by default), or gRPC's "trying to
send message larger than max" past the API server's etcd client limit (2 MiB)."""


def too_large(status: int | None, message: str) -> bool:
    """Whether an answer says the write is too large to store: a 413 (a body past the
    API server's 3 MiB, or an admission rule's ``RequestEntityTooLarge``), or etcd's
    refusal passed on (:data:`_TOO_LARGE_SAID`)."""
    if status == 413:
        return True
    return status in (400, 500) and any(said in message for said in _TOO_LARGE_SAID)


def failure(status: int | None, message: str, retry_after: float | None = None) -> RequestFailed:
    """The error of an answer with ``status`` (a watch's ERROR event is one, too)."""
    kind: type[RequestFailed] = RequestFailed
    if too_large(status, message):
        kind = TooLarge
    elif status == 404:
        kind = NotFound
    elif status == 409:
        kind = Conflict
    elif status == 401:
        kind = Unauthorized
    elif status == 403:
        kind = Forbidden
    elif status == 422:
        kind = Invalid
    elif status == 400:
        kind = Refused
    elif status == 410:
        kind = Expired
    elif status is None or status == 429 or status >= 500:
        kind = Unavailable
    return kind(message, status, retry_after)


def status_failure(status: object) -> RequestFailed:
    """The error a ``metav1.Status`` object says, as a watch's ERROR event carries one (a
    410 Gone: the version watched from is too old). One without a code was answered all
    the same: it is a server error's."""
    said = status if isinstance(status, dict) else {}
    code = said.get("code")
    return failure(
        code if isinstance(code, int) else 500,
        f"{said.get('reason')}: {status_message(said, None)}",
    )


def status_message(status: object, fallback: str | None) -> str:
    """The API server's own message in a ``metav1.Status`` object (the body of a refused
    request, a watch's ERROR event), else ``fallback``."""
    said = status.get("message") if isinstance(status, dict) else None
    return str(said or fallback)


def load_api_client(pool_maxsize: int | None = None) -> client.ApiClient:
    """In a pod, its service account (:func:`service_account_dir`); elsewhere, the current
    kubeconfig context. Raises :class:`NoCredentials`."""
    configuration = client.Configuration()
    directory = service_account_dir()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and (directory / "token").exists():
            loader = config.incluster_config.InClusterConfigLoader(  # type: ignore[no-untyped-call]
                token_filename=str(directory / "token"), cert_filename=str(directory / "ca.crt")
            )
            loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError) as error:
        raise NoCredentials(
            f"could not load Kubernetes credentials ({error}). In a pod, mount the service "
            f"account token (automountServiceAccountToken) at {directory}; elsewhere, set "
            "KUBECONFIG."
        ) from error
    if pool_maxsize is not None:
        configuration.connection_pool_maxsize = pool_maxsize
    return client.ApiClient(configuration)


def service_account_dir() -> Path:
    return Path(os.environ.get(SERVICE_ACCOUNT_DIR_ENV, DEFAULT_SERVICE_ACCOUNT_DIR))


def own_namespace() -> str | None:
    """The pod's namespace: ``POD_NAMESPACE`` (downward API) or the service-account file."""
    if namespace := os.environ.get("POD_NAMESPACE"):
        return namespace
    try:
        return (service_account_dir() / "namespace").read_text().strip() or None
    except OSError:
        return None


Query = Sequence[tuple[str, str]]
Timeout = float | tuple[float, float]
"""Seconds for the whole request, or (connect, read), as the client's ``_request_timeout``."""


class Rest:
    """Requests on behalf of one authenticated ``ApiClient`` (its pool, TLS and token)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.server: str = api_client.configuration.host
        self._pool: urllib3.PoolManager = api_client.rest_client.pool_manager

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        *,
        content_type: str = JSON,
        query: Query = (),
        timeout: Timeout = DEFAULT_TIMEOUT,
    ) -> dict[str, Any]:
        """The answer's JSON; :class:`RequestFailed` (a kind of it) if it did not succeed."""
        response = self._send(method, path, body, content_type, query, timeout)
        return cast(dict[str, Any], json.loads(response.data))

    def lines(self, path: str, query: Query, timeout: Timeout) -> Generator[bytes, None, None]:
        """The complete, non-empty lines of a GET's body as they arrive (a watch's events);
        :class:`Unavailable` if the stream breaks. Closing the iterator closes the stream."""
        response = self._send("GET", path, None, JSON, query, timeout, preload=False)
        try:
            yield from _lines(response.stream(amt=None, decode_content=False))
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _unanswered(error) from error
        finally:
            # A stream read to its end has already gone back to the pool; one left early
            # has not been read to its end, so its connection cannot be used again.
            response.close()
            response.release_conn()

    def bearer_claims(self) -> dict[str, Any] | None:
        """The claims of the bearer token these requests carry, if it is a JWT (as every
        service-account token is), unverified: only the API server's word on a request
        counts, this is what the client may say of itself."""
        for setting in self.api_client.configuration.auth_settings().values():
            scheme, _, token = str(setting.get("value") or "").partition(" ")
            if setting["in"] != "header" or scheme.lower() != "bearer":
                continue
            parts = token.split(".")
            if len(parts) != 3:
                return None
            try:
                claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
            except (ValueError, binascii.Error):
                return None
            return claims if isinstance(claims, dict) else None
        return None

    def _send(
        self,
        method: str,
        path: str,
        body: object | None,
        content_type: str,
        query: Query,
        timeout: Timeout,
        preload: bool = True,
    ) -> urllib3.BaseHTTPResponse:
        headers = {**self.api_client.default_headers, "Accept": JSON}
        # Asked per request: in a pod the configuration re-reads a rotated token.
        for setting in self.api_client.configuration.auth_settings().values():
            if setting["in"] == "header" and setting["value"]:
                headers[setting["key"]] = setting["value"]
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        url = self.server + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        try:
            response = self._pool.request(
                method,
                url,
                body=data,
                headers=headers,
                timeout=(
                    urllib3.Timeout(connect=timeout[0], read=timeout[1])
                    if isinstance(timeout, tuple)
                    else urllib3.Timeout(total=timeout)
                ),
                preload_content=preload,
            )
        except (urllib3.exceptions.HTTPError, OSError) as error:
            raise _unanswered(error) from error
        if not 200 <= response.status <= 299:
            said = status_message(_json_or_none(response.data), response.reason)
            asked = _retry_after(response.headers.get("Retry-After"))
            response.release_conn()
            raise failure(response.status, said, asked)
        return response


def _unanswered(error: BaseException) -> Unavailable:
    return Unavailable(str(error) or type(error).__name__, answered=_answered(error))


def _answered(error: BaseException) -> bool:
    """See :attr:`RequestFailed.answered`, for a transport's ``error``."""
    seen: BaseException | None = error
    for _ in range(_MAX_CHAIN):
        if seen is None:
            return False
        if isinstance(
            seen,
            ConnectionRefusedError
            | ConnectionResetError
            | http.client.RemoteDisconnected
            # Closed in the TLS handshake: a load balancer or proxy whose API server is down.
            | ssl.SSLEOFError
            | ssl.SSLZeroReturnError,
        ):
            return True
        if isinstance(seen, urllib3.exceptions.MaxRetryError):
            seen = seen.reason
        elif isinstance(seen, urllib3.exceptions.ProtocolError) and len(seen.args) > 1:
            inner = seen.args[1]  # urllib3 keeps the socket's error here, not as the cause
            seen = inner if isinstance(inner, BaseException) else None
        else:
            seen = seen.__cause__ or seen.__context__
    return False


def _json_or_none(body: bytes) -> object:
    """A refused request's body as JSON (a Status, from the API server), ``None`` if it
    is not (from a proxy in front of it)."""
    try:
        return json.loads(body or b"{}")
    except ValueError:
        return None


def _retry_after(value: str | None) -> float | None:
    try:
        return None if value is None else min(_MAX_RETRY_AFTER_SECONDS, max(0.0, float(value)))
    except ValueError:  # an HTTP date; the API server sends seconds
        return None


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The non-empty, complete lines of a stream of chunks, however the chunks cut them
    (an unfinished last line is an event cut short: the watch resumes before it)."""
    pending = bytearray()
    for chunk in chunks:
        searched = len(pending)
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", searched)) >= 0:
            if end > start:
                yield bytes(pending[start:end])
            start = searched = end + 1
        del pending[:start]
