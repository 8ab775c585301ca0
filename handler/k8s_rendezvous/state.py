"""The wire format of the ``Rendezvous`` resource, shared by the operator and the pods.

Every type here is a frozen dataclass with an explicit camelCase codec: ``to_dict()`` gives
the JSON the API server stores, ``from_dict()`` reads it back and raises
:class:`DecodeError` naming the offending field. Nothing is pickled: anyone allowed to
patch the status could otherwise make every pod run code of their choosing.

This module imports only the standard library: the operator image has no torch and the
pod side must stay cheap to import.

One writer per object and field:

* a node's Lease ``<rendezvous>.<pod>`` -- its heartbeat and its :class:`NodeEntry`
  (annotation ``k8s-rendezvous.dev/entry``), written only by that pod. Every node writes
  its own object, so joins never contend for one resource's optimistic write;
* the Rendezvous status -- written only by the operator, which alone seals rounds;
* the RendezvousSlices of a large rendezvous (``status.slices`` > 0) -- written only by the
  operator after each status write: the round as the nodes of one slice need it, so that
  each node receives about :data:`SLICE_MEMBERS` members of a sealed round, not all of them.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import ipaddress
import json
import math
import re
import shlex
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, TypeGuard

SCHEMA_VERSION: Final = 1
"""Version of the status layout; bumped on any incompatible change."""

GROUP: Final = "k8s-rendezvous.dev"
VERSION: Final = "v1alpha1"
PLURAL: Final = "rendezvous"
KIND: Final = "Rendezvous"
API_VERSION: Final = f"{GROUP}/{VERSION}"

SLICE_KIND: Final = "RendezvousSlice"
SLICE_PLURAL: Final = "rendezvousslices"
SLICE_MEMBERS: Final = 100
"""A rendezvous admitting more nodes than this is published in slices of about this many
members. Every node receives every sealed round: whole, that is O(N) bytes per node and
O(N^2) per round (122 MB at 1000 nodes); sliced, about 14 kB per node. Smaller rendezvous
are not sliced: a slice costs one more write after each round change."""

ROUND_KEY_FIELD: Final = "status.roundKey"
"""A selectable field: pods watch with ``status.roundKey!=<last seen>`` so that the API
server sends them only the changes that matter to them (a new round, a stale round, a
close), never another node's join."""

MAX_ROUND: Final = 10**12
"""The CRD's bound on ``status.round``: a round a second for 30,000 years, and far below
the API server's integer limit, so that sealing the next round can always be written."""
MAX_ATTEMPT: Final = 2**31 - 1
"""The CRD's bound on a join request's ``attempt``: far more joins than an agent makes, and
within the API server's integers, so that a pod cannot write one that no status can hold."""
MAX_REFUSED: Final = 16
"""The most refused requests a status names (``status.refused``): enough for every pod of
a misconfigured workload to learn why at once in a small job, and in a large one for the
ones that read first; each refused pod also has its Warning. Bounded, as any pod of the
namespace may write a request to be refused."""
MAX_REFUSAL_MESSAGE: Final = 1024
"""The CRD's bound on the message of a refusal or a round in the history (longer ones are cut)."""
MAX_HEALTH_CHECK_TAIL: Final = 1024
"""The most characters of a failed health check's output a node's entry carries (its
last ones, where a self-test says why it failed): enough for a few lines of an NCCL or
GPU test, and small beside the 256 KiB the API server allows a Lease's annotations."""
MAX_ENTRY_LENGTH: Final = 16384
"""The most characters of a node's entry (:data:`ENTRY_ANNOTATION`): the longest a handler
writes is a Leave with a full health check tail, about 12,600 (1,024 characters, each at
most 12 as JSON escapes it, and the other fields)."""
MAX_ENTRY_DEPTH: Final = 4
"""How deep an entry's objects may nest: it has 2 levels (its health check report is the
second); 2 more leave room for a later version's fields."""
MAX_ENTRY_VALUES: Final = 64
"""The most JSON values an entry may hold: it has about a dozen."""
MAX_INSTANCE: Final = 64
"""The most characters of an agent instance's id (printable ASCII; the handler's are 16)."""
MAX_NAME: Final = 253
"""The most characters of a Kubernetes object's name (a DNS subdomain)."""
MAX_UID: Final = 64
"""The most characters of an object's uid as a pod may mark it (Kubernetes writes 36)."""
MAX_HEALTH_CHECK_SECONDS: Final = 3600
"""The longest health check a node may run before each join (``health_check_timeout``):
an hour covers a long burn-in test; longer would hold a node out of rounds unseen."""
DEFAULT_HEALTH_CHECK_SECONDS: Final = 300
"""Five minutes: a short NCCL all-reduce or GPU burn-in ends well within it, and a check
that hangs (a wedged GPU driver) holds its node out no longer than a join would wait."""
DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS: Final = 30
"""Survivors re-form in tens of milliseconds when a peer's process dies (their
collectives fail at once); 30 s also covers a step's compute between two collectives."""
MAX_HISTORY: Final = 10
"""Sealed rounds kept in ``status.history``, newest last: enough to read a bad hour."""
MAX_EXCLUDED_NODES: Final = 8
"""The most Kubernetes nodes ``status.excludedNodes`` keeps out, newest kept: enough for a
few bad machines, and few enough that a small pool always keeps nodes to schedule on
(each failure past it frees the oldest)."""
EXCLUDED_NODE_TTL: Final = datetime.timedelta(hours=24)
"""How long a node stays out after its last failure: a node repaired overnight comes back
without anyone clearing the list."""
MAX_SLICES: Final = 1000
"""The CRD's bound on ``status.slices``: 100000 nodes (maxNodes' bound) in slices of 100."""

DEFAULT_JOIN_TIMEOUT_SECONDS: Final = 600
DEFAULT_LAST_CALL_TIMEOUT_SECONDS: Final = 30
DEFAULT_CLOSE_TIMEOUT_SECONDS: Final = 30
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS: Final = 30
MIN_HEARTBEAT_TIMEOUT_SECONDS: Final = 3
MAX_RESTARTS: Final = 2**31 - 1
"""The CRD's bound on ``spec.maxRestarts``."""
MAX_SPARES: Final = 100_000
"""The CRD's bound on ``spec.spares``: as many as a round's most nodes."""
CLOSED_RESTARTS_EXHAUSTED: Final = "RestartsExhausted"
"""``status.closedReason`` when a failure found the job's restart budget spent: the job has
failed, so every node ends with ``RendezvousClosedError``, a spare too (not the graceful
exit of a spare that was not needed)."""


@dataclasses.dataclass(frozen=True)
class SpecTunable:
    """One number of a Rendezvous' spec that users tune, described once: the codec, the
    ``--rdzv-conf`` keys, the Job annotations and their checks are derived from
    :data:`SPEC_TUNABLES`, and a test holds the CRD to it."""

    attribute: str
    """The :class:`RendezvousSpec` attribute."""
    field: str
    """The spec's field in the CRD."""
    annotation: str
    """A Job's annotation, after ``k8s-rendezvous.dev/``."""
    conf_key: str | None
    """torchrun's ``--rdzv-conf`` key that means the same as in torch's c10d, if one does
    (the liveness window is c10d's ``keep_alive_interval`` x ``keep_alive_max_attempt``)."""
    default: int | None
    """``None``: unset by default, and then nothing is bounded."""
    minimum: int
    meaning: str
    """What it bounds, and why the default is what it is."""
    unit: str = "seconds"
    maximum: int | None = None
    node_local: bool = False
    """Each node's own deadline, as in torch's c10d: a node's ``--rdzv-conf`` value holds
    for that node whatever the spec says (the spec's is the default)."""

    @property
    def in_seconds(self) -> bool:
        return self.unit == "seconds"


