"""Incremental checkpoints (issue 17): what a checkpoint costs when little changed, on this machine and on a local cluster.

Every ratio is against a full checkpoint of the same state measured in the
same run; the load average is printed before and after (the machine's other
jobs share the cores and the disk). Parts (``--parts``, default all):

  micro    no cluster, one process, this machine's disk.
           Sweep: hashing a state into block signatures (one xxh3-128 per
           block, gangd.ckptlib.blocks.hash_blocks) against raw
           ``xxhash.xxh3_128_digest`` over the same bytes, for 4 KiB .. 1 MiB
           blocks; raw and blocked runs alternate after a warm-up, best of
           ``--repeats``, in CPU time of the hashing thread. Target: >= 0.5x
           raw at the default block size. Also the index overhead (16 B per
           block) and whether xxhash releases the GIL (two threads vs one).
           Modes: bytes written per generation, write time (median wall, and
           CPU of the writing thread), restore bytes and time for full /
           incremental / differential / adaptive on a dense heat stencil and a
           sparse app (``--dirty`` of the blocks change between checkpoints),
           inline durable writes, every restore checked bit-identical; and
           adaptive's threshold swept.
  sparse   a cluster of 4 local daemons (gangd.client.cluster.up; every job
           at ``--redundancy`` local by default, so only the checkpoint's own
           files are written, no partner copy behind the job). Two jobs of
           bench/delta_app.py side by side, ``--ranks`` (2) ranks x
           ``--cluster-mib`` (256) MiB each, one ``--ckpt-mode full``, one
           ``--ckpt-mode adaptive``; the bench steers them: between two
           checkpoints one step changes ``--dirty`` (5 %) of each rank's 16 KiB
           blocks (a new random set each step, the same in both jobs), the jobs
           otherwise idle. ``--sparse-gens`` checkpoints of each, the jobs
           taking turns first. Per generation: time (request -> generation
           complete, what ``gang checkpoint`` waits for), the job's blocked
           time (slowest node) and the bytes the rank files wrote (the
           generation's WRITTEN). Targets, for adaptive's checkpoints written
           against the previous generation (the first after the full, a
           rebase, or a differential right after its base: one step, so 5 %
           of the blocks changed against their reference; median): time
           <= 0.15x and bytes <= 0.06x full. Also the first after the full
           alone, and the median over every generation (adaptive's
           differentials grow, 5, 10, 15 %, until 003's rule rebases).
  dense    the same with ``--kind heat``: a 2-D heat stencil whose Jacobi sweep
           changes every block between two checkpoints. Target: adaptive
           <= 1.05x full time (median of the per-generation ratios; generation
           0, a full in both jobs, is printed as a control of the noise).
  modes    paper 003's tables on the cluster: four jobs side by side (full,
           incremental, differential, adaptive), ``--modes-mib`` (64) MiB per
           rank, ``--gens`` (10) generations one step apart, for the heat
           stencil and for the sparse app: the bytes written per generation
           (with each generation's mode: F full, i incremental, d
           differential, R rebase, m mixed), their mean against full's; then
           each job killed and restarted from its last generation: the bytes a
           restore reads (``gang ckpt ls``'s RESTORE), the links it reads, the
           restart time (request -> every restarted rank has its state in
           memory, by the ranks' own clock) and the ranks' own part of it
           (``ckpt.init()`` reading the chain + ``protect``), against full's,
           and whether the restored state is bit-identical.
  ring     the ../shared/peers ring (bench/ringjob.py, ``--ring-ranks`` 4 x
           ``--ring-mib`` 64 MiB, a little state scaled per iteration), once
           under adaptive and once under full: two checkpoints
           ``--ring-gap`` s apart; the second's time and bytes as a fraction
           of the first's (target: a small fraction under adaptive), with the
           iterations between the cuts and the share of the state they touched.

The ranks hash only the blocks the kernel saw written since the reference
generation's cut (gangd.ckptlib.dirty) where the kernel can; with
``GANGD_CKPT_WRITE_WATCH=off`` in this environment (the jobs inherit it) they
hash every block: run both to compare. The first line says which.

Each cluster part also prints where a checkpoint's time went (median ms):
agree (the ranks answer, the job runs on), cut (they reach the cut), save
(they fork their snapshot, or write inline), resume, disk (every node's
state hashed, compared, written, fsynced and committed: the forked writes),
other (the request and the record around the round); and the job's blocked
time, the slowest node's disk time and its commit (its last rank file on
disk -> its MANIFEST written).

    python bench/delta.py [--quick] [--parts micro,sparse,dense,modes,ring] [--json] [--inline] [--redundancy local]
                          [--cluster-mib 256] [--modes-mib 64] [--gens 10] [--dirty 0.05] [--ring-gap 0] [--dir DIR]

``--quick``: small sizes and few generations (a few minutes). ``--dir``:
where the generations and the cluster go (default: a temporary directory
under the current one, i.e. this disk, not a tmpfs). ``--json``: every
number as one JSON document on stdout (the tables on stderr).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil
import trio
import xxhash

from gangd.checkpoint import delta
from gangd.ckptlib import blocks
from gangd.client import cluster as local
from gangd.client.api import connect

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


# ====================================================================== cluster

HERE = Path(__file__).resolve().parent
APP = str(HERE / "delta_app.py")
RING = str(HERE / "ringjob.py")
MiB = 1 << 20
NODES = 4  # the ring's 4 ranks one per node; the apps' jobs take --ranks of them each
NOT_FOR_JOBS = ("GANGD_CKPT_BACKGROUND", "GANGD_RESTART", "GANGD_CKPT_DIR", "GANGD_CKPT_SPC", "GANGD_CKPT_MODE", "GANGD_CKPT_BLOCK_KIB")


class BenchError(Exception):
    pass


def job_env() -> dict:
    """This environment for the ranks, minus what would change ckptlib behind the bench's back (the mode comes
    from each job's --ckpt-mode only); ``--inline`` asks for writes in the rank instead of a forked snapshot."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_FOR_JOBS}
    if ARGS.inline:
        env["GANGD_CKPT_BACKGROUND"] = "0"
    return env


