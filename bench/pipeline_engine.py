"""The stage pipeline (gangd.pipeline, issue 18 / paper 004) against serial compress-then-write, on this machine.

No cluster, one process. A state of ``--mib`` MiB (a smooth float32 field,
half of it noisy: zlib level ``--level`` takes it to about half) is cut into
items of the buffer size and, for each buffer size in ``--sizes``
(4 KiB .. 16 MiB, paper 004's U-curve), written four ways into a file in
``--dir`` with one ``fsync`` at the end, writes aggregated into
``aggregate_bytes`` (4 MiB, or the buffer size if larger) in every way:

  serial    zlib.compress each item, then pack and pwrite, in one thread;
  compress  the compression alone (no write);
  write     the write alone (the compressed items, prepared beforehand);
  pipeline  Pipeline([Transform(compress), Write(fsync=True)]): the caller
            submits, one thread compresses, one writes.

The four alternate within each of ``--repeats`` rounds (best of each taken)
so the machine's other load falls on all of them alike. Printed: the
pipeline against the longer of the two stages alone (004: 1.02-1.03x) and
against serial (004: 0.35-0.68x); the process CPU of serial and pipelined
runs; ``c-stage``, the pipeline's compress thread's own CPU against
compressing alone (what the engine adds on the critical path, whatever the
machine's load does to wall time); and the per-stage busy and idle times of
the pipeline's best run.

The engine's own cost (``--overhead-mib``, 512 MiB): the same with an
identity transform and /dev/null as the file, so only the copying into
buffers and the hand-offs remain, against a serial loop doing the same
aggregation; the difference in process CPU time (all threads) per GiB is
the part of a core the engine costs. Items are the buffer's size (as
in the sweep), then 16 KiB items (gangd's default delta block) packed into
the larger buffers. Also the fixed cost of one pipeline (threads started
and joined, buffers mapped).

Wall-clock figures on a shared machine are noisy: the load average is
printed before and after, and the ratios are within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from gangd.pipeline import Pipeline, Settings, Transform, Write
from gangd.pipeline.settings import MIB

KIB = 1024


def state(mib: int) -> memoryview:
    """A float32 field: 256 KiB stretches of full-precision noise (zlib: ~0.85) alternating with rounded ones (~0.26)."""
    n = mib * MIB // 4
    rng = np.random.default_rng(18)
    field = np.sin(np.arange(n, dtype=np.float32) / 5000.0) + rng.normal(0, 1e-3, n).astype(np.float32)
    rounded = (np.arange(n) // (64 * KIB)) % 2 == 1
    field[rounded] = np.round(field[rounded], 3)
    return memoryview(field.tobytes())


def items_of(data: memoryview, size: int) -> list[memoryview]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def settings_for(size: int) -> Settings:
    return Settings(buffer_count=4, buffer_size=size, aggregate_bytes=max(4 * MIB, size))


def serial_write(fd: int, chunks: list[memoryview], aggregate: int, fn: Callable[[memoryview], object] | None, fsync: bool) -> int:
    """Compress (``fn``) and write in one thread, packing outputs into ``aggregate``-byte writes as the pipeline does."""
    buf = bytearray(aggregate)
    view = memoryview(buf)
    used = offset = 0
    for chunk in chunks:
        out = memoryview(fn(chunk) if fn is not None else chunk).cast("B")  # type: ignore[arg-type]
        pos = 0
        while pos < len(out):
            take = min(aggregate - used, len(out) - pos)
            view[used:used + take] = out[pos:pos + take]
            used += take
            pos += take
            if used == aggregate:
                offset += os.pwrite(fd, view, offset)
                used = 0
    if used:
        offset += os.pwrite(fd, view[:used], offset)
    if fsync:
        os.fsync(fd)
    return offset


def piped_write(fd: int, chunks: list[memoryview], config: Settings, fn: Callable[[object, memoryview], object], fsync: bool):
    with Pipeline([Transform("compress", fn), Write(fd, fsync=fsync)], config) as pipe:
        for i, chunk in enumerate(chunks):
            pipe.submit(i, chunk)
        landing = pipe.finish()
    return landing, pipe.stats()


def compress_all(chunks: list[memoryview], level: int) -> list[bytes]:
    return [zlib.compress(c, level) for c in chunks]


def timed(run: Callable[[], object]) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def open_out(directory: Path) -> int:
    return os.open(directory / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def sweep(args: argparse.Namespace, data: memoryview, directory: Path) -> None:
    level = args.level

    def comp(key: object, chunk: memoryview) -> bytes:
        return zlib.compress(chunk, level)

    print(f"\n== compress (zlib level {level}) -> write + fsync, {args.mib} MiB, best of {args.repeats}: wall s, and process CPU s ==")
    print(f"{'buffer':>8} {'ratio':>6} {'serial':>7} {'compr':>7} {'write':>7} {'piped':>7} {'/longest':>9} {'/serial':>8} "
          f"{'cpu ser':>8} {'cpu pip':>8} {'c-stage':>8}   piped stages busy/idle-in/idle-out s")
    for size in args.sizes:
        config = settings_for(size)
        chunks = items_of(data, size)
        best: dict[str, float] = {}
        cpu: dict[str, float] = {}
        stats_best = None
        compressed = compress_all(chunks, level)
        comp_bytes = sum(len(c) for c in compressed)
        cviews = [memoryview(c) for c in compressed]
        for _ in range(args.repeats):
            fd = open_out(directory)
            try:
                runs: dict[str, Callable[[], object]] = {
                    "serial": partial(serial_write, fd, chunks, config.aggregate_bytes, partial(zlib.compress, level=level), True),
                    "compress": partial(compress_all, chunks, level),
                    "write": partial(serial_write, fd, cviews, config.aggregate_bytes, None, True),
                    "piped": partial(piped_write, fd, chunks, config, comp, True),
                }
                for name, run in runs.items():
                    os.ftruncate(fd, 0)
                    wall, used, result = timed(run)
                    cpu[name] = min(cpu.get(name, float("inf")), used)
                    if wall < best.get(name, float("inf")):
                        best[name] = wall
                    if name == "piped":
                        landing, stats = result  # type: ignore[misc]
                        assert landing.size == comp_bytes
                        cpu["stage"] = min(cpu.get("stage", float("inf")), stats[1].cpu_s)
                        if wall == best[name]:
                            stats_best = stats
            finally:
                os.close(fd)
        longest = max(best["compress"], best["write"])
        stages = " ".join(f"{s.name}={s.busy_s:.2f}/{s.idle_in_s:.2f}/{s.idle_out_s:.2f}" for s in stats_best or [])
        print(f"{size // KIB:>6}Ki {comp_bytes / len(data):6.2f} {best['serial']:7.3f} {best['compress']:7.3f} {best['write']:7.3f} "
              f"{best['piped']:7.3f} {best['piped'] / longest:9.2f} {best['piped'] / best['serial']:8.2f} "
              f"{cpu['serial']:8.3f} {cpu['piped']:8.3f} {cpu['stage'] / cpu['compress']:8.2f}   {stages}", flush=True)


def overhead(args: argparse.Namespace) -> None:
    """Identity transform into /dev/null: the pipeline's CPU against a serial loop doing the same copies and writes."""
    data = memoryview(bytearray(os.urandom(MIB)) * args.overhead_mib)
    print(f"\n== the engine's own cost: identity transform -> /dev/null, {args.overhead_mib} MiB, best of {args.repeats} "
          f"(process CPU s, all threads) ==")
    print(f"{'buffer':>8} {'serial':>7} {'piped':>7} {'extra CPU s/GiB':>16} {'per item us':>12}")
    gib = len(data) / (1024 * MIB)

    def ident(key: object, chunk: memoryview) -> memoryview:
        return chunk

    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fixed = min(timed(partial(piped_write, fd, [data[:1]], settings_for(MIB), ident, False))[1] for _ in range(args.repeats))
        print(f"fixed cost of one pipeline (3 threads started and joined, buffers mapped, 1 byte through): {fixed * 1e3:.2f} ms CPU")
        rows = [(size, size) for size in args.sizes] + [(16 * KIB, size) for size in args.sizes if size > 16 * KIB]
        for row, (item, size) in enumerate(rows):
            if row == len(args.sizes):
                print("16 KiB items (gangd's default delta block) packed into larger buffers:")
            config = settings_for(size)
            chunks = items_of(data, item)
            best = {"serial": float("inf"), "piped": float("inf")}
            for _ in range(args.repeats):
                best["serial"] = min(best["serial"], timed(partial(serial_write, fd, chunks, config.aggregate_bytes, None, False))[1])
                best["piped"] = min(best["piped"], timed(partial(piped_write, fd, chunks, config, ident, False))[1])
            extra = best["piped"] - best["serial"]
            print(f"{size // KIB:>6}Ki {best['serial']:7.3f} {best['piped']:7.3f} {extra / gib:16.3f} {extra / len(chunks) * 1e6:12.2f}",
                  flush=True)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="state size (MiB)")
    parser.add_argument("--sizes", type=lambda s: [int(float(x) * KIB) for x in s.split(",")],
                        default=[4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB], help="buffer sizes in KiB, comma-separated")
    parser.add_argument("--level", type=int, default=1, help="zlib level")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the file is written (a real disk, not tmpfs)")
    parser.add_argument("--overhead-mib", type=int, default=512, help="state size for the overhead part (MiB)")
    parser.add_argument("--parts", default="sweep,overhead")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    data = state(args.mib) if "sweep" in parts else memoryview(b"")
    directory = Path(tempfile.mkdtemp(prefix="pipeline-bench-", dir=args.dir))
    try:
        if "sweep" in parts:
            sweep(args, data, directory)
        if "overhead" in parts:
            overhead(args)
    finally:
        shutil.rmtree(directory)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
