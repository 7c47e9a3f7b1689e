"""The jobs `gang demo` runs; both talk through gangd.comm.

    python -m gangd.client.demojob pi [STEPS]     each rank integrates its share of
        4/(1+x^2) over [0,1] (which is pi); allreduce adds the shares up
    python -m gangd.client.demojob heat [STEPS]   a 2-D heat stencil with halo exchange,
        checkpointable (gangd.ckptlib); rank 0 prints RESULT <digest of the grid>
    python -m gangd.client.demojob ring [ROUNDS]  an array travels around the ring
        of ranks ROUNDS times, every rank adding its rank number; rank 0 checks
        the sum against the closed form
"""

import hashlib
import os
import sys
import time

import numpy as np

from gangd import ckptlib as ckpt
from gangd import comm


def pi(steps: int) -> None:
    w = comm.world()
    h = 1.0 / steps
    start = time.perf_counter()
    total = 0.0
    for i in range(w.rank, steps, w.size):
        x = (i + 0.5) * h
        total += 4.0 / (1.0 + x * x)
    mine = total * h
    everything = w.allreduce(mine, op="sum")
    print(f"rank {w.rank:2d} on {os.environ.get('GANGD_NODE')}: partial={mine!r} ({time.perf_counter() - start:.2f} s)", flush=True)
    if w.rank == 0:
        print(f"pi={everything!r}", flush=True)


def heat(steps: int, n: int = 768) -> None:
    """Explicit 5-point stencil on an n x n plate, hot top edge, rows split over the ranks."""
    ckpt.init()
    w = comm.world()
    lo, hi = w.rank * n // w.size, (w.rank + 1) * n // w.size
    u = ckpt.protect("u", lambda: np.zeros((hi - lo + 2, n)))  # own rows plus one halo row above and below (built on a fresh start only)
    new = np.empty_like(u)
    up, down = w.rank - 1, w.rank + 1
    for _ in ckpt.loop(range(steps)):
        if up >= 0:
            w.send(u[1].copy(), up, tag=0)
        if down < w.size:
            w.send(u[-2].copy(), down, tag=1)
        u[0] = w.recv(source=up, tag=1) if up >= 0 else 100.0  # the hot edge
        u[-1] = w.recv(source=down, tag=0) if down < w.size else 0.0
        new[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        u[1:-1, 1:-1] = new[1:-1, 1:-1]
    ckpt.fini()
    mine = np.frombuffer(hashlib.sha256(u[1:-1].tobytes()).digest(), dtype=np.uint8).astype(np.int64)
    total = w.allreduce(mine * (w.rank + 1))
    heat_in = w.allreduce(float(u[1:-1].sum()))
    if w.rank == 0:
        print(f"heat: {steps} steps on a {n}x{n} plate over {w.size} ranks, total heat {heat_in:.6f}", flush=True)
        print("RESULT", hashlib.sha256(total.tobytes()).hexdigest(), flush=True)


def ring(rounds: int) -> None:
    w = comm.world()
    right, left = (w.rank + 1) % w.size, (w.rank - 1) % w.size
    data = np.zeros(1 << 16, dtype=np.int64)  # 512 KiB travels around the ring
    for _ in range(rounds):
        if w.rank == 0:
            w.send(data + w.rank, right)
            data = w.recv(source=left)
        else:
            data = w.recv(source=left)
            w.send(data + w.rank, right)
        # A little computation per hop, so the job lives through some gang switches.
        np.sqrt(np.arange(2_000_000, dtype=np.float64)).sum()
    if w.rank == 0:
        want = rounds * w.size * (w.size - 1) // 2
        ok = bool(np.all(data == want))
        print(f"ring {'OK' if ok else 'WRONG'}: {rounds} rounds of 512 KiB around {w.size} ranks, every element {int(data[0])} (want {want})", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "pi"
    arg = int(sys.argv[2]) if len(sys.argv) > 2 else None
    if mode == "pi":
        pi(arg or 4_000_000)
    elif mode == "heat":
        heat(arg or 2000)
    elif mode == "ring":
        ring(arg or 60)
    else:
        raise SystemExit(f"unknown demo job {mode!r} (pi, heat or ring)")
