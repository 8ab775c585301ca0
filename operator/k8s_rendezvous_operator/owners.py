"""The controllers a pod's controller stands for (:mod:`.workloads`), climbed with one
read of each object on the way, and kept: what an object's controller stands for is read
once per object (by uid: one made anew under the same name is another), so that a join
costs no reads once its workload's chain is known."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Final

from k8s_rendezvous_operator import workloads

KEPT: Final = 4096
"""Objects whose answer is kept at most (the oldest are forgotten first): a chain of a
few objects per workload, for every workload whose pods asked to join."""

GetOwner = Callable[[str, workloads.Reference], Mapping[str, Any] | None]
"""Reads the object a reference names in a namespace (``None``: not found)."""


class Owners:
    def __init__(self, get_owner: GetOwner) -> None:
        self._get_owner = get_owner
        self._stands_for: dict[tuple[str, str], workloads.Reference | None] = {}
        """Per object (namespace, uid) read: the controller it stands for, if any."""

    async def above(
        self, namespace: str, reference: workloads.Reference
    ) -> tuple[workloads.Reference, ...] | None:
        """The controllers ``reference`` stands for, nearest first (empty: it is the
        workload); ``None`` if an object on the way is gone or was made anew (unknown now:
        asked again at the next event)."""
        chain: list[workloads.Reference] = []
        while len(chain) < workloads.MAX_DEPTH and workloads.may_stand_for_another(reference):
            key = (namespace, reference.uid)
            if key in self._stands_for:
                parent = self._stands_for[key]
            else:
                read = await asyncio.to_thread(self._get_owner, namespace, reference)
                try:
                    parent = workloads.stands_for(reference, read)
                except workloads.Unknown:
                    return None
                self._keep(key, parent)
            if parent is None:
                break
            chain.append(parent)
            reference = parent
        return tuple(chain)

    def _keep(self, key: tuple[str, str], parent: workloads.Reference | None) -> None:
        if len(self._stands_for) >= KEPT:
            del self._stands_for[next(iter(self._stands_for))]
        self._stands_for[key] = parent
