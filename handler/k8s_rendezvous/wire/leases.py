"""A node's Lease ``<rendezvous>.<pod>``, the one object a pod writes: its heartbeat and
its request to the operator (:class:`NodeEntry`), with the report of a failed health check
a Leave carries. What a pod writes is read within bounds, and never raises but
:class:`~k8s_rendezvous.wire.codec.DecodeError`."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import re
from collections.abc import Mapping
from typing import Any, Final

from k8s_rendezvous.wire import codec, objects, tunables

MAX_ATTEMPT: Final = 2**31 - 1
"""The CRD's bound on a join request's ``attempt``: far more joins than an agent makes, and
within the API server's integers, so that a pod cannot write one that no status can hold."""
MAX_HEALTH_CHECK_TAIL: Final = 1024
"""The most characters of a failed health check's output a node's entry carries (its
last ones, where a self-test says why it failed): enough for a few lines of an NCCL or
GPU test, and small beside the 256 KiB the API server allows a Lease's annotations."""
MAX_ENTRY_LENGTH: Final = 16384
"""The most characters of a node's entry (:data:`objects.ENTRY_ANNOTATION`): the longest a handler
writes is a Leave with a full health check tail, about 12,600 (1,024 characters, each at
most 12 as JSON escapes it, and the other fields)."""
MAX_ENTRY_DEPTH: Final = 4
"""How deep an entry's objects may nest: it has 2 levels (its health check report is the
second); 2 more leave room for a later version's fields."""
MAX_ENTRY_VALUES: Final = 64
"""The most JSON values an entry may hold: it has about a dozen."""
MAX_INSTANCE: Final = 64
"""The most characters of an agent instance's id (printable ASCII; the handler's are 16)."""


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


