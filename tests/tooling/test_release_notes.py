"""The release notes are the CHANGELOG section of the tag's version (hack/release_notes.py):
where a section starts and ends, the tag's leading v, refusing a missing or empty section,
and the real CHANGELOG having notes for the version being released."""

from __future__ import annotations

import pytest
from hack import release_notes, sync_chart

CHANGELOG = """\
# Changelog

Intro.

## [Unreleased]
- not yet

## [0.2.0] - 2027-01-10
### Added
- two

- three

## [0.1.0]
First.

## [0.0.9]

[0.2.0]: https://example.org/compare/v0.1.0...v0.2.0
"""


def test_a_section_runs_from_under_its_heading_to_the_next_heading() -> None:
    assert release_notes.section(CHANGELOG, "0.2.0") == "### Added\n- two\n\n- three\n"


def test_a_tag_names_the_same_section_as_its_version() -> None:
    assert release_notes.section(CHANGELOG, "v0.1.0") == "First.\n"


def test_the_last_section_stops_at_the_link_definitions() -> None:
    text = CHANGELOG.replace("## [0.0.9]\n", "## [0.0.9]\n- old\n")
    assert release_notes.section(text, "0.0.9") == "- old\n"


def test_a_version_is_matched_whole_not_as_a_prefix() -> None:
    with pytest.raises(release_notes.NoNotes, match=r"no section '## \[0.2\]'"):
        release_notes.section(CHANGELOG, "0.2")


def test_an_empty_section_is_refused() -> None:
    with pytest.raises(release_notes.NoNotes, match=r"'## \[0.0.9\]' is empty"):
        release_notes.section(CHANGELOG, "0.0.9")


def test_the_changelog_has_notes_for_the_version_being_released() -> None:
    notes = release_notes.section(release_notes.CHANGELOG.read_text(), sync_chart.version())
    assert notes.strip()


def test_the_command_prints_the_notes_of_the_packages_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert release_notes.main([]) == 0
    assert capsys.readouterr().out == release_notes.section(
        release_notes.CHANGELOG.read_text(), sync_chart.version()
    )
    assert release_notes.main(["v99.0.0"]) == 1
    assert "no section '## [99.0.0]'" in capsys.readouterr().err
