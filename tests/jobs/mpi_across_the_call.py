"""An mpi4py program that breaks paper 001's rule at ckptlib.mpi.checkpoint(comm); it deadlocks.

``big-send``: rank 0 sends 8 MiB to rank 1 with ``Ssend`` (it returns once
the receive has begun) before the call; rank 1 receives it after the call.
``recv``: rank 1 receives before the call what rank 0 sends after it.
Either way one rank waits in the call forever; checkpoint(comm) must say why.
``catch``: rank 0 sends to rank 1 before a forced checkpoint; rank 1 catches
the refusal, receives the message, and both checkpoint again, correctly.
"""

import sys

import numpy as np
from mpi4py import MPI

from gangd import ckptlib as ckpt
from gangd.ckptlib import mpi as ckpt_mpi

comm = MPI.COMM_WORLD
mode = sys.argv[1]
ckpt.init()
data = np.zeros(1 << 20)  # 8 MiB
if mode == "big-send":
    if comm.rank == 0:
        comm.Ssend(data, dest=1, tag=42)
    ckpt_mpi.checkpoint(comm)
    if comm.rank == 1:
        comm.Recv(data, source=0, tag=42)
elif mode == "recv":
    if comm.rank == 1:
        comm.Recv(data[:1], source=0, tag=43)
    ckpt_mpi.checkpoint(comm)
    if comm.rank == 0:
        comm.Send(data[:1], dest=1, tag=43)
elif mode == "catch":
    if comm.rank == 0:
        comm.send("early", dest=1, tag=44)
    try:
        ckpt_mpi.checkpoint(comm, force=True)
    except ckpt.CheckpointError as exc:
        print(f"refused: {exc}", flush=True)
    if comm.rank == 1:
        print(f"then received {comm.recv(source=0, tag=44)!r}", flush=True)
    print(f"saved generation {ckpt_mpi.checkpoint(comm, force=True)}", flush=True)
print("finished", flush=True)
