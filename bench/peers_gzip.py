"""Compressed checkpoints against DMTCP's gzip, on the ../shared/peers ring workload, in one run.

Issue 18 cites DMTCP as what a user would pick instead: it pipes each
process's image through a forked ``gzip -1`` by default (``--no-gzip`` turns
it off), and took 6.4-6.7 s per checkpoint with gzip on the ring workload
against gangd's 0.3-0.5 s raw. gangd now compresses through its pipeline
(``--ckpt-codec``); this bench says what that costs against both, on the
same workload and in the same run: ``--ranks`` (4) ranks x ``--mib`` (64)
MiB of float64 state in a ring (bench/ringjob.py, one program for both,
``--data smooth`` by default: ``sin(40x) + 0.01 * noise``, what the peers'
scripts default to). Variants, per repeat, in alternating order (reversed
every other repeat):

  dmtcp gzip       ``dmtcp_launch`` (its default: gzip -1), ``dmtcp_command -bc``
  dmtcp --no-gzip  the same with ``--no-gzip``
  gangd CODEC      a local cluster of ``--ranks`` nodes (one rank and one core
                   each): ``submit --ckpt-codec CODEC``, ``checkpoint`` (the
                   first of the job: a full generation, whatever the cluster's
                   mode), for ``none`` (raw), ``lz4``, ``zstd`` (its default
                   level, 3) and ``auto``

Each is timed from the checkpoint request to its return (DMTCP's ``-bc``:
every image written; gangd's: the generation complete, fsync'd, on disk;
DMTCP fsyncs only its gzip'd images, not ``--no-gzip`` ones); the image is
the bytes on disk (DMTCP: every ``ckpt_*.dmtcp``, one per process, the
launcher's too, each a whole process image: interpreter, libraries, heap;
gangd: the ``protect``ed values' files on their nodes, without the
redundancy copies written after). The trials are bench/restart.py's, stopped
after the checkpoint. Printed: medians and ranges over ``--repeats``, and
ratios of time and image against DMTCP gzip and against gangd raw (of the
medians, and the median of the per-repeat ratios for time). Before the
trials, the state's own compressibility: rank 0's array through zlib level 1
(gzip -1's deflate), lz4 and zstd:3 in 1 MiB blocks (gangd.codecs), without
the processes around it.

    python bench/peers_gzip.py [--repeats 3] [--ranks 4] [--mib 64] [--data smooth|random]
                               [--variants dmtcp-gzip,dmtcp-nogzip,none,lz4,zstd,auto] [--dmtcp PREFIX] [--quick] [--json]

``--quick``: one repeat of 16 MiB per rank (about a minute). No DMTCP
(``--dmtcp`` PREFIX/bin/dmtcp_launch missing): gangd's variants only, said
so. The machine's other load shares the cores: the load average is printed
before, after each repeat and at the end.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import restart as peers  # bench/restart.py: its gangd and DMTCP trials, DMTCP's location, its report helpers
import trio

import gangd
from gangd.client import cluster as local
from gangd.codecs import encode

MiB = 1 << 20
GANGD_CODECS = {"none": "none", "lz4": "lz4", "zstd": "zstd", "auto": "auto"}
DMTCP_VARIANTS = {"dmtcp-gzip": True, "dmtcp-nogzip": False}
LABELS = {"dmtcp-gzip": "dmtcp gzip", "dmtcp-nogzip": "dmtcp --no-gzip", **{k: f"gangd {k}" for k in GANGD_CODECS}}

out = sys.stdout


def say(*parts) -> None:
    print(*parts, file=out, flush=True)


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def rank0_state(mib: int, data: str) -> np.ndarray:
    """Rank 0's array as bench/ringjob.py builds it (its ``build(0)``)."""
    n = mib * MiB // 8
    rng = np.random.default_rng(0)
    if data == "random":
        return rng.random(n)
    return np.sin(40 * np.linspace(0, 1, n)) + 0.01 * rng.standard_normal(n)


def compressibility(mib: int, data: str) -> dict[str, float]:
    """State bytes / compressed bytes of rank 0's array: zlib level 1 (gzip -1) on the whole, lz4 and zstd:3 per 1 MiB block."""
    raw = rank0_state(mib, data).tobytes()
    ratios = {"gzip -1 (zlib 1)": len(raw) / len(zlib.compress(raw, 1))}
    for codec in ("lz4", "zstd:3"):
        stored = sum(len(encode(codec, raw[i : i + MiB], 8)[1]) for i in range(0, len(raw), MiB))
        ratios[codec] = len(raw) / stored
    return ratios


def run_variant(kind: str, directory: Path, binary: Path | None, args) -> dict:
    if kind in DMTCP_VARIANTS:
        assert binary is not None
        return peers.dmtcp_trial(binary, args, gzip=DMTCP_VARIANTS[kind], restart=False)
    return trio.run(lambda: peers.gangd_trial(directory, args, "factory", codec=GANGD_CODECS[kind], restart=False))


def ratio_line(kind: str, base: str, rows: dict[str, list[dict]], summary: dict) -> str:
    if not rows.get(base) or not rows.get(kind):
        return "-"
    pairs = [a["checkpoint_s"] / b["checkpoint_s"] for a, b in zip(rows[kind], rows[base], strict=False)]
    of_medians = summary[kind]["checkpoint_s"] / summary[base]["checkpoint_s"]
    image = summary[kind]["image_bytes"] / summary[base]["image_bytes"]
    return f"time {of_medians:5.2f}x (per repeat median {statistics.median(pairs):5.2f}x), image {image:5.2f}x"


