"""Fixtures for rendezvous tests against the real control plane: the CRD, the operator
as a process, pods scheduled onto kwok nodes, and in-process nodes that authenticate with
their pod's own bound token exactly as the handler does in a pod."""

from __future__ import annotations

import dataclasses
import socket
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from torch.distributed.elastic.rendezvous import RendezvousInfo

from devkit import chart, invariants, manifests, namespaces
from devkit.cluster.controlplane import (
    POD_IP_ANNOTATION,
    ControlPlane,
    build_helm,
    read_object,
)
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous import config, kube
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import leases, objects, specs, statuses


@pytest.fixture(scope="session")
def rendezvous_crd(control_plane: ControlPlane) -> None:
    manifests.install(control_plane)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> chart.Helm:
    """helm without a cluster (lint, template)."""
    return chart.Helm(build_helm(), tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def cluster_helm(helm: chart.Helm, control_plane: ControlPlane) -> chart.Helm:
    """helm as the test control plane's admin."""
    return chart.Helm(helm.binary, helm.home, control_plane.kubeconfig)


@pytest.fixture
def workers_namespace(
    namespace: str, admin_api: kubernetes.client.ApiClient, rendezvous_crd: None
) -> str:
    """A namespace whose `default` ServiceAccount may use the rendezvous (worker role)."""
    namespaces.bind_worker_role(admin_api, namespace)
    return namespace


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def operator_process(
    control_plane: ControlPlane,
    workers_namespace: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorProcess]:
    """The operator, running as its own process, watching the test's namespace.

    ``@pytest.mark.webhook`` also serves the admission webhook on 127.0.0.1 (a
    MutatingWebhookConfiguration named after the namespace, removed afterwards), with the
    marker's arguments as more ``--webhook-*`` flags;
    ``@pytest.mark.metrics`` serves Prometheus metrics on a free port.
    """
    extra: tuple[str, ...] = ()
    webhook_config = f"torchrun-env.{workers_namespace}.k8s-rendezvous.dev"
    if request.node.get_closest_marker("metrics"):
        extra += (f"--metrics-port={free_port()}",)
    if webhook_marker := request.node.get_closest_marker("webhook"):
        extra += (
            "--webhook",
            "--webhook-host=127.0.0.1",
            "--webhook-addr=127.0.0.1",
            f"--webhook-port={free_port()}",
            f"--webhook-config-name={webhook_config}",
            *webhook_marker.args,
        )
    process = OperatorProcess(
        control_plane.kubeconfig,
        tmp_path / "operator.log",
        namespaces=(workers_namespace,),
        extra_args=extra,
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
        if request.node.get_closest_marker("webhook"):
            control_plane.kubectl(
                "delete", "mutatingwebhookconfiguration", webhook_config, "--ignore-not-found"
            )
        print(f"--- operator log (tail) ---\n{process.log_tail()}")


class Rendezvous:
    """The test's view of one Rendezvous object (admin credentials); with a recorder, its
    history and its nodes' outcomes are checked against the invariants at teardown."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        namespace: str,
        name: str,
        recorder: invariants.Recorder | None = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.recorder = recorder
        self._custom = kubernetes.client.CustomObjectsApi(api)

    def body(self) -> dict[str, Any]:
        return self._custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            objects.GROUP, objects.VERSION, self.namespace, objects.PLURAL, self.name
        )

    def status(self) -> statuses.RendezvousStatus:
        return statuses.RendezvousStatus.from_dict(self.body().get("status"))

    def patch_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """An admin's edit of the spec (a merge patch)."""
        return self._custom.patch_namespaced_custom_object(  # type: ignore[no-any-return]
            objects.GROUP,
            objects.VERSION,
            self.namespace,
            objects.PLURAL,
            self.name,
            {"spec": spec},
        )

    def patch_status(self, status: dict[str, Any]) -> dict[str, Any]:
        """A hand edit of the status (an admin's, not a pod's: only the operator writes it)."""
        return self._custom.patch_namespaced_custom_object_status(  # type: ignore[no-any-return]
            objects.GROUP,
            objects.VERSION,
            self.namespace,
            objects.PLURAL,
            self.name,
            {"status": status},
            _content_type="application/merge-patch+json",
        )

    def wait(
        self,
        predicate: Callable[[statuses.RendezvousStatus], bool],
        message: str,
        timeout: float = 30,
    ) -> statuses.RendezvousStatus:
        def check() -> statuses.RendezvousStatus | None:
            current = self.status()
            return current if predicate(current) else None

        return wait_for(check, timeout, f"{self.namespace}/{self.name}: {message}", interval=0.02)

    def requests(self) -> dict[str, leases.NodeEntry]:
        """Each node's request, as its own Lease holds it."""
        coordination = kubernetes.client.CoordinationV1Api(self._custom.api_client)
        found = coordination.list_namespaced_lease(
            self.namespace, label_selector=f"{objects.NODE_LABEL}={self.name}"
        )
        return {
            lease.spec.holder_identity: leases.NodeEntry.from_annotation(raw, lease.metadata.name)
            for lease in found.items
            if (raw := (lease.metadata.annotations or {}).get(objects.ENTRY_ANNOTATION))
        }

    def wait_requests(
        self,
        predicate: Callable[[dict[str, leases.NodeEntry]], bool],
        message: str,
        timeout: float = 30,
    ) -> dict[str, leases.NodeEntry]:
        def check() -> dict[str, leases.NodeEntry] | None:
            current = self.requests()
            return current if predicate(current) else None

        return wait_for(check, timeout, f"{self.namespace}/{self.name}: {message}", interval=0.02)

    def events(self) -> list[tuple[str, str, str]]:
        core = kubernetes.client.CoreV1Api(self._custom.api_client)
        found = core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={self.name}"
        )
        return [(e.type, e.reason, e.message) for e in found.items]

    def wait_events(
        self,
        reason: str,
        about: Callable[[str], bool],
        kind: str | None = None,
        timeout: float = 15,
    ) -> list[str]:
        """The messages of the Events of ``reason`` (and ``kind``) once one is ``about`` what
        the test looks for: kopf posts Events in batches, after the status writes a test
        may have waited for."""

        def check() -> list[str] | None:
            messages = [m for k, r, m in self.events() if r == reason and kind in (None, k)]
            return messages if any(about(m) for m in messages) else None

        return wait_for(check, timeout, f"{self.namespace}/{self.name}: the {reason} Event")


@pytest.fixture
def recorded(
    admin_api: kubernetes.client.ApiClient, workers_namespace: str
) -> Iterator[Callable[[str], Rendezvous]]:
    """A Rendezvous (existing or to come) whose history is checked at teardown."""
    made: list[Rendezvous] = []

    def record(name: str) -> Rendezvous:
        recorder = invariants.Recorder(admin_api, workers_namespace, name)
        made.append(Rendezvous(admin_api, workers_namespace, name, recorder))
        return made[-1]

    yield record
    for rendezvous in made:
        assert rendezvous.recorder is not None
        rendezvous.recorder.catch_up()
        rendezvous.recorder.stop()
        if rendezvous.recorder.spec is None:
            continue  # never created (a test of bad input)
        spec = specs.RendezvousSpec.from_dict(rendezvous.recorder.spec)
        invariants.check(spec, rendezvous.recorder.statuses(), rendezvous.recorder.outcomes)


@pytest.fixture
def make_rendezvous(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    recorded: Callable[[str], Rendezvous],
) -> Callable[..., Rendezvous]:
    def make(min_nodes: int, max_nodes: int, **spec: Any) -> Rendezvous:
        name = f"rdzv-{uuid.uuid4().hex[:6]}"
        body = manifests.rendezvous(workers_namespace, name, min_nodes, max_nodes, **spec)
        rendezvous = recorded(name)
        kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            objects.GROUP, objects.VERSION, workers_namespace, objects.PLURAL, body
        )
        return rendezvous

    return make


