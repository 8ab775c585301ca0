"""The links of the Markdown files people read (hack/check_links.py): a relative link must
name a file of the repository, and its #anchor a heading there; links in code, and to
other sites, are not its business."""

from __future__ import annotations

from pathlib import Path

from hack import check_links


def repo(tmp_path: Path, readme: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "install.md").write_text("# Install\n\n## The `webhook`'s certificate\n")
    (tmp_path / "LICENSE").write_text("")
    (tmp_path / "README.md").write_text(readme)
    return tmp_path / "README.md"


def test_links_to_files_and_headings_that_exist_pass(tmp_path: Path) -> None:
    readme = repo(
        tmp_path,
        "[install](docs/install.md), [certs](docs/install.md#the-webhooks-certificate), "
        "[LICENSE](LICENSE), [docs](docs/), [site](https://example.org/x.md)\n"
        "[top](#title)\n\n# Title\n\n[ref]: docs/install.md\n",
    )
    assert check_links.broken(readme, tmp_path) == []


def test_a_missing_file_a_missing_heading_and_a_way_out_are_each_reported(tmp_path: Path) -> None:
    readme = repo(
        tmp_path,
        "# Title\n\nSee [gone](docs/gone.md) and\n"
        "![plot](docs/install.md#plots) or [out](../outside.md).\n[ref]: LICENSE.txt\n",
    )
    assert check_links.broken(readme, tmp_path) == [
        "README.md:3: docs/gone.md does not exist",
        "README.md:4: docs/install.md#plots: no heading #plots there",
        "README.md:4: ../outside.md leads out of the repository",
        "README.md:5: LICENSE.txt does not exist",
    ]


def test_links_in_code_are_not_links(tmp_path: Path) -> None:
    readme = repo(tmp_path, "`[a](nowhere.md)`\n\n```\n[b](nowhere.md)\n```\n")
    assert check_links.broken(readme, tmp_path) == []


def test_the_repositorys_own_documents_have_no_broken_link() -> None:
    assert [p for f in check_links.default_files() for p in check_links.broken(f)] == []
