"""What the operator knows of each node's pod and its Lease, and the labelling that makes
a node's pod known: the pod watch streams only pods with the rendezvous label, so the
operator labels the pod behind each request, and reads its answer as the pod's state.
The Leases of pods that are gone are collected here too (:mod:`.lease_sweep` decides)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from k8s_rendezvous.wire import objects
from k8s_rendezvous_operator import (
    failed_checks,
    kube,
    lease_sweep,
    observe,
    reasons,
    reporting,
    rounds,
)
from k8s_rendezvous_operator.events import Key

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PodMemory:
    """What is known of one node's pod and its Lease; dropped with its rendezvous."""

    observation: rounds.PodObservation | None = None
    """``None``: the pod was never observed."""
    version: int = -1
    """The resourceVersion ``observation`` is from: an older answer is dropped."""
    node_name: str | None = None
    """The Kubernetes node it runs on, once known."""
    heartbeat: rounds.Heartbeat | None = None
    writer: str | None = None
    """The uid of the pod that wrote its Lease, where the Lease says."""
    lease_problem: str | None = None
    """Why its Lease's request cannot be read (said once, until it writes a good one)."""
    check_reported: failed_checks.Reported | None = None
    """The last failed health check of its Lease reported (each is said once)."""
    labelled: bool = False
    labelling: asyncio.Task[None] | None = None
    lease: lease_sweep.LeaseRead | None = None
    """Its Lease as last seen (``None``: none seen, or deleted)."""
    cleared: tuple[rounds.PodObservation | None, str | None] | None = None
    """The observation and Lease writer under which its Lease was last checked and found
    to be its live pod's: not checked again until one of them changes."""

    @property
    def replaced(self) -> bool:
        """Whether the pod that wrote the Lease is not the one we know of by that name: a
        StatefulSet or PyTorchJob makes a failed pod anew under the same name, and the new
        one, not yet labelled, is read (and labelled) only by asking again."""
        known = self.observation
        return (
            known is not None
            and known.identity is not None
            and self.writer is not None
            and known.identity.uid != self.writer
        )


