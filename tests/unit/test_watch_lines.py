"""Splitting a watch stream into events, whatever the chunks the network delivers."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from k8s_rendezvous.rest import _lines

EVENTS = st.lists(
    st.binary(min_size=1, max_size=40).map(lambda raw: raw.replace(b"\n", b"x")), max_size=8
)


@given(events=EVENTS, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_every_complete_line_comes_out_once_however_the_stream_is_cut(
    events: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(event + b"\n" for event in events)
    points = sorted({0, len(stream), *(cut for cut in cuts if cut < len(stream))})
    chunks = [stream[start:end] for start, end in itertools.pairwise(points)]
    assert list(_lines(chunks)) == events


def test_blank_lines_are_skipped_and_an_unfinished_last_line_is_dropped() -> None:
    chunks = [b'{"a"', b":1}\n\n", b'\n{"b":2}\n{"c', b'":']
    assert list(_lines(chunks)) == [b'{"a":1}', b'{"b":2}']
