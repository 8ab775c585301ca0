"""torchrun's parameters for ``--rdzv-backend=kubernetes``, read and checked: the
``--rdzv-conf`` keys, the endpoint (which Rendezvous), and the node's own name (held by one
agent at a time: :func:`claim_node`).

Nothing here talks to the API but :func:`own_pod_name`, once, when ``POD_NAME`` is unset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from torch.distributed.elastic.rendezvous import RendezvousError

from k8s_rendezvous import messages
from k8s_rendezvous.errors import KubernetesRendezvousStateError
from k8s_rendezvous.wire import objects, specs, tunables

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from k8s_rendezvous import api

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_SECONDS: Final = 60
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS: Final = 5
"""c10d's: the budget of one renewal of the node's Lease, retries included."""
DEFAULT_KEEP_ALIVE_INTERVAL_SECONDS: Final = 10
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT: Final = 3
"""With the interval, the spec's default liveness window (30 s): c10d's is 5 x 3, but a
renewal here is an API write, and 1,000 nodes at 5 s would be 200 writes a second."""
_KEEP_ALIVE = "keep_alive_interval x keep_alive_max_attempt"


def _tunable_meaning(tunable: tunables.SpecTunable) -> str:
    where = (
        "this node's own (the spec's if not given)"
        if tunable.node_local
        else "used if this node creates the Rendezvous, else its spec wins"
    )
    return f"{tunable.unit}, at least {tunable.minimum}: {tunable.meaning}; {where}"


_HEARTBEAT = next(t for t in tunables.SPEC_TUNABLES if t.conf_key is None)
CONFIG_KEYS: Final = {
    "read_timeout": "seconds to retry the API server and to wait on the round's store (60)",
    **{
        tunable.conf_key: _tunable_meaning(tunable)
        for tunable in tunables.SPEC_TUNABLES
        if tunable.conf_key is not None
    },
    "keep_alive_interval": "seconds between renewals of the node's Lease (10); times "
    f"keep_alive_max_attempt (3), the liveness window: {_tunable_meaning(_HEARTBEAT)}",
    "keep_alive_max_attempt": "renewals a node may miss before it is dropped (3); see "
    "keep_alive_interval",
    "heartbeat_timeout": "seconds one renewal of the node's Lease may take, retries "
    "included (5), as c10d bounds one keep-alive write",
    **{setting.conf_key: setting.meaning for setting in tunables.AGENT_SETTINGS},
}
_IGNORED_CONFIG_KEYS: Final = {"timeout"}  # torchrun adds it for every backend
C10D_KEYS_NOT_USED: Final = {
    "is_host": "no node hosts the rendezvous: the operator keeps it in the Rendezvous, and "
    "the round's rank 0 serves the workers' store",
    "store_type": "the rendezvous is no store here; the round's store is always rank 0's TCPStore",
    "use_libuv": "the round's store server is chosen by torch version (libuv where it can "
    "serve a socket it is handed)",
    "cas_backoff_max_seconds": "nodes never compare-and-set a shared state: each writes its "
    "own Lease, and only the operator writes the Rendezvous",
}
"""Keys torch's c10d backend accepts: taken, so that switching only ``--rdzv-backend``
works, and each logged once as having no use here, with the reason."""
_RUN_ID = re.compile(r"^[!-~]{1,253}\Z")
"""As the CRD holds ``spec.runId``: printable ASCII without spaces."""
_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch for workers that start their own store instead of the agent's."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``--rdzv-endpoint`` and ``--rdzv-conf`` say, checked."""

    namespace: str
    """The Rendezvous' namespace: the endpoint's, else the pod's own."""
    name: str
    """The Rendezvous' name."""
    read_timeout: int = DEFAULT_READ_TIMEOUT_SECONDS
    """Seconds to retry the API server and to wait on the round's store: torch's own
    c10d backend waits as long on its store (``read_timeout``, 60 s)."""
    configured_spec: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """The spec's tunables given (:data:`tunables.SPEC_TUNABLES`), by their field in the spec:
    the spec of a Rendezvous this node creates, compared with (and, but for a node's own
    deadlines, overruled by) the spec of one that exists."""
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    """The budget of one renewal of the node's Lease, as c10d's ``heartbeat_timeout``."""
    # The agent's own settings, each named by its --rdzv-conf key (tunables.AGENT_SETTINGS).
    health_check: tuple[str, ...] = ()
    health_check_timeout: int = tunables.DEFAULT_HEALTH_CHECK_SECONDS
    in_place: bool = False
    in_place_loss_timeout: int = tunables.DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS
    warm_start: bool = False

    @classmethod
    def from_parameters(
        cls, params: RendezvousParameters, default_namespace: str | None
    ) -> Settings:
        """Read torchrun's parameters; ``default_namespace`` is the pod's own.

        Raises:
            ValueError: An unknown ``--rdzv-conf`` key (naming the valid ones), a malformed
                endpoint or a read timeout that is not a positive number of seconds.
        """
        unknown = (
            set(params.config) - set(CONFIG_KEYS) - _IGNORED_CONFIG_KEYS - set(C10D_KEYS_NOT_USED)
        )
        if unknown:
            valid = "; ".join(f"{key}: {meaning}" for key, meaning in CONFIG_KEYS.items())
            accepted = ", ".join(sorted(C10D_KEYS_NOT_USED))
            raise ValueError(
                f"unknown --rdzv-conf key(s) {', '.join(sorted(unknown))} for the kubernetes "
                f"rendezvous backend. Valid keys: {valid}. Also accepted, as torch's c10d "
                f"backend takes them, but not used here: {accepted}."
            )
        for key in sorted(set(params.config) & set(C10D_KEYS_NOT_USED)):
            log.info(
                "--rdzv-conf %s is not used by the kubernetes backend: %s",
                key,
                C10D_KEYS_NOT_USED[key],
            )
        namespace, name = parse_endpoint(params.endpoint, default_namespace)
        read_timeout = _positive_seconds(
            params, "read_timeout", DEFAULT_READ_TIMEOUT_SECONDS, "API retries and store waits"
        )
        configured = _configured_spec(params)
        heartbeat_timeout = _positive_seconds(
            params,
            "heartbeat_timeout",
            DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
            "the budget of one renewal of the node's Lease, as in c10d. The window in which "
            f"a node must renew is {_KEEP_ALIVE}",
        )
        if not _RUN_ID.match(params.run_id):
            raise ValueError(
                f"--rdzv-id={params.run_id!r} is not a run id: 1 to 253 printable ASCII "
                "characters without spaces (it prefixes torch's store keys)."
            )
        if os.environ.get(_NO_SHARED_STORE, "0") not in ("", "0"):
            raise ValueError(
                f"{_NO_SHARED_STORE}={os.environ[_NO_SHARED_STORE]} is not supported by the "
                "kubernetes rendezvous backend: the round's rank 0 serves the workers' store "
                "on the port the round names (MASTER_PORT), so the workers cannot start one "
                f"of their own there. Unset {_NO_SHARED_STORE}."
            )
        return cls(
            namespace,
            name,
            read_timeout,
            configured,
            heartbeat_timeout=heartbeat_timeout,
            **{s.conf_key: agent_setting(params, s) for s in tunables.AGENT_SETTINGS},
        )


