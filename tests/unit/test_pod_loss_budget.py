"""Whether a Job's failure settings end it after a few pods lost to disruptions
(``observe.pod_loss_budget``), and the Warning that says so (``reasons.pod_losses_end_job``).

Aspects: the Job API's defaults count every lost pod (backoffLimit 6: 7 losses end the
Job); a podFailurePolicy rule ignoring the DisruptionTarget condition spares them, and only
such a rule; backoffLimitPerIndex counts per index; the message names the fix, and asks for
restartPolicy Never only where the pod template lacks it.
"""

from __future__ import annotations

from typing import Any

import pytest

from k8s_rendezvous_operator import observe, reasons

IGNORE_DISRUPTIONS = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}


def job_spec(restart_policy: str = "Never", **spec: Any) -> dict[str, Any]:
    return {
        "parallelism": 4,
        "template": {"spec": {"restartPolicy": restart_policy, "containers": []}},
        **spec,
    }


@pytest.mark.parametrize(
    ("spec", "budget"),
    [
        (job_spec(), observe.PodLossBudget(7, per_index=False, restart_policy_never=True)),
        (
            job_spec(backoffLimit=20),
            observe.PodLossBudget(21, per_index=False, restart_policy_never=True),
        ),
        (
            job_spec("OnFailure"),
            observe.PodLossBudget(7, per_index=False, restart_policy_never=False),
        ),
        (
            job_spec(completionMode="Indexed", completions=4, backoffLimitPerIndex=3),
            observe.PodLossBudget(4, per_index=True, restart_policy_never=True),
        ),
        (
            job_spec(
                completionMode="Indexed", completions=4, backoffLimitPerIndex=3, backoffLimit=2
            ),
            observe.PodLossBudget(3, per_index=False, restart_policy_never=True),
        ),
        (
            job_spec(
                podFailurePolicy={"rules": [{"action": "FailJob", "onExitCodes": {"values": [42]}}]}
            ),
            observe.PodLossBudget(7, per_index=False, restart_policy_never=True),
        ),
        (
            job_spec(
                podFailurePolicy={
                    "rules": [
                        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget"}]}
                    ]
                }
            ),
            observe.PodLossBudget(7, per_index=False, restart_policy_never=True),
        ),
        (
            job_spec(
                podFailurePolicy={
                    "rules": [
                        {
                            "action": "Ignore",
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "False"}],
                        }
                    ]
                }
            ),
            observe.PodLossBudget(7, per_index=False, restart_policy_never=True),
        ),
        (job_spec(podFailurePolicy={"rules": [IGNORE_DISRUPTIONS]}), None),
        (
            job_spec(
                completionMode="Indexed",
                completions=4,
                backoffLimitPerIndex=3,
                podFailurePolicy={
                    "rules": [
                        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
                        {
                            **IGNORE_DISRUPTIONS,
                            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                        },
                    ]
                },
            ),
            None,
        ),
    ],
    ids=[
        "api-defaults",
        "backoff-limit-20",
        "on-failure",
        "per-index",
        "per-index-and-a-smaller-job-wide-limit",
        "a-policy-without-the-rule",
        "disruptions-counted-by-a-rule",
        "the-condition-false",
        "disruptions-ignored",
        "the-production-job",
    ],
)
def test_a_job_counts_pods_lost_to_disruptions_unless_a_rule_ignores_them(
    spec: dict[str, Any], budget: observe.PodLossBudget | None
) -> None:
    assert observe.pod_loss_budget(spec) == budget


def test_an_annotated_job_is_observed_with_its_budget() -> None:
    body = {
        "metadata": {"name": "train", "uid": "u", "annotations": {"k8s-rendezvous.dev/nodes": "2"}},
        "spec": job_spec(),
    }
    job = observe.observe_job(body)
    assert job is not None and job.pod_losses == observe.PodLossBudget(7, False, True)


def test_the_warning_says_how_many_losses_end_the_job_and_names_the_fix() -> None:
    whole = reasons.pod_losses_end_job("train", 7, per_index=False, restart_policy_never=True)
    assert "Job train" in whole and "7 (backoffLimit + 1) fail the whole Job" in whole
    assert "{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}" in whole
    assert "completionMode: Indexed with backoffLimitPerIndex" in whole
    assert "restartPolicy" not in whole
    per_index = reasons.pod_losses_end_job("train", 4, per_index=True, restart_policy_never=False)
    assert "4 on one index (backoffLimitPerIndex + 1) fail that index" in per_index
    assert "restartPolicy: Never" in per_index
