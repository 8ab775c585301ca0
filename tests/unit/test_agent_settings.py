"""The agent's own settings (``tunables.AGENT_SETTINGS``): each is a ``--rdzv-conf`` key and,
for an annotated Job, an annotation that the webhook hands every pod as a variable.

Aspects: each setting's default, its value from ``--rdzv-conf``, from the variable where
``--rdzv-conf`` does not say, ``--rdzv-conf`` winning over the variable; a bad value refused
naming where it came from (the key, or the variable and its annotation) and what the
setting takes; the operator checks an annotation as the pod will read it (fuzzed: one
accepts exactly what the other does), names a bad one, and gives its pods only what the
Job says; the keys are described among torchrun's.
"""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousParameters

from k8s_rendezvous import config
from k8s_rendezvous.wire import objects, specs, tunables
from k8s_rendezvous_operator import injection, job_annotations

SETTINGS = {setting.conf_key: setting for setting in tunables.AGENT_SETTINGS}
GOOD = {
    "health_check": ("nccl-check --size '1 G'", ("nccl-check", "--size", "1 G")),
    "health_check_timeout": ("90", 90),
    "in_place": ("true", True),
    "in_place_loss_timeout": ("90", 90),
    "warm_start": ("Yes", True),
}
"""A value each setting takes, with what it means: none is its default."""
BAD = {
    "health_check": ("check 'unclosed", "No closing quotation"),
    "health_check_timeout": ("0", "not a number of seconds from 1 to 3600"),
    "in_place": ("2", "not one of 1, true"),
    "in_place_loss_timeout": ("-5", "not a whole number of seconds"),
    "warm_start": ("on", "not one of 1, true"),
}
"""A value each setting refuses, with what the refusal says."""
keys = pytest.mark.parametrize("key", sorted(SETTINGS))


def _settings(**conf: str) -> config.Settings:
    return config.Settings.from_parameters(
        RendezvousParameters("kubernetes", "ns/r", "run", 1, 2, **conf), "ns"
    )


@pytest.fixture(autouse=True)
def _no_job_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting in tunables.AGENT_SETTINGS:
        monkeypatch.delenv(setting.env, raising=False)


def test_the_table_covers_the_examples() -> None:
    assert set(GOOD) == set(BAD) == set(SETTINGS)


@keys
def test_a_setting_given_nowhere_has_its_default(key: str) -> None:
    assert getattr(_settings(), key) == SETTINGS[key].default != GOOD[key][1]


@keys
def test_a_setting_is_read_from_rdzv_conf(key: str) -> None:
    raw, meant = GOOD[key]
    assert getattr(_settings(**{key: raw}), key) == meant


@keys
def test_an_annotated_jobs_setting_is_read_from_its_variable_and_rdzv_conf_wins(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setting = SETTINGS[key]
    raw, meant = GOOD[key]
    monkeypatch.setenv(setting.env, raw)
    assert getattr(_settings(), key) == meant
    bad, _ = BAD[key]
    monkeypatch.setenv(setting.env, bad)
    assert getattr(_settings(**{key: raw}), key) == meant, "--rdzv-conf wins, unread"


@keys
def test_a_bad_value_is_refused_naming_where_it_came_from_and_what_it_takes(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setting = SETTINGS[key]
    bad, problem = BAD[key]
    with pytest.raises(ValueError) as from_conf:
        _settings(**{key: bad})
    assert f"--rdzv-conf {key}={bad!r} is refused: {problem}" in str(from_conf.value)
    assert setting.meaning in str(from_conf.value)
    monkeypatch.setenv(setting.env, bad)
    with pytest.raises(ValueError) as from_env:
        _settings()
    annotation = f"{objects.GROUP}/{setting.annotation}"
    assert f"{setting.env}={bad!r} (from the Job's annotation {annotation}) is refused" in str(
        from_env.value
    )


def test_the_keys_are_described_among_torchruns() -> None:
    for setting in tunables.AGENT_SETTINGS:
        assert config.CONFIG_KEYS[setting.conf_key] == setting.meaning


def test_a_jobs_annotations_are_checked_and_only_what_it_says_is_given_to_its_pods() -> None:
    good = {job_annotations.NODES: "2"} | {
        f"{job_annotations.PREFIX}{SETTINGS[key].annotation}": raw
        for key, (raw, _) in GOOD.items()
        if key != "health_check_timeout"
    }
    assert isinstance(
        job_annotations.parse(good, job_name="j", parallelism=2), specs.RendezvousSpec
    )
    agent_env = job_annotations.agent_env(good)
    assert dict(agent_env) == {
        SETTINGS[key].env: raw for key, (raw, _) in GOOD.items() if key != "health_check_timeout"
    }
    env = injection.torchrun_environment("j", specs.RendezvousSpec(2, 2, "j"), agent_env)
    assert {"name": "K8S_RENDEZVOUS_IN_PLACE", "value": "true"} in env
    assert not any(e["name"] == "K8S_RENDEZVOUS_HEALTH_CHECK_TIMEOUT" for e in env)
    bad = {job_annotations.NODES: "2"} | {
        f"{job_annotations.PREFIX}{SETTINGS[key].annotation}": raw for key, (raw, _) in BAD.items()
    }
    errors = job_annotations.parse(bad, job_name="j", parallelism=2)
    assert isinstance(errors, tuple)
    by_key = {error.key: error.message for error in errors}
    for key, (raw, problem) in BAD.items():
        message = by_key[f"{job_annotations.PREFIX}{SETTINGS[key].annotation}"]
        assert f"={raw!r}: {problem}" in message and SETTINGS[key].env in message


@hypothesis.given(
    key=st.sampled_from(sorted(SETTINGS)),
    # What an environment variable can hold: no NUL, no lone surrogate (the API server
    # holds annotations as UTF-8, and os.environ refuses both).
    raw=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
    ),
)
def test_the_operator_accepts_an_annotation_exactly_when_its_pods_would(key: str, raw: str) -> None:
    setting = SETTINGS[key]
    annotated = {job_annotations.NODES: "2", f"{job_annotations.PREFIX}{setting.annotation}": raw}
    operator_accepts = isinstance(
        job_annotations.parse(annotated, job_name="j", parallelism=2), specs.RendezvousSpec
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(setting.env, raw)
        try:
            _settings()
        except ValueError:
            pod_accepts = False
        else:
            pod_accepts = True
    assert operator_accepts == pod_accepts
