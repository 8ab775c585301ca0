"""The reconciler's orchestration (``k8s_rendezvous_operator.reconciler``) against an
in-memory API door that satisfies ``kube.ReconcilerApi``, with a fixed clock.

Aspects: a round is sealed in one status write and reported after it; a join that changes
only ``formingSince`` costs no write, and the remembered start times the seal; a conflict
is decided again on the fresh object; a refused write is said once and not retried; a
status too large to store is said in a condition and one Warning, held while the
Rendezvous does not change, and tried again when it does or when the hold's wait ends; a
failed reconcile is retried under the backoff policy, counted from 0 again after a success; a
round is never sealed with a pod before the pod is looked at; a deleted rendezvous is
forgotten whole; slices are written only when their content changes; each version of a
Rendezvous is decoded once however many passes read it, and one that does not decode is
refused once, where users look.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from k8s_rendezvous import backoff
from k8s_rendezvous.wire import leases, objects, records, specs, statuses
from k8s_rendezvous_operator import (
    kube,
    metrics,
    reasons,
    reconciler,
    rendezvous_view,
    rounds,
    workloads,
)

NS = "ns"
NAME = "r"
KEY = (NS, NAME)
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
APP = {"app": "train"}


class FakeApi:
    """Rendezvous, pods and writes kept in memory; each object's resourceVersion grows
    with each write. ``label_pod`` of a pod that does not exist is a NotFound, as on a
    real API server."""

    def __init__(self) -> None:
        self.rendezvous: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.status_writes: list[dict[str, Any]] = []
        self.slice_writes: list[tuple[int, dict[str, Any]]] = []
        self.refuse_next_write: kube.ApiError | None = None
        self.members_stored: int | None = None
        """A status of more members is refused as too large (etcd's limit, scaled down)."""
        self.unavailable_writes = 0
        """The next writes that fail as if the API server did not answer."""
        self.refused_writes = 0
        self.written = threading.Event()
        """Set at each status write that reaches this door, refused or not."""
        self.labelled = threading.Event()
        self.deleted: list[tuple[str, str]] = []
        self.leases: dict[str, tuple[str, str]] = {}
        """Each node's Lease, by name: its uid and resourceVersion."""
        self.lease_deletes: list[str] = []
        """Every delete of a Lease asked, refused or not."""
        self.pod_reads: list[str] = []
        self.refuse_lease_deletes: kube.ApiError | None = None
        self.controllers: dict[str, dict[str, Any]] = {}
        """The pods' controllers, by uid, as read on the way up to their workload."""
        self._version = 100

    def _bump(self, body: dict[str, Any]) -> dict[str, Any]:
        self._version += 1
        body["metadata"]["resourceVersion"] = str(self._version)
        return body

    def get_rendezvous(self, namespace: str, name: str) -> dict[str, Any]:
        if name not in self.rendezvous:
            raise kube.NotFound(name, 404)
        return dict(self.rendezvous[name])

    def write_status(
        self, namespace: str, name: str, resource_version: str, fields: dict[str, Any]
    ) -> dict[str, Any]:
        body = self.rendezvous.get(name)
        if body is None:
            raise kube.NotFound(name, 404)
        self.written.set()
        if self.refuse_next_write is not None:
            error, self.refuse_next_write = self.refuse_next_write, None
            raise error
        if self.unavailable_writes:
            self.unavailable_writes -= 1
            raise kube.Unavailable("connection refused")
        if self.members_stored is not None and len(fields.get("members") or ()) > (
            self.members_stored
        ):
            self.refused_writes += 1
            raise kube.TooLarge("etcdserver: request is too large", 500)
        if body["metadata"]["resourceVersion"] != resource_version:
            raise kube.Conflict(name, 409)
        self.status_writes.append(fields)
        status = dict(body.get("status") or {})
        status.update(fields)
        body = self.rendezvous[name] = self._bump(
            {**body, "metadata": dict(body["metadata"]), "status": status}
        )
        return dict(body)

    def write_slice(
        self,
        namespace: str,
        rendezvous: str,
        rendezvous_uid: str,
        index: int,
        content: Mapping[str, Any],
    ) -> None:
        self.slice_writes.append((index, dict(content)))

    def unlabelled_job_pods(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        return []

    def label_pod(self, namespace: str, pod: str, rendezvous: str) -> dict[str, Any]:
        try:
            if pod not in self.pods:
                raise kube.NotFound(pod, 404)
            body = self.pods[pod]
            body["metadata"]["labels"][objects.NODE_LABEL] = rendezvous
            return dict(self._bump(body))
        finally:
            self.labelled.set()

    def create_rendezvous(
        self, namespace: str, name: str, spec: specs.RendezvousSpec, owner: dict[str, Any]
    ) -> dict[str, Any] | None:
        raise AssertionError("no annotated Job here")

    def patch_rendezvous_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        raise AssertionError("no annotated Job here")

    def delete_rendezvous(self, namespace: str, name: str, uid: str) -> None:
        if self.rendezvous.get(name, {}).get("metadata", {}).get("uid") != uid:
            raise kube.Conflict(name, 409)
        self.deleted.append((name, uid))
        del self.rendezvous[name]

    def service_account_exists(self, namespace: str, name: str) -> bool:
        raise AssertionError("no annotated Job here")

    def bind_worker_role(
        self, namespace: str, job: str, job_uid: str, service_account: str, cluster_role: str
    ) -> None:
        raise AssertionError("no annotated Job here")

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    def get_owner(self, namespace: str, reference: workloads.Reference) -> dict[str, Any] | None:
        return self.controllers.get(reference.uid)

    def get_pod(self, namespace: str, pod: str) -> dict[str, Any] | None:
        self.pod_reads.append(pod)
        return self.pods.get(pod)

    def pod_node_name(self, namespace: str, pod: str) -> str | None:
        found = self.pods.get(pod)
        return None if found is None else found["spec"].get("nodeName")

    def adopt_rendezvous(
        self, namespace: str, name: str, uid: str, owner: dict[str, Any]
    ) -> dict[str, Any]:
        raise AssertionError("made with a pod selector: nobody to adopt it")

    def node_labels(self, node: str) -> dict[str, str]:
        return {"zone": "a"}

    def delete_lease(self, namespace: str, name: str, uid: str, resource_version: str) -> None:
        self.lease_deletes.append(name)
        if self.refuse_lease_deletes is not None:
            raise self.refuse_lease_deletes
        if name not in self.leases:
            raise kube.NotFound(name, 404)
        if self.leases[name] != (uid, resource_version):
            raise kube.Conflict(name, 409)
        del self.leases[name]

    # -- the test's side -----------------------------------------------------------------

    def add_rendezvous(self, spec: specs.RendezvousSpec, status: statuses.RendezvousStatus | None):
        body: dict[str, Any] = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {"name": NAME, "namespace": NS, "uid": "uid-r", "generation": 1},
            "spec": spec.to_dict(),
            "status": {} if status is None else status.operator_fields(),
        }
        self.rendezvous[NAME] = self._bump(body)
        return dict(self.rendezvous[NAME])

    def add_pod(self, name: str, ip: str) -> None:
        self.pods[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": dict(APP)},
            "spec": {"nodeName": "node-1"},
            "status": {"phase": "Running", "podIPs": [{"ip": ip}]},
        }


@dataclasses.dataclass
class Posted:
    targets: list[str]
    warning: bool
    reason: str
    message: str


class Events:
    def __init__(self) -> None:
        self.posted: list[Posted] = []

    def __call__(
        self, targets: Sequence[Mapping[str, Any]], *, warning: bool, reason: str, message: str
    ) -> None:
        kinds = [f"{t['kind']}/{t['metadata']['name']}" for t in targets]
        self.posted.append(Posted(kinds, warning, reason, message))

    def reasons(self) -> list[str]:
        return [event.reason for event in self.posted]


def spec(min_nodes: int, max_nodes: int, **more: Any) -> specs.RendezvousSpec:
    return specs.RendezvousSpec(
        min_nodes,
        max_nodes,
        "run",
        pod_selector=specs.LabelSelector(tuple(APP.items())),
        **more,
    )


def entry(node: int, attempt: int = 1) -> leases.NodeEntry:
    return leases.NodeEntry(f"i{node}", attempt, f"10.0.0.{node}", 29500)


class Harness:
    def __init__(self, clock: list[datetime.datetime], **options: Any) -> None:
        self.api = FakeApi()
        self.events = Events()
        self.clock = clock
        self.reconciler = reconciler.Reconciler(
            self.api, self.events, lambda: self.clock[0], **options
        )
        self.reconciler.started()

    async def rendezvous(self, body: Mapping[str, Any]) -> None:
        await self.reconciler.rendezvous_seen(KEY, body, deleted=False)
        await self.reconciler.idle()

    async def lease(self, node: str, request: leases.NodeEntry | None) -> None:
        lease = leases.NodeLease(NAME, node, None if request is None else request.instance, request)
        self.reconciler.lease_seen(NS, lease, {}, deleted=False)
        await self.reconciler.idle()


@pytest.fixture
def harness() -> Harness:
    return Harness([T0])


def written_states(api: FakeApi) -> list[tuple[str, int]]:
    return [(fields.get("state"), fields.get("round")) for fields in api.status_writes]


def test_a_round_is_sealed_in_one_write_and_reported_after_it(harness: Harness) -> None:
    async def scenario() -> None:
        for node in (1, 2):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), None))
        assert written_states(harness.api) == [("Forming", 0)], "the first write is made"
        await harness.lease("p1", entry(1))
        await harness.lease("p2", entry(2))

    asyncio.run(scenario())
    assert written_states(harness.api)[-1] == ("Sealed", 1)
    sealed = harness.api.rendezvous[NAME]["status"]
    assert [member["node"] for member in sealed["members"]] == ["p1", "p2"]
    assert (sealed["master"]["addr"], sealed["master"]["port"]) == ("10.0.0.1", 29500)
    assert harness.events.reasons() == [reasons.ROUND_SEALED]
    assert harness.events.posted[0].targets == [f"{objects.KIND}/{NAME}"]


