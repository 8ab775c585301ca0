"""Container images for the test cluster's real nodes, made on this machine.

No image registry is reachable from where the tests run (only language and Debian package
mirrors are) and there is no Docker engine, so every image a real node runs is made here
and handed to containerd as an OCI image archive, named by the reference its index
carries (``ctr -n k8s.io images import --platform linux/amd64 FILE``):

- **pause** (``PAUSE_REFERENCE``): the pod sandbox's process, the static binary that
  ``devkit/cluster/build.sh nodes`` builds from ``images/pause.go``, alone in one layer.
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
- **operator** (``operator_image``): the project's Dockerfile, as users build it, but by
  buildah (daemonless) FROM a Debian bookworm base made here with mmdebstrap in place of
  ``python:3.11-slim-bookworm``. Its reference is keyed by its inputs:
  ``localhost/k8s-rendezvous/operator:<12 hex digits>``.

The pause and trainer archives are written by a small stdlib-only OCI writer
(``write_oci_archive``): one layer, fixed mtimes, sorted entries, owner 0:0, so the same
inputs give the same bytes and digests. Everything is cached under ``default_cache()``
(``$K8S_RDZV_CACHE`` or ``$XDG_CACHE_HOME/k8s-rendezvous``, then ``images``), as
devkit/cluster/build.sh does for the binaries:

    python -m devkit.cluster.images operator|trainer|pause [--cache DIR]   # prints the path
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeAlias

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
    "operator_image",
    "pause_image",
    "trainer_image",
    "trainer_mounts",
    "write_oci_archive",
]

REPO = Path(__file__).resolve().parents[2]
CLUSTER_DIR = Path(__file__).resolve().parent

REGISTRY = "localhost/k8s-rendezvous"
"""No registry serves these names: containerd finds them in its own store, where the
import put them, so pods must not pull (imagePullPolicy IfNotPresent or Never)."""
PAUSE_REFERENCE = f"{REGISTRY}/pause:1"
TRAINER_REFERENCE = f"{REGISTRY}/trainer:1"
"""Bump the tag when the trainer image's recipe changes: a node keeps what it imported."""
OPERATOR_REPOSITORY = f"{REGISTRY}/operator"
BASE_REPOSITORY = f"{REGISTRY}/python-base"

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
    """An image could not be made; the message says which step and names its log."""


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
    """devkit/cluster/build.sh's cache root (``$K8S_RDZV_CACHE``, else
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
        raise ImageError(f"{binary} is not an ELF binary (build it: devkit/cluster/build.sh nodes)")
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
# operator: the project's Dockerfile, built by buildah from a base made with mmdebstrap

_DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
_BASE_RECIPE: dict[str, Any] = {
    # What python:3.11-slim-bookworm is for the Dockerfile: Debian bookworm, a Python 3.11
    # (Debian's 3.11.2 here, the official image builds the newest 3.11 into /usr/local),
    # `python` and `pip` on PATH, and a pip allowed to install into the system (the
    # official image has no EXTERNALLY-MANAGED marker; Debian's would refuse the
    # Dockerfile's `pip install uv`). python-is-python3 provides `python`; python3-pip
    # provides `pip`.
    "suite": "bookworm",
    "variant": "minbase",
    "sources": list(_DEBIAN_SOURCES),
    "packages": ["python3", "python3-pip", "python3-venv", "ca-certificates", "python-is-python3"],
    # Like Debian's slim images: no documentation beyond the copyright files.
    "dpkg_options": [
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/info/*",
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
    ],
    # Merged /usr by symlinks, as Debian's own images are made, rather than by the
    # usrmerge package that bookworm's init-system-helpers would pull in with perl
    # (50 MB the slim image does not have).
    "hook_dirs": ["/usr/share/mmdebstrap/hooks/merged-usr"],
    "hooks": [
        'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
        # mmdebstrap copies the host's; a runtime provides its own.
        'rm -f "$1/etc/hostname" "$1/etc/resolv.conf"',
    ],
    # A runtime makes /dev; the official images ship it empty.
    "tar_filter": ["--path-exclude=/dev/*"],
    "config": {"env": [f"PATH={DEFAULT_PATH}", "LANG=C.UTF-8"], "cmd": ["python3"]},
}

# The build's own inputs besides the base and the build context: change this when the
# build command changes what it makes.
_BUILD_RECIPE = "buildah bud --isolation=chroot --layers=false --format=oci; CA by volume; v1"

# uv, in the Dockerfile's RUN steps, trusts only its bundled roots unless told to use the
# system's; a system-level uv.toml, mounted for the build only, says so (uv reads
# /etc/uv/uv.toml). The image built is the same as without it.
_UV_SYSTEM_CONFIG = (
    "# Mounted by devkit/cluster/images.py for the build only.\nsystem-certs = true\n"
)
_IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def operator_image(repo: Path, cache: Path) -> ImageArchive:
    """The operator image built from ``repo``'s Dockerfile, as an OCI archive.

    Steps, each timed on stderr with its tools' output in ``cache/logs/<step>.log``:
    install buildah and mmdebstrap from Debian if missing; make the base (once per
    recipe): a bookworm rootfs by mmdebstrap, imported into buildah's storage under
    ``cache/buildah`` (vfs: nothing under /var/lib/containers is used) as
    ``localhost/k8s-rendezvous/python-base:bookworm-<key>``; ``buildah bud
    --pull=never --build-arg PYTHON_IMAGE=<that base>``; ``buildah push`` to an
    oci-archive whose index names the image for containerd.

    The result is keyed by the Dockerfile, the files its .dockerignore admits and both
    recipes: an unchanged tree returns the archive made before, without running anything.

    The RUN steps reach PyPI through this machine's TLS proxy: during the build only, the
    host's CA bundle (``$SSL_CERT_FILE``, else /etc/ssl/certs/ca-certificates.crt) is
    mounted over the image's, which Debian's pip reads, and a uv.toml turns on uv's use
    of it; the image keeps Debian's bundle.

    Raises:
        ImageError: a step failed (the message names its log, whose end is on stderr).
    """
    repo = repo.resolve()
    cache = cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".operator.lock"):
        base_key = _recipe_key(_BASE_RECIPE)
        key = _operator_key(repo, base_key)
        reference = f"{OPERATOR_REPOSITORY}:{key[:12]}"
        path = cache / f"operator-{key[:12]}.tar"
        if path.is_file():
            _progress(f"operator image {reference}: cached in {path}")
            return ImageArchive(reference=reference, path=path)
        began = time.monotonic()
        steps = _Steps(cache / "logs")
        _install_tools(steps)
        buildah = _buildah_command(cache)
        base = _base_image(steps, buildah, cache, base_key)
        with steps.step("bud", f"building {reference} from {repo / 'Dockerfile'}") as step:
            build_dir = cache / "build"
            build_dir.mkdir(exist_ok=True)
            uv_config = build_dir / "uv.toml"
            uv_config.write_text(_UV_SYSTEM_CONFIG)
            host_bundle = Path(os.environ.get("SSL_CERT_FILE") or _IMAGE_CA_BUNDLE)
            volumes = [f"{uv_config}:/etc/uv/uv.toml:ro"]
            if host_bundle.is_file():
                volumes.append(f"{host_bundle.resolve()}:{_IMAGE_CA_BUNDLE}:ro")
            step.run(
                *buildah,
                "bud",
                "--pull=never",
                # No container runtime needed (the nodes' runc is built separately), and
                # the RUN steps share the host's network, so they reach PyPI as it does.
                "--isolation=chroot",
                "--layers=false",
                "--format=oci",
                # Not --timestamp: it would set every file's mtime, so the .pyc files
                # compiled in the build would no longer match their sources and Python
                # would recompile them at every start (the root filesystem is read-only).
                "--build-arg",
                f"PYTHON_IMAGE={base}",
                "--build-arg",
                f"VERSION={_project_version(repo)}",
                *(arg for volume in volumes for arg in ("--volume", volume)),
                "--file",
                str(repo / "Dockerfile"),
                "--tag",
                reference,
                str(repo),
            )
        with steps.step("push", f"exporting {reference} to {path}") as step:
            partial = cache / f".{path.name}.partial"
            partial.unlink(missing_ok=True)
            step.run(*buildah, "push", reference, f"oci-archive:{partial}:{reference}")
            added = _complete_index(partial, reference)
            if added:
                step.note(f"added to index.json's manifest descriptor: {', '.join(added)}")
            os.replace(partial, path)
            # The archive is the cache: keep neither this image nor older archives.
            step.run(*buildah, "rmi", reference, check=False)
            for old in cache.glob("operator-*.tar"):
                if old != path:
                    old.unlink()
        _progress(f"operator image {reference} made in {time.monotonic() - began:.0f} s: {path}")
        return ImageArchive(reference=reference, path=path)


def _project_version(repo: Path) -> str:
    """k8s_rendezvous.__version__ of ``repo`` (read, not imported: it may be another tree)."""
    init = (repo / "handler" / "k8s_rendezvous" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', init, re.MULTILINE)
    if match is None:
        raise ImageError(f"no __version__ in {repo / 'handler' / 'k8s_rendezvous' / '__init__.py'}")
    return match.group(1)


def _install_tools(steps: _Steps) -> None:
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if not missing:
        return
    with steps.step("apt", f"installing {' '.join(missing)} (Debian packages)") as step:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        if step.run(*install, env=env, check=False) != 0:
            step.note("the install failed; updating the package lists and trying again")
            step.run("apt-get", "update", "-q", env=env)
            step.run(*install, env=env)


def _buildah_command(cache: Path) -> list[str]:
    """buildah with its storage under the cache: nothing global is read or written."""
    storage = cache / "buildah"
    return [
        "buildah",
        "--root",
        str(storage / "root"),
        "--runroot",
        str(storage / "run"),
        "--storage-driver",
        "vfs",
    ]


def _base_image(steps: _Steps, buildah: list[str], cache: Path, key: str) -> str:
    """The local stand-in for python:3.11-slim-bookworm, made once per recipe."""
    reference = f"{BASE_REPOSITORY}:bookworm-{key[:12]}"
    if (
        subprocess.run(
            [*buildah, "inspect", "--type", "image", reference],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        ).returncode
        == 0
    ):
        return reference
    rootfs = cache / "base" / f"bookworm-{key[:12]}.tar"
    if not rootfs.is_file():
        rootfs.parent.mkdir(parents=True, exist_ok=True)
        with steps.step("mmdebstrap", f"making a Debian bookworm rootfs ({rootfs})") as step:
            raw = rootfs.with_name(f".{rootfs.name}.raw")
            filtered = rootfs.with_name(f".{rootfs.name}.partial")
            recipe = _BASE_RECIPE
            step.run(
                "mmdebstrap",
                "--mode=root",
                "--format=tar",  # the name does not end in .tar
                f"--variant={recipe['variant']}",
                f"--include={','.join(recipe['packages'])}",
                *(f"--dpkgopt={option}" for option in recipe["dpkg_options"]),
                *(f"--hook-dir={directory}" for directory in recipe["hook_dirs"]),
                *(f"--customize-hook={hook}" for hook in recipe["hooks"]),
                recipe["suite"],
                str(raw),
                *recipe["sources"],
            )
            try:
                with raw.open("rb") as source, filtered.open("wb") as target:
                    step.run("mmtarfilter", *recipe["tar_filter"], stdin=source, stdout=target)
                os.replace(filtered, rootfs)
            finally:
                raw.unlink(missing_ok=True)
                filtered.unlink(missing_ok=True)
    with steps.step("base", f"importing the rootfs into buildah as {reference}") as step:
        container = f"k8s-rdzv-base-{key[:12]}"
        step.run(*buildah, "rm", container, check=False)  # left by an interrupted import
        step.run(*buildah, "from", "--name", container, "scratch")
        step.run(*buildah, "add", container, str(rootfs), "/")
        config = _BASE_RECIPE["config"]
        step.run(
            *buildah,
            "config",
            *(arg for env in config["env"] for arg in ("--env", env)),
            "--cmd",
            json.dumps(config["cmd"]),
            container,
        )
        step.run(*buildah, "commit", "--rm", "--format=oci", container, reference)
        # Older bases (another recipe) are only disk space now.
        for name in step.output(*buildah, "images", "--format", "{{.Name}}:{{.Tag}}").split():
            if name.startswith(f"{BASE_REPOSITORY}:") and name != reference:
                step.run(*buildah, "rmi", name, check=False)
        for old in rootfs.parent.glob("bookworm-*.tar"):
            if old != rootfs:
                old.unlink()
    return reference


def _complete_index(archive: Path, reference: str) -> list[str]:
    """Make the index's manifest descriptor carry what ``ctr images import --platform``
    reads: both name annotations (buildah writes only the OCI one) and the platform
    (buildah writes none; it is the config's). Rewrites ``archive`` if something was
    missing and returns what was added.

    Raises:
        ImageError: the index does not hold exactly one manifest.
    """
    with tarfile.open(archive) as tar:

        def blob(name: str) -> Any:
            stream = tar.extractfile(name)
            if stream is None:
                raise ImageError(f"{archive}: {name} is not a file")
            return json.load(stream)

        index = blob("index.json")
        manifests = index.get("manifests") or []
        if len(manifests) != 1:
            raise ImageError(f"{archive}: index.json should list one manifest: {manifests}")
        descriptor = manifests[0]
        added: list[str] = []
        annotations = descriptor.setdefault("annotations", {})
        for name in (REF_NAME_ANNOTATION, CONTAINERD_NAME_ANNOTATION):
            if annotations.get(name) != reference:
                annotations[name] = reference
                added.append(name)
        if "platform" not in descriptor:
            manifest = blob(_blob_path(descriptor["digest"]))
            config = blob(_blob_path(manifest["config"]["digest"]))
            descriptor["platform"] = {"architecture": config["architecture"], "os": config["os"]}
            added.append("platform")
    if not added:
        return added
    data = json.dumps(index, separators=(",", ":")).encode()
    rewritten = archive.with_name(f"{archive.name}.rewritten")
    with tarfile.open(archive) as source, tarfile.open(rewritten, "w") as target:
        for item in source:
            if item.name == "index.json":
                replacement = copy.copy(item)
                replacement.size = len(data)
                target.addfile(replacement, io.BytesIO(data))
            else:
                target.addfile(item, source.extractfile(item) if item.isreg() else None)
    os.replace(rewritten, archive)
    return added


def _blob_path(digest: str) -> str:
    algorithm, _, encoded = digest.partition(":")
    return f"blobs/{algorithm}/{encoded}"


def _recipe_key(recipe: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical_json(recipe)).hexdigest()


def _operator_key(repo: Path, base_key: str) -> str:
    """sha256 of what the image is made from: the Dockerfile, every file of the build
    context (what .dockerignore admits: its path, mode and content), both recipes."""
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    add("build", _BUILD_RECIPE.encode())
    add("base", base_key.encode())
    add("Dockerfile", (repo / "Dockerfile").read_bytes())
    for relative in _build_context(repo):
        path = repo / relative
        if path.is_symlink():
            add(f"link {relative}", os.readlink(path).encode())
        else:
            add(f"file {relative} {path.stat().st_mode & 0o777:o}", path.read_bytes())
    return digest.hexdigest()


def _build_context(repo: Path) -> list[str]:
    """The files (relative POSIX paths, sorted) that ``repo``'s .dockerignore admits.

    Docker's rules as this repository uses them: patterns in order, the last that matches
    a path or one of its parents decides, ``!`` admits again; ``*`` and ``?`` stay within
    one path component, ``**`` spans any number.

    Raises:
        ImageError: a pattern uses syntax this reader does not implement ([...] or \\).
    """
    rules: list[tuple[bool, re.Pattern[str], str]] = []
    ignore_file = repo / ".dockerignore"
    lines = ignore_file.read_text().splitlines() if ignore_file.is_file() else []
    for line in lines:
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        admits = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip()
        if "[" in pattern or "\\" in pattern:
            raise ImageError(f"{ignore_file}: {pattern!r} uses syntax images.py does not read")
        pattern = posixpath.normpath(pattern.lstrip("/"))
        literal = re.split(r"[*?]", pattern, maxsplit=1)[0]
        rules.append((admits, _ignore_pattern(pattern), literal))

    def admitted(relative: str) -> bool:
        candidates = [relative]
        parent = posixpath.dirname(relative)
        while parent:
            candidates.append(parent)
            parent = posixpath.dirname(parent)
        verdict = True
        for admits, regex, _ in rules:
            if any(regex.fullmatch(candidate) for candidate in candidates):
                verdict = admits
        return verdict

    def may_admit_below(directory: str) -> bool:
        prefix = directory + "/"
        return any(
            admits and (literal.startswith(prefix) or prefix.startswith(literal))
            for admits, _, literal in rules
        )

    files: list[str] = []
    pending = [""]
    while pending:
        directory = pending.pop()
        with os.scandir(repo / directory) as listing:
            for item in listing:
                relative = posixpath.join(directory, item.name) if directory else item.name
                if item.is_dir(follow_symlinks=False):
                    if admitted(relative) or may_admit_below(relative):
                        pending.append(relative)
                elif admitted(relative):
                    files.append(relative)
    return sorted(files)


def _ignore_pattern(pattern: str) -> re.Pattern[str]:
    parts: list[str] = []
    position = 0
    while position < len(pattern):
        if pattern.startswith("**/", position):
            parts.append("(?:.*/)?")
            position += 3
        elif pattern.startswith("**", position):
            parts.append(".*")
            position += 2
        elif pattern[position] == "*":
            parts.append("[^/]*")
            position += 1
        elif pattern[position] == "?":
            parts.append("[^/]")
            position += 1
        else:
            parts.append(re.escape(pattern[position]))
            position += 1
    return re.compile("".join(parts))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build at a time per cache (parallel test sessions share it)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _CommandFailed(Exception):
    def __init__(self, args: Sequence[str], returncode: int) -> None:
        super().__init__(f"{shlex.join(args)} exited with {returncode}")


class _Step:
    """Runs one step's commands with their output appended to the step's log."""

    def __init__(self, log: IO[str]) -> None:
        self._log = log

    def note(self, message: str) -> None:
        self._log.write(f"# {message}\n")
        self._log.flush()

    def run(
        self,
        *args: str,
        stdin: IO[bytes] | None = None,
        stdout: IO[bytes] | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> int:
        self._log.write(f"$ {shlex.join(args)}\n")
        self._log.flush()
        proc = subprocess.run(
            args,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=stdout if stdout is not None else self._log,
            stderr=self._log,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise _CommandFailed(args, proc.returncode)
        return proc.returncode

    def output(self, *args: str) -> str:
        self._log.write(f"$ {shlex.join(args)}\n")
        self._log.flush()
        proc = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
        self._log.write(proc.stderr)
        if proc.returncode != 0:
            raise _CommandFailed(args, proc.returncode)
        return proc.stdout


class _Steps:
    """One progress line per step on stderr (what, then how long); the tools' output in
    ``logs/<step>.log``, whose end is shown when the step fails (as build.sh does)."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs

    @contextlib.contextmanager
    def step(self, name: str, what: str) -> Iterator[_Step]:
        self._logs.mkdir(parents=True, exist_ok=True)
        file = self._logs / f"{name}.log"
        began = time.monotonic()
        _progress(f"{what} (output: {file})")
        try:
            with file.open("w") as log:
                yield _Step(log)
        except (_CommandFailed, OSError) as exc:
            _progress(f"{what} failed after {time.monotonic() - began:.0f} s; the end of {file}:")
            with contextlib.suppress(OSError):
                print(
                    "".join(file.read_text(errors="replace").splitlines(True)[-40:]),
                    file=sys.stderr,
                )
            raise ImageError(f"{what} failed: {exc} (log: {file})") from exc
        _progress(f"{what}: done in {time.monotonic() - began:.0f} s")


# ---------------------------------------------------------------------------------------
# command line


def _nodes_pause_binary() -> Path:
    """The pause binary devkit/cluster/build.sh nodes built (it builds what is missing)."""
    _progress("locating the nodes' binaries (devkit/cluster/build.sh nodes)")
    proc = subprocess.run(
        ["bash", str(CLUSTER_DIR / "build.sh"), "nodes"],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = proc.stdout.split()
    if proc.returncode != 0 or not lines:
        raise ImageError(f"devkit/cluster/build.sh nodes failed (exit code {proc.returncode})")
    return Path(lines[-1]) / "pause"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.cluster.images",
        description="Make one of the real nodes' images and print its OCI archive's path.",
    )
    parser.add_argument("image", choices=("operator", "trainer", "pause"))
    parser.add_argument("--cache", type=Path, default=default_cache(), help="default: %(default)s")
    parser.add_argument(
        "--binary",
        type=Path,
        help="pause: the static binary (default: devkit/cluster/build.sh nodes' pause)",
    )
    parser.add_argument("--repo", type=Path, default=REPO, help="operator: default: %(default)s")
    args = parser.parse_args(argv)
    try:
        if args.image == "operator":
            archive = operator_image(args.repo, args.cache)
        elif args.image == "trainer":
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
