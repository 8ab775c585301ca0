"""Print the CHANGELOG.md section of one version: the notes of its forge release.

    python -m hack.release_notes            # the section of k8s_rendezvous.__version__
    python -m hack.release_notes v0.1.0     # of a tag (the leading v is dropped)

The section is what stands under its heading ``## [0.1.0]`` (Keep a Changelog; a date may
follow the heading) up to the next ``## `` heading or the link definitions at the end.
Exits 1 when there is no such section or it is empty: a release must say what it has.
"""

from __future__ import annotations

import argparse
import re
import sys

from hack import sync_chart

CHANGELOG = sync_chart.REPO / "CHANGELOG.md"


class NoNotes(Exception):
    """The changelog has no section, or only an empty one, for that version."""


def section(changelog: str, version: str) -> str:
    """The body of ``version``'s section of a Keep a Changelog text, without its heading.

    Raises:
        NoNotes: No heading ``## [version]``, or nothing under it.
    """
    version = version.removeprefix("v")
    heading = re.compile(rf"^## \[{re.escape(version)}\](?:\s|$)")
    lines = changelog.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if heading.match(line)), None)
    if start is None:
        raise NoNotes(f"CHANGELOG.md has no section '## [{version}]'")
    body: list[str] = []
    for line in lines[start:]:
        # The next version's heading, or the link definitions ("[0.1.0]: https://...").
        if line.startswith("## ") or re.match(r"^\[[^\]]+\]:\s", line):
            break
        body.append(line)
    notes = "\n".join(body).strip("\n")
    if not notes.strip():
        raise NoNotes(f"CHANGELOG.md's section '## [{version}]' is empty")
    return notes + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "version", nargs="?", default=None, help="default: k8s_rendezvous.__version__"
    )
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(section(CHANGELOG.read_text(), args.version or sync_chart.version()))
    except NoNotes as error:
        print(f"release_notes: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
