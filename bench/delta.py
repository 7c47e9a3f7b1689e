"""Incremental checkpoints (issue 17), the micro parts: no cluster, one process, this machine's disk.

Every baseline is measured in the same run:

  Sweep    hashing a state into block signatures (one xxh3-128 per block,
           gangd.ckptlib.blocks.hash_blocks) against raw
           ``xxhash.xxh3_128_digest`` over the same bytes, for 4 KiB .. 1 MiB
           blocks. Raw and blocked runs alternate after a warm-up (a cold
           first raw run reads half speed); best of ``--repeats``, in CPU
           time of the hashing thread (a shared machine's other jobs do not
           count; memory bandwidth they take still does). The issue
           asks for >= 0.5x raw at the default block size. Also the index
           overhead (16 B of signature per block) and whether xxhash releases
           the GIL (two threads hashing halves against one thread).
  Modes    bytes written per generation, write time (median wall, and median
           CPU time of the writing thread: the work, without the disk's waits), restore bytes and restore
           time for full / incremental / differential / adaptive, like paper
           003's tables, on a dense heat stencil (a Jacobi sweep changes
           every block) and on a sparse app (``--dirty`` of the blocks change
           between checkpoints), every ratio against a full checkpoint of
           the same state in the same run. Writes are durable (fsync), as
           a checkpoint's are; every restore is checked bit-identical.

    python bench/delta.py [--quick] [--mib 256] [--state-mib 64] [--gens 10] [--dirty 0.05] [--dir DIR] [--json]

``--quick``: small sizes (seconds). ``--dir``: where the generations are
written (default: a temporary directory under the current one, i.e. this
disk, not a tmpfs). ``--json``: every number as one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

from gangd.checkpoint import delta
from gangd.ckptlib import blocks

SWEEP_KIB = (4, 8, 16, 32, 64, 256, 1024)


def say(*args) -> None:
    print(*args, file=sys.stderr if ARGS.json else sys.stdout, flush=True)


def best(fn, repeats: int, clock=time.perf_counter) -> float:
    t = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        t = min(t, clock() - start)
    return t


# ====================================================================== hashing


def sweep(mib: int, repeats: int) -> dict:
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8)
    view = data.data.cast("B")
    raw = lambda: xxhash.xxh3_128_digest(view)  # noqa: E731
    for _ in range(3):
        raw()  # warm up: page in, clocks up
    out = {}
    say(f"\nSweep - hashing {mib} MiB into block signatures vs raw xxh3-128 over the same bytes (best of {repeats}, alternating, CPU time)")
    say(f"  {'block':>8} {'raw GB/s':>9} {'blocks GB/s':>12} {'ratio':>6} {'index':>7}")
    for kib in SWEEP_KIB:
        block = kib << 10
        t_raw = t_blk = float("inf")
        for _ in range(repeats):  # alternate, so both see the same machine; CPU time of this thread (other jobs' slices excluded)
            t_raw = min(t_raw, best(raw, 1, time.thread_time))
            t_blk = min(t_blk, best(lambda b=block: blocks.hash_blocks(view, b), 1, time.thread_time))
        ratio = t_raw / t_blk
        out[kib] = {"raw_gbs": len(view) / t_raw / 1e9, "blocks_gbs": len(view) / t_blk / 1e9, "ratio": ratio, "index": blocks.SIG / block}
        mark = " <- default" if block == blocks.DEFAULT_BLOCK else ""
        say(f"  {kib:>5} KiB {out[kib]['raw_gbs']:9.1f} {out[kib]['blocks_gbs']:12.1f} {ratio:6.2f} {100 * blocks.SIG / block:6.2f}%{mark}")
    # Does xxhash release the GIL? Two threads hashing a half each in 1 MiB calls vs one thread doing both halves.
    half = len(view) // 2
    parts = [view[:half], view[half:]]
    one = best(lambda: [blocks.hash_blocks(p, 1 << 20) for p in parts], repeats)

    def two() -> None:
        threads = [threading.Thread(target=blocks.hash_blocks, args=(p, 1 << 20)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    both = best(two, repeats)
    out["threads"] = {"one_s": one, "two_s": both, "speedup": one / both}
    say(f"  two threads vs one, 1 MiB blocks: {one / both:.2f}x (xxhash releases the GIL while it hashes; below ~1.8x the other CPU is busy)")
    return out


# ====================================================================== modes


class Heat:
    """A 2-D heat stencil: each step a Jacobi sweep, which changes every interior value (dense updates)."""

    name = "heat stencil (dense)"

    def __init__(self, nbytes: int, rng: np.random.Generator):
        n = max(16, int((nbytes / 8) ** 0.5))
        self.u = rng.random((n, n))
        self.u[0, :] = 1.0

    def values(self) -> dict:
        return {"u": self.u, "meta": {"step": int(self.u[1, 1] * 1e6)}}

    def step(self) -> None:
        u = self.u
        u[1:-1, 1:-1] = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])


class Sparse:
    """An app that changes ``dirty`` of its blocks (distinct, at random) between checkpoints, plus a small pickle."""

    name = "sparse app"

    def __init__(self, nbytes: int, rng: np.random.Generator, dirty: float):
        self.rng = rng
        self.u = rng.random(nbytes // 8)
        self.stride = blocks.DEFAULT_BLOCK // 8
        self.touch = max(1, int(dirty * self.u.size / self.stride))
        self.count = 0

    def values(self) -> dict:
        return {"u": self.u, "meta": {"step": self.count}}

    def step(self) -> None:
        self.count += 1
        for b in self.rng.choice(self.u.size // self.stride, self.touch, replace=False):
            self.u[int(b) * self.stride] += 1.0


class Writer:
    """One mode's generations of one app, in their own directory."""

    def __init__(self, directory: Path, mode: str, threshold: float = delta.DEFAULT_THRESHOLD):
        self.directory, self.mode, self.threshold = directory, mode, threshold
        directory.mkdir(parents=True)
        self.results: dict[int, dict] = {}
        self.seconds: dict[int, float] = {}
        self.cpu: dict[int, float] = {}

    def path(self, gen: int) -> Path:
        return self.directory / f"gen-{gen}.state"

    def write(self, gen: int, values: dict) -> None:
        offered = [] if gen == 0 else [(g, self.path(g)) for g in [gen - 1, *self.results[gen - 1]["links"]]]
        start, cpu = time.perf_counter(), time.thread_time()
        self.results[gen] = blocks.save_generation(self.path(gen), values, gen=gen, mode=self.mode, offered=offered,
                                                   threshold=self.threshold)
        self.seconds[gen] = time.perf_counter() - start
        self.cpu[gen] = time.thread_time() - cpu

    def restore(self, gen: int, expect: dict) -> dict:
        stats: dict = {}
        start = time.perf_counter()
        values, _, _ = blocks.read_chain(self.path(gen), [(g, self.path(g)) for g in self.results[gen]["links"]], stats=stats)
        seconds = time.perf_counter() - start
        same = values["u"].tobytes() == expect["u"].tobytes() and values["meta"] == expect["meta"]
        return {"restore_bytes": stats["read"], "restore_files": stats["files"], "restore_s": seconds, "bit_identical": same}


