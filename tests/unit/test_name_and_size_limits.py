"""Names and sizes at the limits, without an API server.

Aspects: the Lease name of any Rendezvous name (at most 63 characters) and pod name (at
most 253) is a valid Kubernetes name of at most 253 characters, distinct per pod (a known
bug when the name is cut after a '-' or '.'); and the size of a status of 1000 members and
1000 left behind with the longest names, against etcd's default request limit.
"""

from __future__ import annotations

import json
import re

import hypothesis
from hypothesis import strategies as st

from k8s_rendezvous.wire import objects, records, statuses

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""What the API server accepts as metadata.name of a Lease (RFC 1123 subdomain)."""
ETCD_DEFAULT_MAX_REQUEST_BYTES = 1_572_864

label = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?\Z")


def names(max_size: int, *, dots: bool) -> st.SearchStrategy[str]:
    """Valid names (DNS labels joined by dots if allowed) of at most ``max_size``."""
    parts = st.lists(label, min_size=1, max_size=20)
    joined = parts.map(".".join if dots else "-".join)
    return joined.map(lambda n: n[:max_size].rstrip("-.")).filter(
        lambda n: bool(n) and DNS_SUBDOMAIN.match(n) is not None
    )


def longest(length: int, prefix: str) -> str:
    return (prefix + "-" + "x" * length)[: length - 1] + "z"


def test_a_shortened_lease_name_cut_after_a_dash_is_still_a_valid_name() -> None:
    rendezvous = longest(63, "r")
    pod = "p" * (236 - 64 - 1) + "-" + "q" * 80  # the cut falls right after the '-'
    name = objects.lease_name(rendezvous, pod)
    assert len(name) <= 253
    assert DNS_SUBDOMAIN.match(name), name


@hypothesis.given(rendezvous=names(63, dots=False), pod=names(253, dots=True))
@hypothesis.example(rendezvous=longest(63, "r"), pod=longest(253, "p"))
def test_lease_names_are_short_enough_and_distinct_per_pod(rendezvous: str, pod: str) -> None:
    name = objects.lease_name(rendezvous, pod)
    assert len(name) <= 253
    assert name.startswith(f"{rendezvous}."), "the operator's label, not the name, finds it"
    other = objects.lease_name(rendezvous, pod + "0" if len(pod) < 253 else pod[:-1] + "0")
    assert other != name


def test_a_status_of_1000_nodes_with_the_longest_names_fits_a_request() -> None:
    """A sealed round of 1000 members and as many left behind from the round before, all
    253-character pods with IPv6 addresses: under half of etcd's default request limit."""
    pods = [longest(252, f"p{i}") for i in range(1000)]
    addr = "fd00:1234:5678:9abc:def0:1234:5678:9abc"
    status = statuses.RendezvousStatus(
        state=statuses.RoundState.SEALED,
        round=10**6,
        members=tuple(records.Member(p, "0123456789abcdef", 10**6, addr, 99) for p in pods),
        left_behind=tuple(
            records.Member(p + "0", "fedcba9876543210", 10**6, addr, 99) for p in pods
        ),
        master=records.Master(addr, 65535),
    )
    encoded = json.dumps(status.to_dict(), separators=(",", ":")).encode()
    assert len(encoded) < ETCD_DEFAULT_MAX_REQUEST_BYTES // 2, len(encoded)
    assert statuses.RendezvousStatus.from_dict(json.loads(encoded)) == status
