"""The job of bench/delta.py's cluster parts: state that changes only when the bench says so.

Each rank protects ``--mib`` MiB of float64 state and a small dict (its step
count). A *step* changes the state:

  ``--kind sparse``  ``--dirty`` of the rank's ``--block-kib`` blocks (distinct,
                     chosen at random per step and rank: one element each),
                     so a checkpoint after one step finds that share of the
                     blocks changed against the previous generation, and the
                     union of the steps' blocks changed against an older base;
  ``--kind heat``    a Jacobi sweep of a 2-D heat stencil over the whole plate
                     (random initial values), which changes every interior
                     value, so every block but the plate's first and last
                     (the fixed edge rows) is dirty: the dense case.

The bench steers it, as tests/jobs/deltajob.py's test does: a step runs only
while the number in ``--target FILE`` is above the steps done, so the bench
decides what changed between two checkpoints, whatever the iteration rate.
Between steps an iteration only reads that file and sleeps ``--sleep``, so a
checkpoint's cut comes at once and an idle job costs the other jobs nothing.

Output, one line each, flushed (bench/delta.py follows it through gangd)::

    READY <unix time> <restarted 0|1> <step> <digest> <init s> <protect s> <started>
    STEP <step> <digest> <unix time>

``READY`` comes once the state is in memory: on a restart, restored from the
generation's chain (``init s``: ``ckpt.init()``, which reads the chain;
``protect s``: ``ckpt.protect()``, which places it; ``started``: the unix
time the script started). ``digest`` is xxh3-64 of the state and the step
count, so the bench checks a restart is bit-identical against the STEP line
printed before the checkpoint.

    gang submit -n 2 --per-node 1 --ckpt-mode adaptive -- python bench/delta_app.py --kind sparse --mib 64 --target /tmp/t
"""

import time

started = time.time()

import argparse  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from gangd import ckptlib as ckpt  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kind", choices=["sparse", "heat"], required=True)
parser.add_argument("--mib", type=float, default=64.0, help="state per rank, MiB")
parser.add_argument("--dirty", type=float, default=0.05, help="(sparse) share of the blocks one step changes")
parser.add_argument("--block-kib", type=int, default=16, help="(sparse) the block the share is of (the cluster's [checkpoint] block_kib)")
parser.add_argument("--target", required=True, help="a file holding the number of steps to have done")
parser.add_argument("--sleep", type=float, default=0.002, help="seconds an idle iteration sleeps")
args = parser.parse_args()

rank = int(os.environ.get("GANGD_RANK", "0"))
nbytes = int(args.mib * (1 << 20))
t0 = time.perf_counter()
ckpt.init()
t1 = time.perf_counter()


def build() -> np.ndarray:
    """The initial state (replaced by the saved one on a restart)."""
    rng = np.random.default_rng(1000 + rank)
    if args.kind == "heat":
        side = max(16, int((nbytes / 8) ** 0.5))
        return rng.random((side, side))
    return rng.random(nbytes // 8)


u = ckpt.protect("u", build)
info = ckpt.protect("info", lambda: {"step": 0})
t2 = time.perf_counter()

stride = (args.block_kib << 10) // 8  # elements per block
nblocks = max(1, u.size // stride)
touch = max(1, round(args.dirty * nblocks))


def digest() -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(u).cast("B")) + f"-{info['step']}"


def target() -> int:
    try:
        with open(args.target) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def step(k: int) -> None:
    if args.kind == "heat":
        u[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        return
    chosen = np.random.default_rng((rank, k)).choice(nblocks, touch, replace=False)
    u[chosen * stride] += 1.0  # (distinct blocks: one element of each)


print(f"READY {time.time():.6f} {int(ckpt.restarted())} {info['step']} {digest()} {t1 - t0:.6f} {t2 - t1:.6f} {started:.6f}", flush=True)
for _ in ckpt.loop(itertools.count()):
    wanted = target()
    if info["step"] >= wanted:
        time.sleep(args.sleep)
        continue
    while info["step"] < wanted:
        step(info["step"])
        info["step"] += 1
    print(f"STEP {info['step']} {digest()} {time.time():.6f}", flush=True)