@dataclasses.dataclass
class Node:
    """A simulated node: a real Pod object and a handler that uses that pod's token."""

    pod: str
    addr: str
    handler: KubernetesRendezvousHandler
    api: kubernetes.client.ApiClient
    rendezvous: Rendezvous | None = None

    def join_in_background(self) -> Joining:
        return Joining(self)


def operator_metrics(operator: OperatorProcess) -> dict[str, float]:
    """The operator's ``k8s_rendezvous_*`` samples, by name with labels, as served now."""
    port = next(
        int(arg.split("=")[1]) for arg in operator.extra_args if arg.startswith("--metrics-port")
    )
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("k8s_rendezvous_")
    }


def join_all(nodes: Sequence[Node], timeout: float = 60) -> list[RendezvousInfo]:
    """All ``nodes`` call ``next_rendezvous()`` at once; their answers, in order."""
    joins = [node.join_in_background() for node in nodes]
    return [joining.wait(timeout) for joining in joins]


def wait_told_to_rejoin(nodes: Sequence[Node], why: str, timeout: float = 10) -> None:
    """Until every node's ``num_nodes_waiting()`` is positive: what makes torch's agent
    restart its workers and call ``next_rendezvous()`` again."""
    wait_for(
        lambda: all(node.handler.num_nodes_waiting() > 0 for node in nodes),
        timeout,
        why,
        interval=0.02,
    )


