"""Check the relative links of the Markdown files people read in the repository: each must
name a file or directory that exists in it, and a ``#heading`` of a Markdown file one of
its headings. `make lint` runs it; `mkdocs build --strict` checks the links between the
pages of docs/ too, but not README.md and the other files at the top.

    python -m hack.check_links [FILE ...]      # default: README.md, CONTRIBUTING.md,
                                               # SECURITY.md, CHANGELOG.md, docs/*.md and
                                               # the chart's README
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
DEFINITION = re.compile(r"^\s*\[[^\]]+\]:\s+(?P<target>\S+)")


def default_files() -> list[Path]:
    top = [REPO / name for name in ("README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md")]
    return [
        *top,
        *sorted((REPO / "docs").glob("**/*.md")),
        REPO / "charts/k8s-rendezvous/README.md",
    ]


def slug(heading: str) -> str:
    """A heading's anchor as the forge makes it: lower case, punctuation dropped, spaces to
    hyphens (mkdocs' toc makes the same for the headings used here)."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(markdown: str, *, spans: bool = False) -> list[tuple[int, str]]:
    """The numbered lines outside fenced code blocks, with code spans blanked (unless
    ``spans``: a heading's code is part of its anchor)."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line if spans else re.sub(r"`[^`]*`", "``", line)))
    return lines


def anchors(markdown: str) -> set[str]:
    headings = (line for _, line in prose(markdown, spans=True) if re.match(r"#{1,6} ", line))
    return {slug(heading.lstrip("#")) for heading in headings}


def broken(path: Path, repo: Path = REPO) -> list[str]:
    """``file:line: why`` for each relative link of ``path`` that leads nowhere."""
    found: list[str] = []
    markdown = path.read_text()
    for number, line in prose(markdown):
        targets = [m["target"] for m in LINK.finditer(line)]
        if definition := DEFINITION.match(line):
            targets.append(definition["target"])
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:: not this check's business
            where = f"{path.relative_to(repo)}:{number}"
            name, _, anchor = target.partition("#")
            resolved = (path.parent / name).resolve() if name else path
            if not resolved.is_relative_to(repo):
                found.append(f"{where}: {target} leads out of the repository")
            elif not resolved.exists():
                found.append(f"{where}: {target} does not exist")
            elif (
                anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text())
            ):
                found.append(f"{where}: {target}: no heading #{anchor} there")
    return found


def main(argv: list[str]) -> int:
    files = [Path(arg).resolve() for arg in argv] or default_files()
    problems = [problem for path in files for problem in broken(path)]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
