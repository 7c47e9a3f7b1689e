"""The consistent-checkpoint protocol as pure state machines (DESIGN.md §2).

No I/O, no trio, no threads here — h11's rule: every state and every
transition of one checkpoint lives in one place, so that the races a cluster
test reaches only now and then (an abort between cut and capture, a begin
after its abort, a report for a stale generation, a node lost mid-round, a
coordinator change) are deterministic unit tests and hypothesis stateful
tests (``tests/test_checkpoint_machines.py``).

- :mod:`.messages` — the messages, as frozen dataclasses that validate what
  a rank or a peer sent (``from_wire``) and encode (``to_wire``);
- :mod:`.round` — the coordinator's round of one generation;
- :mod:`.node` — one node's part of a generation;
- :mod:`.rank` — a rank's agreement on the cut.

The shells that feed these machines events and execute their instructions
are :mod:`gangd.daemon.ckptcoord` (trio), :mod:`gangd.daemon.checkpoint`
(trio) and :mod:`gangd.ckptlib.agent` (a thread).
"""
