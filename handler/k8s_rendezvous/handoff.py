"""What a node's agent and its workers hand each other when they re-form in place.

The agent's handler (``--rdzv-conf in_place=1``) and the workers of its node share a
directory, named to the workers by :data:`DIRECTORY_ENV` (the handler sets it in the
agent's environment, which torch's agent passes on to every worker it starts):

- ``round.json``, written by the handler: the latest round this node is in (its number,
  its store, this node's ranks in it) or that the node fell back to restarting;
- ``worker-<local rank>.json``, written by each worker: that it can re-form in place, in
  which round it is, or why it gave up.

Each is replaced whole (written beside, then renamed), so a reader never sees half of one.
Reading them costs a ``stat`` and a few hundred bytes: the agent's handler reads the
workers' records each time torch's agent polls it (every ``--monitor-interval``), a worker
reads the round at each step boundary. No torch and no Kubernetes here: both sides import
this module.

Both records are frozen dataclasses with an explicit camelCase codec and a
``schemaVersion``, as the Rendezvous' own wire format (:mod:`k8s_rendezvous.wire`) is,
and decode as strictly: a bad record raises :class:`HandoffError` naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from k8s_rendezvous.wire import codec

DIRECTORY_ENV: Final = "K8S_RENDEZVOUS_IN_PLACE_DIR"
"""Names the shared directory to the workers; unset, they cannot re-form in place."""
ROUND_FILE: Final = "round.json"
STOP_GRACE_SECONDS: Final = 10.0
"""How long a worker told to stop (SIGTERM from torch's agent: its pod is being deleted, or
the agent restarts its workers) may take to finish the step in flight before it ends
anyway (:mod:`k8s_rendezvous.in_place`), and so how long its peers let a leaving member
finish before they cut it off (:mod:`k8s_rendezvous.cut_peers`): a step blocked on a peer
that is gone would otherwise hold the agent until it SIGKILLs (30 s)."""
SCHEMA_VERSION: Final = 1
"""Version of both records' layout (``schemaVersion`` in each); a reader refuses a record
of another version as unreadable, so an agent and workers of different k8s-rendezvous
versions fall back to torch's restart instead of misreading each other."""


class HandoffError(codec.DecodeError):
    """A record is not JSON, has another schema version, or a field is missing or of the
    wrong type; the message names the field."""


