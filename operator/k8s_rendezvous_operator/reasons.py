"""The reasons of the Events the operator posts, in one place: users filter and alert on
them (``kubectl get events --field-selector reason=NodeRefused``), so each is part of the
interface. The messages stay at their sites: each names its own problem and fix."""

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
