"""Zero-flag torchrun: the environment a pod of an annotated Job gets (pure).

torchrun reads every option from ``PET_<OPTION>`` when the flag is absent, so injecting
these variables makes a plain ``torchrun train.py`` use this backend; an explicit flag
still wins, and so does any variable the container already sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k8s_rendezvous import BACKEND_NAME
from k8s_rendezvous.wire import objects, specs


def torchrun_environment(
    rendezvous: str, spec: specs.RendezvousSpec, agent_env: Sequence[tuple[str, str]] = ()
) -> list[dict[str, Any]]:
    """The env block, also what to write by hand in clusters without the webhook, with what
    the Job's annotations give its pods' agents (``agent_env``, name and value)."""

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
        *({"name": name, "value": value} for name, value in agent_env),
    ]


KUBE_NODE_NAME_LABEL = "kubernetes.io/hostname"
"""The node label the exclusion matches: the kubelet sets it to the node's name unless
told otherwise (``--hostname-override``), and node affinity cannot match
``metadata.name`` in a ``matchExpressions`` term."""


KEEP_OFF_WEIGHT = 100
"""The heaviest a preferred term may weigh, so that the scheduler's other scores (spread,
free resources, cached images; each at most 100 times a smaller plugin weight) rarely
outweigh it."""


def keep_off(pod: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    """The pod's ``affinity`` with a preference, of the heaviest weight, for any node but
    ``nodes``; its other affinities are kept.

    A preference, not a requirement: a pod that fits nowhere else (a hard spread over two
    nodes, one of them excluded) lands on an excluded node rather than stay ``Pending``
    for the exclusion's day, and a one-off crash does not shrink the world that long."""
    affinity = dict((pod.get("spec") or {}).get("affinity") or {})
    node_affinity = dict(affinity.get("nodeAffinity") or {})
    keep_out = {"key": KUBE_NODE_NAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
        *(node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []),
        {"weight": KEEP_OFF_WEIGHT, "preference": {"matchExpressions": [keep_out]}},
    ]
    affinity["nodeAffinity"] = node_affinity
    return affinity


def inject(
    pod: Mapping[str, Any],
    rendezvous: str,
    spec: specs.RendezvousSpec,
    excluded_nodes: Sequence[str] = (),
    agent_env: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """A merge patch for ``pod``: the env in every container (what a container already
    defines is kept), the label the operator watches node pods by, and, when the
    rendezvous keeps Kubernetes nodes out, a node affinity that keeps the pod off them."""
    additions = torchrun_environment(rendezvous, spec, agent_env)
    containers = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        env = list(container.get("env") or [])
        defined = {variable.get("name") for variable in env}
        env += [variable for variable in additions if variable["name"] not in defined]
        containers.append({**container, "env": env})
    pod_spec: dict[str, Any] = {"containers": containers}
    if excluded_nodes:
        pod_spec["affinity"] = keep_off(pod, excluded_nodes)
    return {"metadata": {"labels": {objects.NODE_LABEL: rendezvous}}, "spec": pod_spec}


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
