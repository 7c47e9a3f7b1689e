"""A job for the interval tests (issue 19): an iterative program whose
iterations take irregular times, one of them much longer than the rest.

Each rank prints ``SAVED rank R gen G iteration K`` in the first iteration
after each checkpoint it took (the generation its state is in), and a
RESULT line at the end that depends on every iteration's work."""

import argparse
import os
import random
import sys
import time

import numpy as np

from gangd import ckptlib as ckpt

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--sleep", type=float, default=0.02, help="mean seconds per iteration")
parser.add_argument("--jitter", type=float, default=0.5, help="each iteration's sleep varies by this share")
parser.add_argument("--long-at", type=int, default=-1, help="this iteration sleeps --long seconds")
parser.add_argument("--long", type=float, default=0.0)
parser.add_argument("--mib", type=float, default=0.0, help="protected state (MiB); a few blocks of it change per iteration")
args = parser.parse_args()

rank = int(os.environ.get("GANGD_RANK", "0"))
ckpt.init()
state = ckpt.protect("state", lambda: np.zeros(max(1, int(args.mib * 2**20) // 8), dtype=np.float64))
acc = ckpt.protect("acc", lambda: np.zeros(1, dtype=np.float64))
seen = ckpt.generation()
for i in ckpt.loop(range(args.steps)):
    if ckpt.generation() != seen:
        seen = ckpt.generation()
        print(f"SAVED rank {rank} gen {seen} iteration {i}", flush=True)
    rng = random.Random(i * 7919 + rank)
    pause = args.long if i == args.long_at else args.sleep * (1 + args.jitter * (2 * rng.random() - 1))
    time.sleep(max(0.0, pause))
    where = rng.randrange(len(state))
    state[where] += i
    acc[0] += state[where]
if ckpt.generation() != seen:  # (a checkpoint at the loop's last boundary, after its last iteration)
    print(f"SAVED rank {rank} gen {ckpt.generation()} iteration {args.steps}", flush=True)
print(f"RESULT rank {rank} {acc[0]:.1f}", flush=True)
sys.exit(0)