def _positive_seconds(params: RendezvousParameters, key: str, default: int, meaning: str) -> int:
    """``--rdzv-conf key``, ``default`` if not given; ``ValueError`` unless positive."""
    seconds = params.get_as_int(key, default)
    if seconds is None or seconds <= 0:
        raise ValueError(
            f"--rdzv-conf {key} must be a positive number of seconds: {meaning} ({default})."
        )
    return seconds


def agent_setting(params: RendezvousParameters, setting: tunables.AgentSetting) -> Any:
    """``--rdzv-conf`` ``setting``, else what an annotated Job gave its pods in the
    environment, else its default; checked.

    Raises:
        ValueError: A value ``setting`` does not take, naming where it came from and what
            it takes.
    """
    raw = params.config.get(setting.conf_key)
    said, where = f"--rdzv-conf {setting.conf_key}", ""
    if raw is None and setting.env in os.environ:
        raw, said = os.environ[setting.env], setting.env
        where = f" (from the Job's annotation {objects.GROUP}/{setting.annotation})"
    if raw is None:
        return setting.default
    try:
        return setting.parse(str(raw))
    except ValueError as error:
        raise ValueError(
            f"{said}={raw!r}{where} is refused: {error}. It takes {setting.meaning}."
        ) from None


def _configured_spec(params: RendezvousParameters) -> dict[str, int]:
    """The spec fields ``--rdzv-conf`` gives, by their field in the spec.

    Raises:
        ValueError: One out of its bounds, naming it and the fix.
    """
    configured: dict[str, int] = {}
    for tunable in tunables.SPEC_TUNABLES:
        if tunable.conf_key is not None:
            value = params.get_as_int(tunable.conf_key)
        else:
            interval = params.get_as_int("keep_alive_interval")
            attempts = params.get_as_int("keep_alive_max_attempt")
            if interval is None and attempts is None:
                continue
            if (interval is not None and interval < 1) or (attempts is not None and attempts < 1):
                raise ValueError(
                    "--rdzv-conf keep_alive_interval and keep_alive_max_attempt must be at "
                    f"least 1, got {interval} and {attempts}"
                )
            value = (interval or DEFAULT_KEEP_ALIVE_INTERVAL_SECONDS) * (
                attempts or DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
            )
        if value is None:
            continue
        if problem := _out_of_bounds(tunable, value):
            raise ValueError(
                f"--rdzv-conf {given_as(tunable)}={value} is {problem} ({tunable.meaning}); "
                f"leave it out for {'none' if tunable.default is None else tunable.default}."
            )
        configured[tunable.field] = value
    return configured


