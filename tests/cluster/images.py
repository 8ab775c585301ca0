"""Container images for the test cluster's real nodes, made on this machine.

No image registry is reachable from where the tests run (only language and Debian package
mirrors are) and there is no Docker engine, so every image a real node runs is made here
and handed to containerd as an OCI image archive, named by the reference its index
carries (``ctr -n k8s.io images import --platform linux/amd64 FILE``):

- **pause** (``PAUSE_REFERENCE``): the pod sandbox's process, the static binary that
  ``tests/cluster/build.sh nodes`` builds from ``images/pause.go``, alone in one layer.
- **trainer** (``TRAINER_REFERENCE``): the smallest honest trainer image. It holds no
  Python, no torch and none of the project: only the usr-merge symlinks (``/bin``,
  ``/lib``, ``/lib64`` and ``/sbin`` into ``/usr``), the empty directories a runtime mounts
  over or a process writes to, and an ``/etc/passwd``. A training pod mounts read-only, by
  hostPath at the same paths, the host's ``/usr`` (C library, shell), the Python
  installation the project's venv was made from, and the repository checkout, which
  holds ``.venv`` with torch and the project; ``trainer_mounts`` gives the pod's
  ``volumes`` and ``volumeMounts``. Why: an image with torch is several GB to download,
  build and unpack per node, while the venv ``make setup`` installed is exactly the
  environment the rest of the suite tests, so the pods run the code under test rather
  than a copy of it. The cost: the image runs only on this host (its paths, its Python),
  which is what a test cluster on one machine is. Files uv hardlinked from its cache need
  nothing more (a hardlink is the file itself); symlinks out of the checkout are mounted.

The pause and trainer archives are written by a small stdlib-only OCI writer
(``write_oci_archive``): one layer, fixed mtimes, sorted entries, owner 0:0, so the same
inputs give the same bytes and digests. Everything is cached under ``default_cache()``
(``$K8S_RDZV_CACHE`` or ``$XDG_CACHE_HOME/k8s-rendezvous``, then ``images``), as
tests/cluster/build.sh does for the binaries:

    python -m tests.cluster.images trainer|pause [--cache DIR]   # prints the path
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeAlias

__all__ = [
    "PAUSE_REFERENCE",
    "TRAINER_REFERENCE",
    "Directory",
    "File",
    "ImageArchive",
    "ImageConfig",
    "ImageError",
    "Symlink",
    "default_cache",
    "layer_tar",
    "oci_archive",
    "pause_image",
    "trainer_image",
    "trainer_mounts",
    "write_oci_archive",
]

CLUSTER_DIR = Path(__file__).resolve().parent

REGISTRY = "localhost/k8s-rendezvous"
"""No registry serves these names: containerd finds them in its own store, where the
import put them, so pods must not pull (imagePullPolicy IfNotPresent or Never)."""
PAUSE_REFERENCE = f"{REGISTRY}/pause:1"
TRAINER_REFERENCE = f"{REGISTRY}/trainer:1"
"""Bump the tag when the trainer image's recipe changes: a node keeps what it imported."""

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

REF_NAME_ANNOTATION = "org.opencontainers.image.ref.name"
CONTAINERD_NAME_ANNOTATION = "io.containerd.image.name"
"""`ctr images import` names an image after this annotation of the index's manifest
descriptor; the OCI one is the standard's. Both carry the full reference."""

MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"

_FULL_REFERENCE = re.compile(
    r"[a-z0-9.-]+(?::[0-9]+)?"  # host[:port]
    r"(?:/[a-z0-9._-]+)+"  # /path
    r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"  # :tag
)


class ImageError(RuntimeError):
    """An image could not be made."""


