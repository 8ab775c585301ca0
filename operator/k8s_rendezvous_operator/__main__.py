"""``k8s-rendezvous-operator``: run the operator (``python -m k8s_rendezvous_operator``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="k8s-rendezvous-operator",
        description="Seal elastic PyTorch rendezvous rounds kept in Rendezvous resources.",
    )
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    args = parser.parse_args(argv)

    import kopf

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.FULL)
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from k8s_rendezvous_operator import reconciler  # registers the kopf handlers

    del reconciler
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=True,
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
