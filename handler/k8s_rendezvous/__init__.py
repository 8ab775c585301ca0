"""k8s-rendezvous, pod side: a torchrun rendezvous backend kept in a Kubernetes resource.

torch imports :mod:`k8s_rendezvous.plugin` at start-up of every ``torchrun``, so this
package imports nothing heavy at the top level; the handler lives in
:mod:`k8s_rendezvous.handler` and is imported only when a ``kubernetes`` backend is used.
"""

BACKEND_NAME = "kubernetes"
"""The torchrun backend name (``--rdzv-backend=kubernetes``) and our entry-point name."""

__version__ = "0.1.0"
"""The one version of the distribution, its operator and its chart (pyproject reads it;
hack/sync_chart.py keeps Chart.yaml's version and appVersion equal to it)."""
