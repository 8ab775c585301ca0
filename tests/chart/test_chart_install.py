"""The chart against the real API server: a server-side dry run of what it renders (and of
the plain manifests rendered from it), then, with each helm the project supports (Helm 4
and Helm 3), the packaged chart installed at an older version, upgraded with its CRDs, and
uninstalled, leaving the CRDs and nothing else of ours."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hack.sync_chart import version

from devkit.chart import (
    CHART,
    CRD_NAMES,
    CREATOR_ROLE,
    DEFAULT_OBJECTS,
    INJECTION_POLICY_OBJECTS,
    NAMESPACE,
    OPERATOR,
    RELEASE,
    WEBHOOK_CONFIG,
    WEBHOOK_SERVICE,
    WORKER_ROLE,
    Helm,
    adopt_shared_roles,
    ensure_namespace,
    kinds,
    restore_shared_roles,
    serves_mutating_admission_policy,
    sets,
    wait_policies_unenforced,
)
from devkit.cluster.controlplane import ControlPlane, build_helm, read_versions
from devkit.paths import REPO
from devkit.waiting import wait_for

NON_DEFAULT = sets(
    {
        "replicas": 2,
        "watchNamespaces": "{team-a,team-b}",
        "serviceAccount.name": "rdzv-operator",
        "leaderElection.leaseName": "rdzv-lock",
        "resources.limits.memory": "1Gi",
        "metrics.service.enabled": "true",
        "webhook.port": 10443,
    }
)
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
CLUSTER_KINDS = (
    "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,"
    "mutatingwebhookconfigurations,validatingwebhookconfigurations,flowschemas,"
    "mutatingadmissionpolicies,mutatingadmissionpolicybindings,"
    "prioritylevelconfigurations"
)
NAMESPACED_KINDS = (
    "serviceaccounts,roles,rolebindings,deployments,replicasets,pods,leases,services,"
    "poddisruptionbudgets"
)


def dry_run(control_plane: ControlPlane, manifests: str) -> list[str]:
    result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=manifests)
    lines = result.stdout.splitlines()
    assert lines and all("(server dry run)" in line for line in lines), result.stdout
    return lines


@pytest.mark.parametrize("values", [(), NON_DEFAULT], ids=["defaults", "non-default"])
def test_rendered_chart_passes_a_server_side_dry_run(
    cluster_helm: Helm, control_plane: ControlPlane, values: tuple[str, ...]
) -> None:
    ensure_namespace(control_plane)
    manifests = cluster_helm.template("--include-crds", *values)
    lines = dry_run(control_plane, manifests)
    documents = [doc for doc in yaml.safe_load_all(manifests) if doc]
    assert len(lines) == len(documents)


def test_plain_manifests_pass_a_server_side_dry_run(control_plane: ControlPlane) -> None:
    ensure_namespace(control_plane)
    manifests = "\n---\n".join(
        path.read_text()
        for directory in ("crds", "rbac", "operator", "policy", "flowcontrol")
        for path in sorted((REPO / "manifests" / directory).glob("*.yaml"))
    )
    text = "\n".join(dry_run(control_plane, manifests))
    for expected in (
        *(f"customresourcedefinition.apiextensions.k8s.io/{name}" for name in CRD_NAMES),
        f"clusterrole.rbac.authorization.k8s.io/{WORKER_ROLE}",
        f"clusterrole.rbac.authorization.k8s.io/{CREATOR_ROLE}",
        f"deployment.apps/{OPERATOR}",
        f"service/{WEBHOOK_SERVICE}",
        f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{WEBHOOK_CONFIG}",
        "validatingadmissionpolicy.admissionregistration.k8s.io/k8s-rendezvous-pod-leases",
        "flowschema.flowcontrol.apiserver.k8s.io/k8s-rendezvous-pod-leases",
    ):
        assert expected in text


def exists(control_plane: ControlPlane, obj: dict[str, Any]) -> bool:
    kind = obj["kind"].lower()
    group = obj["apiVersion"].rpartition("/")[0]
    resource = f"{kind}.{group}" if group else kind
    args = ["get", resource, obj["metadata"]["name"], "--ignore-not-found", "-o", "name"]
    if namespace := obj["metadata"].get("namespace"):
        args += ["-n", namespace]
    return bool(control_plane.kubectl(*args).stdout.strip())


def ours_left(control_plane: ControlPlane) -> list[str]:
    cluster = control_plane.kubectl("get", CLUSTER_KINDS, "-l", INSTANCE, "-o", "name").stdout
    namespaced = control_plane.kubectl(
        "get", NAMESPACED_KINDS, "-A", "-l", INSTANCE, "-o", "name"
    ).stdout
    pods = control_plane.kubectl(
        "-n", NAMESPACE, "get", "pods", "-o", "name", "-l", "app.kubernetes.io/name=k8s-rendezvous"
    ).stdout
    return (cluster + namespaced + pods).split()


def crds_there(control_plane: ControlPlane) -> int:
    """How many of our CRDs exist."""
    found = control_plane.kubectl("get", "crd", *CRD_NAMES, "--ignore-not-found", "-o", "name")
    return len(found.stdout.split())


def packaged(helm: Helm, directory: Path, version: str | None = None) -> Path:
    """``helm package`` of the chart, as a release publishes it; with ``version``, an
    older release of it: that version, and a Rendezvous CRD without the Declared column (a
    CRD change, which helm upgrade alone would not apply)."""
    source = CHART
    if version is not None:
        source = directory / "older" / CHART.name
        shutil.copytree(CHART, source)
        chart = source / "Chart.yaml"
        chart.write_text(re.sub(r"(?m)^version: .*$", f"version: {version}", chart.read_text()))
        crd = source / "crds" / "k8s-rendezvous.dev_rendezvous.yaml"
        crd.write_text(
            "".join(
                line for line in crd.read_text().splitlines(True) if "name: Declared" not in line
            )
        )
    out = directory / ("older-package" if version else "package")
    helm.run("package", str(source), "--destination", str(out))
    (tgz,) = out.glob("*.tgz")
    return tgz


def columns(control_plane: ControlPlane) -> list[str]:
    """The printer columns of the Rendezvous CRD in the cluster."""
    found = control_plane.kubectl(
        "get",
        "crd",
        CRD_NAMES[0],
        "-o",
        "jsonpath={.spec.versions[0].additionalPrinterColumns[*].name}",
    )
    return found.stdout.split()


@pytest.mark.parametrize(
    "helm_version",
    [read_versions()["HELM_VERSION"], read_versions()["HELM3_VERSION"]],
    ids=lambda version: f"helm{version}",
)
def test_the_packaged_chart_installs_upgrades_its_crds_and_uninstalls(
    helm_version: str, control_plane: ControlPlane, tmp_path: Path
) -> None:
    """With each helm the project supports (docs/install.md): install an older release of
    the packaged chart, upgrade to this one (its CRDs first, as docs/install.md says: helm
    upgrade never touches crds/), uninstall; what stays is the CRDs."""
    helm = Helm(build_helm(helm_version), tmp_path / "helm-home", control_plane.kubeconfig)
    older, current = packaged(helm, tmp_path, "0.0.1"), packaged(helm, tmp_path)
    # From a cluster without any of it, the CRD included, to see helm create each object.
    removed = adopt_shared_roles(control_plane)
    control_plane.kubectl("delete", "crd", *CRD_NAMES, "--ignore-not-found", "--wait")
    assert crds_there(control_plane) == 0
    ensure_namespace(control_plane)
    installed = False
    try:
        notes = helm.run(
            "install", RELEASE, str(older), "--namespace", NAMESPACE, "--wait", "--timeout", "120s",
        ).stdout  # fmt: skip
        installed = True
        assert "kubectl -n team create rolebinding k8s-rendezvous-worker" in notes
        assert f"--clusterrole={WORKER_ROLE} --serviceaccount=team:default" in notes
        assert "kind: Rendezvous" in notes, "NOTES: the next steps"
        assert f"MutatingWebhookConfiguration {WEBHOOK_CONFIG}" in notes
        assert crds_there(control_plane) == len(CRD_NAMES), "helm installs the CRDs from crds/"
        assert "Declared" not in columns(control_plane)
        control_plane.kubectl(
            "wait", "--for=condition=established", "-f", str(CHART / "crds"), "--timeout=60s"
        )

        new_crds = helm.run("show", "crds", str(current)).stdout
        control_plane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", "-", input=new_crds
        )
        assert "Declared" in columns(control_plane), "the upgraded CRD"
        helm.run(
            "upgrade",
            RELEASE,
            str(current),
            "--namespace",
            NAMESPACE,
            "--wait",
            "--timeout",
            "120s",
        )
        listed = json.loads(helm.run("list", "--namespace", NAMESPACE, "-o", "json").stdout)
        (release,) = listed
        assert (release["chart"], str(release["revision"]), release["status"]) == (
            f"k8s-rendezvous-{version()}",
            "2",
            "deployed",
        )
        manifest = helm.run("get", "manifest", RELEASE, "--namespace", NAMESPACE).stdout
        objects = [doc for doc in yaml.safe_load_all(manifest) if doc]
        assert kinds(objects) == DEFAULT_OBJECTS | (
            # Where the API server serves it (1.36 and later), the chart installs it.
            INJECTION_POLICY_OBJECTS if serves_mutating_admission_policy(control_plane) else set()
        )
        missing = [describe(o) for o in objects if not exists(control_plane, o)]
        assert not missing, f"installed but not there: {missing}"
        available = control_plane.kubectl(
            "-n", NAMESPACE, "get", "deployment", OPERATOR,
            "-o", "jsonpath={.status.availableReplicas}",
        ).stdout  # fmt: skip
        assert available == "1", "kwok runs the Deployment's pod (without its container)"

        helm.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait")
        installed = False
        wait_for(lambda: not ours_left(control_plane), 60, "every object of the release gone")
        left = [describe(o) for o in objects if exists(control_plane, o)]
        assert not left, f"left behind by helm uninstall: {left}"
        assert crds_there(control_plane) == len(CRD_NAMES), "CRDs in crds/ stay (and their objects)"
        wait_policies_unenforced(control_plane)
    finally:
        if installed:
            helm.run("uninstall", RELEASE, "--namespace", NAMESPACE, check=False)
        # The session's other tests expect this checkout's CRDs, whatever happened here.
        control_plane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds")
        )
        if removed:
            restore_shared_roles(control_plane)


def describe(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"
