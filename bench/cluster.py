"""The system under test: the real control plane (devkit/cluster), the CRD and roles, the
operator as its own process (as a Deployment runs it: no ``--verbose``, metrics served),
namespaces, pods on kwok nodes with pod-bound tokens, the API server's /metrics and
per-process CPU/RSS sampling with psutil."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import ssl
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes.client
import psutil
from kubernetes.client.exceptions import ApiException

from devkit import manifests, namespaces, paths
from devkit.cluster.controlplane import (
    POD_IP_ANNOTATION,
    ControlPlane,
    build_binaries,
    dig,
    read_object,
    read_object_or_none,
)
from devkit.operator import OperatorProcess
from devkit.waiting import WaitTimeout, wait_for
from k8s_rendezvous.wire import objects

Log = Callable[[str], None]
OPERATOR_METRICS_PORT = 8081
"""The operator's default, which the chart's Deployment serves on."""


def pod_ips(pod: dict[str, Any]) -> list[str]:
    """A pod's ``status.podIPs`` (else its ``podIP``): the addresses the operator admits
    from its node."""
    status = pod.get("status") or {}
    return [item["ip"] for item in status.get("podIPs") or []] or [status.get("podIP", "")]


@dataclasses.dataclass
class Pod:
    name: str
    uid: str
    token: str = ""


class Cluster:
    def __init__(self, workdir: Path, log: Log) -> None:
        self.workdir = workdir
        self.log = log
        self.plane: ControlPlane | None = None
        self.operator: OperatorProcess | None = None
        self._admin: kubernetes.client.ApiClient | None = None
        self._metrics_context: ssl.SSLContext | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        binaries = build_binaries()
        self.plane = ControlPlane(binaries)
        self.plane.start()
        self.log(f"control plane up in {time.monotonic() - started:.1f} s at {self.plane.server}")
        # What a production install adds: CEL admission, API Priority and Fairness for
        # the nodes' Leases.
        manifests.install(self.plane, paths.POLICY, paths.FLOW_CONTROL)
        self._admin = self.plane.api_client()
        self._admin.configuration.connection_pool_maxsize = 64
        self.operator = OperatorProcess(
            self.plane.kubeconfig,
            self.workdir / "operator.log",
            extra_args=(f"--metrics-port={OPERATOR_METRICS_PORT}",),
            verbose=False,
        )
        self.operator.start()
        probe = self.new_namespace("probe")
        self.create_rendezvous(probe, "probe", 1, 1)
        self.wait_initialised(probe, ["probe"], timeout=120, interval=0.1)
        self.delete_namespace(probe)
        self.log(f"operator ready (pid {self.operator.pid})")

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self._admin is not None:
            self._admin.close()  # type: ignore[no-untyped-call]
        if self.plane is not None:
            self.plane.stop()

    @property
    def admin(self) -> kubernetes.client.ApiClient:
        assert self._admin is not None
        return self._admin

    @property
    def server(self) -> str:
        assert self.plane is not None
        return self.plane.server

    @property
    def ca_file(self) -> str:
        assert self.plane is not None
        return str(self.plane.ca_file)

    def pids(self) -> dict[str, int]:
        assert self.plane is not None and self.operator is not None
        assert self.operator.pid is not None
        pids = {
            "kube-apiserver": self.plane.pids["kube-apiserver"],
            "etcd": self.plane.pids["etcd"],
            "operator": self.operator.pid,
        }
        return pids

    # -- objects ---------------------------------------------------------------------------

    def new_namespace(self, prefix: str) -> str:
        name = namespaces.create(self.admin, f"{prefix}-{uuid.uuid4().hex[:6]}")
        namespaces.bind_worker_role(self.admin, name)
        return name

    def delete_namespace(self, name: str, timeout: float = 300) -> None:
        """Delete and wait until it is gone, so its teardown does not overlap what follows.
        Rendezvous go first: the operator then forgets them instead of reporting every pod
        of the namespace as a lost member."""
        core = kubernetes.client.CoreV1Api(self.admin)
        with contextlib.suppress(ApiException):
            kubernetes.client.CustomObjectsApi(
                self.admin
            ).delete_collection_namespaced_custom_object(
                objects.GROUP, objects.VERSION, name, objects.PLURAL
            )
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)

        try:
            wait_for(
                lambda: read_object_or_none(core.read_namespace, name) is None,
                timeout,
                f"namespace {name} deleted",
                interval=0.25,
                max_interval=0.25,
                ignore=(ApiException,),
            )
        except WaitTimeout as error:
            self.log(f"warning: {error}")

    def create_pods(
        self,
        namespace: str,
        rendezvous_of: dict[str, str],
        addresses: dict[str, str],
        timeout: float = 600,
    ) -> list[Pod]:
        """Pods scheduled onto kwok nodes, Running, each with a pod-bound token and the IP
        ``addresses`` gives it (pod name to address, the one its node offers). They carry
        :data:`~devkit.manifests.WORKLOAD_LABELS`, which the Rendezvous select, and are
        labelled with their rendezvous, as the operator's webhook labels an annotated Job's
        pods at admission (so the operator need not label them itself)."""
        core = kubernetes.client.CoreV1Api(self.admin)
        names = list(rendezvous_of)

        def create(name: str) -> None:
            body = manifests.bare_pod(
                name,
                labels={**manifests.WORKLOAD_LABELS, objects.NODE_LABEL: rendezvous_of[name]},
                annotations={POD_IP_ANNOTATION: addresses[name]},
                terminationGracePeriodSeconds=0,
            )
            for attempt in range(5):
                try:
                    core.create_namespaced_pod(namespace, body)  # type: ignore[arg-type]
                    return
                except ApiException as error:
                    if error.status == 409:
                        return
                    if error.status not in (429, 500, 503) or attempt == 4:
                        raise
                    time.sleep(0.5 * (attempt + 1))

        with ThreadPoolExecutor(max_workers=8) as executor:
            list(executor.map(create, names))
        wanted = set(names)

        def running() -> dict[str, Any] | None:
            found = read_object(core.list_namespaced_pod, namespace)["items"]
            ready = {
                p["metadata"]["name"]: p
                for p in found
                if (p.get("status") or {}).get("phase") == "Running"
                and (p.get("status") or {}).get("podIP")
            }
            return ready if wanted <= set(ready) else None

        started: dict[str, Any] = wait_for(
            running,
            timeout,
            f"{len(names)} pods Running",
            interval=0.5,
            max_interval=0.5,
            ignore=(ApiException,),
        )
        elsewhere = {
            name: ips for name in names if addresses[name] not in (ips := pod_ips(started[name]))
        }
        if elsewhere:
            raise RuntimeError(
                f"pods not at the IP their {POD_IP_ANNOTATION} annotation asked for "
                f"(pod: its IPs): {dict(list(elsewhere.items())[:5])}"
            )
        pods = [Pod(name, started[name]["metadata"]["uid"]) for name in names]

        def token(pod: Pod) -> None:
            request = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [],
                    "expirationSeconds": 7200,
                    "boundObjectRef": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod.name,
                        "uid": pod.uid,
                    },
                },
            }
            answer = read_object(
                core.create_namespaced_service_account_token,
                "default",
                namespace,
                request,
            )
            pod.token = answer["status"]["token"]

        with ThreadPoolExecutor(max_workers=8) as executor:
            list(executor.map(token, pods))
        return pods

    def delete_pod(self, namespace: str, name: str) -> None:
        kubernetes.client.CoreV1Api(self.admin).delete_namespaced_pod(
            name, namespace, grace_period_seconds=0
        )

    def create_rendezvous(
        self, namespace: str, name: str, min_nodes: int, max_nodes: int, **spec: Any
    ) -> None:
        body = manifests.rendezvous(namespace, name, min_nodes, max_nodes, **spec)
        kubernetes.client.CustomObjectsApi(self.admin).create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, namespace, objects.PLURAL, body
        )

    def rendezvous(self, namespace: str, name: str) -> dict[str, Any]:
        return read_object(
            kubernetes.client.CustomObjectsApi(self.admin).get_namespaced_custom_object,
            objects.GROUP,
            objects.VERSION,
            namespace,
            objects.PLURAL,
            name,
        )

    def _round_key(self, namespace: str, name: str) -> str | None:
        key = dig(self.rendezvous(namespace, name), "status", "roundKey")
        return None if key is None else str(key)

    def wait_initialised(
        self, namespace: str, names: Iterable[str], timeout: float = 60, interval: float = 0.05
    ) -> None:
        """The operator has written the first status (roundKey) of each Rendezvous."""
        for name in names:
            wait_for(
                functools.partial(self._round_key, namespace, name),
                timeout,
                f"{namespace}/{name} initialised by the operator",
                interval=interval,
                max_interval=interval,
                ignore=(ApiException,),
            )

    # -- metrics ---------------------------------------------------------------------------

    def metrics(self) -> Metrics:
        """Scrape the API server's /metrics as admin (client certificate)."""
        assert self.plane is not None
        if self._metrics_context is None:
            context = ssl.create_default_context(cafile=self.ca_file)
            admin = self.plane.pki.clients["admin"]
            context.load_cert_chain(str(admin.cert), str(admin.key))
            self._metrics_context = context
        with urllib.request.urlopen(
            f"{self.server}/metrics", timeout=30, context=self._metrics_context
        ) as answer:
            return Metrics.parse(answer.read().decode())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_WANTED = (
    "apiserver_request_total",
    "etcd_requests_total",
    "apiserver_request_duration_seconds_sum",
    "apiserver_request_duration_seconds_count",
    "apiserver_watch_events_total",
    "apiserver_watch_events_sizes_sum",
    "apiserver_watch_events_sizes_count",
    "apiserver_longrunning_requests",
)


