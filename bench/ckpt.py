"""Consistent checkpoints: what they cost, what a restart costs, how fast they write.

Reproduces the evaluation of SCore-D's consistent-checkpoint paper on a
local 4-node cluster (4 daemons on 127.0.0.1-4, one core and one rank each;
every node's "local disk" is a directory of one temporary directory, so all
of them share this machine's disk). The job is bench/ckpt_app.py, a 2-D heat
stencil whose ranks swap halo rows through gangd.comm. Every baseline is
measured in the same run:

  Table 2  library overhead without checkpoints: the same job with
           gangd.ckptlib (init/protect/loop/fini, no checkpoint taken) vs
           without it (``--plain``: no import, a plain range). Runs
           alternate; medians of ``--repeats``; job time from the job
           record (started -> ended) and the ranks' own loop time.
  Table 3  restarted run vs normal run: checkpoint at ~10 % of the
           iterations, kill, ``restart``; the restarted job's time per
           remaining iteration against the time per iteration of a normal
           run taken just before it, the restart latency (call -> the new
           job launched, and -> its ranks done with their first iteration
           after the cut), and whether the result is bit-identical.
  Table 4  one checkpoint broken down per node (prep, write, finish,
           blocked, disk, sync overhead), ``--breakdown-mib`` per node.
  Fig. 4   checkpoint bandwidth per node p = sum(bytes) / t / n (t: request
           -> generation complete, everything on disk) for 1 MiB .. 1 GiB per
           node, against the raw bandwidth of the same disk: n processes
           writing as much at once, 8 MiB os.write calls + fsync (like
           ``dd conv=fsync``), p_raw = sum(s) / t_raw / n; and the same
           around the page cache (``dd oflag=direct conv=fsync``: 8 MiB
           writes from an aligned buffer, O_DIRECT), p_rawD, since ckptlib
           writes its files that way (gangd.directio). Each raw kind is
           measured before each job, the two alternating. Plus the sync
           overhead (the part of the blocked time spent synchronizing).
  Table 5  application blocked vs getting the state on disk, per size, with
           ckptlib's default background writes (a forked copy-on-write
           snapshot writes while the job runs on) and inline writes
           (GANGD_CKPT_BACKGROUND=0 in the job's environment).
  Table R  (issue 16, ``--tables R``) the redundancy levels end to end:
           jobs at local, partner and xor, alternating; per checkpoint the
           time to complete (every node's own files on disk) and to
           protected (then the redundancy written behind the job), as
           SCR's bandwidth ratio against local. bench/recovery.py isolates
           the write itself; this is what a job sees in the running system.

Every job here writes whole files (``--ckpt-mode full``): paper 000's
figures are the cost of writing the whole state, and a cluster's default
mode, adaptive (issue 17), would write only what changed from the second
checkpoint of a job on. ``--ckpt-mode`` measures another mode instead.

Every job writes raw bytes unless ``--ckpt-codec`` names a codec (issue 18):
Fig. 4 and Table 5 then measure checkpoints through the compress/write
pipeline (``--ckpt-pipeline`` sets its buffers and threads). p is then the
*effective* bandwidth: the state's bytes (what the pipeline took in) per
second, against the same raw write of that many bytes; the bytes on disk
and the ratio are printed beside it.

  Begin    (``--begin-cost``, alone) what a job's checkpoint pays at its
           begin for incremental checkpoints: the daemon plans each rank's
           offer from the lineage's candidate MANIFESTs (those it committed
           are kept in memory), in mode full it plans nothing. Jobs of ``--begin-mib`` MiB/node, full and
           adaptive alternating (ABBA), ``--checkpoints`` each (the first of
           each job left out: nothing to offer yet); agree (SIGQUIT -> ranks
           reported, the offers planned meanwhile), blocked and t, medians.

    python bench/ckpt.py [--quick] [--repeats 3] [--max-mib 1024] [--tables 2,3,4] [--ckpt-mode full] [--json]
    python bench/ckpt.py --tables 4 --ckpt-codec blosc2:lz4:1:bytedelta [--ckpt-pipeline workers=1] [--min-mib 256]
    python bench/ckpt.py --begin-cost [--begin-mib 1] [--checkpoints 8] [--repeats 2]

``--tables 2`` runs Table 2 alone (3 needs 2's calibration and runs it too).

Every job runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``
256 MiB, ``MALLOC_TRIM_THRESHOLD_`` 512 MiB; ``--malloc glibc`` leaves
glibc's default). By default glibc moves the threshold with what a process
freed before, so whether the stencil's 4 MiB temporaries are mmap'd and
faulted in afresh at every iteration or reused from the heap depends on the
process's history: a 23 % difference in loop time on this machine, which
fell on either side of Table 2 from one session to the next (ckptlib
0.89x and 1.03x plain) and hid the library's own cost.
``--quick`` is a small version (under a minute); ``--json`` prints every
number as one JSON document on stdout (the tables go to stderr then).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil
import trio

from gangd import directio
from gangd.client import cluster as local
from gangd.client.api import connect

HERE = Path(__file__).resolve().parent
APP = str(HERE / "ckpt_app.py")
NODES = 4  # one rank per node: the machine has 2 cores, 4 ranks is as far as it goes (--nodes)
SIZES = [1, 4, 16, 64, 256, 1024]  # MiB per node (= per rank), Fig. 4's x axis
MiB = 1 << 20
RAW_CHUNK = 8 * MiB  # the size of ckptlib's own writes (ckptstore.CHUNK)
CKPT_SLEEP = 0.02  # s per iteration of the checkpointed jobs: they run on, a cut comes quickly
CKPT_BAND = 1 * MiB  # state relaxed per iteration of those jobs (what a snapshot copies on write)
STENCIL_COLS = 1024  # ckpt_app's default --n: 8 KiB rows

CKPT_MODE = "full"  # every job's --ckpt-mode (see the docstring; --ckpt-mode)
CKPT_REDUNDANCY: str | None = None  # every job's --ckpt-redundancy (None: the cluster's default, xor on 3+ nodes)
CKPT_CODEC: str | None = None  # every job's --ckpt-codec (None: the cluster's, none)
CKPT_PIPELINE: str | None = None  # every job's --ckpt-pipeline (None: the defaults)
# glibc's allocator, the same in every job (--malloc): its mmap threshold otherwise moves with each process's
# allocation history, and the stencil's 4 MiB temporaries are either mmap'd and faulted in at every iteration or
# reused from the heap: 23 % of the loop time either way, whichever side the history favours (see the docstring).
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}
MALLOC = PINNED_MALLOC

out = sys.stdout  # where the tables go (stderr under --json)


def say(*parts) -> None:
    print(*parts, file=out, flush=True)


class BenchError(Exception):
    pass


# ---------------------------------------------------------------- jobs


def job_env(background: bool | None) -> dict:
    """This environment for the ranks, minus anything that would change ckptlib's behaviour
    behind the benchmark's back; ``background=False`` asks for inline writes."""
    dropped = ("GANGD_CKPT_BACKGROUND", "GANGD_RESTART", "GANGD_CKPT_DIR", "GANGD_CKPT_MODE", "GANGD_CKPT_BLOCK_KIB", "GANGD_CKPT_CODEC",
               "GANGD_CKPT_PIPELINE")
    env = {k: v for k, v in os.environ.items() if k not in dropped} | MALLOC
    if background is False:
        env["GANGD_CKPT_BACKGROUND"] = "0"
    return env


