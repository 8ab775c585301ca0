"""Kueue, JobSet, Kubeflow Trainer v2 and LeaderWorkerSet as local processes against the
test control plane.

Each controller is the binary devkit/cluster/build-controllers.sh built from its Go module,
installed the way its release manifests install it: its CRDs, its ClusterRole (bound to a
client certificate of its own, signed by the cluster's CA, so it runs with exactly the RBAC
its manifests give it), its webhook configurations, its configuration file and its feature
gates. Where this differs from a Deployment, it says why:

- There is no kube-proxy and no cluster DNS: each webhook's ``clientConfig`` is a URL on
  127.0.0.1 (the manifests name a Service) with the caBundle of a CA made for the test. The
  controllers' own certificate management (a Secret, then the caBundle injected for the
  Service's DNS name) is off; their serving certificate is given to them as a Deployment
  mounts a Secret.
- Their webhooks intercept only namespaces labelled :data:`CONTROLLERS_LABEL`: the other
  tests of the session (the control plane is shared) are never sent to them, and the
  configurations are deleted when the controllers stop.
- Leader election and the metrics endpoints are off; health probes listen on 127.0.0.1.

Processes run in their own sessions, are stopped by PID (SIGTERM, then SIGKILL), and get
SIGTERM from the kernel if the test run dies (``setpriv --pdeathsig``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml

from devkit.cluster import pki
from devkit.cluster.controlplane import (
    CLUSTER_DIR,
    ControlPlane,
    ControlPlaneError,
    read_object,
    read_versions,
    run_build_script,
)
from devkit.waiting import wait_for

BUILD_SCRIPT = CLUSTER_DIR / "build-controllers.sh"
CONTROLLERS_LABEL = "k8s-rendezvous.dev/controllers"
"""Label (value ``on``) of the namespaces whose objects the controllers' webhooks see."""
HOST = "127.0.0.1"
READY_TIMEOUT = 120.0
STOP_GRACE_SECONDS = 10.0


def build_controllers(*, stream_log: bool = False) -> Path:
    """Run devkit/cluster/build-controllers.sh (a no-op once cached); the directory it
    prints, holding ``kueue/``, ``jobset/``, ``trainer/`` and ``lws/``."""
    return run_build_script(BUILD_SCRIPT, stream_log=stream_log)


# -- certificates ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Certificates:
    """The webhooks' CA and serving pair (for 127.0.0.1), and the client certificates the
    controllers authenticate with (signed by the cluster's CA)."""

    directory: Path
    webhook_ca: Path
    serving_cert: Path
    serving_key: Path

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        directory.mkdir(parents=True, exist_ok=True)
        ca = pki.create_ca(directory, "webhook-ca", "/CN=k8s-rendezvous-controllers-webhook-ca")
        serving = pki.sign_certificate(
            directory,
            ca,
            "serving",
            f"/CN={HOST}",
            f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{HOST}\n",
        )
        return cls(directory, ca.cert, serving.cert, serving.key)

    def ca_bundle(self) -> str:
        return base64.b64encode(self.webhook_ca.read_bytes()).decode()

    def serving_dir(self, directory: Path, cert: str = "tls.crt", key: str = "tls.key") -> Path:
        """A directory holding the serving pair under the names a controller reads."""
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.serving_cert, directory / cert)
        shutil.copyfile(self.serving_key, directory / key)
        return directory

    def client_kubeconfig(self, plane: ControlPlane, user: str) -> Path:
        """A kubeconfig authenticating as ``user`` with a certificate of the cluster's CA."""
        client = pki.sign_certificate(
            self.directory, plane.pki.ca, user, f"/CN={user}", "extendedKeyUsage=clientAuth\n"
        )
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": plane.server,
                        "certificate-authority": str(plane.pki.ca.cert),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate": str(client.cert),
                        "client-key": str(client.key),
                    },
                }
            ],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }
        path = self.directory / f"{user}.kubeconfig"
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)
        return path


