"""Whose a Rendezvous is, as the reconcile settles it with the API server: a pod-made one
given its creator's workload as owner, or deleted to give its name back to the workload
it is named after (:func:`.membership.claimed_by`); and the controllers a node's pod
stands for, where they decide whether it belongs (:func:`.membership.to_climb`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from k8s_rendezvous_operator import (
    events,
    jobs,
    kube,
    membership,
    owners,
    reasons,
    reporting,
    workloads,
)
from k8s_rendezvous_operator.rendezvous_view import RendezvousView

log = logging.getLogger(__name__)

REPORTS_KEPT = 1024
"""Names given back whose report is remembered (once per pod that made one)."""


class Ownership:
    """Adopts and gives back pod-made Rendezvous, and climbs pods' controllers."""

    def __init__(self, api: kube.ReconcilerApi, reporter: reporting.Reporter) -> None:
        self._api = api
        self._reporter = reporter
        self._owners = owners.Owners(api.get_owner)
        self._given_back: dict[tuple[str, str, str], None] = {}
        """(namespace, rendezvous, creator pod) of each pod-made Rendezvous deleted for the
        workload named so, as reported (once per pod; the oldest forgotten first)."""

    async def with_ancestors(
        self,
        namespace: str,
        workload: membership.Workload,
        identities: Mapping[str, membership.PodIdentity | None],
    ) -> dict[str, membership.PodIdentity | None]:
        """The pods' identities with the controllers their controller stands for, where
        that decides whether they belong (:func:`membership.to_climb`); a pod whose chain
        is not known now stays as it is, refused until its next event."""
        result = dict(identities)
        for node, identity in identities.items():
            if identity is None or (reference := membership.to_climb(workload, identity)) is None:
                continue
            above = await self._owners.above(namespace, reference)
            if above is not None:
                result[node] = dataclasses.replace(
                    identity,
                    ancestors=tuple(parent.uid for parent in above),
                    workload=workloads.workload(reference, above),
                )
        return result

    async def adopt(self, view: RendezvousView, creator: str) -> dict[str, Any] | None:
        """Make the workload of the pod that created the Rendezvous its owner: its
        controller, or the workload that stands behind it (a Job's JobSet, a
        LeaderWorkerSet: :mod:`.workloads`); the Rendezvous as adopted, or ``None``. The
        pod only said that it made it (the admission policy holds that to its token):
        which workload that is, is the word of the Pod and its controllers' objects, never
        the pod's.

        Raises:
            Exception: what else failed (the caller tries again at its next event).
        """
        namespace, name = view.key
        try:
            pod = await asyncio.to_thread(self._api.get_pod, namespace, creator)
            controller = None if pod is None else workloads.controller(pod.get("metadata") or {})
            if controller is not None:
                above = await self._owners.above(namespace, controller) or ()
                owner = workloads.workload(controller, above).owner_reference()
                adopted = await asyncio.to_thread(
                    self._api.adopt_rendezvous, namespace, name, view.uid, owner
                )
                log.info(
                    "Rendezvous %s/%s: owned by %s/%s", *view.key, owner["kind"], owner["name"]
                )
                return adopted
        except (kube.NotFound, kube.Conflict):
            return None  # deleted or made anew meanwhile: its own event follows
        message = reasons.no_owner(name, creator, pod_exists=pod is not None)
        self._reporter.warn(view.key, view.reference, reasons.NO_OWNER, message)
        return None

    async def give_name_back(
        self, view: RendezvousView, pod: str, claimant: workloads.Reference
    ) -> None:
        """Delete the pod-made Rendezvous ``view``, named after ``claimant``, whose pod
        ``pod`` asks to join it, and say so on both workloads: the claimant's pods make it
        anew (their creator role), as they would have, had the other pod not been first.
        The deleted one's maker can make it again only to see it deleted again, at the
        next join of the claimant's pods: each try costs it a create."""
        namespace, name = view.key
        held = view.holding
        assert held.creator is not None, "only a pod-made Rendezvous is claimed"
        try:
            await asyncio.to_thread(self._api.delete_rendezvous, namespace, name, held.uid)
        except (kube.NotFound, kube.Conflict):
            return  # deleted, or made anew, meanwhile: that one's event follows
        except kube.Refused as error:  # RBAC or the admission policy of another release
            message = reasons.rendezvous_not_given_back(
                name, namespace, held.creator, held.owner_name, str(claimant), error
            )
            self._reporter.warn(
                view.key, view.reference, reasons.RENDEZVOUS_NOT_OWNED, message, pod=held.creator
            )
            return
        log.warning(
            "Rendezvous %s/%s: made by pod %s (%s), deleted: it is named after %s, whose pod "
            "%s asks to join it",
            *view.key,
            held.creator,
            held.owner_name or "no owner",
            claimant,
            pod,
        )
        reported = (namespace, name, held.creator)
        if reported in self._given_back or not self._reporter.allow(view.key, held.creator):
            return
        self._given_back[reported] = None
        if len(self._given_back) > REPORTS_KEPT:
            del self._given_back[next(iter(self._given_back))]
        self._reporter.post(
            [
                events.object_reference(
                    namespace, claimant.api_version, claimant.kind, claimant.name, claimant.uid
                )
            ],
            warning=True,
            reason=reasons.RENDEZVOUS_REPLACED,
            message=reasons.rendezvous_given_back(
                name, held.creator, held.owner_name, str(claimant)
            ),
        )
        maker = await jobs.maker(self._api, namespace, held)
        if maker is not None:
            self._reporter.post(
                [maker],
                warning=True,
                reason=reasons.RENDEZVOUS_REPLACED,
                message=reasons.rendezvous_taken_back(
                    name, held.creator, held.owner_name, str(claimant)
                ),
            )
