"""The parts of a status: a member of the sealed round and where its store is, a refused
request, a sealed round in the history, a Kubernetes node kept out, a condition."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Final

from k8s_rendezvous.wire import codec, leases

MAX_ROUND: Final = 10**12
"""The CRD's bound on ``status.round``: a round a second for 30,000 years, and far below
the API server's integer limit, so that sealing the next round can always be written."""
MAX_REFUSAL_MESSAGE: Final = 1024
"""The CRD's bound on the message of a refusal or a round in the history (longer ones are cut)."""


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

    def admits(self, entry: leases.NodeEntry) -> bool:
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
        data = codec.mapping(value, field)
        if rank is not None and data.get("rank") != rank:
            raise codec.DecodeError(
                f"{field}.rank: expected {rank} (its position), got {data.get('rank')!r}"
            )
        return cls(
            node=codec.string(data, "node", field),
            instance=codec.string(data, "instance", field),
            attempt=codec.integer(data, "attempt", field, minimum=1),
            addr=codec.string(data, "addr", field),
            pod_restarts=codec.integer(data, "podRestarts", field, default=0),
            replaces=None
            if data.get("replaces") is None
            else codec.string(data, "replaces", field),
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
        data = codec.mapping(value, field)
        return cls(
            addr=codec.string(data, "addr", field),
            port=codec.integer(data, "port", field, minimum=1),
        )


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A join request the operator will not count, and why: written in the status so that
    the refused node ends with the reason instead of waiting out its join timeout."""

    node: str
    instance: str
    attempt: int
    reason: str
    message: str

    def refuses(self, entry: leases.NodeEntry) -> bool:
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
        data = codec.mapping(value, field)
        return cls(
            node=codec.string(data, "node", field),
            instance=codec.string(data, "instance", field),
            attempt=codec.integer(data, "attempt", field, minimum=1, maximum=leases.MAX_ATTEMPT),
            reason=codec.string(data, "reason", field),
            message=codec.string(data, "message", field),
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
            "sealedAt": codec.format_time(self.sealed_at),
            "formingMilliseconds": self.forming_milliseconds,
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> RoundRecord:
        data = codec.mapping(value, field)
        return cls(
            round=codec.integer(data, "round", field, maximum=MAX_ROUND),
            cause=codec.string(data, "cause", field),
            message=codec.string(data, "message", field, default=""),
            world_size=codec.integer(data, "worldSize", field),
            sealed_at=codec.parse_time(data.get("sealedAt"), f"{field}.sealedAt"),
            forming_milliseconds=codec.integer(data, "formingMilliseconds", field),
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
            "failedAt": codec.format_time(self.failed_at),
        }

    @classmethod
    def from_dict(cls, value: object, field: str) -> ExcludedNode:
        data = codec.mapping(value, field)
        return cls(
            node=codec.string(data, "node", field),
            reason=codec.string(data, "reason", field),
            pod=codec.string(data, "pod", field, default=""),
            failed_at=codec.parse_time(data.get("failedAt"), f"{field}.failedAt"),
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
        data = codec.mapping(value, field)
        return cls(
            type=codec.string(data, "type", field),
            status=codec.string(data, "status", field),
            reason=codec.string(data, "reason", field),
            message=codec.string(data, "message", field, default=""),
            last_transition_time=codec.parse_time(
                data.get("lastTransitionTime"), f"{field}.lastTransitionTime"
            ),
            observed_generation=codec.integer(data, "observedGeneration", field, default=0),
        )
