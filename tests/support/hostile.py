"""A hostile container: what one pod can write with its own bound token, raw, without
our handler in the way (tests/security)."""

from __future__ import annotations

from typing import Any

import kubernetes.client

from devkit.cluster.controlplane import ControlPlane
from k8s_rendezvous.wire import leases, objects


class Attacker:
    """Raw Lease writes with one pod's own bound token, as a hostile container would."""

    def __init__(self, control_plane: ControlPlane, namespace: str, pod: dict[str, Any]) -> None:
        self.name = pod["metadata"]["name"]
        self.ip = pod["status"]["podIP"]
        self.namespace = namespace
        token = control_plane.token_for(
            namespace, "default", pod_name=self.name, pod_uid=pod["metadata"]["uid"]
        )
        self.api = control_plane.client_for_token(token)
        self._custom = kubernetes.client.CustomObjectsApi(self.api)

    def write_unreadable_request(self, rendezvous: str) -> None:
        """Write its Lease in ``rendezvous`` with a request no operator can read."""
        self.write_entry(rendezvous, "{not json")

    def request(
        self,
        rendezvous: str,
        intent: leases.NodeIntent,
        addr: str | None = None,
        probe_port: int = 0,
    ) -> None:
        """Write its Lease in ``rendezvous`` asking ``intent``, with ``addr`` (its own IP),
        answering probes at ``probe_port`` (0: none)."""
        entry = leases.NodeEntry(
            "attacker-1", 1, addr or self.ip, 29500, intent, probe_port=probe_port
        )
        self.write_annotations(
            rendezvous,
            {
                objects.ENTRY_ANNOTATION: entry.to_annotation(),
                objects.INSTANCE_ANNOTATION: "attacker-1",
            },
        )

    def write_entry(self, rendezvous: str, text: str) -> None:
        """Write ``text`` as the entry of its Lease in ``rendezvous`` (made if missing)."""
        self.write_annotations(rendezvous, {objects.ENTRY_ANNOTATION: text})

    def write_annotations(self, rendezvous: str, annotations: dict[str, str]) -> None:
        """Write ``annotations`` on its Lease in ``rendezvous`` (made if missing)."""
        name = objects.lease_name(rendezvous, self.name)
        try:
            self._custom.patch_namespaced_custom_object(
                "coordination.k8s.io",
                "v1",
                self.namespace,
                "leases",
                name,
                {"metadata": {"annotations": annotations}},
                _content_type="application/merge-patch+json",
            )
        except kubernetes.client.exceptions.ApiException as error:
            if error.status != 404:
                raise
            self._custom.create_namespaced_custom_object(
                "coordination.k8s.io",
                "v1",
                self.namespace,
                "leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": name,
                        "labels": {objects.NODE_LABEL: rendezvous},
                        "annotations": annotations,
                    },
                    "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 30},
                },
            )
