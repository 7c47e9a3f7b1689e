"""Redundancy of checkpoint generations across nodes (issue 16): a generation
committed on every node's local disk is *complete*; once its files are also
on other nodes — a partner's copy, or XOR parity over a set of nodes — it is
*protected*: it survives the loss of any one node of each set.

* :mod:`.plan` — pure: who holds what, and whether a set of lost nodes can
  be rebuilt (and from where).
* :mod:`.xor` — parity encode and rebuild over generation directories,
  streamed in bounded blocks and checksummed end to end.
* :mod:`.transfer` — pulling a file (or a slice of a node's data) from one
  daemon to another, never trusting the sender: the request on the peer
  channel, the bytes either in its stream items or (``bulk=``, the fast
  path) on a connection of their own:
* :mod:`.bulk` — that connection: an HMAC handshake keyed by the cluster
  secret and a one-use ticket, then 1 MiB chunks each hashed, moved by
  worker threads.
* :mod:`.direct` — redundancy files written around the page cache.

The checkpoint state machines call these after a generation's local commit;
nothing here decides *when* (that is theirs), only *how*.
"""