async def explain(gang, job: int) -> str:
    record = await gang.job(job)
    tail = bytearray()
    with trio.move_on_after(10):
        async with gang.output(job, follow=False) as chunks:
            async for chunk in chunks:
                tail += chunk["data"]
    said = bytes(tail[-800:]).decode(errors="replace")
    return f"job {job} is {record['state']} ({record.get('reason') or '-'}); its output ends: {said}"


async def lines(gang, job: int, tag: str, ranks, accept=None, timeout: float = 600) -> dict[int, list[str]]:
    """Follow the job's output until each of ``ranks`` printed a line ``tag ...`` (that ``accept`` takes);
    {rank: the line's words after the tag}."""
    want, found = set(ranks), {}
    pending: dict = defaultdict(bytearray)
    with trio.move_on_after(timeout) as scope:
        async with gang.output(job, follow=True, ranks=sorted(want)) as chunks:
            async for chunk in chunks:
                rank = chunk["rank"]
                if rank not in want or rank in found:
                    continue
                key = (rank, chunk.get("stream"))
                pending[key] += chunk["data"]
                *complete, rest = pending[key].split(b"\n")
                pending[key] = bytearray(rest)
                for line in complete:
                    words = line.decode(errors="replace").split()
                    if words and words[0] == tag and (accept is None or accept(words[1:])):
                        found[rank] = words[1:]
                        break
                if len(found) == len(want):
                    return found
    why = "timed out" if scope.cancelled_caught else "its output ended"
    raise BenchError(f"{why} before ranks {sorted(want - set(found))} of job {job} printed {tag}: {await explain(gang, job)}")


async def end(gang, job: int) -> None:
    try:
        await gang.kill(job)
    except Exception:  # noqa: BLE001,S110 -- already ended
        pass
    with trio.fail_after(120):
        await gang.wait_done(job, follow=False)


def phases(entry: dict, wall: float) -> dict:
    """Where one checkpoint's time went (s), from the coordinator's marks: ``agree`` the ranks answer (the job runs
    on), ``cut`` the ranks reach the cut and stop, ``save`` they save (fork their snapshot, or write it inline),
    ``resume`` they run again, ``disk`` the state on disk on every node and committed (the forked writes: hash,
    compare, write, fsync), ``other`` the request and the record around them (wall minus the round)."""
    m = entry.get("marks") or {}
    keys = ["start", "agreed", "cut", "saved", "resumed", "committed"]
    if not all(k in m for k in keys):
        return {}
    names = ["agree", "cut", "save", "resume", "disk"]
    out = {n: m[b] - m[a] for n, a, b in zip(names, keys, keys[1:], strict=False)}
    out["other"] = wall - (m["committed"] - m["start"])
    return out


async def checkpoint(gang, job: int) -> dict:
    """One checkpoint of ``job``: its time (request -> generation complete, as ``gang checkpoint`` waits), the
    job's blocked time, the bytes its rank files wrote and the state's bytes, its mode and links."""
    started = time.time()
    with trio.fail_after(900):
        entry = await gang.checkpoint(job)
    wall = time.time() - started
    if entry.get("state") != "complete":
        raise BenchError(f"checkpoint of job {job}: {entry.get('state')}: {entry.get('reason')}")
    nodes = list((entry.get("nodes") or {}).values())
    state = sum(n.get("state_bytes", 0) for n in nodes)
    return {
        "gen": entry["gen"], "iteration": entry.get("iteration"), "wall": wall,
        "blocked": max(n["blocked"] for n in nodes), "disk": max(n["disk"] for n in nodes),
        "commit": max(n.get("commit", 0.0) for n in nodes),  # (a node's last rank file on disk -> its MANIFEST)
        "written": entry.get("written") if type(entry.get("written")) is int else sum(n["bytes"] for n in nodes),
        "state": state, "restore_bytes": entry.get("restore_bytes"), "mode": entry.get("mode") or "full",
        "needs": entry.get("needs") or [], "phases": phases(entry, wall),
    }


