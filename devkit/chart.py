"""The chart against the test control plane: helm, the release, the operator's identity.

helm runs with its own HOME-like directories (nothing is written under ~) and the admin
kubeconfig. Renders pass no --kube-version: devkit/cluster/build.sh builds helm for the
pinned Kubernetes version (a release build of helm assumes that of its client-go).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml

from devkit import paths
from devkit.cluster.controlplane import ControlPlane, dig, read_object
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for

CHART = paths.CHART
RELEASE = "k8s-rendezvous"
NAMESPACE = "k8s-rendezvous-system"
OPERATOR = "k8s-rendezvous-operator"
"""The Deployment, its ServiceAccount, ClusterRole(Binding) and leader-election Lease."""
WORKER_ROLE = "k8s-rendezvous-worker"
CREATOR_ROLE = "k8s-rendezvous-creator"
SHARED_ROLES = (WORKER_ROLE, CREATOR_ROLE)
"""ClusterRoles of fixed names, also in manifests/rbac/ (which the integration fixtures apply)."""
WEBHOOK_SERVICE = "k8s-rendezvous-webhook"
WEBHOOK_CONFIG = "k8s-rendezvous.k8s-rendezvous.dev"
"""The MutatingWebhookConfiguration the operator keeps its webhook in."""
CRD_NAMES = ("rendezvous.k8s-rendezvous.dev", "rendezvousslices.k8s-rendezvous.dev")
DEFAULT_OBJECTS = frozenset(
    {
        ("ServiceAccount", OPERATOR),
        ("ClusterRole", OPERATOR),
        ("ClusterRoleBinding", OPERATOR),
        ("Role", f"{OPERATOR}-leader-election"),
        ("RoleBinding", f"{OPERATOR}-leader-election"),
        ("ClusterRole", WORKER_ROLE),
        ("ClusterRole", CREATOR_ROLE),
        ("Deployment", OPERATOR),
        ("Service", WEBHOOK_SERVICE),
        ("MutatingWebhookConfiguration", WEBHOOK_CONFIG),
        ("ValidatingAdmissionPolicy", "k8s-rendezvous-pod-leases"),
        ("ValidatingAdmissionPolicyBinding", "k8s-rendezvous-pod-leases"),
        ("ValidatingAdmissionPolicy", "k8s-rendezvous-worker-leases"),
        ("ValidatingAdmissionPolicyBinding", "k8s-rendezvous-worker-leases"),
        ("ValidatingAdmissionPolicy", "k8s-rendezvous-operator-writes"),
        ("ValidatingAdmissionPolicyBinding", "k8s-rendezvous-operator-writes"),
        ("ValidatingAdmissionPolicy", "k8s-rendezvous-pod-rendezvous"),
        ("ValidatingAdmissionPolicyBinding", "k8s-rendezvous-pod-rendezvous"),
        ("PriorityLevelConfiguration", "k8s-rendezvous-pod-leases"),
        ("FlowSchema", "k8s-rendezvous-pod-leases"),
    }
)
"""(kind, name) of each object the chart makes with its default values where the API server
serves no MutatingAdmissionPolicy (and for ``helm template``)."""
INJECTION_POLICY_OBJECTS = frozenset(
    {
        ("MutatingAdmissionPolicy", "k8s-rendezvous-torchrun-env"),
        ("MutatingAdmissionPolicyBinding", "k8s-rendezvous-torchrun-env"),
    }
)
"""What it adds where the API server serves MutatingAdmissionPolicy (Kubernetes 1.36 and
later): the injection policy."""


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
        return self.run("template", release, str(CHART), "--namespace", NAMESPACE, *args).stdout

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


def serves_mutating_admission_policy(control_plane: ControlPlane) -> bool:
    """Whether the API server serves admissionregistration.k8s.io/v1 MutatingAdmissionPolicy
    (Kubernetes 1.36 and later), the capability the chart's injectionPolicy: auto tests."""
    found = control_plane.kubectl("get", "--raw", "/apis/admissionregistration.k8s.io/v1")
    resources = json.loads(found.stdout)["resources"]
    return any(r["name"] == "mutatingadmissionpolicies" for r in resources)


