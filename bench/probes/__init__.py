"""Probes: programs that each measure one thing a figure is made of, apart from
bench/run.py's sections.

- ``python -m bench.probes`` (:mod:`bench.probes.micro`): a TCPStore's connects and a
  node's decoding of a sealed round (also run.py's ``probes`` section).
- :mod:`bench.probes.agent`: torchrun whose agent records its steps (the recovery section
  runs every node under it).
- ``python -m bench.probes.fanout``: one sealed round delivered to 1000 watching nodes.
- ``python -m bench.probes.reachability``: the operator's reachability probes' cost.
- ``python -m bench.probes.floods``: what one hostile pod can make the operator spend.
"""
