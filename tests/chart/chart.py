"""The chart against the test control plane: helm, the release, the operator's identity.

helm runs with its own HOME-like directories (nothing is written under ~) and the admin
kubeconfig; every render passes the control plane's Kubernetes version (this helm build
would otherwise assume 1.20, below the chart's kubeVersion).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from tests.cluster.controlplane import ControlPlane, dig, read_object, read_versions
from tests.cluster.waiting import wait_for
from tests.support.operator import OperatorProcess

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "k8s-rendezvous"
RELEASE = "k8s-rendezvous"
NAMESPACE = "k8s-rendezvous-system"
OPERATOR = "k8s-rendezvous-operator"
"""The Deployment, its ServiceAccount, ClusterRole(Binding) and leader-election Lease."""
WORKER_ROLE = "k8s-rendezvous-worker"
CRD_NAME = "rendezvous.k8s-rendezvous.dev"
KUBE_VERSION = read_versions()["KUBERNETES_VERSION"]


class Helm:
    def __init__(self, binary: Path, home: Path, kubeconfig: Path | None = None) -> None:
        self.binary = binary
        self.home = home
        self.kubeconfig = kubeconfig

    def run(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))},
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=env,
            input=input,
            check=False,
            timeout=240,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def template(self, *args: str, release: str = RELEASE) -> str:
        return self.run(
            "template",
            release,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *args,
        ).stdout

    def template_objects(self, *args: str) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(self.template(*args)) if doc]


def sets(values: dict[str, object]) -> tuple[str, ...]:
    """``--set key=value`` flags."""
    return tuple(flag for key, value in values.items() for flag in ("--set", f"{key}={value}"))


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} rendered"
    return found[0]


def kinds(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def adopt_worker_role(control_plane: ControlPlane) -> bool:
    """Make room for the release's worker ClusterRole: a copy applied with kubectl (the
    integration fixtures do) cannot be adopted by Helm. True if one was removed; put it
    back with :func:`restore_worker_role` after the release is gone."""
    found = control_plane.kubectl(
        "get",
        "clusterrole",
        WORKER_ROLE,
        "--ignore-not-found",
        "-o",
        "jsonpath={.metadata.annotations.meta\\.helm\\.sh/release-name}|{.metadata.name}",
    ).stdout
    if not found or not found.endswith(f"|{WORKER_ROLE}"):
        return False
    if found.startswith(f"{RELEASE}|"):
        return False
    control_plane.kubectl("delete", "clusterrole", WORKER_ROLE, "--wait")
    return True


def restore_worker_role(control_plane: ControlPlane) -> None:
    control_plane.kubectl(
        "apply", "--server-side", "-f", str(REPO / "manifests" / "rbac" / "worker-clusterrole.yaml")
    )


def ensure_namespace(control_plane: ControlPlane, name: str = NAMESPACE) -> None:
    if not control_plane.kubectl("get", "namespace", name, "--ignore-not-found").stdout:
        control_plane.kubectl("create", "namespace", name)


@dataclasses.dataclass
class Release:
    """An installed release of the chart (default name and namespace)."""

    control_plane: ControlPlane
    api: kubernetes.client.ApiClient

    def operator_pods(self) -> list[dict[str, Any]]:
        """The Deployment's pods, Running (kwok runs no container: they stand for the pods
        whose identity the operator processes of the tests borrow)."""
        core = kubernetes.client.CoreV1Api(self.api)

        def running() -> list[dict[str, Any]] | None:
            pods = read_object(
                core.list_namespaced_pod,
                NAMESPACE,
                label_selector="app.kubernetes.io/component=operator",
            )["items"]
            ok = [
                p
                for p in pods
                if dig(p, "status", "phase") == "Running"
                and not dig(p, "metadata", "deletionTimestamp")
            ]
            return sorted(ok, key=lambda p: str(p["metadata"]["name"])) or None

        return wait_for(running, 60, "the operator Deployment's pods Running")

    def operator_kubeconfig(self, pod: dict[str, Any], path: Path) -> Path:
        """A kubeconfig with a real token of the chart's ServiceAccount, bound to ``pod``
        as the kubelet would mount it (so the API server also sees the pod's name)."""
        token = self.control_plane.token_for(
            NAMESPACE, OPERATOR, pod_name=pod["metadata"]["name"], pod_uid=pod["metadata"]["uid"]
        )
        return self.control_plane.write_kubeconfig_for_token(token, path)


@functools.cache
def operator_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "k8s_rendezvous_operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


class ChartOperator(OperatorProcess):
    """The operator as the chart's Deployment runs it: its flags, and the pod's name and
    namespace in the environment (leader-election identity)."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        *,
        pod: str,
        args: tuple[str, ...] = (),
        liveness: str = "",
    ) -> None:
        super().__init__(kubeconfig, log_path)
        self.pod = pod
        self.args = args
        self.liveness = liveness
        self.started_at = 0.0

    def start(self) -> None:
        assert self._process is None or self._process.poll() is not None, "already running"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "POD_NAME": self.pod,
            "POD_NAMESPACE": NAMESPACE,
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        command = [sys.executable, "-m", "k8s_rendezvous_operator", f"--liveness={self.liveness}"]
        if "--metrics-port" in operator_help():
            command.append("--metrics-port=0")  # several operators on one host would clash
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [*command, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def health(self) -> Any:
        """The JSON its liveness endpoint answers (200 or an error)."""
        with urllib.request.urlopen(self.liveness, timeout=5) as response:
            assert response.status == 200
            return json.loads(response.read())

    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def terminate(self) -> None:
        """SIGTERM without waiting."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""
