"""The operator's reachability probe of a member's agent and the agent's echo, one UDP
datagram each way."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Final

PROBE_NONCE_BYTES: Final = 16


@dataclasses.dataclass(frozen=True)
class Probe:
    """The operator's reachability probe of a member's agent, one UDP datagram each way
    (:data:`leases.NodeEntry.probe_port`): the agent echoes the nonce, so a reply proves the
    agent got this very probe, and no one who did not see it can answer in its stead.

    The request is padded to at least the reply's size, so the agent never sends more
    than it is sent (a spoofed source cannot use it to amplify a flood)."""

    nonce: bytes
    """:data:`PROBE_NONCE_BYTES` random bytes, new for each probe: a nonce vouches for
    one member only, so one member's answer says nothing of another's. The agent only
    echoes it, so how the operator makes it is not part of the format (version 1)."""

    _REQUEST: ClassVar[bytes] = b"k8s-rendezvous.dev/probe/1?"
    _REPLY: ClassVar[bytes] = b"k8s-rendezvous.dev/probe/1!"
    REQUEST_BYTES: ClassVar[int] = 64

    def request(self) -> bytes:
        return (self._REQUEST + self.nonce).ljust(self.REQUEST_BYTES, b"\0")

    def reply(self) -> bytes:
        return self._REPLY + self.nonce

    @classmethod
    def from_request(cls, datagram: bytes) -> Probe | None:
        """The probe a datagram asks for (``None``: not a probe, to be ignored)."""
        if len(datagram) != cls.REQUEST_BYTES or not datagram.startswith(cls._REQUEST):
            return None
        start = len(cls._REQUEST)
        return cls(datagram[start : start + PROBE_NONCE_BYTES])

    @classmethod
    def from_reply(cls, datagram: bytes) -> Probe | None:
        """The probe a datagram answers (``None``: not a reply, to be ignored)."""
        if len(datagram) != len(cls._REPLY) + PROBE_NONCE_BYTES:
            return None
        if not datagram.startswith(cls._REPLY):
            return None
        return cls(datagram[len(cls._REPLY) :])