def test_forming_since_alone_is_not_written_and_times_the_seal(harness: Harness) -> None:
    async def scenario() -> None:
        for node in (1, 2, 3):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        await harness.rendezvous(harness.api.add_rendezvous(spec(3, 3), None))
        writes = len(harness.api.status_writes)
        await harness.lease("p1", entry(1))
        assert len(harness.api.status_writes) == writes, "the first join writes nothing"
        assert "formingSince" not in harness.api.rendezvous[NAME]["status"] or (
            harness.api.rendezvous[NAME]["status"]["formingSince"] is None
        )
        harness.clock[0] = T0 + datetime.timedelta(seconds=2.5)
        await harness.lease("p2", entry(2))
        await harness.lease("p3", entry(3))

    asyncio.run(scenario())
    assert written_states(harness.api)[-1] == ("Sealed", 1)
    (sealed,) = harness.events.posted
    assert "2.500 s after the first join" in sealed.message, sealed.message


def test_a_conflict_is_decided_again_on_the_fresh_object(harness: Harness) -> None:
    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")
        body = harness.api.add_rendezvous(spec(1, 1), None)
        # Someone wrote after the operator's view: its write must be over the fresh one.
        harness.api.add_rendezvous(spec(1, 1), None)
        await harness.reconciler.rendezvous_seen(KEY, body, deleted=False)
        await harness.reconciler.idle()

    asyncio.run(scenario())
    assert written_states(harness.api) == [("Forming", 0)]
    assert harness.reconciler.known_body(KEY) == harness.api.rendezvous[NAME]


