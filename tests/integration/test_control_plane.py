"""Proof that the local control plane behaves like a real cluster where this project relies
on it: versioning, CRD validation (CEL), concurrent status patches, optimistic
concurrency, selector watches, RBAC, pod-bound tokens, Jobs on kwok nodes, garbage
collection and Job accounting of pods that tests end."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.watch
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.incluster_config import InClusterConfigLoader

from devkit.cluster.controlplane import (
    NODE_ZONES,
    POD_CIDR,
    ControlPlane,
    dig,
    read_object,
    read_versions,
    set_pod_phase,
    to_model,
)
from devkit.waiting import wait_for

GROUP = "proof.k8s-rendezvous.dev"
VERSION = "v1"
PLURAL = "proofs"
CEL_MESSAGE = "minNodes must not exceed maxNodes"
MERGE = "application/merge-patch+json"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "proof", "kind": "Proof", "listKind": "ProofList"},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["minNodes", "maxNodes"],
                                "properties": {
                                    "minNodes": {"type": "integer", "minimum": 1},
                                    "maxNodes": {"type": "integer", "minimum": 1},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.minNodes <= self.maxNodes",
                                        "message": CEL_MESSAGE,
                                    },
                                ],
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "members": {
                                        "type": "object",
                                        "additionalProperties": {"type": "string"},
                                    },
                                    "note": {"type": "string"},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def _dict(value: object) -> dict[str, Any]:
    """Custom-object calls are typed `object`; they return the JSON dict."""
    assert isinstance(value, dict), value
    return value


def _status(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body or "{}")
    return body


@pytest.fixture(scope="module")
def proof_crd(admin_api: kubernetes.client.ApiClient) -> Iterator[str]:
    """The test CRD, established and served; deleted at the end of the module."""
    ext = kubernetes.client.ApiextensionsV1Api(admin_api)
    name = CRD["metadata"]["name"]

    def absent() -> bool:
        try:
            ext.read_custom_resource_definition(name)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    # A leftover from an aborted run against a reused cluster: start from scratch.
    if not absent():
        ext.delete_custom_resource_definition(name)
        wait_for(absent, 60, f"leftover CRD {name} to be deleted")
    ext.create_custom_resource_definition(
        to_model(kubernetes.client.V1CustomResourceDefinition, CRD)
    )

    def established() -> bool:
        crd = read_object(ext.read_custom_resource_definition, name)
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in dig(crd, "status", "conditions", default=[])
        )

    wait_for(established, 60, f"CRD {name} to be Established")
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    wait_for(
        lambda: custom.list_cluster_custom_object(GROUP, VERSION, PLURAL) is not None,
        30,
        "the new resource to be served",
        ignore=(ApiException,),
    )
    yield name
    ext.delete_custom_resource_definition(name)


def _proof(name: str, min_nodes: int = 1, max_nodes: int = 4, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Proof",
        "metadata": {"name": name, **meta},
        "spec": {"minNodes": min_nodes, "maxNodes": max_nodes},
    }


def _config_map(name: str) -> kubernetes.client.V1ConfigMap:
    return to_model(kubernetes.client.V1ConfigMap, {"metadata": {"name": name}})


def _pods(core: kubernetes.client.CoreV1Api, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = read_object(
        core.list_namespaced_pod, namespace, label_selector=selector
    )["items"]
    return items


def _running_pods(
    core: kubernetes.client.CoreV1Api, namespace: str, selector: str, count: int
) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in _pods(core, namespace, selector)
        if dig(p, "status", "phase") == "Running" and dig(p, "status", "podIP")
    ]
    return pods if len(pods) >= count else None


def _job(name: str, parallelism: int, completions: int, backoff_limit: int = 6) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": parallelism,
            "completions": completions,
            "backoffLimit": backoff_limit,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "registry.invalid/never-pulled:1"}],
                }
            },
        },
    }


def test_version_is_the_pinned_release(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient
) -> None:
    expected = "v" + read_versions()["KUBERNETES_VERSION"]
    info = kubernetes.client.VersionApi(admin_api).get_code()
    assert info.git_version == expected
    assert (info.major, info.minor) == ("1", expected.split(".")[1])
    versions = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == expected
    assert versions["serverVersion"]["gitVersion"] == expected


def test_crd_cel_rule_and_status_subresource(
    admin_api: kubernetes.client.ApiClient, proof_crd: str, namespace: str
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    with pytest.raises(ApiException) as rejected:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _proof("bad", min_nodes=3, max_nodes=2)
        )
    assert rejected.value.status == 422
    assert CEL_MESSAGE in _status(rejected.value)["message"]

    # A valid object passes; status sent on create is dropped (status subresource) ...
    body = _proof("good") | {"status": {"note": "ignored"}}
    created = _dict(custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body))
    assert "status" not in created
    # ... a main-resource patch cannot set it, the /status endpoint can.
    patched = _dict(
        custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "good",
            {"status": {"note": "main"}},
            _content_type=MERGE,
        )
    )
    assert "status" not in patched
    patched = _dict(
        custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "good",
            {"status": {"note": "via-status"}},
            _content_type=MERGE,
        )
    )
    assert patched["status"]["note"] == "via-status"
    # The CEL rule also guards updates.
    with pytest.raises(ApiException) as update_rejected:
        custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "good",
            {"spec": {"minNodes": 9}},
            _content_type=MERGE,
        )
    assert update_rejected.value.status == 422
    assert CEL_MESSAGE in _status(update_rejected.value)["message"]


def test_concurrent_status_patches_lose_nothing_and_stale_updates_conflict(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    proof_crd: str,
    namespace: str,
) -> None:
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _proof("shared"))
    writers = 32
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            with control_plane.api_client() as own:
                api = kubernetes.client.CustomObjectsApi(own)
                kubernetes.client.VersionApi(own).get_code()  # connect before the barrier
                barrier.wait(timeout=60)
                api.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    "shared",
                    {"status": {"members": {f"member-{index:02d}": f"value-{index}"}}},
                    _content_type=MERGE,
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a writer hung"
    assert not errors, errors
    members = _dict(
        custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "shared")
    )["status"]["members"]
    assert members == {f"member-{i:02d}": f"value-{i}" for i in range(writers)}

    stale = _dict(custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "shared"))
    custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        "shared",
        {"spec": {"maxNodes": 5}},
        _content_type=MERGE,
    )
    stale_rv = stale["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as put_conflict:
        custom.replace_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "shared",
            stale | {"spec": {"minNodes": 2, "maxNodes": 6}},
        )
    assert put_conflict.value.status == 409
    with pytest.raises(ApiException) as patch_conflict:
        custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            "shared",
            {"metadata": {"resourceVersion": stale_rv}, "status": {"note": "late"}},
            _content_type=MERGE,
        )
    assert patch_conflict.value.status == 409
    final = _dict(custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "shared"))
    assert final["spec"] == {"minNodes": 1, "maxNodes": 5}
    assert "note" not in final["status"]


def test_label_selector_watch_sees_objects_enter_and_leave(
    admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(admin_api)
    start_rv = read_object(core.list_namespaced_config_map, namespace)["metadata"][
        "resourceVersion"
    ]
    core.create_namespaced_config_map(namespace, _config_map("never-matches"))
    core.create_namespaced_config_map(namespace, _config_map("subject"))
    for patch in (
        {"metadata": {"labels": {"proof": "yes"}}},  # starts matching
        {"data": {"k": "v"}},  # changes while matching
        {"metadata": {"labels": {"proof": None}}},  # stops matching
    ):
        core.patch_namespaced_config_map("subject", namespace, patch, _content_type=MERGE)

    seen: list[tuple[str, str]] = []
    watch = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
    for event in watch.stream(  # type: ignore[no-untyped-call]
        core.list_namespaced_config_map,
        namespace,
        label_selector="proof=yes",
        resource_version=start_rv,
        timeout_seconds=30,
        deserialize=False,
    ):
        seen.append((event["type"], event["object"]["metadata"]["name"]))
        if event["type"] == "DELETED":
            watch.stop()  # type: ignore[no-untyped-call]
    assert seen == [("ADDED", "subject"), ("MODIFIED", "subject"), ("DELETED", "subject")]


def test_rbac_denies_until_a_role_is_bound(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    service_account_client: Any,
    tmp_path: Path,
) -> None:
    reader = kubernetes.client.CoreV1Api(service_account_client("reader"))
    with pytest.raises(ApiException) as denied:
        reader.list_namespaced_config_map(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:reader" in _status(denied.value)["message"]

    rbac = kubernetes.client.RbacAuthorizationV1Api(admin_api)
    rbac.create_namespaced_role(
        namespace,
        to_model(
            kubernetes.client.V1Role,
            {
                "metadata": {"name": "configmap-reader"},
                "rules": [
                    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}
                ],
            },
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        to_model(
            kubernetes.client.V1RoleBinding,
            {
                "metadata": {"name": "configmap-reader"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "configmap-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            },
        ),
    )

    def allowed() -> bool:
        try:
            reader.list_namespaced_config_map(namespace)
        except ApiException as exc:
            if exc.status == 403:
                return False
            raise
        return True

    wait_for(allowed, 30, "the RoleBinding to take effect")
    with pytest.raises(ApiException) as still_denied:
        reader.list_namespaced_secret(namespace)
    assert still_denied.value.status == 403

    # The same identity through a kubeconfig file, as kubectl or kopf would load it.
    kubeconfig = control_plane.write_kubeconfig_for_token(
        control_plane.token_for(namespace, "reader"), tmp_path / "reader.kubeconfig"
    )
    can_i = [f"--kubeconfig={kubeconfig}", "auth", "can-i", "-n", namespace]
    assert control_plane.kubectl(*can_i, "list", "configmaps").stdout.strip() == "yes"
    denied_secrets = control_plane.kubectl(*can_i, "list", "secrets", check=False)
    assert (denied_secrets.returncode, denied_secrets.stdout.strip()) == (1, "no")


def test_pod_bound_token_carries_the_pod_and_dies_with_it(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    pod_environment: Any,
) -> None:
    core = kubernetes.client.CoreV1Api(admin_api)
    core.create_namespaced_pod(
        namespace,
        to_model(
            kubernetes.client.V1Pod,
            {
                "metadata": {"name": "worker"},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/x:1"}]},
            },
        ),
    )
    pod = wait_for(
        lambda: _running_pods(core, namespace, "", 1), 120, "pod worker to run on a kwok node"
    )[0]
    uid = pod["metadata"]["uid"]

    def review(api: kubernetes.client.ApiClient) -> dict[str, Any]:
        result = read_object(
            kubernetes.client.AuthenticationV1Api(api).create_self_subject_review,
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        user: dict[str, Any] = result["status"]["userInfo"]
        return user

    token = control_plane.token_for(namespace, "default", pod_name="worker", pod_uid=uid)
    with control_plane.client_for_token(token) as api:
        user = review(api)
    assert user["username"] == f"system:serviceaccount:{namespace}:default"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["worker"]
    assert user["extra"]["authentication.kubernetes.io/pod-uid"] == [uid]

    # The pod-side view: the in-cluster loader pointed at the files pod_environment wrote.
    env = pod_environment(pod, pod["status"]["podIP"])
    directory = Path(env["K8S_RENDEZVOUS_SERVICE_ACCOUNT_DIR"])
    assert (directory / "namespace").read_text() == namespace
    assert env["POD_NAME"] == "worker" and env["POD_IP"] == pod["status"]["podIP"]
    configuration = kubernetes.client.Configuration()
    loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
        token_filename=str(directory / "token"),
        cert_filename=str(directory / "ca.crt"),
        environ=env,
    )
    loader.load_and_set(configuration)  # type: ignore[no-untyped-call]
    assert configuration.host == control_plane.server
    with kubernetes.client.ApiClient(configuration) as api:
        assert review(api)["extra"]["authentication.kubernetes.io/pod-name"] == ["worker"]

    core.delete_namespaced_pod("worker", namespace)

    def rejected() -> bool:
        with control_plane.client_for_token(token) as api:
            try:
                review(api)
            except ApiException as exc:
                if exc.status == 401:
                    return True
                raise
        return False

    wait_for(rejected, 90, "the pod-bound token to be rejected after the pod is gone")


def test_job_pods_run_on_kwok_nodes_with_distinct_ips(
    admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    kubernetes.client.BatchV1Api(admin_api).create_namespaced_job(
        namespace, to_model(kubernetes.client.V1Job, _job("trio", parallelism=3, completions=3))
    )
    core = kubernetes.client.CoreV1Api(admin_api)
    pods = wait_for(
        lambda: _running_pods(core, namespace, "job-name=trio", 3),
        120,
        "3 Running pods of Job trio",
    )
    assert len(pods) == 3
    assert {p["spec"]["nodeName"] for p in pods} <= set(NODE_ZONES)
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 3
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network(POD_CIDR) for ip in ips)
    batch = kubernetes.client.BatchV1Api(admin_api)
    wait_for(
        lambda: (
            dig(read_object(batch.read_namespaced_job, "trio", namespace), "status", "ready") == 3
        ),
        60,
        "Job trio to count 3 ready pods",
    )


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(
    admin_api: kubernetes.client.ApiClient, proof_crd: str, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(admin_api)
    owner = core.create_namespaced_config_map(namespace, _config_map("owner"))
    custom = kubernetes.client.CustomObjectsApi(admin_api)
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner.metadata.uid if owner.metadata else None,
    }
    custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _proof("dependent", ownerReferences=[reference])
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _proof("bystander"))
    core.delete_namespaced_config_map("owner", namespace)

    def dependent_gone() -> bool:
        try:
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "dependent")
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    # The GC notices new resource types on its periodic discovery resync (30 s).
    wait_for(dependent_gone, 150, "the garbage collector to delete the dependent")
    custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bystander")


def test_job_controller_counts_pods_ended_by_set_pod_phase(
    admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    batch = kubernetes.client.BatchV1Api(admin_api)
    core = kubernetes.client.CoreV1Api(admin_api)
    name = f"pair-{uuid.uuid4().hex[:6]}"
    batch.create_namespaced_job(
        namespace, to_model(kubernetes.client.V1Job, _job(name, parallelism=2, completions=2))
    )
    pods = wait_for(
        lambda: _running_pods(core, namespace, f"job-name={name}", 2),
        120,
        f"2 Running pods of Job {name}",
    )
    failing, succeeding = pods[0]["metadata"]["name"], pods[1]["metadata"]["name"]

    set_pod_phase(admin_api, namespace, failing, "Failed", exit_code=3)
    set_pod_phase(admin_api, namespace, succeeding, "Succeeded")

    def counted() -> dict[str, Any] | None:
        status: dict[str, Any] = dig(
            read_object(batch.read_namespaced_job, name, namespace), "status", default={}
        )
        done = status.get("failed") == 1 and status.get("succeeded") == 1
        return status if done else None

    wait_for(counted, 90, f"Job {name} to count one failed and one succeeded pod")
    # By now the Job controller has seen and finalized both pods; kwok has had every
    # update event too and must not have put them back to Running.
    by_name = {p["metadata"]["name"]: p for p in _pods(core, namespace, f"job-name={name}")}
    assert by_name[failing]["status"]["phase"] == "Failed"
    terminated = by_name[failing]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert by_name[succeeding]["status"]["phase"] == "Succeeded"
    for ended in (failing, succeeding):
        finalizers = dig(by_name[ended], "metadata", "finalizers", default=[])
        assert "batch.kubernetes.io/job-tracking" not in finalizers


def test_a_crashed_scheduler_is_started_again_and_schedules(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    """restart_exited, which long fault runs call as a kubelet restarts a static pod: the
    scheduler exits by design when it finds its cache corrupted (a soak with API server
    restarts saw it), here SIGKILLed by its PID; started again, it schedules pods."""
    crashed = control_plane.pids["kube-scheduler"]
    os.kill(crashed, signal.SIGKILL)
    wait_for(
        lambda: "kube-scheduler" not in control_plane.running_components(),
        30,
        "the killed scheduler to have exited",
    )
    assert control_plane.restart_exited() == ["kube-scheduler"]
    assert control_plane.pids["kube-scheduler"] != crashed
    assert control_plane.restart_exited() == [], "nothing else had exited"
    kubernetes.client.BatchV1Api(admin_api).create_namespaced_job(
        namespace, to_model(kubernetes.client.V1Job, _job("after", parallelism=1, completions=1))
    )
    core = kubernetes.client.CoreV1Api(admin_api)
    wait_for(
        lambda: _running_pods(core, namespace, "job-name=after", 1),
        120,
        "the pod of Job after scheduled and Running",
    )


def test_apiserver_and_etcd_restarts_keep_state(
    control_plane: ControlPlane, namespace: str
) -> None:
    """The fault-injection hooks: the apiserver comes back on the same address, etcd keeps
    its data across a restart. (Last in the module: it disturbs every client briefly.)"""
    server = control_plane.server
    with control_plane.api_client() as api:
        core = kubernetes.client.CoreV1Api(api)
        core.create_namespaced_config_map(namespace, _config_map("survivor"))

        control_plane.stop_apiserver()
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.read_namespaced_config_map("survivor", namespace, _request_timeout=5)
        control_plane.start_apiserver()
        assert control_plane.server == server
        core.read_namespaced_config_map("survivor", namespace)

        control_plane.restart_etcd()
        transient = (ApiException, urllib3.exceptions.HTTPError)
        wait_for(
            lambda: core.read_namespaced_config_map("survivor", namespace),
            60,
            "the survivor ConfigMap to be readable after the etcd restart",
            ignore=transient,
        )
        wait_for(
            lambda: core.create_namespaced_config_map(namespace, _config_map("after")),
            60,
            "a write to succeed after the etcd restart",
            ignore=transient,
        )
    assert set(control_plane.running_components()) == {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    }