def write_target(path: Path, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


async def restart(gang, job: int, ranks: int, expect: dict[int, str]) -> dict:
    """Kill ``job``, restart it from its newest generation and time it: request -> every restarted rank has its
    state in memory (its READY line's own timestamp), with the ranks' own part (``ckpt.init()``, which reads the
    chain, and ``protect``, which places it) and whether the state is bit-identical to the one checkpointed."""
    await end(gang, job)
    t0 = time.time()
    answer = await gang.restart(job)
    answered = time.time() - t0
    new = answer["record"]["id"]
    try:
        got = await lines(gang, new, "READY", range(ranks))
    finally:
        with trio.CancelScope(shield=True):
            await end(gang, new)
    ready = max(float(w[0]) for w in got.values())
    return {
        "gen": answer["gen"], "job": new, "restart_s": ready - t0, "answered_s": answered,
        "started_s": max(float(w[6]) for w in got.values()) - t0,  # the last rank's script started
        "init_s": max(float(w[4]) for w in got.values()), "protect_s": max(float(w[5]) for w in got.values()),
        "bit_identical": all(w[1] == "1" and w[3] == expect.get(r) for r, w in got.items()),
    }


async def app_run(directory: Path, kind: str, modes: list[str], gens: int, mib: float, ranks: int, *, restore: bool) -> dict:
    """One job of bench/delta_app.py per mode, running side by side (idle between steps), the same steps in each;
    ``gens`` checkpoints of each, one step apart, the jobs taking turns first; then (``restore``) each killed and
    restarted from its last generation, in turn."""
    targets = directory / "targets"
    targets.mkdir(exist_ok=True)
    label = f"{kind}-{uuid.uuid4().hex[:6]}"
    jobs: dict[str, int] = {}
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    restores: dict[str, dict] = {}
    async with connect(directory) as gang:
        try:
            for mode in modes:
                target = targets / f"{label}-{mode}"
                write_target(target, 0)
                argv = [sys.executable, APP, "--kind", kind, "--mib", str(mib), "--target", str(target), "--dirty", str(ARGS.dirty)]
                record = await gang.submit(argv, ranks, per_node=1, env=job_env(), cwd=str(HERE), name=f"delta-{kind}-{mode}",
                                           ckpt_mode=mode, ckpt_redundancy=ARGS.redundancy)
                jobs[mode] = record["id"]
            digests = {}
            for mode, job in jobs.items():
                digests[mode] = {r: w[3] for r, w in (await lines(gang, job, "READY", range(ranks))).items()}
            for gen in range(gens):
                if gen:
                    for mode in modes:
                        write_target(targets / f"{label}-{mode}", gen)
                    for mode, job in jobs.items():
                        got = await lines(gang, job, "STEP", range(ranks), accept=lambda w, g=gen: int(w[0]) == g)
                        digests[mode] = {r: w[1] for r, w in got.items()}
                for mode in modes[gen % len(modes):] + modes[:gen % len(modes)]:  # a different job first each time
                    rows[mode].append(await checkpoint(gang, jobs[mode]))
            if restore:
                for mode in modes[gens % len(modes):] + modes[:gens % len(modes)]:
                    restores[mode] = await restart(gang, jobs.pop(mode), ranks, digests[mode])
                    restores[mode]["wanted_gen"] = rows[mode][-1]["gen"]
        finally:
            with trio.CancelScope(shield=True):
                for job in jobs.values():
                    await end(gang, job)
    return {"kind": kind, "mib": mib, "ranks": ranks, "gens": gens, "rows": rows, "restores": restores}


async def ring_run(directory: Path, mode: str, mib: int, ranks: int, gap: float) -> dict:
    """The peers' ring (bench/ringjob.py) in ``mode``: two checkpoints, ``gap`` s apart."""
    argv = [sys.executable, RING, "--mib", str(mib), "--every", "200"]
    async with connect(directory) as gang:
        record = await gang.submit(argv, ranks, per_node=1, env=job_env(), cwd=str(HERE), name=f"ring-{mode}", ckpt_mode=mode, ckpt_redundancy=ARGS.redundancy)
        job = record["id"]
        try:
            await lines(gang, job, "it", [0])
            await trio.sleep(0.5)
            first = await checkpoint(gang, job)
            await trio.sleep(gap)
            second = await checkpoint(gang, job)
        finally:
            with trio.CancelScope(shield=True):
                await end(gang, job)
    iterations = (second["iteration"] or 0) - (first["iteration"] or 0)
    touched = min(1.0, iterations * 4096 * 8 / (mib * MiB))  # (each iteration scales the next 4096 float64 of the ring's state)
    return {"mode": mode, "first": first, "second": second, "iterations_between": iterations, "touched_share": touched,
            "time_ratio": second["wall"] / first["wall"], "blocked_ratio": second["blocked"] / first["blocked"] if first["blocked"] else None,
            "bytes_ratio": second["written"] / first["written"]}


# ---------------------------------------------------------------- cluster reports


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.0f}"


