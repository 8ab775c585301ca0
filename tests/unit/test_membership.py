"""Who may be a node of a rendezvous: the pod's workload and its own IPs decide."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from k8s_rendezvous.wire import codec, leases, objects, specs, statuses
from k8s_rendezvous_operator import membership, observe, reasons, workloads

JOB_UID = "job-uid-1"


def pod(
    name: str = "train-0",
    *,
    controller_uid: str | None = JOB_UID,
    ips: tuple[str, ...] = ("10.1.0.5",),
    labels: dict[str, str] | None = None,
    host_network: bool = False,
) -> dict[str, Any]:
    owners = (
        [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": "train",
                "uid": controller_uid,
                "controller": True,
            }
        ]
        if controller_uid
        else []
    )
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": labels or {},
            "ownerReferences": owners,
        },
        "spec": {"hostNetwork": host_network},
        "status": {
            "phase": "Running",
            "podIP": ips[0] if ips else None,
            "podIPs": [{"ip": ip} for ip in ips],
            "hostIP": "192.0.2.1",
            "hostIPs": [{"ip": "192.0.2.1"}, {"ip": "2001:db8::1"}],
        },
    }


def rendezvous(owner_uid: str | None = JOB_UID, **spec: Any) -> tuple[dict[str, Any], Any]:
    owners = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "train",
            "uid": owner_uid,
            "controller": True,
        }
    ]
    body = {
        "metadata": {"name": "train", "ownerReferences": owners if owner_uid else []},
        "spec": {"minNodes": 1, "maxNodes": 4, "runId": "train", **spec},
    }
    return body, specs.RendezvousSpec.from_dict(body["spec"])


def entry(addr: str = "10.1.0.5") -> leases.NodeEntry:
    return leases.NodeEntry("i-1", 1, addr, 29500)


def refusal(body_spec: tuple[dict[str, Any], Any], pod_body: dict[str, Any], addr: str) -> Any:
    workload = membership.workload_of(*body_spec)
    identity = membership.identify_pod(pod_body)
    return membership.refusal(workload, pod_body["metadata"]["name"], identity, entry(addr))


def test_a_pod_of_the_owning_job_offering_its_own_ip_is_admitted() -> None:
    assert refusal(rendezvous(), pod(), "10.1.0.5") is None


def test_a_pod_of_another_job_is_refused_naming_both_workloads() -> None:
    found = refusal(rendezvous(), pod("other-0", controller_uid="job-uid-2"), "10.1.0.5")
    assert found.reason == reasons.REFUSED_OTHER_WORKLOAD
    assert "pod other-0 is controlled by Job/train, not by Job/train" in found.message


def test_a_bare_pod_is_refused_by_an_owned_rendezvous() -> None:
    found = refusal(rendezvous(), pod(controller_uid=None), "10.1.0.5")
    assert found.reason == reasons.REFUSED_OTHER_WORKLOAD
    assert "controlled by nothing" in found.message


def test_an_address_that_is_not_the_pods_is_refused_with_the_fix() -> None:
    found = refusal(rendezvous(), pod(), "10.9.9.9")
    assert found.reason == reasons.REFUSED_ADDRESS
    assert "'10.9.9.9', which is not one of its pod's IPs (10.1.0.5)" in found.message
    assert "--local-addr" in found.message


def test_a_hostname_is_no_address_of_the_pod() -> None:
    found = refusal(rendezvous(), pod(), "train-0.train.svc")
    assert found.reason == reasons.REFUSED_ADDRESS


@pytest.mark.parametrize("written", ["fd00::0:7", "FD00::7", "[fd00::7]"])
def test_ipv6_addresses_compare_in_canonical_form(written: str) -> None:
    assert refusal(rendezvous(), pod(ips=("10.1.0.5", "fd00::7")), written) is None


def test_a_host_network_pod_may_offer_its_nodes_addresses_only() -> None:
    on_host = pod(host_network=True)
    assert refusal(rendezvous(), on_host, "2001:db8::1") is None
    assert refusal(rendezvous(), on_host, "10.1.0.5").reason == reasons.REFUSED_ADDRESS


def test_a_hand_made_rendezvous_without_a_selector_admits_nobody_and_says_why() -> None:
    found = refusal(rendezvous(owner_uid=None), pod(), "10.1.0.5")
    assert found.reason == reasons.REFUSED_NO_RULE
    assert "Set spec.podSelector" in found.message


def test_a_hand_made_rendezvous_admits_the_pods_its_selector_matches() -> None:
    selected = rendezvous(
        owner_uid=None,
        podSelector={
            "matchLabels": {"app": "train"},
            "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["spare"]}],
        },
    )
    assert refusal(selected, pod(labels={"app": "train"}), "10.1.0.5") is None
    found = refusal(selected, pod(labels={"app": "train", "tier": "spare"}), "10.1.0.5")
    assert found.reason == reasons.REFUSED_SELECTOR
    assert "app=train, tier NotIn (spare)" in found.message


def test_the_operators_own_label_cannot_satisfy_a_selector() -> None:
    selected = rendezvous(
        owner_uid=None, podSelector={"matchLabels": {objects.NODE_LABEL: "train"}}
    )
    labelled = pod(labels={objects.NODE_LABEL: "train"})
    assert refusal(selected, labelled, "10.1.0.5").reason == reasons.REFUSED_SELECTOR


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ({}, "an empty selector would match every pod"),
        ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "operator In needs values"),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            "operator Exists takes no values",
        ),
        ({"matchLabels": {"a": 1}}, "matchLabels.a: expected a string"),
    ],
)
def test_a_malformed_selector_is_named(selector: dict[str, Any], message: str) -> None:
    with pytest.raises(codec.DecodeError, match=message):
        rendezvous(podSelector=selector)


def test_the_selector_round_trips() -> None:
    selector = {
        "matchLabels": {"app": "train"},
        "matchExpressions": [{"key": "zone", "operator": "Exists"}],
    }
    _, spec = rendezvous(podSelector=selector)
    assert spec.to_dict()["podSelector"] == selector


def test_unobserved_pods_are_held_back_unless_already_admitted() -> None:
    body, spec = rendezvous()
    identities = {"seen": membership.identify_pod(pod("seen")), "member": None, "new": None}
    requests = {name: entry() for name in identities}
    admission = membership.admit(
        membership.workload_of(body, spec), requests, identities, frozenset({"member"})
    )
    assert sorted(admission.counted) == ["member", "seen"]
    assert admission.refused == {}


def test_a_refused_pod_cannot_close_the_rendezvous() -> None:
    body, spec = rendezvous()
    closing = leases.NodeEntry("i-1", 1, "10.1.0.5", 29500, leases.NodeIntent.CLOSE)
    stranger = membership.identify_pod(pod("stranger", controller_uid="job-uid-2"))
    admission = membership.admit(
        membership.workload_of(body, spec),
        {"stranger": closing},
        {"stranger": stranger},
        frozenset(),
    )
    assert admission.counted == {}
    assert admission.refused["stranger"].reason == reasons.REFUSED_OTHER_WORKLOAD


def test_the_pod_observation_carries_its_identity() -> None:
    observation = observe.observe_pod(pod())
    assert observation.identity is not None
    assert observation.identity.controller_uid == JOB_UID
    assert observation.identity.addresses == frozenset({"10.1.0.5"})


def test_a_request_written_by_an_earlier_pod_of_the_same_name_is_held_back() -> None:
    body, spec = rendezvous()
    identities = {name: membership.identify_pod(pod(name)) for name in ("train-0", "train-1")}
    admission = membership.admit(
        membership.workload_of(body, spec),
        {"train-0": entry(), "train-1": entry()},
        identities,
        frozenset({"train-0"}),
        writers={"train-0": "uid-of-the-pod-before", "train-1": "uid-train-1"},
    )
    assert sorted(admission.counted) == ["train-1"]
    assert admission.refused == {}, "not the new pod's doing: nothing to report"


def test_a_lease_says_which_pod_wrote_it() -> None:
    lease = {
        "metadata": {
            "name": "train.train-0",
            "labels": {objects.NODE_LABEL: "train"},
            "annotations": {
                objects.INSTANCE_ANNOTATION: "i-1",
                objects.ENTRY_ANNOTATION: entry().to_annotation(),
                objects.POD_UID_ANNOTATION: "uid-train-0",
            },
        },
        "spec": {"holderIdentity": "train-0"},
    }
    observation = leases.NodeLease.from_body(lease)
    assert observation is not None and observation.pod_uid == "uid-train-0"
    del lease["metadata"]["annotations"][objects.POD_UID_ANNOTATION]
    observation = leases.NodeLease.from_body(lease)
    assert observation is not None and observation.pod_uid is None


def test_a_pod_made_rendezvous_is_adopted_by_its_creators_controller_only() -> None:
    made = {
        "metadata": {"name": "train", "annotations": {objects.CREATED_BY_ANNOTATION: "train-0"}},
        "spec": {"minNodes": 1, "maxNodes": 2, "runId": "train"},
    }
    spec = specs.RendezvousSpec.from_dict(made["spec"])
    assert membership.creator_to_adopt(made, spec) == "train-0"
    owned, _ = rendezvous()
    owned["metadata"]["annotations"] = made["metadata"]["annotations"]
    assert membership.creator_to_adopt(owned, spec) is None, "owned already"
    selecting = {**made, "spec": {**made["spec"], "podSelector": {"matchLabels": {"a": "b"}}}}
    selected = specs.RendezvousSpec.from_dict(selecting["spec"])
    assert membership.creator_to_adopt(selecting, selected) is None, "an admin's rule"


JOBSET_UID = "jobset-uid-1"
JOBSET = workloads.Reference("jobset.x-k8s.io/v1alpha2", "JobSet", "train", JOBSET_UID)


def jobset_pod(name: str = "train-workers-0-0", job_uid: str = JOB_UID) -> dict[str, Any]:
    body = pod(name, controller_uid=job_uid)
    body["metadata"]["ownerReferences"][0].update(name="train-workers-0")
    return body


def jobset_rendezvous() -> tuple[dict[str, Any], Any]:
    body, spec = rendezvous(JOBSET_UID)
    body["metadata"]["ownerReferences"][0].update(apiVersion=JOBSET.api_version, kind="JobSet")
    return body, spec


def test_a_pod_of_a_jobsets_job_is_admitted_once_its_jobs_controller_is_read() -> None:
    body, spec = jobset_rendezvous()
    workload = membership.workload_of(body, spec)
    identity = membership.identify_pod(jobset_pod())
    job = membership.to_climb(workload, identity)
    assert job == workloads.Reference("batch/v1", "Job", "train-workers-0", JOB_UID)
    unread = membership.refusal(workload, "train-workers-0-0", identity, entry())
    assert unread is not None and unread.reason == reasons.REFUSED_OTHER_WORKLOAD
    assert "controlled by Job/train-workers-0, not by JobSet/train, which owns" in unread.message
    read = dataclasses.replace(identity, ancestors=(JOBSET_UID,))
    assert membership.refusal(workload, "train-workers-0-0", read, entry()) is None
    other = dataclasses.replace(identity, ancestors=("jobset-uid-2",))
    assert membership.refusal(workload, "train-workers-0-0", other, entry()) is not None


def test_a_job_owned_rendezvous_needs_no_read_of_its_pods_job() -> None:
    identity = membership.identify_pod(jobset_pod())
    owned = membership.workload_of(*rendezvous())
    assert membership.to_climb(owned, identity) is None, "the pod's own Job owns it"
    unowned = membership.workload_of(*rendezvous(None))
    assert membership.to_climb(unowned, identity) is None, "nothing to reach"
    bare = membership.identify_pod(pod(controller_uid=None))
    assert membership.to_climb(membership.workload_of(*jobset_rendezvous()), bare) is None


def test_a_pod_whose_ips_are_not_reported_yet_is_held_back_not_refused() -> None:
    body, spec = rendezvous()
    admission = membership.admit(
        membership.workload_of(body, spec),
        {"train-0": entry()},
        {"train-0": membership.identify_pod(pod(ips=()))},
        frozenset(),
    )
    assert (admission.counted, admission.refused) == ({}, {})


def test_the_status_names_a_bounded_number_of_refusals_by_pod_name() -> None:
    body, spec = rendezvous()
    names = [f"stranger-{index:02}" for index in range(statuses.MAX_REFUSED + 4)]
    requests = {name: leases.NodeEntry(f"i-{name}", 3, "10.1.0.5", 29500) for name in names}
    admission = membership.admit(
        membership.workload_of(body, spec),
        requests,
        {name: membership.identify_pod(pod(name, controller_uid="job-uid-2")) for name in names},
        frozenset(),
    )
    published = admission.published(requests)
    assert [refusal.node for refusal in published] == names[: statuses.MAX_REFUSED]
    first = published[0]
    assert (first.instance, first.attempt, first.reason) == (
        "i-stranger-00",
        3,
        reasons.REFUSED_OTHER_WORKLOAD,
    )
    assert first.message == admission.refused["stranger-00"].message


def test_checks_kept_between_passes_follow_each_change_of_what_they_were_made_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass reuses the outcome of a request's last check only while the request, its
    pod and the Rendezvous' workload are what it was made from; a request gone is
    forgotten."""
    body, spec = rendezvous()
    workload = membership.workload_of(body, spec)
    identities = {name: membership.identify_pod(pod(name)) for name in ("a", "b")}
    requests = {"a": entry(), "b": entry()}
    checked = membership.Checked()
    calls: list[str] = []
    real = membership.refusal

    def counting(*args: Any) -> Any:
        calls.append(args[1])
        return real(*args)

    monkeypatch.setattr(membership, "refusal", counting)

    def admit(**changes: Any) -> membership.Admission:
        given = {"workload": workload, "requests": requests, "identities": identities, **changes}
        return membership.admit(
            given["workload"], given["requests"], given["identities"], frozenset(), None, checked
        )

    assert sorted(admit().counted) == ["a", "b"] and sorted(calls) == ["a", "b"]
    calls.clear()
    assert sorted(admit().counted) == ["a", "b"] and calls == []

    moved = {**requests, "b": entry("10.9.9.9")}
    assert admit(requests=moved).refused["b"].reason == reasons.REFUSED_ADDRESS
    assert calls == ["b"]
    calls.clear()

    relabelled = {**identities, "a": membership.identify_pod(pod("a", controller_uid="other"))}
    refused = admit(requests=moved, identities=relabelled).refused
    assert refused["a"].reason == reasons.REFUSED_OTHER_WORKLOAD
    assert calls == ["a"]
    calls.clear()

    selecting = membership.workload_of(*rendezvous(podSelector={"matchLabels": {"x": "y"}}))
    assert set(admit(workload=selecting).refused) == {"a", "b"}
    assert sorted(calls) == ["a", "b"]

    admit(workload=selecting, requests={"a": entry()})
    assert set(checked.outcomes) == {"a"}
