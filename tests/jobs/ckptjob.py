"""A checkpointed test job with knobs: state size, per-iteration sleep, one slow rank.

Each iteration every rank updates its state from its own values and from the
message its left neighbour sent in the previous iteration (so messages are
in flight at every cut). Rank 0 prints RESULT <digest of every rank's state>.
"""

import argparse
import hashlib
import time

import numpy as np

from gangd import ckptlib as ckpt
from gangd import comm

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--mb", type=float, default=0.0625, help="MiB of state per rank")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-from", type=int, default=0, help="the slow rank is slow from this iteration on")
parser.add_argument("--slow-sleep", type=float, default=0.0)
parser.add_argument("--pre-sleep", type=float, default=0.0, help="seconds between ckpt.init() and the loop")
parser.add_argument("--c-call", type=int, default=0,
                    help="per iteration, one N x N matrix product: a long C call that releases the GIL (the SIGQUIT handler cannot run until it returns)")
parser.add_argument("--request-at", type=int, default=-1, help="rank 0 calls ckpt.request() at this iteration")
args = parser.parse_args()

ckpt.init()
world = comm.world()
rank, size = world.rank, world.size
n = max(1, int(args.mb * 2**20 / 8))
state = ckpt.protect("state", np.arange(n, dtype=np.float64) + rank)
info = ckpt.protect("info", {"sum": 0.0})
right, left = (rank + 1) % size, (rank - 1) % size
time.sleep(args.pre_sleep)
started_at = None
for it in ckpt.loop(range(args.steps)):
    if started_at is None:
        started_at = it
    if it > 0:
        got = world.recv(source=left, tag=it - 1)
        state[:64] += got
    state *= 0.999
    state[it % n] += it
    info["sum"] += float(state[:64].sum())
    world.send(state[:64].copy(), dest=right, tag=it)
    if args.sleep:
        time.sleep(args.sleep)
    if args.c_call:
        square = np.ones((args.c_call, args.c_call))
        square @ square
    if rank == 0 and it == args.request_at:
        ckpt.request()
    if rank == args.slow_rank and it >= args.slow_from:
        if it == args.slow_from:
            print(f"rank {rank} is slow from now on", flush=True)
        time.sleep(args.slow_sleep)
world.recv(source=left, tag=args.steps - 1)
ckpt.fini()
print(f"rank {rank} ran from iteration {started_at}", flush=True)
digest = np.frombuffer(hashlib.sha256(state.tobytes() + repr(info["sum"]).encode()).digest(), dtype=np.uint8).astype(np.int64)
total = world.allreduce(digest * (rank + 1))
if rank == 0:
    print("RESULT", hashlib.sha256(total.tobytes()).hexdigest(), flush=True)
world.close()
