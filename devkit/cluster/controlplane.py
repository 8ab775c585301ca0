"""A real Kubernetes control plane as plain local processes, for integration tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (simulated nodes
that run no containers) listen on 127.0.0.1 at random ports; every file they need (PKI,
kubeconfigs, etcd data, logs, saved state) lives in one work directory. Processes are
started in their own sessions and stopped by recorded PID only.

The same class serves the pytest fixtures (``start()``/``stop()``, stop registered with
atexit) and the developer command ``python -m devkit.cluster up|down`` (``detach=True`` and
``ControlPlane.attach(directory)``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client
import pydantic
from kubernetes.client.exceptions import ApiException

from devkit.cluster.pki import ClusterPKI, create_pki
from devkit.waiting import wait_for

CLUSTER_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = CLUSTER_DIR / "build.sh"

HOST = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"  # Service ClusterIPs
# kwok's pod IPs: loopback, so that whatever a test runs "in" a pod (a handler, a torchrun
# agent) listens at its pod's real IP, as the operator checks it does. Must not overlap
# SERVICE_CIDR. Test sessions side by side (hack/test_lanes.py) each take their own.
POD_CIDR = os.environ.get("K8S_RDZV_POD_CIDR", "127.244.0.0/16")
POD_IP_ANNOTATION = "kwok.k8s-rendezvous.dev/pod-ip"
"""A test that must choose a pod's IP (one of POD_CIDR's or any loopback address) sets
it here when it creates the pod; kwok then reports it as the pod's IP."""
FALLBACK_ADVERTISE_ADDRESS = "192.0.2.10"  # TEST-NET-1, used when the host has no global IPv4
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
NODE_ZONES: dict[str, str] = {
    "kwok-node-0": "zone-a",
    "kwok-node-1": "zone-b",
    "kwok-node-2": "zone-c",
}
NODE_RESOURCES: dict[str, str] = {"cpu": "256", "memory": "1Ti", "pods": "6000"}
"""Enough pods on the three kwok nodes for the benchmark's largest world (16,384)."""
# kwok's own stage definitions, relative to <binaries>/kwok-stages. pod-complete is left
# out on purpose: it would mark Job pods Succeeded at once, and tests decide when they end.
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-delete.yaml",
)
# Start order; stop runs in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
CLIENT_CERTS: dict[str, tuple[str, list[str]]] = {
    # file stem -> (user, groups); the default RBAC policy binds the system:kube-* users.
    "admin": ("admin", ["system:masters"]),
    "kube-controller-manager": ("system:kube-controller-manager", []),
    "kube-scheduler": ("system:kube-scheduler", []),
    "kwok": ("kwok-controller", ["system:masters"]),
    # The API server's identity towards kubelets (logs, exec, port-forward of real pods).
    "kube-apiserver-kubelet-client": ("kube-apiserver-kubelet-client", ["system:masters"]),
}
STATE_FILE = "state.json"
STOP_GRACE_SECONDS = 10.0
START_TIMEOUT_SECONDS = float(os.environ.get("K8S_RDZV_START_TIMEOUT", "180"))
PORT_ATTEMPTS = 5


M = TypeVar("M", bound=pydantic.BaseModel)


def to_model(cls: type[M], manifest: Mapping[str, Any]) -> M:
    """A typed-client body from a plain manifest (camelCase keys as in YAML; unknown keys
    are rejected rather than silently dropped)."""
    return cls.model_validate(dict(manifest))


class ControlPlaneError(RuntimeError):
    """A component failed to start or to become ready."""


class _PortClash(Exception):
    """A component exited because one of its ports was taken meanwhile."""


def read_versions() -> dict[str, str]:
    """The pinned versions from versions.env, or from the file K8S_RDZV_VERSIONS names (as
    devkit/cluster/build.sh reads them: the compatibility run, hack/compat.sh, tests other
    Kubernetes releases so)."""
    versions: dict[str, str] = {}
    path = os.environ.get("K8S_RDZV_VERSIONS") or CLUSTER_DIR / "versions.env"
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def build_binaries(*, stream_log: bool = False) -> Path:
    """Run devkit/cluster/build.sh (idempotent; a no-op when everything is cached) and return
    the directory it prints. With ``stream_log`` its progress goes to our stderr; otherwise
    the log is kept and its tail shown on failure."""
    return run_build_script(BUILD_SCRIPT, stream_log=stream_log)