# MPICH between ranks on different gangd nodes of this one machine: TCP, as between hosts.
MPI_OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


async def submit(gang, app_args: list[str], *, name: str, background: bool | None = None, mpi: bool = False,
                 ckpt_mode: str | None = None, ckpt_redundancy: str | None = None) -> int:
    """``mpi``: the app's mpi4py version (``--mpi``), run with gangd as MPICH's
    process manager; ``ckpt_mode``: the job's --ckpt-mode (default :data:`CKPT_MODE`);
    ``ckpt_redundancy``: its --ckpt-redundancy (default :data:`CKPT_REDUNDANCY`)."""
    env = job_env(background) | (MPI_OVER_TCP if mpi else {})
    argv = [sys.executable, APP, *app_args, *(["--mpi"] if mpi else [])]
    record = await gang.submit(argv, NODES, per_node=1, env=env, cwd=str(HERE), name=name, mpi=mpi, ckpt_mode=ckpt_mode or CKPT_MODE,
                               ckpt_codec=CKPT_CODEC, ckpt_pipeline=CKPT_PIPELINE, ckpt_redundancy=ckpt_redundancy or CKPT_REDUNDANCY)
    return record["id"]


async def read_output(gang, job: int) -> dict[int, str]:
    """Every rank's output of an ended job."""
    texts: dict[int, bytearray] = defaultdict(bytearray)
    async with gang.output(job, follow=False) as chunks:
        async for chunk in chunks:
            if chunk["rank"] is not None:
                texts[chunk["rank"]] += chunk["data"]
    return {rank: text.decode(errors="replace") for rank, text in texts.items()}


def lines_of(texts: dict[int, str], tag: str) -> dict[int, str]:
    """The last ``tag`` line of each rank, without the tag."""
    found = {}
    for rank, text in texts.items():
        for line in text.splitlines():
            if line.startswith(tag + " "):
                found[rank] = line[len(tag) + 1:]
    return found


async def explain(gang, job: int) -> str:
    record = await gang.job(job)
    texts = await read_output(gang, job)
    tail = "\n".join(f"  rank {r}: {line}" for r, text in sorted(texts.items()) for line in text.splitlines()[-5:])
    return f"job {job} is {record['state']}: {record['reason'] or '-'}\n{tail}"


async def run_to_end(gang, app_args: list[str], *, name: str, timeout: float = 300, mpi: bool = False) -> tuple[dict, dict[int, dict]]:
    """Submit, wait for the end; returns (record, each rank's DONE numbers)."""
    job = await submit(gang, app_args, name=name, mpi=mpi)
    with trio.fail_after(timeout):
        record = await gang.wait_done(job)
    return record, await done_lines(gang, record)


async def done_lines(gang, record: dict) -> dict[int, dict]:
    if record["state"] != "DONE":
        raise BenchError(await explain(gang, record["id"]))
    done = {rank: json.loads(text) for rank, text in lines_of(await read_output(gang, record["id"]), "DONE").items()}
    if len(done) != record["nranks"]:
        raise BenchError(f"job {record['id']}: DONE from ranks {sorted(done)} only\n{await explain(gang, record['id'])}")
    return done


async def wait_ready(gang, job: int, timeout: float = 180) -> dict[int, tuple[float, int]]:
    """Follow the job's output until every rank printed READY (it is in its loop and
    has talked to its neighbours); returns {rank: (unix time, iteration)}."""
    ready: dict[int, tuple[float, int]] = {}
    pending: dict[int, bytearray] = defaultdict(bytearray)
    with trio.fail_after(timeout):
        async with gang.output(job, follow=True) as chunks:
            async for chunk in chunks:
                rank = chunk["rank"]
                if rank is None:
                    continue
                pending[rank] += chunk["data"]
                *complete, rest = pending[rank].split(b"\n")
                pending[rank] = bytearray(rest)
                for line in complete:
                    if line.startswith(b"READY "):
                        _, at, it = line.split()
                        ready[rank] = (float(at), int(it))
                if len(ready) == NODES:
                    return ready
    raise BenchError(f"the job ended before all its ranks were ready: {await explain(gang, job)}")


async def kill(gang, job: int) -> None:
    await gang.kill(job)
    with trio.fail_after(60):
        await gang.wait_done(job)


async def checkpoint(gang, job: int) -> dict:
    with trio.fail_after(900):
        entry = await gang.checkpoint(job)
    if entry["state"] != "complete":
        raise BenchError(f"checkpoint of job {job} {entry['state']}: {entry.get('reason')}")
    return entry


def slowest(done: dict[int, dict], key: str = "loop_s") -> float:
    return max(d[key] for d in done.values())


def per_iter(done: dict[int, dict]) -> float:
    """Seconds per iteration of the slowest rank (the job goes at its pace)."""
    return max(d["loop_s"] / d["iters"] for d in done.values() if d["iters"])


# ---------------------------------------------------------------- Tables 2 and 3