def mib_(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:8.2f}"


def median_phases(rows: list[dict]) -> dict:
    rows = [r for r in rows if r["phases"]]
    if not rows:
        return {}
    return {k: statistics.median(r["phases"][k] for r in rows) for k in rows[0]["phases"]}


def say_phases(label: str, rows: list[dict]) -> None:
    p = median_phases(rows)
    if p:
        say(f"    {label:<10} " + "  ".join(f"{k} {v * 1e3:.0f}" for k, v in p.items())
            + f"  | blocked {statistics.median(r['blocked'] for r in rows) * 1e3:.0f}, disk (slowest node) "
              f"{statistics.median(r['disk'] for r in rows) * 1e3:.0f}, node commit (slowest) "
              f"{statistics.median(r.get('commit', 0.0) for r in rows) * 1e3:.1f}")


def pairs(run: dict, mode: str) -> dict:
    """Per generation (1..), ``mode``'s checkpoint against the full of the same state in the same run."""
    full, other = run["rows"]["full"], run["rows"][mode]
    later = range(1, len(full))
    out = {
        "time": [other[g]["wall"] / full[g]["wall"] for g in later],
        "blocked": [other[g]["blocked"] / full[g]["blocked"] if full[g]["blocked"] else float("nan") for g in later],
        "bytes": [other[g]["written"] / full[g]["written"] for g in later],
        "control_time": other[0]["wall"] / full[0]["wall"],  # (generation 0: a full in both jobs, the same work)
    }
    for k in ("time", "blocked", "bytes"):
        out[f"{k}_median"] = statistics.median(out[k]) if out[k] else float("nan")
    # The checkpoints written against the previous generation (a rebase, or a differential whose base is the
    # previous generation): what changed against their reference is one step's changes, the "5 % dirty".
    one = [i for i, g in enumerate(later) if other[g]["needs"] and other[g]["needs"][0] == other[g - 1]["gen"]]
    out["one_step_gens"] = [later[i] for i in one]  # (as the table numbers them, from 0)
    for k in ("time", "bytes"):
        out[f"one_step_{k}"] = statistics.median(out[k][i] for i in one) if one else float("nan")
    out["time_of_medians"] = (statistics.median(other[g]["wall"] for g in later) / statistics.median(full[g]["wall"] for g in later)) if later else float("nan")
    return out


def say_pair_run(title: str, run: dict) -> dict:
    say(f"\n{title}")
    say(f"  {'gen':>3} | {'full: ms':>8} {'blocked':>7} {'MiB':>8} | {'adaptive: role':<15} {'ms':>7} {'blocked':>7} {'MiB':>8} | "
        f"{'time x':>6} {'blkd x':>6} {'bytes x':>7}")
    full, ad = run["rows"]["full"], run["rows"]["adaptive"]
    for g, (f, a) in enumerate(zip(full, ad, strict=False)):
        say(f"  {g:>3} | {ms(f['wall']):>8} {ms(f['blocked'])} {mib_(f['written'])} | {a['mode']:<15} {ms(a['wall'])} {ms(a['blocked'])} "
            f"{mib_(a['written'])} | {a['wall'] / f['wall']:6.3f} {a['blocked'] / f['blocked'] if f['blocked'] else float('nan'):6.3f} "
            f"{a['written'] / f['written']:7.3f}")
    say("  where the time went (median over generations 1.., ms):")
    say_phases("full", full[1:])
    say_phases("adaptive", ad[1:])
    out = pairs(run, "adaptive")
    out["disk_model"] = disk_model(run)
    return out


