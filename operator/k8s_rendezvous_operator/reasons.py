"""The reasons and messages of the Events the operator posts and of the conditions it sets,
in one place: users filter and alert on the reasons (``kubectl get events --field-selector
reason=NodeRefused``) and read the messages, so each is part of the interface. A message
names its own problem and its fix."""

from __future__ import annotations

from typing import Final

# On a Rendezvous: its rounds.
ROUND_SEALED: Final = "RoundSealed"
MEMBER_LOST: Final = "MemberLost"
CLOSED: Final = "Closed"
# On a Rendezvous: what it is not told, or refuses.
NODE_REFUSED: Final = "NodeRefused"
INVALID_ENTRY: Final = "InvalidEntry"
INVALID_RENDEZVOUS: Final = "InvalidRendezvous"
NODE_WITHOUT_POD: Final = "NodeWithoutPod"
NO_OWNER: Final = "NoOwner"
# On an annotated Job (and a pod of it).
RENDEZVOUS_CREATED: Final = "RendezvousCreated"
RENDEZVOUS_RECREATED: Final = "RendezvousRecreated"
RENDEZVOUS_NOT_OWNED: Final = "RendezvousNotOwned"
INVALID_ANNOTATION: Final = "InvalidAnnotation"
RUN_ID_IMMUTABLE: Final = "RunIdImmutable"
SERVICE_ACCOUNT_NOT_FOUND: Final = "ServiceAccountNotFound"
POD_NOT_INJECTED: Final = "PodNotInjected"

# Conditions (``Ready`` and ``Closed``; their types are in :mod:`.rounds`). ``Ready``'s
# reason while a round forms is the state itself (``Forming``, ``Reforming``).
OPEN: Final = "Open"
"""``Closed`` is False: rounds can still be formed."""
OPEN_MESSAGE: Final = "rounds can still be formed"
READY_CLOSED_MESSAGE: Final = "the rendezvous is closed"
"""``Ready`` is False, reason :data:`CLOSED`."""


def ready_message(round_: int, world_size: int, master: str) -> str:
    return f"round {round_}: {world_size} nodes, master {master}"


def forming_message(round_: int) -> str:
    return f"forming round {round_}"


# Why a rendezvous closed (``status.closedMessage``, the ``Closed`` condition and Event).


def closed_by_node(pod: str) -> str:
    return f"pod {pod} called set_closed()"


def closed_node_finished(pod: str, round_: int) -> str:
    return (
        f"pod {pod} of round {round_} finished (its workers succeeded): no further round "
        "forms, and the other members finish their work"
    )


def closed_all_left(round_: int) -> str:
    return f"every node of round {round_} left and none is waiting"
