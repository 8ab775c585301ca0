"""k8s-rendezvous operator: the single authority that seals rendezvous rounds.

:mod:`.rounds` decides (pure functions); :mod:`.kube` is the only module that calls the
Kubernetes API; :mod:`.reconciler` wires kopf's watches to both.
"""