def adopt_shared_roles(control_plane: ControlPlane) -> bool:
    """Make room for the release's worker and creator ClusterRoles: copies applied with
    kubectl (the integration fixtures apply manifests/rbac/) cannot be adopted by Helm. True
    if any was removed; put them back with :func:`restore_shared_roles` after the release
    is gone."""
    removed = False
    for role in SHARED_ROLES:
        found = control_plane.kubectl(
            "get",
            "clusterrole",
            role,
            "--ignore-not-found",
            "-o",
            "jsonpath={.metadata.annotations.meta\\.helm\\.sh/release-name}|{.metadata.name}",
        ).stdout
        if not found or not found.endswith(f"|{role}") or found.startswith(f"{RELEASE}|"):
            continue
        control_plane.kubectl("delete", "clusterrole", role, "--wait")
        removed = True
    return removed


def restore_shared_roles(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "--server-side", "-f", str(paths.RBAC))


def uninstall(helm: Helm, control_plane: ControlPlane) -> None:
    """Uninstall the release and its Leases, and return once its admission policies are
    no longer enforced."""
    helm.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
    control_plane.kubectl("-n", NAMESPACE, "delete", "leases", "--all")
    wait_policies_unenforced(control_plane)


def wait_policies_unenforced(control_plane: ControlPlane) -> None:
    """Until the API server no longer enforces the chart's admission policies on pods: the
    deleted policies leave its admission plugin through an informer, some time after the
    DELETE returned, and a test of another tier writing raw Leases as a pod would be
    refused meanwhile."""
    wait_for(
        lambda: not _refused_as_a_pod(control_plane),
        60,
        "the API server to stop enforcing the uninstalled chart's admission policies",
    )


_POLICY_PROBES = (
    {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "probe.probe",
            "namespace": "default",
            "labels": {"k8s-rendezvous.dev/rendezvous": "probe"},
        },
        "spec": {"holderIdentity": "probe"},
    },
    {
        "apiVersion": "k8s-rendezvous.dev/v1alpha1",
        "kind": "Rendezvous",
        "metadata": {"name": "probe", "namespace": "default"},
        "spec": {"minNodes": 1, "maxNodes": 1, "runId": "probe"},
    },
)
"""Writes the pod-leases and pod-rendezvous policies refuse from pod ``probe`` (no owner,
no pod uid, no created-by-pod annotation). The worker-leases and operator-writes policies
refuse nothing that tests outside the chart's own do."""


def _refused_as_a_pod(control_plane: ControlPlane) -> bool:
    """Whether a server-side dry run of a probe write by a pod (impersonated, in
    system:masters so that RBAC allows it) is refused by an admission policy."""
    for probe in _POLICY_PROBES:
        proc = control_plane.kubectl(
            "create", "--dry-run=server", "-f", "-",
            "--as=probe", "--as-group=system:masters",
            "--as-user-extra=authentication.kubernetes.io/pod-name=probe",
            input=json.dumps(probe), check=False,
        )  # fmt: skip
        if proc.returncode != 0:
            if "ValidatingAdmissionPolicy" not in proc.stderr:
                raise AssertionError(f"dry run of a probe write failed: {proc.stderr}")
            return True
    return False


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


class ChartOperator(OperatorProcess):
    """The operator as the chart's Deployment runs it: its flags (``args``), and the pod's
    name and namespace in the environment (the leader-election identity)."""

    def __init__(
        self,
        kubeconfig: Path,
        log_path: Path,
        *,
        pod: str,
        args: tuple[str, ...] = (),
        liveness: str = "",
    ) -> None:
        super().__init__(
            kubeconfig,
            log_path,
            extra_args=(f"--liveness={liveness}", *args),
            env={"POD_NAME": pod, "POD_NAMESPACE": NAMESPACE},
        )
        self.pod = pod
        self.liveness = liveness

    @classmethod
    def leading_with_webhook(cls, release: Release, directory: Path, port: int) -> ChartOperator:
        """The operator with the chart's identity (its first pod's) and flags, leader
        election and the webhook included, served on 127.0.0.1:``port`` (the API server
        runs here, not in the cluster) and registered in the chart's configuration."""
        pod = release.operator_pods()[0]
        return cls(
            release.operator_kubeconfig(pod, directory / "kubeconfig"),
            directory / "operator.log",
            pod=pod["metadata"]["name"],
            args=(
                "--leader-elect",
                f"--leader-election-namespace={NAMESPACE}",
                f"--leader-election-id={OPERATOR}",
                "--webhook",
                "--webhook-host=127.0.0.1",
                "--webhook-addr=127.0.0.1",
                f"--webhook-port={port}",
                f"--webhook-config-name={WEBHOOK_CONFIG}",
            ),
        )

    def health(self) -> Any:
        """The JSON its liveness endpoint answers (200 or an error)."""
        with urllib.request.urlopen(self.liveness, timeout=5) as response:
            assert response.status == 200
            return json.loads(response.read())
