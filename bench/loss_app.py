"""The job bench/node_loss.py loses a node under: each rank keeps ``--mib``
MiB of state (checkpointed with gangd.ckptlib) and every iteration rank 0
prints ``ITER <i> <wall clock>``, so the bench sees when it computes again."""

import argparse
import time

import numpy as np

from gangd import ckptlib as ckpt
from gangd import comm

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=float, default=64)
parser.add_argument("--steps", type=int, default=1_000_000)
parser.add_argument("--sleep", type=float, default=0.05)
args = parser.parse_args()

ckpt.init()
world = comm.world()
n = max(1, int(args.mib * 2**20 / 8))
state = ckpt.protect("state", lambda: np.full(n, float(world.rank)))  # (a restart reads it instead)
for it in ckpt.loop(range(args.steps)):
    state[it % n] += 1.0
    time.sleep(args.sleep)
    if world.rank == 0:
        print(f"ITER {it} {time.time():.6f}", flush=True)