_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


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
        data = codec.mapping(value, field)
        tail = codec.string(data, "tail", field, default="")
        if len(tail) > MAX_HEALTH_CHECK_TAIL:
            raise codec.DecodeError(
                f"{field}.tail: must be at most {MAX_HEALTH_CHECK_TAIL} characters, got {len(tail)}"
            )
        exit_code = data.get("exitCode")
        if exit_code is not None and (
            isinstance(exit_code, bool)
            or not isinstance(exit_code, int)
            or not -255 <= exit_code <= 255
        ):
            raise codec.DecodeError(
                f"{field}.exitCode: expected an integer from -255 to 255, "
                f"got {codec.shown(exit_code)}"
            )
        milliseconds = codec.integer(
            data, "milliseconds", field, maximum=(tunables.MAX_HEALTH_CHECK_SECONDS + 60) * 1000
        )
        return cls(
            outcome=codec.enumerated(HealthCheckOutcome, data, "outcome", field),
            seconds=milliseconds / 1000,
            exit_code=exit_code,
            tail=printable_tail(tail),
        )


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """A node's own request, written by that pod alone in its Lease (see
    :data:`objects.ENTRY_ANNOTATION`)."""

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
    (:class:`datagrams.Probe`); 0: it answers none, and only its heartbeats say it lives."""
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
        data = codec.mapping(value, field)
        instance = codec.string(data, "instance", field, max_length=MAX_INSTANCE)
        if not codec.printable(instance, MAX_INSTANCE):
            raise codec.DecodeError(
                f"{field}.instance: must be printable ASCII, got {codec.shown(instance)}"
            )
        return cls(
            instance=instance,
            attempt=codec.integer(data, "attempt", field, minimum=1, maximum=MAX_ATTEMPT),
            addr=codec.canonical_ip(
                codec.string(data, "addr", field, max_length=253), f"{field}.addr"
            ),
            store_port=codec.integer(data, "storePort", field, minimum=1, maximum=65535),
            intent=codec.enumerated(NodeIntent, data, "intent", field),
            probe_port=codec.integer(data, "probePort", field, default=0, maximum=65535),
            health_check=None
            if data.get("healthCheck") is None
            else HealthCheckReport.from_dict(data["healthCheck"], f"{field}.healthCheck"),
        )

    def to_annotation(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_annotation(cls, text: str, field: str) -> NodeEntry:
        data = codec.decode_json(
            text,
            field,
            max_length=MAX_ENTRY_LENGTH,
            max_depth=MAX_ENTRY_DEPTH,
            max_values=MAX_ENTRY_VALUES,
        )
        return cls.from_dict(data, field)


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
    """The uid of the pod that wrote it (:data:`objects.POD_UID_ANNOTATION`), if it says."""
    owner_uid: str | None = None
    """The uid of its Rendezvous, its owner."""
    duration_seconds: int | None = None
    renew_time: datetime.datetime | None = None

    @property
    def name(self) -> str:
        return objects.lease_name(self.rendezvous, self.node)

    def _annotations(self) -> dict[str, str]:
        annotations = {} if self.instance is None else {objects.INSTANCE_ANNOTATION: self.instance}
        if self.pod_uid is not None:
            annotations[objects.POD_UID_ANNOTATION] = self.pod_uid
        if self.entry is not None:
            annotations[objects.ENTRY_ANNOTATION] = self.entry.to_annotation()
        return annotations

    def _owners(self) -> list[dict[str, Any]]:
        assert self.owner_uid is not None, "a node's Lease is written with its owner"
        return [
            objects.owner_reference(
                objects.API_VERSION, objects.KIND, self.rendezvous, self.owner_uid, controller=False
            )
        ]

    def _spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"holderIdentity": self.node}
        if self.duration_seconds is not None:
            spec["leaseDurationSeconds"] = self.duration_seconds
        if self.renew_time is not None:
            spec["renewTime"] = codec.format_time(self.renew_time)
        return spec

    def to_body(self) -> dict[str, Any]:
        """The whole Lease, to create."""
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "labels": {objects.NODE_LABEL: self.rendezvous},
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
        metadata = codec.part(body.get("metadata"))
        rendezvous = codec.part(metadata.get("labels")).get(objects.NODE_LABEL)
        spec = codec.part(body.get("spec"))
        node = spec.get("holderIdentity")
        if (
            not isinstance(rendezvous, str)
            or objects.rendezvous_name_problem(rendezvous)  # then the name reads two ways
            or not objects.is_object_name(node)  # not a pod's name: it could never be a member
            or metadata.get("name") != objects.lease_name(rendezvous, node)
        ):
            return None
        name = f"Lease {metadata.get('name')}"
        annotations = codec.part(metadata.get("annotations"))
        instance = annotations.get(objects.INSTANCE_ANNOTATION)
        pod_uid = annotations.get(objects.POD_UID_ANNOTATION) or None
        raw = annotations.get(objects.ENTRY_ANNOTATION)
        entry, problem = None, None
        if instance is not None and not codec.printable(instance, MAX_INSTANCE):
            problem = (
                f"{name} annotation {objects.INSTANCE_ANNOTATION}: must be 1 to {MAX_INSTANCE} "
                f"printable ASCII characters, got {codec.shown(instance)}"
            )
        elif pod_uid is not None and not codec.printable(pod_uid, objects.MAX_UID):
            problem = (
                f"{name} annotation {objects.POD_UID_ANNOTATION}: must be a uid (at most "
                f"{objects.MAX_UID} printable ASCII characters), got {codec.shown(pod_uid)}"
            )
        if problem is not None:  # neither its heartbeat nor its request is read
            instance = pod_uid = None
        elif raw is not None:
            field = f"{name} annotation {objects.ENTRY_ANNOTATION}"
            try:
                if not isinstance(raw, str):
                    raise codec.DecodeError(f"{field}: expected a string")
                entry = NodeEntry.from_annotation(raw, field)
            except codec.DecodeError as error:
                problem = str(error)
        owner_uid = next(
            (
                owner["uid"]
                for owner in codec.list_part(metadata.get("ownerReferences"))
                if isinstance(owner, Mapping)
                and owner.get("kind") == objects.KIND
                and codec.printable(owner.get("uid"), objects.MAX_UID)
            ),
            None,
        )
        duration = spec.get("leaseDurationSeconds")
        try:
            renewed: datetime.datetime | None = codec.parse_time(spec.get("renewTime"), "renewTime")
        except codec.DecodeError:
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