def fresh_bytecode() -> int:
    """Bring gangd's cached bytecode up to date; returns how many modules were compiled.

    With PYTHONDONTWRITEBYTECODE set (as in this project's shells) and a source
    tree whose __pycache__ is older than its sources, every rank compiles every
    changed module at every start. The ckptlib side of Table 2 then pays for
    compiling the library (~0.25 s of CPU per rank, profiled) and the plain side
    does not: that is not the library's cost, and an installed package has its
    bytecode. So both sides start from compiled bytecode."""
    import compileall
    import io
    from contextlib import redirect_stdout

    import gangd

    listing = io.StringIO()
    with redirect_stdout(listing):
        compileall.compile_dir(str(Path(gangd.__file__).parent), quiet=0)
    return sum(1 for line in listing.getvalue().splitlines() if line.startswith("Compiling"))


async def overhead(directory: Path, mib: float, seconds: float, repeats: int) -> dict:
    compiled = fresh_bytecode()
    if compiled:
        say(f"  (compiled {compiled} stale gangd modules first: every rank would compile them at each start)")
    async with connect(directory) as gang:
        # A short plain run: warms the caches (Python, numpy, the daemons) and
        # tells how many iterations make a run of about ``seconds``.
        base = ["--mb", str(mib)]
        _, done = await run_to_end(gang, [*base, "--steps", "60", "--plain"], name="calibrate")
        steps = max(60, round(seconds / per_iter(done)))
        runs: dict[str, list[dict]] = {"plain": [], "ckptlib": []}
        for i in range(repeats):
            # ABBA order: a drift of the machine's speed hits both alike.
            for mode in ("plain", "ckptlib") if i % 2 == 0 else ("ckptlib", "plain"):
                argv = [*base, "--steps", str(steps)] + (["--plain"] if mode == "plain" else [])
                record, done = await run_to_end(gang, argv, name=f"heat-{mode}")
                runs[mode].append({
                    "job": record["id"], "job_s": record["ended"] - record["started"], "loop_s": slowest(done),
                    # CPU seconds of the loop (every thread of the rank), and start-up: job started -> the
                    # last rank done with its first iteration; both far less noisy than wall time under load.
                    "loop_cpu_s": slowest(done, "loop_cpu_s"),
                    "startup_s": max(d["times"]["ready"] for d in done.values()) - record["started"],
                    "digests": [done[r]["digest"] for r in sorted(done)],
                })
    digests = {tuple(r["digests"]) for rs in runs.values() for r in rs}
    keys = ("job_s", "loop_s", "loop_cpu_s", "startup_s")
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in keys} for mode, rs in runs.items()}
    # The best run of each kind too: the one least disturbed by whatever else shares this machine.
    best = {mode: {k: min(r[k] for r in rs) for k in keys} for mode, rs in runs.items()}
    return {
        "mib_per_rank": mib, "steps": steps, "runs": runs, "median": med, "best": best,
        "ratio_job": med["ckptlib"]["job_s"] / med["plain"]["job_s"],
        "ratio_loop": med["ckptlib"]["loop_s"] / med["plain"]["loop_s"],
        "best_ratio_job": best["ckptlib"]["job_s"] / best["plain"]["job_s"],
        "best_ratio_loop": best["ckptlib"]["loop_s"] / best["plain"]["loop_s"],
        "ratio_loop_cpu": med["ckptlib"]["loop_cpu_s"] / med["plain"]["loop_cpu_s"],
        "startup_extra_s": med["ckptlib"]["startup_s"] - med["plain"]["startup_s"],
        "identical": len(digests) == 1, "digests": min(digests) if len(digests) == 1 else None,
    }


async def restarted(directory: Path, t2: dict, repeats: int) -> dict:
    steps = t2["steps"]
    argv = ["--mb", str(t2["mib_per_rank"]), "--steps", str(steps)]
    rows = []
    async with connect(directory) as gang:
        for _ in range(repeats):
            # Its own normal run right before each restarted one: on this shared
            # machine the speed drifts over a minute more than what is measured.
            normal, normal_done = await run_to_end(gang, argv, name="heat-normal")
            normal_loop = slowest(normal_done)
            job = await submit(gang, argv, name="heat-restart")
            ready = await wait_ready(gang, job)
            # READY comes after the first iteration: ~10 % of the run's loop from there.
            await trio.sleep(max(0.0, 0.1 * normal_loop - (time.time() - max(t for t, _ in ready.values()))))
            entry = await checkpoint(gang, job)
            await kill(gang, job)
            called = time.time()
            answer = await gang.restart(job)
            new = answer["record"]["id"]
            ready = await wait_ready(gang, new)
            with trio.fail_after(300):
                record = await gang.wait_done(new)
            done = await done_lines(gang, record)
            remaining = steps - answer["iteration"]
            row = {
                "job": job, "restarted_as": new, "gen": answer["gen"], "cut": answer["iteration"], "remaining": remaining,
                "job_s": record["ended"] - record["started"], "loop_s": slowest(done),
                "per_iter_job": (record["ended"] - record["started"]) / remaining,
                "per_iter_loop": per_iter(done),
                "normal_job": normal["id"],
                "normal_per_iter_job": (normal["ended"] - normal["started"]) / steps,
                "normal_per_iter_loop": per_iter(normal_done),
                "launch_latency": record["started"] - called,
                "process_latency": max(d["times"]["began"] for d in done.values()) - called,
                "running_latency": max(t for t, _ in ready.values()) - called,
                "identical": [done[r]["digest"] for r in sorted(done)] == [normal_done[r]["digest"] for r in sorted(normal_done)],
                "checkpoint_s": entry["ended"] - entry["started"],
            }
            row["ratio_job"] = row["per_iter_job"] / row["normal_per_iter_job"]
            row["ratio_loop"] = row["per_iter_loop"] / row["normal_per_iter_loop"]
            rows.append(row)
    keys = ("per_iter_job", "per_iter_loop", "normal_per_iter_job", "normal_per_iter_loop", "ratio_job", "ratio_loop",
            "launch_latency", "process_latency", "running_latency")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    return {"runs": rows, "median": med, "ratio_job": med["ratio_job"], "ratio_loop": med["ratio_loop"]}


# ---------------------------------------------------------------- Fig. 4, Tables 4 and 5


