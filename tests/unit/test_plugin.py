"""The torchrun plugin: registration through the ``torchrun.handlers`` entry point exactly
as torch does it, parameters from torchrun, and what importing the plugin costs.

Aspects: torch's registry lists and builds the ``kubernetes`` backend; get_backend()
matches the entry-point name (torch checks it); the endpoint forms; unknown --rdzv-conf
keys are refused naming the valid ones; ``warm_start=1`` starts the zygote the workers are
forked from (and shutdown() ends it); without POD_NAME a node is the pod its token names
(then the hostname); the plugin module imports neither the Kubernetes client nor kopf nor
the operator.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)

from k8s_rendezvous import BACKEND_NAME, config, kube, rest, warm
from k8s_rendezvous.handler import KubernetesRendezvousHandler
from k8s_rendezvous.wire import tunables


@pytest.fixture
def pod_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-cluster files of a pod (the watch a built handler starts finds no server)."""
    (tmp_path / "token").write_text("token")
    (tmp_path / "ca.crt").write_text("not checked until a request is made")
    (tmp_path / "namespace").write_text("team-a")
    monkeypatch.setenv(rest.SERVICE_ACCOUNT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("POD_NAME", "trainer-0")
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


@pytest.fixture
def built() -> Iterator[list[RendezvousHandler]]:
    """The handlers a test built, shut down afterwards: building one starts its watch."""
    handlers: list[RendezvousHandler] = []
    yield handlers
    for handler in handlers:
        handler.shutdown()


def params(endpoint: str = "job-a", **config: str) -> RendezvousParameters:
    return RendezvousParameters(BACKEND_NAME, endpoint, "run-1", 2, 4, **config)


def test_torch_registry_builds_our_handler(pod_env: None, built: list[RendezvousHandler]) -> None:
    handler = rendezvous_handler_registry.create_handler(params(timeout="900"))
    built.append(handler)
    assert isinstance(handler, KubernetesRendezvousHandler)
    assert handler.get_backend() == "kubernetes"
    assert handler.get_run_id() == "run-1"
    assert handler.use_agent_store is True
    assert handler.client.namespace == "team-a" and handler.client.name == "job-a"
    assert handler.addr == "10.1.2.3" and handler.node == "trainer-0"


def test_a_torch_older_than_the_oldest_supported_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from torch.torch_version import TorchVersion

    from k8s_rendezvous import plugin

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.5.1"))
    with pytest.raises(RuntimeError, match=r"needs torch 2\.6 or newer, not 2\.5\.1"):
        plugin.create_handler(params())


def test_local_addr_overrides_the_pod_ip(pod_env: None, built: list[RendezvousHandler]) -> None:
    handler = KubernetesRendezvousHandler.from_parameters(
        RendezvousParameters(BACKEND_NAME, "x", "r", 1, 1, local_addr="fd00::7")
    )
    built.append(handler)
    assert handler.addr == "fd00::7"


@pytest.mark.parametrize(
    ("local_addr", "pod_ip", "addr"),
    [
        pytest.param("[FD00:0::7]", "10.1.2.3", "fd00::7", id="an IPv6 literal, canonical"),
        pytest.param("localhost", "127.0.0.1", "127.0.0.1", id="a host name, to the pod's IP"),
    ],
)
def test_local_addr_is_one_ip_in_canonical_form_as_the_operator_checks_it(
    pod_env: None,
    built: list[RendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
    local_addr: str,
    pod_ip: str,
    addr: str,
) -> None:
    """c10d's node address defaults to the FQDN; the operator admits only the pod's IPs."""
    monkeypatch.setenv("POD_IP", pod_ip)
    handler = KubernetesRendezvousHandler.from_parameters(
        RendezvousParameters(BACKEND_NAME, "x", "r", 1, 1, local_addr=local_addr)
    )
    built.append(handler)
    assert handler.addr == addr


def test_a_local_addr_that_does_not_resolve_is_refused_at_creation(pod_env: None) -> None:
    with pytest.raises(ValueError, match="neither an IP address nor a host name that resolves"):
        KubernetesRendezvousHandler.from_parameters(
            RendezvousParameters(BACKEND_NAME, "x", "r", 1, 1, local_addr="no-such-host.invalid")
        )


def test_a_second_agent_in_the_same_pod_fails_at_once_naming_why(
    pod_env: None, built: list[RendezvousHandler]
) -> None:
    """Both would write one Lease under one node name; neither would be admitted."""
    first = KubernetesRendezvousHandler.from_parameters(params())
    built.append(first)
    with pytest.raises(RendezvousStateError, match="another torchrun agent of pod trainer-0"):
        KubernetesRendezvousHandler.from_parameters(params())
    other_rendezvous = KubernetesRendezvousHandler.from_parameters(params("job-b"))
    built.append(other_rendezvous)
    first.shutdown()
    built.append(KubernetesRendezvousHandler.from_parameters(params()))  # freed with it


def test_broken_credentials_are_a_connection_error_that_says_where(
    pod_env: None, tmp_path: Path
) -> None:
    (tmp_path / "token").unlink()
    (tmp_path / "ca.crt").write_text("")
    with pytest.raises(RendezvousConnectionError, match="credentials"):
        KubernetesRendezvousHandler.from_parameters(params())


def test_unknown_rdzv_conf_key_names_the_valid_ones(pod_env: None) -> None:
    with pytest.raises(ValueError, match=r"unknown --rdzv-conf key.*keep_alive_intervall") as error:
        KubernetesRendezvousHandler.from_parameters(params(keep_alive_intervall="1"))
    assert "read_timeout" in str(error.value)
    assert "is_host" in str(error.value), "names the c10d keys it accepts too"


@pytest.mark.parametrize(
    ("key", "value", "least"),
    [
        ("join_timeout", "0", "1"),
        ("last_call_timeout", "-1", "0"),
        ("close_timeout", "0", "1"),
    ],
)
def test_a_timeout_below_its_least_value_is_refused_at_creation_naming_it(
    pod_env: None, key: str, value: str, least: str
) -> None:
    """As c10d's RendezvousTimeout refuses a timeout <= 0 when the handler is built, not
    at the first join (nor, for a pod that creates the Rendezvous, in the API server)."""
    with pytest.raises(
        ValueError, match=rf"--rdzv-conf {key}={value} is below its least value, {least} s"
    ):
        KubernetesRendezvousHandler.from_parameters(params(**{key: value}))


def test_a_run_id_the_resource_cannot_hold_is_refused_at_creation(pod_env: None) -> None:
    with pytest.raises(ValueError, match="--rdzv-id='two words' is not a run id"):
        KubernetesRendezvousHandler.from_parameters(
            RendezvousParameters(BACKEND_NAME, "job-a", "two words", 1, 1)
        )


def test_workers_with_a_store_of_their_own_are_refused_by_name(
    pod_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is not supported"):
        KubernetesRendezvousHandler.from_parameters(params())


def test_c10d_rdzv_conf_keys_are_accepted_and_each_named_once_as_unused(
    pod_env: None, built: list[RendezvousHandler], caplog: pytest.LogCaptureFixture
) -> None:
    """A user who switches only --rdzv-backend from c10d keeps torch's own keys."""
    c10d = {
        "is_host": "true",
        "store_type": "tcp",
        "use_libuv": "1",
        "cas_backoff_max_seconds": "2",
    }
    with caplog.at_level(logging.INFO, logger="k8s_rendezvous.config"):
        handler = KubernetesRendezvousHandler.from_parameters(params(timeout="900", **c10d))
    built.append(handler)
    unused = [r.getMessage() for r in caplog.records if "is not used by" in r.getMessage()]
    assert sorted(m.split()[1] for m in unused) == sorted(c10d)
    assert any("is_host is not used" in m and "rank 0 serves" in m for m in unused)


def test_the_jobs_restart_budget_is_its_own_key_not_torchruns_max_restarts(
    pod_env: None,
) -> None:
    settings = config.Settings.from_parameters(params(job_max_restarts="7"), "team-a")
    assert settings.configured_spec == {"maxRestarts": 7}
    created = config.spec_to_create(2, 4, "run-1", settings.configured_spec)
    assert created.max_restarts == 7
    assert config.disagreements(
        dataclasses.replace(created, max_restarts=None), (2, 4), settings.configured_spec
    ) == ["sets job_max_restarts=none but --rdzv-conf gave job_max_restarts=7"]
    with pytest.raises(ValueError, match="job_max_restarts=-1 is below its least value, 0"):
        config.Settings.from_parameters(params(job_max_restarts="-1"), "team-a")
    with pytest.raises(ValueError, match=r"unknown --rdzv-conf key\(s\) max_restarts"):
        config.Settings.from_parameters(params(max_restarts="7"), "team-a")


def test_c10d_keep_alive_keys_make_the_liveness_window_and_heartbeat_timeout_one_renewal(
    pod_env: None,
) -> None:
    """As in c10d: a node is dropped after keep_alive_interval x keep_alive_max_attempt
    without a renewal, and heartbeat_timeout bounds one renewal (not the window)."""
    settings = config.Settings.from_parameters(
        params(keep_alive_interval="5", keep_alive_max_attempt="3", heartbeat_timeout="2"),
        "team-a",
    )
    assert settings.configured_spec == {"heartbeatTimeoutSeconds": 15}
    assert settings.heartbeat_timeout == 2
    with pytest.raises(ValueError, match="keep_alive_interval x keep_alive_max_attempt=2 is below"):
        config.Settings.from_parameters(
            params(keep_alive_interval="1", keep_alive_max_attempt="2"), "team-a"
        )
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive number"):
        config.Settings.from_parameters(params(heartbeat_timeout="0"), "team-a")


def test_in_place_loss_timeout_is_read_and_a_bound_that_is_not_positive_refused(
    pod_env: None,
) -> None:
    settings = config.Settings.from_parameters(params(in_place_loss_timeout="90"), "team-a")
    assert settings.in_place_loss_timeout == 90
    default = config.Settings.from_parameters(params(), "team-a")
    assert default.in_place_loss_timeout == tunables.DEFAULT_IN_PLACE_LOSS_TIMEOUT_SECONDS
    with pytest.raises(ValueError, match="in_place_loss_timeout='0' is refused: not a whole"):
        config.Settings.from_parameters(params(in_place_loss_timeout="0"), "team-a")


@pytest.mark.parametrize("given_by", ["rdzv-conf", "job annotation"])
def test_warm_start_starts_the_zygote_and_points_the_workers_at_it(
    pod_env: None, built: list[RendezvousHandler], monkeypatch: pytest.MonkeyPatch, given_by: str
) -> None:
    monkeypatch.delenv(warm.SOCKET_ENV, raising=False)  # restored after the test
    if given_by == "rdzv-conf":
        parameters = params(warm_start="1")
    else:  # what the webhook gives the pods of a Job annotated warm-start: "true"
        monkeypatch.setenv("K8S_RENDEZVOUS_WARM_START", "true")
        parameters = params()
    handler = KubernetesRendezvousHandler.from_parameters(parameters)
    built.append(handler)
    assert isinstance(handler, KubernetesRendezvousHandler)
    zygote = handler.zygote
    assert zygote is not None and zygote.poll() is None
    socket_path = os.environ[warm.SOCKET_ENV]  # what torch's agent hands its workers
    assert "--zygote" in zygote.args and socket_path in zygote.args
    handler.shutdown()
    assert zygote.wait(60) == 0, "the zygote ends with the node"


def test_without_warm_start_no_zygote_is_started(
    pod_env: None, built: list[RendezvousHandler]
) -> None:
    handler = KubernetesRendezvousHandler.from_parameters(params())
    built.append(handler)
    assert isinstance(handler, KubernetesRendezvousHandler) and handler.zygote is None


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("job-a", ("own-ns", "job-a")), ("other/job-b", ("other", "job-b"))],
)
def test_endpoint_forms(endpoint: str, expected: tuple[str, str]) -> None:
    assert config.parse_endpoint(endpoint, "own-ns") == expected


@pytest.mark.parametrize(
    "endpoint", ["", "Job_A", "host:29400", "a/b/c", "team.train", "ns/team.train", "a" * 64]
)
def test_malformed_endpoint_says_which_forms_work(endpoint: str) -> None:
    with pytest.raises(ValueError, match="use NAME or NAMESPACE/NAME"):
        config.parse_endpoint(endpoint, "own-ns")


def test_plugin_import_is_light_and_loads_no_operator_code() -> None:
    probe = (
        "import sys, json; import k8s_rendezvous.plugin as p; p.handler_creator();"
        "import k8s_rendezvous.handler;"
        "print(json.dumps({m: m in sys.modules for m in "
        "('kubernetes', 'kopf', 'k8s_rendezvous_operator')}))"
    )
    light = subprocess.run(
        [sys.executable, "-c", probe.replace("import k8s_rendezvous.handler;", "")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(light.stdout) == {
        "kubernetes": False,
        "kopf": False,
        "k8s_rendezvous_operator": False,
    }
    full = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(full.stdout) == {
        "kubernetes": True,
        "kopf": False,
        "k8s_rendezvous_operator": False,
    }


def test_without_pod_name_a_node_is_the_pod_its_token_names_not_its_hostname(
    pod_env: None, built: list[RendezvousHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JobSet's or Trainer's pod (an Indexed Job with a subdomain) has the hostname
    <job>-<index>, not its name: the bound token says which pod it is."""
    monkeypatch.delenv("POD_NAME")
    asked: list[str] = []

    def identity(client: kube.RendezvousClient) -> tuple[str, str | None]:
        asked.append(client.name)
        return "system:serviceaccount:team-a:default", "train-workers-0-0-x7k2p"

    monkeypatch.setattr(kube.RendezvousClient, "identity", identity)
    handler = KubernetesRendezvousHandler.from_parameters(params())
    built.append(handler)
    assert handler.node == "train-workers-0-0-x7k2p" and asked == ["job-a"]


@pytest.mark.parametrize("answer", ["no pod", "unreachable"])
def test_without_pod_name_or_a_pod_token_a_node_is_its_hostname(
    answer: str,
    pod_env: None,
    built: list[RendezvousHandler],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("POD_NAME")

    def identity(client: kube.RendezvousClient) -> tuple[str, str | None]:
        if answer == "unreachable":
            raise RendezvousConnectionError("the API server did not answer")
        return "someone", None

    monkeypatch.setattr(kube.RendezvousClient, "identity", identity)
    with caplog.at_level(logging.WARNING, logger="k8s_rendezvous.config"):
        handler = KubernetesRendezvousHandler.from_parameters(params())
    built.append(handler)
    assert handler.node == socket.gethostname()
    warned = [r.getMessage() for r in caplog.records if "POD_NAME is not set" in r.getMessage()]
    assert len(warned) == (answer == "unreachable")


def test_pod_name_wins_and_costs_no_request(
    pod_env: None, built: list[RendezvousHandler], monkeypatch: pytest.MonkeyPatch
) -> None:
    def identity(client: kube.RendezvousClient) -> tuple[str, str | None]:
        raise AssertionError("POD_NAME is set: nothing to ask")

    monkeypatch.setattr(kube.RendezvousClient, "identity", identity)
    handler = KubernetesRendezvousHandler.from_parameters(params())
    built.append(handler)
    assert handler.node == "trainer-0"