class Pods:
    """Each node's pod, by (namespace, pod name)."""

    def __init__(
        self,
        api: kube.ReconcilerApi,
        reporter: reporting.Reporter,
        request: Callable[[Key], None],
        known_body: Callable[[Key], Mapping[str, Any] | None],
    ) -> None:
        self._api = api
        self._reporter = reporter
        self._request = request
        self._known_body = known_body
        self._pods: dict[Key, PodMemory] = {}
        self._marked: dict[Key, set[str]] = {}
        """By rendezvous: the nodes whose Leases may have outlived their pods."""
        self._sweeping: dict[Key, asyncio.Task[None]] = {}
        self._sweep_failed: dict[Key, float] = {}
        """By rendezvous: when (event-loop time) a check or delete of its Leases failed."""

    def memory(self, pod: Key) -> PodMemory:
        """What is known of ``pod``, remembered from now on."""
        return self._pods.setdefault(pod, PodMemory())

    def get(self, pod: Key) -> PodMemory | None:
        return self._pods.get(pod)

    def forget(self, namespace: str, nodes: Iterable[str]) -> None:
        for node in nodes:
            self._pods.pop((namespace, node), None)

    def forget_marks(self, key: Key) -> None:
        """Rendezvous ``key`` is gone: its Leases go with it (their owner)."""
        self._marked.pop(key, None)
        self._sweep_failed.pop(key, None)

    def observed(self, pod: Key) -> rounds.PodObservation | None:
        """The pod as last observed (``None``: never)."""
        memory = self._pods.get(pod)
        return None if memory is None else memory.observation

    def seen(
        self,
        key: Key,
        observation: rounds.PodObservation,
        rendezvous: str | None,
        node_name: str | None = None,
        version: int = -1,
    ) -> None:
        """A pod changed: its watch event, or the answer to our labelling of it (whichever
        is older than what we know is dropped)."""
        memory = self.memory(key)
        if version >= 0:
            if version < memory.version:
                return
            memory.version = version
        if node_name:
            memory.node_name = node_name
        if memory.observation == observation:
            return
        memory.observation = observation
        self._mark(key, memory)
        if rendezvous:
            self._request((key[0], rendezvous))

    def heartbeats(self, namespace: str, nodes: Iterable[str]) -> dict[str, rounds.Heartbeat]:
        """The last heartbeat of each of ``nodes`` that has one."""
        return {
            node: beat
            for node in nodes
            if (pod := self._pods.get((namespace, node))) and (beat := pod.heartbeat)
        }

    def writers(self, namespace: str, nodes: Iterable[str]) -> dict[str, str]:
        """The uid of the pod that wrote each of ``nodes``' Lease, where it says."""
        return {
            node: writer
            for node in nodes
            if (pod := self._pods.get((namespace, node))) and (writer := pod.writer)
        }

    def lease_seen(self, pod: Key, lease: lease_sweep.LeaseRead | None) -> None:
        """``pod``'s Lease as its watch event shows it (``None``: deleted)."""
        memory = self.memory(pod)
        old = memory.lease
        if old is not None and (lease is None or lease.rendezvous != old.rendezvous):
            self._marked.get((pod[0], old.rendezvous), set()).discard(pod[1])
        memory.lease = lease
        self._mark(pod, memory)

    def _mark(self, pod: Key, memory: PodMemory) -> None:
        """Mark ``pod``'s Lease for a check if what is known says its pod may be gone."""
        lease = memory.lease
        if lease is None:
            return
        cleared = memory.cleared == (memory.observation, lease.pod_uid)
        if not cleared and lease_sweep.suspected(memory.observation, lease):
            self._marked.setdefault((pod[0], lease.rendezvous), set()).add(pod[1])

    def tasks(self) -> Iterator[asyncio.Task[None]]:
        """The labelling and the sweeps under way."""
        yield from (task for pod in self._pods.values() if (task := pod.labelling) is not None)
        yield from self._sweeping.values()

    def sweep(self, key: Key, needed: frozenset[str]) -> None:
        """Collect, in the background, the Leases of Rendezvous ``key`` whose pods are gone
        (a bounded few per call), but those of ``needed`` nodes: the current round's
        members and those it left behind, whose loss the round handles first."""
        if key in self._sweeping or not (marked := self._marked.get(key)):
            return
        now = asyncio.get_running_loop().time()
        if now - self._sweep_failed.get(key, -math.inf) < lease_sweep.RETRY_AFTER_SECONDS:
            return
        nodes = lease_sweep.to_check(marked, needed)
        if nodes:
            task = asyncio.get_running_loop().create_task(self._sweep(key, nodes, needed))
            self._sweeping[key] = task

    async def _sweep(self, key: Key, nodes: list[str], needed: frozenset[str]) -> None:
        try:
            settled = await asyncio.gather(*(self._collect(key, node) for node in nodes))
        finally:
            del self._sweeping[key]
        if not all(settled):
            self._sweep_failed[key] = asyncio.get_running_loop().time()
        marked = self._marked.get(key, set())
        if any(settled) and lease_sweep.to_check(marked, needed, limit=1):
            self._request(key)  # a backlog (after a restart): the next few, one pass on

    async def _collect(self, key: Key, node: str) -> bool:
        """Check one marked Lease against its Pod as read now, and delete it if stale;
        whether that settled it (a failure keeps the mark, for a later pass)."""
        namespace = key[0]
        memory = self._pods.get((namespace, node))
        lease = None if memory is None else memory.lease
        marked = self._marked.get(key, set())
        if memory is None or lease is None or lease.rendezvous != key[1]:
            marked.discard(node)
            return True
        try:
            # Read after the Lease: a pod of the name made since is seen here, or it made
            # a new Lease since, and then the preconditions refuse the delete.
            pod = await asyncio.to_thread(self._api.get_pod, namespace, node)
            if not lease_sweep.stale(lease, pod):
                memory.cleared = (memory.observation, lease.pod_uid)
                log.info(
                    "Lease %s/%s kept: its pod is the one that wrote it", namespace, lease.name
                )
            else:
                await asyncio.to_thread(
                    self._api.delete_lease,
                    namespace,
                    lease.name,
                    lease.uid,
                    lease.resource_version,
                )
                log.info("Lease %s/%s of a pod that is gone deleted", namespace, lease.name)
        except (kube.NotFound, kube.Conflict):
            pass  # gone already, or written since: its next event marks it if still stale
        except Exception as error:
            log.warning(
                "collecting Lease %s/%s of a pod that is gone failed (tried again at a "
                "pass %.0f s or more from now): %s",
                namespace,
                lease.name,
                lease_sweep.RETRY_AFTER_SECONDS,
                error,
            )
            return False
        if memory.lease is lease:  # else a newer version came meanwhile: checked anew
            marked.discard(node)
        return True

    def label(self, namespace: str, rendezvous: str, requests: Iterable[str]) -> None:
        """Label the pod behind each request not yet known (or known as another pod of
        its name), so that its events reach us."""
        for node in requests:
            pod = self.memory((namespace, node))
            if pod.labelling is not None or (
                (pod.observation is not None or pod.labelled) and not pod.replaced
            ):
                continue
            pod.labelling = asyncio.get_running_loop().create_task(
                self._label((namespace, node), rendezvous)
            )

    def looking_at(self, namespace: str, nodes: Iterable[str]) -> list[asyncio.Task[None]]:
        """The labelling still under way of these pods, if they are still not observed:
        labelling a pod is how a restarted operator learns that a pod behind an old request
        is gone, so a round is never sealed with it before the answer (rule 11)."""
        return [
            task
            for node in nodes
            if (pod := self._pods.get((namespace, node))) is not None
            and pod.observation is None
            and (task := pod.labelling) is not None
        ]

    async def with_topology(
        self,
        namespace: str,
        label: str,
        nodes: Iterable[str],
        pods: Mapping[str, rounds.PodObservation],
        node_labels: dict[str, dict[str, str]],
    ) -> dict[str, rounds.PodObservation]:
        """Each node's value of the rank-order label of the Kubernetes node its pod runs on
        (pods read once if the watch has not shown them yet; ``node_labels`` are those read
        so far, kept while the rendezvous lives)."""
        result = dict(pods)
        for pod in nodes:
            memory = self.memory((namespace, pod))
            node = memory.node_name
            if node is None:
                node = await asyncio.to_thread(self._api.pod_node_name, namespace, pod)
                if node is None:
                    continue
                memory.node_name = node
            if node not in node_labels:
                node_labels[node] = await asyncio.to_thread(self._api.node_labels, node)
            observation = result.get(pod, rounds.PodObservation())
            result[pod] = dataclasses.replace(observation, topology=node_labels[node].get(label))
        return result

    async def _label(self, pod: Key, rendezvous: str) -> None:
        try:
            body = await asyncio.to_thread(self._api.label_pod, pod[0], pod[1], rendezvous)
            self.memory(pod).labelled = True
            # The answer is the pod as it is now: no need to wait for its watch event.
            self.seen(
                pod,
                observe.observe_pod(body),
                rendezvous,
                node_name=(body.get("spec") or {}).get("nodeName"),
                version=objects.resource_version(body),
            )
        except kube.NotFound:
            self.seen(pod, rounds.PodObservation(reasons.LOST_POD_NOT_FOUND), rendezvous)
            key = (pod[0], rendezvous)
            # A Lease a pod wrote (its uid annotation says which) outlives that pod: the pod
            # is gone, nothing is misconfigured, and a restarted operator would otherwise
            # warn again of every pod a long job ever replaced. Only a node that never ran
            # in a pod is told to.
            memory = self._pods.get(pod)
            never_a_pod = memory is None or memory.writer is None
            if never_a_pod and (known := self._known_body(key)) is not None:
                lease = objects.lease_name(rendezvous, pod[1])
                message = reasons.node_without_pod(pod[1], pod[0], lease)
                self._reporter.warn(key, known, reasons.NODE_WITHOUT_POD, message, pod=pod[1])
        except Exception:
            log.exception("labelling pod %s/%s failed; it is retried on the next change", *pod)
        finally:
            if (memory := self._pods.get(pod)) is not None:
                memory.labelling = None
