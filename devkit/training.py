"""An annotated Job running plain ``torchrun examples/elastic_train.py`` in real containers,
and what its workers say about the world they train in.

The container runs the trainer image (host userland and the repository's venv by hostPath,
see devkit/cluster/images.py) with no rendezvous flag: torchrun reads them from the
``PET_*`` environment the operator's injection gives the Job's pods. Each worker prints one
JSON line per step (``TRAIN_PROGRESS_FILE=/dev/stdout``) to its container's log, which the
tests read through the API server and the kubelet, as ``kubectl logs`` does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import kubernetes.client
import urllib3
from kubernetes.client.exceptions import ApiException

from devkit import chart
from devkit.cluster import images
from devkit.cluster.controlplane import dig, read_object, read_object_or_none
from devkit.cluster.nodes import REAL_NODE_LABEL, REAL_NODE_TOLERATION
from devkit.paths import REPO, TRAIN_SCRIPT
from devkit.waiting import wait_for
from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import leadership

VENV_BIN = REPO / ".venv" / "bin"

CONTAINER = "trainer"
FOLLOW_SECONDS = 600
"""The longest a followed log is read: past any test's timeout."""
JOB_LABEL = "batch.kubernetes.io/job-name"
OPERATOR_POD_LABELS = "app.kubernetes.io/name=k8s-rendezvous"


PRODUCTION_SPEC: Mapping[str, Any] = {
    "completionMode": "Indexed",
    "backoffLimitPerIndex": 3,
    "podFailurePolicy": {
        "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
    },
    "successPolicy": {"rules": [{"succeededCount": 1}]},
}
"""The failure and success settings of the Job docs/annotations.md recommends (its
"production Job"), beside ``completions`` equal to ``parallelism``; the pods'
``restartPolicy`` must be Never."""


def job_manifest(
    name: str,
    trainer_image: str,
    *,
    parallelism: int,
    nodes: str,
    restart_policy: str = "Never",
    annotations: Mapping[str, str] = (),  # type: ignore[assignment]
    torchrun_args: tuple[str, ...] = (),
    train_args: tuple[str, ...] = ("--steps", "100000", "--step-seconds", "0.25"),
    node_name: str | None = None,
    backoff_limit: int = 20,
    command: list[str] | None = None,
    production: bool = False,
) -> dict[str, Any]:
    """A Job as a user writes it: the nodes annotation, plain torchrun, nothing else
    rendezvous-related. Its pods spread over the real nodes (at most one more on a node
    than on another) unless ``node_name`` pins them. ``command`` replaces torchrun.
    ``production``: the Job docs/annotations.md recommends (:data:`PRODUCTION_SPEC`),
    Indexed, resized by its parallelism and completions together; else ``backoff_limit``
    for the whole Job."""
    container = {
        "name": CONTAINER,
        "command": command
        or ["torchrun", "--nproc-per-node=1", *torchrun_args, "train.py", *train_args],
    }
    pod_spec = on_real_nodes(
        {"restartPolicy": restart_policy, "containers": [container]}, trainer_image
    )
    if node_name:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node_name}
    else:
        pod_spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                # A cordoned node counts no more: a drained pod's replacement may go to
                # the other node.
                "nodeTaintsPolicy": "Honor",
                "labelSelector": {"matchLabels": {JOB_LABEL: name}},
            }
        ]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "annotations": {"k8s-rendezvous.dev/nodes": nodes, **dict(annotations)},
        },
        "spec": {
            "parallelism": parallelism,
            **(
                {"completions": parallelism, **PRODUCTION_SPEC}
                if production
                else {"completions": None, "backoffLimit": backoff_limit}
            ),
            "template": {"spec": pod_spec},
        },
    }


def local_command(words: list[str]) -> list[str]:
    """A container's command with ``torchrun`` the checkout venv's and ``train.py``
    examples/elastic_train.py, as the trainer image runs them."""
    local = {"torchrun": str(VENV_BIN / "torchrun"), "train.py": str(TRAIN_SCRIPT)}
    return [local.get(word, word) for word in words]


def on_real_nodes(pod_spec: dict[str, Any], trainer_image: str) -> dict[str, Any]:
    """``pod_spec`` (a user's, or a workload controller's template) made to run on the real
    nodes in the trainer image: each container's ``torchrun`` is the checkout venv's and
    ``train.py`` is examples/elastic_train.py, reading the host's /usr, Python and checkout
    by hostPath (devkit/cluster/images.py); its progress lines go to the container's log.
    Nothing rendezvous-related is added. Changed in place, and returned."""
    volumes, mounts = images.trainer_mounts(REPO)
    for container in pod_spec["containers"]:
        container["image"] = trainer_image
        container["imagePullPolicy"] = "Never"
        container["command"] = local_command(container.get("command") or [])
        container["env"] = [
            *(container.get("env") or []),
            {"name": "PATH", "value": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "TRAIN_PROGRESS_FILE", "value": "/dev/stdout"},
        ]
        container["volumeMounts"] = [*(container.get("volumeMounts") or []), *mounts]
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), *volumes]
    pod_spec["tolerations"] = [*(pod_spec.get("tolerations") or []), REAL_NODE_TOLERATION]
    pod_spec.setdefault("nodeSelector", {REAL_NODE_LABEL: "true"})
    pod_spec.setdefault("terminationGracePeriodSeconds", 5)
    return pod_spec


