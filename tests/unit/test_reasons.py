"""The operator's reasons live in one module (``k8s_rendezvous_operator.reasons``).

Aspects: no other module of the operator names a reason (a CamelCase string constant), so
a reader, the docs' table and the metrics' pre-declared series find them all in one place;
the reasons' groups hold every constant of their prefix.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from k8s_rendezvous_operator import reasons

PACKAGE = Path(reasons.__file__).parent
REASON = re.compile(r"[A-Z][a-z]+(?:[A-Z][a-z]*)+|[A-Z][a-z]+")
NOT_REASONS = ("CONDITION_",)
"""Constants that hold a CamelCase word and are no reason: a condition's type."""


def constants(tree: ast.Module) -> dict[str, str]:
    """The module-level string constants of a module, by name."""
    found = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        value = getattr(node, "value", None)
        if (
            isinstance(target, ast.Name)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            found[target.id] = value.value
    return found


def test_no_module_of_the_operator_but_reasons_names_a_reason() -> None:
    strays = {
        f"{path.name}:{name}"
        for path in PACKAGE.glob("*.py")
        if path.name != "reasons.py"
        for name, value in constants(ast.parse(path.read_text())).items()
        if name.isupper() and REASON.fullmatch(value) and not name.startswith(NOT_REASONS)
    }
    assert not strays, f"reasons outside reasons.py: {sorted(strays)}"


def test_each_group_of_reasons_holds_every_constant_of_its_prefix() -> None:
    for prefix, group in (
        ("LOST_", reasons.LOST_REASONS),
        ("CLOSED_", reasons.CLOSED_REASONS),
        ("REFUSED_", reasons.REFUSED_REASONS),
    ):
        named = {
            value
            for name, value in vars(reasons).items()
            if name.startswith(prefix) and isinstance(value, str)
        }
        assert set(group) == named, prefix
        assert len(group) == len(named), f"{prefix}: a reason listed twice"