def build_helm(version: str | None = None) -> Path:
    """The helm binary of ``version`` (default: HELM_VERSION of versions.env), built by
    devkit/cluster/build.sh the first time (the control plane's build makes HELM_VERSION's
    and HELM3_VERSION's)."""
    return run_build_script(BUILD_SCRIPT, "helm", *([version] if version else [])) / "helm"


def run_build_script(script: Path, *args: str, stream_log: bool = False) -> Path:
    """Run one of devkit/cluster's build scripts, which prints the directory of what it
    built (or found cached) last; that directory."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(
            ["bash", str(script), *args],
            stdout=subprocess.PIPE,
            stderr=None if stream_log else log,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            log.seek(0)
            tail = "".join(log.readlines()[-40:])
            raise ControlPlaneError(
                f"{script} {' '.join(args)} failed with exit code {proc.returncode}:\n{tail}"
            )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if not lines or not Path(lines[-1]).is_dir():
        raise ControlPlaneError(f"{script} printed no directory: {proc.stdout!r}")
    return Path(lines[-1])


def _with_chosen_pod_ip(stage: str) -> str:
    """kwok's pod-ready stage, giving the pod the IP of its POD_IP_ANNOTATION if it has
    one (as a CNI plugin would hand out a requested address), else one of POD_CIDR's."""
    lines = stage.splitlines()
    found = [i for i, line in enumerate(lines) if line.strip().startswith("{{ $podIPs := ")]
    if len(found) != 1:
        raise ControlPlaneError("kwok's pod-ready stage no longer assigns $podIPs once")
    (index,) = found
    line = lines[index]
    indent = line[: len(line) - len(line.lstrip())]
    chosen = (
        f'{{{{ with $.metadata.annotations }}}}{{{{ with index . "{POD_IP_ANNOTATION}" }}}}'
        "{{ $podIPs = list . }}{{ end }}{{ end }}"
    )
    lines.insert(index + 1, indent + chosen)
    return "\n".join(lines) + "\n"


