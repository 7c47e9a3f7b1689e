"""A checkpointed test job with knobs: state size, per-iteration sleep, one slow rank, a hold.

Each step every rank updates its state from its own values and from the
message its left neighbour sent in the previous step (so messages are
in flight at every cut). Rank 0 prints RESULT <digest of every rank's state>.

``--hold-at K --release FILE``: after K steps the ranks idle in the
checkpointed loop (every iteration a checkpoint candidate, the message of
step K-1 in flight) until FILE exists, then go on; each prints
``rank R holding at step K`` as it starts to idle. A test's checkpoint,
suspension or kill then lands mid-run however loaded the machine is, and
the job runs no longer than the test needs, where a fixed number of slow
steps either ended before the test got there or made every run wait them
out. The hold changes no state: the RESULT is that of the run without it.
A restart from a generation taken in the hold holds again until FILE exists.
"""

import argparse
import hashlib
import os
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
parser.add_argument("--c-call-times", action="store_true", help="print each product's start (c-call-begin RANK T0) and, once it returned, "
                    "c-call RANK T0 T1 (time.time())")
parser.add_argument("--request-at", type=int, default=-1, help="rank 0 calls ckpt.request() at this iteration")
parser.add_argument("--slow-while", default=None, help="the slow rank is slow only while this file exists")
parser.add_argument("--hold-at", type=int, default=-1, help="after this many steps, idle (taking checkpoints) until --release exists")
parser.add_argument("--release", default=None, help="the file that ends the hold")
args = parser.parse_args()
if args.hold_at >= 0 and (args.release is None or not 0 < args.hold_at < args.steps):
    parser.error("--hold-at needs --release and a step between 0 and --steps")

ckpt.init()
world = comm.world()
rank, size = world.rank, world.size
n = max(1, int(args.mb * 2**20 / 8))
state = ckpt.protect("state", np.arange(n, dtype=np.float64) + rank)
info = ckpt.protect("info", {"sum": 0.0, "step": 0, "released": args.hold_at < 0})
right, left = (rank + 1) % size, (rank - 1) % size
time.sleep(args.pre_sleep)


def iterations():
    """The loop's items: one per step, and one per idle iteration of the hold
    (so a restart's skip of the iterations already done, which runs this,
    ends where the saved run stood)."""
    k = 0
    while info["step"] < args.steps:
        yield k
        k += 1


started_at = None
holding = False
for it in ckpt.loop(range(args.steps) if args.hold_at < 0 else iterations()):
    if started_at is None:
        started_at = it
    if info["step"] == args.hold_at and not info["released"]:
        # Each rank looks for the file itself and may leave a few iterations
        # after another (a cut is still consistent: no message is sent in the
        # hold). No collective here: its messages would be received before the
        # one of step K-1 still in flight, which a network context cannot restore.
        if not holding:
            print(f"rank {rank} holding at step {args.hold_at}", flush=True)
            holding = True
        if os.path.exists(args.release):
            info["released"] = True
        else:
            time.sleep(0.01)
        continue
    step = info["step"]
    info["step"] += 1
    if step > 0:
        got = world.recv(source=left, tag=step - 1)
        state[:64] += got
    state *= 0.999
    state[step % n] += step
    info["sum"] += float(state[:64].sum())
    world.send(state[:64].copy(), dest=right, tag=step)
    if args.sleep:
        time.sleep(args.sleep)
    if args.c_call:
        square = np.ones((args.c_call, args.c_call))
        began = time.time()
        if args.c_call_times:
            print(f"c-call-begin {rank} {began!r}", flush=True)
        square @ square
        if args.c_call_times:
            print(f"c-call {rank} {began!r} {time.time()!r}", flush=True)
    if rank == 0 and step == args.request_at:
        ckpt.request()
    if rank == args.slow_rank and step >= args.slow_from and (args.slow_while is None or os.path.exists(args.slow_while)):
        if step == args.slow_from:
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