def report(rows: dict[str, list[dict]], args) -> dict:
    state = args.ranks * args.mib * MiB
    say(f"\ncheckpoint of the ring job, {args.ranks} ranks x {args.mib} MiB ({args.data}), {args.repeats} repeat(s), medians (range):")
    summary: dict = {}
    for kind, trials in rows.items():
        if not trials:
            say(f"  {LABELS[kind]:<16} no successful trial")
            continue
        times = [t["checkpoint_s"] for t in trials]
        images = [t["image_bytes"] for t in trials]
        summary[kind] = {"checkpoint_s": statistics.median(times), "checkpoint_range": [min(times), max(times)],
                         "image_bytes": statistics.median(images), "image_range": [min(images), max(images)]}
        say(f"  {LABELS[kind]:<16} checkpoint {peers.spread(times):<30} image {statistics.median(images) / MiB:7.1f} MiB "
            f"({min(images) / MiB:.1f}-{max(images) / MiB:.1f}), {statistics.median(images) / state:5.2f}x state")
    for base in ("dmtcp-gzip", "none"):
        if base not in summary:
            continue
        say(f"\nagainst {LABELS[base]} (below 1: faster / smaller):")
        for kind in rows:
            if kind != base and kind in summary:
                line = ratio_line(kind, base, rows, summary)
                summary[kind][f"vs {base}"] = line
                say(f"  {LABELS[kind]:<16} {line}")
    return summary


def main() -> None:
    global out
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64, help="state per rank")
    parser.add_argument("--data", choices=["smooth", "random"], default="smooth")
    parser.add_argument("--variants", default=",".join([*DMTCP_VARIANTS, *GANGD_CODECS]),
                        help=f"comma-separated, of {', '.join([*DMTCP_VARIANTS, *GANGD_CODECS])}")
    parser.add_argument("--every", type=int, default=200, help="iterations between rank 0's progress lines")
    parser.add_argument("--dmtcp", default=peers.DMTCP_DEFAULT, help="DMTCP's install prefix (bin/dmtcp_launch ...)")
    parser.add_argument("--quick", action="store_true", help="one repeat, 16 MiB per rank")
    parser.add_argument("--json", action="store_true", help="every number as JSON on stdout (the text on stderr)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.mib = 1, 16
    if args.json:
        out = peers.out = sys.stderr  # (bench/restart.py's lines too: its stray-process notes)
    kinds = [k for k in args.variants.split(",") if k]
    unknown = [k for k in kinds if k not in LABELS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose among {', '.join(LABELS)}")
    binary = peers.dmtcp_bin(args.dmtcp)
    if binary is None and any(k in DMTCP_VARIANTS for k in kinds):
        say(f"DMTCP not found in {args.dmtcp} (no bin/dmtcp_launch): gangd's variants only, NO DMTCP COMPARISON. Build it: "
            f"git clone https://github.com/dmtcp/dmtcp && ./configure --prefix={peers.DMTCP_DEFAULT} && make -j2 && make install.")
        kinds = [k for k in kinds if k not in DMTCP_VARIANTS]
    compileall.compile_dir(str(Path(gangd.__file__).parent), quiet=1)
    result: dict = {"config": {**vars(args), "variants": kinds, "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}}
    say(f"peers_gzip bench: {args.ranks} ranks x {args.mib} MiB ({args.data}), {', '.join(LABELS[k] for k in kinds)}; "
        f"{args.repeats} repeat(s); {load()} on {os.cpu_count()} cores")
    began = time.perf_counter()
    result["compressibility"] = compressibility(args.mib, args.data)
    say("rank 0's state alone, state/compressed: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["compressibility"].items()))
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="gangd-bench-peers-gzip-") as tmp:
        directory = Path(tmp)
        if any(k in GANGD_CODECS for k in kinds):
            local.up(directory, args.ranks, cores=1, log_level="warning")
        try:
            for repeat in range(args.repeats):
                for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                    try:
                        trial = run_variant(kind, directory, binary, args)
                    except (peers.BenchError, subprocess.SubprocessError) as exc:
                        say(f"  [{repeat + 1}/{args.repeats}] {LABELS[kind]:<16} FAILED: {exc}")
                        continue
                    except BaseExceptionGroup as group:  # (trio's nurseries wrap a trial's BenchError)
                        failed, other = group.split((peers.BenchError, subprocess.SubprocessError))
                        if failed is None or other is not None:
                            raise
                        say(f"  [{repeat + 1}/{args.repeats}] {LABELS[kind]:<16} FAILED: {'; '.join(map(str, peers._leaves(failed)))}")
                        continue
                    rows[kind].append(trial)
                    say(f"  [{repeat + 1}/{args.repeats}] {LABELS[kind]:<16} checkpoint {trial['checkpoint_s']:6.2f} s, "
                        f"image {trial['image_bytes'] / MiB:7.1f} MiB")
                say(f"  ({load()})")
        finally:
            if any(k in GANGD_CODECS for k in kinds):
                local.down(directory)
            peers.kill_strays(directory)
    result["trials"] = rows
    result["summary"] = report(rows, args)
    result["config"]["loadavg_end"] = os.getloadavg()
    say(f"\n({load()}; {time.perf_counter() - began:.0f} s)")
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()


if __name__ == "__main__":
    main()
