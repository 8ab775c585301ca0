"""Zero-flag torchrun: the environment a pod of an annotated Job gets (pure).

torchrun reads every option from ``PET_<OPTION>`` when the flag is absent, so injecting
these variables makes a plain ``torchrun train.py`` use this backend; an explicit flag
still wins, and so does any variable the container already sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k8s_rendezvous import BACKEND_NAME, state


def torchrun_environment(rendezvous: str, spec: state.RendezvousSpec) -> list[dict[str, Any]]:
    """The env block, also what to write by hand in clusters without the webhook."""

    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        {"name": "PET_RDZV_BACKEND", "value": BACKEND_NAME},
        {"name": "PET_RDZV_ENDPOINT", "value": rendezvous},
        {"name": "PET_RDZV_ID", "value": spec.run_id},
        {"name": "PET_NNODES", "value": f"{spec.min_nodes}:{spec.max_nodes}"},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
    ]


def inject(pod: Mapping[str, Any], rendezvous: str, spec: state.RendezvousSpec) -> dict[str, Any]:
    """A merge patch for ``pod``: the env in every container (what a container already
    defines is kept) and the label the operator watches node pods by."""
    additions = torchrun_environment(rendezvous, spec)
    containers = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        env = list(container.get("env") or [])
        defined = {variable.get("name") for variable in env}
        env += [variable for variable in additions if variable["name"] not in defined]
        containers.append({**container, "env": env})
    return {
        "metadata": {"labels": {state.NODE_LABEL: rendezvous}},
        "spec": {"containers": containers},
    }


def configured_for_rendezvous(pod: Mapping[str, Any]) -> bool:
    """Whether a container of ``pod`` is told to use this backend: the env the webhook
    injects (or its user wrote), or torchrun's own flag on its command line."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if any(v.get("name") == "PET_RDZV_BACKEND" for v in container.get("env") or []):
            return True
        words = [*(container.get("command") or []), *(container.get("args") or [])]
        if any("rdzv-backend" in word or "rdzv_backend" in word for word in words):
            return True
    return False