def _raw_writer(path: str, nbytes: int, barrier, results, direct: bool = False) -> None:
    buf = memoryview(np.full(RAW_CHUNK // 8, 0.5).view(np.uint8))  # real bytes, allocated before the clock starts
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if direct:
        aligned = directio.aligned_buffer(RAW_CHUNK)
        aligned[:] = buf
        buf = aligned
        directio.set_direct(fd, True)  # (nbytes is a whole number of MiB: every write aligned; refused: through the cache)
    barrier.wait()
    started = time.time()
    left = nbytes
    while left:
        left -= os.write(fd, buf[: min(left, RAW_CHUNK)])
    os.fsync(fd)
    os.close(fd)
    results.put((started, time.time()))


def raw_write(directory: Path, nbytes: int, writers: int, direct: bool = False) -> float:
    """Seconds for ``writers`` processes to each write and fsync ``nbytes`` at
    once into ``directory`` (``direct``: O_DIRECT): first start -> last fsync done."""
    directory.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    paths = [str(directory / f"raw-{i}") for i in range(writers)]
    procs = [ctx.Process(target=_raw_writer, args=(p, nbytes, barrier, results, direct)) for p in paths]
    for p in procs:
        p.start()
    spans = [results.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    for path in paths:
        os.unlink(path)
    if any(p.exitcode for p in procs):
        raise BenchError(f"a raw writer failed: exit codes {[p.exitcode for p in procs]}")
    return max(e for _, e in spans) - min(s for s, _ in spans)


def checkpointed_argv(mib: int) -> list[str]:
    """The app's arguments for a job that runs until killed, ``mib`` MiB per rank, while it is checkpointed:
    a short sleep per iteration (a cut comes quickly) and a band of rows relaxed per iteration (CKPT_BAND)."""
    return ["--mb", str(mib), "--steps", str(10**9), "--sleep", str(CKPT_SLEEP), "--band-rows", str(CKPT_BAND // (8 * STENCIL_COLS))]


async def checkpointed_job(directory: Path, mib: int, background: bool, count: int, mpi: bool = False) -> list[dict]:
    """``count`` checkpoints of a job with ``mib`` MiB per rank; the generation entries."""
    argv = checkpointed_argv(mib)
    async with connect(directory) as gang:
        name = f"ckpt-{'mpi-' if mpi else ''}{mib}M-{'bg' if background else 'inline'}"
        job = await submit(gang, argv, name=name, background=None if background else False, mpi=mpi)
        try:
            await wait_ready(gang, job)
            await trio.sleep(0.5)  # a few iterations in: past the first-iteration effects
            entries = []
            for _ in range(count):
                entries.append(await checkpoint(gang, job))
                if entries[-1].get("level", "local") != "local":
                    # The redundancy (the cluster's default: XOR parity on 3+ nodes) is written behind the job;
                    # the next checkpoint waits for it, so each one's bandwidth is its own write's, as in paper
                    # 000's Fig. 4 (Table R measures the redundancy).
                    await protection(gang, job, entries[-1]["gen"])
            return entries
        finally:
            with trio.CancelScope(shield=True):
                await kill(gang, job)


async def begin_cost(directory: Path, mib: int, count: int, repeats: int) -> dict:
    """The begin of a job's checkpoints in mode full and adaptive (see the
    docstring): per mode, every checkpoint but each job's first."""
    argv = checkpointed_argv(mib)
    taken: dict[str, list[dict]] = {"full": [], "adaptive": []}
    async with connect(directory) as gang:
        for i in range(repeats):
            for mode in ("full", "adaptive") if i % 2 == 0 else ("adaptive", "full"):
                job = await submit(gang, argv, name=f"begin-{mode}-{mib}M", ckpt_mode=mode)
                try:
                    await wait_ready(gang, job)
                    await trio.sleep(0.5)
                    entries = [await checkpoint(gang, job) for _ in range(count)]
                finally:
                    with trio.CancelScope(shield=True):
                        await kill(gang, job)
                taken[mode] += entries[1:]
    out: dict = {"mib": mib, "checkpoints": {m: len(e) for m, e in taken.items()}}
    for mode, entries in taken.items():
        rows = [{"agree": max(s["agree"] for s in e["nodes"].values()), "blocked": max(s["blocked"] for s in e["nodes"].values()),
                 "t": e["ended"] - e["started"], "bytes": sum(s["bytes"] for s in e["nodes"].values()), "mode": e.get("mode")} for e in entries]
        out[mode] = {k: statistics.median(r[k] for r in rows) for k in ("agree", "blocked", "t", "bytes")}
        out[mode]["modes"] = sorted({str(r["mode"]) for r in rows})
    out["ratio"] = {k: out["adaptive"][k] / out["full"][k] if out["full"][k] else float("nan") for k in ("agree", "blocked", "t")}
    return out


def print_begin(b: dict) -> None:
    say(f"\nBegin - a checkpoint's begin, {NODES} nodes x 1 rank, {b['mib']} MiB/node, medians of "
        f"{b['checkpoints']['full']} (full) / {b['checkpoints']['adaptive']} (adaptive) checkpoints, ms (max over nodes)")
    say(f"{'mode':>9} | {'agree':>9} {'blocked':>9} {'t':>9} | {'bytes':>10} | generations")
    for mode in ("full", "adaptive"):
        m = b[mode]
        say(f"{mode:>9} | {ms(m['agree'])} {ms(m['blocked'])} {ms(m['t'])} | {m['bytes']:10.0f} | {', '.join(m['modes'])}")
    r = b["ratio"]
    say(f"adaptive/full: agree {r['agree']:.3f}, blocked {r['blocked']:.3f}, t {r['t']:.3f}")
    say("  agree: SIGQUIT -> the ranks reported (the daemon plans the offers meanwhile, from the lineage's candidate")
    say("  MANIFESTs); blocked: cut -> resumed; t: request -> complete (adaptive writes only what changed)")


LEVELS = ("local", "partner", "xor")


async def protection(gang, job: int, gen: int) -> dict:
    """Generation ``gen``'s entry once its redundancy write ended: protected, or complete with the reason it is not."""
    with trio.fail_after(900):
        while True:
            listing = await gang.checkpoints(job)
            entry = next((e for e in listing["generations"] if e["gen"] == gen), None)
            if entry is not None and (entry["state"] == "protected" or "redundancy" in entry):
                return entry
            await trio.sleep(0.02)


async def redundancy_levels(directory: Path, mib: int, count: int, repeats: int, background: bool) -> dict:
    """Issue 16 end to end, in the running system (Table R): jobs of ``mib``
    MiB per node at each redundancy level, the levels alternating job by job
    (``repeats`` jobs each, ``count`` checkpoints per job, the first left out);
    per checkpoint the time from the request to *complete* (every node's own
    files on disk: the ``local`` level's whole cost) and to *protected*
    (complete, then the partner copies or the XOR parity written behind the
    job: the coordinator's ``protect_seconds``). The job is not blocked for
    the redundancy write, so the next checkpoint of a back-to-back series
    would overlap it: here each waits for the one before to be protected."""
    argv = checkpointed_argv(mib)
    taken: dict[str, list[dict]] = {level: [] for level in LEVELS}
    async with connect(directory) as gang:
        for i in range(repeats):
            for level in LEVELS if i % 2 == 0 else LEVELS[::-1]:
                job = await submit(gang, argv, name=f"redundancy-{level}-{mib}M", background=None if background else False, ckpt_redundancy=level)
                try:
                    await wait_ready(gang, job)
                    await trio.sleep(0.5)
                    for k in range(count + 1):
                        entry = await checkpoint(gang, job)
                        done = entry if level == "local" else await protection(gang, job, entry["gen"])
                        if level != "local" and done["state"] != "protected":
                            raise BenchError(f"{level} redundancy of job {job}'s generation {entry['gen']} failed: {done.get('redundancy')}")
                        if k:
                            t = entry["ended"] - entry["started"]
                            taken[level].append({"complete": t, "protected": t + float(done.get("protect_seconds") or 0.0),
                                                 "redundancy_bytes": int(done.get("redundancy_bytes") or 0),
                                                 "bytes": sum(s["bytes"] for s in entry["nodes"].values())})
                finally:
                    with trio.CancelScope(shield=True):
                        await kill(gang, job)
    out: dict = {"mib": mib, "background": background, "checkpoints": {level: len(r) for level, r in taken.items()}, "levels": {}}
    for level, rows in taken.items():
        out["levels"][level] = {key: statistics.median(r[key] for r in rows) for key in ("complete", "protected", "redundancy_bytes", "bytes")}
    local_t = out["levels"]["local"]["complete"]
    for m in out["levels"].values():
        m["x_local"] = local_t / m["protected"] if m["protected"] else float("nan")  # bandwidth ratio: the same bytes in that time
        m["in_run"] = m["complete"] / m["protected"] if m["protected"] else float("nan")
    return out


def print_levels(r: dict) -> None:
    say(f"\nTable R - redundancy levels end to end: {NODES} nodes x 1 rank, {r['mib']} MiB/node, "
        f"{'background' if r['background'] else 'inline'} writes, medians of {min(r['checkpoints'].values())} checkpoints per level (s)")
    say(f"{'level':>8} | {'complete':>9} {'protected':>9} | {'x local':>7} {'in run':>7} | {'redundancy MiB':>14} | target")
    targets = {"local": "", "partner": ">= 0.50", "xor": ">= 0.75"}
    for level, m in r["levels"].items():
        say(f"{level:>8} | {m['complete']:9.3f} {m['protected']:9.3f} | {m['x_local']:7.2f} {m['in_run']:7.2f} | "
            f"{m['redundancy_bytes'] / MiB:14.1f} | {targets[level]}")
    say("  complete: checkpoint request -> every node's own files fsynced and committed (local's whole cost); protected: complete")
    say("  + the redundancy write behind the job (partner copies / XOR parity, the coordinator's protect_seconds);")
    say("  x local: local's complete / this level's protected (the bandwidth ratio, SCR's figure, in the running system:")
    say("  the syncs and the snapshots' writes are part of every level's time); in run: this level's own complete / protected.")
    say("  bench/recovery.py isolates the write itself (files, then redundancy) and is the harder measure.")


def summarize(entry: dict) -> dict:
    nodes = entry["nodes"].values()
    t = entry["ended"] - entry["started"]
    state = sum(s["pipeline"]["in"] if "pipeline" in s else s["bytes"] for s in nodes)  # (compressed: the state the pipeline took in)
    return {
        "t": t,
        "bytes": sum(s["bytes"] for s in nodes),
        "state": state,
        "p": state / t / len(entry["nodes"]),
        "blocked": max(s["blocked"] for s in nodes),
        "disk": max(s["disk"] for s in nodes),
        "sync_overhead": max(s["sync_overhead"] for s in nodes),
    }


def sweep(directory: Path, sizes: list[int], count: int) -> list[dict]:
    rows = []
    for mib in sizes:
        nbytes = mib * MiB
        row: dict = {"mib": mib, "raw_s": [], "rawd_s": []}
        # The raw baselines right before each job: the disk as it is just then.
        for k, (mode, background) in enumerate((("background", True), ("inline", False))):
            for direct in (False, True) if k % 2 == 0 else (True, False):
                row["rawd_s" if direct else "raw_s"].append(raw_write(directory / "raw", nbytes, NODES, direct))
            entries = trio.run(checkpointed_job, directory, mib, background, count)
            row[mode] = {"entries": entries, "each": [summarize(e) for e in entries]}
            row[mode]["median"] = {k: statistics.median(s[k] for s in row[mode]["each"]) for k in row[mode]["each"][0]}
        row["raw_t"] = statistics.median(row["raw_s"])
        row["p_raw"] = NODES * nbytes / row["raw_t"] / NODES
        row["p_rawd"] = NODES * nbytes / statistics.median(row["rawd_s"]) / NODES
        rows.append(row)
        say(f"  {mib} MiB/node done: raw {row['p_raw'] / MiB:.0f} MiB/s (direct {row['p_rawd'] / MiB:.0f}),"
            f" checkpoint {row['background']['median']['p'] / MiB:.0f} MiB/s (background) "
            f"{row['inline']['median']['p'] / MiB:.0f} MiB/s (inline)")
    return rows


# ---------------------------------------------------------------- printing


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def print_overhead(t2: dict, repeats: int) -> None:
    say(f"\nTable 2 - ckptlib overhead, no checkpoint taken: {NODES} nodes x 1 rank, heat stencil, "
        f"{t2['mib_per_rank']:g} MiB/rank, {t2['steps']} iterations, {repeats} runs each (alternating)")
    say(f"{'run':>6} | {'job plain':>10} {'job ckptlib':>12} | {'loop plain':>11} {'loop ckptlib':>13} | "
        f"{'cpu plain':>10} {'cpu ckptlib':>12} | {'start plain':>11} {'start ckptlib':>13}   (seconds)")

    def row(label, p, c) -> None:
        say(f"{label:>6} | {p['job_s']:10.3f} {c['job_s']:12.3f} | {p['loop_s']:11.3f} {c['loop_s']:13.3f} | "
            f"{p['loop_cpu_s']:10.3f} {c['loop_cpu_s']:12.3f} | {p['startup_s']:11.3f} {c['startup_s']:13.3f}")

    for i, (p, c) in enumerate(zip(t2["runs"]["plain"], t2["runs"]["ckptlib"], strict=True), 1):
        row(str(i), p, c)
    for label in ("median", "best"):
        row(label, t2[label]["plain"], t2[label]["ckptlib"])
    say(f"ckptlib/plain: job time {t2['ratio_job']:.3f}, loop time {t2['ratio_loop']:.3f} (medians; target <= 1.02); "
        f"best runs: {t2['best_ratio_job']:.3f}, {t2['best_ratio_loop']:.3f}; same result in every run: {'yes' if t2['identical'] else 'NO'}")
    say(f"  loop CPU time (every thread of the slowest rank) {t2['ratio_loop_cpu']:.3f}x plain; start-up (job started -> every rank "
        f"past its first iteration) {t2['startup_extra_s'] * 1e3:+.0f} ms against plain (medians)")


def print_restart(t3: dict, steps: int) -> None:
    say(f"\nTable 3 - restarted run vs normal run: checkpoint at ~10 % of {steps} iterations, kill, restart; "
        "each against a normal run just before it")
    say(f"{'run':>4} {'cut':>5} {'left':>5} | {'ms/it job':>9} {'normal':>7} {'ratio':>6} | {'ms/it loop':>10} {'normal':>7} {'ratio':>6} | "
        f"{'launch ms':>9} {'python ms':>9} {'running ms':>10} | identical")
    for i, r in enumerate(t3["runs"], 1):
        say(f"{i:>4} {r['cut']:>5} {r['remaining']:>5} | {r['per_iter_job'] * 1e3:9.3f} {r['normal_per_iter_job'] * 1e3:7.3f} {r['ratio_job']:6.3f} | "
            f"{r['per_iter_loop'] * 1e3:10.3f} {r['normal_per_iter_loop'] * 1e3:7.3f} {r['ratio_loop']:6.3f} | "
            f"{r['launch_latency'] * 1e3:9.1f} {r['process_latency'] * 1e3:9.1f} {r['running_latency'] * 1e3:10.1f} | {'yes' if r['identical'] else 'NO'}")
    m = t3["median"]
    say(f"median: restarted/normal per iteration {t3['ratio_job']:.3f} (job time), {t3['ratio_loop']:.3f} (loop time) (target ~1.0); "
        f"restart latency {m['launch_latency'] * 1e3:.0f} ms to launched, {m['running_latency'] * 1e3:.0f} ms to running again")
    say("  job: the restarted job's started->ended / iterations left, vs the normal run's / all iterations (start-up and,")
    say("  for the restarted job, loading the state included); loop: the ranks' own time per iteration after their first;")
    say("  launch: restart call -> job started (ranks launched); python: -> the last rank's script began (interpreter up);")
    say("  running: -> every rank loaded its state and finished an iteration with its neighbours; identical: same")
    say("  final state (digest of every rank's band) as the normal run")


def print_breakdown(row: dict) -> None:
    for mode in ("background", "inline"):
        entry = row[mode]["entries"][-1]
        say(f"\nTable 4 - one checkpoint per node, {row['mib']} MiB/node, {mode} writes "
            f"(generation {entry['gen']}, cut at iteration {entry['iteration']}, total {(entry['ended'] - entry['started']) * 1e3:.1f} ms), ms")
        say(f"{'node':>5} {'MiB':>7} {'agree':>9} {'reach':>9} {'prep':>9} {'write':>9} {'finish':>9} {'blocked':>9} {'disk':>9} {'commit':>9} {'sync ovh':>9}")
        for node, s in sorted(entry["nodes"].items()):
            say(f"{node:>5} {s['bytes'] / MiB:7.1f} {ms(s['agree'])} {ms(s['reach'])} {ms(s['prep'])} {ms(s['write'])} {ms(s['finish'])} "
                f"{ms(s['blocked'])} {ms(s['disk'])} {ms(s['commit'])} {ms(s['sync_overhead'])}")
    say("  agree: SIGQUIT -> ranks reported; reach: -> ranks at the cut (both while the job runs on); prep: cut -> state")
    say("  writing allowed (gates closed, network context saved); write: -> ranks wrote or forked their snapshot;")
    say("  finish: -> job resumed; blocked = prep + write + finish; disk: -> the last rank's state fsynced (its report")
    say("  reached the daemon); commit: -> the daemon's own files fsynced and the manifest written;")
    say("  sync ovh: prep + finish minus the time spent waiting for other nodes")


def print_bandwidth(rows: list[dict], count: int) -> None:
    say(f"\nFig. 4 - checkpoint bandwidth per node p = sum(bytes)/t/n, {NODES} nodes x 1 rank, median of {count} checkpoints; "
        f"raw: {NODES} writers + fsync, median of 2; rawD: the same O_DIRECT")
    say(f"{'MiB/node':>8} | {'raw MiB/s':>9} {'rawD':>7} | {'bg t s':>7} {'p MiB/s':>8} {'p/raw':>6} {'p/rawD':>6} {'sync ms':>8} | "
        f"{'inline t s':>10} {'p MiB/s':>8} {'p/raw':>6} {'p/rawD':>6} {'sync ms':>8}")
    for r in rows:
        b, i = r["background"]["median"], r["inline"]["median"]
        say(f"{r['mib']:>8} | {r['p_raw'] / MiB:9.1f} {r['p_rawd'] / MiB:7.1f} | {b['t']:7.3f} {b['p'] / MiB:8.1f} {b['p'] / r['p_raw']:6.2f} "
            f"{b['p'] / r['p_rawd']:6.2f} {b['sync_overhead'] * 1e3:8.2f} | "
            f"{i['t']:10.3f} {i['p'] / MiB:8.1f} {i['p'] / r['p_raw']:6.2f} {i['p'] / r['p_rawd']:6.2f} {i['sync_overhead'] * 1e3:8.2f}")
    say("  t: checkpoint request -> generation complete (all nodes' files fsynced and committed); sync: max over nodes")
    if CKPT_CODEC:
        say(f"  codec {CKPT_CODEC}{f', pipeline {CKPT_PIPELINE}' if CKPT_PIPELINE else ''}: p is the state's bytes per second "
            "(effective bandwidth); on disk, state / written:")
        for r in rows:
            b, i = r["background"]["median"], r["inline"]["median"]
            say(f"{r['mib']:>8} | bg {b['state'] / b['bytes']:.2f}x  inline {i['state'] / i['bytes']:.2f}x")
    say(f"\nTable 5 - application blocked vs state on disk (max over nodes, ms, median of {count})")
    say(f"{'MiB/node':>8} | {'bg blocked':>10} {'bg disk':>9} {'blocked/disk':>12} | {'inl blocked':>11} {'inl disk':>9} | {'bg/inline blocked':>17}")
    for r in rows:
        b, i = r["background"]["median"], r["inline"]["median"]
        say(f"{r['mib']:>8} | {ms(b['blocked']):>10} {ms(b['disk'])} {b['blocked'] / b['disk'] if b['disk'] else float('nan'):12.3f} | "
            f"{ms(i['blocked']):>11} {ms(i['disk'])} | {b['blocked'] / i['blocked'] if i['blocked'] else float('nan'):17.3f}")
    say("  background: the rank forks a copy-on-write snapshot that writes and fsyncs while the job runs on;")
    say("  inline: the rank writes and fsyncs before it continues (GANGD_CKPT_BACKGROUND=0)")


def summary(result: dict) -> dict:
    t2, t3, rows = result["overhead"], result["restart"], result["sweep"]
    big = [r for r in rows if r["mib"] >= 256]
    checks = {
        "lib/plain job time <= 1.02 (medians)": (t2["ratio_job"], t2["ratio_job"] <= 1.02),
        "lib/plain job time <= 1.02 (best runs)": (t2["best_ratio_job"], t2["best_ratio_job"] <= 1.02),
        "restarted/normal per iteration ~1.0 (0.9..1.1)": (t3["ratio_job"], 0.9 <= t3["ratio_job"] <= 1.1),
        "restarted runs bit-identical": (all(r["identical"] for r in t3["runs"]), all(r["identical"] for r in t3["runs"])),
        "sync overhead <= 10 ms (max over sizes, background)": (
            max(r["background"]["median"]["sync_overhead"] for r in rows) * 1e3,
            max(r["background"]["median"]["sync_overhead"] for r in rows) <= 0.010,
        ),
    }
    if big:
        worst = min(r["background"]["median"]["p"] / r["p_raw"] for r in big)
        checks["p/p_raw >= 0.8 for >= 256 MiB (background, worst size)"] = (worst, worst >= 0.8)
        worst = min(r["background"]["median"]["p"] / r["p_rawd"] for r in big)
        checks["p/p_rawD >= 0.8 for >= 256 MiB (background, worst size)"] = (worst, worst >= 0.8)
    largest = rows[-1]
    say(f"\nSummary ({NODES} nodes x 1 rank on {os.cpu_count()} cores, disk: the filesystem of {result['config']['directory']})")
    for name, (value, ok) in checks.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        say(f"  {'ok  ' if ok else 'MISS'} {name}: {shown}")
    say(f"  at {largest['mib']} MiB/node the job is blocked {largest['background']['median']['blocked'] * 1e3:.0f} ms with background writes "
        f"vs {largest['inline']['median']['blocked'] * 1e3:.0f} ms inline; the state is on disk after "
        f"{largest['background']['median']['disk'] * 1e3:.0f} / {largest['inline']['median']['disk'] * 1e3:.0f} ms")
    say(f"  restart latency (median): {t3['median']['launch_latency'] * 1e3:.0f} ms to launched, "
        f"{t3['median']['running_latency'] * 1e3:.0f} ms to running again")
    return {name: {"value": value, "ok": ok} for name, (value, ok) in checks.items()}


# ---------------------------------------------------------------- main


def leftover_processes(directory: Path) -> list[psutil.Process]:
    """Processes started for this cluster's jobs (ranks, snapshot writers) still alive."""
    found = []
    for proc in psutil.process_iter(["pid", "environ"]):
        try:
            env = proc.info.get("environ") or {}
        except psutil.Error:
            continue
        if env.get("GANGD_SOCKET", "").startswith(str(directory)):
            found.append(proc)
    return found


def main() -> None:
    global out, CKPT_MODE, CKPT_CODEC, CKPT_PIPELINE, CKPT_REDUNDANCY, MALLOC, NODES
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small version: shorter runs, fewer repeats, sizes up to 64 MiB")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each kind for Tables 2 and 3 (default 3, quick 2)")
    parser.add_argument("--checkpoints", type=int, default=None, help="checkpoints per job and size in Fig. 4 (default 2, quick 1)")
    parser.add_argument("--max-mib", type=int, default=None, help="largest state per node in Fig. 4 (default 1024, quick 64)")
    parser.add_argument("--breakdown-mib", type=int, default=64, help="state per node of Table 4")
    parser.add_argument("--state-mib", type=float, default=4.0, help="state per rank of Tables 2 and 3")
    parser.add_argument("--seconds", type=float, default=None, help="loop time of one Table 2 run (default 3.5, quick 1.5)")
    parser.add_argument("--malloc", choices=["pinned", "glibc"], default="pinned",
                        help="glibc's mmap threshold fixed in every job (default), or glibc's default (see the docstring)")
    parser.add_argument("--ckpt-mode", choices=["full", "incremental", "differential", "adaptive"], default="full",
                        help="every job's checkpoint mode (default full: the paper's figures are whole writes)")
    parser.add_argument("--ckpt-redundancy", choices=["local", "partner", "xor"], default=None,
                        help="every job's --ckpt-redundancy (default: the cluster's, xor on 3+ nodes: each generation's "
                             "parity is written behind the job, while the next checkpoint of a back-to-back series writes)")
    parser.add_argument("--ckpt-codec", default=None, help="every job's --ckpt-codec (default: none, raw): Fig. 4 through the pipeline")
    parser.add_argument("--ckpt-pipeline", default=None, help="every job's --ckpt-pipeline (e.g. workers=1; default: the defaults)")
    parser.add_argument("--min-mib", type=int, default=1, help="smallest state per node in Fig. 4 (default 1)")
    parser.add_argument("--begin-cost", action="store_true", help="only the begin's cost, mode full against adaptive (see the docstring)")
    parser.add_argument("--begin-mib", type=int, default=1, help="state per node of --begin-cost")
    parser.add_argument("--nodes", type=int, default=NODES,
                        help="nodes of the local cluster, one rank each (default 4: twice this machine's 2 cores; "
                             "--nodes 2 gives each node and its rank a core, as on a real cluster)")
    parser.add_argument("--json", action="store_true", help="print every number as JSON on stdout (tables on stderr)")
    parser.add_argument("--tables", default="2,3,4", help="which parts to run: 2 (overhead), 3 (restart; runs 2 for its "
                        "calibration), 4 (Tables 4, 5 and Fig. 4), R (redundancy levels end to end: local, partner, xor at "
                        "--redundancy-mib, --repeats jobs each); e.g. --tables 2 (default: 2,3,4; the summary needs those three)")
    parser.add_argument("--redundancy-mib", type=int, default=256, help="MiB per node of Table R's jobs (default 256)")
    parser.add_argument("--redundancy-inline", action="store_true", help="Table R's jobs write inline (default: background)")
    args = parser.parse_args()
    tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    if not tables or not tables <= {"2", "3", "4", "5", "R"}:
        parser.error(f"--tables takes a comma-separated list of 2, 3, 4 and R, not {args.tables!r}")
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    NODES = args.nodes
    CKPT_MODE = args.ckpt_mode
    CKPT_REDUNDANCY = args.ckpt_redundancy
    CKPT_CODEC, CKPT_PIPELINE = args.ckpt_codec, args.ckpt_pipeline
    MALLOC = PINNED_MALLOC if args.malloc == "pinned" else {}
    quick = args.quick
    repeats = args.repeats or (2 if quick else 3)
    restarts = args.repeats or (2 if quick else 3)
    count = args.checkpoints or (1 if quick else 2)
    max_mib = args.max_mib if args.max_mib is not None else (64 if quick else 1024)
    seconds = args.seconds or (1.5 if quick else 3.5)
    sizes = [s for s in SIZES if args.min_mib <= s <= max_mib] or [max_mib]
    if args.json:
        out = sys.stderr
    result: dict = {}
    started = time.time()
    # The cluster in the same filesystem as /tmp, where the raw baseline writes too.
    with tempfile.TemporaryDirectory(prefix="gangd-bench-ckpt-") as tmp:
        directory = Path(tmp)
        result["config"] = {
            "nodes": NODES, "ranks_per_node": 1, "cores": os.cpu_count(), "directory": str(directory), "quick": quick,
            "repeats": repeats, "restarts": restarts, "checkpoints_per_size": count, "sizes_mib": sizes, "state_mib": args.state_mib,
            "ckpt_job_sleep_s": CKPT_SLEEP, "ckpt_job_band_bytes": CKPT_BAND, "raw_chunk": RAW_CHUNK,
            "loadavg_start": os.getloadavg(), "malloc": MALLOC, "ckpt_codec": CKPT_CODEC, "ckpt_pipeline": CKPT_PIPELINE,
        }
        say(f"gangd checkpoint benchmark: {NODES} nodes x 1 rank (1 core each) on {os.cpu_count()} cores, cluster in {directory}")
        say("every job's glibc mmap threshold: " + ("fixed (" + " ".join(f"{k}={v}" for k, v in MALLOC.items()) + ")" if MALLOC
                                                    else "glibc's default, moving with each process's history"))
        say(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (anything else running shares the cores and the disk)")
        local.up(directory, NODES, cores=1, log_level="warning")
        try:
            if args.begin_cost:
                say(f"Begin: {args.repeats or 2} x (full, adaptive) jobs of {args.checkpoints or 8} checkpoints, {args.begin_mib} MiB/node ...")
                result["begin"] = trio.run(begin_cost, directory, args.begin_mib, args.checkpoints or 8, args.repeats or 2)
                print_begin(result["begin"])
                tables = set()
            if tables & {"2", "3"}:
                say(f"Table 2: {repeats} plain + {repeats} ckptlib runs of ~{seconds:g} s ...")
                result["overhead"] = trio.run(overhead, directory, args.state_mib, seconds, repeats)
                print_overhead(result["overhead"], repeats)
            if "3" in tables:
                say(f"\nTable 3: {restarts} normal + checkpoint/kill/restart runs ...")
                result["restart"] = trio.run(restarted, directory, result["overhead"], restarts)
                print_restart(result["restart"], result["overhead"]["steps"])
            if tables & {"4", "5"}:
                wanted = [*sizes, args.breakdown_mib] if args.breakdown_mib not in sizes else sizes
                say(f"\nFig. 4 / Tables 4, 5: sizes {', '.join(map(str, sorted(set(wanted))))} MiB per node, {count} checkpoint(s) each ...")
                rows = sweep(directory, sorted(set(wanted)), count)
                result["sweep"] = [r for r in rows if r["mib"] in sizes]
                print_breakdown(next(r for r in rows if r["mib"] == args.breakdown_mib))
                print_bandwidth(result["sweep"], count)
            if "R" in tables:
                say(f"\nTable R: {repeats} jobs per redundancy level ({', '.join(LEVELS)}), {count} + 1 checkpoints each, "
                    f"{args.redundancy_mib} MiB/node ...")
                result["redundancy"] = trio.run(redundancy_levels, directory, args.redundancy_mib, count, repeats, not args.redundancy_inline)
                print_levels(result["redundancy"])
            if {"2", "3", "4"} <= tables:
                result["summary"] = summary(result)
        finally:
            # Kill whatever is left (after an error), then stop the daemons.
            async def kill_all():
                async with connect(directory) as gang:
                    for record in await gang.jobs():
                        if record["state"] not in ("DONE", "FAILED", "KILLED"):
                            await kill(gang, record["id"])

            try:
                trio.run(kill_all)
            except Exception as exc:  # noqa: BLE001 -- the cluster goes down anyway
                say(f"(could not kill the remaining jobs: {exc})")
            local.down(directory)
            stray = leftover_processes(directory)
            for proc in stray:
                say(f"(killing stray process {proc.pid} of the cluster: {' '.join(proc.cmdline()[:4])})")
                proc.send_signal(signal.SIGKILL)
    result["seconds"] = time.time() - started
    result["loadavg_end"] = os.getloadavg()
    say(f"\n(total {result['seconds']:.0f} s; load average after: {' '.join(f'{x:.2f}' for x in result['loadavg_end'])})")
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()


if __name__ == "__main__":
    main()