def run_app(factory, gens: int, steps: int, root: Path, thresholds: tuple[float, ...] = ()) -> tuple[dict, dict]:
    """Every mode's generations of one app run, written in turn from the same state at each checkpoint (so the modes
    see the same machine); then each mode's last generation restored."""
    app = factory()
    writers = {mode: Writer(root / mode, mode) for mode in delta.MODES}
    sweep = {t: Writer(root / f"adaptive-{t}", "adaptive", t) for t in thresholds}
    every = list(writers.values()) + list(sweep.values())
    for gen in range(gens):
        if gen:
            for _ in range(steps):
                app.step()
        values = app.values()
        for i in range(len(every)):  # rotate who writes first
            every[(gen + i) % len(every)].write(gen, values)
    rows = {}
    for mode, w in writers.items():
        later = range(1, gens)
        rows[mode] = {
            "state": w.results[0]["state"],
            "first_delta_bytes": w.results[1]["size"],
            "first_delta_s": w.seconds[1],
            "bytes_per_gen": sum(w.results[g]["size"] for g in later) / len(later),
            "write_s_per_gen": statistics.median(w.seconds[g] for g in later),
            "write_cpu_per_gen": statistics.median(w.cpu[g] for g in later),
            "roles": [w.results[g]["role"] for g in range(gens)],
            **w.restore(gens - 1, app.values()),
        }
    full = rows["full"]
    for r in rows.values():
        r["first_bytes_ratio"] = r["first_delta_bytes"] / full["first_delta_bytes"]
        r["first_time_ratio"] = r["first_delta_s"] / full["first_delta_s"]
        r["bytes_ratio"] = r["bytes_per_gen"] / full["bytes_per_gen"]
        r["time_ratio"] = r["write_s_per_gen"] / full["write_s_per_gen"]
        r["cpu_ratio"] = r["write_cpu_per_gen"] / full["write_cpu_per_gen"]
    swept = {t: {"bytes_ratio": sum(w.results[g]["size"] for g in range(1, gens)) / (gens - 1) / full["bytes_per_gen"],
                 "max_files": max(len(r["links"]) + 1 for r in w.results.values()),
                 "roles": [w.results[g]["role"] for g in range(gens)]} for t, w in sweep.items()}
    return rows, swept


ROLE_LETTER = {"full": "F", "incr": "i", "diff": "d", "rebase": "R"}