# -- manifests ---------------------------------------------------------------------------


def documents(*paths: Path) -> list[dict[str, Any]]:
    """Every YAML document of ``paths`` (files, or directories of ``*.yaml``)."""
    found: list[dict[str, Any]] = []
    for path in paths:
        files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
        for file in files:
            found += [doc for doc in yaml.safe_load_all(file.read_text()) if doc]
    return found


def apply(plane: ControlPlane, objects: Iterable[Mapping[str, Any]]) -> None:
    """``kubectl apply --server-side`` (CRDs are too big for the last-applied annotation)."""
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=body)


def local_webhooks(
    configurations: Iterable[Mapping[str, Any]], prefix: str, port: int, ca_bundle: str
) -> list[dict[str, Any]]:
    """The manifests' webhook configurations, named ``<prefix>-...``, each webhook calling
    ``https://127.0.0.1:<port><its path>`` and seeing only labelled namespaces."""
    result = []
    for configuration in configurations:
        if not configuration.get("kind", "").endswith("WebhookConfiguration"):
            continue
        webhooks = []
        for webhook in configuration.get("webhooks") or []:
            path = webhook["clientConfig"]["service"]["path"]
            selector = dict(webhook.get("namespaceSelector") or {})
            selector["matchLabels"] = {**selector.get("matchLabels", {}), CONTROLLERS_LABEL: "on"}
            webhooks.append(
                {
                    **webhook,
                    "clientConfig": {"url": f"https://{HOST}:{port}{path}", "caBundle": ca_bundle},
                    "namespaceSelector": selector,
                }
            )
        name = f"{prefix}-{configuration['metadata']['name']}"
        result.append({**configuration, "metadata": {"name": name}, "webhooks": webhooks})
    return result


def role_for(
    roles: Iterable[Mapping[str, Any]], source: str, name: str, user: str, namespace: str = ""
) -> list[dict[str, Any]]:
    """The manifests' ClusterRole (or, with ``namespace``, Role) ``source``, renamed
    ``name`` (placed in ``namespace``), bound to ``user``."""
    kind = "Role" if namespace else "ClusterRole"
    (role,) = [r for r in roles if r.get("kind") == kind and r["metadata"]["name"] == source]
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": f"{kind}Binding",
        "metadata": metadata,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    return [{**role, "metadata": metadata}, binding]