@dataclasses.dataclass
class Metrics:
    """The API server counters the cost section needs (Prometheus text, parsed)."""

    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = []
        for line in text.splitlines():
            if not line.startswith(_WANTED):
                continue
            if line.startswith(("etcd_", "apiserver_request_duration")) and (
                'resource="rendezvous"' not in line
            ):
                continue
            match = _SAMPLE.match(line)
            if not match:
                continue
            labels = dict(_LABEL.findall(match.group(3) or ""))
            with contextlib.suppress(ValueError):
                samples.append((match.group(1), labels, float(match.group(4))))
        return cls(samples)

    def requests(self) -> dict[str, float]:
        """apiserver_request_total summed by ``VERB resource[/subresource]``."""
        totals: dict[str, float] = {}
        for name, labels, value in self.samples:
            if name != "apiserver_request_total":
                continue
            resource = labels.get("resource", "")
            if labels.get("subresource"):
                resource += "/" + labels["subresource"]
            key = f"{labels.get('verb', '?')} {resource or labels.get('path', '?')}"
            totals[key] = totals.get(key, 0.0) + value
        return totals

    def refused(self) -> dict[str, float]:
        """Requests answered 429 (API Priority and Fairness: too many at once from one
        flow), by ``VERB resource``."""
        totals: dict[str, float] = {}
        for name, labels, value in self.samples:
            if name == "apiserver_request_total" and labels.get("code") == "429":
                key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}"
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def writes(self) -> tuple[float, float, float]:
        """(PATCH requests, their summed seconds, etcd update attempts) on rendezvous."""
        patches = seconds = attempts = 0.0
        for name, labels, value in self.samples:
            if labels.get("resource") != "rendezvous":
                continue
            if name == "etcd_requests_total" and labels.get("operation") == "update":
                attempts += value
            elif labels.get("verb") == "PATCH":
                if name == "apiserver_request_duration_seconds_count":
                    patches += value
                elif name == "apiserver_request_duration_seconds_sum":
                    seconds += value
        return patches, seconds, attempts

    def watch(self, *resources: str) -> tuple[float, float]:
        """(events, bytes) sent to watchers of ``resources``."""
        events = size = 0.0
        for name, labels, value in self.samples:
            if not {labels.get("resource"), labels.get("kind", "").lower()} & set(resources):
                continue
            if name == "apiserver_watch_events_total":
                events += value
            elif name == "apiserver_watch_events_sizes_sum":
                size += value
        return events, size