def wait_watching_own_slice(nodes: Sequence[Node], rendezvous: str, slices: int) -> None:
    """Until each node's round watcher holds its own RendezvousSlice of ``rendezvous``
    (a node that read the Rendezvous last, e.g. a round sealed before its watch moved,
    takes its slice at the slice's next event)."""

    def watching(node: Node) -> bool:
        latest = node.handler.watcher.latest
        own = objects.slice_name(rendezvous, objects.slice_index(node.pod, slices))
        return latest is not None and latest["metadata"]["name"] == own

    wait_for(lambda: all(map(watching, nodes)), 10, "every node watches its own slice")


class Joining:
    """``next_rendezvous()`` running in a thread (nodes join concurrently)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"join-{node.pod}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        recorder = self.node.rendezvous.recorder if self.node.rendezvous else None
        try:
            self.result = self.node.handler.next_rendezvous()
        except BaseException as error:
            self.error = error
            if recorder is not None:
                recorder.outcomes.append(
                    invariants.Outcome(self.node.pod, error=type(error).__name__)
                )
            return
        if recorder is not None:
            info, joined = self.result, self.node.handler.joined
            recorder.outcomes.append(
                invariants.Outcome(
                    self.node.pod,
                    round=joined.round if joined else None,
                    rank=info.rank,
                    world_size=info.world_size,
                    master=(
                        info.bootstrap_store_info.master_addr,
                        info.bootstrap_store_info.master_port,
                    ),
                )
            )

    def still_blocked_after(self, seconds: float) -> bool:
        """Whether ``next_rendezvous()`` has neither returned nor raised ``seconds`` from
        now (it returns at once if it ends sooner)."""
        self._thread.join(seconds)
        return self._thread.is_alive()

    def wait(self, timeout: float = 60) -> RendezvousInfo:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"{self.node.pod}: next_rendezvous() still blocked"
        if self.error is not None:
            raise self.error
        return self.result


def create_pods(
    api: kubernetes.client.ApiClient,
    namespace: str,
    names: Sequence[str],
    service_account: str = "default",
    placement: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    addresses: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Bare pods with :data:`~devkit.manifests.WORKLOAD_LABELS` (or ``labels``), scheduled
    by kube-scheduler onto kwok nodes (or placed by ``placement``, pod name to kwok node
    name), each with the IP ``addresses`` gives it or one kwok picks; returns them Running."""
    core = kubernetes.client.CoreV1Api(api)

    def create(name: str) -> None:
        pinned = {"nodeName": placement[name]} if placement else {}
        chosen = {POD_IP_ANNOTATION: addresses[name]} if addresses else {}
        core.create_namespaced_pod(
            namespace,
            manifests.bare_pod(
                name,
                labels=labels,
                annotations=chosen,
                serviceAccountName=service_account,
                **pinned,
            ),
        )

    for name in names:
        create(name)
    remade = dict.fromkeys(names, 0)

    def running() -> list[dict[str, Any]] | None:
        pods = []
        for name in names:
            try:
                pods.append(
                    api.sanitize_for_serialization(core.read_namespaced_pod(name, namespace))
                )
            except ApiException as error:
                # kwok, as the kubelet, deletes a deleted pod by name without its uid, and
                # may do so twice: a pod made anew at once under a deleted pod's name can
                # be deleted in its place. Made again, as its controller would.
                if error.status != 404 or remade[name] == 3:
                    raise
                remade[name] += 1
                create(name)
                return None
        ok = all(p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in pods)
        return pods if ok else None

    return wait_for(running, 60, f"pods {names} Running with IPs")