def test_a_refused_write_is_said_once_and_not_retried(harness: Harness) -> None:
    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")
        body = harness.api.add_rendezvous(spec(2, 2), None)
        harness.api.refuse_next_write = kube.Invalid("status.round: Invalid value", 422)
        await harness.rendezvous(body)

    asyncio.run(scenario())
    assert harness.events.reasons() == [reasons.INVALID_RENDEZVOUS]
    assert "its next status was refused" in harness.events.posted[0].message
    # The one write that followed is the refusal's own condition, not a retried decision.
    (condition_only,) = harness.api.status_writes
    assert list(condition_only) == ["conditions"]
    assert condition_only["conditions"][0]["reason"] == reasons.INVALID_RENDEZVOUS


def test_a_status_too_large_to_store_is_held_until_the_rendezvous_changes(
    harness: Harness,
) -> None:
    """The seal of 2 members is more than the API server stores: a condition naming the
    problem and its fix, one Warning, and no write at the joins and renewals that follow
    (each would be refused the same way); a spec edited to fit is decided and sealed."""
    harness.api.members_stored = 1

    async def scenario() -> None:
        for node in (1, 2, 3):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        body = harness.api.add_rendezvous(spec(2, 2), None)
        await harness.rendezvous(body)
        await harness.lease("p1", entry(1))
        await harness.lease("p2", entry(2))
        assert harness.api.refused_writes == 1
        held = harness.api.rendezvous[NAME]
        await harness.rendezvous(held)  # the echo of the condition's own write
        await harness.lease("p3", entry(3))
        await harness.lease("p1", entry(1, attempt=2))
        assert harness.api.refused_writes == 1, "held: nothing sent while nothing changed"
        assert harness.api.rendezvous[NAME] is held
        edited = harness.api._bump(
            {
                **held,
                "metadata": {**held["metadata"], "generation": 2},
                "spec": spec(1, 1).to_dict(),
            }
        )
        harness.api.rendezvous[NAME] = edited
        await harness.rendezvous(edited)

    asyncio.run(scenario())
    assert harness.api.refused_writes == 1
    assert written_states(harness.api)[-1] == ("Sealed", 1)
    warnings = [e for e in harness.events.posted if e.reason == reasons.STATUS_TOO_LARGE]
    (warning,) = warnings
    assert warning.warning and "its next status (2 members" in warning.message
    assert "Lower spec.maxNodes" in warning.message
    assert "etcdserver: request is too large" in warning.message
    condition_only = harness.api.status_writes[1]
    assert list(condition_only) == ["conditions"], "small: it fits where the status did not"
    (ready,) = condition_only["conditions"]
    assert (ready["status"], ready["reason"]) == ("False", reasons.STATUS_TOO_LARGE)
    assert ready["message"] == warning.message