def modes(state_mib: int, gens: int, steps: int, dirty: float, root: Path) -> dict:
    out: dict = {}
    nbytes = state_mib << 20
    apps = {
        "heat": (lambda: Heat(nbytes, np.random.default_rng(1)), steps, ()),
        "sparse": (lambda: Sparse(nbytes, np.random.default_rng(2), dirty), 1, (0.02, 0.05, 0.10, 0.20)),
    }
    for app_name, (factory, app_steps, thresholds) in apps.items():
        say(f"\nModes - {factory().name}, {state_mib} MiB of state, {gens} generations"
            + (f", {100 * dirty:.0f} % of the blocks dirty per checkpoint" if app_name == "sparse" else f", {app_steps} sweeps apart"))
        say(f"  {'mode':<13} {'1st delta':>9} {'x full':>7} {'time x':>7} | {'bytes/gen':>9} {'x full':>7} {'time x':>7} {'cpu x':>6} | "
            f"{'restore':>8} {'files':>5} {'s':>6}  roles")
        directory = root / app_name
        rows, swept = run_app(factory, gens, app_steps, directory, thresholds)
        shutil.rmtree(directory)
        for mode, r in rows.items():
            roles = "".join(ROLE_LETTER[x] for x in r["roles"])
            say(f"  {mode:<13} {r['first_delta_bytes'] / 2**20:8.2f}M {r['first_bytes_ratio']:7.3f} {r['first_time_ratio']:7.3f} | "
                f"{r['bytes_per_gen'] / 2**20:8.2f}M {r['bytes_ratio']:7.3f} {r['time_ratio']:7.3f} {r['cpu_ratio']:6.3f} | "
                f"{r['restore_bytes'] / 2**20:7.1f}M {r['restore_files']:>5} {r['restore_s']:6.3f}  {roles}"
                + ("" if r["bit_identical"] else "  NOT BIT-IDENTICAL"))
        for t, r in swept.items():
            roles = "".join(ROLE_LETTER[x] for x in r["roles"])
            say(f"  adaptive, threshold {t:.2f}: bytes/gen {r['bytes_ratio']:.3f}x full, restore reads up to {r['max_files']} files  {roles}")
        out[app_name] = {"modes": rows, "threshold_sweep": swept}
    return out


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mib", type=int, default=256, help="bytes hashed in the sweep")
    parser.add_argument("--state-mib", type=int, default=64, help="the apps' state")
    parser.add_argument("--gens", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="app steps between checkpoints")
    parser.add_argument("--dirty", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=None, help="of each hashing measurement (default 7, quick 3)")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sweep-only", action="store_true", help="only the hashing sweep")
    ARGS = parser.parse_args()
    if ARGS.quick:
        ARGS.mib, ARGS.state_mib, ARGS.gens = 32, 8, 5
    ARGS.repeats = ARGS.repeats or (3 if ARGS.quick else 7)
    load = os.getloadavg()
    say(f"bench/delta.py: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, default block "
        f"{blocks.DEFAULT_BLOCK >> 10} KiB")
    result = {"load": load, "sweep": sweep(ARGS.mib, ARGS.repeats)}
    if ARGS.sweep_only:
        if ARGS.json:
            print(json.dumps(result, default=str))
        return
    root = Path(tempfile.mkdtemp(prefix="gangd-delta-bench-", dir=ARGS.dir or Path.cwd()))
    try:
        result["modes"] = modes(ARGS.state_mib, ARGS.gens, ARGS.steps, ARGS.dirty, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sweep_default = result["sweep"][blocks.DEFAULT_BLOCK >> 10]
    sparse, heat = result["modes"]["sparse"]["modes"], result["modes"]["heat"]["modes"]
    say("\nRatios (the issue's rules, micro version: one process, inline durable writes, against a full of the same state):")
    say(f"  hashing at {blocks.DEFAULT_BLOCK >> 10} KiB: {sweep_default['ratio']:.2f}x raw xxh3 (rule >= 0.5)")
    say(f"  sparse, a checkpoint {100 * ARGS.dirty:.0f} % dirty after a full, adaptive: bytes {sparse['adaptive']['first_bytes_ratio']:.3f}x "
        f"(rule <= 0.06), time {sparse['adaptive']['first_time_ratio']:.3f}x (rule <= 0.15); "
        f"over {ARGS.gens - 1} such checkpoints: bytes {sparse['adaptive']['bytes_ratio']:.3f}x, time {sparse['adaptive']['time_ratio']:.3f}x")
    say(f"  dense (everything changed), adaptive: bytes {heat['adaptive']['bytes_ratio']:.3f}x, time {heat['adaptive']['time_ratio']:.3f}x "
        f"(rule <= 1.05; median wall time per generation, noisy on a shared disk), CPU {heat['adaptive']['cpu_ratio']:.3f}x")
    if ARGS.json:
        print(json.dumps(result, default=str))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