# -- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass
class Controller:
    """One controller process: what it runs and how to tell it is ready."""

    name: str
    args: list[str]
    env: dict[str, str]
    workdir: Path
    health_port: int
    installed: Installed
    wrapper: list[str] = dataclasses.field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        setpriv = shutil.which("setpriv")
        death = [setpriv, "--pdeathsig", "TERM"] if setpriv else []
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [*death, *self.wrapper, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**env, **self.env},
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Until its /readyz answers 200 (its webhook server listens; its caches synced)
        and each of its webhooks is served (:meth:`wait_webhooks`)."""

        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise ControlPlaneError(
                    f"{self.name} exited ({self.process and self.process.returncode}):\n"
                    f"{self.log_tail()}"
                )
            try:
                url = f"http://{HOST}:{self.health_port}/readyz"
                with urllib.request.urlopen(url, timeout=2) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_for(ready, timeout, f"{self.name} ready (/readyz)\n{self.log_tail()}", interval=0.2)
        self.wait_webhooks(timeout)

    def wait_webhooks(self, timeout: float) -> None:
        """Until every webhook URL of its configurations answers other than 404. JobSet
        v0.12 reports ready once its webhook server listens, while a goroutine of its own
        registers the handlers: until then the server answers 404, which the API server
        turns into a 500 for the object (seen on busy cores: a JobSet created just after
        /readyz went green was refused with "failed calling webhook mjobset.kb.io: ... could
        not find the requested resource"). An empty POST reaches a registered handler,
        which answers 200 with an error in its AdmissionReview, or an unregistered path."""
        context = ssl.create_default_context(cafile=str(self.installed.webhook_ca))
        pending = set(self.installed.webhook_urls)

        def served() -> bool:
            for url in sorted(pending):
                request = urllib.request.Request(
                    url, data=b"", headers={"Content-Type": "application/json"}, method="POST"
                )
                try:
                    with urllib.request.urlopen(request, timeout=2, context=context):
                        pending.discard(url)
                except urllib.error.HTTPError as error:
                    if error.code != 404:
                        pending.discard(url)
                except (urllib.error.URLError, OSError):
                    pass
            return not pending

        wait_for(
            served,
            timeout,
            f"{self.name}'s webhooks served: {sorted(pending)}\n{self.log_tail()}",
            interval=0.2,
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period: by PID only."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_GRACE_SECONDS)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _private_etc(workdir: Path, files: Mapping[str, Path]) -> list[str]:
    """A wrapper that runs a command with ``files`` (paths under /etc) in place, seen by
    that process only: /etc overlaid in a mount namespace of its own, as a container sees
    the Secrets its pod mounts. The host's /etc is not touched. The command is exec'd, so
    the recorded PID is the controller's."""
    upper, work = workdir / "etc-upper", workdir / "etc-work"
    for target, source in files.items():
        relative = Path(target).relative_to("/etc")
        (upper / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, upper / relative)
    work.mkdir(parents=True, exist_ok=True)
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    mount = f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc"
    return [*unshare, "sh", "-c", f'{mount} && exec "$0" "$@"']


# -- the three controllers ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Installed:
    """What a controller's install put into the cluster, removed again by :func:`remove`."""

    webhook_configurations: tuple[tuple[str, str], ...]
    """(kind, name) of each webhook configuration."""
    rbac: tuple[tuple[str, str, str], ...]
    """(kind, name, namespace) of each role and binding."""
    webhook_urls: tuple[str, ...]
    """The URL each webhook of the configurations calls (on the controller's server)."""
    webhook_ca: Path
    """The CA that signed the controller's serving certificate."""


def install(
    plane: ControlPlane,
    prefix: str,
    crds: Sequence[Path],
    rbac: Sequence[Mapping[str, Any]],
    webhooks: Path,
    port: int,
    certificates: Certificates,
) -> Installed:
    """Apply a controller's CRDs (waiting until established), ``rbac`` (from
    :func:`role_for`, and the namespaces it needs), and its webhook configurations
    pointing at ``port``."""
    # Only the CRDs: a directory of them may also hold its kustomization.yaml (Trainer's).
    definitions = [d for d in documents(*crds) if d.get("kind") == "CustomResourceDefinition"]
    apply(plane, definitions)
    with plane.api_client() as api:
        extensions = kubernetes.client.ApiextensionsV1Api(api)

        def established(name: str) -> bool:
            crd = read_object(extensions.read_custom_resource_definition, name)
            conditions = (crd.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        for crd in definitions:
            name = crd["metadata"]["name"]
            wait_for(lambda n=name: established(n), 60, f"CRD {name} established")
    configurations = local_webhooks(documents(webhooks), prefix, port, certificates.ca_bundle())
    apply(plane, [*rbac, *configurations])
    return Installed(
        tuple((c["kind"], c["metadata"]["name"]) for c in configurations),
        tuple(
            (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", ""))
            for o in rbac
            if o["kind"] != "Namespace"
        ),
        tuple(sorted({w["clientConfig"]["url"] for c in configurations for w in c["webhooks"]})),
        certificates.webhook_ca,
    )


def remove(plane: ControlPlane, installed: Installed) -> None:
    """Delete the webhook configurations and RBAC (CRDs stay: harmless, and their objects
    may still be being collected)."""
    for kind, name in installed.webhook_configurations:
        plane.kubectl("delete", kind.lower(), name, "--ignore-not-found", "--wait=false")
    for kind, name, namespace in installed.rbac:
        where = ["-n", namespace] if namespace else []
        plane.kubectl("delete", *where, kind.lower(), name, "--ignore-not-found", "--wait=false")


def _config(workdir: Path, name: str, body: Mapping[str, Any]) -> Path:
    path = workdir / f"{name}-config.yaml"
    path.write_text(yaml.safe_dump(dict(body), sort_keys=False))
    return path


def kueue(plane: ControlPlane, built: Path, workdir: Path, certs: Certificates) -> Controller:
    """Kueue, managing plain Jobs, with its default feature gates but VisibilityOnDemand:
    ``ElasticJobsViaWorkloadSlices`` is beta and on by default since v0.18, so the elastic
    Jobs run as a user's Kueue would run them, without turning anything on."""
    manifests = built / "kueue" / "manifests" / "config" / "components"
    health, webhook = free_port(), free_port()
    user = "kueue-controller-manager"
    roles = documents(manifests / "rbac")
    rbac = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}},
        *role_for(roles, "manager-role", "kueue-manager-role", user),
        # Kueue watches the Secrets of its namespace (for its own certificates), even with
        # their management off: without this its caches never sync, and nothing runs.
        *role_for(roles, "manager-secrets-role", "kueue-secrets", user, "kueue-system"),
    ]
    installed = install(
        plane,
        "kueue",
        [manifests / "crd" / "bases"],
        rbac,
        manifests / "webhook" / "manifests.yaml",
        webhook,
        certs,
    )
    config = _config(
        workdir,
        "kueue",
        {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"{HOST}:{health}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {
                "port": webhook,
                "host": HOST,
                "certDir": str(certs.serving_dir(workdir / "kueue-webhook-certs")),
            },
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "clientConnection": {"qps": 50, "burst": 100},
            # VisibilityOnDemand serves pending-workload listings through an aggregated API
            # that nothing here registers, with a certificate from another fixed path
            # (/visibility): off.
            "featureGates": {"VisibilityOnDemand": False},
            "integrations": {"frameworks": ["batch/job"]},
        },
    )
    # Without its own certificate management, Kueue reads its metrics endpoint's pair from
    # this fixed path (the Deployment mounts a Secret there), even with metrics off.
    metrics_certs = {
        "/etc/kueue/metrics/certs/tls.crt": certs.serving_cert,
        "/etc/kueue/metrics/certs/tls.key": certs.serving_key,
    }
    return Controller(
        "kueue",
        [
            str(built / "kueue" / "kueue"),
            f"--config={config}",
            "--zap-log-level=2",
        ],
        {"KUBECONFIG": str(certs.client_kubeconfig(plane, user))},
        workdir,
        health,
        installed,
        wrapper=_private_etc(workdir / "kueue-root", metrics_certs),
    )