def test_a_held_status_is_tried_again_once_its_wait_ends_and_said_only_once() -> None:
    """A limit raised outside the Rendezvous (etcd's) changes nothing the watch shows: the
    hold's wait alone brings the next try, and a second refusal adds no Warning."""
    harness = Harness([T0], hold=backoff.Backoff(base=0.01, cap=0.01, jitter=0))
    harness.api.members_stored = 1

    async def scenario() -> None:
        for node in (1, 2):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), None))
        await harness.lease("p1", entry(1))
        await harness.lease("p2", entry(2))
        assert harness.api.refused_writes == 1
        harness.api.written.clear()
        harness.clock[0] = T0 + datetime.timedelta(seconds=1)  # past the hold's end
        harness.api.members_stored = None  # the limit raised
        assert await asyncio.to_thread(harness.api.written.wait, 10), "the hold's timer"
        await harness.reconciler.idle()

    asyncio.run(scenario())
    assert written_states(harness.api)[-1] == ("Sealed", 1)
    assert harness.events.reasons().count(reasons.STATUS_TOO_LARGE) == 1


@dataclasses.dataclass(frozen=True)
class RecordedBackoff(backoff.Backoff):
    attempts: list[int] = dataclasses.field(default_factory=list)

    def delay(self, attempt: int, draw: Any = None) -> float:
        self.attempts.append(attempt)
        return super().delay(attempt, lambda: 0.0)


def test_a_failed_reconcile_is_retried_under_the_backoff_counted_anew_after_a_success() -> None:
    policy = RecordedBackoff(base=0.001, cap=0.004)
    harness = Harness([T0], retry=policy)

    async def scenario() -> None:
        for node in (1, 2):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        harness.api.unavailable_writes = 3
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), None))
        assert written_states(harness.api) == [("Forming", 0)], "written at the 4th try"
        harness.api.unavailable_writes = 1
        await harness.lease("p1", entry(1))
        await harness.lease("p2", entry(2))

    asyncio.run(scenario())
    assert policy.attempts == [0, 1, 2, 0], "each failure in a row waits longer; a success resets"
    assert written_states(harness.api)[-1] == ("Sealed", 1)


