"""The mutating admission webhook that gives pods of annotated Jobs torchrun's
environment: its configuration and server (registered with kopf by
:func:`.handlers.register_webhook` when ``--webhook`` is on).

The operator registers it itself, not through kopf's managed configuration (which fixes
the timeout at 30 s and sends pods of every namespace): only pods with the
``batch.kubernetes.io/job-name`` label, only in the namespaces it watches, failure policy
``Ignore`` and a timeout of a few seconds, so that a down or hung operator never blocks a
pod, and delays one by that much at most.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import kopf

from k8s_rendezvous_operator import kube

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
        server: kopf's server (TLS, the listening socket, the routing to handlers).
        service: ``NAMESPACE/NAME`` of the Service in front of the webhook, to register by
            Service reference (kube-apiserver reaches Services through its own service
            resolution, but usually cannot resolve their DNS names in a URL); ``""`` to
            register the server's URL (local runs).
        service_port: The Service's port.
    """

    def __init__(
        self,
        server: kopf.WebhookServer,
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


def server(options: Mapping[str, Any], namespaces: Sequence[str]) -> RegisteringWebhookServer:
    """The webhook server the operator's ``--webhook-*`` ``options`` describe: its
    certificate from ``cert_dir``, or self-signed for ``host`` (and ``addr``)."""
    # Imported here: cryptography costs every operator its memory, and only this needs it.
    from k8s_rendezvous_operator import certificates

    if options["cert_dir"]:
        directory = Path(options["cert_dir"])
        ca, cert, key = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    else:
        directory = Path(tempfile.mkdtemp(prefix="k8s-rendezvous-webhook-"))
        ca, cert, key = certificates.write_self_signed(
            directory, [options["host"], *([options["addr"]] if options["addr"] else [])]
        )
    listening = kopf.WebhookServer(
        addr=options["addr"] or None,
        port=options["port"],
        host=options["host"],
        cafile=str(ca),
        certfile=str(cert),
        pkeyfile=str(key),
    )
    return RegisteringWebhookServer(
        listening,
        kube.OperatorApi(kube.load_api_client()),
        options["config_name"],
        service=options["service"],
        service_port=options["port"],
        timeout_seconds=options["timeout_seconds"],
        namespaces=namespaces,
    )
