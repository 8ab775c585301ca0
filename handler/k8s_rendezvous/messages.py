"""What the pod side tells its user when a join cannot go on, in one place, as the
operator's reasons module holds what it posts: each message names its problem and its fix,
and is part of the interface (torchrun prints it as the agent's error). Pure text, no I/O;
``reference`` is always the Rendezvous as ``Rendezvous <namespace>/<name>``."""

from __future__ import annotations

from k8s_rendezvous.wire import objects, specs, views


def another_agent(node: str, reference: str) -> str:
    return (
        f"another torchrun agent of pod {node} already joins {reference}: a pod is one node "
        "of a rendezvous, with one Lease. Run one torchrun per pod (more workers: "
        "--nproc-per-node), or give each agent its own pod."
    )


def joins_no_more(node: str, reference: str, called: str) -> str:
    return (
        f"node {node} called {called} on {reference}: it joins no further round. Start a "
        "new torchrun to join again."
    )


def no_store_port(node: str, reference: str, error: OSError) -> str:
    return (
        f"node {node} could not open a port for its store to join {reference}: {error}. "
        "Check the pod's open-file limit."
    )


def unhealthy(node: str, reference: str, check: str, how: str, tail: str) -> str:
    return (
        f"node {node} joins no round of {reference}: its health check ({check}) {how}. Its "
        f"output ends: {tail[-256:]!r}. The agent ends in failure so that its workload "
        "replaces the pod; `kubectl describe rdzv` shows a HealthCheckFailed Warning naming "
        "the Kubernetes node."
    )


def refused(node: str, reference: str, reason: str, message: str) -> str:
    return f"the operator refused node {node}'s request to join {reference} ({reason}): {message}"


def rank_zero_silent(round_number: int, rank_zero_node: str | None, endpoint: str) -> str:
    """Why a node asks again (logged): not an error."""
    return (
        f"round {round_number} went stale before its rank 0 (pod {rank_zero_node}) answered "
        f"at {endpoint}"
    )


def token_of_another_pod(node: str, reference: str, pod: str) -> str:
    return (
        f"node {node} runs with the token of pod {pod}, so it is not the node it names: no "
        f"round of {reference} can include it. Set POD_NAME to the pod's own name (the "
        "downward API's metadata.name), or leave it unset: the node then takes its pod's "
        "name from its token."
    )


def not_a_pod(node: str, reference: str, namespace: str, user: str) -> str:
    return (
        f"no Pod {node} exists in namespace {namespace}, and node {node} runs as {user}, not "
        "as a pod: the operator admits only pods of the Rendezvous' workload, so no round of "
        f"{reference} can include it. Run torchrun in the workload's pods, with their service "
        "account token, and POD_NAME set to the pod's name."
    )


def deleted(node: str, reference: str, namespace: str, name: str, within: float) -> str:
    return (
        f"{reference} was deleted while node {node} waited to join, and was not made anew "
        f"within {within:.0f} s: no round can form. An annotated Job's "
        "Rendezvous is made anew by the operator while the Job runs (check it runs: kubectl "
        f"get events -n {namespace} --field-selector involvedObject.name={name}); any other "
        "is made by torchrun when its pod may create it (the creator role), or by hand."
    )


def store_not_served(
    node: str, reference: str, round_number: int, port: int, error: Exception
) -> str:
    return (
        f"node {node} is rank 0 of round {round_number} of {reference} but could not serve "
        f"the round's store on port {port}: {error}. The next next_rendezvous() joins a new "
        "round."
    )


def store_unreachable(
    node: str,
    reference: str,
    *,
    rank: int,
    round_number: int,
    endpoint: str,
    rank_zero_node: str | None,
    timeout: float,
    error: Exception,
) -> str:
    return (
        f"node {node} is rank {rank} of round {round_number} of {reference} but could not "
        f"reach the round's store at {endpoint} (rank 0, pod {rank_zero_node}) within "
        f"{timeout:.0f} s: {error}. Rank 0 has probably left, died or stalled since the round "
        "was sealed; the next next_rendezvous() joins a new round."
    )


def invalid_spec(reference: str, error: Exception) -> str:
    return f"{reference} has an invalid spec: {error}"


def other_run(reference: str, run_id: str, given: str) -> str:
    return (
        f"{reference} has runId {run_id!r} but torchrun was given --rdzv-id={given!r}: its "
        f"rounds are another run's. Give every node --rdzv-id={run_id} (an annotated Job's "
        "pods get it as PET_RDZV_ID: drop --rdzv-id from the command), or use another "
        "Rendezvous."
    )


def timed_out(
    node: str,
    reference: str,
    namespace: str,
    name: str,
    timeout: int,
    spec: specs.RendezvousSpec,
    status: views.NodeView,
) -> str:
    members = ", ".join(status.member_nodes) or (
        f"{status.world_size}, listed in its status" if status.world_size else "none"
    )
    return (
        f"no round of {reference} included node {node} within {timeout} s "
        f"(minNodes={spec.min_nodes}, maxNodes={spec.max_nodes}); it is "
        f"{status.state.value} after round {status.round} (members: {members}). The nodes "
        f"that asked to join hold the Leases of `kubectl get leases -n {namespace} -l "
        f"{objects.NODE_LABEL}={name}`; check that the operator runs (kubectl describe rdzv "
        f"{name} -n {namespace}) and that enough pods are scheduled."
    )


def spare_released(node: str, reference: str, reason: str | None, message: str | None) -> str:
    return (
        f"{reference} closed ({reason}: {message}) while node {node} waited as a spare (its "
        "round was full): it was not needed, and ends without having trained."
    )


def closed(reference: str, reason: str | None, message: str | None) -> str:
    return (
        f"{reference} is closed ({reason}: {message}); no further round will be formed. "
        "Create a new Rendezvous (or a new Job) to run again."
    )
