"""The peers' ring workload (../shared/peers), one program for gangd and for DMTCP: bench/restart.py's job.

N ranks in a ring, each holding ``--mib`` MiB of float64 state (``smooth``:
a sine plus noise; ``random``: incompressible), one small message per
iteration, 1 ms of "compute" (a sleep) per iteration. Rank 0 prints a
progress line every ``--every`` iterations with the time it was printed::

    it 600 acc 295.068839 at 1795530385.060

so that a restart is timed to the line's own timestamp (no polling delay in
the figure, for gangd and DMTCP alike). Rank 0 also says when it completes
its first iteration after a pause of over 0.3 s (a new process's first, or
the first after DMTCP restored it)::

    resumed it 377 at 1795530385.060

which times a restart without the 0-``--every`` iterations a progress line
may come after it (bench/restart.py prints both).

``--under gangd`` (default): gangd.comm and gangd.ckptlib, run by gangd::

    gang submit -n 4 --per-node 1 -- python bench/ringjob.py --mib 64 [--idiom factory|build|restarted]

``--idiom`` is how the program gives its state to ``ckpt.protect``:
``factory`` (the documented idiom: ``protect("u", lambda: build())``, built
only on a fresh start), ``build`` (``protect("u", build())``: built on a
restart too, then replaced by the saved state) or ``restarted`` (the peers'
version: ``np.empty`` instead of building when ``ckpt.restarted()``).

``--under tcp``: no gangd at all — its own TCP ring on 127.0.0.1 ports
``--port``+rank, for a transparent checkpointer (DMTCP) to save and restore
as processes; the launcher forks the ranks (numpy is imported after the
fork: forking a process with numpy's threads deadlocks DMTCP)::

    dmtcp_launch python bench/ringjob.py --under tcp --ranks 4 --mib 64
"""

import argparse
import os
import socket
import struct
import subprocess
import sys
import time

STARTED = time.time()
PROFILE = None
if os.environ.get("RINGJOB_PROFILE"):  # a directory: each rank's profile, from here to its first progress line
    import cProfile

    PROFILE = cProfile.Profile()
    PROFILE.enable()

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--under", choices=["gangd", "tcp"], default="gangd")
parser.add_argument("--mib", type=int, default=64, help="state per rank, MiB")
parser.add_argument("--data", choices=["smooth", "random"], default="random")
parser.add_argument("--idiom", choices=["factory", "build", "restarted"], default="factory")
parser.add_argument("--every", type=int, default=200, help="iterations between rank 0's progress lines")
parser.add_argument("--iters", type=int, default=10**9)
parser.add_argument("--ranks", type=int, default=4, help="(tcp) ranks the launcher starts")
parser.add_argument("--port", type=int, default=47000, help="(tcp) first port of the ring")
parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
args = parser.parse_args()

if args.under == "tcp" and args.rank < 0:  # the launcher: one process per rank
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r)]) for r in range(args.ranks)]
    sys.exit(max(p.wait() for p in procs))

import numpy as np  # noqa: E402 -- after the launcher's fork (see the docstring)

n = args.mib * 2**20 // 8


def build(rank: int) -> np.ndarray:
    """The initial state: what a restart replaces (seconds of work for 64 MiB)."""
    rng = np.random.default_rng(rank)
    if args.data == "random":
        return rng.random(n)
    return np.sin(40 * np.linspace(0, 1, n)) + 0.01 * rng.standard_normal(n)


RESUME_GAP = 0.3  # s without an iteration: the program was stopped (a checkpoint, a restart) and goes on now
last_iteration: float | None = None


def iterated(it: int) -> None:
    """Rank 0: after each iteration; the first one after a gap (a fresh or restarted process: its first
    iteration; a process DMTCP restored: the first after its restore) says when, for restart's "resumed"."""
    global last_iteration
    now = time.time()
    if last_iteration is None or now - last_iteration > RESUME_GAP:
        print(f"resumed it {it} at {now:.3f}", flush=True)
    last_iteration = now


def progress(it: int, acc: float) -> None:
    global PROFILE
    print(f"it {it} acc {acc:.6f} at {time.time():.3f}", flush=True)
    if PROFILE is not None:
        PROFILE.disable()
        PROFILE.dump_stats(os.path.join(os.environ["RINGJOB_PROFILE"], f"ring-{os.getpid()}.prof"))
        print(f"profiled from {STARTED:.3f}", flush=True)
        PROFILE = None


if args.under == "tcp":
    u = build(args.rank)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", args.port + args.rank))
    srv.listen(1)
    nxt = socket.socket()
    while True:
        try:
            nxt.connect(("127.0.0.1", args.port + (args.rank + 1) % args.ranks))
            break
        except OSError:
            time.sleep(0.05)
    prv, _ = srv.accept()
    acc = 0.0
    for it in range(args.iters):
        lo = (it * 4096) % (n - 4096)
        u[lo : lo + 4096] *= 1.0000001  # touch a little state each step
        nxt.sendall(struct.pack("!qd", it, acc))
        got, val = struct.unpack("!qd", prv.recv(16, socket.MSG_WAITALL))
        assert got == it, (got, it)
        acc = val + u[lo]
        if args.rank == 0:
            iterated(it)
        if it % args.every == 0 and args.rank == 0:
            progress(it, acc)
        time.sleep(0.001)
    sys.exit(0)

from gangd import ckptlib as ckpt  # noqa: E402
from gangd import comm  # noqa: E402

marks = {"started": STARTED, "imported": time.time()}
ckpt.init()
marks["init"] = time.time()
w = comm.world()
marks["world"] = time.time()
if args.idiom == "factory":  # the documented idiom: built only on a fresh start
    u = ckpt.protect("u", lambda: build(w.rank))
elif args.idiom == "build":  # built every time, then replaced by the saved state on a restart
    u = ckpt.protect("u", build(w.rank))
else:  # the peers' version: skips building by hand
    u = ckpt.protect("u", np.empty(n) if ckpt.restarted() else build(w.rank))
acc = ckpt.protect("acc", lambda: {"v": 0.0})
marks["protected"] = time.time()
if w.rank == 0:  # where rank 0's start went (bench/restart.py's breakdown)
    print("timeline", " ".join(f"{k} {v:.3f}" for k, v in marks.items()), flush=True)
nxt, prv = (w.rank + 1) % w.size, (w.rank - 1) % w.size
for it in ckpt.loop(range(args.iters)):
    lo = (it * 4096) % (n - 4096)
    u[lo : lo + 4096] *= 1.0000001
    w.send(np.array([it, acc["v"]]), nxt)
    got = w.recv(source=prv)
    assert int(got[0]) == it, (got, it)
    acc["v"] = float(got[1]) + u[lo]
    if w.rank == 0:
        iterated(it)
    if it % args.every == 0 and w.rank == 0:
        progress(it, acc["v"])
    time.sleep(0.001)
ckpt.fini()
