"""``python -m bench.probes``: the micro-probes (:mod:`bench.probes.micro`)."""

from bench.probes.micro import main

main()
