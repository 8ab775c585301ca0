"""``spec``: what the user (or the operator, from a Job's annotations) asked of a
Rendezvous, its pod selector included."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous.wire import codec, tunables


class SelectorOperator(enum.Enum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


@dataclasses.dataclass(frozen=True)
class LabelRequirement:
    key: str
    operator: SelectorOperator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator is SelectorOperator.EXISTS:
            return self.key in labels
        if self.operator is SelectorOperator.DOES_NOT_EXIST:
            return self.key not in labels
        inside = self.key in labels and labels[self.key] in self.values
        return inside if self.operator is SelectorOperator.IN else not inside


@dataclasses.dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector (``matchLabels`` and ``matchExpressions``), as in a
    Deployment's ``spec.selector``: every term must hold."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.match_labels) and all(
            requirement.matches(labels) for requirement in self.match_expressions
        )

    def __str__(self) -> str:
        terms = [f"{key}={value}" for key, value in self.match_labels]
        for requirement in self.match_expressions:
            values = ",".join(requirement.values)
            terms.append(f"{requirement.key} {requirement.operator.value} ({values})")
        return ", ".join(terms)

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.match_labels:
            result["matchLabels"] = dict(self.match_labels)
        if self.match_expressions:
            result["matchExpressions"] = [
                {"key": r.key, "operator": r.operator.value}
                | ({"values": list(r.values)} if r.values else {})
                for r in self.match_expressions
            ]
        return result

    @classmethod
    def from_dict(cls, value: object, field: str) -> LabelSelector:
        data = codec.mapping(value, field)
        labels = codec.mapping(data.get("matchLabels") or {}, f"{field}.matchLabels")
        for key, label in labels.items():
            if not isinstance(label, str):
                raise codec.DecodeError(
                    f"{field}.matchLabels.{key}: expected a string, got {label!r}"
                )
        requirements = []
        for index, item in enumerate(codec.listed(data, "matchExpressions", field)):
            where = f"{field}.matchExpressions[{index}]"
            term = codec.mapping(item, where)
            operator = codec.enumerated(SelectorOperator, term, "operator", where)
            values = tuple(codec.listed(term, "values", where))
            if not all(isinstance(v, str) for v in values):
                raise codec.DecodeError(f"{where}.values: expected strings, got {list(values)!r}")
            with_values = operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
            if with_values != bool(values):
                need = "needs values" if with_values else "takes no values"
                raise codec.DecodeError(f"{where}: operator {operator.value} {need}")
            requirements.append(
                LabelRequirement(codec.string(term, "key", where), operator, values)
            )
        selector = cls(tuple(sorted(labels.items())), tuple(requirements))
        if not selector.match_labels and not selector.match_expressions:
            raise codec.DecodeError(
                f"{field}: an empty selector would match every pod; name labels"
            )
        return selector


def _tunables(data: Mapping[str, Any], field: str) -> dict[str, Any]:
    """Each of :data:`tunables.SPEC_TUNABLES` by its attribute; one unset by default stays unset."""
    return {
        tunable.attribute: codec.integer(
            data,
            tunable.field,
            field,
            default=tunable.default,
            minimum=tunable.minimum,
            maximum=tunable.maximum,
        )
        for tunable in tunables.SPEC_TUNABLES
        if tunable.default is not None or data.get(tunable.field) is not None
    }


@dataclasses.dataclass(frozen=True)
class RendezvousSpec:
    """``spec``: what the user (or the operator, from a Job's annotations) asked for."""

    min_nodes: int
    max_nodes: int
    run_id: str
    join_timeout_seconds: int = tunables.DEFAULT_JOIN_TIMEOUT_SECONDS
    last_call_timeout_seconds: int = tunables.DEFAULT_LAST_CALL_TIMEOUT_SECONDS
    close_timeout_seconds: int = tunables.DEFAULT_CLOSE_TIMEOUT_SECONDS
    heartbeat_timeout_seconds: int = tunables.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    rank_order_node_label: str | None = None
    """Order newcomers by this label of their Kubernetes node (e.g. a zone or rack), so
    that neighbours in the ring are neighbours in the network."""
    pod_selector: LabelSelector | None = None
    """Which pods may join, for a Rendezvous that no workload controls (made by hand)."""
    max_restarts: int | None = None
    """The job's restart budget: re-forms caused by a failure that may follow the first
    round, whichever node failed (``None``: no budget, as with torch's c10d, where only
    each agent's own ``--max-restarts`` bounds its restarts)."""
    spares: int | None = None
    """How many nodes the workload means to keep waiting beyond a full round (``None``:
    none declared, and nothing is reported about them)."""

    @property
    def heartbeat_interval_seconds(self) -> float:
        """How often a node renews its Lease: three renewals fit in one timeout."""
        return self.heartbeat_timeout_seconds / 3

    def to_dict(self) -> dict[str, Any]:
        order = (
            {}
            if self.rank_order_node_label is None
            else {"rankOrder": {"nodeLabel": self.rank_order_node_label}}
        )
        selector = {} if self.pod_selector is None else {"podSelector": self.pod_selector.to_dict()}
        return (
            order
            | selector
            | {
                "minNodes": self.min_nodes,
                "maxNodes": self.max_nodes,
                "runId": self.run_id,
            }
            | {
                tunable.field: value
                for tunable in tunables.SPEC_TUNABLES
                if (value := getattr(self, tunable.attribute)) is not None
            }
        )

    @classmethod
    def from_dict(cls, value: object, field: str = "spec") -> RendezvousSpec:
        data = codec.mapping(value, field)
        spec = cls(
            min_nodes=codec.integer(data, "minNodes", field, minimum=1),
            max_nodes=codec.integer(data, "maxNodes", field, minimum=1),
            run_id=codec.string(data, "runId", field),
            **_tunables(data, field),
            rank_order_node_label=(
                None
                if data.get("rankOrder") is None
                else codec.string(
                    codec.mapping(data["rankOrder"], f"{field}.rankOrder"),
                    "nodeLabel",
                    f"{field}.rankOrder",
                )
            ),
            pod_selector=(
                None
                if data.get("podSelector") is None
                else LabelSelector.from_dict(data["podSelector"], f"{field}.podSelector")
            ),
        )
        if spec.min_nodes > spec.max_nodes:
            raise codec.DecodeError(
                f"{field}: minNodes ({spec.min_nodes}) must not exceed maxNodes ({spec.max_nodes})"
            )
        return spec
