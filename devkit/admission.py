"""AdmissionReviews as the API server sends them to the webhook, for tests and benchmarks
that write to its port directly (as anyone who reaches the port can)."""

from __future__ import annotations

import uuid
from typing import Any


def pod_review(
    namespace: str, job: str, job_uid: str, *, controller: bool = True
) -> dict[str, Any]:
    """A CREATE review of a pod of Job ``job`` (uid ``job_uid``; its controller unless not
    ``controller``), as the Job controller's request reaches the webhook."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{uuid.uuid4().hex[:5]}",
            "namespace": namespace,
            "labels": {"batch.kubernetes.io/job-name": job},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job,
                    "uid": job_uid,
                    "controller": controller,
                }
            ],
        },
        "spec": {"containers": [{"name": "trainer", "image": "example.invalid/trainer"}]},
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": namespace,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": pod,
        },
    }