_ROUND_RESOURCES = ("rendezvous", "rendezvousslices")
_LEADER_ELECTION = ("GET leases", "PUT leases")


def metrics_delta(before: Metrics, after: Metrics) -> dict[str, Any]:
    """What happened between two scrapes, restricted to what rendezvous cause."""
    b, a = before.requests(), after.requests()
    by = {k: a[k] - b.get(k, 0.0) for k in a if a[k] - b.get(k, 0.0) > 0}
    # What the nodes watch: the Rendezvous, or above 100 nodes its slices.
    events_before, bytes_before = before.watch(*_ROUND_RESOURCES)
    events_after, bytes_after = after.watch(*_ROUND_RESOURCES)
    lease_events = after.watch("leases")[0] - before.watch("leases")[0]
    ours = {
        k: v
        for k, v in by.items()
        if (
            k.split(" ", 1)[1].split("/")[0] in (*_ROUND_RESOURCES, "leases")
            or k in ("PATCH pods", "POST events")
        )
        # Leader elections (the operator's, kube-controller-manager's, kube-scheduler's)
        # read and update their Lease on their own clock; nodes only create and patch
        # theirs, so these are no round's cost.
        and k not in _LEADER_ELECTION
    }
    refused_b, refused_a = before.refused(), after.refused()
    refused = {k: v - refused_b.get(k, 0.0) for k, v in refused_a.items()}
    patches_b, seconds_b, attempts_b = before.writes()
    patches_a, seconds_a, attempts_a = after.writes()
    patches = patches_a - patches_b
    return {
        # Optimistic-concurrency retries inside the API server: each PATCH of the one
        # Rendezvous object is applied in a read-modify-write loop against etcd.
        "rendezvous_patches": patches,
        "storage_update_attempts": attempts_a - attempts_b,
        "attempts_per_patch": (attempts_a - attempts_b) / patches if patches else None,
        "patch_mean_seconds": (seconds_a - seconds_b) / patches if patches else None,
        "requests_by": dict(sorted(by.items())),
        "requests_total": sum(by.values()),
        "requests_rendezvous": sum(ours.values()),
        "requests_rendezvous_by": dict(sorted(ours.items())),
        "requests_refused_429": {k: v for k, v in sorted(refused.items()) if v > 0},
        "watch_events": events_after - events_before,
        "watch_bytes": bytes_after - bytes_before,
        "lease_watch_events": lease_events,
    }