def _out_of_bounds(tunable: tunables.SpecTunable, value: int) -> str | None:
    if value < tunable.minimum:
        return (
            f"below its least value, {tunable.minimum} {tunable.unit}: give "
            f"{tunable.minimum} or more"
        )
    if tunable.maximum is not None and value > tunable.maximum:
        return f"above its greatest value, {tunable.maximum} {tunable.unit}"
    return None


def given_as(tunable: tunables.SpecTunable) -> str:
    """How ``--rdzv-conf`` gives ``tunable``."""
    return tunable.conf_key or _KEEP_ALIVE


def parse_endpoint(endpoint: str, default_namespace: str | None) -> tuple[str, str]:
    """``NAME`` or ``NAMESPACE/NAME`` to ``(namespace, name)``.

    Raises:
        ValueError: Not a Rendezvous' name, saying which forms work.
    """
    namespace, _, name = endpoint.strip().rpartition("/")
    namespace = namespace or default_namespace or ""
    if objects.rendezvous_name_problem(name) or objects.rendezvous_name_problem(namespace):
        raise ValueError(
            f"--rdzv-endpoint={endpoint!r} does not name a Rendezvous: use NAME or "
            "NAMESPACE/NAME (DNS labels: at most 63 lowercase letters, digits and '-', no "
            "dots; the namespace defaults to the pod's own"
            + ("" if default_namespace else ", which is unknown here: set POD_NAMESPACE")
            + ")."
        )
    return namespace, name


def spec_to_create(
    min_nodes: int, max_nodes: int, run_id: str, configured: Mapping[str, int]
) -> specs.RendezvousSpec:
    """The spec of a Rendezvous this node creates: torchrun's ``--nnodes`` and
    ``--rdzv-id``, the ``configured`` fields, and the defaults for the others."""
    tuned: dict[str, Any] = {
        tunable.attribute: configured.get(tunable.field, tunable.default)
        for tunable in tunables.SPEC_TUNABLES
    }
    return specs.RendezvousSpec(min_nodes, max_nodes, run_id, **tuned)