@pytest.fixture
def attach_nodes(
    control_plane: ControlPlane, workers_namespace: str
) -> Iterator[Callable[..., list[Node]]]:
    """A handler per existing pod, each authenticated with its own pod-bound token."""
    created: list[Node] = []

    def attach(
        rendezvous: Rendezvous,
        pods: list[dict[str, Any]],
        *,
        min_nodes: int = 1,
        max_nodes: int = 1,
        read_timeout: int = 20,
        service_account: str = "default",
        configured_spec: dict[str, int] | None = None,
        **handler_options: Any,
    ) -> list[Node]:
        nodes = []
        for pod in pods:
            name = pod["metadata"]["name"]
            token = control_plane.token_for(
                workers_namespace, service_account, pod_name=name, pod_uid=pod["metadata"]["uid"]
            )
            api = control_plane.client_for_token(token)
            client = kube.RendezvousClient(
                api, rendezvous.namespace, rendezvous.name, retry_seconds=read_timeout
            )
            addr = pod["status"]["podIP"]  # a loopback address (POD_CIDR): reachable
            handler = KubernetesRendezvousHandler(
                client,
                run_id=rendezvous.name,
                node=name,
                addr=addr,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                settings=config.Settings(
                    rendezvous.namespace,
                    rendezvous.name,
                    read_timeout=read_timeout,
                    configured_spec=configured_spec or {},
                    **handler_options,
                ),
            )
            node = Node(name, addr, handler, api, rendezvous)
            created.append(node)
            nodes.append(node)
        return nodes

    yield attach
    for node in created:
        node.handler.shutdown()
        node.api.close()


@pytest.fixture
def make_nodes(
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    attach_nodes: Callable[..., list[Node]],
) -> Callable[..., list[Node]]:
    """Create ``count`` bare pods and a handler per pod."""
    counter = iter(range(10_000))

    def make(rendezvous: Rendezvous, count: int, **options: Any) -> list[Node]:
        names = [f"node-{next(counter)}" for _ in range(count)]
        return attach_nodes(rendezvous, create_pods(admin_api, workers_namespace, names), **options)

    return make


def statefulset_pods(
    admin_api: kubernetes.client.ApiClient, namespace: str, name: str, replicas: int
) -> tuple[str, list[dict[str, Any]]]:
    """StatefulSet ``name``'s uid and its ``replicas`` pods, once each has an IP."""
    created = kubernetes.client.AppsV1Api(admin_api).create_namespaced_stateful_set(
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "t", "image": "example.invalid/t"}]},
                },
            },
        },
    )
    core = kubernetes.client.CoreV1Api(admin_api)

    def running() -> list[dict[str, Any]] | None:
        listed = read_object(core.list_namespaced_pod, namespace, label_selector=f"app={name}")
        pods = [pod for pod in listed["items"] if pod["status"].get("podIP")]
        return pods if len(pods) == replicas else None

    return created.metadata.uid, wait_for(running, 60, f"{replicas} StatefulSet pods running")


def delete_pod(api: kubernetes.client.ApiClient, namespace: str, name: str) -> None:
    kubernetes.client.CoreV1Api(api).delete_namespaced_pod(name, namespace, grace_period_seconds=0)