def _configured(
    plane: ControlPlane,
    workdir: Path,
    certs: Certificates,
    name: str,
    manifests: Path,
    configuration: str,
    command: list[str],
) -> Controller:
    """A controller whose manifests are kubebuilder's (``crd/bases``, ``rbac/role.yaml``
    with its ``manager-role``, ``webhook/manifests.yaml``) and whose configuration file has
    the ``internalCertManagement`` switch: JobSet's and LeaderWorkerSet's (``configuration``:
    its apiVersion)."""
    health, webhook = free_port(), free_port()
    user = f"{name}-controller-manager"
    installed = install(
        plane,
        name,
        [manifests / "crd" / "bases"],
        role_for(
            documents(manifests / "rbac" / "role.yaml"),
            "manager-role",
            f"{name}-manager-role",
            user,
        ),
        manifests / "webhook" / "manifests.yaml",
        webhook,
        certs,
    )
    config = _config(
        workdir,
        name,
        {
            "apiVersion": configuration,
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {
                "port": webhook,
                "host": HOST,
                "certDir": str(certs.serving_dir(workdir / f"{name}-webhook-certs")),
            },
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"{HOST}:{health}"},
        },
    )
    return Controller(
        name,
        [
            *command,
            f"--config={config}",
            "--metrics-bind-address=0",
            f"--health-probe-bind-address={HOST}:{health}",
        ],
        {"KUBECONFIG": str(certs.client_kubeconfig(plane, user))},
        workdir,
        health,
        installed,
    )


