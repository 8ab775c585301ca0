"""Run inside a real pod of an annotated Job: tries, with the token the kubelet mounted,
what a hostile pod would, and prints one JSON line per attempt (its HTTP status and the API
server's message). Then it sleeps, so the pod stays Running while the test reads its log.

    python tests/nodes/hostile_pod.py VICTIM_POD
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import kubernetes
from kubernetes.client.exceptions import ApiException

from k8s_rendezvous.wire import leases, objects

TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def pod_uid_of_token() -> str:
    payload = TOKEN.read_text().split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return str(claims["kubernetes.io"]["pod"]["uid"])


def attempt(name: str, call: Callable[[], object]) -> None:
    try:
        call()
    except ApiException as error:
        message = json.loads(error.body).get("message", "") if error.body else ""
        print(json.dumps({"attempt": name, "status": error.status, "message": message}))
    else:
        print(json.dumps({"attempt": name, "status": 200, "message": ""}))
    sys.stdout.flush()


def main(victim: str) -> None:
    kubernetes.config.load_incluster_config()
    custom = kubernetes.client.CustomObjectsApi()
    namespace, me = os.environ["POD_NAMESPACE"], os.environ["POD_NAME"]
    rendezvous = os.environ["PET_RDZV_ENDPOINT"]
    entry = leases.NodeEntry("hostile", 1, os.environ["POD_IP"], 29500)
    owner = objects.owner_reference(
        objects.API_VERSION,
        objects.KIND,
        rendezvous,
        custom.get_namespaced_custom_object(
            objects.GROUP, objects.VERSION, namespace, objects.PLURAL, rendezvous
        )["metadata"]["uid"],
        controller=False,
    )

    def lease(name: str, labelled: bool = True) -> Callable[[], object]:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "labels": {objects.NODE_LABEL: rendezvous} if labelled else {},
                "annotations": {
                    objects.ENTRY_ANNOTATION: entry.to_annotation(),
                    objects.POD_UID_ANNOTATION: pod_uid_of_token(),
                },
                "ownerReferences": [owner],
            },
            "spec": {"holderIdentity": me, "leaseDurationSeconds": 30},
        }
        return lambda: custom.create_namespaced_custom_object(
            "coordination.k8s.io", "v1", namespace, "leases", body
        )

    attempt("own-lease", lease(objects.lease_name(rendezvous, me)))
    attempt("victim-lease", lease(objects.lease_name(rendezvous, victim)))
    attempt("other-controller-lock", lease("some-controller-lock", labelled=False))
    attempt(
        "rendezvous-status",
        lambda: custom.patch_namespaced_custom_object_status(
            objects.GROUP,
            objects.VERSION,
            namespace,
            objects.PLURAL,
            rendezvous,
            {"status": {"round": 99}},
            _content_type="application/merge-patch+json",
        ),
    )
    print(json.dumps({"attempt": "done"}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
