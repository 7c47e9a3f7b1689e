"""Compressed checkpoints through the pipeline (issue 18) against raw and against compress-then-write, in one run.

Paper 004 (PCCR) pipelines compress and write so a checkpoint costs about
its longest stage instead of their sum. This measures gangd's inline
checkpoint of one rank's state -- ``--mib`` MiB of smooth float64 (the
../shared/peers ring job's ``smooth``: ``sin(40x) + 0.01 * noise``) -- written
by :func:`gangd.ckptlib.blocks.save_generation` as a full, durable
generation (fsync, rename), with:

* ``none``: today's raw write (format 2, writev + sync_file_range kicks);
* each codec of ``--codecs`` through the pipeline (compress thread, write
  thread, 4 MiB aggregated writes);
* ``serial <codec>``: the same units compressed first (same function, one
  thread), then written and fsynced (``write_atomic``) -- what the pipeline is
  meant to beat.

Rounds alternate the variants (``--rounds``), and the median of each is
printed: total wall time, the pipeline's longest stage (busy time: wall
minus waiting for input or for a free buffer) and total/longest, bytes on
disk, effective bandwidth (state bytes per second of total time) and its
ratio to ``none`` in the same run. The machine is shared (2 cores, other
jobs): the load average is printed before and after; take the ratios, not
the MB/s. ``restore s``: reading the file back into a new array (from the page cache: the
file was just written), checked bit-identical.

``--background``: the generations are written by the forked snapshot
(:func:`gangd.ckptlib.writer.write`, as a job's checkpoints are by default);
total is then the time to durable, and the time the job was blocked is printed.

    python bench/pipeline.py [--mib 256] [--rounds 3] [--codecs auto,blosc2:lz4:1:bytedelta] [--background] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from gangd import ckptstore
from gangd.ckptlib import blocks, units, writer
from gangd.ckptlib.core import DeltaSettings
from gangd.codecs import CodecSpec, encode


def smooth(mib: int) -> np.ndarray:
    n = (mib << 20) // 8
    x = np.linspace(0, 1, n)
    return np.sin(40 * x) + 0.01 * np.random.default_rng(0).standard_normal(n)


def pipelined(path: Path, values: dict, codec: str | None, background: bool = False) -> dict:
    began = time.perf_counter()
    if background:  # the forked snapshot writes (ckptlib's default): the job is blocked only for the fork
        plan = DeltaSettings.from_options(mode="full", codec=codec or "none").plan(1, [])
        written = writer.write(path, values, 0, background=True, delta=plan)
        blocked = time.perf_counter() - began
        result = written.wait()
        assert "error" not in result, result
        result["blocked"] = blocked
    else:
        result = blocks.save_generation(path, values, gen=1, mode="full", codec=None if codec is None else CodecSpec.parse(codec))
    result["total"] = time.perf_counter() - began
    stages = result.get("pipeline", {}).get("stages", {})
    result["longest"] = max((s["busy_s"] for name, s in stages.items() if name != "submit"), default=result["total"])
    return result


def serial(path: Path, values: dict, codec: str) -> dict:
    """Compress every unit first (one thread), then write and fsync: the pipeline's baseline."""
    spec = CodecSpec.parse(codec)
    began = time.perf_counter()
    state = blocks.signature(blocks.plan(values))  # (the pipelined writer hashes too)
    packed = []
    for v in state.values:
        dtype = np.dtype(v.meta["dtype"]) if v.kind == "nd" else None
        chosen, itemsize = units.choose(spec, v.data, dtype)
        for a, b in units.cut(np.ones(blocks.nblocks(v.nbytes, state.block), bool), units.per_unit(state.block)):
            packed.append(encode(chosen, v.data[a * state.block : min(b * state.block, v.nbytes)], itemsize)[1])
    compressed = time.perf_counter()
    size, _ = ckptstore.write_atomic(path, packed)
    done = time.perf_counter()
    return {"size": size, "total": done - began, "longest": max(compressed - began, done - compressed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codecs", default="auto,blosc2:lz4:1:bytedelta")
    ap.add_argument("--background", action="store_true", help="checkpoint from a forked snapshot (the job blocked only for the fork)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on the disk of the working directory)")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(prefix="gangd-bench-pipeline-", dir=args.dir or "."))
    print(f"load average before: {os.getloadavg()}")
    values = {"u": smooth(args.mib)}
    state = values["u"].nbytes
    bg = args.background
    variants: list[tuple[str, object]] = [("none", lambda p: pipelined(p, values, None, bg))]
    for codec in args.codecs.split(","):
        variants.append((codec, lambda p, c=codec: pipelined(p, values, c, bg)))
        variants.append((f"serial {codec}", lambda p, c=codec: serial(p, values, c)))
    figures: dict[str, list[dict]] = {name: [] for name, _ in variants}
    try:
        for _, run in variants:  # a warm-up round, not counted: the codecs' libraries are imported in it
            run(where / "rank-0.state")  # type: ignore[operator]
            (where / "rank-0.state").unlink()
        for _ in range(args.rounds):
            for name, run in variants:
                path = where / "rank-0.state"
                row = run(path)  # type: ignore[operator]
                if not name.startswith("serial"):  # (the serial baseline writes no checkpoint file)
                    began = time.perf_counter()
                    restored = blocks.read_chain(path, (), (row["size"], row["digest"]))[0]
                    row["restore"] = time.perf_counter() - began
                    assert restored["u"].tobytes() == values["u"].tobytes()
                    del restored
                figures[name].append(row)
                path.unlink()
    finally:
        shutil.rmtree(where, ignore_errors=True)
    base = statistics.median(r["total"] for r in figures["none"])
    print(f"state {state >> 20} MiB smooth float64, {'background (forked)' if bg else 'inline'} writes "
          f"(serial: inline), {args.rounds} alternating rounds, medians:")
    print(f"{'variant':34} {'total s':>8} {'longest s':>9} {'tot/long':>8} {'on disk MiB':>11} {'ratio':>6} {'MB/s':>7} {'x none':>7} "
          f"{'restore s':>9}")
    for name, rows in figures.items():
        total = statistics.median(r["total"] for r in rows)
        longest = statistics.median(r["longest"] for r in rows)
        size = statistics.median(r["size"] for r in rows)
        print(f"{name:34} {total:8.2f} {longest:9.2f} {total / longest:8.2f} {size / (1 << 20):11.1f} {state / size:6.2f} "
              f"{state / total / 1e6:7.0f} {base / total:7.2f} "
              + (f"{statistics.median(r['restore'] for r in rows):9.2f}" if "restore" in rows[0] else f"{'-':>9}"))
    for name in figures:
        if not name.startswith("serial") and name != "none":
            mine = statistics.median(r["total"] for r in figures[name])
            other = statistics.median(r["total"] for r in figures[f"serial {name}"])
            print(f"{name}: pipelined {mine:.2f} s vs compress-then-write {other:.2f} s: {100 * (1 - mine / other):.0f} % faster")
    if bg:
        for name, rows in figures.items():
            if "blocked" in rows[0]:
                print(f"{name}: the job was blocked {1000 * statistics.median(r['blocked'] for r in rows):.1f} ms (the fork)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