def disk_model(run: dict) -> dict:
    """Adaptive's disk phase (its slowest node, median over generations 1..) split into: the hash pass over one
    rank's state (measured here, now, on an array of that size: wall and CPU), its bytes per node written at the
    rate the full's disk phase showed, and the rest (fork, the parent's index, the index, fsync latency, commit)."""
    full, ad = run["rows"]["full"][1:], run["rows"]["adaptive"][1:]
    if not full:
        return {}
    nbytes = int(run["mib"] * MiB)
    data = np.random.default_rng(3).random(nbytes // 8)
    view = memoryview(data).cast("B")
    blocks.hash_blocks(view, blocks.DEFAULT_BLOCK)  # (warm)
    wall, cpu = time.perf_counter(), time.thread_time()
    blocks.hash_blocks(view, blocks.DEFAULT_BLOCK)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    del data, view
    per_node = run["ranks"]  # (one rank per node)
    f_disk = statistics.median(r["disk"] for r in full)
    f_bytes = statistics.median(r["written"] for r in full) / per_node
    a_disk = statistics.median(r["disk"] for r in ad)
    a_bytes = statistics.median(r["written"] for r in ad) / per_node
    write = a_bytes / (f_bytes / f_disk) if f_disk > 0 else float("nan")
    model = {"adaptive_disk": a_disk, "hash_wall": wall, "hash_cpu": cpu, "write_at_full_rate": write, "rest": a_disk - wall - write,
             "full_disk": f_disk, "full_rate_mib_s": f_bytes / f_disk / MiB if f_disk > 0 else float("nan")}
    if a_bytes > 0.9 * f_bytes:  # (dense: the same bytes; adaptive's only extra work is the hash pass)
        say(f"  adaptive's disk phase {a_disk * 1e3:.0f} ms against full's {f_disk * 1e3:.0f} ({(a_disk - f_disk) * 1e3:+.0f} ms): the same "
            f"{a_bytes / MiB:.1f} MiB per node, plus the hash pass over one rank's {run['mib']:g} MiB: {wall * 1e3:.0f} ms (measured now; "
            f"CPU {cpu * 1e3:.0f}), {wall / f_disk if f_disk > 0 else float('nan'):.3f}x full's disk phase")
        return model
    if WATCHED:  # (the ranks hash only the blocks the kernel saw written: gangd.ckptlib.dirty)
        model["rest"] = a_disk - write
        say(f"  adaptive's disk phase {a_disk * 1e3:.0f} ms (full's {f_disk * 1e3:.0f}: {model['full_rate_mib_s']:.0f} MiB/s per node) = "
            f"its {a_bytes / MiB:.1f} MiB per node at the full's rate {write * 1e3:.0f} ms + the rest {model['rest'] * 1e3:.0f} ms (hashing "
            f"the blocks written, fork, indexes, fsync latency, commit); the write watch is on: hashing all of one rank's "
            f"{run['mib']:g} MiB would be {wall * 1e3:.0f} ms (measured now; CPU {cpu * 1e3:.0f})")
        return model
    say(f"  adaptive's disk phase {a_disk * 1e3:.0f} ms (full's {f_disk * 1e3:.0f}: {model['full_rate_mib_s']:.0f} MiB/s per node) = hashing "
        f"one rank's {run['mib']:g} MiB {wall * 1e3:.0f} ms (measured now; CPU {cpu * 1e3:.0f}) + its {a_bytes / MiB:.1f} MiB per node "
        f"at the full's rate {write * 1e3:.0f} ms + the rest {model['rest'] * 1e3:.0f} ms (fork, indexes, fsync latency, commit)")
    return model


def _watched() -> bool:
    """Whether the ranks track writes (gangd.ckptlib.dirty: this kernel can, and GANGD_CKPT_WRITE_WATCH is not off)."""
    from gangd.ckptlib import dirty

    return dirty.watch() is not None


WATCHED = _watched()


ROLE_OF_MODE = {"full": "F", "incremental": "i", "differential": "d", "rebase": "R", "mixed": "m"}


def say_modes_run(title: str, run: dict) -> dict:
    """Paper 003's table: bytes written per generation for each mode, and a restore of the last one."""
    gens = run["gens"]
    say(f"\n{title}")
    say("  MiB written per generation (F full, i incremental, d differential, R rebase: adaptive's new base, m mixed: ranks differing):")
    say(f"  {'mode':<13}" + "".join(f"{g:>8}" for g in range(gens)) + f" | {'mean 1..':>8} {'x full':>7} {'time x':>7}")
    full = run["rows"]["full"]
    out: dict = {}
    later = range(1, gens)
    for mode, rows in run["rows"].items():
        mean = statistics.fmean(rows[g]["written"] for g in later) if gens > 1 else float("nan")
        full_mean = statistics.fmean(full[g]["written"] for g in later) if gens > 1 else float("nan")
        tx = statistics.median(rows[g]["wall"] / full[g]["wall"] for g in later) if gens > 1 else float("nan")
        cells = "".join(f"{r['written'] / MiB:7.1f}{ROLE_OF_MODE.get(r['mode'], '?')}" for r in rows)
        say(f"  {mode:<13}{cells} | {mean / MiB:8.2f} {mean / full_mean:7.3f} {tx:7.3f}")
        out[mode] = {"written": [r["written"] for r in rows], "roles": [r["mode"] for r in rows], "mean_written": mean,
                     "bytes_ratio": mean / full_mean, "time_ratio_median": tx}
    if run["restores"]:
        say("  restart from the last generation (request -> every rank's state in memory; the ranks' own read: ckpt.init + protect):")
        say(f"  {'mode':<13} {'gen':>4} {'restore MiB':>11} {'x full':>7} {'links':>5} | {'restart s':>9} {'x full':>7} "
            f"{'rank read s':>11} {'x full':>7}  bit-identical")
        fr = run["restores"]["full"]
        f_bytes = full[-1]["restore_bytes"] or full[-1]["written"]
        for mode, r in run["restores"].items():
            last = run["rows"][mode][-1]
            rb = last["restore_bytes"] or last["written"]
            read = r["init_s"] + r["protect_s"]
            f_read = fr["init_s"] + fr["protect_s"]
            ok = r["bit_identical"] and r["gen"] == r["wanted_gen"]
            say(f"  {mode:<13} {r['gen']:>4} {rb / MiB:11.2f} {rb / f_bytes:7.3f} {len(last['needs']):>5} | {r['restart_s']:9.2f} "
                f"{r['restart_s'] / fr['restart_s']:7.3f} {read:11.3f} {read / f_read if f_read else float('nan'):7.3f}  "
                + ("yes" if ok else f"NO (gen {r['gen']} of {r['wanted_gen']}, state {'same' if r['bit_identical'] else 'differs'})"))
            out[mode].update(restore_bytes=rb, restore_bytes_ratio=rb / f_bytes, links=len(last["needs"]), restart_s=r["restart_s"],
                             restart_ratio=r["restart_s"] / fr["restart_s"], rank_read_s=read, bit_identical=ok)
    say("  where the checkpoint time went (median over generations 1.., ms):")
    for mode, rows in run["rows"].items():
        say_phases(mode, rows[1:])
    return out


def say_ring(runs: dict) -> dict:
    say(f"\nRing - the peers' workload (bench/ringjob.py), {ARGS.ring_ranks} ranks x {ARGS.ring_mib} MiB, two checkpoints "
        f"{ARGS.ring_gap:g} s apart:")
    say(f"  {'mode':<9} | {'1st ms':>7} {'blocked':>7} {'MiB':>8} | {'2nd ms':>7} {'blocked':>7} {'MiB':>8} {'mode':<13} | "
        f"{'time x':>6} {'bytes x':>7} | iterations between (state touched)")
    out = {}
    for mode, r in runs.items():
        f, s = r["first"], r["second"]
        say(f"  {mode:<9} | {ms(f['wall'])} {ms(f['blocked'])} {mib_(f['written'])} | {ms(s['wall'])} {ms(s['blocked'])} {mib_(s['written'])} "
            f"{s['mode']:<13} | {r['time_ratio']:6.3f} {r['bytes_ratio']:7.3f} | {r['iterations_between']} ({100 * r['touched_share']:.1f} %)")
        out[mode] = {k: r[k] for k in ("time_ratio", "bytes_ratio", "blocked_ratio", "iterations_between", "touched_share")}
    say("  where the time went (ms):")
    for mode, r in runs.items():
        say_phases(f"{mode} 1st", [r["first"]])
        say_phases(f"{mode} 2nd", [r["second"]])
    return out


def sparse_part(directory: Path) -> dict:
    run = trio.run(functools.partial(app_run, directory, "sparse", ["full", "adaptive"], ARGS.sparse_gens, ARGS.cluster_mib, ARGS.ranks, restore=False))
    return {"run": run, "pairs": say_pair_run(
        f"Sparse - {ARGS.ranks} ranks x {ARGS.cluster_mib:g} MiB, {100 * ARGS.dirty:g} % of the 16 KiB blocks changed between "
        f"checkpoints (a new random set each time), {ARGS.sparse_gens} checkpoints of each job, alternating:", run)}


def dense_part(directory: Path) -> dict:
    run = trio.run(functools.partial(app_run, directory, "heat", ["full", "adaptive"], ARGS.dense_gens, ARGS.cluster_mib, ARGS.ranks, restore=False))
    return {"run": run, "pairs": say_pair_run(
        f"Dense - heat stencil, {ARGS.ranks} ranks x {ARGS.cluster_mib:g} MiB, one Jacobi sweep (every block) between checkpoints, "
        f"{ARGS.dense_gens} checkpoints of each job, alternating:", run)}


def modes_part(directory: Path) -> dict:
    out = {}
    for kind, name in (("heat", "heat stencil (dense)"), ("sparse", f"sparse app ({100 * ARGS.dirty:g} % of the blocks per step)")):
        run = trio.run(functools.partial(app_run, directory, kind, list(delta.MODES), ARGS.gens, ARGS.modes_mib, ARGS.ranks, restore=True))
        out[kind] = {"run": run, "table": say_modes_run(
            f"Modes ({kind}) - {name}, {ARGS.ranks} ranks x {ARGS.modes_mib:g} MiB, {ARGS.gens} generations, one step apart, "
            f"the four jobs side by side taking turns:", run)}
    return out


def ring_part(directory: Path) -> dict:
    runs = {mode: trio.run(ring_run, directory, mode, ARGS.ring_mib, ARGS.ring_ranks, ARGS.ring_gap) for mode in ("adaptive", "full")}
    return {"runs": runs, "table": say_ring(runs)}


CLUSTER_PARTS = {"sparse": sparse_part, "dense": dense_part, "modes": modes_part, "ring": ring_part}


def cluster_parts(parts: set[str], root: Path) -> dict:
    result: dict = {}
    directory = root / "cluster"
    say(f"\nCluster: {NODES} local daemons (each node's checkpoints in {directory}, on this disk), jobs one rank per node, "
        f"{'inline' if ARGS.inline else 'background (forked)'} writes, redundancy {ARGS.redundancy}, every job's --ckpt-mode given")
    # A node is never lost on purpose here: generous heartbeat and lease timeouts keep a loaded machine's
    # stalls (seconds, with other benches running) from turning into node losses and recoveries.
    local.up(directory, NODES, log_level="warning", heartbeat_timeout=30.0, lease_ttl=30)
    try:
        for part in ("sparse", "dense", "modes", "ring"):
            if part not in parts:
                continue
            try:
                result[part] = CLUSTER_PARTS[part](directory)
            except Exception as exc:  # noqa: BLE001 -- the other parts still run; the summary says what failed
                leaf = exc
                while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                    leaf = leaf.exceptions[0]
                if not isinstance(leaf, BenchError | trio.TooSlowError):
                    traceback.print_exception(exc)
                say(f"\n{part}: FAILED: {type(leaf).__name__}: {leaf}")
                result.setdefault("failed", {})[part] = f"{type(leaf).__name__}: {leaf}"
    finally:
        local.down(directory)
        for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
            try:
                env = proc.info.get("environ") or {}
                cmdline = proc.info.get("cmdline") or []
            except psutil.Error:
                continue
            if env.get("GANGD_SOCKET", "").startswith(str(directory)) or any(str(directory) in part for part in cmdline):
                say(f"(killing stray process {proc.pid} of the cluster: {' '.join(cmdline[:4])})")
                proc.send_signal(signal.SIGKILL)
    return result


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def summary(result: dict) -> None:
    say("\nTargets (issue 17; every ratio against a full checkpoint of the same state in the same run):")
    for part, why in (result.get("failed") or {}).items():
        say(f"  {part}: FAILED ({why[:300]})")
    if "sweep" in result:
        s = result["sweep"][blocks.DEFAULT_BLOCK >> 10]
        say(f"  hashing at {blocks.DEFAULT_BLOCK >> 10} KiB: {s['ratio']:.2f}x raw xxh3 (>= 0.5: {verdict(s['ratio'] >= 0.5)})")
    if "modes" in result and isinstance(result["modes"], dict) and "sparse" in result["modes"] and "modes" in result["modes"]["sparse"]:
        sparse, heat = result["modes"]["sparse"]["modes"], result["modes"]["heat"]["modes"]
        say(f"  micro (one process, inline durable writes): sparse {100 * ARGS.dirty:g} % dirty after a full, adaptive: bytes "
            f"{sparse['adaptive']['first_bytes_ratio']:.3f}x, time {sparse['adaptive']['first_time_ratio']:.3f}x; dense adaptive: time "
            f"{heat['adaptive']['time_ratio']:.3f}x (CPU {heat['adaptive']['cpu_ratio']:.3f}x)")
    if "sparse" in result:
        p = result["sparse"]["pairs"]
        t1, b1 = p["one_step_time"], p["one_step_bytes"]
        say(f"  cluster sparse, {100 * ARGS.dirty:g} % dirty: adaptive's checkpoints written against the previous generation "
            f"(one step, {100 * ARGS.dirty:g} % of the blocks changed against their reference: generations {p['one_step_gens']}), median: "
            f"time {t1:.3f}x (<= 0.15: {verdict(t1 <= 0.15)}), bytes {b1:.3f}x (<= 0.06: {verdict(b1 <= 0.06)}); the first after the "
            f"full: time {p['time'][0]:.3f}x, bytes {p['bytes'][0]:.3f}x; every generation 1..{len(p['time'])} (adaptive's differentials "
            f"grow until it rebases), median: time {p['time_median']:.3f}x, bytes {p['bytes_median']:.3f}x, blocked {p['blocked_median']:.3f}x")
    if "dense" in result:
        p = result["dense"]["pairs"]
        say(f"  cluster dense (every block changed), adaptive: time {p['time_median']:.3f}x full (median of per-generation ratios; "
            f"<= 1.05: {verdict(p['time_median'] <= 1.05)}), {p['time_of_medians']:.3f}x of the medians, bytes {p['bytes_median']:.3f}x; "
            f"control (generation 0, a full in both jobs): {p['control_time']:.3f}x")
    if "cluster_modes" in result:
        for kind, m in result["cluster_modes"].items():
            t = m["table"]
            say(f"  modes, {kind}: bytes/gen x full " + ", ".join(f"{mode} {t[mode]['bytes_ratio']:.3f}" for mode in t)
                + "; restore bytes x full " + ", ".join(f"{mode} {t[mode].get('restore_bytes_ratio', float('nan')):.3f}" for mode in t)
                + "; restart time x full " + ", ".join(f"{mode} {t[mode].get('restart_ratio', float('nan')):.2f}" for mode in t)
                + ("" if all(t[mode].get("bit_identical", True) for mode in t) else "  (a restore was NOT bit-identical)"))
    if "ring" in result:
        r = result["ring"]["table"]
        say(f"  ring, adaptive: the second checkpoint costs {r['adaptive']['time_ratio']:.3f}x the first's time and "
            f"{r['adaptive']['bytes_ratio']:.3f}x its bytes ({100 * r['adaptive']['touched_share']:.1f} % of the state touched between; "
            f"under full: {r['full']['time_ratio']:.3f}x, {r['full']['bytes_ratio']:.3f}x)")


PARTS = ("micro", "sparse", "dense", "modes", "ring")


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few generations (a few minutes)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: all)")
    parser.add_argument("--mib", type=int, default=256, help="(micro) bytes hashed in the sweep")
    parser.add_argument("--state-mib", type=int, default=64, help="(micro) the apps' state")
    parser.add_argument("--gens", type=int, default=10, help="generations of the modes tables (micro and cluster)")
    parser.add_argument("--steps", type=int, default=5, help="(micro) heat sweeps between checkpoints")
    parser.add_argument("--dirty", type=float, default=0.05, help="share of the blocks a sparse step changes")
    parser.add_argument("--repeats", type=int, default=None, help="(micro) of each hashing measurement (default 7, quick 3)")
    parser.add_argument("--cluster-mib", type=float, default=None, help="state per rank of the sparse and dense parts (default 256, quick 16)")
    parser.add_argument("--modes-mib", type=float, default=None, help="state per rank of the cluster modes tables (default 64, quick 8)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of each app job (one per node)")
    parser.add_argument("--sparse-gens", type=int, default=None, help="checkpoints of each job in the sparse part (default 8, quick 3)")
    parser.add_argument("--dense-gens", type=int, default=None, help="checkpoints of each job in the dense part (default 8, quick 3)")
    parser.add_argument("--ring-mib", type=int, default=None, help="state per rank of the ring (default 64, quick 16)")
    parser.add_argument("--ring-ranks", type=int, default=4)
    parser.add_argument("--ring-gap", type=float, default=0.0, help="seconds between the ring's two checkpoints")
    parser.add_argument("--redundancy", default="local", choices=["local", "partner", "xor", "auto"],
                        help="the cluster jobs' --ckpt-redundancy (default local: the checkpoint's own files only, no copy written behind the job)")
    parser.add_argument("--inline", action="store_true", help="cluster jobs write inline (GANGD_CKPT_BACKGROUND=0), not from a forked snapshot")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory under the current one)")
    parser.add_argument("--json", action="store_true", help="every number as one JSON document on stdout (the tables on stderr)")
    parser.add_argument("--keep", action="store_true", help="keep the directory (the cluster's logs) after the run")
    parser.add_argument("--sweep-only", action="store_true", help="only the hashing sweep")
    ARGS = parser.parse_args()
    parts = {p.strip() for p in ARGS.parts.split(",") if p.strip()}
    if parts - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(parts - set(PARTS)))} (of {', '.join(PARTS)})")
    q = ARGS.quick
    if q:
        ARGS.mib, ARGS.state_mib, ARGS.gens = 32, 8, 5
    ARGS.repeats = ARGS.repeats or (3 if q else 7)
    ARGS.cluster_mib = ARGS.cluster_mib or (16 if q else 256)
    ARGS.modes_mib = ARGS.modes_mib or (8 if q else 64)
    ARGS.sparse_gens = ARGS.sparse_gens or (3 if q else 8)
    ARGS.dense_gens = ARGS.dense_gens or (3 if q else 8)
    ARGS.ring_mib = ARGS.ring_mib or (16 if q else 64)
    if ARGS.sweep_only:
        parts = {"micro"}
    started = time.time()
    load = os.getloadavg()
    say(f"bench/delta.py {' '.join(sys.argv[1:])}: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, "
        f"default block {blocks.DEFAULT_BLOCK >> 10} KiB, parts {','.join(p for p in PARTS if p in parts)}, "
        f"write watch {'on' if WATCHED else 'off'} (GANGD_CKPT_WRITE_WATCH; gangd.ckptlib.dirty)")
    result: dict = {"load_before": load, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ARGS).items()}}
    root = Path(tempfile.mkdtemp(prefix="gangd-delta-bench-", dir=ARGS.dir or Path.cwd()))
    try:
        if "micro" in parts:
            result["sweep"] = sweep(ARGS.mib, ARGS.repeats)
            if not ARGS.sweep_only:
                result["modes"] = modes(ARGS.state_mib, ARGS.gens, ARGS.steps, ARGS.dirty, root / "micro")
        if parts & {"sparse", "dense", "modes", "ring"}:
            cluster = cluster_parts(parts, root)
            if "modes" in cluster:
                result["cluster_modes"] = cluster.pop("modes")
            result.update(cluster)
    finally:
        if ARGS.keep:
            say(f"(kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    summary(result)
    result["load_after"] = os.getloadavg()
    result["seconds"] = time.time() - started
    say(f"\n(total {result['seconds']:.0f} s; load average after: {' '.join(f'{x:.2f}' for x in result['load_after'])})")
    if ARGS.json:
        print(json.dumps(result, default=str))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
