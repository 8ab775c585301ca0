"""The operator's probes against a pod that answers more than its own, with real pod
tokens: a member of one namespace's rendezvous, probed as every member is, answers its
probe and forges answers for every other member it can think of; a member of another
namespace's round that goes silent is dropped all the same."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import kubernetes.client
from tests.support.fixtures import Node, Rendezvous, create_pods, join_all
from tests.support.hostile import Attacker

from devkit import manifests
from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.wire import datagrams, leases, objects

PROBE_INTERVAL, PROBE_WINDOW = 0.5, 1.5
"""Short, so that a silent member is judged within seconds (the default window is 3 s)."""


class Forger:
    """A pod's UDP socket at its own IP, named in its join request as its probe port: it
    answers each probe it gets, and with the same probe's nonce made to name each other
    target the operator could have probed in that round (the nonce used to be one secret
    per round followed by the target's index)."""

    def __init__(self, addr: str) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((addr, 0))
        self.socket.settimeout(0.2)
        self.port = int(self.socket.getsockname()[1])
        self.probes = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                datagram, operator = self.socket.recvfrom(128)
            except TimeoutError:
                continue
            probe = datagrams.Probe.from_request(datagram)
            if probe is None:
                continue
            self.probes += 1
            self.socket.sendto(probe.reply(), operator)
            for index in range(64):
                forged = probe.nonce[:-8] + index.to_bytes(8, "big")
                self.socket.sendto(datagrams.Probe(forged).reply(), operator)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        self.socket.close()


def test_a_pod_that_gets_its_own_probe_cannot_answer_for_a_member_of_another_namespace(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    other_namespace: str,
    operator_of_both: Callable[..., OperatorProcess],
    make_rendezvous: Callable[..., Rendezvous],
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Issue 55: a member of another namespace's round that stopped answering was not
    dropped in 20 s while the forger ran (3.5 s without it). Now the forger's answers
    count for itself alone, and the silent member is dropped within the window."""
    operator_of_both(f"--probe-interval={PROBE_INTERVAL}", f"--probe-window={PROBE_WINDOW}").start()
    victims_round = make_rendezvous(2, 2)
    pods = create_pods(admin_api, workers_namespace, ["answering", "silent"])
    answering, silent = attach_nodes(victims_round, pods, min_nodes=2, max_nodes=2)
    join_all([answering, silent])

    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        other_namespace,
        objects.PLURAL,
        manifests.rendezvous(other_namespace, "own", 1, 1),
    )
    (pod,) = create_pods(admin_api, other_namespace, ["forger"])
    attacker = Attacker(control_plane, other_namespace, pod)
    forger = Forger(attacker.ip)
    try:
        attacker.request("own", leases.NodeIntent.JOIN, probe_port=forger.port)
        wait_for(lambda: forger.probes >= 2, 30, "the forger, a member, is probed")
        # The silent member's agent stops answering, its heartbeats go on: a cut UDP path.
        silent.handler.probes.stop()
        lost = wait_for(
            lambda: next(
                (m for _, r, m in victims_round.events() if r == "MemberLost" and "silent" in m),
                None,
            ),
            PROBE_WINDOW + 10,
            "the silent member dropped while the forger answers",
        )
        assert "AgentUnreachable" in lost, lost
        assert forger.probes >= 2
    finally:
        forger.stop()
