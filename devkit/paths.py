"""Where the repository's files are, for the kit and everything that uses it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "manifests" / "crds"
RBAC = REPO / "manifests" / "rbac"
POLICY = REPO / "manifests" / "policy"
"""The CEL admission policies a production install adds."""
FLOW_CONTROL = REPO / "manifests" / "flowcontrol"
"""API Priority and Fairness for the nodes' Leases, as a production install adds."""
CHART = REPO / "charts" / "k8s-rendezvous"
TRAIN_SCRIPT = REPO / "examples" / "elastic_train.py"