def progress_lines(text: str, pod: str) -> list[dict[str, Any]]:
    """The workers' progress lines in the log ``text`` of ``pod``, each naming the pod."""
    lines = []
    for line in text.splitlines():
        if line.startswith("{") and '"step"' in line:
            with contextlib.suppress(json.JSONDecodeError):
                lines.append({**json.loads(line), "pod": pod})
    return lines


@dataclass
class TrainingJob:
    """A training workload's pods: a Job's, or (with ``selector``) those of the Jobs a
    workload controller made."""

    api: kubernetes.client.ApiClient
    namespace: str
    name: str
    selector: str = ""
    """The pods' label selector; the Job ``name``'s pods if empty."""
    container: str = CONTAINER

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    def pods(self) -> list[dict[str, Any]]:
        found = read_object(
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=self.selector or f"{JOB_LABEL}={self.name}",
        )
        return list(found["items"])

    def rendezvous_status(self) -> dict[str, Any]:
        """The status of the Rendezvous named after the Job (an annotated Job's)."""
        body = read_object(
            kubernetes.client.CustomObjectsApi(self.api).get_namespaced_custom_object,
            objects.GROUP,
            objects.VERSION,
            self.namespace,
            objects.PLURAL,
            self.name,
        )
        return dict(body.get("status") or {})

    def running_pods(self) -> list[dict[str, Any]]:
        return [
            pod
            for pod in self.pods()
            if dig(pod, "status", "phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        ]

    def logs(self, pod: str, *, previous: bool = False) -> str:
        try:
            return str(
                self.core.read_namespaced_pod_log(
                    pod, self.namespace, container=self.container, previous=previous
                )
            )
        except ApiException as exc:
            # Not started yet, gone, no previous container (400, 404), or its kubelet is
            # unreachable (500: a lost node's logs cannot be read, as in any cluster).
            if exc.status in (400, 404, 500):
                return ""
            raise

    def progress(self) -> list[dict[str, Any]]:
        """Every progress line of the pods' current (and previous) containers, each naming
        the pod whose log it is in (a worker names its hostname, which is not its pod's
        name in a JobSet)."""
        lines: list[dict[str, Any]] = []
        for pod in self.pods():
            name = pod["metadata"]["name"]
            texts = [self.logs(name)]
            if any(
                s.get("restartCount") for s in dig(pod, "status", "containerStatuses", default=[])
            ):
                texts.append(self.logs(name, previous=True))
            for text in texts:
                lines += progress_lines(text, name)
        return lines

    def follow_log(self, pod: str) -> concurrent.futures.Future[str]:
        """The log of ``pod``'s running container, read as it is written, complete once the
        container has ended. A log read afterwards may be gone: the kubelet removes a
        deleted pod's ended containers, and their logs, at once."""
        # Not preloaded, the client hands back the open response, not the str it declares.
        response = cast(
            urllib3.HTTPResponse,
            self.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                container=self.container,
                follow=True,
                _preload_content=False,
                _request_timeout=FOLLOW_SECONDS,
            ),
        )
        whole: concurrent.futures.Future[str] = concurrent.futures.Future()

        def read() -> None:
            try:
                whole.set_result(response.read().decode(errors="replace"))
            except BaseException as error:  # handed to whoever waits on the log
                whole.set_exception(error)
            finally:
                response.release_conn()

        threading.Thread(target=read, name=f"log-{pod}", daemon=True).start()
        return whole

    def world(self, size: int, *, after: float, steps: int = 2) -> World | None:
        """The latest world of ``size`` workers that started after ``after`` (host clock)
        and has trained ``steps`` steps on every rank, if there is one. A world is told
        apart by its master (rank 0's store address and port, new each round)."""
        by_master: dict[str, list[dict[str, Any]]] = {}
        for line in self.progress():
            if line["started"] > after and line["world_size"] == size:
                by_master.setdefault(line["master"], []).append(line)
        complete = [
            world
            for master, lines in by_master.items()
            if (world := _complete_world(master, lines, size, steps)) is not None
        ]
        return max(complete, key=lambda world: world.started, default=None)

    def first_world(self, *, after: float, steps: int = 2) -> World | None:
        """The first world of any size whose workers all started after ``after`` and have
        trained ``steps`` steps, by when its last rank took its first step."""
        by_world: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for line in self.progress():
            if line["started"] > after:
                by_world.setdefault((line["master"], line["world_size"]), []).append(line)
        complete = [
            world
            for (master, size), lines in by_world.items()
            if (world := _complete_world(master, lines, size, steps)) is not None
        ]
        return min(complete, key=lambda world: world.first_step, default=None)

    def wait_world(self, size: int, *, after: float, timeout: float = 240) -> World:
        return wait_for(
            lambda: self.world(size, after=after),
            timeout,
            f"Job {self.name}: a world of {size} workers started after {after:.1f} and training",
            interval=0.5,
            max_interval=2.0,
        )


@dataclass(frozen=True)
class World:
    size: int
    master: str
    pods: dict[int, str]
    """Pod of each global rank."""
    pids: dict[int, int]
    started: float
    """When the last of its workers started (host clock)."""
    first_step: float
    """When the last rank completed its first step (host clock)."""


def _complete_world(
    master: str, lines: list[dict[str, Any]], size: int, steps: int
) -> World | None:
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_rank.setdefault(line["rank"], []).append(line)
    if sorted(by_rank) != list(range(size)):
        return None
    if any(max(line["step"] for line in ranked) < steps - 1 for ranked in by_rank.values()):
        return None
    return World(
        size=size,
        master=master,
        pods={rank: ranked[0]["pod"] for rank, ranked in by_rank.items()},
        pids={rank: ranked[0]["pid"] for rank, ranked in by_rank.items()},
        started=max(line["started"] for line in lines),
        first_step=max(min(line["time"] for line in ranked) for ranked in by_rank.values()),
    )


RunJob = Callable[..., TrainingJob]
"""The run_job fixture: ``run_job(**job_manifest options) -> TrainingJob``."""


def create_job(
    api: kubernetes.client.ApiClient, namespace: str, manifest: dict[str, Any]
) -> TrainingJob:
    # The manifest as written (the client sends a dict as it is).
    kubernetes.client.BatchV1Api(api).create_namespaced_job(namespace, manifest)  # type: ignore[arg-type]
    return TrainingJob(api, namespace, manifest["metadata"]["name"])


def operator_leader(api: kubernetes.client.ApiClient) -> str:
    """The pod that holds the operator's leader-election Lease."""
    coordination = kubernetes.client.CoordinationV1Api(api)

    def holder() -> str | None:
        lease = read_object_or_none(
            coordination.read_namespaced_lease, chart.OPERATOR, chart.NAMESPACE
        )
        if lease is None:  # no replica has taken it yet
            return None
        found = (lease.get("spec") or {}).get("holderIdentity")
        return leadership.pod_of(str(found)) if found else None

    return wait_for(holder, 60, "a leader among the operator's pods")


def wait_webhook_served_by_leader_alone(api: kubernetes.client.ApiClient) -> None:
    """Until the webhook Service's only ready endpoint is the leader's pod. The pod of a
    leader whose node was lost stays Ready, and so an endpoint, until its kubelet is back
    and probes it: meanwhile the API server sends it some admission requests, which fail,
    and their pods are admitted without the env (the webhook's failure policy Ignore)."""
    discovery = kubernetes.client.DiscoveryV1Api(api)

    def ready_endpoints() -> set[str]:
        slices = read_object(
            discovery.list_namespaced_endpoint_slice,
            chart.NAMESPACE,
            label_selector=f"kubernetes.io/service-name={chart.WEBHOOK_SERVICE}",
        )["items"]
        return {
            dig(endpoint, "targetRef", "name")
            for found in slices
            for endpoint in found.get("endpoints") or []
            if dig(endpoint, "conditions", "ready")
        }

    wait_for(
        lambda: ready_endpoints() == {operator_leader(api)},
        120,
        "the webhook Service to send admission requests to the operator's leader alone",
    )


def pod_processes(pod: dict[str, Any]) -> dict[int, str]:
    """PID -> command line of every process in the pod's containers, from its cgroup."""
    uid = pod["metadata"]["uid"]
    found: dict[int, str] = {}
    for procs in Path("/sys/fs/cgroup/pids").rglob(f"pod{uid}/*/cgroup.procs"):
        for pid in procs.read_text().split():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found[int(pid)] = cmdline.decode(errors="replace")
    return found


def agent_pid(pod: dict[str, Any]) -> int:
    (pid,) = [p for p, cmd in pod_processes(pod).items() if "/torchrun " in cmd]
    return pid


def worker_pid(pod: dict[str, Any]) -> int:
    """The pod's worker: the process running the training script or, started warm
    (k8s_rendezvous.warm), the zygote's fork that runs it (the client the agent started
    only stands in for it)."""
    processes = pod_processes(pod)
    zygotes = {pid for pid, cmd in processes.items() if "k8s_rendezvous.warm --zygote" in cmd}
    forks = [pid for pid in zygotes if _parent(pid) in zygotes]
    if not forks:
        forks = [
            pid
            for pid, cmd in processes.items()
            if "elastic_train" in cmd and "/torchrun " not in cmd
        ]
    (pid,) = forks
    return pid


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command in parentheses may hold spaces: the fields after its ")" are fixed.
    return int(stat.rpartition(")")[2].split()[1])