SPEC_TUNABLES: Final = (
    SpecTunable(
        "join_timeout_seconds",
        "joinTimeoutSeconds",
        "join-timeout",
        "join_timeout",
        DEFAULT_JOIN_TIMEOUT_SECONDS,
        1,
        "how long a node waits in next_rendezvous() to be admitted, with no deadline while "
        "it waits as a spare (its round is full); c10d's default, long enough for image "
        "pulls and scheduling",
        node_local=True,
    ),
    SpecTunable(
        "last_call_timeout_seconds",
        "lastCallTimeoutSeconds",
        "last-call-timeout",
        "last_call_timeout",
        DEFAULT_LAST_CALL_TIMEOUT_SECONDS,
        0,
        "after minNodes have joined, how long the operator waits for more before sealing "
        "(a stale round seals as soon as every survivor is back); c10d's default",
    ),
    SpecTunable(
        "close_timeout_seconds",
        "closeTimeoutSeconds",
        "close-timeout",
        "close_timeout",
        DEFAULT_CLOSE_TIMEOUT_SECONDS,
        1,
        "how long set_closed() and shutdown() try to record themselves; c10d's default",
        node_local=True,
    ),
    SpecTunable(
        "heartbeat_timeout_seconds",
        "heartbeatTimeoutSeconds",
        "heartbeat-timeout",
        None,
        DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
        MIN_HEARTBEAT_TIMEOUT_SECONDS,
        "a node whose agent has not renewed its Lease for this long is dropped, member or "
        "waiter (c10d's keep_alive_interval x keep_alive_max_attempt); nodes renew three "
        "times per period (at 1,000 nodes and 30 s, 100 Lease writes a second, which the "
        "API server's default flow control admits), and pod deletion and failure are "
        "noticed at once",
    ),
    SpecTunable(
        "max_restarts",
        "maxRestarts",
        "max-restarts",
        "job_max_restarts",  # not torchrun's --max-restarts, each agent's own budget
        None,
        0,
        "the job's restart budget: how many re-forms after a failure of any node may follow "
        "the first round before the rendezvous closes and every agent ends with "
        "RendezvousClosedError; torchrun's --max-restarts still bounds each agent's own "
        "(default: no budget, as with c10d)",
        unit="restarts",
        maximum=MAX_RESTARTS,
    ),
    SpecTunable(
        "spares",
        "spares",
        "spares",
        "spares",
        None,
        0,
        "how many nodes the workload keeps waiting beyond a full round, each ready to take a "
        "lost member's rank at once; the SparesReady condition says when fewer wait. The "
        "workload makes them, not the operator (default: none declared; for an annotated "
        "Job, its parallelism beyond maxNodes)",
        unit="nodes",
        maximum=MAX_SPARES,
    ),
)
"""Every tunable number of the spec, in the CRD's order."""

NODE_LABEL: Final = f"{GROUP}/rendezvous"
"""On a node's pod (set by the operator) and Lease (set by the node): the Rendezvous name."""
INSTANCE_ANNOTATION: Final = f"{GROUP}/instance"
"""On a node's Lease: the agent instance that renews it."""
ENTRY_ANNOTATION: Final = f"{GROUP}/entry"
"""On a node's Lease: its :class:`NodeEntry` as JSON, the node's request to the operator."""
CLEAR_EXCLUDED_NODES_ANNOTATION: Final = f"{GROUP}/clear-excluded-nodes"
"""On a Rendezvous, an RFC 3339 time: the operator forgets the nodes it keeps out that
failed at or before it (``status.excludedNodes``). The user writes the annotation; the
operator alone writes the status."""
CREATED_BY_ANNOTATION: Final = f"{GROUP}/created-by-pod"
"""On a Rendezvous a pod made (not an annotated Job's): that pod's name. The admission
policy holds it to the creator's token; the operator then sets the Rendezvous' owner to
that pod's controller, as the Pod object says."""
POD_UID_ANNOTATION: Final = f"{GROUP}/pod-uid"
"""On a node's Lease: the uid of the pod that wrote it, from its bound token. The admission
policy holds it to the token's, so the operator can tell the pod that wrote a Lease from a
later pod of the same name (a StatefulSet's, a PyTorchJob's) that has not written yet."""


_RENDEZVOUS_NAME: Final = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")


def rendezvous_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a Rendezvous, else ``None``. It must be a DNS label (at
    most 63 lowercase letters, digits and '-', no dots; the CRD holds the same): it is a
    label value, and a node's Lease ``<rendezvous>.<pod>`` must read one way, while pod
    names may have dots."""
    if _RENDEZVOUS_NAME.match(name):
        return None
    return (
        f"{name!r} cannot name a Rendezvous: it must be a DNS label (at most 63 lowercase "
        "letters, digits and '-', no dots), as a node's Lease <rendezvous>.<pod> must name "
        "one rendezvous and one pod"
    )


_OBJECT_NAME: Final = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z"
)


def is_object_name(text: object) -> TypeGuard[str]:
    """Whether ``text`` can name a pod (or most objects): a DNS subdomain of at most 253
    characters. A name a pod wrote is checked so before it goes into an API path or a
    message: a '/' or '..' in it could otherwise name another object."""
    return isinstance(text, str) and len(text) <= MAX_NAME and bool(_OBJECT_NAME.match(text))


def lease_name(rendezvous: str, node: str) -> str:
    """The name of a node's heartbeat Lease: ``<rendezvous>.<pod>``, shortened with a hash
    when that exceeds the 253 characters of a Kubernetes name. The rendezvous has no dot
    (:func:`rendezvous_name_problem`), so the name reads one way."""
    name = f"{rendezvous}.{node}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    # A DNS subdomain's labels end in an alphanumeric: no "-." or ".." at the cut.
    return f"{name[:236].rstrip('-.')}.{digest}"


def slice_count(max_nodes: int) -> int:
    """How many slices a Rendezvous admitting ``max_nodes`` is published in (0: none)."""
    return 0 if max_nodes <= SLICE_MEMBERS else math.ceil(max_nodes / SLICE_MEMBERS)


def slices_needed(max_nodes: int, nodes: int = 0) -> int:
    """The most slices a Rendezvous can need: as many as ``max_nodes`` fill, or its
    ``nodes`` (members and left behind) if ``maxNodes`` was lowered since. More is a status
    edited by hand: neither side follows it."""
    return slice_count(max(max_nodes, nodes))


def slice_index(node: str, count: int) -> int:
    """The slice that carries pod ``node``'s entries: a stable hash, so that a node knows
    its slice before it has a rank (both sides compute it)."""
    return zlib.crc32(node.encode()) % count


def slice_name(rendezvous: str, index: int) -> str:
    """``<rendezvous>.slice-<index>`` (Rendezvous names have at most 63 characters)."""
    return f"{rendezvous}.slice-{index}"


class DecodeError(ValueError):
    """A stored object does not match the wire format; the message names the field."""


def decode_json(
    text: str | bytes,
    field: str,
    *,
    max_length: int,
    max_depth: int,
    max_values: int | None = None,
) -> object:
    """``text`` as JSON, read only within bounds: at most ``max_length`` characters (bytes,
    for bytes), arrays and objects nested at most ``max_depth`` deep, at most
    ``max_values`` values in all. Text a pod or any other client chose goes through here,
    so that nothing it writes makes a reader raise anything but :class:`DecodeError`, nor
    hold more than the bounds: thousands of ``[`` used to raise ``RecursionError`` out of
    ``json``, which no caller expected (one Lease stopped the operator's start).

    Raises:
        DecodeError: Not JSON, or beyond a bound; the message names ``field`` and the bound.
    """
    if len(text) > max_length:
        unit = "bytes" if isinstance(text, bytes) else "characters"
        raise DecodeError(f"{field}: {len(text)} {unit} long, more than {max_length}")
    try:
        value: object = json.loads(text)
    except RecursionError:  # nested far beyond max_depth: json gave up first
        raise DecodeError(f"{field}: nested more than {max_depth} deep") from None
    except ValueError as error:  # not JSON, not UTF-8, an integer of too many digits
        raise DecodeError(f"{field}: not JSON ({error})") from None
    pending: list[tuple[object, int]] = [(value, 1)]
    values = 0
    while pending:  # a loop, not a recursion: what is walked is the writer's choice
        item, depth = pending.pop()
        values += 1
        if max_values is not None and values > max_values:
            raise DecodeError(f"{field}: more than {max_values} values")
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise DecodeError(f"{field}: nested more than {max_depth} deep")
        pending.extend((child, depth + 1) for child in children)
    return value


def resource_version(obj: Mapping[str, Any]) -> int:
    """``obj``'s resourceVersion as a number, -1 if it has none.

    resourceVersions are opaque, but on every API server backed by etcd they are its
    revisions: comparing them is how a watch event and a write's response of the same
    object are told apart by age.
    """
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", -1))
    except (TypeError, ValueError):
        return -1


def owner_reference(
    api_version: str, kind: str, name: str, uid: str, *, controller: bool = True
) -> dict[str, Any]:
    """An ownerReference that never blocks the owner's deletion: blocking would need
    ``update`` on the owner's finalizers, and nothing we make must outlive its owner."""
    reference: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid}
    if controller:
        reference["controller"] = True
    reference["blockOwnerDeletion"] = False
    return reference


def rendezvous_uid(obj: Mapping[str, Any]) -> str:
    """The uid of the Rendezvous ``obj`` is, or is a slice of (its owner)."""
    metadata = obj.get("metadata") or {}
    if obj.get("kind") != SLICE_KIND:
        return str(metadata["uid"])
    for owner in metadata.get("ownerReferences") or []:
        if owner.get("kind") == KIND and owner.get("uid"):
            return str(owner["uid"])
    raise DecodeError(
        f"metadata.ownerReferences: RendezvousSlice {metadata.get('name')!r} names no "
        "Rendezvous. Slices are written by the k8s-rendezvous operator alone: delete this "
        "one, and the operator writes it anew at the next round change or restart"
    )


class RoundState(str, enum.Enum):
    """Where the rendezvous stands; ``kubectl get rdzv`` shows it."""

    FORMING = "Forming"
    """No round has been sealed yet; nodes are joining the first one."""
    SEALED = "Sealed"
    """``members`` is the current round and every one of them is still there."""
    REFORMING = "Reforming"
    """The sealed round lost a member or nodes wait to be admitted; the next one is forming."""
    CLOSED = "Closed"
    """No further round will be formed."""


def round_key(state: RoundState, round_number: int) -> str:
    """The selectable field (:data:`ROUND_KEY_FIELD`): changes exactly when watching pods
    must look again."""
    if state is RoundState.CLOSED:
        return "Closed"
    return f"{round_number}-{state.value}"


class NodeIntent(str, enum.Enum):
    """What a node asks of the operator in its own entry."""

    JOIN = "Join"
    """Admit me to the next round (``attempt`` identifies this request)."""
    LEAVE = "Leave"
    """I am gone for good (``shutdown()`` of a failed agent); do not count me."""
    FINISH = "Finish"
    """My workers succeeded (``shutdown()`` of an agent that is done): the round's work is
    ending, so no further round forms, and the other members finish theirs."""
    CLOSE = "Close"
    """The job is done (``set_closed()``): close the rendezvous for everyone."""


class HealthCheckOutcome(str, enum.Enum):
    """How a node's health check failed (:class:`HealthCheckReport`)."""

    FAILED = "Failed"
    """It ended with a non-zero exit code (or was killed by a signal)."""
    TIMED_OUT = "TimedOut"
    """It ran past its bound and was killed with its process group."""
    NOT_STARTED = "NotStarted"
    """It could not be started (no such program, not executable)."""


# --------------------------------------------------------------------------------------
# Helpers of the codec.


def format_time(moment: datetime.datetime) -> str:
    """RFC 3339 in UTC with microseconds, the form the API server accepts for date-time."""
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: object, field: str) -> datetime.datetime:
    if not isinstance(text, str):
        raise DecodeError(f"{field}: expected an RFC 3339 time string, got {_shown(text)}")
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as error:
        raise DecodeError(f"{field}: {_shown(text)} is not an RFC 3339 time") from error
    if moment.tzinfo is None:
        raise DecodeError(f"{field}: {_shown(text)} has no time zone")
    return moment


