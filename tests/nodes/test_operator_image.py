"""The operator image built from the Dockerfile, as users will pull it: its configuration
and contents from the archive, and its entry point run by a real kubelet."""

from __future__ import annotations

import json
import tarfile
from typing import Any

import kubernetes.client
import pytest

from devkit.cluster import images
from devkit.cluster.controlplane import read_object
from devkit.cluster.nodes import REAL_NODE_LABEL, REAL_NODE_TOLERATION, RealNodes
from devkit.waiting import wait_for
from k8s_rendezvous import __version__

pytestmark = pytest.mark.timeout(300)
MAX_COMPRESSED_MB = 150
"""About 97 MB when written (a Debian base and the operator's locked dependencies)."""


def read_image(archive: images.ImageArchive) -> tuple[dict[str, Any], list[tarfile.TarInfo], int]:
    """The image's config, every file of its layers, and its compressed size in bytes."""
    with tarfile.open(archive.path) as outer:

        def blob(digest: str) -> bytes:
            member = outer.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return member.read()

        index = json.loads(outer.extractfile("index.json").read())  # type: ignore[union-attr]
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        files: list[tarfile.TarInfo] = []
        for layer in manifest["layers"]:
            with tarfile.open(
                fileobj=outer.extractfile(  # type: ignore[arg-type]
                    f"blobs/sha256/{layer['digest'].removeprefix('sha256:')}"
                )
            ) as contents:
                files.extend(contents.getmembers())
        size = sum(layer["size"] for layer in manifest["layers"])
    return config, files, size


def test_the_image_runs_as_its_user_without_torch_and_says_its_version(
    node_images: dict[str, images.ImageArchive],
) -> None:
    config, files, size = read_image(node_images["operator"])
    settings = config["config"]
    assert settings["User"] == "65532:65532"
    assert settings["Entrypoint"] == ["k8s-rendezvous-operator"]
    labels = settings["Labels"]
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    venv = [f.name for f in files if f.name.startswith("opt/venv/")]
    assert any(name.endswith("k8s_rendezvous_operator/__main__.py") for name in venv)
    assert not [name for name in venv if "/torch/" in name or name.endswith("/torch")]
    assert size < MAX_COMPRESSED_MB * 1024 * 1024, f"{size / 1048576:.1f} MB"


def test_a_kubelet_runs_the_images_entry_point(
    real_nodes: RealNodes,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    node_images: dict[str, images.ImageArchive],
) -> None:
    core = kubernetes.client.CoreV1Api(admin_api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "operator-version"},
        "spec": {
            "restartPolicy": "Never",
            "tolerations": [REAL_NODE_TOLERATION],
            "nodeSelector": {REAL_NODE_LABEL: "true"},
            "containers": [
                {
                    "name": "operator",
                    "image": node_images["operator"].reference,
                    "imagePullPolicy": "Never",
                    "args": ["--version"],
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True,
                    },
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)

    def finished() -> dict[str, Any] | None:
        found = read_object(core.read_namespaced_pod, "operator-version", namespace)
        return found if found["status"].get("phase") in ("Succeeded", "Failed") else None

    done = wait_for(finished, 120, "the --version pod to finish")
    log = core.read_namespaced_pod_log("operator-version", namespace)
    assert done["status"]["phase"] == "Succeeded", (done["status"], log)
    assert log.strip() == f"k8s-rendezvous-operator {__version__}"
