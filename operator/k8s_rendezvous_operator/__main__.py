"""``k8s-rendezvous-operator``: run the operator (``python -m k8s_rendezvous_operator``)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from k8s_rendezvous import __version__
from k8s_rendezvous_operator import settings

log = logging.getLogger("k8s_rendezvous_operator")


def command_line() -> argparse.ArgumentParser:
    """The operator's flags, with their defaults."""
    parser = argparse.ArgumentParser(
        prog="k8s-rendezvous-operator",
        description="Seal elastic PyTorch rendezvous rounds kept in Rendezvous resources.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: the whole cluster",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint URL, or '' to disable (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="serve Prometheus metrics at :PORT/metrics (0 disables; default: %(default)s)",
    )
    parser.add_argument(
        "--job-label-selector",
        default="",
        help="only consider Jobs matching this label selector (filtered by the API server), "
        "e.g. k8s-rendezvous.dev/enabled=true; default: every Job, opted in by annotation",
    )
    parser.add_argument(
        "--worker-role",
        default="k8s-rendezvous-worker",
        help="ClusterRole to bind to the ServiceAccount of annotated Jobs in their namespace "
        "('' to leave binding to the user; default: %(default)s)",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=1.0,
        help="seconds between UDP probes of each member's agent (0 disables probing: a "
        "silent agent is then dropped only when its Lease expires; default: %(default)s)",
    )
    parser.add_argument(
        "--probe-window",
        type=float,
        default=3.0,
        help="drop a member whose agent answered none of this many seconds' probes in a row "
        "(window / interval of them; at least twice --probe-interval; default: %(default)s)",
    )
    admission = parser.add_argument_group("zero-flag torchrun (mutating admission webhook)")
    admission.add_argument(
        "--webhook",
        action="store_true",
        help="inject torchrun's PET_* environment into pods of annotated Jobs",
    )
    admission.add_argument(
        "--webhook-host",
        default="",
        help="host name the API server reaches the webhook at (its Service's DNS name)",
    )
    admission.add_argument(
        "--webhook-service",
        default="",
        help="NAMESPACE/NAME of the Service in front of the webhook: registered by Service "
        "reference (its port = --webhook-port) instead of by URL; what a cluster needs",
    )
    admission.add_argument("--webhook-addr", default="", help="listen address (default: all)")
    admission.add_argument("--webhook-port", type=int, default=9443, help="(default: %(default)s)")
    admission.add_argument(
        "--webhook-cert-dir",
        default="",
        help="directory with ca.crt, tls.crt, tls.key; default: a self-signed set made at start",
    )
    admission.add_argument(
        "--webhook-timeout-seconds",
        type=int,
        choices=range(1, 31),
        metavar="1..30",
        default=5,
        help="how long the API server waits for the webhook before it admits a pod without "
        "the environment (default: %(default)s)",
    )
    admission.add_argument(
        "--webhook-max-connections",
        type=int,
        choices=range(1, 4097),
        metavar="1..4096",
        default=64,
        help="connections the webhook serves at once (TLS handshakes included); more wait "
        "in the kernel's queue, unanswered, until one ends (default: %(default)s)",
    )
    admission.add_argument(
        "--webhook-config-name",
        default="torchrun-env.k8s-rendezvous.dev",
        help="name of the MutatingWebhookConfiguration the operator keeps its webhook in "
        "(made if missing; default: %(default)s)",
    )
    parser.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding a coordination.k8s.io Lease, so that several replicas "
        "are safe; exits when the Lease is lost (default: off)",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the Lease (default: POD_NAMESPACE, else the service account's)",
    )
    parser.add_argument(
        "--leader-election-id",
        default="k8s-rendezvous-operator",
        help="name of the Lease (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = command_line()
    args = parser.parse_args(argv)
    if args.probe_interval < 0:
        parser.error(f"--probe-interval must be 0 (no probes) or more, got {args.probe_interval}")
    if args.probe_interval and args.probe_window < 2 * args.probe_interval:
        parser.error(
            "--probe-window must be at least twice --probe-interval (one lost datagram must "
            f"not drop a member), got {args.probe_window} and {args.probe_interval}"
        )
    if args.webhook and not args.webhook_host:
        parser.error("--webhook needs --webhook-host (the webhook Service's DNS name)")
    parsed = settings_of(args)

    try:
        import kopf
        import prometheus_client  # noqa: F401  (what metrics needs, checked here to say so)
    except ModuleNotFoundError as error:
        sys.exit(
            f"k8s-rendezvous-operator: {error.name} is missing: the operator needs its extra, "
            "pip install 'k8s-rendezvous[operator]'"
        )

    if args.metrics_port:
        from k8s_rendezvous_operator import metrics

        metrics.serve(args.metrics_port)
        metrics.BUILD_INFO.labels(__version__).set(1)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    log.info("k8s-rendezvous-operator %s starting", __version__)
    from k8s_rendezvous_operator import handlers  # registers the kopf handlers

    if parsed.webhook is not None:
        handlers.register_webhook()
    from k8s_rendezvous_operator import leadership

    # The liveness endpoint is ours, not kopf's: kopf's binds one address family only.
    run: Callable[..., None] = functools.partial(
        leadership.run_unelected, liveness_endpoint=args.liveness or None
    )
    if args.leader_elect:
        from k8s_rendezvous_operator import kube

        run = functools.partial(
            leadership.run_elected,
            namespace=args.leader_election_namespace,
            name=args.leader_election_id,
            api_client=kube.load_api_client(),
            liveness_endpoint=args.liveness or None,
        )
    run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,
        # Named here: kopf would ask the password database for the user, and the image's
        # user 65532 has no entry there (getpwuid raises KeyError).
        identity=leadership.default_identity(),
        memo=kopf.Memo(settings=parsed),
    )


def settings_of(args: argparse.Namespace) -> settings.Settings:
    """The flags :func:`command_line` parsed, as the kopf handlers read them."""
    return settings.Settings(
        namespaces=tuple(args.namespace),
        job_label_selector=args.job_label_selector or None,
        worker_role=args.worker_role or None,
        probes=(
            settings.Probes(args.probe_interval, args.probe_window) if args.probe_interval else None
        ),
        webhook=(
            settings.Webhook(
                host=args.webhook_host,
                service=args.webhook_service or None,
                addr=args.webhook_addr or None,
                port=args.webhook_port,
                cert_dir=Path(args.webhook_cert_dir) if args.webhook_cert_dir else None,
                timeout_seconds=args.webhook_timeout_seconds,
                max_connections=args.webhook_max_connections,
                config_name=args.webhook_config_name,
            )
            if args.webhook
            else None
        ),
    )


if __name__ == "__main__":
    main()
