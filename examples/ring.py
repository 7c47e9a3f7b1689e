"""A ring that always has messages in flight across iteration boundaries.

Each rank sends a block to its right neighbour in iteration k and receives
its left neighbour's block of iteration k in iteration k+1, so at every
boundary — and so at every checkpoint cut — one message per rank is in the
network. A consistent checkpoint must save those messages (the daemons'
network context) and deliver them again after a restart.

    gang run -n 8 -- python examples/ring.py --steps 200
    python examples/ring.py                    # alone: a one-rank ring (to itself)

Rank 0 prints ``RESULT <digest>`` of every rank's final state: an
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
parser.add_argument("--size", type=int, default=4096, help="float64 values per block")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra 'compute' per iteration")
args = parser.parse_args()

ckpt.init()
world = comm.world()
rank, size = world.rank, world.size
right, left = (rank + 1) % size, (rank - 1) % size

state = ckpt.protect("state", lambda: np.full(args.size, float(rank + 1)))  # built on a fresh start only
for it in ckpt.loop(range(args.steps)):
    if it > 0:
        incoming = world.recv(source=left, tag=it - 1)  # sent in the previous iteration
        state[:] = 0.5 * state + 0.5 * np.roll(incoming, 1) + 1e-3 * it
    world.send(state.copy(), dest=right, tag=it)
    if args.sleep:
        time.sleep(args.sleep)
world.recv(source=left, tag=args.steps - 1)  # the last one still in flight
ckpt.fini()

digest = hashlib.sha256(state.tobytes()).digest()
digests = world.allreduce(np.frombuffer(digest, dtype=np.uint8).astype(np.int64) * (rank + 1))
if rank == 0:
    print("RESULT", hashlib.sha256(digests.tobytes()).hexdigest(), flush=True)
world.close()
