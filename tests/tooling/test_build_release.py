"""What a release may publish (hack/build_release.py): the tag equal to the version, a wheel
with both packages' py.typed and the entry points torchrun and users rely on, and the
published chart pointing at the published image. `make test` builds the real ones."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from hack import build_release, sync_chart

INFO = "k8s_rendezvous-1.2.3.dist-info"
ENTRY_POINTS = """\
[console_scripts]
k8s-rendezvous-operator = k8s_rendezvous_operator.__main__:main

[torchrun.handlers]
kubernetes = k8s_rendezvous.plugin:handler_creator
"""
FILES = {
    "k8s_rendezvous/__init__.py": "",
    "k8s_rendezvous/plugin.py": "",
    "k8s_rendezvous/py.typed": "",
    "k8s_rendezvous_operator/__main__.py": "",
    "k8s_rendezvous_operator/py.typed": "",
    f"{INFO}/METADATA": "Metadata-Version: 2.4\nName: k8s-rendezvous\nVersion: 1.2.3\n",
    f"{INFO}/entry_points.txt": ENTRY_POINTS,
    f"{INFO}/licenses/LICENSE": "Apache License",
}


def wheel(directory: Path, **changes: str | None) -> Path:
    """A wheel of version 1.2.3 with FILES, some replaced (a path's / written as __)."""
    files = {**FILES, **{k.replace("__", "/"): v for k, v in changes.items()}}
    path = directory / "k8s_rendezvous-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            if content is not None:
                archive.writestr(name, content)
    return path


def test_a_wheel_with_both_packages_typed_and_both_entry_points_passes(tmp_path: Path) -> None:
    build_release.check_wheel(wheel(tmp_path), "1.2.3")


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"k8s_rendezvous_operator__py.typed": None}, "no k8s_rendezvous_operator/py.typed"),
        (
            {f"{INFO}__entry_points.txt": ENTRY_POINTS.replace("kubernetes =", "k8s =")},
            r"\[torchrun.handlers\] kubernetes = None",
        ),
        ({"k8s_rendezvous__plugin.py": None}, "names k8s_rendezvous/plugin.py, not in it"),
        ({"tests__test_x.py": ""}, r"holds \['k8s_rendezvous', "),
        ({f"{INFO}__licenses__LICENSE": None}, "has no LICENSE"),
    ],
    ids=["untyped-operator", "no-torchrun-backend", "entry-point-to-nothing", "stray", "license"],
)
def test_a_wheel_users_could_not_rely_on_is_refused(
    tmp_path: Path, changes: dict[str, str | None], error: str
) -> None:
    with pytest.raises(build_release.Refused, match=error):
        build_release.check_wheel(wheel(tmp_path, **changes), "1.2.3")


def test_a_wheel_of_another_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(build_release.Refused, match=r"expected k8s_rendezvous-1\.2\.4-py3"):
        build_release.check_wheel(wheel(tmp_path), "1.2.4")


def test_only_the_tag_of_the_version_may_be_released() -> None:
    build_release.check_tag("v1.2.3", "1.2.3")
    for tag in ("1.2.3", "v1.2.4", "v1.2.3-rc1"):
        with pytest.raises(build_release.Refused, match=r"is not v \+ k8s_rendezvous"):
            build_release.check_tag(tag, "1.2.3")


def test_the_published_chart_pulls_the_published_image_and_keeps_its_comments() -> None:
    values = (sync_chart.CHART / "values.yaml").read_text()
    published = build_release.with_image_repository(values, "ghcr.io/o/k8s-rendezvous-operator")
    changed = [
        (old, new)
        for old, new in zip(values.splitlines(), published.splitlines(), strict=True)
        if old != new
    ]
    assert changed == [
        ("  repository: k8s-rendezvous-operator", "  repository: ghcr.io/o/k8s-rendezvous-operator")
    ]
