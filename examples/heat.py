"""Heat diffusion on a square plate: a 2-D Jacobi stencil with halo exchanges.

The ``--n`` x ``--n`` grid of float64 is split by rows over the ranks; its top
edge is hot (1.0), the other edges cold (0.0), and every iteration each
interior point becomes the mean of its four neighbours. Each rank swaps one
halo row with the rank above and the one below, and every 10 iterations the
ranks agree on the largest change (an allreduce kept in a protected dict).

A good checkpoint test: the state is a large array updated in place, small
scalars live in a dict, and any bit lost or repeated at a restart spreads
through the whole plate and changes the final digest.

    gang run -n 8 -- python examples/heat.py --steps 200 --n 512
    python examples/heat.py                    # alone: one rank holds the whole plate

Rank 0 prints ``RESULT <digest>`` of the whole plate (any rank count gives the same): an
uninterrupted run and a checkpointed, killed and restarted one print the same.
"""

import argparse
import hashlib
import time

import numpy as np

from gangd import ckptlib as ckpt
from gangd import comm

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--n", type=int, default=256, help="grid points per side")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra 'compute' per iteration")
args = parser.parse_args()

ckpt.init()
world = comm.world()
rank, size = world.rank, world.size
n = args.n
if n < max(size, 3):
    parser.error(f"--n {n}: need at least 3 rows and one row per rank ({size} ranks)")

# Rows [lo, hi) of the plate are ours; the first n % size ranks take one extra.
counts = [n // size + (r < n % size) for r in range(size)]
lo = sum(counts[:rank])
rows = counts[rank]
hi = lo + rows
up = rank - 1 if rank > 0 else None  # no neighbour beyond the plate's edges
down = rank + 1 if rank < size - 1 else None

# Local rows 1..rows are ours, rows 0 and rows+1 are halos (copies of the neighbours' edge rows).
def initial_plate() -> np.ndarray:
    plate = np.zeros((rows + 2, n))
    if lo == 0:
        plate[1, :] = 1.0  # the hot top edge: never updated, so it stays fixed
    return plate


u = ckpt.protect("u", initial_plate)  # built on a fresh start only; on a restart the saved plate instead
stats = ckpt.protect("stats", lambda: {"residual": float("nan"), "at": -1})

# Local rows updated: all of ours but the plate's top and bottom edges (the columns 0 and n-1 stay fixed too).
first = 2 if lo == 0 else 1
last = rows - 1 if hi == n else rows  # inclusive

for it in ckpt.loop(range(args.steps)):
    # Send both edge rows first, then receive both halos: no rank waits on a
    # receive before its own sends are out, so no ordering can deadlock.
    if up is not None:
        world.send(u[1].copy(), dest=up, tag=it)
    if down is not None:
        world.send(u[rows].copy(), dest=down, tag=it)
    if up is not None:
        world.recv_into(u[0], source=up, tag=it)  # a row of a C-ordered array is contiguous
    if down is not None:
        world.recv_into(u[rows + 1], source=down, tag=it)

    # Jacobi: the right-hand side is evaluated whole into a temporary before u
    # is written, so every point sees only the previous iteration's values.
    mine = u[first:last + 1]  # a view of the rows we update
    new = 0.25 * (u[first - 1:last, 1:-1] + u[first + 1:last + 2, 1:-1] + mine[:, :-2] + mine[:, 2:])
    if it % 10 == 9:
        change = float(np.abs(new - mine[:, 1:-1]).max()) if new.size else 0.0
        stats["residual"] = world.allreduce(change, op="max")  # mutate the protected dict, don't rebind it
        stats["at"] = it
    mine[:, 1:-1] = new
    if args.sleep:
        time.sleep(args.sleep)
ckpt.fini()

# A digest of every row, summed over the ranks (each fills in its own rows): the
# same table whatever the decomposition, so every rank count prints the same.
table = np.zeros((n, 32), dtype=np.int64)
for i in range(rows):
    table[lo + i] = np.frombuffer(hashlib.sha256(u[i + 1].tobytes()).digest(), dtype=np.uint8)
table = world.allreduce(table)
if rank == 0:
    digest = hashlib.sha256(table.tobytes())
    digest.update(np.float64(stats["residual"]).tobytes())
    print("RESULT", digest.hexdigest(), flush=True)
world.close()
