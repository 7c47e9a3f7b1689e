"""Issue 17's dense rule, measured alone: when nearly everything changed, adaptive costs <= 1.05x a plain full.

A plain full (mode ``full``) writes every block and hashes nothing but the
file's checksum. Adaptive must hash every block for the signature the next
generation diffs against. Two ways of doing that are timed here, each against
plain fulls written in the same run, alternating (full, adaptive, full, ...):

* ``adaptive``: today's writer. A sample of blocks shows the change is dense,
  so the generation is a full. Its blocks are written first, and their
  hashing overlaps the disk's writeback (``blocks.looks_dense``,
  ``blocks.encode(late=True)``). A dense full after a full is not signed, so
  every other generation of the run hashes only the sample.
* ``full-pass``: the writer before. It hashes every block, compares,
  decides, then writes a signed full.

Every generation is written inline with fsync (``durable``), as a rank's
inline write is. Between generations the whole state changes (a dense update),
outside the clock. Printed per kind: the median wall time and CPU time of a
write, the ratio to the plain fulls' medians, and a breakdown: the block
hash pass alone, raw xxh3 over the same bytes, and write+fsync.

    python bench/ckpt_dense.py [--mib 64] [--repeats 9] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from gangd.ckptlib import blocks


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="state size")
    parser.add_argument("--repeats", type=int, default=9, help="writes of each kind")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    args = parser.parse_args()
    load = os.getloadavg()
    state = {"u": np.random.default_rng(0).random(args.mib * (1 << 20) // 8), "stats": {"step": 0}}
    with tempfile.TemporaryDirectory(prefix="gangd-dense-", dir=args.dir) as tmp:
        root = Path(tmp)
        shortcut = blocks.looks_dense
        gen = 0
        times: dict[str, list[tuple[float, float]]] = {"full": [], "adaptive": [], "full-pass": []}
        signed: dict[str, list[bool]] = {k: [] for k in times}
        last: dict[str, tuple[Path, dict] | None] = dict.fromkeys(times)  # each kind's chain: its previous generation

        def write(kind: str) -> None:
            nonlocal gen
            gen += 1
            state["u"] += 1.0  # every block changes (outside the clock)
            state["stats"]["step"] = gen
            path = root / f"gen-{gen}"
            prev = last[kind]
            offered = [] if prev is None or kind == "full" else [{"gen": int(prev[0].name[4:]), "path": str(prev[0]),
                                                                   "expect": [prev[1]["size"], prev[1]["digest"]]}]
            if kind == "full-pass":  # the writer before: with a signed parent, hash every block, compare, then write
                blocks.looks_dense = lambda *a, **k: False
            out: dict = {}
            try:
                times[kind].append(timed(lambda: out.update(blocks.save_generation(
                    path, state, gen=gen, mode="full" if kind == "full" else "adaptive", offered=offered))))
            finally:
                blocks.looks_dense = shortcut
            signed[kind].append(blocks.read_index(path).signed)
            if prev is not None:
                prev[0].unlink()
            last[kind] = (path, out)

        for kind in times:  # warm-up (page cache, allocator), and each chain's first generation
            write(kind)
            times[kind].clear()
            signed[kind].clear()
        for i in range(args.repeats):
            for kind in ("full", "adaptive", "full", "full-pass") if i % 2 == 0 else ("full-pass", "full", "adaptive", "full"):
                write(kind)
        blocks.looks_dense = shortcut
        data = memoryview(state["u"]).cast("B")
        hash_pass = min(timed(lambda: blocks.hash_blocks(data, blocks.DEFAULT_BLOCK))[1] for _ in range(5))
        raw = min(timed(lambda: xxhash.xxh3_128_digest(data))[1] for _ in range(5))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print(f"dense checkpoints of {args.mib} MiB, {args.repeats} writes of each adaptive kind, {2 * args.repeats} plain fulls, alternating, "
          f"inline with fsync; load average {' '.join(f'{x:.2f}' for x in load)} -> {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'kind':>10} | {'wall ms':>8} {'x full':>7} | {'CPU ms':>7} {'x full':>7} | signed")
    for kind, (w, c) in med.items():
        print(f"{kind:>10} | {w * 1e3:8.1f} {w / med['full'][0]:7.3f} | {c * 1e3:7.1f} {c / med['full'][1]:7.3f} | "
              f"{sum(signed[kind])} of {len(signed[kind])}")
    print(f"breakdown: block hash pass {hash_pass * 1e3:.1f} ms CPU ({args.mib / 1024 / hash_pass:.1f} GiB/s; raw xxh3 {raw * 1e3:.1f} ms, "
          f"{args.mib / 1024 / raw:.1f} GiB/s); a plain full's write+fsync {med['full'][0] * 1e3:.1f} ms wall, {med['full'][1] * 1e3:.1f} ms CPU")
    ok = med["adaptive"][0] <= 1.05 * med["full"][0]
    print(f"{'ok  ' if ok else 'MISS'} adaptive/full wall time {med['adaptive'][0] / med['full'][0]:.3f} (target <= 1.05; "
          f"full-pass was {med['full-pass'][0] / med['full'][0]:.3f})")
    sys.exit(0)


if __name__ == "__main__":
    main()