def test_each_version_of_the_rendezvous_is_decoded_once_however_many_passes_read_it(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every join is a pass, and most passes write nothing: they all decide on the same
    version of the Rendezvous, read once."""
    read_versions: list[str] = []
    passes: list[int] = []
    read, decide = rendezvous_view.read, rounds.decide

    def counted_read(body: Mapping[str, Any]) -> rendezvous_view.RendezvousView:
        read_versions.append(body["metadata"]["resourceVersion"])
        return read(body)

    def counted_decide(*args: Any, **kwargs: Any) -> rounds.Decision:
        passes.append(1)
        return decide(*args, **kwargs)

    monkeypatch.setattr(rendezvous_view, "read", counted_read)
    monkeypatch.setattr(rounds, "decide", counted_decide)

    async def scenario() -> None:
        for node in (1, 2, 3, 4):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        await harness.rendezvous(harness.api.add_rendezvous(spec(4, 4), None))
        for node in (1, 2, 3, 4):
            await harness.lease(f"p{node}", entry(node))

    asyncio.run(scenario())
    assert written_states(harness.api) == [("Forming", 0), ("Sealed", 1)]
    assert len(read_versions) == len(set(read_versions)), read_versions
    assert len(read_versions) == 2, "the version first seen, and the one the first write made"
    assert len(passes) == 9, "the first pass, one per join, one per pod labelled"


def test_a_rendezvous_that_does_not_decode_is_refused_once_and_decides_nothing(
    harness: Harness,
) -> None:
    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")
        body = harness.api.add_rendezvous(spec(1, 1), None)
        body["status"] = {"state": "Forming", "schemaVersion": 1, "round": "one"}
        harness.api.rendezvous[NAME] = body
        await harness.rendezvous(body)
        await harness.lease("p1", entry(1))  # another pass over the same version

    asyncio.run(scenario())
    assert harness.events.reasons() == [reasons.INVALID_RENDEZVOUS]
    assert harness.events.posted[0].targets == [f"{objects.KIND}/{NAME}"]
    assert harness.events.posted[0].message == reasons.invalid_rendezvous(
        NAME, reasons.unreadable("status.round: expected an integer, got 'one'")
    )
    (condition_only,) = harness.api.status_writes
    assert list(condition_only) == ["conditions"]
    assert condition_only["conditions"][0]["reason"] == reasons.INVALID_RENDEZVOUS


def sealed_p1_p2() -> statuses.RendezvousStatus:
    """Round 1 sealed with p1 and p2, as a restarted operator finds it."""
    return statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=1,
        members=(
            records.Member("p1", "i1", 1, "10.0.0.1"),
            records.Member("p2", "i2", 1, "10.0.0.2"),
        ),
        master=records.Master("10.0.0.1", 29500),
        sealed_at=T0,
    )


def test_a_round_is_never_sealed_with_a_pod_not_yet_looked_at(harness: Harness) -> None:
    """A restarted operator: the stored round's members re-join, but p2's pod is gone.
    Sealing before the labelling answered would seal p2 in; waiting for it loses p2."""
    previous = sealed_p1_p2()

    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")  # p2 has no pod any more
        for node in (1, 2):
            request = entry(node, attempt=2)
            lease = leases.NodeLease(NAME, f"p{node}", request.instance, request)
            harness.reconciler.lease_seen(NS, lease, {}, deleted=False)
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), previous))

    asyncio.run(scenario())
    assert ("Sealed", 2) not in written_states(harness.api)
    assert written_states(harness.api)[-1] == ("Reforming", 1)
    lost = [e for e in harness.events.posted if e.reason == reasons.MEMBER_LOST]
    assert [e.message for e in lost] == [
        reasons.member_lost("p2", 1, 1, reasons.LOST_POD_NOT_FOUND)
    ]
    assert reasons.NODE_WITHOUT_POD in harness.events.reasons()


def test_the_lease_of_a_pod_gone_for_good_is_no_node_without_a_pod(harness: Harness) -> None:
    """A restarted operator finds the Lease of a member whose pod was deleted long ago: the
    member is lost, but nobody is told to run torchrun in a pod (it did)."""
    previous = sealed_p1_p2()

    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")  # p2's pod is gone
        for node in (1, 2):
            request = entry(node, attempt=2)
            lease = leases.NodeLease(
                NAME, f"p{node}", request.instance, request, pod_uid=f"uid-p{node}"
            )
            harness.reconciler.lease_seen(NS, lease, {}, deleted=False)
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), previous))

    asyncio.run(scenario())
    lost = [e for e in harness.events.posted if e.reason == reasons.MEMBER_LOST]
    assert [e.message for e in lost] == [
        reasons.member_lost("p2", 1, 1, reasons.LOST_POD_NOT_FOUND)
    ]
    assert reasons.NODE_WITHOUT_POD not in harness.events.reasons()


def lease_body(api: FakeApi, node: str, version: str = "5") -> dict[str, Any]:
    """Node ``node``'s Lease as the API server holds it (``api.leases`` says so too),
    written by the pod ``add_pod`` makes of that name."""
    name = objects.lease_name(NAME, node)
    api.leases[name] = (f"lease-{node}", version)
    return {
        "metadata": {
            "name": name,
            "uid": f"lease-{node}",
            "resourceVersion": version,
            "annotations": {objects.POD_UID_ANNOTATION: f"uid-{node}"},
        }
    }


def test_a_gone_pods_lease_is_deleted_once_the_round_that_lost_it_is_sealed(
    harness: Harness,
) -> None:
    """A restarted operator finds member p2's pod gone: its loss is the round's to handle
    (a Lease deleted first would read as its request removed), and its Lease goes once a
    round without it is sealed; p1's, whose pod lives, stays."""

    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")  # p2's pod is gone
        for node in (1, 2):
            request = entry(node)
            lease = leases.NodeLease(
                NAME, f"p{node}", request.instance, request, pod_uid=f"uid-p{node}"
            )
            body = lease_body(harness.api, f"p{node}")
            harness.reconciler.lease_seen(NS, lease, body, deleted=False)
        await harness.rendezvous(harness.api.add_rendezvous(spec(1, 2), sealed_p1_p2()))
        assert written_states(harness.api)[-1] == ("Reforming", 1)
        assert harness.api.lease_deletes == [], "p2 is still a member of the stale round"
        await harness.lease("p1", entry(1, attempt=2))

    asyncio.run(scenario())
    assert written_states(harness.api)[-1] == ("Sealed", 2)
    lost = [e.message for e in harness.events.posted if e.reason == reasons.MEMBER_LOST]
    assert lost == [reasons.member_lost("p2", 1, 1, reasons.LOST_POD_NOT_FOUND)]
    assert harness.api.lease_deletes == [objects.lease_name(NAME, "p2")]
    assert list(harness.api.leases) == [objects.lease_name(NAME, "p1")]


def test_a_lease_written_since_it_was_read_is_not_deleted_nor_tried_again_at_once(
    harness: Harness,
) -> None:
    """The delete's preconditions refuse it (409): a pod of the name wrote it since. It is
    checked again only once its new version is seen, never in a loop."""

    async def scenario() -> None:
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), None))
        request = entry(3)
        lease = leases.NodeLease(NAME, "p3", request.instance, request, pod_uid="uid-p3")
        body = lease_body(harness.api, "p3")
        harness.api.leases[objects.lease_name(NAME, "p3")] = ("lease-p3", "6")  # written since
        harness.reconciler.lease_seen(NS, lease, body, deleted=False)
        await harness.reconciler.idle()

    asyncio.run(scenario())
    assert harness.api.lease_deletes == [objects.lease_name(NAME, "p3")]
    assert objects.lease_name(NAME, "p3") in harness.api.leases


