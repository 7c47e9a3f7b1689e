"""Every rank sends to every rank, each iteration, messages of pseudo-random sizes.

Iteration k sends each rank (itself included) a slice of the sender's state
whose length, 0 to ``--max-size`` float64 values, is derived from a hash of
(seed, k, source, destination); iteration k+1 receives them and folds them into
the receiver's state. So at every iteration boundary — and so at every
checkpoint cut — size x size messages of mixed sizes (empty ones included)
are in the network, between every pair of ranks and across nodes.

A good checkpoint test: a consistent checkpoint must save all those messages
(the daemons' network context) and deliver each exactly once after a restart;
a message lost, repeated or reordered changes every rank's state and so the
digest. Nothing here is random at run time: sizes and contents follow from
the seed, the iteration and the state, so the protected state is enough.

    gang run -n 8 -- python examples/alltoall.py --steps 200
    python examples/alltoall.py                # alone: a one-rank world sending to itself

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
parser.add_argument("--max-size", type=int, default=2048, help="most float64 values in one message")
parser.add_argument("--width", type=int, default=512, help="float64 values of state per rank")
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds of extra 'compute' per iteration")
args = parser.parse_args()


def message_size(it: int, src: int, dst: int) -> int:
    """0..max_size, the same on every run and rank: a hash, not an RNG, so there is no RNG state to save."""
    h = hashlib.blake2b(f"{args.seed},{it},{src},{dst}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (args.max_size + 1)


def receive_all(it: int) -> None:
    """Take iteration ``it``'s message from every rank and fold them into ``state``.
    Sources in rank order, so the floating-point sums are the same on every run."""
    acc = np.zeros(args.width)
    for src in range(size):
        msg = world.recv(source=src, tag=it)
        assert msg.size == message_size(it, src, rank), f"rank {rank}: wrong size from {src} in iteration {it}"
        # bincount adds the weights in index order: deterministic, unlike a parallel sum.
        acc += np.bincount(np.arange(msg.size) % args.width, weights=msg * (src + 1), minlength=args.width)
    state[:] = 0.5 * state + 0.5 * np.sin(acc) + 1e-3 * it  # in place: `state` is what the checkpoint saves


ckpt.init()
world = comm.world()
rank, size = world.rank, world.size

state = ckpt.protect("state", lambda: np.linspace(rank, rank + 1, args.width))  # built on a fresh start only
for it in ckpt.loop(range(args.steps)):
    if it > 0:
        receive_all(it - 1)  # sent in the previous iteration: in flight across the boundary
    for k in range(size):
        dst = (rank + k) % size  # start at a different peer on each rank
        # Content depends on the sender's state and the destination; np.resize repeats it as needed.
        world.send(np.resize(np.roll(state, dst + it), message_size(it, rank, dst)), dest=dst, tag=it)
    if args.sleep:
        time.sleep(args.sleep)
if args.steps > 0:
    receive_all(args.steps - 1)  # the last iteration's messages, still in flight
ckpt.fini()

digest = hashlib.sha256(state.tobytes()).digest()
digests = world.allreduce(np.frombuffer(digest, dtype=np.uint8).astype(np.int64) * (rank + 1))
if rank == 0:
    print("RESULT", hashlib.sha256(digests.tobytes()).hexdigest(), flush=True)
world.close()
