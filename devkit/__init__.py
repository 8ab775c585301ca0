"""The development kit: what the tests, the benchmark and the examples run against.

Nothing here ships; nothing here imports ``tests`` or ``bench``.

* :mod:`devkit.cluster`: the real control plane and real nodes, built from source
  (``python -m devkit.cluster up|down``);
* :mod:`devkit.waiting`: :func:`~devkit.waiting.wait_for`, bounded polling;
* :mod:`devkit.paths`: where the repository's manifests, chart and scripts are;
* :mod:`devkit.manifests`: the test workload's labels, its bare pods and Rendezvous;
* :mod:`devkit.namespaces`: a namespace whose ``default`` ServiceAccount may rendezvous;
* :mod:`devkit.operator`: the operator as its own process;
* :mod:`devkit.chart`: helm and the chart's release;
* :mod:`devkit.child`: helper processes over one JSON-line protocol;
* :mod:`devkit.processes`: local stand-ins of a pod's container and killing process trees;
* :mod:`devkit.nodepool`, :mod:`devkit.training`: the chart on real nodes, and an
  annotated Job of torchrun on them.
"""