def test_a_refused_delete_is_tried_again_at_a_later_pass_not_at_every_one(
    harness: Harness,
) -> None:
    """An operator whose ClusterRole lacks ``delete`` on Leases (an older chart): each pass
    of a join storm would otherwise try every marked Lease again."""

    async def scenario() -> None:
        harness.api.refuse_lease_deletes = kube.Forbidden("leases is forbidden", 403)
        await harness.rendezvous(harness.api.add_rendezvous(spec(3, 3), None))
        request = entry(3)
        lease = leases.NodeLease(NAME, "p3", request.instance, request, pod_uid="uid-p3")
        harness.reconciler.lease_seen(NS, lease, lease_body(harness.api, "p3"), deleted=False)
        await harness.reconciler.idle()
        for node in (1, 2):  # two more passes at once
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
            await harness.lease(f"p{node}", entry(node))

    asyncio.run(scenario())
    assert harness.api.lease_deletes == [objects.lease_name(NAME, "p3")]
    assert objects.lease_name(NAME, "p3") in harness.api.leases


def test_the_lease_of_a_pod_that_lives_is_checked_once_and_kept(harness: Harness) -> None:
    """p1's pod was seen deleted, then a pod of its name wrote the Lease: the Pod read
    says it is that pod, so the Lease stays, and renewals do not check it again."""

    async def scenario() -> None:
        await harness.rendezvous(harness.api.add_rendezvous(spec(2, 2), None))
        harness.reconciler.pods.seen(
            (NS, "p1"), rounds.PodObservation(reasons.LOST_POD_DELETED), None
        )
        harness.api.add_pod("p1", "10.0.0.1")
        request = entry(1)
        lease = leases.NodeLease(NAME, "p1", request.instance, request, pod_uid="uid-p1")
        for version in ("5", "6"):
            body = lease_body(harness.api, "p1", version)
            harness.reconciler.lease_seen(NS, lease, body, deleted=False)
            await harness.reconciler.idle()
        harness.api.add_pod("p2", "10.0.0.2")
        await harness.lease("p2", entry(2))  # a pass after the renewal

    asyncio.run(scenario())
    assert harness.api.pod_reads == ["p1"], "checked at its first version only"
    assert harness.api.lease_deletes == []
    assert objects.lease_name(NAME, "p1") in harness.api.leases