@dataclasses.dataclass(frozen=True)
class PublishedRound:
    """The round this node is in, as its handler publishes it to the node's workers.

    A round the agent started the workers in (``next_rendezvous()``) has no ranks: torch's
    agent assigns them and gives them to the workers in their environment. A round the
    handler re-formed in place carries this node's first global rank and the new world
    size, from torch's own rank assignment, which the handler ran on the agent's behalf.
    """

    round: int
    uuid: int
    """The same on every node of the round and different for every round: what the
    workers pass to ``dist._reconfigure``, which wants a fresh one each time."""
    master: str
    """``addr:port`` of the round's store, served by its rank 0."""
    group_rank: int
    group_world_size: int
    base_rank: int | None = None
    """This node's first worker's global rank in the round, if it was re-formed in place."""
    world_size: int | None = None
    """The number of workers in the round, if it was re-formed in place."""
    fallback: str | None = None
    """Set when the node gave up re-forming in place: why. torch's agent restarts the
    workers; those waiting to re-form stop waiting."""
    lost_addresses: tuple[str, ...] = ()
    """The addresses of the members of this node's previous round that this one dropped:
    the workers shut their connections to them down (:mod:`k8s_rendezvous.cut_peers`)."""
    leaving_addresses: tuple[str, ...] = ()
    """Those of the dropped members whose pods are being deleted (the status' ``leaving``):
    their workers finish the step in flight, so the workers cut them off only if they are
    still connected :data:`STOP_GRACE_SECONDS` later."""

    @property
    def in_place(self) -> bool:
        """Whether the handler re-formed this round around running workers."""
        return self.base_rank is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schemaVersion": SCHEMA_VERSION,
            "round": self.round,
            "uuid": self.uuid,
            "master": self.master,
            "groupRank": self.group_rank,
            "groupWorldSize": self.group_world_size,
            "baseRank": self.base_rank,
            "worldSize": self.world_size,
            "fallback": self.fallback,
            "lostAddresses": list(self.lost_addresses),
            "leavingAddresses": list(self.leaving_addresses),
        }

    @classmethod
    def from_dict(cls, data: object) -> PublishedRound:
        """Raises :class:`HandoffError` naming the field that is wrong."""
        with _refused():
            fields = _fields(data, "round")
            return cls(
                round=fields.integer("round"),
                uuid=fields.integer("uuid"),
                master=fields.string("master"),
                group_rank=fields.integer("groupRank"),
                group_world_size=fields.integer("groupWorldSize"),
                base_rank=fields.optional_integer("baseRank"),
                world_size=fields.optional_integer("worldSize"),
                fallback=fields.optional_string("fallback"),
                lost_addresses=fields.strings("lostAddresses"),
                leaving_addresses=fields.strings("leavingAddresses"),
            )


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """A worker's word to its node's handler."""

    local_rank: int
    pid: int
    round: int
    """The round whose world the worker is in (the one it last re-formed into)."""
    fallback: str | None = None
    """Set when the worker gave up re-forming in place: why."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schemaVersion": SCHEMA_VERSION,
            "localRank": self.local_rank,
            "pid": self.pid,
            "round": self.round,
            "fallback": self.fallback,
        }

    @classmethod
    def from_dict(cls, data: object) -> WorkerRecord:
        """Raises :class:`HandoffError` naming the field that is wrong."""
        with _refused():
            fields = _fields(data, "worker")
            return cls(
                local_rank=fields.integer("localRank"),
                pid=fields.integer("pid"),
                round=fields.integer("round"),
                fallback=fields.optional_string("fallback"),
            )


def round_uuid(rendezvous_uid: str, round_number: int, master: str) -> int:
    """The reconfigure UUID of a round: the same on every node of it (each computes it
    from what the round says), different for every round, even of a Rendezvous made anew
    (its uid changes) or a round number seen again."""
    digest = hashlib.sha256(f"{rendezvous_uid}/{round_number}/{master}".encode()).digest()
    return int.from_bytes(digest[:7], "big")


def worker_file(local_rank: int) -> str:
    return f"worker-{local_rank}.json"


def write(directory: Path, name: str, record: PublishedRound | WorkerRecord) -> None:
    """Replace ``directory/name`` with ``record`` at once (write beside, then rename)."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(record.to_dict(), file)
        os.replace(temporary, directory / name)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_round(directory: Path) -> PublishedRound | None:
    """The published round, ``None`` if there is none yet. Raises :class:`HandoffError`."""
    data = _read(directory / ROUND_FILE)
    return None if data is None else PublishedRound.from_dict(data)


def read_worker(directory: Path, local_rank: int) -> WorkerRecord | None:
    """A worker's record, ``None`` if it wrote none. Raises :class:`HandoffError`."""
    data = _read(directory / worker_file(local_rank))
    return None if data is None else WorkerRecord.from_dict(data)


def _read(path: Path) -> object | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data: object = json.loads(text)
    except ValueError as error:
        raise HandoffError(f"{path.name} is not JSON: {error}") from error
    return data


def _fields(data: object, what: str) -> codec.Fields:
    """The record ``what`` (``round``, ``worker``), once it is an object of this version."""
    if type(data) is not dict:
        raise HandoffError(f"the {what} record is not an object: {data!r}")
    version = data.get("schemaVersion")
    if version != SCHEMA_VERSION:
        raise HandoffError(
            f"{what}.schemaVersion: {version!r} is not {SCHEMA_VERSION}; the agent and its "
            "workers run different k8s-rendezvous versions"
        )
    return codec.Fields(data, what)


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """The codec's :class:`k8s_rendezvous.wire.codec.DecodeError` as this module's error."""
    try:
        yield
    except HandoffError:
        raise
    except codec.DecodeError as error:
        raise HandoffError(str(error)) from None