# -- psutil sampling -----------------------------------------------------------------------


class Sampler:
    """CPU and RSS of named process groups every ``interval`` seconds, in a thread."""

    def __init__(self, groups: dict[str, list[int]], interval: float = 0.25) -> None:
        self._groups = {
            name: [psutil.Process(pid) for pid in pids] for name, pids in groups.items()
        }
        self._interval = interval
        self._stop = threading.Event()
        self._series: dict[str, list[tuple[float, float, float]]] = {n: [] for n in groups}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start_cpu: dict[str, float] = {}
        self._started = 0.0

    def _cpu_rss(self, name: str) -> tuple[float, float]:
        cpu = rss = 0.0
        for process in self._groups[name]:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                cpu += times.user + times.system + times.children_user + times.children_system
                rss += process.memory_info().rss
        return cpu, rss

    def __enter__(self) -> Sampler:
        self._started = time.monotonic()
        for name in self._groups:
            self._start_cpu[name] = self._cpu_rss(name)[0]
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        previous = {name: (self._started, self._start_cpu[name]) for name in self._groups}
        for _ in range(100_000):  # bounded: ~7 h at 0.25 s
            if self._stop.wait(self._interval):
                break
            now = time.monotonic()
            for name in self._groups:
                cpu, rss = self._cpu_rss(name)
                then, cpu_then = previous[name]
                percent = 100.0 * (cpu - cpu_then) / max(1e-6, now - then)
                self._series[name].append((now - self._started, percent, rss / 2**20))
                previous[name] = (now, cpu)

    def summary(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        elapsed = max(1e-6, time.monotonic() - self._started)
        for name in self._groups:
            cpu, _rss = self._cpu_rss(name)
            series = self._series[name]
            used = cpu - self._start_cpu[name]
            result[name] = {
                "cpu_seconds": round(used, 3),
                "mean_cpu_percent": round(100.0 * used / elapsed, 1),
                "peak_cpu_percent": round(max((s[1] for s in series), default=0.0), 1),
                "peak_rss_mb": round(max((s[2] for s in series), default=0.0), 1),
                "series": [[round(t, 2), round(p, 1), round(r, 1)] for t, p, r in series],
            }
        return result


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


def dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