def disagreements(
    spec: specs.RendezvousSpec, nnodes: tuple[int, int], configured: Mapping[str, int]
) -> list[str]:
    """Where ``spec`` (of the Rendezvous found) and torchrun's parameters disagree, each
    said for a log line that ends "the resource wins"."""
    found: list[str] = []
    if (spec.min_nodes, spec.max_nodes) != nnodes:
        found.append(
            f"admits {spec.min_nodes}:{spec.max_nodes} nodes but torchrun was given "
            f"--nnodes={nnodes[0]}:{nnodes[1]}"
        )
    for tunable in tunables.SPEC_TUNABLES:
        value = getattr(spec, tunable.attribute)
        if tunable.node_local or configured.get(tunable.field, value) == value:
            continue
        found.append(
            f"sets {given_as(tunable)}={'none' if value is None else value} but --rdzv-conf "
            f"gave {given_as(tunable)}={configured[tunable.field]}"
        )
    return found


def local_address(local_addr: str, pod_ip: str | None) -> str:
    """``--local-addr`` as the operator checks it: one IP address in its canonical form.
    An IP is normalised (``[fd00::7]`` and ``FD00:0::7`` are ``fd00::7``); a host name
    (c10d's default node address is the FQDN) is resolved here, as the operator admits
    only the pod's own IPs: to ``pod_ip`` (``POD_IP``) if it is among its addresses, else
    to its first.

    Raises:
        ValueError: It is neither an IP nor a name that resolves, saying which forms work.
    """
    text = local_addr.strip()
    try:
        return str(ipaddress.ip_address(text.removeprefix("[").removesuffix("]")))
    except ValueError:
        pass
    try:
        found = [str(info[4][0]) for info in socket.getaddrinfo(text, None)]
    except (OSError, UnicodeError) as error:
        raise ValueError(
            f"--local-addr={local_addr!r} is neither an IP address nor a host name that "
            f"resolves here ({error}). Give one of the pod's IPs (the default, from POD_IP), "
            "or a name that resolves to it, e.g. the pod's FQDN in a headless Service."
        ) from error
    addresses = [str(ipaddress.ip_address(address.partition("%")[0])) for address in found]
    with contextlib.suppress(ValueError):  # a malformed POD_IP: the operator will say so
        if pod_ip is not None and (own := str(ipaddress.ip_address(pod_ip))) in addresses:
            return own
    return addresses[0]


def own_pod_name(client: api.RendezvousApi) -> str:
    """This node's name when ``POD_NAME`` is not set: the pod its bound token was issued
    for (one SelfSubjectReview at start), else the hostname. Not the hostname first: the
    pods of an Indexed Job with a subdomain (JobSet's, Kubeflow Trainer's) are named
    ``<job>-<index>-<suffix>`` but have ``<job>-<index>`` as their hostname."""
    try:
        _, pod = client.identity()
    except RendezvousError as error:
        log.warning(
            "POD_NAME is not set and this node could not ask whose token it holds (%s); "
            "taking the hostname %s as its pod's name",
            error,
            socket.gethostname(),
        )
        pod = None
    return pod or socket.gethostname()


def claim_node(reference: str, node: str) -> socket.socket:
    """Hold the name ``node`` for this agent, in ``reference``, while it lives: an abstract
    Unix socket, which every container of the pod sees (they share its network namespace)
    and the kernel frees with the process, however it ends.

    Raises:
        KubernetesRendezvousStateError: Another agent of this pod holds it.
    """
    key = hashlib.sha256(f"{reference}/{node}".encode()).hexdigest()[:32]
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0k8s-rendezvous-node-{key}")
    except OSError as error:
        claim.close()
        if error.errno != errno.EADDRINUSE:
            raise
        # Two agents under one node name would share its Lease: each join would overwrite
        # the other's request, and neither would ever be admitted.
        raise KubernetesRendezvousStateError(messages.another_agent(node, reference)) from error
    return claim