def _progress(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class ImageArchive:
    """An OCI image archive on disk, ready for ``ctr images import``."""

    reference: str
    """The full name the archive's index gives the image, e.g. ``localhost/x/pause:1``."""
    path: Path


# ---------------------------------------------------------------------------------------
# The OCI writer (stdlib only)


@dataclasses.dataclass(frozen=True)
class File:
    """A regular file in a layer."""

    path: str
    """Its path in the image; a leading ``/`` is optional."""
    data: bytes
    mode: int = 0o644


@dataclasses.dataclass(frozen=True)
class Directory:
    """A directory in a layer (parents of other entries are added as 0755 if missing)."""

    path: str
    mode: int = 0o755
    """With the sticky bit for the world-writable ones (0o1777)."""


@dataclasses.dataclass(frozen=True)
class Symlink:
    """A symbolic link in a layer, kept as a link (``bin -> usr/bin``)."""

    path: str
    target: str


Entry: TypeAlias = File | Directory | Symlink


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """The runtime part of an OCI image config (the fields a kubelet's pod inherits)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = (f"PATH={DEFAULT_PATH}",)
    """A pod's container gets these unless its spec overrides them; PATH is what an
    image without one would make a shell or ``execvp`` guess."""
    user: str = ""
    """``uid:gid``; empty is root."""
    working_dir: str = "/"


def layer_tar(entries: Iterable[Entry]) -> bytes:
    """An uncompressed tar of ``entries``, the same bytes for the same entries.

    Entries are sorted by path (a parent before its children), missing parents are added
    as 0755 directories, and every member has mtime 0 and owner 0:0 without names.

    Raises:
        ValueError: a path is empty, leaves the root, occurs twice or lies under a
            non-directory.
    """
    by_path: dict[str, Entry] = {}
    for entry in entries:
        path = _member_path(entry.path)
        if path in by_path:
            raise ValueError(f"{path!r} occurs twice")
        by_path[path] = entry
    for path in list(by_path):
        parent = posixpath.dirname(path)
        while parent:
            existing = by_path.setdefault(parent, Directory(parent))
            if not isinstance(existing, Directory):
                raise ValueError(f"{path!r} lies under {parent!r}, which is not a directory")
            parent = posixpath.dirname(parent)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(by_path):
            entry = by_path[path]
            info = tarfile.TarInfo(path)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if isinstance(entry, File):
                info.mode = entry.mode
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
                continue
            if isinstance(entry, Directory):
                info.type = tarfile.DIRTYPE
                info.mode = entry.mode
            else:
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                info.mode = 0o777
            tar.addfile(info)
    return buffer.getvalue()


def oci_archive(reference: str, entries: Iterable[Entry], config: ImageConfig) -> bytes:
    """An OCI image layout in a tar: ``oci-layout``, ``index.json`` and ``blobs/sha256/``
    holding one gzip layer of ``entries``, the image config and the manifest.

    The index's one manifest descriptor carries the platform of this machine and
    ``reference`` in both name annotations, so that ``ctr images import`` names it.

    Raises:
        ValueError: ``reference`` is not a full ``host/path:tag`` reference, or an entry
            is invalid (see ``layer_tar``).
    """
    if not _FULL_REFERENCE.fullmatch(reference):
        raise ValueError(f"{reference!r} is not a full reference such as {PAUSE_REFERENCE}")
    layer = layer_tar(entries)
    # mtime=0 and no file name: the gzip header holds nothing that changes between runs.
    compressed = gzip.compress(layer, compresslevel=9, mtime=0)
    image_config: dict[str, Any] = {"Env": list(config.env), "WorkingDir": config.working_dir}
    if config.entrypoint:
        image_config["Entrypoint"] = list(config.entrypoint)
    if config.cmd:
        image_config["Cmd"] = list(config.cmd)
    if config.user:
        image_config["User"] = config.user
    architecture = _architecture()
    config_blob = _canonical_json(
        {
            "architecture": architecture,
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": __name__}],
        }
    )
    manifest = _canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": _descriptor(MEDIA_TYPE_CONFIG, config_blob),
            "layers": [_descriptor(MEDIA_TYPE_LAYER, compressed)],
        }
    )
    index = _canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [
                {
                    **_descriptor(MEDIA_TYPE_MANIFEST, manifest),
                    "platform": {"architecture": architecture, "os": "linux"},
                    "annotations": {
                        REF_NAME_ANNOTATION: reference,
                        CONTAINERD_NAME_ANNOTATION: reference,
                    },
                }
            ],
        }
    )
    files: list[Entry] = [
        File("oci-layout", _canonical_json({"imageLayoutVersion": "1.0.0"})),
        File("index.json", index),
    ]
    for blob in (compressed, config_blob, manifest):
        files.append(File(f"blobs/sha256/{hashlib.sha256(blob).hexdigest()}", blob))
    return layer_tar(files)


def write_oci_archive(
    path: Path, reference: str, entries: Iterable[Entry], config: ImageConfig
) -> ImageArchive:
    """Write ``oci_archive(reference, entries, config)`` to ``path``.

    A file already holding the same bytes is left alone (its mtime too); otherwise the
    new one replaces it atomically, so a node importing the old one meanwhile is not
    disturbed.
    """
    data = oci_archive(reference, entries, config)
    if not (path.is_file() and path.read_bytes() == data):
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, data)
    return ImageArchive(reference=reference, path=path)


def _member_path(path: str) -> str:
    cleaned = posixpath.normpath(path.lstrip("/"))
    if cleaned in ("", ".") or cleaned == ".." or cleaned.startswith("../"):
        raise ValueError(f"{path!r} is not a path inside the image")
    return cleaned


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _descriptor(media_type: str, blob: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}


def _architecture() -> str:
    """This machine's architecture in OCI (Go) terms: the images hold its binaries."""
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(name, 0o644)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise


# ---------------------------------------------------------------------------------------
# pause and trainer


def default_cache() -> Path:
    """tests/cluster/build.sh's cache root (``$K8S_RDZV_CACHE``, else
    ``${XDG_CACHE_HOME:-~/.cache}/k8s-rendezvous``), then ``images``."""
    root = os.environ.get("K8S_RDZV_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"))
        root = os.path.join(root, "k8s-rendezvous")
    return Path(root) / "images"


