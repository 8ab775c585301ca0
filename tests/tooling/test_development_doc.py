"""docs/development.md's map of the code stays whole: every module of the pod side, the
operator and the dev kit (their subpackages' too) has an entry in the layout at the top,
and no entry names a module that is gone; the count of round rules it gives is the count
rounds.py's docstring numbers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devkit.paths import REPO

DOC = REPO / "docs" / "development.md"
PACKAGES = ("handler/k8s_rendezvous", "operator/k8s_rendezvous_operator", "devkit")
"""The product's two packages and the dev kit: every module of each is named."""
ENTRY = re.compile(r"((?:\w+\.py|\w+/)(?:, (?:\w+\.py|\w+/))*)(?:\s|$)")
"""An entry's names, before its description: modules, or a directory whose own entries
follow, two columns deeper."""


def layout() -> str:
    """The fenced block at the top of the page."""
    text = DOC.read_text()
    start = text.index("```\n") + len("```\n")
    return text[start : text.index("```", start)]


def entries(text: str) -> dict[str, set[str]]:
    """The names each directory of the layout lists, by the directory's path.

    A line at column 0 opens a top-level directory (its first word, e.g. ``devkit/``). A
    line indented at most two columns deeper than the innermost directory open is an entry
    of the nearest directory opened at a smaller indentation, when it starts with names
    (:data:`ENTRY`); an entry naming one directory opens it. Any other line continues a
    description."""
    listed: dict[str, set[str]] = {}
    opened: list[tuple[int, str]] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent == 0:
            opened = [(0, line.split()[0].rstrip("/") + "/")]
            continue
        entry = ENTRY.match(line.strip())
        if entry is None or not opened or indent > opened[-1][0] + 2:
            continue
        while opened[-1][0] >= indent:
            opened.pop()
        names = entry.group(1).split(", ")
        parent = opened[-1][1]
        listed.setdefault(parent, set()).update(names)
        if len(names) == 1 and names[0].endswith("/"):
            opened.append((indent, parent + names[0]))
    return listed


def modules(package: Path) -> dict[str, set[str]]:
    """The modules and subpackages of ``package`` and of each subpackage, by path."""
    found: dict[str, set[str]] = {}
    for directory in [package, *sorted(p.parent for p in package.rglob("*/__init__.py"))]:
        names = {p.name for p in directory.glob("*.py") if p.name != "__init__.py"}
        names |= {p.name + "/" for p in directory.iterdir() if (p / "__init__.py").is_file()}
        found[directory.relative_to(REPO).as_posix() + "/"] = names
    return found


def test_every_module_of_the_product_and_the_dev_kit_has_an_entry() -> None:
    listed = entries(layout())
    for package in PACKAGES:
        for directory, names in modules(REPO / package).items():
            named = listed.get(directory, set())
            assert not names - named, (
                f"docs/development.md: {sorted(names - named)} of {directory} have no entry "
                "in the layout (a line `  name.py  what it does`, under its directory)"
            )
            assert not named - names, (
                f"docs/development.md lists {sorted(named - names)} under {directory}, "
                "which has no such module"
            )


def test_the_layout_reader_sees_nesting_and_shared_entries() -> None:
    text = (
        "pkg/         what it is\n"
        "  a.py, b.py  two at once\n"
        "             a continuation naming c.py, not an entry\n"
        "  g.py one space before its description\n"
        "             c.py at the start of a continuation\n"
        "  sub/       a subpackage\n"
        "    d.py     in it\n"
        "  e.py       back in pkg\n"
        "other/       another\n"
        "  f.py       its own\n"
    )
    assert entries(text) == {
        "pkg/": {"a.py", "b.py", "g.py", "sub/", "e.py"},
        "pkg/sub/": {"d.py"},
        "other/": {"f.py"},
    }


def test_the_count_of_round_rules_is_the_docstrings() -> None:
    rounds = REPO / "operator" / "k8s_rendezvous_operator" / "rounds.py"
    docstring = ast.get_docstring(ast.parse(rounds.read_text())) or ""
    numbers = [int(n) for n in re.findall(r"^(\d+)\. :func:`", docstring, re.MULTILINE)]
    assert numbers == list(range(1, len(numbers) + 1)), f"rounds.py numbers its rules {numbers}"
    said = re.findall(r"rules 1-(\d+)", layout())
    assert said == [str(len(numbers))], (
        f"docs/development.md says rules 1-{' and 1-'.join(said) or 'N nowhere'}; "
        f"rounds.py's docstring numbers {len(numbers)}"
    )
