"""The reasons and messages of the Events the operator posts and of the conditions it sets,
in one place: users filter and alert on the reasons (``kubectl get events --field-selector
reason=NodeRefused``) and read the messages, so each is part of the interface. A message
names its own problem and its fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from k8s_rendezvous.wire import leases, objects, statuses
from k8s_rendezvous.wire.specs import RendezvousSpec

# On a Rendezvous: its rounds.
ROUND_SEALED: Final = "RoundSealed"
"""A round was sealed (also ``Ready``'s reason while it stands)."""
MEMBER_LOST: Final = "MemberLost"
"""A member left the sealed round; the message gives its ``LOST_*`` reason."""
WAITER_EXPIRED: Final = "WaiterExpired"
"""A node asking to join is not counted: its agent stopped renewing its Lease."""
CLOSED: Final = "Closed"
"""The rendezvous closed; the message gives its ``CLOSED_*`` reason."""
# On a Rendezvous: what it is not told, or refuses.
NODE_REFUSED: Final = "NodeRefused"
"""A node's request is refused; the message says why (a ``REFUSED_*`` reason)."""
INVALID_ENTRY: Final = "InvalidEntry"
"""A node's Lease holds a request this operator cannot read."""
INVALID_RENDEZVOUS: Final = "InvalidRendezvous"
"""The Rendezvous does not decode, or the API server refuses its next status."""
STATUS_TOO_LARGE: Final = "StatusTooLarge"
"""The next status of the Rendezvous is larger than the API server stores (etcd's limit);
no round is decided until it fits."""
NODE_WITHOUT_POD: Final = "NodeWithoutPod"
"""A node asks to join under the name of a pod that does not exist."""
NO_OWNER: Final = "NoOwner"
"""A pod-made Rendezvous could not be given its creator's workload as its owner."""
HEALTH_CHECK_FAILED: Final = "HealthCheckFailed"
"""Also on the pod: its health check failed before a join, so it joins no round."""
CLEAR_EXCLUDED_NODES_UNREADABLE: Final = "ClearExcludedNodesUnreadable"
"""The clear annotation of a Rendezvous is not a time: the excluded nodes stay."""
# On an annotated Job (and a pod of it).
RENDEZVOUS_CREATED: Final = "RendezvousCreated"
"""The operator made the Job's Rendezvous."""
RENDEZVOUS_RECREATED: Final = "RendezvousRecreated"
"""The Job's own Rendezvous was deleted while it runs, and made anew."""
RENDEZVOUS_NOT_OWNED: Final = "RendezvousNotOwned"
"""A Rendezvous of the Job's name is not the Job's, and is left as it is."""
RENDEZVOUS_REPLACED: Final = "RendezvousReplaced"
"""Also on the workload (or the pod) whose pod-made Rendezvous was replaced; and, for a
pod-made Rendezvous named after another workload, on both workloads."""
INVALID_ANNOTATION: Final = "InvalidAnnotation"
"""The Job's ``k8s-rendezvous.dev/`` annotations have errors: no Rendezvous is made."""
RUN_ID_IMMUTABLE: Final = "RunIdImmutable"
"""The Job's annotations ask for another runId than its Rendezvous keeps."""
SERVICE_ACCOUNT_NOT_FOUND: Final = "ServiceAccountNotFound"
"""The Job's ServiceAccount does not exist: the worker role is not bound yet."""
POD_NOT_INJECTED: Final = "PodNotInjected"
"""A pod of the Job was made without the env that points torchrun here."""
POD_LOSSES_END_JOB: Final = "PodLossesEndJob"
"""The Job counts pods lost to disruptions (drains, preemptions, lost nodes) as failures."""

# Why a member left a round: MemberLost's message, the cause of the next round in
# ``status.history``, an ``excludedNodes`` entry's reason, the members-lost metric's label.
LOST_POD_DELETED: Final = "PodDeleted"
"""Its pod was deleted (a drain, an eviction, a scale-down: planned)."""
LOST_POD_TERMINATING: Final = "PodTerminating"
"""Its pod is being deleted: gone at once, not at the end of its grace period."""
LOST_POD_FAILED: Final = "PodFailed"
"""Its pod failed."""
LOST_POD_SUCCEEDED: Final = "PodSucceeded"
"""Its pod succeeded: its work is done (the rendezvous closes, ``NodeFinished``)."""
LOST_POD_NOT_FOUND: Final = "PodNotFound"
"""Its pod does not exist (a restarted operator looked, and found none)."""
LOST_CONTAINER_RESTARTED: Final = "ContainerRestarted"
"""Its pod's containers restarted since it was admitted."""
LOST_AGENT_RESTARTED: Final = "AgentRestarted"
"""Another agent instance writes its Lease: torchrun restarted inside the container."""
LOST_LEFT: Final = "Left"
"""Its agent left (``shutdown()`` of a failed agent)."""
LOST_ENTRY_REMOVED: Final = "EntryRemoved"
"""Its Lease, or the request in it, is gone (deleted by hand, or collected)."""
LOST_HEARTBEAT_EXPIRED: Final = "HeartbeatExpired"
"""Its agent did not renew its Lease within ``heartbeatTimeoutSeconds``."""
LOST_UNREACHABLE: Final = "AgentUnreachable"
"""Its agent answered none of the operator's probes for the probe window."""
LOST_HEALTH_CHECK_FAILED: Final = HEALTH_CHECK_FAILED
"""Its agent left because its health check failed before its next join."""
LOST_REASONS: Final = (
    LOST_POD_DELETED,
    LOST_POD_TERMINATING,
    LOST_POD_FAILED,
    LOST_POD_SUCCEEDED,
    LOST_POD_NOT_FOUND,
    LOST_CONTAINER_RESTARTED,
    LOST_AGENT_RESTARTED,
    LOST_LEFT,
    LOST_ENTRY_REMOVED,
    LOST_HEARTBEAT_EXPIRED,
    LOST_UNREACHABLE,
    LOST_HEALTH_CHECK_FAILED,
)

# Why a rendezvous closed: ``status.closedReason``, the ``Closed`` condition's reason, the
# closures metric's label.
CLOSED_BY_NODE: Final = "ClosedByNode"
"""A node called ``set_closed()``."""
CLOSED_ALL_LEFT: Final = "AllNodesLeft"
"""Every member of the last round left, and none waits."""
CLOSED_NODE_FINISHED: Final = "NodeFinished"
"""A member finished (its workers succeeded): the round's work is ending."""
CLOSED_JOB_COMPLETE: Final = "JobComplete"
"""The annotated Job completed."""
CLOSED_JOB_FAILED: Final = "JobFailed"
"""The annotated Job failed."""
CLOSED_RESTARTS_EXHAUSTED: Final = statuses.CLOSED_RESTARTS_EXHAUSTED
"""A failure found the job's restart budget (``spec.maxRestarts``) spent. The pod side
reads it too (a spare ends in failure then), so the wire format holds its value."""
CLOSED_REASONS: Final = (
    CLOSED_BY_NODE,
    CLOSED_ALL_LEFT,
    CLOSED_NODE_FINISHED,
    CLOSED_JOB_COMPLETE,
    CLOSED_JOB_FAILED,
    CLOSED_RESTARTS_EXHAUSTED,
)

# Why a node's request is refused: ``status.refused``, the reason the node ends with
# (``NodeRefusedError``), the refusals metric's label.
REFUSED_NO_RULE: Final = "NoWorkload"
"""The Rendezvous has no controller owner and no ``spec.podSelector``."""
REFUSED_OTHER_WORKLOAD: Final = "OtherWorkload"
"""The pod is not of the workload that owns the Rendezvous."""
REFUSED_SELECTOR: Final = "SelectorMismatch"
"""The pod's labels do not match ``spec.podSelector``."""
REFUSED_ADDRESS: Final = "AddressNotThePods"
"""The address the node offers is not one of its pod's IPs."""
REFUSED_REASONS: Final = (
    REFUSED_NO_RULE,
    REFUSED_OTHER_WORKLOAD,
    REFUSED_SELECTOR,
    REFUSED_ADDRESS,
)

# Causes of a round, in ``status.history`` (a member lost: that loss's reason, a
# ``LOST_*``).
CAUSE_FIRST_ROUND: Final = "FirstRound"
CAUSE_NODES_JOINED: Final = "NodesJoined"
CAUSE_MEMBER_REJOINED: Final = "MemberRejoined"
CAUSE_SPEC_CHANGED: Final = "SpecChanged"

# Conditions (``Ready`` and ``Closed``; their types are in :mod:`.rounds`). ``Ready``'s
# reason while a round forms is the state itself (``Forming``, ``Reforming``).
OPEN: Final = "Open"
"""``Closed`` is False: rounds can still be formed."""
OPEN_MESSAGE: Final = "rounds can still be formed"
READY_CLOSED_MESSAGE: Final = "the rendezvous is closed"
"""``Ready`` is False, reason :data:`CLOSED`."""


def ready_message(round_: int, world_size: int, master: str) -> str:
    return f"round {round_}: {world_size} nodes, master {master}"


def forming_message(round_: int) -> str:
    return f"forming round {round_}"


# ``SparesReady`` (set while ``spec.spares`` is); SPARES_SHORT is also the Warning posted
# when it turns False.
SPARES_WAITING: Final = "SparesWaiting"
SPARES_SHORT: Final = "SparesShort"


def spares_message(waiting: int, declared: int) -> str:
    said = f"{waiting} of {declared} declared spare(s) wait beyond the full round"
    if waiting >= declared:
        return said
    return (
        f"{said}: a member lost now is replaced only when the workload makes another pod "
        "that joins (an annotated Job: pods beyond maxNodes); see kubectl get pods for "
        "pending or failing ones"
    )


# Why a rendezvous closed (``status.closedMessage``, the ``Closed`` condition and Event).


def closed_by_node(pod: str) -> str:
    return f"pod {pod} called set_closed()"


def closed_node_finished(pod: str, round_: int) -> str:
    return (
        f"pod {pod} of round {round_} finished (its workers succeeded): no further round "
        "forms, and the other members finish their work"
    )


def closed_all_left(round_: int) -> str:
    return f"every node of round {round_} left and none is waiting"


def closed_restarts_exhausted(max_restarts: int, round_: int, cause: str) -> str:
    return (
        f"round {round_} failed ({cause}) with the job's restart budget spent: "
        f"{max_restarts} restart(s) after failures already taken (spec.maxRestarts). "
        "Every agent ends with RendezvousClosedError; to let the job go on, raise "
        "spec.maxRestarts (an annotated Job: k8s-rendezvous.dev/max-restarts) and start it anew"
    )


# Events on a Rendezvous (and the Job that controls it): its rounds.


def member_lost(pod: str, rank: int, round_: int, why: str) -> str:
    return f"pod {pod} (rank {rank} of round {round_}) left the round: {why}"


def cause_members_lost(pods: Sequence[tuple[str, int]], why: str) -> str:
    """``pods``: the members lost (pod, rank), the first one's reason ``why``."""
    (pod, rank), more = pods[0], len(pods) - 1
    return f"pod {pod} (rank {rank}) lost: {why}" + (f", and {more} more" if more else "")


def cause_nodes_joined(count: int) -> str:
    return f"{count} node(s) asked to join and fit under maxNodes"


def cause_member_rejoined(pod: str) -> str:
    return f"pod {pod} asked to join again (its agent restarts its workers)"


def cause_spec_changed(world_size: int, spec: RendezvousSpec) -> str:
    return (
        f"a world of {world_size} is outside minNodes..maxNodes {spec.min_nodes}..{spec.max_nodes}"
    )


def waiter_expired(pod: str, timeout_seconds: int) -> str:
    return (
        f"pod {pod} asked to join but its agent has not renewed its Lease for "
        f"{timeout_seconds} s (heartbeatTimeoutSeconds), so it is not counted: its torchrun "
        "has probably died while the pod runs on. It counts again once it renews (a new "
        f"torchrun joins anew); else check the pod: kubectl logs {pod}"
    )


MAX_EVENT_MESSAGE: Final = 1024
"""What an Event's message may hold before kopf cuts out its middle; a health check's
report is cut to fit instead, so that its output's last lines (where a test says why)
are what is shown."""


def health_check_failed(pod: str, node: str | None, report: leases.HealthCheckReport) -> str:
    """A pod's failed health check, on the Kubernetes node the Pod object names (never
    where the pod says it runs); its output's tail, printable and cut to fit the Event."""
    where = f"on node {node}" if node else "on a node not known (its Pod is gone or unscheduled)"
    head = (
        f"pod {pod} {where} joins no round: its health check {report.summary()}; its agent "
        "ends so that its workload replaces it. Output ends: "
    )
    tail = leases.printable_tail(report.tail, max(0, MAX_EVENT_MESSAGE - len(head)))
    return head + (tail or "(none)")


INVALID_ANNOTATIONS_NAMED: Final = 3
"""How many of a Job's annotation errors its one Warning names (a Job may carry thousands
of keys: one Event each would be as many)."""


def invalid_annotations(errors: Sequence[str]) -> str:
    named = "; ".join(errors[:INVALID_ANNOTATIONS_NAMED])
    more = len(errors) - INVALID_ANNOTATIONS_NAMED
    return named + (f"; and {more} more (the operator's log names each)" if more > 0 else "")


def round_sealed(
    round_: int, members: Sequence[str], master: str, forming_seconds: float | None
) -> str:
    """Names the first 8 members; ``forming_seconds`` from the first join, if known."""
    names = ", ".join(members[:8])
    more = f" and {len(members) - 8} more" if len(members) > 8 else ""
    took = "" if forming_seconds is None else f" {forming_seconds:.3f} s after the first join;"
    return f"round {round_} sealed with {len(members)} nodes ({names}{more});{took} master {master}"


def closed(reason: str | None, message: str | None) -> str:
    return f"{reason}: {message}"


# Warnings on a Rendezvous: what it is not told, or refuses.


# Why a node's request is refused (NodeRefused's message, and the refused node's error).


def refused_no_rule(rendezvous: str, pod: str) -> str:
    return (
        f"Rendezvous {rendezvous} has no controller owner and no spec.podSelector, so no pod "
        f"can be checked as one of its workload's and pod {pod} is not admitted. Set "
        "spec.podSelector to the labels of the job's pods."
    )


def refused_other_workload(rendezvous: str, pod: str, controller: str, owner: str | None) -> str:
    return (
        f"pod {pod} is controlled by {controller}, not by {owner}, which owns Rendezvous "
        f"{rendezvous}: only that workload's pods may join it."
    )


def refused_selector(rendezvous: str, pod: str, selector: str) -> str:
    return (
        f"pod {pod}'s labels do not match spec.podSelector of Rendezvous {rendezvous} "
        f"({selector}): only the pods it selects may join it."
    )


def refused_address(pod: str, addr: str, ips: Sequence[str]) -> str:
    return (
        f"pod {pod} offers address {addr!r}, which is not one of its pod's IPs "
        f"({', '.join(ips)}): other nodes would connect there. Leave --local-addr unset, or "
        "set it to one of the pod's IPs."
    )


def invalid_entry(pod: str, problem: str) -> str:
    return (
        f"pod {pod} wrote a request this operator cannot read, so it is not counted: "
        f"{problem}. Run the same k8s-rendezvous version in the pods as in the operator."
    )


def node_without_pod(pod: str, namespace: str, lease: str) -> str:
    return (
        f"node {pod} asks to join (Lease {lease}), but no Pod {pod} exists in namespace "
        f"{namespace}: only pods of the workload are admitted. Run torchrun in the workload's "
        "pods, with POD_NAME set to the pod's name (the downward API's metadata.name)."
    )


def no_owner(rendezvous: str, creator: str, pod_exists: bool) -> str:
    why = "has no controller (a bare pod)" if pod_exists else "no longer exists"
    return (
        f"Rendezvous {rendezvous} was made by pod {creator}, which {why}: there is no workload "
        "to check its nodes against, so it admits nobody. Run torchrun in pods of a "
        "controller (a Job, JobSet, StatefulSet...), or set spec.podSelector to the "
        "labels of the job's pods."
    )


def unreadable(error: object) -> str:
    return f"cannot be read, no round is decided: {error}"


def write_refused(error: object) -> str:
    return f"its next status was refused, no round is decided: {error}"


def status_too_large(members: int, size: int, error: object, retry_seconds: float) -> str:
    """Also the ``Ready`` condition's message, reason :data:`STATUS_TOO_LARGE`."""
    return (
        f"its next status ({members} members, {size / 2**20:.2f} MiB) is larger than the API "
        f"server stores ({error}); no round is decided until it fits. Lower spec.maxNodes, "
        "or raise the limit (etcd --max-request-bytes, 1.5 MiB by default). Tried again "
        f"when the Rendezvous changes, or in {retry_seconds:.0f} s."
    )


def invalid_rendezvous(rendezvous: str, problem: str) -> str:
    """Also the ``Ready`` condition's message, reason :data:`INVALID_RENDEZVOUS`."""
    return (
        f"{problem}. Fix the field (kubectl edit rdzv {rendezvous} --subresource=status) or "
        "recreate the Rendezvous."
    )


# On an annotated Job (and a pod of it).


def rendezvous_created(rendezvous: str, spec: RendezvousSpec) -> str:
    return (
        f"Rendezvous {rendezvous} for {spec.min_nodes}:{spec.max_nodes} nodes, run id {spec.run_id}"
    )


def rendezvous_recreated(rendezvous: str, spec: RendezvousSpec) -> str:
    return (
        f"{rendezvous_created(rendezvous, spec)} was deleted while the Job runs, and is made "
        "anew: its nodes join its first round. Delete the Job to stop the run."
    )


def rendezvous_not_owned(rendezvous: str, namespace: str, owner: str | None, selects: bool) -> str:
    """A Rendezvous of the Job's name that no pod made (``owner``: ``Kind/name``, if any)."""
    if owner is not None:
        held = f"it is owned by {owner}"
    elif selects:
        held = "it admits the pods its spec.podSelector matches"
    else:
        held = "it has no owner"
    return (
        f"Rendezvous {rendezvous} exists and is not this Job's: a user or another "
        f"controller made it, not a pod (it has no {objects.CREATED_BY_ANNOTATION} "
        f"annotation), and {held}. The operator leaves it as it is, so this Job's pods get "
        "no env and join nothing; it makes this Job's Rendezvous as soon as the name is "
        f"free. Delete it if it is not in use (kubectl -n {namespace} delete rendezvous "
        f"{rendezvous}), or rename the Job."
    )


def _made_by(creator: str, owner: str | None) -> str:
    return f"pod {creator}" + ("" if owner is None else f" (of {owner})")


def rendezvous_replaced(rendezvous: str, creator: str, owner: str | None) -> str:
    """On the Job: a pod-made Rendezvous of its name was deleted and the Job's made."""
    who = owner or f"pod {creator}"
    return (
        f"Rendezvous {rendezvous} had been made by {_made_by(creator, owner)}, not for this "
        "Job. The name of an annotated Job's Rendezvous is its Job's in its namespace, so "
        "the operator deleted that one and makes this Job's in its place. If "
        f"{who} uses rendezvous {rendezvous} on purpose, its pods are now refused at their "
        "join: rename one of the two (this Job, or that workload's --rdzv-endpoint)."
    )


def rendezvous_replaced_for_workload(
    rendezvous: str, creator: str, owner: str | None, job: str
) -> str:
    """On the workload (or the bare pod) whose pod made the replaced Rendezvous."""
    return (
        f"Rendezvous {rendezvous}, made by {_made_by(creator, owner)}, was deleted by the "
        f"k8s-rendezvous operator and made anew for Job {job}: the name of an annotated "
        f"Job's Rendezvous is its Job's in its namespace. The pods of "
        f"{owner or 'pod ' + creator} are refused from Rendezvous {rendezvous} from now on: "
        f"give their torchrun another --rdzv-endpoint, or rename Job {job}."
    )


def rendezvous_given_back(rendezvous: str, creator: str, owner: str | None, workload: str) -> str:
    """On the workload a pod-made Rendezvous is named after, whose pods asked to join it:
    the operator deleted it, for them to make it anew."""
    who = owner or f"pod {creator}"
    return (
        f"Rendezvous {rendezvous} had been made by {_made_by(creator, owner)}, not by a pod "
        f"of {workload}, whose pods asked to join it. A Rendezvous named after a workload of "
        f"its namespace is that workload's, whatever made it first, so the operator deleted "
        f"that one, and the pods of {workload} make it anew (their creator role). If {who} "
        f"uses rendezvous {rendezvous} on purpose, its pods are now refused at their join: "
        "rename one of the two (that workload's --rdzv-endpoint, or this one)."
    )


def rendezvous_taken_back(rendezvous: str, creator: str, owner: str | None, workload: str) -> str:
    """On the workload (or the bare pod) whose pod made the Rendezvous given back."""
    return (
        f"Rendezvous {rendezvous}, made by {_made_by(creator, owner)}, was deleted by the "
        f"k8s-rendezvous operator: it is named after {workload} of this namespace, whose "
        "pods asked to join it, and a Rendezvous named after a workload is that workload's. "
        f"The pods of {owner or 'pod ' + creator} are refused from Rendezvous {rendezvous} "
        "from now on: give their torchrun another --rdzv-endpoint."
    )


def rendezvous_not_given_back(
    rendezvous: str, namespace: str, creator: str, owner: str | None, workload: str, error: object
) -> str:
    """A pod-made Rendezvous named after another workload that the operator could not delete."""
    return (
        f"Rendezvous {rendezvous} was made by {_made_by(creator, owner)}, not by a pod of "
        f"{workload}, whose pods ask to join it, and the operator could not delete it: "
        f"{error}. Its pods wait meanwhile. Delete it (kubectl -n {namespace} delete "
        f"rendezvous {rendezvous}): the pods of {workload} make it anew."
    )


def rendezvous_not_replaced(
    rendezvous: str, namespace: str, creator: str, owner: str | None, error: object
) -> str:
    """A pod-made Rendezvous of the Job's name the operator could not delete."""
    return (
        f"Rendezvous {rendezvous} was made by {_made_by(creator, owner)}, not for this Job, "
        f"and the operator could not delete it to make this Job's: {error}. Delete it "
        f"(kubectl -n {namespace} delete rendezvous {rendezvous}): the operator makes this "
        "Job's at once. Or rename the Job."
    )


def run_id_immutable(rendezvous: str, kept: object, asked: str) -> str:
    return (
        f"Rendezvous {rendezvous} keeps runId {kept!r}; the annotation asks for {asked!r}. "
        "Use a new Job for a new run."
    )


def service_account_not_found(account: str) -> str:
    return (
        f"ServiceAccount {account} does not exist, so the worker role is not bound for it "
        "(and the Job cannot create pods). Create it, or name an existing one in the pod "
        "template; the role is bound then."
    )


def pod_not_injected(pod: object, job: str) -> str:
    return (
        f"pod {pod} of Job {job} was made without the env that points torchrun at Rendezvous "
        f"{job} (PET_RDZV_BACKEND and the rest): nothing injected it when it was created (the "
        "webhook's failure policy lets pods through during an operator rollout or leader "
        "change, and the injection policy, where the cluster serves it, needs the Job's "
        f"Rendezvous to exist). A plain torchrun in it trains alone. Delete pod {pod}: the Job "
        "replaces it, with the env."
    )


def pod_losses_end_job(job: str, losses: int, per_index: bool, restart_policy_never: bool) -> str:
    """A Job whose failure settings end it after a few pods lost to disruptions, and the
    Job to make instead (docs/annotations.md shows it whole)."""
    if per_index:
        ends = (
            f"{losses} on one index (backoffLimitPerIndex + 1) fail that index for good, "
            "and the Job with it"
        )
    else:
        ends = f"{losses} (backoffLimit + 1) fail the whole Job"
    never = "" if restart_policy_never else ", with restartPolicy: Never in its pod template"
    return (
        f"Job {job} counts a pod lost to a node drain, a preemption, an eviction or a lost "
        f"node as failed, as the Job API does by default: {ends}, however well the survivors "
        "train on. Make it anew with a podFailurePolicy whose rules ignore disruptions "
        "({action: Ignore, onPodConditions: [{type: DisruptionTarget}]})"
        f"{never}; completionMode: Indexed with backoffLimitPerIndex also keeps the Job "
        "controller's back-off per pod, not for the whole Job (docs: Annotated Jobs, the "
        "production Job)."
    )


def clear_excluded_nodes_unreadable(problem: str) -> str:
    return (
        f"{problem}; the Kubernetes nodes in status.excludedNodes are kept out until it is "
        "fixed. Write the time to clear up to, e.g. "
        f"kubectl annotate rdzv NAME --overwrite {objects.CLEAR_EXCLUDED_NODES_ANNOTATION}="
        '"$(date -u +%Y-%m-%dT%H:%M:%SZ)"'
    )
