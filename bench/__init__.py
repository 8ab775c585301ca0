"""Benchmarks of k8s-rendezvous against torch's own rendezvous (python bench/run.py)."""
