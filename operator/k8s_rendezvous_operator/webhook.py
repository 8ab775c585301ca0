"""The mutating admission webhook that gives pods of annotated Jobs torchrun's
environment (imported only when ``--webhook`` is on, so its handler is registered then).

Only pods with the ``batch.kubernetes.io/job-name`` label are sent to it (an object
selector evaluated by the API server) and its failure policy is ``Ignore``: a down
operator never blocks a pod from being created.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import kopf

from k8s_rendezvous_operator import certificates, injection
from k8s_rendezvous_operator.reconciler import Reconciler

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


class ServiceWebhookServer(kopf.WebhookServer):
    """Registers the webhook by Service reference: kube-apiserver reaches Services through
    its own service resolution, but usually cannot resolve their DNS names in a URL."""

    def __init__(self, *, service: str, service_port: int, **options: Any) -> None:
        super().__init__(**options)
        self._namespace, _, self._name = service.rpartition("/")
        self._service_port = service_port

    async def __call__(self, fn: Any) -> Any:
        async for config in super().__call__(fn):
            yield {
                **({"caBundle": config["caBundle"]} if config.get("caBundle") else {}),
                "service": {
                    "namespace": self._namespace,
                    "name": self._name,
                    "port": self._service_port,
                    "path": "",
                },
            }


@kopf.on.startup()
async def configure_webhook(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options = memo["webhook"]
    if options["cert_dir"]:
        directory = Path(options["cert_dir"])
        ca, cert, key = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    else:
        directory = Path(tempfile.mkdtemp(prefix="k8s-rendezvous-webhook-"))
        ca, cert, key = certificates.write_self_signed(
            directory, [options["host"], *([options["addr"]] if options["addr"] else [])]
        )
    server_options: dict[str, Any] = {
        "addr": options["addr"] or None,
        "port": options["port"],
        "host": options["host"],
        "cafile": str(ca),
        "certfile": str(cert),
        "pkeyfile": str(key),
    }
    settings.admission.server = (
        ServiceWebhookServer(
            service=options["service"], service_port=options["port"], **server_options
        )
        if options["service"]
        else kopf.WebhookServer(**server_options)
    )
    settings.admission.managed = options["config_name"]


@kopf.on.mutate(
    "",
    "v1",
    "pods",
    id="torchrun-env",
    operations={"CREATE"},
    ignore_failures=True,
    labels={JOB_NAME_LABEL: kopf.PRESENT},
)
async def inject_torchrun_env(
    body: kopf.Body, patch: kopf.Patch, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    reconciler: Reconciler = memo["reconciler"]
    found = await reconciler.rendezvous_for_pod(namespace or body.metadata.namespace or "", body)
    if found is not None:
        name, spec = found
        for key, value in injection.inject(body, name, spec).items():
            patch[key] = value
