"""A Job's rendezvous annotations, parsed and checked (pure).

A Job opts in with ``k8s-rendezvous.dev/nodes`` in torchrun's own form (``"4"`` or
``"2:4"``); every other key under the prefix is optional. A malformed or contradictory
annotation yields :class:`AnnotationError`\\ s that name the key, the value and the accepted
forms, and no resource is made from it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from k8s_rendezvous.wire import objects, specs, tunables

PREFIX: Final = f"{objects.GROUP}/"
NODES: Final = f"{PREFIX}nodes"
TUNABLES: Final = {f"{PREFIX}{t.annotation}": t for t in tunables.SPEC_TUNABLES}
"""The annotation of each tunable of the spec."""
SPARES: Final = f"{PREFIX}spares"
RUN_ID: Final = f"{PREFIX}run-id"
RANK_ORDER: Final = f"{PREFIX}rank-order"
AGENT_SETTINGS: Final = {f"{PREFIX}{s.annotation}": s for s in tunables.AGENT_SETTINGS}
"""Annotations that are the pods' agents' to read, not the Rendezvous': each is given to
the Job's pods as its variable (``--rdzv-conf`` wins over it)."""


def _accepted(tunable: tunables.SpecTunable) -> str:
    if tunable.in_seconds:
        example = f'"{tunable.default}" or "{tunable.default}s"'
    else:
        example = f'"{tunable.default or 10}"'
    most = "" if tunable.maximum is None else f" and at most {tunable.maximum}"
    default = "none" if tunable.default is None else tunable.default
    return (
        f"{tunable.unit}, e.g. {example}, at least {tunable.minimum}{most} (default {default}): "
        f"{tunable.meaning}"
    )


ACCEPTED: Final = {
    NODES: 'a node count "N" or a range "MIN:MAX" (torchrun --nnodes), 1 <= MIN <= MAX <= 100000',
    **{key: _accepted(t) for key, t in TUNABLES.items()},
    RUN_ID: "torchrun's --rdzv-id, 1 to 253 printable ASCII characters without spaces "
    "(default: the Job's name)",
    RANK_ORDER: 'a node label key to group ranks by, e.g. "topology.kubernetes.io/zone"',
    **{
        key: f"the pods' --rdzv-conf {s.conf_key} (given to them as {s.env}): {s.meaning}"
        for key, s in AGENT_SETTINGS.items()
    },
}
"""Every annotation we read, with its accepted forms: the one table the docs show."""

# ASCII digits only: Python's \d and int() also take Arabic-Indic and full-width digits.
_SECONDS = re.compile(r"^ *([0-9]{1,9}) *s? *\Z")
_COUNT = re.compile(r"^ *([0-9]{1,10}) *\Z")
_NODES = re.compile(r"^ *([0-9]{1,6}) *(?:: *([0-9]{1,6}) *)?\Z")
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z"
)
_LABEL_KEY_MAX = 253 + 1 + 63
_RUN_ID = re.compile(r"^[!-~]{1,253}\Z")
"""Printable ASCII without spaces: it becomes PET_RDZV_ID and torch's store key prefix."""
MAX_NODES: Final = 100_000
"""The CRD's bound on minNodes and maxNodes."""


def agent_env(annotations: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables a Job's annotations give its pods' agents (:data:`AGENT_SETTINGS`), as
    written: :func:`parse` has checked them (a Job with errors gets no Rendezvous, and its
    pods no env)."""
    return tuple(
        (setting.env, annotations[key])
        for key, setting in AGENT_SETTINGS.items()
        if key in annotations
    )


@dataclasses.dataclass(frozen=True)
class AnnotationError:
    key: str
    value: str
    problem: str

    @property
    def message(self) -> str:
        accepted = ACCEPTED.get(self.key, "one of: " + ", ".join(sorted(ACCEPTED)))
        return f"annotation {self.key}={self.value!r}: {self.problem}; accepted: {accepted}"


def parse(
    annotations: Mapping[str, str], *, job_name: str, parallelism: int | None
) -> specs.RendezvousSpec | tuple[AnnotationError, ...] | None:
    """The Rendezvous spec a Job asks for, its errors, or ``None`` if it did not opt in."""
    ours = {key: value for key, value in annotations.items() if key.startswith(PREFIX)}
    if not ours:
        return None
    errors: list[AnnotationError] = [
        AnnotationError(key, value, "unknown key")
        for key, value in ours.items()
        if key not in ACCEPTED
    ]
    raw_nodes = ours.get(NODES)
    bounds: tuple[int, int] | None = None
    if raw_nodes is None:
        errors.append(AnnotationError(NODES, "", "missing: it opts the Job in"))
    elif (match := _NODES.match(raw_nodes)) is None:
        errors.append(AnnotationError(NODES, raw_nodes, "not a count or a range"))
    else:
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if not 1 <= low <= high <= MAX_NODES:
            errors.append(
                AnnotationError(NODES, raw_nodes, f"needs 1 <= MIN <= MAX <= {MAX_NODES}")
            )
        elif parallelism is not None and low > parallelism:
            errors.append(
                AnnotationError(
                    NODES, raw_nodes, f"MIN is above the Job's parallelism ({parallelism})"
                )
            )
        else:
            bounds = (low, high)

    def number(key: str, tunable: tunables.SpecTunable) -> int | None:
        raw = ours.get(key)
        if raw is None:
            return tunable.default
        match = (_SECONDS if tunable.in_seconds else _COUNT).match(raw)
        value = None if match is None else int(match.group(1))
        if (
            value is None
            or value < tunable.minimum
            or (tunable.maximum is not None and value > tunable.maximum)
        ):
            most = "" if tunable.maximum is None else f" and <= {tunable.maximum}"
            errors.append(
                AnnotationError(
                    key, raw, f"not a whole number of {tunable.unit} >= {tunable.minimum}{most}"
                )
            )
            return tunable.default
        return value

    def text(key: str, valid: Callable[[str], bool], problem: str) -> str | None:
        raw = ours.get(key)
        if raw is not None and not valid(raw):
            errors.append(AnnotationError(key, raw, problem))
        return raw

    tuned: dict[str, Any] = {t.attribute: number(key, t) for key, t in TUNABLES.items()}
    beyond = 0 if bounds is None or parallelism is None else parallelism - bounds[1]
    if SPARES not in ours and beyond > 0:
        # A Job's pods beyond MAX wait as spares: they are its declaration.
        tuned["spares"] = beyond
    run_id = text(RUN_ID, lambda v: bool(_RUN_ID.match(v)), "not a run id")
    rank_order = text(
        RANK_ORDER,
        lambda v: len(v) <= _LABEL_KEY_MAX and bool(_LABEL_KEY.match(v)),
        "not a label key",
    )
    for key, setting in AGENT_SETTINGS.items():
        if (raw := ours.get(key)) is not None:
            try:
                setting.parse(raw)
            except ValueError as error:
                errors.append(AnnotationError(key, raw, str(error)))
    if problem := objects.rendezvous_name_problem(job_name):
        errors.append(
            AnnotationError(NODES, raw_nodes or "", f"the Job's name {problem}: rename the Job")
        )
    if errors or bounds is None:
        return tuple(errors)
    return specs.RendezvousSpec(
        min_nodes=bounds[0],
        max_nodes=bounds[1],
        run_id=run_id or job_name,
        rank_order_node_label=rank_order,
        **tuned,
    )
