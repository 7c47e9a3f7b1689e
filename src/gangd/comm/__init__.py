"""gangd.comm — messaging between the ranks of a gangd job, MPI-like::

    from gangd import comm

    w = comm.world()                         # w.rank, w.size; outside gangd a 1-rank world
    w.send(obj_or_array, dest, tag=0)        # arrays travel as raw bytes: no pickle, no copy
    x = w.recv(source=comm.ANY, tag=comm.ANY)
    x, st = w.recv(status=True)              # st.source, st.tag, st.nbytes
    st = w.recv_into(buf, source, tag)       # array/bytes payload straight into your buffer
    w.barrier(); y = w.bcast(x, root=0); z = w.allreduce(a, op="sum")   # sum prod min max
    w.close()                                # also done at exit

Ranks talk over direct sockets (AF_UNIX on a node, TCP between nodes); the
node daemon owns the rendezvous, a send gate (for gang scheduling and
checkpoints) and the network context of stopped jobs.

Environment knobs: ``GANGD_COMM_SPIN_US`` (default 50) is how long a receive
polls before it sleeps — waking up costs more than handling a small message,
0 never spins; ``GANGD_COMM_GATE=0`` compiles the send gate out (benchmarks
only: such a job cannot have its network context captured).

Layout:

* :mod:`.world` — the public API above
* :mod:`.wire` — how a message looks on a socket
* :mod:`.engine` — sockets, the progress engine, counters, the gate
* :mod:`.control` — the connection to the node daemon and its thread
* :mod:`.collectives` — barrier, bcast, allreduce over point-to-point
* :mod:`.context` — capture and restore of a rank's network context
"""

from .engine import ANY
from .errors import CommError, PeerExited
from .world import MAX_TAG, Status, World, world

__all__ = ["ANY", "MAX_TAG", "CommError", "PeerExited", "Status", "World", "world"]