def _advertise_address() -> str:
    """A non-loopback IPv4 address the host owns (kube-apiserver rejects loopback and, when
    unset, needs a default route); a documentation address otherwise. It is only published
    in the `kubernetes` Service endpoints, which nothing here uses (reconciler is off)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
        for line in out.splitlines():
            fields = line.split()
            if "inet" in fields:
                return fields[fields.index("inet") + 1].split("/")[0]
    return FALLBACK_ADVERTISE_ADDRESS


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's counts): a zombie still "exists", but
    runs nothing (its parent reaps it)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except PermissionError:
        return True
    except OSError:  # no such process, or reaped since
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _pid_runs(pid: int, executable: Path) -> bool:
    """Whether ``pid`` is alive and still runs ``executable`` (guards against PID reuse)."""
    if not pid_alive(pid):
        return False
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except OSError:
        return False
    return argv0 == str(executable)


def set_pod_phase(
    api: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    phase: str,
    *,
    exit_code: int | None = None,
    reason: str | None = None,
    message: str = "",
    disruption: str | None = None,
) -> None:
    """Mark a pod ``Succeeded`` or ``Failed`` the way a kubelet reports it: every container
    terminated (exit code 0 for Succeeded, ``exit_code`` or 1 for Failed), Ready and
    ContainersReady False, the phase set, all through the status subresource with
    optimistic concurrency (retried on 409 if kwok writes in between). ``disruption``: the
    reason of a DisruptionTarget condition set with it, as a kubelet that evicts a pod for
    node pressure says why (``TerminationByKubelet``)."""
    if phase not in ("Succeeded", "Failed"):
        raise ValueError(f"phase must be Succeeded or Failed, not {phase!r}")
    code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
    why = reason or ("Completed" if code == 0 else "Error")
    core = kubernetes.client.CoreV1Api(api)
    for _attempt in range(20):
        pod = read_object(core.read_namespaced_pod_status, name, namespace)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        previous = {cs["name"]: cs for cs in dig(pod, "status", "containerStatuses", default=[])}
        statuses = []
        for container in pod["spec"]["containers"]:
            old = previous.get(container["name"], {})
            started = dig(old, "state", "running", "startedAt", default=now)
            statuses.append(
                {
                    "name": container["name"],
                    "image": old.get("image", container.get("image", "")),
                    "imageID": old.get("imageID", ""),
                    "ready": False,
                    "restartCount": old.get("restartCount", 0),
                    "started": False,
                    "state": {
                        "terminated": {
                            "exitCode": code,
                            "reason": why,
                            "message": message,
                            "startedAt": started,
                            "finishedAt": now,
                        }
                    },
                }
            )
        conditions = []
        for condition in dig(pod, "status", "conditions", default=[]):
            if condition["type"] in ("Ready", "ContainersReady"):
                condition = {
                    **condition,
                    "status": "False",
                    "reason": "PodCompleted",
                    "lastTransitionTime": now,
                }
            conditions.append(condition)
        if disruption is not None:
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": disruption,
                    "message": message,
                    "lastTransitionTime": now,
                }
            )
        body = {
            "metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]},
            "status": {"phase": phase, "containerStatuses": statuses, "conditions": conditions},
        }
        try:
            core.patch_namespaced_pod_status(
                name, namespace, body, _content_type="application/merge-patch+json"
            )
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise ControlPlaneError(f"pod {namespace}/{name}: kept conflicting while setting {phase}")


def dig(obj: Any, *keys: str, default: Any = None) -> Any:
    """``obj[k1][k2]...`` on decoded JSON, returning ``default`` where a key is missing or
    null (the apiserver may send ``"conditions": null`` right after a create)."""
    for key in keys:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return default
        obj = obj[key]
    return obj


def read_object(method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call a method of the typed client (a read or a list, or a create whose answer is
    wanted) and return the JSON as a plain dict (camelCase keys, nothing dropped by model
    validation)."""
    response = method(*args, _preload_content=False, **kwargs)
    try:
        data = response.data
    finally:
        with contextlib.suppress(Exception):
            response.release_conn()
    result: dict[str, Any] = json.loads(data)
    return result


