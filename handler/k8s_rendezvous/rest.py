"""One request to the Kubernetes API server, answered as plain JSON: through the official
client's connection pool and credentials, not through its typed API classes.

The typed classes validate every call with pydantic. Each method builds its validator at
its first call, for about 3 ms of CPU, and each thread that makes that first call at the
same moment builds its own. Every body also goes to a model and back. A node paid that on
the write of its first join, while the other nodes waited for it; the operator paid the
validation on every status write (bench/FINDINGS.md). Both sides' ``kube`` modules send
their requests through here.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

JSON: Final = "application/json"
MERGE_PATCH: Final = "application/merge-patch+json"
DEFAULT_TIMEOUT: Final = (5.0, 30.0)
"""Connect and read timeouts of every request but watches: a request caught by an API
server restart must fail and be retried, not hang forever."""

SERVICE_ACCOUNT_DIR_ENV: Final = "K8S_RENDEZVOUS_SERVICE_ACCOUNT_DIR"
"""Where the pod's service-account files are, if not at the standard path."""
DEFAULT_SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_message(error: ApiException) -> str:
    """The API server's own message of a refused request (its Status body), else the HTTP
    reason: what both sides' errors quote."""
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.reason)


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
        """The answer's JSON; ``ApiException`` for a non-2xx answer, urllib3's errors for
        a failed transport."""
        response = self._send(method, path, body, content_type, query, timeout)
        return cast(dict[str, Any], json.loads(response.data))

    def stream(self, path: str, query: Query, timeout: Timeout) -> urllib3.BaseHTTPResponse:
        """A GET whose body is left to read as it arrives (a watch); the caller closes it."""
        return self._send("GET", path, None, JSON, query, timeout, preload=False)

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
        if not 200 <= response.status <= 299:
            error = ApiException(status=response.status, reason=response.reason)
            error.body = response.data.decode(errors="replace")
            error.headers = response.headers
            response.release_conn()
            raise error
        return response
