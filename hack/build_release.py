"""Build what a release publishes, and check it; publish nothing.

    python -m hack.build_release        # a dry run, in a temporary directory (make test)
    python -m hack.build_release --tag v0.1.0 --out dist \\
        --image-repository ghcr.io/OWNER/k8s-rendezvous-operator       # the release workflow

- ``--tag`` must be ``v`` + ``k8s_rendezvous.__version__``: one version, everywhere.
- ``uv build`` makes the sdist, then the wheel from it (so a file missing from the sdist
  fails here) into ``OUT/python/``. The wheel must be of this version, hold only the two
  packages, each with its ``py.typed``, and declare the two entry points users rely on:
  ``torchrun.handlers`` ``kubernetes`` (torchrun finds the backend by it) and the
  ``k8s-rendezvous-operator`` script.
- ``helm package`` makes ``OUT/chart/k8s-rendezvous-VERSION.tgz`` at this version and
  appVersion, from a copy of the chart whose ``image.repository`` is
  ``--image-repository`` when given (the published chart pulls the published image).

uv comes from ``--uv`` (a command; default: ``uv`` on the PATH, else ``python3 -m uv``),
helm from ``--helm``, ``$HELM`` or devkit/cluster/build.sh, as for hack/sync_chart.py.
"""

from __future__ import annotations

import argparse
import configparser
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import yaml
from hack import chart_readme, sync_chart

REPO = sync_chart.REPO
DISTRIBUTION = "k8s_rendezvous"
PACKAGES = ("k8s_rendezvous", "k8s_rendezvous_operator")
ENTRY_POINTS = {
    "torchrun.handlers": {"kubernetes": "k8s_rendezvous.plugin:handler_creator"},
    "console_scripts": {"k8s-rendezvous-operator": "k8s_rendezvous_operator.__main__:main"},
}


class Refused(Exception):
    """What was built (or the tag) is not what a release may publish."""


def check_tag(tag: str, version: str) -> None:
    if tag != f"v{version}":
        raise Refused(
            f"tag {tag} is not v + k8s_rendezvous.__version__ ({version}): change "
            "handler/k8s_rendezvous/__init__.py and run hack/sync_chart.py, or tag v" + version
        )


def check_wheel(wheel: Path, version: str) -> None:
    expected = f"{DISTRIBUTION}-{version}-py3-none-any.whl"
    if wheel.name != expected:
        raise Refused(f"built {wheel.name}, expected {expected}")
    info = f"{DISTRIBUTION}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        tops = {name.split("/", 1)[0] for name in names}
        if tops != {*PACKAGES, info}:
            raise Refused(f"{wheel.name} holds {sorted(tops)}, not only {[*PACKAGES, info]}")
        for package in PACKAGES:
            if f"{package}/py.typed" not in names:
                raise Refused(f"{wheel.name} has no {package}/py.typed")
        if f"{info}/licenses/LICENSE" not in names:
            raise Refused(f"{wheel.name} has no LICENSE")
        declared = configparser.ConfigParser(delimiters=("=",))
        declared.optionxform = str  # type: ignore[assignment, method-assign]  # keep names' case
        declared.read_string(archive.read(f"{info}/entry_points.txt").decode())
        metadata = archive.read(f"{info}/METADATA").decode()
    for group, points in ENTRY_POINTS.items():
        for name, target in points.items():
            found = declared.get(group, name, fallback=None)
            if found != target:
                raise Refused(f"{wheel.name}: entry point [{group}] {name} = {found}, not {target}")
            module = target.split(":")[0].replace(".", "/")
            if f"{module}.py" not in names:
                raise Refused(f"{wheel.name}: entry point {name} names {module}.py, not in it")
    if not re.search(rf"(?m)^Version: {re.escape(version)}$", metadata):
        raise Refused(f"{wheel.name}: METADATA is not of version {version}")


def check_sdist(sdist: Path, version: str) -> None:
    expected = f"{DISTRIBUTION}-{version}.tar.gz"
    if sdist.name != expected:
        raise Refused(f"built {sdist.name}, expected {expected}")
    root = f"{DISTRIBUTION}-{version}"
    with tarfile.open(sdist) as archive:
        names = set(archive.getnames())
    for path in ("LICENSE", "README.md", "pyproject.toml", *(f"{p}/py.typed" for p in PACKAGES)):
        if not any(name == f"{root}/{path}" or name.endswith(f"/{path}") for name in names):
            raise Refused(f"{sdist.name} has no {path}")


