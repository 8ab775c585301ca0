"""What a hostile pod can put in its own Lease, beyond what the API server checks: the
ways of poisoning a node's request that the fuzzer of the pod-written decoders
(tests/unit/test_pod_written_objects.py) explores, each with the problem the operator
names in its ``InvalidEntry`` Warning. The unit tests read them as examples; the security
tests write them with a real pod's token (tests/security/test_poisoned_objects.py)."""

from __future__ import annotations

import dataclasses
import json

from k8s_rendezvous.wire import objects

WELL_FORMED = {
    "instance": "i-1",
    "attempt": 1,
    "addr": "10.0.0.7",
    "storePort": 29500,
    "intent": "Join",
    "probePort": 0,
}
"""A request every field of which reads; a poison changes one thing of it (or all)."""


@dataclasses.dataclass(frozen=True)
class Poison:
    name: str
    entry: str | None
    """The entry annotation's text (``None``: the well-formed one)."""
    problem: str
    """What the operator's Warning says of it (a part of the message: its words, and the
    bounds of ``k8s_rendezvous.wire`` as users read them)."""
    instance: str = "i-1"
    """The instance annotation (its heartbeat's)."""

    def annotations(self, addr: str) -> dict[str, str]:
        """The Lease's annotations, the request offering ``addr`` where it has one."""
        entry = self.entry or json.dumps(WELL_FORMED | {"addr": addr})
        return {
            objects.ENTRY_ANNOTATION: entry.replace(WELL_FORMED["addr"], addr),
            objects.INSTANCE_ANNOTATION: self.instance,
        }


def _with(**fields: object) -> str:
    return json.dumps(WELL_FORMED | fields)


POISONS = (
    # Deeper than json's recursion: used to raise RecursionError (issue 55).
    Poison("brackets", "[" * 10_000, "nested more than 4 deep"),
    Poison("objects", '{"a":' * 2_000 + "1" + "}" * 2_000, "nested more than"),
    # Within json's recursion, beyond the entry's own bounds.
    Poison("nested", _with(healthCheck=[[[[[]]]]]), "nested more than"),
    Poison("values", _with(healthCheck=list(range(100))), "more than 64 values"),
    Poison(
        "long",
        _with(instance="i" * 16_384),
        "long, more than 16384",
    ),
    Poison(
        "digits", _with(attempt=0).replace('"attempt": 0', '"attempt": ' + "9" * 5000), "not JSON"
    ),
    Poison("not-an-object", "[]", "expected an object, got list"),
    Poison(
        "nan", _with(attempt=0).replace('"attempt": 0', '"attempt": NaN'), "expected an integer"
    ),
    Poison("surrogate", _with(instance="\ud800"), "not valid UTF-8"),
    Poison("intent", _with(intent={"Join": [1]}), "is not one of"),
    Poison(
        "instance-annotation", None, "annotation k8s-rendezvous.dev/instance", instance="x" * 300
    ),
)
