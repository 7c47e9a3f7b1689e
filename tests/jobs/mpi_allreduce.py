"""An mpi4py program: ROUNDS allreduces of a numpy array; rank 0 checks the sum."""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 100
x = np.arange(1000, dtype=np.float64) * (comm.rank + 1)
y = np.empty_like(x)
for _ in range(rounds):
    comm.Allreduce(x, y)
want = np.arange(1000) * (comm.size * (comm.size + 1) // 2)
nodes = len(set(comm.allgather(MPI.Get_processor_name() + ":" + __import__("os").environ.get("GANGD_NODE", "?"))))
if comm.rank == 0:
    print(f"allreduce {'OK' if np.array_equal(y, want) else 'WRONG'} over {comm.size} ranks on {nodes} nodes", flush=True)
