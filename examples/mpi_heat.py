"""Heat diffusion in MPI (mpi4py), checkpointed at a collective call (paper 001's model).

The same 2-D Jacobi stencil as ``heat.py``, written against mpi4py: halo rows
swapped with ``Sendrecv``, the residual agreed with ``allreduce``. At the
end of every iteration all ranks call ``ckpt_mpi.checkpoint(comm)``, which
saves the job when a checkpoint is due (``gang checkpoint JOB``, Ctrl-\\,
``--ckpt-every``) and is a cheap allreduce otherwise.

    gang run --mpi -n 4 -- python examples/mpi_heat.py --steps 300 --n 512
    gang checkpoint JOB; gang kill JOB; gang restart JOB   # goes on after the saved call

Rank 0 prints ``RESULT <digest>`` of the whole plate: an uninterrupted run and
a checkpointed, killed and restarted one print the same.

``--wrong`` breaks the rule on purpose: every rank sends its step number to
the next rank just before the call and receives it just after, so a message
is in flight at every checkpoint and ``checkpoint(comm)`` refuses, naming it.
"""

import argparse
import hashlib
import time

import numpy as np
from mpi4py import MPI

from gangd import ckptlib as ckpt
from gangd.ckptlib import mpi as ckpt_mpi

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--n", type=int, default=256, help="grid points per side")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra 'compute' per iteration")
parser.add_argument("--every", type=int, default=0, help="also force a checkpoint every this many steps")
parser.add_argument("--wrong", action="store_true", help="keep a message in flight across each checkpoint call")
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
ckpt.init()
n = args.n
if n < max(size, 3):
    parser.error(f"--n {n}: need at least 3 rows and one row per rank ({size} ranks)")

counts = [n // size + (r < n % size) for r in range(size)]
lo = sum(counts[:rank])
rows = counts[rank]
hi = lo + rows
up = rank - 1 if rank > 0 else MPI.PROC_NULL  # PROC_NULL: Sendrecv does nothing on that side
down = rank + 1 if rank < size - 1 else MPI.PROC_NULL

def initial_rows() -> np.ndarray:
    rows_here = np.zeros((rows + 2, n))
    if lo == 0:
        rows_here[1, :] = 1.0  # the hot top edge, never updated
    return rows_here


u = ckpt.protect("u", initial_rows)  # built on a fresh start only; on a restart this rank's saved rows instead
state = ckpt.protect("state", lambda: {"step": 0, "residual": float("nan")})
first = 2 if lo == 0 else 1
last = rows - 1 if hi == n else rows

while state["step"] < args.steps:
    it = state["step"]
    # Edge rows out, halos in: up's bottom halo is our first row, and so on.
    comm.Sendrecv(u[1], dest=up, sendtag=it, recvbuf=u[rows + 1], source=down, recvtag=it)
    comm.Sendrecv(u[rows], dest=down, sendtag=it, recvbuf=u[0], source=up, recvtag=it)
    mine = u[first:last + 1]
    new = 0.25 * (u[first - 1:last, 1:-1] + u[first + 1:last + 2, 1:-1] + mine[:, :-2] + mine[:, 2:])
    if it % 10 == 9:
        change = float(np.abs(new - mine[:, 1:-1]).max()) if new.size else 0.0
        state["residual"] = comm.allreduce(change, op=MPI.MAX)
    mine[:, 1:-1] = new
    if args.sleep:
        time.sleep(args.sleep)
    state["step"] = it + 1
    if args.wrong:  # the rule broken: sent before the call, received after it
        sending = comm.isend(it, dest=(rank + 1) % size, tag=7)
    ckpt_mpi.checkpoint(comm, force=bool(args.every) and state["step"] % args.every == 0)
    if args.wrong:
        comm.recv(source=(rank - 1) % size, tag=7)
        sending.wait()

# The digest of the whole plate, in row order, independent of the rank count.
chunks = comm.gather(u[1:rows + 1].tobytes(), root=0)
if rank == 0:
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()[:16]
    print(f"RESULT {digest} residual={state['residual']:.6g} steps={args.steps} ranks={size}", flush=True)
ckpt.fini()
