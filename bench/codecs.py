"""Checkpoint codecs (gangd.codecs, issue 18) on their own: ratio and speed per codec, against memcpy in the same run.

No checkpoint is written (the codecs are not in the writer yet): this is
what each codec costs per byte of state and what it saves, to choose the
defaults before the pipeline exists. For each data set -- smooth float64
(``sin(40x) + 0.01 * noise``, the ../shared/peers ring job's ``smooth``),
uniform random float64 (the ring job's ``random``: its exponents are alike,
so it is not incompressible), random bits (incompressible) and an int32
ramp -- the value (``--mib`` MiB) is cut into ``--block`` byte blocks and
each is compressed and decompressed through :func:`gangd.codecs.encode` /
:func:`~gangd.codecs.decode` (so a block that does not shrink is stored
raw, as the writer will). Speeds are CPU time of this thread (the codecs
run single-threaded), best of ``--repeats``, each repeat timing a memcpy
of the same bytes (``numpy.copyto``) right before the codecs: the ratio
``x memcpy`` is what survives a busy machine. (``none``'s encode hands back a view
of the block, no copy, so its "compress" speed is not a copy's.) ``auto`` is also timed
choosing alone, against compressing the whole value with what it chose.
Import times of each library (a rank pays them only if it compresses) are
the best of 5 fresh interpreters that already imported gangd.ckptlib (as a
rank has: numpy, typing, dataclasses are loaded by then). The load average is printed before and
after.

    python bench/codecs.py [--mib 32] [--block 1M] [--repeats 3] [--codecs a,b,..] [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from gangd import codecs
from gangd.codecs import auto

CODECS = [
    "none", "lz4", "zstd:1", "zstd:3", "zstd:9", "blosc2:lz4:shuffle", "blosc2:lz4:bytedelta", "blosc2:zstd:1:shuffle",
    "blosc2:zstd:1:bytedelta", "blosc2:zstd:5:bytedelta", "auto",
]


def size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def datasets(mib: int) -> dict[str, np.ndarray]:
    n = (mib << 20) // 8
    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, n)
    return {
        "smooth f8": np.sin(40 * x) + 0.01 * rng.standard_normal(n),
        "uniform f8": rng.random(n),
        "random bits": np.frombuffer(rng.bytes(8 * n), "<f8"),
        "int32 ramp": np.arange(2 * n, dtype=np.int32),
    }


def cpu(fn) -> float:
    began = time.thread_time()
    fn()
    return time.thread_time() - began


def one_codec(spec: str, value: np.ndarray, block: int, repeats: int) -> dict:
    raw = value.reshape(-1).view(np.uint8)
    blocks = [raw[i : i + block] for i in range(0, raw.nbytes, block)]
    chosen = str(codecs.choose(raw, value.dtype)) if spec == "auto" else spec
    best = {"memcpy": float("inf"), "compress": float("inf"), "decompress": float("inf")}
    stored: list = []
    scratch = np.empty_like(raw)
    out = np.empty_like(raw)
    for _ in range(repeats):
        best["memcpy"] = min(best["memcpy"], cpu(lambda: np.copyto(scratch, raw)))
        stored.clear()
        best["compress"] = min(best["compress"], cpu(lambda: stored.extend(codecs.encode(chosen, b, value.dtype.itemsize) for b in blocks)))

        def restore() -> None:
            for (ident, payload), b in zip(stored, blocks, strict=True):
                at = b.ctypes.data - raw.ctypes.data
                codecs.decode(ident, payload, memoryview(out[at : at + b.nbytes]))

        best["decompress"] = min(best["decompress"], cpu(restore))
    assert np.array_equal(out, raw), spec
    packed = sum(memoryview(p).nbytes for _, p in stored)
    raw_blocks = sum(1 for ident, _ in stored if ident.spec.name == "none")
    result = {
        "codec": spec, "chosen": chosen, "ratio": raw.nbytes / packed, "raw_blocks": raw_blocks, "blocks": len(blocks),
        "memcpy_gbs": raw.nbytes / best["memcpy"] / 1e9,
        "compress_gbs": raw.nbytes / best["compress"] / 1e9, "decompress_gbs": raw.nbytes / best["decompress"] / 1e9,
    }
    if spec == "auto":  # what choosing costs against compressing the whole value with the codec it tried
        tried, itemsize = auto.candidate(value.dtype)
        choosing = min(cpu(lambda: codecs.choose(raw, value.dtype)) for _ in range(repeats))
        whole = min(cpu(lambda: [codecs.encode(tried, b, itemsize) for b in blocks]) for _ in range(repeats))
        result["auto_share"] = choosing / whole
        result["auto_ms"] = choosing * 1e3
    return result


def import_times() -> dict[str, float]:
    """Milliseconds to import each module in a fresh interpreter that already imported what a rank has (gangd.ckptlib)."""
    found = {}
    for module in ("gangd.codecs", "lz4.block", "zstandard", "blosc2", "importlib.metadata"):
        probe = f"import gangd.ckptlib, time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
        runs = [float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout) for _ in range(5)]
        found[module] = min(runs) * 1e3
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--block", type=size, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--quick", action="store_true", help="8 MiB, 2 repeats")
    a = ap.parse_args()
    if a.quick:
        a.mib, a.repeats = 8, 2
    print(f"load average before: {os.getloadavg()}; {a.mib} MiB per data set, {a.block} B blocks, best of {a.repeats}, CPU time")
    for module, ms in import_times().items():
        print(f"  import {module:20s} {ms:7.1f} ms (after gangd.ckptlib, as in a rank; best of 5 fresh interpreters)")
    for name, value in datasets(a.mib).items():
        print(f"\n{name}:")
        print(f"  {'codec':26s} {'chosen':26s} {'ratio':>7s} {'raw blk':>8s} {'comp GB/s':>9s} {'x memcpy':>8s} {'dec GB/s':>9s} {'x memcpy':>8s}")
        for spec in a.codecs.split(","):
            r = one_codec(spec, value, a.block, a.repeats)
            extra = f"  (choosing: {r['auto_ms']:.2f} ms, {100 * r['auto_share']:.1f} % of compressing it all with the candidate)" if "auto_ms" in r else ""
            print(
                f"  {spec:26s} {r['chosen']:26s} {r['ratio']:7.2f} {r['raw_blocks']:4d}/{r['blocks']:<3d} {r['compress_gbs']:9.2f} "
                f"{r['compress_gbs'] / r['memcpy_gbs']:8.3f} {r['decompress_gbs']:9.2f} {r['decompress_gbs'] / r['memcpy_gbs']:8.3f}{extra}"
            )
        print(f"  (memcpy of the same bytes: {r['memcpy_gbs']:.2f} GB/s)")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