def _mapping(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DecodeError(f"{field}: expected an object, got {type(value).__name__}")
    return value


def _str(
    data: Mapping[str, Any],
    key: str,
    field: str,
    *,
    default: str | None = None,
    max_length: int | None = None,
) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise DecodeError(f"{field}.{key}: expected a string, got {_shown(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:  # JSON's "\ud800": stored otherwise than it was read
        raise DecodeError(f"{field}.{key}: not valid UTF-8 (a lone surrogate)") from None
    if max_length is not None and not 0 < len(value) <= max_length:
        raise DecodeError(f"{field}.{key}: must be 1 to {max_length} characters, got {len(value)}")
    return value


_PRINTABLE: Final = re.compile(r"^[!-~]+\Z")


def _part(value: object) -> Mapping[str, Any]:
    """A part of an object that should be a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def _list_part(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _printable(value: object, max_length: int) -> bool:
    return isinstance(value, str) and len(value) <= max_length and bool(_PRINTABLE.match(value))


def _shown(value: object, limit: int = 80) -> str:
    """``value`` as a message may quote it: its repr, cut."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _canonical_ip(text: str, field: str) -> str:
    """``text`` if it is an IP address as the API server writes pod IPs, so that one
    address is stored, and compared with a pod's, in one form only."""
    try:
        canonical = str(ipaddress.ip_address(text))
    except ValueError:
        raise DecodeError(f"{field}: not an IP address: {_shown(text)}") from None
    if canonical != text:
        raise DecodeError(f"{field}: {_shown(text)} is not in canonical form; write {canonical!r}")
    return canonical


def _int(
    data: Mapping[str, Any],
    key: str,
    field: str,
    *,
    default: int | None = None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{field}.{key}: expected an integer, got {_shown(value)}")
    if value < minimum:
        raise DecodeError(f"{field}.{key}: must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise DecodeError(f"{field}.{key}: must be at most {maximum}, got {value}")
    return value


def _tunables(data: Mapping[str, Any], field: str) -> dict[str, Any]:
    """Each of :data:`SPEC_TUNABLES` by its attribute; one unset by default stays unset."""
    return {
        tunable.attribute: _int(
            data,
            tunable.field,
            field,
            default=tunable.default,
            minimum=tunable.minimum,
            maximum=tunable.maximum,
        )
        for tunable in SPEC_TUNABLES
        if tunable.default is not None or data.get(tunable.field) is not None
    }


def _enum(enum_type: type[enum.Enum], data: Mapping[str, Any], key: str, field: str) -> Any:
    value = data.get(key)
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(member.value) for member in enum_type)
        raise DecodeError(f"{field}.{key}: {_shown(value)} is not one of {allowed}") from None


class Fields:
    """One JSON object of a wire format, read key by key with the checks of this codec:
    each read raises :class:`DecodeError` naming ``<field>.<key>``. For the pod side's other
    records (:mod:`k8s_rendezvous.handoff`), so they decode as strictly as the status."""

    def __init__(self, value: object, field: str) -> None:
        self.data = _mapping(value, field)
        self.field = field

    def integer(self, key: str) -> int:
        """A non-negative integer (``True`` is not one)."""
        return _int(self.data, key, self.field)

    def optional_integer(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.integer(key)

    def string(self, key: str) -> str:
        return _str(self.data, key, self.field)

    def optional_string(self, key: str) -> str | None:
        return None if self.data.get(key) is None else self.string(key)

    def strings(self, key: str) -> tuple[str, ...]:
        """A list of strings, empty when absent."""
        values = _list(self.data, key, self.field)
        for index, value in enumerate(values):
            if type(value) is not str:
                raise DecodeError(
                    f"{self.field}.{key}[{index}]: expected a string, got {_shown(value)}"
                )
        return tuple(values)


# --------------------------------------------------------------------------------------
# Spec.


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
        data = _mapping(value, field)
        labels = _mapping(data.get("matchLabels") or {}, f"{field}.matchLabels")
        for key, label in labels.items():
            if not isinstance(label, str):
                raise DecodeError(f"{field}.matchLabels.{key}: expected a string, got {label!r}")
        requirements = []
        for index, item in enumerate(_list(data, "matchExpressions", field)):
            where = f"{field}.matchExpressions[{index}]"
            term = _mapping(item, where)
            operator = _enum(SelectorOperator, term, "operator", where)
            values = tuple(_list(term, "values", where))
            if not all(isinstance(v, str) for v in values):
                raise DecodeError(f"{where}.values: expected strings, got {list(values)!r}")
            with_values = operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
            if with_values != bool(values):
                need = "needs values" if with_values else "takes no values"
                raise DecodeError(f"{where}: operator {operator.value} {need}")
            requirements.append(LabelRequirement(_str(term, "key", where), operator, values))
        selector = cls(tuple(sorted(labels.items())), tuple(requirements))
        if not selector.match_labels and not selector.match_expressions:
            raise DecodeError(f"{field}: an empty selector would match every pod; name labels")
        return selector


@dataclasses.dataclass(frozen=True)
class RendezvousSpec:
    """``spec``: what the user (or the operator, from a Job's annotations) asked for."""

    min_nodes: int
    max_nodes: int
    run_id: str
    join_timeout_seconds: int = DEFAULT_JOIN_TIMEOUT_SECONDS
    last_call_timeout_seconds: int = DEFAULT_LAST_CALL_TIMEOUT_SECONDS
    close_timeout_seconds: int = DEFAULT_CLOSE_TIMEOUT_SECONDS
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
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
                for tunable in SPEC_TUNABLES
                if (value := getattr(self, tunable.attribute)) is not None
            }
        )

    @classmethod
    def from_dict(cls, value: object, field: str = "spec") -> RendezvousSpec:
        data = _mapping(value, field)
        spec = cls(
            min_nodes=_int(data, "minNodes", field, minimum=1),
            max_nodes=_int(data, "maxNodes", field, minimum=1),
            run_id=_str(data, "runId", field),
            **_tunables(data, field),
            rank_order_node_label=(
                None
                if data.get("rankOrder") is None
                else _str(
                    _mapping(data["rankOrder"], f"{field}.rankOrder"),
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
            raise DecodeError(
                f"{field}: minNodes ({spec.min_nodes}) must not exceed maxNodes ({spec.max_nodes})"
            )
        return spec


# --------------------------------------------------------------------------------------
# Status.


_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def health_check_arguments(command: str) -> tuple[str, ...]:
    """A health check command split as a shell would (it runs without one); none: no check.

    Raises:
        ValueError: It does not split (an unclosed quote), with shlex's reason.
    """
    return tuple(shlex.split(command))


def health_check_seconds(raw: str) -> int:
    """A health check's bound: whole seconds from 1 to :data:`MAX_HEALTH_CHECK_SECONDS`.

    Raises:
        ValueError: Anything else.
    """
    seconds = int(raw) if raw.strip().isascii() and raw.strip().isdigit() else 0
    if not 1 <= seconds <= MAX_HEALTH_CHECK_SECONDS:
        raise ValueError(f"not a number of seconds from 1 to {MAX_HEALTH_CHECK_SECONDS}")
    return seconds


_ON: Final = ("1", "true", "t", "yes", "y")
_OFF: Final = ("0", "false", "f", "no", "n")


def switch(raw: str) -> bool:
    """On or off, in the words torch's ``RendezvousParameters.get_as_bool`` takes.

    Raises:
        ValueError: Any other word.
    """
    word = raw.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(f"not one of {', '.join(_ON)} (on) or {', '.join(_OFF)} (off)")


def positive_seconds(raw: str) -> int:
    """A whole number of seconds, at least 1.

    Raises:
        ValueError: Anything else.
    """
    seconds = int(raw) if raw.strip().isascii() and raw.strip().isdigit() else 0
    if seconds < 1:
        raise ValueError("not a whole number of seconds of at least 1")
    return seconds


@dataclasses.dataclass(frozen=True)
class AgentSetting:
    """A setting of each node's own agent, described once: its ``--rdzv-conf`` key, and
    the Job annotation that gives it to every pod of an annotated Job, through the
    variable :attr:`env` (the webhook sets it; ``--rdzv-conf`` wins over it)."""

    conf_key: str
    default: object
    parse: Callable[[str], object]
    """The value from its text, raising ``ValueError`` with what is wrong."""
    meaning: str
    """What it does, its default and what it costs."""

    @property
    def annotation(self) -> str:
        """After ``k8s-rendezvous.dev/``."""
        return self.conf_key.replace("_", "-")

    @property
    def env(self) -> str:
        return f"K8S_RENDEZVOUS_{self.conf_key.upper()}"


AGENT_SETTINGS: Final = (
    AgentSetting(
        "health_check",
        (),
        health_check_arguments,
        "a command each node runs before every join (split as a shell would, run without "
        "one), e.g. an NCCL or GPU self-test: a node whose check fails (non-zero exit, "
        "timeout, cannot start) joins no round, the operator posts a HealthCheckFailed "
        "Warning with its output's tail, and the agent exits non-zero so that its workload "
        "replaces the pod; none by default",
    ),
    AgentSetting(
        "health_check_timeout",
        DEFAULT_HEALTH_CHECK_SECONDS,
        health_check_seconds,
        "seconds the health check may run before it is killed with its process group "
        f"({DEFAULT_HEALTH_CHECK_SECONDS}, at most {MAX_HEALTH_CHECK_SECONDS})",
    ),
    AgentSetting(
        "in_place",
        False,
        switch,
        "1 to keep the workers running through a change of the world when they re-form in "
        "place through k8s_rendezvous.in_place (torch >= 2.14); 0, the default, restarts "
        "them as torch does",
    ),
    AgentSetting(
        "in_place_loss_timeout",
        DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS,
        positive_seconds,
        "seconds the workers have to re-form in place into a round that lost a member "
        "before the node falls back to torch's restart: the bound on a collective blocked "
        "on a peer whose node was cut off, where shutting its connections down does not "
        "wake it (NCCL); make it longer than a step's longest stretch between two "
        f"collectives ({DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS})",
    ),
    AgentSetting(
        "warm_start",
        False,
        switch,
        "1 to start each worker forked from a process that imported torch once "
        "(k8s_rendezvous.warm, given as the workers' entrypoint: torchrun ... -m "
        "k8s_rendezvous.warm train.py); 0, the default, lets each import torch",
    ),
)
"""Every setting a node's agent takes that an annotated Job can also give all its pods."""
HEALTH_CHECK_ENV: Final = AGENT_SETTINGS[0].env
HEALTH_CHECK_TIMEOUT_ENV: Final = AGENT_SETTINGS[1].env


def printable_tail(text: str, limit: int = MAX_HEALTH_CHECK_TAIL) -> str:
    """The last ``limit`` characters of ``text`` with control characters (but newlines and
    tabs) shown as ``?``: what a pod's output becomes before anyone displays it, so that a
    terminal reading an Event is never driven by escape sequences the pod chose."""
    return _CONTROL.sub("?", text[-limit:] if limit else "")


@dataclasses.dataclass(frozen=True)
class HealthCheckReport:
    """Why a node's health check failed, carried by its Leave (:attr:`NodeEntry.health_check`)
    so that the operator, which alone may post Events, says it where users look."""

    outcome: HealthCheckOutcome
    seconds: float
    """How long it ran, to the millisecond."""
    exit_code: int | None = None
    """Its exit code when it ended by itself (negative: the signal that ended it)."""
    tail: str = ""
    """The last of its output (stdout and stderr), at most :data:`MAX_HEALTH_CHECK_TAIL`
    printable characters."""

    def summary(self) -> str:
        """How the check failed, in one line for errors, logs and Events (its tail apart)."""
        if self.outcome is HealthCheckOutcome.TIMED_OUT:
            how = "did not end within health_check_timeout and was killed"
        elif self.outcome is HealthCheckOutcome.NOT_STARTED:
            how = "could not be started"
        elif self.exit_code is not None and self.exit_code < 0:
            how = f"was killed by signal {-self.exit_code}"
        else:
            how = f"exited with code {self.exit_code}"
        return f"{how} after {self.seconds:.3f} s"

    def to_dict(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "outcome": self.outcome.value,
            "milliseconds": round(self.seconds * 1000),
            "tail": printable_tail(self.tail),
        }
        if self.exit_code is not None:
            report["exitCode"] = self.exit_code
        return report

    @classmethod
    def from_dict(cls, value: object, field: str) -> HealthCheckReport:
        # A pod writes it: every part is bounded and checked, and the tail is shown only
        # as printable text.
        data = _mapping(value, field)
        tail = _str(data, "tail", field, default="")
        if len(tail) > MAX_HEALTH_CHECK_TAIL:
            raise DecodeError(
                f"{field}.tail: must be at most {MAX_HEALTH_CHECK_TAIL} characters, got {len(tail)}"
            )
        exit_code = data.get("exitCode")
        if exit_code is not None and (
            isinstance(exit_code, bool)
            or not isinstance(exit_code, int)
            or not -255 <= exit_code <= 255
        ):
            raise DecodeError(
                f"{field}.exitCode: expected an integer from -255 to 255, got {_shown(exit_code)}"
            )
        milliseconds = _int(
            data, "milliseconds", field, maximum=(MAX_HEALTH_CHECK_SECONDS + 60) * 1000
        )
        return cls(
            outcome=_enum(HealthCheckOutcome, data, "outcome", field),
            seconds=milliseconds / 1000,
            exit_code=exit_code,
            tail=printable_tail(tail),
        )


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """A node's own request, written by that pod alone in its Lease (see
    :data:`ENTRY_ANNOTATION`)."""

    instance: str
    """Identifies one agent process; a restarted agent is a new instance."""
    attempt: int
    """Counts this instance's joins (each ``next_rendezvous()``, and each ask again after a
    missed round); a new value is a new join."""
    addr: str
    """The address other nodes reach this one at (the pod IP unless ``--local-addr``)."""
    store_port: int
    """Port of the TCPStore this node hosts; it serves the round if this node is rank 0."""
    intent: NodeIntent = NodeIntent.JOIN
    probe_port: int = 0
    """The UDP port at ``addr`` where its agent answers the operator's probes
    (:class:`Probe`); 0: it answers none, and only its heartbeats say it lives."""
    health_check: HealthCheckReport | None = None
    """Why this node's health check failed, with a Leave: the node joins no round, and
    the operator says why in a Warning."""

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "instance": self.instance,
            "attempt": self.attempt,
            "addr": self.addr,
            "storePort": self.store_port,
            "intent": self.intent.value,
            "probePort": self.probe_port,
        }
        if self.health_check is not None:  # absent otherwise: entries stay as small as before
            entry["healthCheck"] = self.health_check.to_dict()
        return entry

    @classmethod
    def from_dict(cls, value: object, field: str) -> NodeEntry:
        # Bounded like every string the operator may copy into the status (members).
        data = _mapping(value, field)
        instance = _str(data, "instance", field, max_length=MAX_INSTANCE)
        if not _PRINTABLE.match(instance):
            raise DecodeError(f"{field}.instance: must be printable ASCII, got {_shown(instance)}")
        return cls(
            instance=instance,
            attempt=_int(data, "attempt", field, minimum=1, maximum=MAX_ATTEMPT),
            addr=_canonical_ip(_str(data, "addr", field, max_length=253), f"{field}.addr"),
            store_port=_int(data, "storePort", field, minimum=1, maximum=65535),
            intent=_enum(NodeIntent, data, "intent", field),
            probe_port=_int(data, "probePort", field, default=0, maximum=65535),
            health_check=None
            if data.get("healthCheck") is None
            else HealthCheckReport.from_dict(data["healthCheck"], f"{field}.healthCheck"),
        )

    def to_annotation(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str, field: str) -> NodeEntry:
        data = decode_json(
            text,
            field,
            max_length=MAX_ENTRY_LENGTH,
            max_depth=MAX_ENTRY_DEPTH,
            max_values=MAX_ENTRY_VALUES,
        )
        return cls.from_dict(data, field)


PROBE_NONCE_BYTES: Final = 16


@dataclasses.dataclass(frozen=True)
class Probe:
    """The operator's reachability probe of a member's agent, one UDP datagram each way
    (:data:`NodeEntry.probe_port`): the agent echoes the nonce, so a reply proves the
    agent got this very probe, and no one who did not see it can answer in its stead.

    The request is padded to at least the reply's size, so the agent never sends more
    than it is sent (a spoofed source cannot use it to amplify a flood)."""

    nonce: bytes
    """:data:`PROBE_NONCE_BYTES` random bytes, new for each probe: a nonce vouches for
    one member only, so one member's answer says nothing of another's. The agent only
    echoes it, so how the operator makes it is not part of the format (version 1)."""

    _REQUEST: ClassVar[bytes] = b"k8s-rendezvous.dev/probe/1?"
    _REPLY: ClassVar[bytes] = b"k8s-rendezvous.dev/probe/1!"
    REQUEST_BYTES: ClassVar[int] = 64

    def request(self) -> bytes:
        return (self._REQUEST + self.nonce).ljust(self.REQUEST_BYTES, b"\0")

    def reply(self) -> bytes:
        return self._REPLY + self.nonce

    @classmethod
    def from_request(cls, datagram: bytes) -> Probe | None:
        """The probe a datagram asks for (``None``: not a probe, to be ignored)."""
        if len(datagram) != cls.REQUEST_BYTES or not datagram.startswith(cls._REQUEST):
            return None
        start = len(cls._REQUEST)
        return cls(datagram[start : start + PROBE_NONCE_BYTES])

    @classmethod
    def from_reply(cls, datagram: bytes) -> Probe | None:
        """The probe a datagram answers (``None``: not a reply, to be ignored)."""
        if len(datagram) != len(cls._REPLY) + PROBE_NONCE_BYTES:
            return None
        if not datagram.startswith(cls._REPLY):
            return None
        return cls(datagram[len(cls._REPLY) :])


@dataclasses.dataclass(frozen=True)
class NodeLease:
    """A node's Lease ``<rendezvous>.<pod>``, the one object a pod writes: its heartbeat
    (the agent instance renewing it) and its request (:class:`NodeEntry`). The pod side
    writes it whole (:meth:`to_body`) or renews it (:meth:`to_patch`); the operator reads it
    (:meth:`from_body`); the admission policy holds its name, holder, mark and owner to the
    writer's token.

    Its one owner is the Rendezvous, so it goes with it, and one for a Rendezvous that does
    not exist is collected."""

    rendezvous: str
    node: str
    """The pod that holds it (``spec.holderIdentity``)."""
    instance: str | None
    entry: NodeEntry | None = None
    """``None``: the node has asked nothing yet (or, read, ``entry_problem`` says why not)."""
    entry_problem: str | None = None
    """Read only: why the entry written is not a request (it names the field)."""
    pod_uid: str | None = None
    """The uid of the pod that wrote it (:data:`POD_UID_ANNOTATION`), if it says."""
    owner_uid: str | None = None
    """The uid of its Rendezvous, its owner."""
    duration_seconds: int | None = None
    renew_time: datetime.datetime | None = None

    @property
    def name(self) -> str:
        return lease_name(self.rendezvous, self.node)

    def _annotations(self) -> dict[str, str]:
        annotations = {} if self.instance is None else {INSTANCE_ANNOTATION: self.instance}
        if self.pod_uid is not None:
            annotations[POD_UID_ANNOTATION] = self.pod_uid
        if self.entry is not None:
            annotations[ENTRY_ANNOTATION] = self.entry.to_annotation()
        return annotations

    def _owners(self) -> list[dict[str, Any]]:
        assert self.owner_uid is not None, "a node's Lease is written with its owner"
        return [
            owner_reference(API_VERSION, KIND, self.rendezvous, self.owner_uid, controller=False)
        ]

    def _spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"holderIdentity": self.node}
        if self.duration_seconds is not None:
            spec["leaseDurationSeconds"] = self.duration_seconds
        if self.renew_time is not None:
            spec["renewTime"] = format_time(self.renew_time)
        return spec

    def to_body(self) -> dict[str, Any]:
        """The whole Lease, to create."""
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "labels": {NODE_LABEL: self.rendezvous},
                "annotations": self._annotations(),
                "ownerReferences": self._owners(),
            },
            "spec": self._spec(),
        }

    def to_patch(self, *, owner: bool) -> dict[str, Any]:
        """A merge patch renewing it, replacing the entry if there is one (an absent one is
        left as it is) and, with ``owner``, its owner (a Rendezvous made anew)."""
        metadata: dict[str, Any] = {"annotations": self._annotations()}
        if owner:
            metadata["ownerReferences"] = self._owners()
        return {"metadata": metadata, "spec": self._spec()}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> NodeLease | None:
        """``None`` for a Lease that speaks for no node: only ``<rendezvous>.<holder>``
        does, its holder a pod's name, so a pod cannot pose as another node by naming or
        relabelling a Lease it holds. What it says is not guessed at: a request, instance
        or mark that cannot be read leaves the node no request, and ``entry_problem`` says
        why. Never raises, whatever the Lease holds (the pod chose most of it)."""
        metadata = _part(body.get("metadata"))
        rendezvous = _part(metadata.get("labels")).get(NODE_LABEL)
        spec = _part(body.get("spec"))
        node = spec.get("holderIdentity")
        if (
            not isinstance(rendezvous, str)
            or rendezvous_name_problem(rendezvous)  # then the name reads two ways
            or not is_object_name(node)  # not a pod's name: it could never be a member
            or metadata.get("name") != lease_name(rendezvous, node)
        ):
            return None
        name = f"Lease {metadata.get('name')}"
        annotations = _part(metadata.get("annotations"))
        instance = annotations.get(INSTANCE_ANNOTATION)
        pod_uid = annotations.get(POD_UID_ANNOTATION) or None
        raw = annotations.get(ENTRY_ANNOTATION)
        entry, problem = None, None
        if instance is not None and not _printable(instance, MAX_INSTANCE):
            problem = (
                f"{name} annotation {INSTANCE_ANNOTATION}: must be 1 to {MAX_INSTANCE} "
                f"printable ASCII characters, got {_shown(instance)}"
            )
        elif pod_uid is not None and not _printable(pod_uid, MAX_UID):
            problem = (
                f"{name} annotation {POD_UID_ANNOTATION}: must be a uid (at most {MAX_UID} "
                f"printable ASCII characters), got {_shown(pod_uid)}"
            )
        if problem is not None:  # neither its heartbeat nor its request is read
            instance = pod_uid = None
        elif raw is not None:
            field = f"{name} annotation {ENTRY_ANNOTATION}"
            try:
                if not isinstance(raw, str):
                    raise DecodeError(f"{field}: expected a string")
                entry = NodeEntry.from_annotation(raw, field)
            except DecodeError as error:
                problem = str(error)
        owner_uid = next(
            (
                owner["uid"]
                for owner in _list_part(metadata.get("ownerReferences"))
                if isinstance(owner, Mapping)
                and owner.get("kind") == KIND
                and _printable(owner.get("uid"), MAX_UID)
            ),
            None,
        )
        duration = spec.get("leaseDurationSeconds")
        try:
            renewed: datetime.datetime | None = parse_time(spec.get("renewTime"), "renewTime")
        except DecodeError:
            renewed = None  # not read by the operator, which times heartbeats by its clock
        return cls(
            rendezvous,
            node,
            instance,
            entry,
            problem,
            pod_uid,
            owner_uid,
            duration if type(duration) is int else None,
            renewed,
        )


@dataclasses.dataclass(frozen=True)
class Member:
    """One node of the sealed round; its rank is its index in ``status.members``."""

    node: str
    """The pod name (the holder of its Lease)."""
    instance: str
    attempt: int
    addr: str
    pod_restarts: int = 0
    """The pod's container restarts when admitted; more later means the agent restarted."""
    replaces: str | None = None
    """The node that held this rank in the round before, when it changed hands in this one
    (a newcomer at a lost member's rank, or a survivor moved into it)."""

    def admits(self, entry: NodeEntry) -> bool:
        """Whether ``entry`` is the very join request this member was admitted for."""
        return entry.instance == self.instance and entry.attempt == self.attempt

    def to_dict(self, rank: int | None) -> dict[str, Any]:
        return {
            **({} if rank is None else {"rank": rank}),
            "node": self.node,
            "instance": self.instance,
            "attempt": self.attempt,
            "addr": self.addr,
            "podRestarts": self.pod_restarts,
            **({} if self.replaces is None else {"replaces": self.replaces}),
        }

    @classmethod
    def from_dict(cls, value: object, field: str, rank: int | None) -> Member:
        # Every node decodes every member of each sealed round (1000 at the largest): a
        # well-formed entry is taken in one check; the checks below name what is wrong.
        if (
            type(value) is dict
            and (rank is None or value.get("rank") == rank)
            and type(node := value.get("node")) is str
            and type(instance := value.get("instance")) is str
            and type(attempt := value.get("attempt")) is int
            and attempt >= 1
            and type(addr := value.get("addr")) is str
            and type(restarts := value.get("podRestarts", 0)) is int
            and restarts >= 0
            and ((replaces := value.get("replaces")) is None or type(replaces) is str)
        ):
            return cls(node, instance, attempt, addr, restarts, replaces)
        data = _mapping(value, field)
        if rank is not None and data.get("rank") != rank:
            raise DecodeError(
                f"{field}.rank: expected {rank} (its position), got {data.get('rank')!r}"
            )
        return cls(
            node=_str(data, "node", field),
            instance=_str(data, "instance", field),
            attempt=_int(data, "attempt", field, minimum=1),
            addr=_str(data, "addr", field),
            pod_restarts=_int(data, "podRestarts", field, default=0),
            replaces=None if data.get("replaces") is None else _str(data, "replaces", field),
        )


@dataclasses.dataclass(frozen=True)
class Master:
    """Where rank 0's TCPStore listens: MASTER_ADDR/MASTER_PORT of the round."""

    addr: str
    port: int

    @property
    def endpoint(self) -> str:
        """``host:port`` with IPv6 addresses bracketed, for people and printer columns."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"addr": self.addr, "port": self.port, "endpoint": self.endpoint}

    @classmethod
    def from_dict(cls, value: object, field: str) -> Master:
        data = _mapping(value, field)
        return cls(addr=_str(data, "addr", field), port=_int(data, "port", field, minimum=1))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A join request the operator will not count, and why: written in the status so that
    the refused node ends with the reason instead of waiting out its join timeout."""

    node: str
    instance: str
    attempt: int
    reason: str
    message: str

    def refuses(self, entry: NodeEntry) -> bool:
        """Whether ``entry`` is the very request refused (a later one is judged anew)."""
        return entry.instance == self.instance and entry.attempt == self.attempt

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "instance": self.instance,
            "attempt": self.attempt,
            "reason": self.reason,
            "message": self.message[:MAX_REFUSAL_MESSAGE],
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> Refusal:
        data = _mapping(value, field)
        return cls(
            node=_str(data, "node", field),
            instance=_str(data, "instance", field),
            attempt=_int(data, "attempt", field, minimum=1, maximum=MAX_ATTEMPT),
            reason=_str(data, "reason", field),
            message=_str(data, "message", field),
        )


@dataclasses.dataclass(frozen=True)
class RoundRecord:
    """One sealed round in ``status.history``: why it was formed and what forming it took.
    Events say the same but expire after an hour; a long run's story stays here."""

    round: int
    cause: str
    """A reason: the first loss's (``PodDeleted``, ``HeartbeatExpired``, ...), or
    ``FirstRound``, ``NodesJoined``, ``MemberRejoined``, ``SpecChanged``."""
    message: str
    world_size: int
    sealed_at: datetime.datetime
    forming_milliseconds: int
    """From the cause, as the operator noticed it (the first join, for a first round), to
    the seal."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "cause": self.cause,
            "message": self.message,
            "worldSize": self.world_size,
            "sealedAt": format_time(self.sealed_at),
            "formingMilliseconds": self.forming_milliseconds,
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> RoundRecord:
        data = _mapping(value, field)
        return cls(
            round=_int(data, "round", field, maximum=MAX_ROUND),
            cause=_str(data, "cause", field),
            message=_str(data, "message", field, default=""),
            world_size=_int(data, "worldSize", field),
            sealed_at=parse_time(data.get("sealedAt"), f"{field}.sealedAt"),
            forming_milliseconds=_int(data, "formingMilliseconds", field),
        )


@dataclasses.dataclass(frozen=True)
class ExcludedNode:
    """A Kubernetes node in ``status.excludedNodes``: a member failed on it, so the pods the
    workload makes next are kept off it."""

    node: str
    """The Kubernetes node's name, from the Pod object the operator observed."""
    reason: str
    """The loss reason (``PodFailed``, ``HeartbeatExpired``, ...)."""
    pod: str
    """The member's pod, for people to find its logs."""
    failed_at: datetime.datetime
    """When the operator noticed the failure (its own clock)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "reason": self.reason,
            "pod": self.pod,
            "failedAt": format_time(self.failed_at),
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> ExcludedNode:
        data = _mapping(value, field)
        return cls(
            node=_str(data, "node", field),
            reason=_str(data, "reason", field),
            pod=_str(data, "pod", field, default=""),
            failed_at=parse_time(data.get("failedAt"), f"{field}.failedAt"),
        )


@dataclasses.dataclass(frozen=True)
class Condition:
    """A ``metav1.Condition``."""

    type: str
    status: str
    reason: str
    message: str
    last_transition_time: datetime.datetime
    observed_generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "message": self.message,
            "lastTransitionTime": self.last_transition_time.astimezone(datetime.timezone.utc)
            .replace(microsecond=0)
            .strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": self.observed_generation,
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> Condition:
        data = _mapping(value, field)
        return cls(
            type=_str(data, "type", field),
            status=_str(data, "status", field),
            reason=_str(data, "reason", field),
            message=_str(data, "message", field, default=""),
            last_transition_time=parse_time(
                data.get("lastTransitionTime"), f"{field}.lastTransitionTime"
            ),
            observed_generation=_int(data, "observedGeneration", field, default=0),
        )


@dataclasses.dataclass(frozen=True)
class RendezvousStatus:
    """``status``, written by the operator alone."""

    state: RoundState = RoundState.FORMING
    round: int = 0
    """Number of the latest sealed round; 0 until the first is sealed."""
    members: tuple[Member, ...] = ()
    """The latest sealed round in rank order (kept while it re-forms, for reference)."""
    master: Master | None = None
    nodes_waiting: int = 0
    """What running agents' ``num_nodes_waiting()`` returns. In a sealed round always 0
    (spares beyond maxNodes do not count); when the round goes stale, the nodes that made
    it so (waiting to be admitted, plus members lost), counted once then. More than 0 tells
    healthy agents to re-rendezvous now."""
    spares: int = 0
    """Nodes asking to join that the sealed round, full at maxNodes, left out: they wait
    and step in when a member is lost. For people (``kubectl get rdzv``); agents are not
    told (torch's agent would restart for them)."""
    forming_since: datetime.datetime | None = None
    """When the round now forming got its first join request, or went stale (operator's
    clock). Written with the round's other changes, never on its own: at a first join that
    write would cost every waiting node an event of the round it is waiting for."""
    last_call_deadline: datetime.datetime | None = None
    """Seal no later than this once minNodes have joined (operator's clock)."""
    sealed_at: datetime.datetime | None = None
    closed_reason: str | None = None
    closed_message: str | None = None
    observed_generation: int = 0
    conditions: tuple[Condition, ...] = ()
    left_behind: tuple[Member, ...] = ()
    """Members of an earlier round still running it when a later round sealed without them
    (after the last call). Their join requests are spent: they count again once they join
    anew."""
    slices: int = 0
    """How many RendezvousSlices publish the round to the nodes (0: none, the nodes watch
    the Rendezvous). Fixed by the operator's first write (:func:`slice_count` of maxNodes
    then), so that a node's slice never moves under it."""
    refused: tuple[Refusal, ...] = ()
    """Requests not counted, with the reason (at most :data:`MAX_REFUSED`, by pod name):
    the refused nodes read it and end (``NodeRefusedError``)."""
    forming_cause: str | None = None
    """Why the round now forming is formed (a :attr:`RoundRecord.cause`), set when the
    sealed round goes stale; it goes into the history at the seal."""
    forming_cause_message: str | None = None
    history: tuple[RoundRecord, ...] = ()
    """The last :data:`MAX_HISTORY` sealed rounds, oldest first."""
    restarts: int = 0
    """Re-forms caused by a failure so far, each spending one of ``spec.maxRestarts``."""
    excluded_nodes: tuple[ExcludedNode, ...] = ()
    """Kubernetes nodes on which a member failed, oldest first, at most
    :data:`MAX_EXCLUDED_NODES` and none older than :data:`EXCLUDED_NODE_TTL`: the webhook
    keeps the workload's new pods off them."""
    leaving: tuple[str, ...] = ()
    """Members of the round before the latest that it dropped while their pods were being
    deleted (a drain, an eviction, a scale-down): their workers may still be finishing the
    step in flight, so nodes re-forming in place let them leave rather than cut them off
    (:data:`k8s_rendezvous.handoff.STOP_GRACE_SECONDS`). Not in a RendezvousSlice, whose
    nodes learn of no member they lost."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def round_key(self) -> str:
        return round_key(self.state, self.round)

    def rank_of(self, node: str, entry: NodeEntry) -> int | None:
        """The rank ``entry`` (of pod ``node``) holds in the sealed round, if it is in it."""
        for rank, member in enumerate(self.members):
            if member.node == node and member.admits(entry):
                return rank
        return None

    def left_behind_with(self, node: str, entry: NodeEntry) -> bool:
        """Whether ``entry`` was admitted to an earlier round and a later one sealed
        without it: the request is spent and will not be admitted again."""
        return any(m.node == node and m.admits(entry) for m in self.left_behind)

    def operator_fields(self) -> dict[str, Any]:
        """Every operator-owned field, ``None`` where unset so a merge patch removes it."""

        def optional_time(moment: datetime.datetime | None) -> str | None:
            return None if moment is None else format_time(moment)

        return {
            "schemaVersion": SCHEMA_VERSION,
            "state": self.state.value,
            "roundKey": self.round_key,
            "round": self.round,
            "worldSize": self.world_size,
            "members": [member.to_dict(rank) for rank, member in enumerate(self.members)],
            "master": None if self.master is None else self.master.to_dict(),
            "nodesWaiting": self.nodes_waiting,
            "spares": self.spares,
            "formingSince": optional_time(self.forming_since),
            "lastCallDeadline": optional_time(self.last_call_deadline),
            "sealedAt": optional_time(self.sealed_at),
            "closedReason": self.closed_reason,
            "closedMessage": self.closed_message,
            "observedGeneration": self.observed_generation,
            "conditions": [condition.to_dict() for condition in self.conditions],
            "leftBehind": [member.to_dict(rank=None) for member in self.left_behind],
            "slices": self.slices,
            "refused": [refusal.to_dict() for refusal in self.refused],
            "formingCause": self.forming_cause,
            "formingCauseMessage": self.forming_cause_message,
            "history": [record.to_dict() for record in self.history],
            "restarts": self.restarts,
            "excludedNodes": [excluded.to_dict() for excluded in self.excluded_nodes],
            "leaving": list(self.leaving),
        }

    def slice_fields(self, indexes: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
        """The status of each slice (of those ``indexes``, else all), by index: the round's
        fields, and the members, left behind and refused whose pods hash to it (with their
        ranks). ``None`` where unset, so that a merge patch removes it. A node's
        :class:`NodeView` of its slice answers as the whole status does. Empty if the round
        is not sliced."""
        if not self.slices:
            return {}
        round_fields = {
            "schemaVersion": SCHEMA_VERSION,
            "state": self.state.value,
            "roundKey": self.round_key,
            "round": self.round,
            "worldSize": self.world_size,
            "rankZeroNode": self.members[0].node if self.members else None,
            "master": None if self.master is None else self.master.to_dict(),
            "nodesWaiting": self.nodes_waiting,
            "closedReason": self.closed_reason,
            "closedMessage": self.closed_message,
            "slices": self.slices,
        }
        pieces: dict[int, dict[str, Any]] = {
            index: round_fields | {"slice": index, "members": [], "leftBehind": [], "refused": []}
            for index in sorted(range(self.slices) if indexes is None else set(indexes))
        }

        def piece(node: str) -> dict[str, Any] | None:
            return pieces.get(slice_index(node, self.slices))

        for rank, member in enumerate(self.members):
            if (own := piece(member.node)) is not None:
                own["members"].append(member.to_dict(rank))
        for member in self.left_behind:
            if (own := piece(member.node)) is not None:
                own["leftBehind"].append(member.to_dict(rank=None))
        for refusal in self.refused:
            if (own := piece(refusal.node)) is not None:
                own["refused"].append(refusal.to_dict())
        return pieces

    def named_nodes(self) -> set[str]:
        """The pods the status names: members, left behind and refused."""
        return {
            *(member.node for member in self.members),
            *(member.node for member in self.left_behind),
            *(refusal.node for refusal in self.refused),
        }

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.operator_fields().items() if value is not None}

    @classmethod
    def from_dict(cls, value: object, field: str = "status") -> RendezvousStatus:
        """Decode a stored status. An absent or empty status is the initial one."""
        data = _stored_status(value, field)
        if data is None:
            return cls()
        members = tuple(
            Member.from_dict(item, f"{field}.members[{rank}]", rank)
            for rank, item in enumerate(_list(data, "members", field))
        )

        def optional_time(key: str) -> datetime.datetime | None:
            raw = data.get(key)
            return None if raw is None else parse_time(raw, f"{field}.{key}")

        def optional_str(key: str) -> str | None:
            return None if data.get(key) is None else _str(data, key, field)

        return cls(
            **_round_fields(data, field, sealable=bool(members)),
            members=members,
            spares=_int(data, "spares", field, default=0),
            forming_since=optional_time("formingSince"),
            last_call_deadline=optional_time("lastCallDeadline"),
            sealed_at=optional_time("sealedAt"),
            observed_generation=_int(data, "observedGeneration", field, default=0),
            conditions=tuple(
                Condition.from_dict(item, f"{field}.conditions[{index}]")
                for index, item in enumerate(_list(data, "conditions", field))
            ),
            left_behind=tuple(
                Member.from_dict(item, f"{field}.leftBehind[{index}]", rank=None)
                for index, item in enumerate(_list(data, "leftBehind", field))
            ),
            slices=_int(data, "slices", field, default=0, maximum=MAX_SLICES),
            refused=tuple(
                Refusal.from_dict(item, f"{field}.refused[{index}]")
                for index, item in enumerate(_list(data, "refused", field))
            ),
            forming_cause=optional_str("formingCause"),
            forming_cause_message=optional_str("formingCauseMessage"),
            history=tuple(
                RoundRecord.from_dict(item, f"{field}.history[{index}]")
                for index, item in enumerate(_list(data, "history", field))
            ),
            restarts=_int(data, "restarts", field, default=0, maximum=MAX_RESTARTS),
            excluded_nodes=tuple(
                ExcludedNode.from_dict(item, f"{field}.excludedNodes[{index}]")
                for index, item in enumerate(_list(data, "excludedNodes", field))
            )[-MAX_EXCLUDED_NODES:],
            leaving=Fields(data, field).strings("leaving"),
        )


@dataclasses.dataclass(frozen=True)
class NodeView:
    """The status as one node reads it: the round, and this node's own entries in it.

    Read from the Rendezvous status or from the node's RendezvousSlice (its status has the
    same layout, with ``slice`` set and only that slice's members). Every node reads every
    sealed round, and a round of 1000 members is about 120 kB: decoding each member would
    cost every node about 1.7 ms of CPU (``python -m bench.probes``), 1000 times over on a
    machine of simulated nodes; a node looks only for itself."""

    node: str
    state: RoundState = RoundState.FORMING
    round: int = 0
    world_size: int = 0
    rank_zero_node: str | None = None
    """The pod of rank 0, for messages about the round's store."""
    member_nodes: tuple[str, ...] = ()
    """The pods of the latest sealed round in rank order, for messages; empty when read
    from a slice (see ``world_size``)."""
    member_addresses: tuple[str, ...] = ()
    """Their addresses, in the same order."""
    own_ranks: tuple[tuple[int, Member], ...] = ()
    """This pod's entries in ``members`` with their ranks (one, unless its agent restarted
    and the operator has not yet noticed)."""
    own_left_behind: tuple[Member, ...] = ()
    master: Master | None = None
    nodes_waiting: int = 0
    closed_reason: str | None = None
    closed_message: str | None = None
    slices: int = 0
    """See :attr:`RendezvousStatus.slices`: more than 0 tells the node to watch its slice."""
    own_refusals: tuple[Refusal, ...] = ()
    """This pod's entries in ``refused``."""
    leaving: tuple[str, ...] = ()
    """See :attr:`RendezvousStatus.leaving` (empty when read from a slice)."""

    @property
    def round_key(self) -> str:
        return round_key(self.state, self.round)

    def rank_of(self, entry: NodeEntry) -> int | None:
        """The rank this node's ``entry`` holds in the sealed round, if it is in it."""
        return next((rank for rank, member in self.own_ranks if member.admits(entry)), None)

    def left_behind_with(self, entry: NodeEntry) -> bool:
        """See :meth:`RendezvousStatus.left_behind_with`."""
        return any(member.admits(entry) for member in self.own_left_behind)

    def refusal_of(self, entry: NodeEntry) -> Refusal | None:
        """Why the operator does not count ``entry``, if it said so."""
        return next((refusal for refusal in self.own_refusals if refusal.refuses(entry)), None)

    @classmethod
    def from_dict(cls, value: object, node: str, field: str = "status") -> NodeView:
        data = _stored_status(value, field)
        if data is None:
            return cls(node)
        sliced = data.get("slice") is not None
        world_size = _int(data, "worldSize", field) if sliced else 0
        member_nodes: list[str] = []
        member_addresses: list[str] = []
        own_ranks: list[tuple[int, Member]] = []
        for position, item in enumerate(_list(data, "members", field)):
            where = f"{field}.members[{position}]"
            name = item.get("node") if type(item) is dict else None
            if type(name) is not str:
                raise DecodeError(f"{where}.node: expected a string, got {name!r}")
            if not sliced:
                member_nodes.append(name)
                member_addresses.append(_str(item, "addr", where))
            if name == node:
                rank = _int(item, "rank", where, maximum=world_size - 1) if sliced else position
                own_ranks.append((rank, Member.from_dict(item, where, rank)))
        if not sliced:
            world_size = len(member_nodes)
        rank_zero_node = (
            (None if data.get("rankZeroNode") is None else _str(data, "rankZeroNode", field))
            if sliced
            else next(iter(member_nodes), None)
        )
        return cls(
            node,
            **_round_fields(data, field, sealable=world_size > 0),
            world_size=world_size,
            rank_zero_node=rank_zero_node,
            member_nodes=tuple(member_nodes),
            member_addresses=tuple(member_addresses),
            own_ranks=tuple(own_ranks),
            own_left_behind=tuple(
                Member.from_dict(item, f"{field}.leftBehind[{index}]", rank=None)
                for index, item in enumerate(_list(data, "leftBehind", field))
                if type(item) is not dict or item.get("node") == node
            ),
            slices=_int(data, "slices", field, default=0, maximum=MAX_SLICES),
            own_refusals=tuple(
                Refusal.from_dict(item, f"{field}.refused[{index}]")
                for index, item in enumerate(_list(data, "refused", field))
                if type(item) is not dict or item.get("node") == node
            ),
            leaving=() if sliced else Fields(data, field).strings("leaving"),
        )


def _stored_status(value: object, field: str) -> Mapping[str, Any] | None:
    """The status as the operator wrote it, or ``None`` before its first write."""
    if value is None:
        return None
    data = _mapping(value, field)
    if "state" not in data:  # the operator has not written yet
        return None
    version = data.get("schemaVersion")
    if version != SCHEMA_VERSION:
        raise DecodeError(
            f"{field}.schemaVersion: {version!r} is not {SCHEMA_VERSION}; the operator and "
            "the pods' k8s-rendezvous versions disagree, upgrade them together"
        )
    return data


def _list(data: Mapping[str, Any], key: str, field: str) -> list[Any]:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise DecodeError(f"{field}.{key}: expected a list")
    return value


def _round_fields(data: Mapping[str, Any], field: str, *, sealable: bool) -> dict[str, Any]:
    """The fields every reader of a status needs, decoded and checked."""

    def optional_str(key: str) -> str | None:
        return None if data.get(key) is None else _str(data, key, field)

    master_data = data.get("master")
    state = _enum(RoundState, data, "state", field)
    if state is RoundState.SEALED and (master_data is None or not sealable):
        raise DecodeError(f"{field}: a Sealed round needs members and a master")
    return {
        "state": state,
        "round": _int(data, "round", field, default=0, maximum=MAX_ROUND),
        "master": None if master_data is None else Master.from_dict(master_data, f"{field}.master"),
        "nodes_waiting": _int(data, "nodesWaiting", field, default=0),
        "closed_reason": optional_str("closedReason"),
        "closed_message": optional_str("closedMessage"),
    }
