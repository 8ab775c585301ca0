"""The OCI image writer behind the real nodes' pause and trainer images.

Covers: the same inputs give the same bytes (and digests); the layout's files (oci-layout,
index.json, a blob for every descriptor, sizes and digests that match); the index's name
annotations and platform, which `ctr images import` reads; the image config's runtime
fields and diff_id; the layer's members (sorted, parents added, owner 0:0, mtime 0,
symlinks and sticky modes kept); what the writer refuses; the pause and trainer images
built on it. Nothing here runs a builder.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from devkit.cluster import images

REFERENCE = "localhost/k8s-rendezvous/example:1"
CONFIG = images.ImageConfig(
    entrypoint=("/app", "--serve"),
    cmd=("--port", "80"),
    env=("PATH=/usr/bin", "MODE=test"),
    user="65532:65532",
    working_dir="/work",
)
ENTRIES: list[images.Entry] = [
    images.File("app", b"\x7fELF pretend", 0o755),
    images.Symlink("bin", "usr/bin"),
    images.Directory("tmp", 0o1777),
    images.File("/etc/app/config.json", b"{}"),
]


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {member.name: member for member in tar}


def read(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        stream = tar.extractfile(name)
        assert stream is not None
        return stream.read()


def blob(archive: bytes, digest: str) -> bytes:
    content = read(archive, "blobs/sha256/" + digest.removeprefix("sha256:"))
    assert "sha256:" + hashlib.sha256(content).hexdigest() == digest
    return content


def image(archive: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], bytes]:
    """The index, manifest and config of a one-layer archive, and its uncompressed layer."""
    index = json.loads(read(archive, "index.json"))
    manifest = json.loads(blob(archive, index["manifests"][0]["digest"]))
    config = json.loads(blob(archive, manifest["config"]["digest"]))
    layer = gzip.decompress(blob(archive, manifest["layers"][0]["digest"]))
    return index, manifest, config, layer


def test_the_same_inputs_give_the_same_bytes() -> None:
    first = images.oci_archive(REFERENCE, ENTRIES, CONFIG)
    second = images.oci_archive(REFERENCE, list(reversed(ENTRIES)), CONFIG)
    assert hashlib.sha256(first).digest() == hashlib.sha256(second).digest()


def test_other_content_gives_another_manifest_digest() -> None:
    changed = [images.File("app", b"\x7fELF other", 0o755), *ENTRIES[1:]]
    before, _, _, _ = image(images.oci_archive(REFERENCE, ENTRIES, CONFIG))
    after, _, _, _ = image(images.oci_archive(REFERENCE, changed, CONFIG))
    assert before["manifests"][0]["digest"] != after["manifests"][0]["digest"]


def test_the_archive_is_an_oci_layout_with_a_blob_for_every_descriptor() -> None:
    archive = images.oci_archive(REFERENCE, ENTRIES, CONFIG)
    index, manifest, _, _ = image(archive)
    descriptors = [index["manifests"][0], manifest["config"], *manifest["layers"]]
    blob_names = {"blobs/sha256/" + d["digest"].removeprefix("sha256:") for d in descriptors}
    assert set(members(archive)) == {"oci-layout", "index.json", "blobs", "blobs/sha256"} | (
        blob_names
    )
    assert json.loads(read(archive, "oci-layout")) == {"imageLayoutVersion": "1.0.0"}
    for descriptor in descriptors:
        assert len(blob(archive, descriptor["digest"])) == descriptor["size"]
    assert index["mediaType"] == images.MEDIA_TYPE_INDEX
    assert manifest["mediaType"] == images.MEDIA_TYPE_MANIFEST
    assert manifest["config"]["mediaType"] == images.MEDIA_TYPE_CONFIG
    assert [layer["mediaType"] for layer in manifest["layers"]] == [images.MEDIA_TYPE_LAYER]


def test_the_index_names_the_image_for_ctr_import_with_its_platform() -> None:
    index, _, config, _ = image(images.oci_archive(REFERENCE, ENTRIES, CONFIG))
    [descriptor] = index["manifests"]
    assert descriptor["annotations"] == {
        "org.opencontainers.image.ref.name": REFERENCE,
        "io.containerd.image.name": REFERENCE,
    }
    assert descriptor["platform"] == {"architecture": config["architecture"], "os": "linux"}


def test_the_config_carries_the_runtime_fields_and_the_layers_diff_id() -> None:
    _, _, config, layer = image(images.oci_archive(REFERENCE, ENTRIES, CONFIG))
    assert config["config"] == {
        "Entrypoint": ["/app", "--serve"],
        "Cmd": ["--port", "80"],
        "Env": ["PATH=/usr/bin", "MODE=test"],
        "User": "65532:65532",
        "WorkingDir": "/work",
    }
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()],
    }


def test_the_layer_keeps_symlinks_and_modes_with_root_owner_and_fixed_times() -> None:
    layer = images.layer_tar(ENTRIES)
    found = members(layer)
    assert list(found) == ["app", "bin", "etc", "etc/app", "etc/app/config.json", "tmp"]
    assert found["bin"].issym() and found["bin"].linkname == "usr/bin"
    assert found["tmp"].isdir() and found["tmp"].mode == 0o1777
    assert found["app"].isreg() and found["app"].mode == 0o755
    assert found["etc/app"].isdir() and found["etc/app"].mode == 0o755  # added parent
    assert read(layer, "etc/app/config.json") == b"{}"
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in found.values()} == {
        (0, 0, "", "", 0)
    }


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([images.File("a", b""), images.File("/a", b"")], "twice"),
        ([images.Symlink("bin", "usr/bin"), images.File("bin/sh", b"")], "not a directory"),
        ([images.File("../escape", b"")], "inside the image"),
        ([images.Directory("/")], "inside the image"),
    ],
)
def test_invalid_entries_are_refused(entries: list[images.Entry], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        images.layer_tar(entries)


@pytest.mark.parametrize("reference", ["pause:1", "localhost/pause", "Localhost/x:1"])
def test_a_reference_must_be_full(reference: str) -> None:
    with pytest.raises(ValueError, match="full reference"):
        images.oci_archive(reference, ENTRIES, CONFIG)


def test_writing_the_same_archive_again_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "example.tar"
    written = images.write_oci_archive(path, REFERENCE, ENTRIES, CONFIG)
    assert written == images.ImageArchive(reference=REFERENCE, path=path)
    path.touch()  # a fresh mtime, so that a rewrite would change it even on a coarse clock
    stamp = path.stat().st_mtime_ns
    images.write_oci_archive(path, REFERENCE, ENTRIES, CONFIG)
    assert path.stat().st_mtime_ns == stamp
    assert path.read_bytes() == images.oci_archive(REFERENCE, ENTRIES, CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["example.tar"]  # no temporary left


def test_the_pause_image_runs_its_binary_as_pause(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF static pause")
    archive = images.pause_image(binary, tmp_path / "cache")
    assert archive.reference == images.PAUSE_REFERENCE
    _, _, config, layer = image(archive.path.read_bytes())
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert read(layer, "pause") == b"\x7fELF static pause"
    assert members(layer)["pause"].mode == 0o755


def test_the_pause_image_refuses_what_is_not_a_binary(tmp_path: Path) -> None:
    script = tmp_path / "pause"
    script.write_text("#!/bin/sh\nsleep infinity\n")
    with pytest.raises(images.ImageError, match="not an ELF"):
        images.pause_image(script, tmp_path)


def test_the_trainer_image_is_usr_merge_links_and_empty_directories(tmp_path: Path) -> None:
    archive = images.trainer_image(tmp_path)
    assert archive.reference == images.TRAINER_REFERENCE
    _, _, _, layer = image(archive.path.read_bytes())
    found = members(layer)
    links = {name: m.linkname for name, m in found.items() if m.issym()}
    assert links == {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
    assert {name for name, m in found.items() if m.isreg()} == {"etc/passwd", "etc/group"}
    assert {"usr", "etc", "proc", "sys", "dev", "var/tmp"} <= set(found)
    assert found["tmp"].mode == found["var/tmp"].mode == 0o1777