def pause_image(binary: Path, cache: Path) -> ImageArchive:
    """The pod sandbox image: ``binary`` (static: the image has no C library) as
    ``/pause``, its entrypoint, run as 65535:65535 like the upstream pause image.

    Raises:
        ImageError: ``binary`` is not an ELF executable.
    """
    data = binary.read_bytes()
    if not data.startswith(b"\x7fELF"):
        raise ImageError(f"{binary} is not an ELF binary (build it: tests/cluster/build.sh nodes)")
    return write_oci_archive(
        cache / "pause.tar",
        PAUSE_REFERENCE,
        [File("pause", data, 0o755)],
        ImageConfig(entrypoint=("/pause",), user="65535:65535"),
    )


_TRAINER_ENTRIES: tuple[Entry, ...] = (
    # Debian's usr-merge: the host's binaries name their loader /lib64/ld-linux-x86-64.so.2
    # and its scripts /bin/sh; both resolve into the mounted /usr.
    Symlink("bin", "usr/bin"),
    Symlink("lib", "usr/lib"),
    Symlink("lib64", "usr/lib64"),
    Symlink("sbin", "usr/sbin"),
    Directory("usr"),  # the mount point of the host's /usr
    # Mounted over by the runtime (proc, sysfs, devtmpfs) and by the kubelet (/etc/hosts,
    # resolv.conf, hostname, the service account under /var/run/secrets).
    Directory("dev"),
    Directory("proc"),
    Directory("sys"),
    Directory("etc"),
    Directory("run"),
    Directory("var/run"),
    # Python's tempfile needs one (torch makes a temporary file as it is imported).
    Directory("tmp", 0o1777),
    Directory("var/tmp", 0o1777),
    # Without an entry for the running uid, getpass.getuser() raises (torch names its
    # cache directories after the user); neither the kubelet nor the runtime adds one.
    File(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\n"
        b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    ),
    File("etc/group", b"root:x:0:\nnogroup:x:65534:\n"),
)


def trainer_image(cache: Path) -> ImageArchive:
    """The trainer image: usr-merge links and empty directories only (see the module's
    docstring); pods add the host's userland and the venv with ``trainer_mounts``."""
    return write_oci_archive(
        cache / "trainer.tar",
        TRAINER_REFERENCE,
        _TRAINER_ENTRIES,
        ImageConfig(cmd=("/bin/sh",), env=(f"PATH={DEFAULT_PATH}", "LANG=C.UTF-8")),
    )


