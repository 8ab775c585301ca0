"""What users tune, each described once: the numbers of a Rendezvous' spec
(:data:`SPEC_TUNABLES`) and the settings of each node's own agent (:data:`AGENT_SETTINGS`),
with their defaults and bounds. The codec, the ``--rdzv-conf`` keys, the Job annotations
and their checks are derived from these tables, and tests hold the CRD to them."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from typing import Final

DEFAULT_JOIN_TIMEOUT_SECONDS: Final = 600
DEFAULT_LAST_CALL_TIMEOUT_SECONDS: Final = 30
DEFAULT_CLOSE_TIMEOUT_SECONDS: Final = 30
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS: Final = 30
MIN_HEARTBEAT_TIMEOUT_SECONDS: Final = 3
MAX_RESTARTS: Final = 2**31 - 1
"""The CRD's bound on ``spec.maxRestarts``."""
MAX_SPARES: Final = 100_000
"""The CRD's bound on ``spec.spares``: as many as a round's most nodes."""
MAX_HEALTH_CHECK_SECONDS: Final = 3600
"""The longest health check a node may run before each join (``health_check_timeout``):
an hour covers a long burn-in test; longer would hold a node out of rounds unseen."""
DEFAULT_HEALTH_CHECK_SECONDS: Final = 300
"""Five minutes: a short NCCL all-reduce or GPU burn-in ends well within it, and a check
that hangs (a wedged GPU driver) holds its node out no longer than a join would wait."""
DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS: Final = 30
"""Survivors re-form in tens of milliseconds when a peer's process dies (their
collectives fail at once); 30 s also covers a step's compute between two collectives."""


@dataclasses.dataclass(frozen=True)
class SpecTunable:
    """One number of a Rendezvous' spec that users tune, described once: the codec, the
    ``--rdzv-conf`` keys, the Job annotations and their checks are derived from
    :data:`SPEC_TUNABLES`, and a test holds the CRD to it."""

    attribute: str
    """The :class:`specs.RendezvousSpec` attribute."""
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
