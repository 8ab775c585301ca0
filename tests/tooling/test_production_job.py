"""Every annotated Job the project shows a user is the production Job of
docs/annotations.md: the docs' YAML, the examples, the kind demo's and the dev kit's (what
``make demo`` creates).

Aspects: each is found (a page that loses its Job fails here too); each is Indexed with
completions equal to parallelism, a budget per index and no Job-wide one, a podFailurePolicy
the operator does not warn about (``observe.pod_loss_budget``), done at its first success,
its pods never restarted in place.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from devkit import training
from devkit.paths import REPO
from k8s_rendezvous_operator import job_annotations, observe

YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.DOTALL)
HEREDOC = re.compile(r"<<'(\w+)'\n(.*?)\n\1\n", re.DOTALL)


def annotated_jobs(text: str) -> list[dict[str, Any]]:
    """The annotated Jobs among the YAML documents of ``text``."""
    return [
        document
        for document in yaml.safe_load_all(text)
        if isinstance(document, dict)
        and document.get("kind") == "Job"
        and job_annotations.NODES in ((document.get("metadata") or {}).get("annotations") or {})
    ]


def shown_jobs() -> dict[str, list[dict[str, Any]]]:
    """Each file's annotated Jobs: YAML blocks of the docs and the README, YAML files of
    examples/, here-documents of the kind demo."""
    found: dict[str, list[dict[str, Any]]] = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        jobs = [
            job for block in YAML_BLOCK.findall(page.read_text()) for job in annotated_jobs(block)
        ]
        found[str(page.relative_to(REPO))] = jobs
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        found[str(path.relative_to(REPO))] = annotated_jobs(path.read_text())
    demo = REPO / "tests" / "e2e" / "kind-demo.sh"
    found[str(demo.relative_to(REPO))] = [
        job for _, body in HEREDOC.findall(demo.read_text()) for job in annotated_jobs(body)
    ]
    return {where: jobs for where, jobs in found.items() if jobs}


SHOWN = shown_jobs()


def test_the_annotated_jobs_shown_are_found() -> None:
    assert {
        "docs/annotations.md": 2,
        "docs/workloads.md": 1,
        "tests/e2e/kind-demo.sh": 1,
    }.items() <= {where: len(jobs) for where, jobs in SHOWN.items()}.items()


def assert_production(spec: dict[str, Any]) -> None:
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"], "resized together"
    assert isinstance(spec["backoffLimitPerIndex"], int)
    assert "backoffLimit" not in spec, "the budget is per index"
    assert observe.pod_loss_budget(spec) is None, "disruptions are not counted"
    assert spec["successPolicy"] == {"rules": [{"succeededCount": 1}]}
    assert spec["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(
    "job",
    [job for jobs in SHOWN.values() for job in jobs],
    ids=[f"{where}-{index}" for where, jobs in SHOWN.items() for index in range(len(jobs))],
)
def test_every_annotated_job_shown_is_the_production_job(job: dict[str, Any]) -> None:
    assert_production(job["spec"])


def test_the_demos_job_is_the_production_job() -> None:
    manifest = training.job_manifest(
        "demo", "trainer:1", parallelism=3, nodes="2:4", production=True
    )
    assert_production(manifest["spec"])


def test_the_same_job_without_its_failure_policy_is_not() -> None:
    spec = copy.deepcopy(SHOWN["docs/annotations.md"][0]["spec"])
    del spec["podFailurePolicy"]
    with pytest.raises(AssertionError, match="disruptions are not counted"):
        assert_production(spec)