def with_image_repository(values: str, repository: str) -> str:
    """values.yaml with ``image.repository`` replaced (comments and layout kept)."""
    changed, count = re.subn(
        r"(?m)^(image:\n(?:(?:  [^\n]*)?\n)*?  repository: )[^\n]*$",
        lambda match: match.group(1) + repository,
        values,
        count=1,
    )
    if count != 1:
        raise Refused("values.yaml has no image.repository to set")
    return changed


def check_chart(package: Path, version: str, repository: str | None) -> None:
    expected = f"k8s-rendezvous-{version}.tgz"
    if package.name != expected:
        raise Refused(f"packaged {package.name}, expected {expected}")
    with tarfile.open(package) as archive:

        def read(name: str) -> str:
            member = archive.extractfile(f"k8s-rendezvous/{name}")
            if member is None:
                raise Refused(f"{package.name} has no {name}")
            return member.read().decode()

        metadata, values, readme = read("Chart.yaml"), read("values.yaml"), read("README.md")
    chart = yaml.safe_load(metadata)  # as helm wrote it, not as in the repository
    for key in ("version", "appVersion"):
        if chart.get(key) != version:
            raise Refused(f"{package.name}: Chart.yaml's {key} is {chart.get(key)}, not {version}")
    if repository and f"  repository: {repository}\n" not in values:
        raise Refused(f"{package.name}: image.repository is not {repository}")
    if readme != chart_readme.render(values):
        raise Refused(f"{package.name}: README.md does not describe its values.yaml")


def run(command: list[str], what: str) -> None:
    began = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Refused(f"{shlex.join(command)} failed:\n{done.stderr}{done.stdout}")
    print(f"[release] {what} in {time.monotonic() - began:.1f} s", file=sys.stderr)


def build(out: Path, *, uv: list[str], helm: str, repository: str | None) -> list[Path]:
    version = sync_chart.version()
    python, charts = out / "python", out / "chart"
    run([*uv, "build", "--out-dir", str(python), str(REPO)], "uv build: sdist, then wheel")
    (wheel,) = python.glob("*.whl")
    (sdist,) = python.glob("*.tar.gz")
    check_wheel(wheel, version)
    check_sdist(sdist, version)
    with tempfile.TemporaryDirectory() as scratch:
        chart = Path(scratch) / "k8s-rendezvous"
        shutil.copytree(sync_chart.CHART, chart)
        if repository:
            values = with_image_repository((chart / "values.yaml").read_text(), repository)
            (chart / "values.yaml").write_text(values)
            (chart / "README.md").write_text(chart_readme.render(values))
        package = [helm, "package", str(chart), "--version", version, "--app-version", version]
        run([*package, "--destination", str(charts)], "helm package")
    (tgz,) = charts.glob("*.tgz")
    check_chart(tgz, version, repository)
    return [sdist, wheel, tgz]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tag", help="the release's tag: must be v + __version__")
    parser.add_argument("--out", type=Path, help="keep the results here (default: a dry run)")
    parser.add_argument("--image-repository", help="the chart's image.repository")
    parser.add_argument("--uv", help="the uv command (default: uv, else python3 -m uv)")
    parser.add_argument("--helm", help="the helm binary (default: $HELM or build.sh's)")
    args = parser.parse_args(argv)
    uv = shlex.split(args.uv) if args.uv else (["uv"] if shutil.which("uv") else [])
    uv = uv or ["python3", "-m", "uv"]
    try:
        if args.tag is not None:
            check_tag(args.tag, sync_chart.version())
        helm = sync_chart.find_helm(args.helm)
        if args.out:
            built = build(args.out, uv=uv, helm=helm, repository=args.image_repository)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                built = build(Path(scratch), uv=uv, helm=helm, repository=args.image_repository)
    except Refused as error:
        print(f"build_release: {error}", file=sys.stderr)
        return 1
    for path in built:
        print(path.name if not args.out else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