def trainer_mounts(repo: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod ``volumes`` and a container's ``volumeMounts`` (Kubernetes' JSON) that give
    a trainer-image container what it runs, read-only at the host's own paths.

    They are: the host's ``/usr``; the Python installation ``repo/.venv`` was made from
    (``sys.base_prefix`` of ``.venv/bin/python``, unless under ``/usr``); the checkout at
    its real path (and at ``repo``'s path too, if that is a symlink: the venv's scripts
    name their interpreter by the path uv saw); and whatever symlinks in ``.venv`` point
    at outside those, such as uv's cache when uv linked the venv with symlinks (the cache
    directory, found by its CACHEDIR.TAG, is mounted whole rather than each file).

    The image's ``/tmp`` is on its root filesystem: a pod with ``readOnlyRootFilesystem``
    needs an emptyDir there (torch makes a temporary file as it is imported).

    Raises:
        ImageError: ``repo`` has no ``.venv/bin/python``, or it does not run.
    """
    checkout = repo.resolve()
    venv_python = checkout / ".venv" / "bin" / "python"
    if not venv_python.exists():
        raise ImageError(f"{venv_python} does not exist: make the venv first (make venv)")
    try:
        proc = subprocess.run(
            [str(venv_python), "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ImageError(f"{venv_python} does not run: {exc}") from exc
    base_prefix = Path(proc.stdout.strip()).resolve()
    interpreter = venv_python.resolve()
    # (volume name, host path, path in the container); names are DNS labels.
    wanted: list[tuple[str, Path, Path]] = [
        ("host-usr", Path("/usr"), Path("/usr")),
        ("host-python", base_prefix, base_prefix),
        ("host-python-binary", interpreter, interpreter),
        ("host-repo", checkout, checkout),
    ]
    given = Path(os.path.abspath(repo))
    if given != checkout:
        wanted.append(("host-repo-link", checkout, given))
    for number, target in enumerate(sorted(_links_leaving(checkout / ".venv", checkout))):
        wanted.append((f"host-venv-link-{number}", target, target))
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    covered: list[Path] = []
    for name, host, inside in wanted:
        if host == inside and any(host.is_relative_to(path) for path in covered):
            continue
        covered.append(inside)
        kind = "Directory" if host.is_dir() else "File"
        volumes.append({"name": name, "hostPath": {"path": str(host), "type": kind}})
        mounts.append({"name": name, "mountPath": str(inside), "readOnly": True})
    return volumes, mounts


def _links_leaving(venv: Path, inside: Path) -> set[Path]:
    """The real targets of the symlinks under ``venv`` that lie outside ``inside``, each
    replaced by the cache directory holding it (one with a CACHEDIR.TAG), if any."""
    found: set[Path] = set()
    pending = [venv]
    while pending:
        with os.scandir(pending.pop()) as listing:
            for item in listing:
                if item.is_symlink():
                    target = Path(os.path.realpath(item.path))
                    if not target.exists() or target.is_relative_to(inside):
                        continue
                    if not any(target.is_relative_to(path) for path in found):
                        found.add(_cache_directory_of(target))
                elif item.is_dir(follow_symlinks=False):
                    pending.append(Path(item.path))
    return found


def _cache_directory_of(path: Path) -> Path:
    for directory in (path, *path.parents):
        if (directory / "CACHEDIR.TAG").is_file():
            return directory
    return path


# ---------------------------------------------------------------------------------------
# command line


def _nodes_pause_binary() -> Path:
    """The pause binary tests/cluster/build.sh nodes built (it builds what is missing)."""
    _progress("locating the nodes' binaries (tests/cluster/build.sh nodes)")
    proc = subprocess.run(
        ["bash", str(CLUSTER_DIR / "build.sh"), "nodes"],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = proc.stdout.split()
    if proc.returncode != 0 or not lines:
        raise ImageError(f"tests/cluster/build.sh nodes failed (exit code {proc.returncode})")
    return Path(lines[-1]) / "pause"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.cluster.images",
        description="Make one of the real nodes' images and print its OCI archive's path.",
    )
    parser.add_argument("image", choices=("trainer", "pause"))
    parser.add_argument("--cache", type=Path, default=default_cache(), help="default: %(default)s")
    parser.add_argument(
        "--binary",
        type=Path,
        help="pause: the static binary (default: tests/cluster/build.sh nodes' pause)",
    )
    args = parser.parse_args(argv)
    try:
        if args.image == "trainer":
            archive = trainer_image(args.cache)
        else:
            archive = pause_image(args.binary or _nodes_pause_binary(), args.cache)
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _progress(f"{archive.reference}")
    print(archive.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
