"""The checkpoint interval: how often a job should checkpoint, from what its checkpoints cost and how often its nodes fail.

Today ``--ckpt-every`` is a duration the user must guess; issue 19 (paper 002) asks the daemons to compute it.
This package is the arithmetic alone -- no trio, no I/O, no clock -- so that the daemon, ``gang ckpt plan``, the
simulation bench and the tests all compute the same numbers from the same inputs, and so that it can be checked
against published values without a cluster:

- :mod:`.model`: Vaidya's expected-time model (paper 002's, extended to checkpoint latency), its optimum, and
  Young's and Daly's formulas reported beside it;
- :mod:`.rates`: each node's failure rate from the cluster's history of node losses, with a prior from the config;
- :mod:`.planner`: one job's decision -- the interval, in seconds and iterations, and the iteration of the next
  checkpoint -- as pure functions of measured values (events in, decisions out, like
  :mod:`gangd.checkpoint.round`).

It depends on nothing else in gangd, and nothing here may import the daemon: the dependency runs one way.
"""
