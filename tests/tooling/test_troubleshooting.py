"""docs/troubleshooting.md against the code: its table of reasons names every reason the
operator posts on an Event or sets on a condition and nothing else, and its table of errors
every error the pod side raises.

Aspects: each side found non-empty (a renamed table or module fails here too); a reason or
an error missing from its table, or one the table names that no code has, is named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devkit.paths import REPO
from k8s_rendezvous.wire import statuses
from k8s_rendezvous_operator import reasons

PAGE = REPO / "docs" / "troubleshooting.md"
ERRORS = REPO / "handler" / "k8s_rendezvous" / "errors.py"
REASON = re.compile(r"[A-Z][A-Za-z]+")


def operator_reasons() -> set[str]:
    """Every reason the operator posts on an Event or sets on a condition: reasons.py's,
    a member's losses, closures and refusals included."""
    found = {
        value
        for name, value in vars(reasons).items()
        if name.isupper()
        and not name.startswith("CAUSE_")  # a round's cause in status.history, not a reason
        and isinstance(value, str)
        and REASON.fullmatch(value)
    }
    # Ready's reason while a round forms is the state itself.
    found |= {statuses.RoundState.FORMING.value, statuses.RoundState.REFORMING.value}
    return found


def pod_side_errors() -> dict[str, set[str]]:
    """The error classes handler/k8s_rendezvous/errors.py defines, each with the names of
    its bases (read, not imported: importing it imports torch)."""
    tree = ast.parse(ERRORS.read_text())
    return {
        node.name: {base.id for base in node.bases if isinstance(base, ast.Name)}
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def first_column(heading: str, page: Path = PAGE) -> set[str]:
    """The names in backquotes in the first column of the table under ``heading``."""
    text = page.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            names |= set(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_the_reasons_table_names_every_reason_the_operator_posts_and_no_other() -> None:
    posted = operator_reasons()
    documented = first_column("By reason")
    assert len(posted) > 40 and documented
    assert not posted - documented, (
        f"reasons missing from {PAGE.name}: {sorted(posted - documented)}"
    )
    assert not documented - posted, (
        f"{PAGE.name} names reasons no code posts: {sorted(documented - posted)}"
    )


def test_the_errors_table_names_every_error_of_the_pod_side_and_no_other() -> None:
    errors = pod_side_errors()
    raised = set(errors)
    torchs = set().union(*errors.values())  # the torch error each is, named beside it
    documented = {
        name for name in first_column("Errors torchrun's agent gets") if name.endswith("Error")
    }
    assert len(raised) > 8 and documented
    assert not raised - documented, (
        f"errors missing from {PAGE.name}: {sorted(raised - documented)}"
    )
    unknown = documented - raised - torchs
    assert not unknown, f"{PAGE.name} names errors errors.py lacks: {sorted(unknown)}"
