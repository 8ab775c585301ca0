"""Poisoned Leases, written with real pod tokens, against the real operator: each is its
writer's refusal (an ``InvalidEntry`` Warning naming the problem), never the operator's
stop, whether the operator starts among them or is running when they come, and every
other rendezvous, in the writer's namespace and in another, keeps its rounds.

The poisons are the corpus the decoders are fuzzed with (tests/support/poison.py): the
nesting that raised RecursionError (issue 55), and the sizes, counts and types around it.
"""

from __future__ import annotations

from collections.abc import Callable

import kubernetes.client
import pytest
from tests.support.fixtures import Node, Rendezvous, create_pods, join_all, wait_told_to_rejoin
from tests.support.hostile import Attacker
from tests.support.poison import POISONS

from devkit import manifests
from devkit.cluster.controlplane import ControlPlane
from devkit.operator import OperatorProcess
from devkit.waiting import wait_for
from k8s_rendezvous.wire import leases, objects, statuses

MakeRendezvous = Callable[..., Rendezvous]


@pytest.fixture
def operator(operator_of_both: Callable[..., OperatorProcess]) -> OperatorProcess:
    """The operator of both namespaces, not started: each test starts it when it needs."""
    return operator_of_both()


def poison_pods(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    namespace: str,
    make_rendezvous: MakeRendezvous,
) -> tuple[list[Rendezvous], list[Attacker]]:
    """A pod per poison, each writing its poison into its Lease in one of two Rendezvous
    (a rendezvous' Warning budget is 10 a minute, and there are more poisons)."""
    poisoned = [make_rendezvous(1, 1) for _ in range(2)]
    names = [f"poisoner-{poison.name}" for poison in POISONS]
    writers = [
        Attacker(control_plane, namespace, pod) for pod in create_pods(admin_api, namespace, names)
    ]
    for index, (poison, writer) in enumerate(zip(POISONS, writers, strict=True)):
        writer.write_annotations(poisoned[index % 2].name, poison.annotations(writer.ip))
    return poisoned, writers


def wait_each_refused(poisoned: list[Rendezvous], writers: list[Attacker]) -> None:
    """Until each poison's Warning is on its Rendezvous, naming its writer and problem."""
    for index, (poison, writer) in enumerate(zip(POISONS, writers, strict=True)):
        message = wait_for(
            lambda rdzv=poisoned[index % 2], pod=writer.name: invalid_entry(rdzv, pod),
            30,
            f"the InvalidEntry Warning of poison {poison.name}",
        )
        assert poison.problem in message, message
    for rdzv in poisoned:
        assert rdzv.status().state is statuses.RoundState.FORMING, "no poison counted"


def invalid_entry(rdzv: Rendezvous, pod: str) -> str | None:
    """The InvalidEntry Warning on ``rdzv`` about ``pod``'s request, once posted."""
    said = f"pod {pod} wrote a request this operator cannot read, so it is not counted: "
    return next((m for _, r, m in rdzv.events() if r == "InvalidEntry" and said in m), None)


def elsewhere(
    control_plane: ControlPlane, admin_api: kubernetes.client.ApiClient, namespace: str
) -> tuple[Rendezvous, Attacker]:
    """A Rendezvous of another namespace and a pod of its workload asking to join it (a
    well-formed request, raw)."""
    rdzv = Rendezvous(admin_api, namespace, "elsewhere")
    kubernetes.client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
        objects.GROUP,
        objects.VERSION,
        namespace,
        objects.PLURAL,
        manifests.rendezvous(namespace, rdzv.name, 1, 1),
    )
    (pod,) = create_pods(admin_api, namespace, ["joiner"])
    return rdzv, Attacker(control_plane, namespace, pod)


def sealed_with(rdzv: Rendezvous, node: str) -> statuses.RendezvousStatus:
    return rdzv.wait(
        lambda status: (
            status.state is statuses.RoundState.SEALED
            and [member.node for member in status.members] == [node]
        ),
        f"sealed with {node}",
    )


def test_an_operator_starting_among_poisoned_leases_gives_every_other_rendezvous_its_round(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    other_namespace: str,
    operator: OperatorProcess,
    make_rendezvous: MakeRendezvous,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Issue 55: one Lease nested thousands deep made the start-up list of Leases raise
    RecursionError; kopf retried it every 60 s, and no Rendezvous of any namespace got a
    status until an admin deleted that Lease. Every poison is present here at start."""
    poisoned, writers = poison_pods(control_plane, admin_api, workers_namespace, make_rendezvous)
    here = make_rendezvous(1, 1)
    (pod,) = create_pods(admin_api, workers_namespace, ["honest"])
    (honest,) = attach_nodes(here, [pod])
    there, joiner = elsewhere(control_plane, admin_api, other_namespace)
    joiner.request(there.name, leases.NodeIntent.JOIN)

    operator.start()
    (info,) = join_all([honest], timeout=30)
    assert (info.rank, info.world_size) == (0, 1)
    sealed_with(there, joiner.name)
    wait_each_refused(poisoned, writers)


def test_leases_poisoned_while_the_operator_runs_drop_only_their_writers(
    control_plane: ControlPlane,
    admin_api: kubernetes.client.ApiClient,
    workers_namespace: str,
    other_namespace: str,
    operator: OperatorProcess,
    make_rendezvous: MakeRendezvous,
    attach_nodes: Callable[..., list[Node]],
) -> None:
    """Their events used to be dropped (the watch handler raised): a member whose entry
    became unreadable stayed in the round. Now the member that poisons its own entry
    leaves its round and the others re-form, each poison is said, and a rendezvous of
    another namespace asked after them all is sealed."""
    operator.start()
    shared = make_rendezvous(1, 2)
    honest_pod, member_pod = create_pods(admin_api, workers_namespace, ["honest", "member"])
    honest, member = attach_nodes(shared, [honest_pod, member_pod], min_nodes=1, max_nodes=2)
    assert sorted(info.rank for info in join_all([honest, member])) == [0, 1]

    brackets = POISONS[0]
    Attacker(control_plane, workers_namespace, member_pod).write_annotations(
        shared.name, brackets.annotations(member.addr)
    )
    poisoned, writers = poison_pods(control_plane, admin_api, workers_namespace, make_rendezvous)
    wait_told_to_rejoin([honest], "the member that poisoned its entry is out")
    (info,) = join_all([honest])
    assert info.world_size == 1 and [m.node for m in shared.status().members] == ["honest"]
    warned = invalid_entry(shared, "member")
    assert warned is not None and brackets.problem in warned, shared.events()
    wait_each_refused(poisoned, writers)

    there, joiner = elsewhere(control_plane, admin_api, other_namespace)
    joiner.request(there.name, leases.NodeIntent.JOIN)
    sealed_with(there, joiner.name)
