"""The job of bench/ckpt.py: a 2-D heat stencil with halo exchanges, with or without gangd.ckptlib.

Each rank owns a band of rows of a ``--n``-column float64 plate, sized so
that its band is ``--mb`` MiB: that band is the rank's whole checkpointed
state (one protected array, plus a small protected dict for the residual).
Every iteration the ranks swap one halo row with each neighbour through
gangd.comm and relax their band (Jacobi); every 10 iterations they agree on
the largest change (allreduce).

``--band-rows R`` relaxes only R rows per iteration, a window that moves down
the band from one iteration to the next (a block relaxation: it still
converges to the same plate). It keeps an iteration cheap when the state is
large (256 MiB-1 GiB per rank for the checkpoint-bandwidth runs), where the
point is the checkpoint, not the arithmetic; the window's writes are also
what a background (forked) snapshot has to copy-on-write while it writes.

``--plain`` is the same computation without the library: no ckptlib import,
a plain ``range`` — the baseline of the library's overhead.

``--mpi`` is the same job written against mpi4py (run it with ``gang run
--mpi``): halo rows through ``Sendrecv``, the residual through ``allreduce``,
and a ``gangd.ckptlib.mpi.checkpoint(comm)`` call at the end of every
iteration instead of ``ckpt.loop`` (the step counter is protected state).
Same state, same arithmetic, same digest.

Output, one line each, flushed (bench/ckpt.py reads them through gangd):

    READY <unix time> <iteration>   after the first iteration this process ran
                                     (after a restart: the first one after the cut),
                                     i.e. when the ranks have computed and talked
    DONE <json>                     at the end: loop seconds from READY, iterations
                                     after READY, and a digest of the rank's band

    gang run -n 4 --per-node 1 -- python bench/ckpt_app.py --mb 4 --steps 300
"""

import time

began = time.time()  # before the imports: they are part of a job's start-up

import argparse
import hashlib
import json

import numpy as np

from gangd import comm

imported = time.time()  # (numpy and gangd.comm: the plain app's imports too)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mb", type=float, default=4.0, help="state (the plate's band) per rank, MiB")
parser.add_argument("--n", type=int, default=1024, help="columns of the plate")
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra 'compute' per iteration")
parser.add_argument("--band-rows", type=int, default=0, help="rows relaxed per iteration (0: the whole band)")
parser.add_argument("--plain", action="store_true", help="no gangd.ckptlib: the baseline")
parser.add_argument("--mpi", action="store_true", help="talk through mpi4py; checkpoint at ckptlib.mpi.checkpoint(comm)")
args = parser.parse_args()

if args.mpi:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
else:
    world = comm.world()
    rank, size = world.rank, world.size
if not args.plain:
    from gangd import ckptlib as ckpt

    ckpt.init()
inited, inited_cpu = time.time(), time.process_time()  # start-up: the world joined, ckptlib imported and registered
n = args.n
rows = max(3, int(args.mb * (1 << 20)) // (8 * n))
up = rank - 1 if rank > 0 else None  # no neighbour beyond the plate's edges
down = rank + 1 if rank < size - 1 else None

# Local rows 1..rows are ours, rows 0 and rows+1 are halos. Filled (not
# np.zeros, whose pages the kernel would not even allocate before the
# first write): the state is resident, as a real application's is.
def initial_band() -> np.ndarray:
    band = np.zeros((rows + 2, n))
    band[1:rows + 1] = 0.5
    if rank == 0:
        band[1, :] = 1.0  # the hot top edge: never updated
    return band


def initial_stats() -> dict:
    return {"residual": float("nan"), "at": -1, "step": 0}


if args.plain:
    u, stats = initial_band(), initial_stats()
else:  # factories: built on a fresh start only; on a restart the saved band comes back instead
    u = ckpt.protect("u", initial_band)
    stats = ckpt.protect("stats", initial_stats)

first = 2 if rank == 0 else 1  # the plate's top and bottom rows stay fixed
last = rows - 1 if rank == size - 1 else rows  # inclusive
interior = last - first + 1
band = min(args.band_rows or interior, interior)
windows = -(-interior // band)



def mpi_steps():
    """MPI's way: a while loop on a protected counter, the checkpoint call at the end of each step."""
    from gangd.ckptlib import mpi as ckpt_mpi

    while stats["step"] < args.steps:
        yield stats["step"]
        stats["step"] += 1
        if not args.plain:
            ckpt_mpi.checkpoint(world)


def exchange(it: int) -> None:
    if args.mpi:  # up's bottom halo is our first row, and so on; PROC_NULL: nothing on that side
        no = MPI.PROC_NULL
        world.Sendrecv(u[1], dest=no if up is None else up, sendtag=it, recvbuf=u[rows + 1], source=no if down is None else down, recvtag=it)
        world.Sendrecv(u[rows], dest=no if down is None else down, sendtag=it, recvbuf=u[0], source=no if up is None else up, recvtag=it)
        return
    # Both sends before both receives: no ordering can deadlock.
    if up is not None:
        world.send(u[1].copy(), dest=up, tag=it)
    if down is not None:
        world.send(u[rows].copy(), dest=down, tag=it)
    if up is not None:
        world.recv_into(u[0], source=up, tag=it)
    if down is not None:
        world.recv_into(u[rows + 1], source=down, tag=it)


def largest(change: float) -> float:
    return world.allreduce(change, op=MPI.MAX) if args.mpi else world.allreduce(change, op="max")


if args.mpi:
    iterations = mpi_steps()
else:
    iterations = ckpt.loop(range(args.steps)) if not args.plain else range(args.steps)
ready_at = ready_cpu = None
done_after_ready = 0
for it in iterations:
    exchange(it)

    a = first + (it % windows) * band
    b = min(a + band, last + 1)  # rows [a, b) this iteration
    # The right-hand side is evaluated whole before u is written: Jacobi within the window.
    new = 0.25 * (u[a - 1:b - 1, 1:-1] + u[a + 1:b + 1, 1:-1] + u[a:b, :-2] + u[a:b, 2:])
    if it % 10 == 9:
        change = float(np.abs(new - u[a:b, 1:-1]).max()) if new.size else 0.0
        stats["residual"] = largest(change)  # mutate the protected dict, don't rebind it
        stats["at"] = it
    u[a:b, 1:-1] = new
    if args.sleep:
        time.sleep(args.sleep)
    if ready_at is None:
        ready_at, ready_cpu = time.time(), time.process_time()
        print(f"READY {ready_at:.6f} {it}", flush=True)
    else:
        done_after_ready += 1
ended, loop_cpu = time.time(), time.process_time() - (ready_cpu or time.process_time())
if not args.plain:
    ckpt.fini()
finished = time.time()
digest = hashlib.sha256(u[1:rows + 1].tobytes()).hexdigest()[:16]
times = {"began": began, "imported": imported, "inited": inited, "ready": ready_at, "ended": ended, "finished": finished}
done = {"loop_s": ended - (ready_at or ended), "loop_cpu_s": loop_cpu, "init_cpu_s": inited_cpu, "cpu_s": time.process_time(), "iters": done_after_ready,
        "digest": digest, "rows": rows, "times": times}
print("DONE " + json.dumps(done), flush=True)
if not args.mpi:
    world.close()
