"""A job whose checkpoints are mostly unchanged blocks (issue 17): each step
changes a few blocks of each rank's state, so incremental, differential and
adaptive generations are small deltas.

The test steers it: a step runs only while the number in ``--target FILE``
is above the steps done (a missing file means none), so a test decides how
far the job goes between two of its checkpoints; the job ends after
``--steps``. Every change depends only on the step and the rank, so the
RESULT (rank 0 prints a digest of every rank's state) is that of an
uninterrupted run, however often it was checkpointed and restarted.
"""

import argparse
import hashlib
import time

import numpy as np

from gangd import ckptlib as ckpt
from gangd import comm

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--kib", type=int, default=512, help="KiB of the big array per rank")
parser.add_argument("--target", required=True)
parser.add_argument("--inline", action="store_true", help="write in the rank, not from a forked snapshot")
args = parser.parse_args()

ckpt.init(background=not args.inline)
world = comm.world()
rank = world.rank
n = args.kib * 1024 // 8
state = ckpt.protect("state", lambda: np.arange(n, dtype=np.float64) + rank)
small = ckpt.protect("small", lambda: np.zeros(10, dtype=np.int32))
info = ckpt.protect("info", {"step": 0, "log": []})


def target() -> int:
    try:
        with open(args.target) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def iterations():
    k = 0
    while info["step"] < args.steps:
        yield k
        k += 1


for _ in ckpt.loop(iterations()):
    if info["step"] >= target():
        time.sleep(0.01)
        continue
    step = info["step"]
    info["step"] += 1
    for j in range(3):  # three elements, each in some block
        at = (step * 7919 + j * 104729 + rank * 31) % n
        state[at] += step + 1
    small[step % 10] += 1
    info["log"].append(step)
ckpt.fini()
digest = np.frombuffer(hashlib.sha256(state.tobytes() + small.tobytes() + repr(info).encode()).digest(), dtype=np.uint8).astype(np.int64)
total = world.allreduce(digest * (rank + 1))
if rank == 0:
    print("RESULT", hashlib.sha256(total.tobytes()).hexdigest(), flush=True)
world.close()