def test_a_deleted_rendezvous_is_forgotten_whole(harness: Harness) -> None:
    async def scenario() -> None:
        harness.api.add_pod("p1", "10.0.0.1")
        body = harness.api.add_rendezvous(spec(2, 2), None)
        await harness.rendezvous(body)
        await harness.lease("p1", entry(1))
        assert harness.reconciler.pods.observed((NS, "p1")) is not None
        await harness.reconciler.rendezvous_seen(KEY, body, deleted=True)

    asyncio.run(scenario())
    assert harness.reconciler.known_body(KEY) is None
    assert harness.reconciler.pods.observed((NS, "p1")) is None


def test_requests_for_a_rendezvous_that_does_not_exist_are_forgotten_with_their_leases(
    harness: Harness,
) -> None:
    made_up = (NS, "made-up")

    async def scenario() -> None:
        for node in ("p1", "p2"):
            lease = leases.NodeLease("made-up", node, "i", entry(1))
            harness.reconciler.lease_seen(NS, lease, {}, deleted=False)
        await harness.reconciler.idle()
        assert harness.reconciler.remembers(made_up)
        for node in ("p1", "p2"):
            lease = leases.NodeLease("made-up", node, "i", entry(1))
            harness.reconciler.lease_seen(NS, lease, {}, deleted=True)
            await harness.reconciler.idle()
        assert harness.api.status_writes == []

    asyncio.run(scenario())
    assert not harness.reconciler.remembers(made_up)


def test_slices_are_written_only_for_joiners_and_when_their_content_changes(
    harness: Harness,
) -> None:
    large = spec(2, objects.SLICE_MEMBERS + 1)
    count = objects.slice_count(large.max_nodes)
    joiners = {objects.slice_index(f"p{node}", count) for node in (1, 2, 3)}

    async def scenario() -> None:
        for node in (1, 2, 3):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        await harness.rendezvous(harness.api.add_rendezvous(large, None))
        assert harness.api.slice_writes == [], "no pod asked to join: no slice"
        for node in (1, 2, 3):
            await harness.lease(f"p{node}", entry(node))
        assert harness.api.status_writes[-1]["lastCallDeadline"] is not None
        first = sorted(index for index, _ in harness.api.slice_writes)
        assert first == sorted(joiners), "a join writes its pod's slice once, if not yet"
        harness.api.slice_writes.clear()
        harness.clock[0] = T0 + datetime.timedelta(seconds=large.last_call_timeout_seconds)
        for node in (1, 2, 3):  # the nodes' heartbeats, renewing what they asked
            await harness.lease(f"p{node}", entry(node))
        assert harness.api.slice_writes == [], "heartbeats and a last call write no slice"
        harness.reconciler.request(KEY)  # the last call's timer
        await harness.reconciler.idle()

    asyncio.run(scenario())
    assert written_states(harness.api)[-1] == ("Sealed", 1)
    assert sorted(index for index, _ in harness.api.slice_writes) == sorted(joiners)