def jobset(plane: ControlPlane, built: Path, workdir: Path, certs: Certificates) -> Controller:
    """The JobSet controller."""
    manifests = built / "jobset" / "manifests" / "config" / "components"
    command = [str(built / "jobset" / "jobset")]
    return _configured(
        plane, workdir, certs, "jobset", manifests, "config.jobset.x-k8s.io/v1alpha1", command
    )


def trainer(plane: ControlPlane, built: Path, workdir: Path, certs: Certificates) -> Controller:
    """Kubeflow Trainer v2's controller manager (TrainJob, (Cluster)TrainingRuntime)."""
    manifests = built / "trainer" / "manifests" / "manifests" / "base"
    health, webhook = free_port(), free_port()
    user = "kubeflow-trainer-controller-manager"
    installed = install(
        plane,
        "trainer",
        [manifests / "crds"],
        role_for(documents(manifests / "rbac" / "role.yaml"), user, "trainer-manager-role", user),
        manifests / "webhook" / "manifests.yaml",
        webhook,
        certs,
    )
    config = _config(
        workdir,
        "trainer",
        {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
            "kind": "Configuration",
            "health": {
                "healthProbeBindAddress": f"{HOST}:{health}",
                "readinessEndpointName": "readyz",
                "livenessEndpointName": "healthz",
            },
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": webhook, "host": HOST},
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
        },
    )
    # Its configuration has no certificate directory: controller-runtime's default,
    # $TMPDIR/k8s-webhook-server/serving-certs, is used, with this process's own TMPDIR.
    tmp = workdir / "trainer-tmp"
    certs.serving_dir(tmp / "k8s-webhook-server" / "serving-certs")
    return Controller(
        "trainer",
        [str(built / "trainer" / "trainer-controller-manager"), f"--config={config}"],
        {"KUBECONFIG": str(certs.client_kubeconfig(plane, user)), "TMPDIR": str(tmp)},
        workdir,
        health,
        installed,
    )


def lws(plane: ControlPlane, built: Path, workdir: Path, certs: Certificates) -> Controller:
    """The LeaderWorkerSet controller."""
    manifests = built / "lws" / "manifests" / "config"
    command = [str(built / "lws" / "lws")]
    return _configured(
        plane, workdir, certs, "lws", manifests, "config.lws.x-k8s.io/v1alpha1", command
    )


@dataclasses.dataclass
class Controllers:
    """The controllers of a test layer, started on first use (:meth:`ensure`); :meth:`stop`
    stops each by PID and removes its webhook configurations and RBAC."""

    plane: ControlPlane
    built: Path
    workdir: Path
    certificates: Certificates
    running: dict[str, Controller] = dataclasses.field(default_factory=dict)

    def ensure(self, name: str) -> Controller:
        if name not in self.running:
            controller = ALL[name](self.plane, self.built, self.workdir, self.certificates)
            self.running[name] = controller
            controller.start()
            controller.wait_ready()
        return self.running[name]

    def stop(self) -> None:
        for controller in reversed(list(self.running.values())):
            controller.stop()
            remove(self.plane, controller.installed)
        self.running.clear()


StartController = Callable[[ControlPlane, Path, Path, Certificates], Controller]
ALL: dict[str, StartController] = {
    "kueue": kueue,
    "jobset": jobset,
    "trainer": trainer,
    "lws": lws,
}
VERSIONS = {name: read_versions()[f"{name.upper()}_VERSION"] for name in ALL}
