"""The real control plane and real nodes, built from source (``python -m devkit.cluster``)."""
