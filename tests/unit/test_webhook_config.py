"""How the operator registers its webhook: by Service reference in a cluster (the API
server resolves Services, not their DNS names in URLs), by URL for local runs; and the
certificates made at start cover the names the API server will use."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

from k8s_rendezvous_operator import certificates, webhook


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def first_config(server: Any) -> dict[str, Any]:
    async def handler(*_: Any, **__: Any) -> None:
        return None

    configs = server(handler)
    try:
        return dict(await configs.__anext__())
    finally:
        await configs.aclose()


class RecordingApi:
    """Stands in for the API only to capture what would be registered; the registration
    itself runs against the real API server in tests/chart and tests/integration."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, list[dict[str, Any]]]] = []

    def register_webhooks(self, configuration: str, webhooks: list[dict[str, Any]]) -> None:
        self.registered.append((configuration, webhooks))


def test_a_service_reference_with_its_ca_bundle_is_registered_before_kopf_gets_it(
    tmp_path: Path,
) -> None:
    ca, cert, key = certificates.write_self_signed(tmp_path, ["op-webhook.system.svc", "127.0.0.1"])
    port = free_port()
    api = RecordingApi()
    server = webhook.RegisteringWebhookServer(
        webhook.BoundedServer(
            addr="127.0.0.1",
            port=port,
            host="op-webhook.system.svc",
            cafile=ca,
            certfile=cert,
            pkeyfile=key,
            limits=webhook.Limits(),
        ),
        api,  # type: ignore[arg-type]
        "op.k8s-rendezvous.dev",
        service="system/op-webhook",
        service_port=port,
        timeout_seconds=3,
        namespaces=["team-b", "team-a"],
    )
    config = asyncio.run(first_config(server))
    assert "url" not in config
    assert config["service"] == {"namespace": "system", "name": "op-webhook", "port": port}
    assert config["caBundle"]
    ((name, (registered,)),) = api.registered
    assert name == "op.k8s-rendezvous.dev"
    assert registered["clientConfig"] == {
        "caBundle": config["caBundle"],
        "service": {
            "namespace": "system",
            "name": "op-webhook",
            "port": port,
            "path": "/torchrun-env",
        },
    }
    assert registered["timeoutSeconds"] == 3
    assert registered["failurePolicy"] == "Ignore"
    assert registered["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
        ]
    }


def test_a_url_gets_the_handlers_path_and_a_cluster_wide_operator_skips_system_namespaces() -> None:
    (registered,) = webhook.webhooks(
        {"url": "https://127.0.0.1:9443"}, timeout_seconds=5, namespaces=()
    )
    assert registered["clientConfig"] == {"url": "https://127.0.0.1:9443/torchrun-env"}
    (excluded,) = registered["namespaceSelector"]["matchExpressions"]
    assert excluded["operator"] == "NotIn" and "kube-system" in excluded["values"]
    assert registered["objectSelector"] == {
        "matchExpressions": [{"key": "batch.kubernetes.io/job-name", "operator": "Exists"}]
    }


def test_self_signed_certificate_verifies_for_its_names(tmp_path: Path) -> None:
    ca, cert, key = certificates.write_self_signed(tmp_path, ["op-webhook.system.svc", "127.0.0.1"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(ca))
    for name in ("op-webhook.system.svc", "127.0.0.1"):
        a, b = socket.socketpair()
        with (
            server.wrap_socket(a, server_side=True, do_handshake_on_connect=False) as s,
            client.wrap_socket(b, server_hostname=name, do_handshake_on_connect=False) as c,
        ):
            s.setblocking(False)
            c.setblocking(False)
            for _ in range(50):  # drive both ends of the handshake in one thread
                done = 0
                for end in (c, s):
                    try:
                        end.do_handshake()
                        done += 1
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        pass
                if done == 2:
                    break
            assert done == 2, f"TLS handshake for {name}"