def test_a_pod_made_rendezvous_named_after_another_workload_is_given_back_to_it(
    harness: Harness,
) -> None:
    """Issue 55: a pod of StatefulSet squatter made Rendezvous r, which StatefulSet r's
    pods need; owned by the squatter's workload, r's pods were refused for good. Now the
    first of them to ask to join is held back, not refused, the Rendezvous is deleted (its
    uid a precondition), both workloads are told once, and a pod-made one made anew is
    deleted again, with nothing said again."""
    squatter = workloads.Reference("apps/v1", "StatefulSet", "squatter", "uid-squatter")
    claimant = workloads.Reference("apps/v1", "StatefulSet", NAME, "uid-sts")
    harness.api.controllers[claimant.uid] = {"metadata": {"name": NAME, "uid": claimant.uid}}

    def made(uid: str) -> dict[str, Any]:
        body = {
            "apiVersion": objects.API_VERSION,
            "kind": objects.KIND,
            "metadata": {
                "name": NAME,
                "namespace": NS,
                "uid": uid,
                "annotations": {objects.CREATED_BY_ANNOTATION: "squatter-0"},
                "ownerReferences": [squatter.owner_reference()],
            },
            "spec": {"minNodes": 1, "maxNodes": 1, "runId": "run"},
        }
        harness.api.rendezvous[NAME] = harness.api._bump(body)
        return dict(harness.api.rendezvous[NAME])

    async def scenario() -> None:
        harness.api.add_pod("r-0", "10.0.0.1")
        harness.api.pods["r-0"]["metadata"]["ownerReferences"] = [claimant.owner_reference()]
        await harness.rendezvous(made("uid-1"))
        await harness.lease("r-0", entry(1))
        await harness.reconciler.rendezvous_seen(KEY, made("uid-2"), deleted=False)
        await harness.reconciler.idle()

    asyncio.run(scenario())
    assert harness.api.deleted == [(NAME, "uid-1"), (NAME, "uid-2")]
    assert reasons.NODE_REFUSED not in harness.events.reasons()
    assert not any(write.get("refused") for write in harness.api.status_writes)
    given_back = [e for e in harness.events.posted if e.reason == reasons.RENDEZVOUS_REPLACED]
    assert [e.targets for e in given_back] == [[f"StatefulSet/{NAME}"], ["StatefulSet/squatter"]]
    assert given_back[0].message == reasons.rendezvous_given_back(
        NAME, "squatter-0", "StatefulSet/squatter", f"StatefulSet/{NAME}"
    )
    assert given_back[1].message == reasons.rendezvous_taken_back(
        NAME, "squatter-0", "StatefulSet/squatter", f"StatefulSet/{NAME}"
    )


def sample(gauge: Any, key: tuple[str, str]) -> float | None:
    """The value of ``gauge``'s series for rendezvous ``key``, if it has one."""
    return next(
        (
            s.value
            for family in gauge.collect()
            for s in family.samples
            if (s.labels.get("namespace"), s.labels.get("rendezvous")) == key
        ),
        None,
    )


def test_each_rendezvous_has_its_world_against_max_and_its_last_recovery(
    harness: Harness,
) -> None:
    async def scenario() -> None:
        for node in (1, 2):
            harness.api.add_pod(f"p{node}", f"10.0.0.{node}")
        body = harness.api.add_rendezvous(spec(1, 2), None)
        await harness.rendezvous(body)
        await harness.lease("p1", entry(1))
        await harness.lease("p2", entry(2))
        assert (sample(metrics.WORLD_SIZE, KEY), sample(metrics.MAX_NODES, KEY)) == (2, 2)
        assert sample(metrics.LAST_RECOVERY, KEY) is None, "the first round recovers nothing"
        await harness.lease("p2", None)  # its request removed: p1 re-forms alone
        assert sample(metrics.WORLD_SIZE, KEY) == 0, "no sealed round while one forms"
        harness.clock[0] = T0 + datetime.timedelta(seconds=0.5)
        await harness.lease("p1", entry(1, attempt=2))
        assert written_states(harness.api)[-1] == ("Sealed", 2)
        assert sample(metrics.WORLD_SIZE, KEY) == 1
        assert sample(metrics.LAST_RECOVERY, KEY) == 0.5
        await harness.reconciler.rendezvous_seen(KEY, harness.api.rendezvous[NAME], deleted=True)

    asyncio.run(scenario())
    for gauge in metrics.PER_RENDEZVOUS:
        assert sample(gauge, KEY) is None, f"{gauge} dropped with its rendezvous"


def test_only_so_many_rendezvous_have_series_of_their_own() -> None:
    series = metrics.RendezvousSeries(limit=2)
    for name in ("a", "b", "c"):
        series.set(("limits", name), 1, 4, None)
    assert len(series) == 2
    assert sample(metrics.WORLD_SIZE, ("limits", "c")) is None
    series.forget(("limits", "a"))
    series.set(("limits", "c"), 1, 4, 0.25)
    assert sample(metrics.LAST_RECOVERY, ("limits", "c")) == 0.25
    assert sample(metrics.WORLD_SIZE, ("limits", "a")) is None
    for name in ("b", "c"):
        series.forget(("limits", name))
