"""Checkpoints of an MPI job against a gangd-comm job of the same state.

The job is bench/ckpt_app.py on a local 4-node cluster, one rank per node,
in its two versions: halo rows through gangd.comm with ``ckpt.loop``
(``gang run``), and through mpi4py over TCP with a
``ckptlib.mpi.checkpoint(comm)`` call at the end of every iteration (``gang
run --mpi``). Same state per rank, same arithmetic, same digest. Measured in
the same run, the two versions alternating:

* checkpoint time per size (``gang checkpoint`` from request to the
  generation complete, everything on disk), the time the job is blocked,
  and the sync overhead; ratio MPI / comm. An MPI checkpoint adds the
  in-flight check (a marker from every rank to every rank) and waits for
  the next ``checkpoint(comm)`` call instead of any loop boundary.
* what ``checkpoint(comm)`` costs when no checkpoint is due (one small
  allreduce per call): time per iteration with the call against the same
  MPI job without ckptlib (``--plain``).

    python bench/mpi_ckpt.py [--sizes 4,16,64] [--checkpoints 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ckpt as bench  # bench/ckpt.py: its jobs, checkpoints and summaries
import trio

from gangd.client import cluster as local
from gangd.client.api import connect

say = bench.say  # (to bench.out: stdout, or stderr under --json)


def checkpoint_costs(directory: Path, sizes: list[int], count: int) -> list[dict]:
    rows = []
    for mib in sizes:
        row: dict = {"mib": mib}
        for kind, mpi in (("comm", False), ("mpi", True)) if mib % 2 else (("mpi", True), ("comm", False)):
            entries = trio.run(bench.checkpointed_job, directory, mib, True, count, mpi)
            each = [bench.summarize(e) for e in entries]
            row[kind] = {k: statistics.median(s[k] for s in each) for k in each[0]}
        row["ratio_t"] = row["mpi"]["t"] / row["comm"]["t"]
        row["ratio_blocked"] = row["mpi"]["blocked"] / row["comm"]["blocked"]
        rows.append(row)
        say(f"  {mib} MiB/rank: checkpoint {row['comm']['t'] * 1e3:.0f} ms (comm) vs {row['mpi']['t'] * 1e3:.0f} ms (MPI)")
    return rows


async def call_cost(directory: Path, steps: int, repeats: int) -> dict:
    """Seconds per iteration of the MPI job with checkpoint(comm) every iteration vs without ckptlib."""
    argv = ["--mb", "1", "--steps", str(steps)]
    samples: dict[str, list[float]] = {"plain": [], "ckpt": []}
    async with connect(directory) as gang:
        for i in range(repeats):
            for kind in ("plain", "ckpt") if i % 2 == 0 else ("ckpt", "plain"):
                _, done = await bench.run_to_end(gang, argv + (["--plain"] if kind == "plain" else []), name=f"mpi-{kind}", mpi=True)
                samples[kind].append(bench.per_iter(done))
    result = {kind: statistics.median(values) for kind, values in samples.items()}
    result["ratio"] = result["ckpt"] / result["plain"]
    result["call_us"] = (result["ckpt"] - result["plain"]) * 1e6
    result["samples"] = samples
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,16,64", help="MiB per rank, comma-separated")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per job and size")
    parser.add_argument("--steps", type=int, default=2000, help="iterations of each call-cost run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind for the call cost")
    parser.add_argument("--json", action="store_true", help="every number as JSON on stdout (tables on stderr)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.json:
        bench.out = sys.stderr
    result: dict = {"config": {"nodes": bench.NODES, "sizes_mib": sizes, "checkpoints": args.checkpoints, "cores": os.cpu_count()}}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gangd-bench-mpickpt-") as tmp:
        directory = Path(tmp)
        say(f"MPI vs gangd-comm checkpoints: {bench.NODES} nodes x 1 rank, MPI over TCP; load average {os.getloadavg()[0]:.2f}")
        local.up(directory, bench.NODES, cores=1, log_level="warning")
        try:
            result["checkpoints"] = checkpoint_costs(directory, sizes, args.checkpoints)
            result["call"] = trio.run(call_cost, directory, args.steps, args.repeats)
        finally:
            local.down(directory)
    result["seconds"] = time.time() - started
    say(f"\nCheckpoint of the same job, gangd.comm vs MPI (medians of {args.checkpoints}; ms; background writes)")
    say(f"{'MiB/rank':>8} | {'t comm':>8} {'t MPI':>8} {'ratio':>6} | {'blocked comm':>12} {'blocked MPI':>11} {'ratio':>6} | {'sync comm':>9} {'sync MPI':>8}")
    for row in result["checkpoints"]:
        c, m = row["comm"], row["mpi"]
        say(f"{row['mib']:8} | {c['t'] * 1e3:8.0f} {m['t'] * 1e3:8.0f} {row['ratio_t']:6.2f} | {c['blocked'] * 1e3:12.1f} {m['blocked'] * 1e3:11.1f} "
            f"{row['ratio_blocked']:6.2f} | {c['sync_overhead'] * 1e3:9.1f} {m['sync_overhead'] * 1e3:8.1f}")
    call = result["call"]
    say(f"\ncheckpoint(comm) with none due, per iteration (median of {args.repeats}): "
        f"{call['plain'] * 1e6:.0f} us without ckptlib, {call['ckpt'] * 1e6:.0f} us with -> ratio {call['ratio']:.3f} "
        f"({call['call_us']:.0f} us per call)")
    say(f"(total {result['seconds']:.0f} s)")
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()


if __name__ == "__main__":
    main()
