"""The next round's TCPStore server is made ahead, off the join's critical path."""

from __future__ import annotations

import threading

import pytest

from k8s_rendezvous.handler import _NextStore


class Maker:
    """Stands in for TCPStore creation: records the thread it ran on, can fail once."""

    def __init__(self, fail_first: bool = False) -> None:
        self.threads: list[str] = []
        self.fail_next = fail_first

    def __call__(self) -> object:
        self.threads.append(threading.current_thread().name)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("address in use")
        return object()


def test_a_prepared_store_is_made_in_the_background_and_taken_once() -> None:
    make = Maker()
    stores = _NextStore(make)  # type: ignore[arg-type]
    stores.prepare()
    first = stores.take()
    assert make.threads == ["k8s-rendezvous-store"]
    second = stores.take()  # nothing prepared: made now, on the caller's thread
    assert second is not first
    assert make.threads == ["k8s-rendezvous-store", threading.current_thread().name]


def test_a_failed_preparation_raises_its_error_at_take_and_the_next_is_fresh() -> None:
    make = Maker(fail_first=True)
    stores = _NextStore(make)  # type: ignore[arg-type]
    stores.prepare()
    with pytest.raises(RuntimeError, match="address in use"):
        stores.take()
    stores.prepare()
    assert stores.take() is not None
    assert make.threads == ["k8s-rendezvous-store", "k8s-rendezvous-store"]


def test_discard_drops_the_prepared_store() -> None:
    make = Maker()
    stores = _NextStore(make)  # type: ignore[arg-type]
    stores.prepare()
    stores.discard()
    stores.take()
    assert len(make.threads) == 2
