"""Real faults on real nodes (devkit/cluster/nodes.py): processes SIGKILLed by PID, pods
deleted or evicted, Kubernetes nodes drained or lost, the operator's leader killed and the
API server stopped; each node taken repaired :data:`REPAIR_SECONDS` later.

:class:`Injector` injects what bench/goodput.py's schedule deals; bench/real_nodes.py
injects one fault a run with :func:`evict` and :func:`lose_node`.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import kubernetes.client

from bench.fault_schedule import NODE_FAULTS, POD_FAULTS, Fault
from bench.goodput_measures import latest_world, read_lines
from devkit import chart
from devkit.cluster.controlplane import dig, read_object, to_model
from devkit.cluster.nodes import RealNodes
from devkit.nodepool import NodePool
from devkit.training import (
    TrainingJob,
    agent_pid,
    operator_leader,
    pod_processes,
    wait_webhook_served_by_leader_alone,
    worker_pid,
)
from k8s_rendezvous.wire import codec
from k8s_rendezvous_operator import leadership

REPAIR_SECONDS = 45.0
"""How long a drained node stays cordoned and a lost node stays lost."""
Json = dict[str, Any]


def evict(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> None:
    """Evict pod ``name`` through the eviction API, as a drain does."""
    core.create_namespaced_pod_eviction(
        name,
        namespace,
        to_model(
            kubernetes.client.V1Eviction, {"metadata": {"name": name, "namespace": namespace}}
        ),
    )


def lose_node(nodes: RealNodes, node: str) -> None:
    """Kubernetes node ``node`` lost: its kubelet killed and its network cut."""
    nodes.kill_kubelet(node)
    nodes.cut_network(node)


def leading_pod(lease: Json, now: float) -> str | None:
    """The pod holding the operator's leader Lease at ``now`` (the host's clock, the API
    server's too), if its hold has not expired: an expired holder is a leader killed whom
    no standby has replaced yet."""
    record = leadership.Record.from_lease(lease)
    if not record.holder or not record.renew_time:
        return None
    age = now - codec.parse_time(record.renew_time, "spec.renewTime").timestamp()
    return leadership.pod_of(record.holder) if age <= record.duration_seconds else None


class Injector:
    """Injects a goodput run's faults into its Job's pods (never ``protected``'s, and only
    into members of the world training now), their nodes and the control plane, and
    repairs each node it took :data:`REPAIR_SECONDS` later."""

    def __init__(
        self,
        pool: NodePool,
        api: kubernetes.client.ApiClient,
        namespace: str,
        seed: int,
        progress: Path,
    ) -> None:
        self.pool = pool
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.namespace = namespace
        self.seed = seed
        self.progress = progress
        """The workers' progress lines, which say who trains in the world now."""
        self.repairs: list[tuple[float, str, str]] = []
        """(when, in seconds after the schedule began; the fault's kind; the node) of each
        repair due."""

    def inject(self, job: TrainingJob, protected: str, fault: Fault, began: float) -> Json:
        """Inject ``fault``; returns it as injected (host clock, victim, what was done)."""
        running = job.running_pods()
        # A member of the world training now (a waiting spare has no worker to lose).
        members = set((latest_world(read_lines(self.progress)) or {}).values())
        pods = [
            p
            for p in running
            if p["metadata"]["name"] in members and p["metadata"]["name"] != protected
        ]
        guarded = next((p for p in running if p["metadata"]["name"] == protected), None)
        kind = fault.kind
        rng = random.Random(f"{self.seed}-{fault.at}")
        if kind in NODE_FAULTS:
            away = [
                p
                for p in pods
                if guarded is not None
                and p["spec"]["nodeName"] != guarded["spec"]["nodeName"]
                and not any(r[2] == p["spec"]["nodeName"] for r in self.repairs)
            ]
            if not away:
                kind = "pod"  # every pod is on rank 0's node: nothing else to lose
            else:
                pods = away
        victim = None
        if kind in POD_FAULTS and pods:
            victim = rng.choice(sorted(pods, key=lambda p: p["metadata"]["name"]))
        record: Json = {"planned": fault.kind, "kind": kind, "victim": None, "node": None}
        if kind in POD_FAULTS and victim is None:
            record["at"] = time.time()
            record["kind"] = "none (no pod to take)"
            return record
        if victim is not None:
            record["victim"] = victim["metadata"]["name"]
            record["node"] = victim["spec"]["nodeName"]
        nodes = self.pool.nodes
        assert nodes is not None
        if kind in ("worker", "container"):
            assert victim is not None
            try:
                pid = (worker_pid if kind == "worker" else agent_pid)(victim)
            except ValueError:  # not one such process now: its agent is restarting workers
                record["at"] = time.time()
                record["kind"] = "none (no process to take)"
                return record
            record["at"] = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif kind == "pod":
            record["at"] = time.time()
            self.core.delete_namespaced_pod(record["victim"], self.namespace)
        elif kind == "drain":
            node = record["node"]
            record["at"] = time.time()
            self.pool.control_plane.kubectl("cordon", node)
            for pod in job.running_pods():
                if pod["spec"]["nodeName"] == node:
                    with contextlib.suppress(kubernetes.client.exceptions.ApiException):
                        evict(self.core, self.namespace, pod["metadata"]["name"])
            self.repairs.append((record["at"] - began + REPAIR_SECONDS, "drain", node))
        elif kind == "node":
            node = record["node"]
            record["leader_node"] = self._operator_leader_node()
            record["at"] = time.time()
            lose_node(nodes, node)
            self.repairs.append((record["at"] - began + REPAIR_SECONDS, "node", node))
        elif kind == "leader":
            leader = operator_leader(self.api)
            pod = read_object(self.core.read_namespaced_pod, leader, chart.NAMESPACE)
            pids = [p for p, cmd in pod_processes(pod).items() if "rendezvous" in cmd]
            record["victim"], record["node"] = leader, dig(pod, "spec", "nodeName")
            record["at"] = time.time()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            record["at"] = time.time()
            try:
                self.pool.control_plane.stop_apiserver()
            finally:  # even when interrupted: the run's cleanup needs the API server
                self.pool.control_plane.start_apiserver()
            record["restored"] = time.time()
        return record

    def repair_due(self, now: float) -> None:
        """Repair each node whose repair is due ``now`` (seconds after the schedule began)."""
        for node in {node for at, _, node in self.repairs if at <= now}:
            self.repair(node)

    def repair_all(self) -> None:
        while self.repairs:
            self.repair(self.repairs[0][2])

    def repair(self, node: str) -> None:
        """Bring ``node`` back, whatever was done to it (each step tried on its own: the
        run's cleanup comes next)."""
        nodes = self.pool.nodes
        assert nodes is not None
        lost = [r for r in self.repairs if r[2] == node]
        for repair in lost:
            self.repairs.remove(repair)
        with contextlib.suppress(Exception):
            nodes.restore_network(node)
        with contextlib.suppress(Exception):
            nodes.start_kubelet(node)
        with contextlib.suppress(Exception):
            self.pool.control_plane.kubectl("uncordon", node)
        with contextlib.suppress(Exception):
            wait_webhook_served_by_leader_alone(self.api)

    def _operator_leader_node(self) -> str | None:
        """The node of the operator's leader by its Lease now (None: none held, its holder
        expired, or not known): a node lost with it costs the operator's takeover too."""
        try:
            lease = read_object(
                kubernetes.client.CoordinationV1Api(self.api).read_namespaced_lease,
                chart.OPERATOR,
                chart.NAMESPACE,
            )
            holder = leading_pod(lease, time.time())
            if holder is None:
                return None
            pod = read_object(self.core.read_namespaced_pod, holder, chart.NAMESPACE)
        except Exception:  # gone, or the API server unreachable: the record says not known
            return None
        node = dig(pod, "spec", "nodeName")
        return str(node) if node else None
