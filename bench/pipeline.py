"""Compressed checkpoints through the pipeline (issue 18, paper 004's evaluation) against raw, in one run.

Paper 004 (PCCR) pipelines compress and write so a checkpoint costs about
its longest stage instead of their sum, and argues that compression pays
where the disk is the bottleneck (many nodes sharing it). Each section below
is measured in the same run, its variants alternating round by round (the
median of ``--rounds`` printed), and printed as ratios against a baseline of
the same run: on a shared 2-core machine the MB/s move with the other jobs,
the ratios much less. The load average is printed with each section.

Every checkpoint is an inline full, durable generation (fsync, rename) of
one rank's state written by :func:`gangd.ckptlib.blocks.save_generation`
(``none``: the raw format-2 path; a codec: format 3, units compressed by
``Settings.workers`` threads and written in order in 4 MiB aggregated
writes; both around the page cache, :mod:`gangd.directio`, unless
``GANGD_CKPT_DIRECT=0`` is in this bench's environment), run in a child process of this one
(forked: the state is shared copy-on-write, and the child can be put into a
throttling cgroup). States (``--mib`` MiB per rank):

* ``smooth``: the ../shared/peers ring job's float64 field,
  ``sin(40x) + 0.01 * noise`` (the noise leaves little to compress: ~1.2x);
* ``counters``: int64 indices that grow slowly (a mesh's connectivity, a
  particle's cell): very compressible;
* ``random``: incompressible bytes (``auto`` must store them raw).

Sections:

1. **pipeline vs serial**: total time against the pipeline's longest stage
   (busy time of compress -- with a full's hashing -- and write; target <= 1.1x; also with the
   write stage's time counted to durable: plus the fsync, index and rename
   that follow the pipeline) and against
   compressing every unit first and writing after (``serial``; target >= 30 %
   faster when the compress and write stages are within 2x of each other),
   with ``--workers`` and with one compress worker; restore time, checked
   bit-identical.
2. **buffer size** (004's U-curve): total time against the ring buffer size
   and the aggregated write size, 4 KiB -> 16 MiB, as a ratio to the best.
3. **contention**: 1, 2 and 4 writers (``--mib`` / 4 MiB each, so the
   4-writer case writes ``--mib`` in all; each a node's rank) started together on this machine's one disk, compressed against raw:
   the time until the last is durable.
4. **effective bandwidth** (state bytes per second of total time) of
   compressed against raw, on compressible and on incompressible data, on
   the disk as it is and, with ``--throttle MBPS`` (root), through a disk
   throttled to that many MB/s: a cgroup-v1 ``blkio.throttle.write_bps_device``
   on the device of ``--dir``, which the children join. Writeback the
   children start (the writer's ``sync_file_range`` kicks, the ``fsync``) is
   throttled; writeback the kernel's flusher would start on its own is not
   (it does not, within a few seconds, at the default dirty expiry of 30 s),
   so this models a node whose disk takes only that many MB/s.
5. **background** (``--background``): the same through the forked snapshot
   (:func:`gangd.ckptlib.writer.write`): time to durable against raw
   background and raw inline, and the milliseconds the job was blocked.

    python bench/pipeline.py [--mib 128] [--rounds 3] [--codec blosc2:lz4:1:bytedelta] [--workers 2]
                             [--sections 1,2,3,4,5] [--throttle 50] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from gangd import ckptstore
from gangd.ckptlib import blocks, units, writer
from gangd.ckptlib.core import DeltaSettings
from gangd.codecs import CodecSpec, encode
from gangd.pipeline import Settings

MIB = 1 << 20


def smooth(mib: int) -> np.ndarray:
    n = (mib << 20) // 8
    x = np.linspace(0, 1, n)
    return np.sin(40 * x) + 0.01 * np.random.default_rng(0).standard_normal(n)


def counters(mib: int) -> np.ndarray:
    n = (mib << 20) // 8
    return (np.arange(n, dtype=np.int64) // 7) + np.random.default_rng(1).integers(0, 3, n)


def random_bytes(mib: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(2).bytes(mib << 20), dtype=np.uint8)


STATES: dict[str, Callable[[int], np.ndarray]] = {"smooth": smooth, "counters": counters, "random": random_bytes}


# ====================================================================== one checkpoint


def save(path: Path, values: dict, codec: str | None, settings: Settings | None = None, background: bool = False) -> dict:
    """One full, durable generation; {"total", "longest", "size", "stored", "stages", ["blocked"]}."""
    began = time.perf_counter()
    if background:  # the forked snapshot writes (ckptlib's default): the job is blocked only for the fork
        plan = DeltaSettings.from_options(mode="full", codec=codec or "none").plan(1, [])
        written = writer.write(path, values, 0, background=True, delta=plan)
        blocked = time.perf_counter() - began
        result = written.wait()
        assert "error" not in result, result
        result["blocked"] = blocked
    else:
        result = blocks.save_generation(path, values, gen=1, mode="full", codec=None if codec is None else CodecSpec.parse(codec),
                                        pipeline=settings)
    result["total"] = time.perf_counter() - began
    stages = result.get("pipeline", {}).get("stages", {})
    result["stages"] = stages
    result["longest"] = max((s["busy_s"] for name, s in stages.items() if name != "submit"), default=result["total"])
    # The write stage hands its bytes to the page cache; the fsync after the pipeline (with the index and the
    # rename) is the rest of getting them to disk, which paper 004's write stage includes: "write+sync".
    after = result["total"] - max((s["wall_s"] for s in stages.values()), default=result["total"])
    result["longest_sync"] = max([result["total"] if not stages else 0.0]
                                 + [s["busy_s"] + (after if name == "write" else 0.0) for name, s in stages.items() if name != "submit"])
    result["stored"] = result.get("stored", result["size"])
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
    return {"size": size, "stored": size, "total": done - began, "compress": compressed - began, "write": done - compressed,
            "longest": max(compressed - began, done - compressed), "longest_sync": max(compressed - began, done - compressed)}


# ====================================================================== children, a throttled disk


class Throttle:
    """A cgroup-v1 blkio group limiting writes to ``device`` to ``bps``; children join it (None: no throttle)."""

    def __init__(self, directory: Path, mbps: float | None):
        self.tasks: Path | None = None
        self.group: Path | None = None
        if not mbps:
            return
        root = Path("/sys/fs/cgroup/blkio")
        if os.geteuid() != 0 or not (root / "blkio.throttle.write_bps_device").exists():
            raise SystemExit("--throttle needs root and a cgroup-v1 blkio hierarchy at /sys/fs/cgroup/blkio")
        dev = os.stat(directory).st_dev
        self.group = root / f"gangd-bench-pipeline-{os.getpid()}"
        self.group.mkdir()
        (self.group / "blkio.throttle.write_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} {int(mbps * 1e6)}\n")
        self.tasks = self.group / "tasks"

    def join(self) -> None:
        if self.tasks is not None:
            self.tasks.write_text(f"{os.getpid()}\n")

    def remove(self) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                self.group.rmdir()


def in_children(count: int, run: Callable[[int], dict], throttle: Throttle | None = None) -> tuple[float, list[dict]]:
    """Run ``run(i)`` in ``count`` forked children started together; (seconds until the last finished, their results)."""
    go_r, go_w = os.pipe()
    children = []
    for i in range(count):
        back_r, back_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(back_r)
                if throttle is not None:
                    throttle.join()
                os.read(go_r, 1)
                out = run(i)
            except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises it
                out, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
            with os.fdopen(back_w, "wb") as f:
                f.write(pickle.dumps(out))
            os._exit(code)
        os.close(back_w)
        children.append((pid, back_r))
    time.sleep(0.05)  # (every child at its read)
    began = time.perf_counter()
    os.write(go_w, b"x" * count)
    results = []
    for pid, back_r in children:
        with os.fdopen(back_r, "rb") as f:
            results.append(pickle.loads(f.read()))  # noqa: S301 -- our own children
        os.waitpid(pid, 0)
    elapsed = time.perf_counter() - began
    os.close(go_r)
    os.close(go_w)
    for r in results:
        if "error" in r:
            raise RuntimeError(r["error"])
    return elapsed, results


def rounds(n: int, variants: dict[str, Callable[[], dict]]) -> dict[str, list[dict]]:
    """``n`` rounds of every variant, alternating, after one warm-up round (not counted)."""
    out: dict[str, list[dict]] = {name: [] for name in variants}
    for run in variants.values():
        run()
    for _ in range(n):
        for name, run in variants.items():
            out[name].append(run())
    return out


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# ====================================================================== sections


def one(where: Path, values: dict, codec: str | None, settings: Settings | None = None, background: bool = False,
        throttle: Throttle | None = None, restore: bool = False) -> dict:
    """One checkpoint in a child (optionally throttled); the file removed after, restored and checked first if asked."""
    path = where / "rank-0.state"

    def run(_: int) -> dict:
        row = save(path, values, codec, settings, background)
        if restore:
            began = time.perf_counter()
            restored = blocks.read_chain(path, (), (row["size"], row["digest"]))[0]
            row["restore"] = time.perf_counter() - began
            assert all(restored[k].tobytes() == v.tobytes() for k, v in values.items())
        return {k: v for k, v in row.items() if k in ("total", "longest", "longest_sync", "size", "stored", "stages", "blocked", "restore")}

    try:
        return in_children(1, run, throttle)[1][0]
    finally:
        path.unlink(missing_ok=True)


def section_pipeline(args, where: Path, workers: int) -> None:
    values = {"u": smooth(args.mib)}
    state = values["u"].nbytes
    path = where / "rank-0.state"

    def serial_child() -> dict:
        try:
            return in_children(1, lambda _: serial(path, values, args.codec))[1][0]
        finally:
            path.unlink(missing_ok=True)

    variants = {"none": lambda: one(where, values, None, restore=True),
                f"{args.codec} x{workers}": lambda: one(where, values, args.codec, Settings(workers=workers), restore=True),
                f"{args.codec} x1": lambda: one(where, values, args.codec, Settings(workers=1), restore=True),
                f"serial {args.codec}": serial_child}
    print(f"\n1. pipeline vs serial: {args.mib} MiB smooth float64, inline, {args.rounds} rounds, medians ({load()})")
    got = rounds(args.rounds, variants)
    base = med(got["none"], "total")
    print(f"   {'variant':36} {'total s':>8} {'longest':>8} {'tot/long':>8} {'+sync':>6} {'tot/long':>8} {'ratio':>6} {'x none':>7} {'restore s':>9}")
    for name, rows in got.items():
        total, longest, synced = med(rows, "total"), med(rows, "longest"), med(rows, "longest_sync")
        restore = f"{med(rows, 'restore'):9.2f}" if "restore" in rows[0] else f"{'-':>9}"
        print(f"   {name:36} {total:8.2f} {longest:8.2f} {total / longest:8.2f} {synced:6.2f} {total / synced:8.2f} "
              f"{state / med(rows, 'stored'):6.2f} {base / total:7.2f} {restore}")
    print("   (longest: the busiest stage; +sync: the write stage's busy time plus the fsync, index and rename after the pipeline)")
    for name in (f"{args.codec} x{workers}", f"{args.codec} x1"):
        rows = got[name]
        stages = {s: statistics.median(r["stages"][s]["busy_s"] for r in rows) for s in rows[0]["stages"] if s != "submit"}
        cpu = {s: statistics.median(r["stages"][s]["cpu_s"] for r in rows) for s in rows[0]["stages"]}
        print(f"   {name}: stage busy s " + ", ".join(f"{s} {v:.2f}" for s, v in stages.items())
              + "; CPU s " + ", ".join(f"{s} {v:.2f}" for s, v in cpu.items()))
    ser = got[f"serial {args.codec}"]
    comp, wr = med(ser, "compress"), med(ser, "write")
    mine = med(got[f"{args.codec} x{workers}"], "total")
    print(f"   serial: compress {comp:.2f} s, write {wr:.2f} s (within 2x of each other: {'yes' if max(comp, wr) <= 2 * min(comp, wr) else 'no'}); "
          f"pipelined x{workers} {mine:.2f} s vs compress-then-write {med(ser, 'total'):.2f} s: "
          f"{100 * (1 - mine / med(ser, 'total')):.0f} % faster ({load()})")


def section_curve(args, where: Path, workers: int) -> None:
    values = {"u": smooth(args.mib)}
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    variants = {f"{s >> 10:>6} KiB": (lambda s=s: one(where, values, args.codec, Settings(buffer_size=s, aggregate_bytes=s, workers=workers)))
                for s in sizes}
    print(f"\n2. buffer size (ring buffers and aggregated writes both that size): {args.codec} x{workers}, {args.mib} MiB smooth, "
          f"{args.rounds} rounds ({load()})")
    got = rounds(args.rounds, variants)
    best = min(med(rows, "total") for rows in got.values())
    for name, rows in got.items():
        total = med(rows, "total")
        print(f"   {name}: {total:6.2f} s  {total / best:5.2f}x the best")
    print(f"   ({load()})")


def section_contention(args, where: Path, workers: int, throttle: Throttle | None) -> None:
    per = max(1, args.mib // 4)
    values = {"u": smooth(per)}
    print(f"\n3. contention: 1, 2, 4 writers on this machine's one disk, {per} MiB smooth each, {args.codec} x{workers} vs none"
          f"{' (throttled disk)' if throttle and throttle.tasks else ''}, {args.rounds} rounds ({load()})")

    def many(n: int, codec: str | None) -> Callable[[], dict]:
        def run() -> dict:
            def child(i: int) -> dict:
                path = where / f"rank-{i}.state"
                try:
                    return save(path, values, codec, Settings(workers=workers))
                finally:
                    path.unlink(missing_ok=True)
            elapsed, rows = in_children(n, child, throttle)
            return {"total": elapsed, "stored": sum(r["stored"] for r in rows)}
        return run

    variants = {f"{n} {name}": many(n, codec) for n in (1, 2, 4) for name, codec in (("none", None), ("codec", args.codec))}
    got = rounds(args.rounds, variants)
    for n in (1, 2, 4):
        raw, packed = med(got[f"{n} none"], "total"), med(got[f"{n} codec"], "total")
        print(f"   {n} writer{'s' if n > 1 else ' '}: none {raw:6.2f} s, {args.codec} {packed:6.2f} s: compressed/raw time {packed / raw:5.2f} "
              f"(effective bandwidth x{raw / packed:.2f})")
    print(f"   ({load()})")


def section_bandwidth(args, where: Path, workers: int, throttle: Throttle | None) -> None:
    print(f"\n4. effective bandwidth (state bytes / total time) against raw, {args.mib} MiB, {args.rounds} rounds ({load()})")
    disks = [("disk as it is", None)] + ([(f"disk throttled to {args.throttle:g} MB/s", throttle)] if throttle and throttle.tasks else [])
    for label, thr in disks:
        for kind, codec in (("smooth", args.codec), ("counters", args.codec), ("random", "auto")):
            values = {"u": STATES[kind](args.mib)}
            got = rounds(args.rounds, {"none": lambda v=values, t=thr: one(where, v, None, throttle=t),
                                       codec: lambda v=values, c=codec, t=thr: one(where, v, c, Settings(workers=workers), throttle=t)})
            raw, packed = med(got["none"], "total"), med(got[codec], "total")
            state = values["u"].nbytes
            print(f"   {label:30} {kind:9} {codec:26} ratio {state / med(got[codec], 'stored'):5.2f}: none {state / raw / 1e6:6.0f} MB/s, "
                  f"compressed {state / packed / 1e6:6.0f} MB/s: x{raw / packed:.2f} ({load()})")


def section_background(args, where: Path, workers: int) -> None:
    values = {"u": smooth(args.mib)}
    state = values["u"].nbytes
    print(f"\n5. background (forked snapshot) vs inline, {args.mib} MiB smooth, {args.rounds} rounds ({load()})")
    got = rounds(args.rounds, {"inline none": lambda: one(where, values, None),
                               "background none": lambda: one(where, values, None, background=True),
                               f"background {args.codec}": lambda: one(where, values, args.codec, background=True)})
    raw = med(got["inline none"], "total")
    for name, rows in got.items():
        total = med(rows, "total")
        blocked = f", the job blocked {1000 * med(rows, 'blocked'):.1f} ms" if "blocked" in rows[0] else ""
        print(f"   {name:36} {total:6.2f} s to durable, {state / total / 1e6:6.0f} MB/s, x{raw / total:.2f} of inline raw{blocked}")
    print(f"   ({load()})")


@contextlib.contextmanager
def workdir(parent: str | None) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="gangd-bench-pipeline-", dir=parent or "."))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="state per rank (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codec", default="blosc2:lz4:1:bytedelta")
    ap.add_argument("--workers", type=int, default=Settings().workers, help="compress workers (default: the cores less one, 1 to 4)")
    ap.add_argument("--sections", default="1,2,3,4", help="which of 1..5 to run (5: background)")
    ap.add_argument("--background", action="store_true", help="also section 5 (the forked snapshot)")
    ap.add_argument("--throttle", type=float, default=None, help="MB/s: also measure sections 3 and 4 on a disk throttled to this (root)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on the disk of the working directory)")
    args = ap.parse_args()
    sections = {int(s) for s in args.sections.split(",") if s} | ({5} if args.background else set())
    print(f"gangd bench/pipeline.py: {os.cpu_count()} CPUs, {args.workers} compress workers, {load()}")
    with workdir(args.dir) as where:
        for codec in (args.codec, "auto"):  # the codecs' libraries loaded here, as in a job after its first checkpoint
            for kind in ("smooth", "counters", "random"):
                save(where / "warm", {"u": STATES[kind](4)}, codec)
                (where / "warm").unlink()
        throttle = Throttle(where, args.throttle)
        try:
            if 1 in sections:
                section_pipeline(args, where, args.workers)
            if 2 in sections:
                section_curve(args, where, args.workers)
            if 3 in sections:
                section_contention(args, where, args.workers, None)
                if throttle.tasks:
                    section_contention(args, where, args.workers, throttle)
            if 4 in sections:
                section_bandwidth(args, where, args.workers, throttle)
            if 5 in sections:
                section_background(args, where, args.workers)
        finally:
            throttle.remove()
    print(f"\n{load()}")


if __name__ == "__main__":
    main()