def read_object_or_none(
    method: Callable[..., Any], *args: Any, **kwargs: Any
) -> dict[str, Any] | None:
    """:func:`read_object`, or None where the object does not exist (404)."""
    try:
        return read_object(method, *args, **kwargs)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on 127.0.0.1."""

    host: str = HOST

    def __init__(
        self,
        binaries: Path | None = None,
        workdir: Path | None = None,
        *,
        detach: bool = False,
        keep_workdir: bool | None = None,
    ) -> None:
        self._binaries = binaries
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="k8s-rdzv-"))
        self.detach = detach
        if keep_workdir is None:
            keep_workdir = not self._own_workdir or bool(os.environ.get("K8S_RDZV_KEEP_WORKDIR"))
        self.keep_workdir = keep_workdir
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.advertise_address = ""
        self.startup_seconds: float | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_offsets: dict[str, int] = {}
        self._taken_ports: set[int] = set()
        self._lock = threading.RLock()
        self._atexit_registered = False

    # -- public attributes ---------------------------------------------------------------

    @property
    def binaries(self) -> Path:
        if self._binaries is None:
            self._binaries = build_binaries()
        return self._binaries

    @property
    def port(self) -> int:
        return self.ports["apiserver"]

    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def pki_dir(self) -> Path:
        return self.workdir / "pki"

    @property
    def pki(self) -> ClusterPKI:
        return ClusterPKI.load(self.pki_dir, list(CLIENT_CERTS))

    @property
    def ca_file(self) -> Path:
        return self.pki.ca.cert

    @property
    def kubeconfig(self) -> Path:
        return self._kubeconfig_path("admin")

    def log_path(self, component: str) -> Path:
        return self.workdir / "logs" / f"{component}.log"

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    def attach(cls, workdir: Path) -> ControlPlane:
        """A handle on a control plane started elsewhere (``up``) from its saved state.
        ``stop()`` on it stops those processes (and keeps the directory)."""
        workdir = Path(workdir)
        state = json.loads((workdir / STATE_FILE).read_text())
        plane = cls(Path(state["binaries"]), workdir, detach=True, keep_workdir=True)
        plane.ports = {k: int(v) for k, v in state["ports"].items()}
        plane.pids = {k: int(v) for k, v in state["pids"].items()}
        plane.advertise_address = state["advertise_address"]
        return plane

    def running_components(self) -> list[str]:
        return [name for name in COMPONENTS if self._running(name)]

    def start(self) -> None:
        """Start every component and return once the cluster is usable: etcd healthy,
        apiserver ready, namespace and ServiceAccount `default` present (the latter proves
        the controller manager works), controller manager and scheduler healthy, all kwok
        nodes Ready."""
        started = time.monotonic()
        if not self.detach and not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        try:
            self._prepare()
            self._start_with_port_retry("etcd", ("etcd", "etcd-peer"), self._wait_etcd)
            self._start_with_port_retry("kube-apiserver", ("apiserver",), self._wait_apiserver)
            for stem in CLIENT_CERTS:
                self._write_client_kubeconfig(stem)
            self._ensure_nodes()
            self._launch("kube-controller-manager")
            self._launch("kube-scheduler")
            self._launch("kwok")
            self._await_with_port_retry(
                "kube-controller-manager",
                ("kube-controller-manager",),
                lambda: self._wait_https_healthz("kube-controller-manager"),
            )
            self._await_with_port_retry(
                "kube-scheduler",
                ("kube-scheduler",),
                lambda: self._wait_https_healthz("kube-scheduler"),
            )
            self._wait_cluster_usable()
        except BaseException as error:
            # The message carries the failing component's log tail: its work directory (an
            # etcd's data, 100 MB and more) goes too, unless it was asked to stay.
            if not self.keep_workdir and self.workdir.exists():
                error.add_note(
                    f"(its work directory {self.workdir} is removed; "
                    "K8S_RDZV_KEEP_WORKDIR=1 keeps it)"
                )
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Stop every component by PID, in three groups (kwok, scheduler and controller
        manager; apiserver; etcd): SIGTERM, then SIGKILL whatever is still alive after a
        grace period. Idempotent. Removes the work directory if this object
        created it (unless keep_workdir)."""
        with self._lock:
            # Clients first, then the apiserver, then etcd: an apiserver whose etcd is
            # already gone lingers in shutdown until it is killed.
            for group in (COMPONENTS[2:], ("kube-apiserver",), ("etcd",)):
                self._terminate([name for name in group if name in self.pids])
            if self._atexit_registered:
                atexit.unregister(self.stop)
                self._atexit_registered = False
            if not self.keep_workdir and self.workdir.exists():
                shutil.rmtree(self.workdir, ignore_errors=True)

    def stop_apiserver(self) -> None:
        self._terminate(["kube-apiserver"])

    def start_apiserver(self) -> None:
        """Start kube-apiserver again with the same port, flags and PKI."""
        self._launch("kube-apiserver")
        self._await("kube-apiserver", self._probe_apiserver, "ready (/readyz)")

    def restart_exited(self) -> list[str]:
        """Start again each client component (controller manager, scheduler, kwok) that has
        exited, as a node's kubelet restarts a crashed static pod; returns those restarted.
        The scheduler exits by design when it finds its cache corrupted, which API server
        restarts a minute apart can bring about."""
        with self._lock:
            exited = [
                name for name in COMPONENTS[2:] if name in self.pids and not self._running(name)
            ]
            for name in exited:
                self._launch(name)
        return exited

    def restart_etcd(self) -> None:
        """Stop etcd and start it again on the same ports and data directory."""
        self._terminate(["etcd"])
        self._launch("etcd")
        self._await("etcd", self._probe_etcd, "healthy (/health)")

    # -- clients -------------------------------------------------------------------------

    def _configuration(self) -> kubernetes.client.Configuration:
        configuration = kubernetes.client.Configuration(host=self.server)
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.verify_ssl = True
        return configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        """A client authenticated as `admin` (group system:masters: bypasses RBAC)."""
        configuration = self._configuration()
        admin = self.pki.clients["admin"]
        configuration.cert_file = str(admin.cert)
        configuration.key_file = str(admin.key)
        configuration.connection_pool_maxsize = 32
        return kubernetes.client.ApiClient(configuration)

    def client_for_token(self, token: str) -> kubernetes.client.ApiClient:
        configuration = self._configuration()
        configuration.api_key = {"BearerToken": token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        return kubernetes.client.ApiClient(configuration)

    def token_for(
        self,
        namespace: str,
        service_account: str,
        *,
        pod_name: str | None = None,
        pod_uid: str | None = None,
        expiration_seconds: int = 3600,
    ) -> str:
        """A real token from the TokenRequest API; bound to the pod when pod_name is given
        (the pod must exist and run as ``service_account``; the token dies with it)."""
        bound = None
        if pod_name is not None:
            bound = kubernetes.client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod_name, uid=pod_uid
            )
        request = kubernetes.client.AuthenticationV1TokenRequest(
            api_version="authentication.k8s.io/v1",
            kind="TokenRequest",
            spec=kubernetes.client.V1TokenRequestSpec(
                audiences=[], expiration_seconds=expiration_seconds, bound_object_ref=bound
            ),
        )
        with self.api_client() as api:
            response = kubernetes.client.CoreV1Api(api).create_namespaced_service_account_token(
                service_account, namespace, request
            )
        if response.status is None or not response.status.token:
            raise ControlPlaneError(f"TokenRequest for {namespace}/{service_account}: no token")
        return response.status.token

    def write_kubeconfig_for_token(self, token: str, path: Path) -> Path:
        """A kubeconfig for this cluster that authenticates with ``token``."""
        return self.write_kubeconfig_for_user(Path(path), {"token": token})

    def write_kubeconfig_for_user(self, path: Path, user: Mapping[str, str]) -> Path:
        """A kubeconfig for this cluster with ``user`` as its credentials (a kubeconfig
        ``user`` entry: a token, or a client certificate and key)."""
        return self._write_kubeconfig(Path(path), user)

    def pod_environment(
        self,
        *,
        namespace: str,
        pod_name: str,
        pod_uid: str,
        pod_ip: str,
        directory: Path,
        service_account: str = "default",
    ) -> dict[str, str]:
        """What a container of the pod would see: writes `token` (a real pod-bound token),
        `ca.crt` and `namespace` into ``directory`` (the files of
        /var/run/secrets/kubernetes.io/serviceaccount) and returns the environment that
        points the in-cluster loader at them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        token = self.token_for(namespace, service_account, pod_name=pod_name, pod_uid=pod_uid)
        (directory / "token").write_text(token)
        shutil.copyfile(self.ca_file, directory / "ca.crt")
        (directory / "namespace").write_text(namespace)
        return {
            "KUBERNETES_SERVICE_HOST": self.host,
            "KUBERNETES_SERVICE_PORT": str(self.port),
            "K8S_RENDEZVOUS_SERVICE_ACCOUNT_DIR": str(directory),
            "POD_NAME": pod_name,
            "POD_NAMESPACE": namespace,
            "POD_IP": pod_ip,
        }

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl as admin (explicit kubeconfig and cache dir)."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        proc = subprocess.run(
            [
                str(self.binaries / "kubectl"),
                f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.workdir / 'kubectl-cache'}",
                *args,
            ],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(
                proc.returncode, proc.args, proc.stdout, proc.stderr
            )
        return proc

    # -- preparation -----------------------------------------------------------------------

    def _prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        missing = [
            name
            for name in (
                "etcd",
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubectl",
                "kwok",
            )
            if not os.access(self.binaries / name, os.X_OK)
        ]
        if missing:
            raise ControlPlaneError(f"missing binaries in {self.binaries}: {missing}")
        if not self.advertise_address:
            self.advertise_address = _advertise_address()
        if not (self.pki_dir / "sa.pub").exists():
            create_pki(
                self.pki_dir,
                serving_ips=[HOST, "10.0.0.1"],
                serving_dns=[
                    "localhost",
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                ],
                clients=CLIENT_CERTS,
            )
        for name in ("etcd", "etcd-peer", "apiserver", "kube-controller-manager", "kube-scheduler"):
            if name not in self.ports:
                self.ports[name] = self._free_port()
        self._write_kwok_config()
        self._save_state()

    def _free_port(self) -> int:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port = int(sock.getsockname()[1])
            if port not in self._taken_ports:
                self._taken_ports.add(port)
                return port
        raise ControlPlaneError("could not find a free port")

    def _write_kwok_config(self) -> None:
        stages_dir = self.binaries / "kwok-stages"
        documents: list[str] = []
        for stage in KWOK_STAGES:
            path = stages_dir / stage
            if not path.is_file():
                raise ControlPlaneError(f"kwok stage {path} is missing (rerun build.sh)")
            text = path.read_text()
            documents.append(_with_chosen_pod_ip(text) if path.name == "pod-ready.yaml" else text)
        (self.workdir / "kwok.yaml").write_text("\n---\n".join(documents) + "\n")

    def _kubeconfig_path(self, stem: str) -> Path:
        return self.workdir / f"{stem}.kubeconfig"

    def _write_client_kubeconfig(self, stem: str) -> Path:
        pair = self.pki.clients[stem]
        user = {"client-certificate": str(pair.cert), "client-key": str(pair.key)}
        return self._write_kubeconfig(self._kubeconfig_path(stem), user)

    def _write_kubeconfig(self, path: Path, user: Mapping[str, str]) -> Path:
        # JSON is YAML: every kubeconfig reader accepts it.
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "k8s-rendezvous-test",
                    "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": "user", "user": dict(user)}],
            "contexts": [
                {
                    "name": "k8s-rendezvous-test",
                    "context": {
                        "cluster": "k8s-rendezvous-test",
                        "user": "user",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": "k8s-rendezvous-test",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)
        return path

    def _save_state(self) -> None:
        state = {
            "binaries": str(self._binaries or ""),
            "ports": self.ports,
            "pids": self.pids,
            "advertise_address": self.advertise_address,
            "server": self.server if "apiserver" in self.ports else None,
            "kubeconfig": str(self.kubeconfig),
        }
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.workdir / STATE_FILE)

    # -- component command lines -------------------------------------------------------------

    def _args(self, name: str) -> list[str]:
        b, p, pki = self.binaries, self.ports, self.pki
        if name == "etcd":
            client = f"http://{HOST}:{p['etcd']}"
            peer = f"http://{HOST}:{p['etcd-peer']}"
            return [
                str(b / "etcd"),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ]
        if name == "kube-apiserver":
            return [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://{HOST}:{p['etcd']}",
                f"--bind-address={HOST}",
                f"--secure-port={p['apiserver']}",
                f"--advertise-address={self.advertise_address}",
                "--endpoint-reconciler-type=none",
                f"--cert-dir={self.pki_dir}",
                f"--tls-cert-file={pki.apiserver.cert}",
                f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca.cert}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Kubelets of real nodes (nodes.py) authenticate as system:node:<name>;
                # the Node authorizer and NodeRestriction keep each to its own node's pods.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={pki.clients['kube-apiserver-kubelet-client'].cert}",
                f"--kubelet-client-key={pki.clients['kube-apiserver-kubelet-client'].key}",
                f"--kubelet-certificate-authority={pki.ca.cert}",
                # A real node's name resolves nowhere (no DNS here); its InternalIP is its
                # bridge's gateway address.
                "--kubelet-preferred-address-types=InternalIP",
                # No kube-proxy: reach webhook Services at their endpoints' pod IPs rather
                # than at ClusterIPs nothing routes.
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                "--profiling=false",
            ]
        kubeconfig = self._kubeconfig_path(name)
        delegated = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={p.get(name, 0)}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        if name == "kube-controller-manager":
            return [
                str(b / name),
                *delegated,
                f"--cert-dir={self.workdir / 'kube-controller-manager-certs'}",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--root-ca-file={pki.ca.cert}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--cluster-signing-cert-file={pki.ca.cert}",
                f"--cluster-signing-key-file={pki.ca.key}",
            ]
        if name == "kube-scheduler":
            return [str(b / name), *delegated]
        if name == "kwok":
            return [
                str(b / "kwok"),
                f"--kubeconfig={self._kubeconfig_path('kwok')}",
                f"--config={self.workdir / 'kwok.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}",
                "--node-ip=10.244.0.1",
                "--node-lease-duration-seconds=40",
            ]
        raise ValueError(f"unknown component {name!r}")

    def _env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = str(self._kubeconfig_path("kwok" if name == "kwok" else "admin"))
        env["KWOK_WORKDIR"] = str(self.workdir / "kwok-workdir")
        return env

    # -- processes -------------------------------------------------------------------------

    def _launch(self, name: str) -> None:
        with self._lock:
            if self._running(name):
                raise ControlPlaneError(f"{name} is already running (pid {self.pids[name]})")
            args = self._args(name)
            log_path = self.log_path(name)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("ab") as log:
                stamp = datetime.datetime.now().isoformat(timespec="seconds")
                log.write(f"\n==== {stamp} starting: {' '.join(args)}\n".encode())
                log.flush()
                self._log_offsets[name] = log.tell()
                proc = subprocess.Popen(
                    self._parent_death_wrapper() + args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,
                    env=self._env(name),
                    start_new_session=True,
                )
            self._procs[name] = proc
            self.pids[name] = proc.pid
            self._save_state()

    def _parent_death_wrapper(self) -> list[str]:
        """Unless detached, have the kernel SIGTERM each component when the thread that
        started it dies, so a SIGKILLed test run leaves no cluster behind (atexit cannot
        cover that). setpriv execs the component, so the recorded PID is the component's."""
        if self.detach:
            return []
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "TERM"] if setpriv else []

    def _running(self, name: str) -> bool:
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None
        pid = self.pids.get(name)
        return pid is not None and _pid_runs(pid, self.binaries / name)

    def _terminate(self, names: list[str]) -> None:
        """SIGTERM ``names`` together, wait, SIGKILL stragglers; forget their PIDs."""
        with self._lock:
            targets: dict[str, int] = {}
            for name in names:
                pid = self.pids.get(name)
                if pid is None:
                    continue
                if self._running(name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                    targets[name] = pid
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while targets and time.monotonic() < deadline:
                targets = {n: pid for n, pid in targets.items() if self._running(n)}
                if targets:
                    time.sleep(0.05)
            for name, pid in targets.items():
                if self._running(name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            for name in names:
                proc = self._procs.pop(name, None)
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=STOP_GRACE_SECONDS)
                else:
                    pid = self.pids.get(name)
                    if pid is not None:
                        with contextlib.suppress(WaitTimeoutError):
                            _wait_gone(pid, self.binaries / name)
                self.pids.pop(name, None)
            if self.workdir.exists():
                self._save_state()

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines the current run of ``name`` wrote."""
        try:
            with self.log_path(name).open("rb") as log:
                log.seek(self._log_offsets.get(name, 0))
                text = log.read().decode(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def _await(
        self,
        name: str,
        probe: Callable[[], bool],
        what: str,
        timeout: float = START_TIMEOUT_SECONDS,
    ) -> None:
        """Poll ``probe`` until true; fail fast (with the log tail) if ``name`` exits."""
        start = time.monotonic()
        delay = 0.05
        last: object = None
        while True:
            if not self._running(name):
                proc = self._procs.get(name)
                code = proc.poll() if proc is not None else None
                tail = self.log_tail(name)
                if "address already in use" in tail:
                    raise _PortClash(name)
                raise ControlPlaneError(
                    f"{name} exited (code {code}) before it was {what}; "
                    f"log {self.log_path(name)} ends with:\n{tail}"
                )
            try:
                if probe():
                    return
            except Exception as exc:
                last = exc
            if time.monotonic() - start > timeout:
                raise ControlPlaneError(
                    f"{name} was not {what} within {timeout:.0f}s (last probe: {last!r}); "
                    f"log {self.log_path(name)} ends with:\n{self.log_tail(name)}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _start_with_port_retry(
        self, name: str, port_keys: tuple[str, ...], wait: Callable[[], None]
    ) -> None:
        self._launch(name)
        self._await_with_port_retry(name, port_keys, wait)

    def _await_with_port_retry(
        self, name: str, port_keys: tuple[str, ...], wait: Callable[[], None]
    ) -> None:
        for attempt in range(PORT_ATTEMPTS):
            try:
                wait()
                return
            except _PortClash:
                if attempt == PORT_ATTEMPTS - 1:
                    raise ControlPlaneError(
                        f"{name}: ports kept clashing; last log:\n{self.log_tail(name)}"
                    ) from None
                self._terminate([name])
                for key in port_keys:
                    self.ports[key] = self._free_port()
                self._launch(name)

    # -- readiness -------------------------------------------------------------------------

    def _probe_etcd(self) -> bool:
        url = f"http://{HOST}:{self.ports['etcd']}/health"
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(json.loads(response.read()).get("health") == "true")

    def _wait_etcd(self) -> None:
        self._await("etcd", self._probe_etcd, "healthy (/health)")

    def _admin_ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        admin = self.pki.clients["admin"]
        context.load_cert_chain(str(admin.cert), str(admin.key))
        return context

    def _probe_apiserver(self) -> bool:
        request = urllib.request.Request(f"{self.server}/readyz")
        try:
            with urllib.request.urlopen(
                request, timeout=5, context=self._admin_ssl_context()
            ) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError:
            return False  # 500 while post-start hooks are still running

    def _wait_apiserver(self) -> None:
        self._await("kube-apiserver", self._probe_apiserver, "ready (/readyz)")

    def _wait_https_healthz(self, name: str) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # self-signed serving certificate

        def probe() -> bool:
            url = f"https://{HOST}:{self.ports[name]}/healthz"
            with urllib.request.urlopen(url, timeout=5, context=context) as response:
                return bool(response.status == 200)

        self._await(name, probe, "healthy (/healthz)")

    def _ensure_nodes(self) -> None:
        with self.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)
            for name, zone in NODE_ZONES.items():
                body = {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "annotations": {
                            KWOK_NODE_ANNOTATION: "fake",
                            "node.alpha.kubernetes.io/ttl": "0",
                        },
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "topology.kubernetes.io/zone": zone,
                        },
                    },
                    "spec": {},
                    "status": {"allocatable": NODE_RESOURCES, "capacity": NODE_RESOURCES},
                }
                try:
                    core.create_node(to_model(kubernetes.client.V1Node, body))
                except ApiException as exc:
                    if exc.status != 409:
                        raise

    def _wait_cluster_usable(self) -> None:
        with self.api_client() as api:
            core = kubernetes.client.CoreV1Api(api)

            def default_service_account() -> bool:
                found = read_object_or_none(
                    core.read_namespaced_service_account, "default", "default"
                )
                return found is not None

            def nodes_ready() -> bool:
                nodes = read_object(core.list_node)["items"]
                ready = {
                    node["metadata"]["name"]
                    for node in nodes
                    if any(
                        c["type"] == "Ready" and c["status"] == "True"
                        for c in dig(node, "status", "conditions", default=[])
                    )
                }
                return set(NODE_ZONES) <= ready

            self._await(
                "kube-controller-manager",
                default_service_account,
                "creating ServiceAccount default/default",
            )
            self._await("kwok", nodes_ready, f"marking nodes {sorted(NODE_ZONES)} Ready")
            for name in COMPONENTS:
                if not self._running(name):
                    raise ControlPlaneError(f"{name} died during start-up:\n{self.log_tail(name)}")


class WaitTimeoutError(Exception):
    pass


def _wait_gone(pid: int, executable: Path, timeout: float = STOP_GRACE_SECONDS) -> None:
    try:
        wait_for(
            lambda: not _pid_runs(pid, executable),
            timeout,
            f"pid {pid} to exit",
            interval=0.05,
            max_interval=0.2,
        )
    except AssertionError as exc:
        raise WaitTimeoutError(str(exc)) from exc
