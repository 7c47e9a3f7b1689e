"""Compressed blocks (format ``GANGDCK3``, issue 18): blocks compressed in units, written by a pipeline, read back bounded.

Why units and not blocks: a codec call costs tens of microseconds whatever
its size (blosc2 builds a context per call), so compressing the block
format's 16 KiB blocks one by one ran at a third of the speed of 1 MiB calls
(``bench/codecs.py``). A *unit* is a run of consecutive stored blocks of one
value, cut every :func:`per_unit` blocks (about :data:`UNIT` bytes): the
layout follows from the file's block map and the unit size its index
records, so the index adds only, per unit, the codec it was stored with (an
index into the file's small table of codec identities, ``zstd:3@1``) and its
stored length. Signatures stay over the raw blocks: the delta logic,
hashing and chains do not know about compression, and every decompressed
block is checked against its signature by :func:`.blocks.read_chain` -- the
check that catches a corrupted compressed unit, since blosc2 decodes many
flipped bytes into wrong bytes without an error.

Why a pipeline: compressing and then writing costs the sum of the two;
compressing on one thread while another writes the previous units costs
about the longer one (paper 004). :func:`stream` runs
:class:`gangd.pipeline.Pipeline` with a compress stage and a write stage
(aggregated 4 MiB writes, hashed for the manifest's checksum as they go, the
disk started on them as they are written). The compress stage is parallel
(``Settings.workers`` threads, by default the cores less the write stage's,
1 to 4): with one thread, compression runs at one core's codec speed, on a
fast disk slower than it takes raw bytes; on 2 cores one worker beside the
writer is still the fastest (two wait for the cores). The units still reach the writer in file order (the pipeline
hands on in order), and each worker records its unit's codec by the unit's
number, so the index does not depend on which worker finished first.
Restores mirror it: read (and the file's checksum, in file order, in the
reading thread), then a parallel decompress stage. The codecs and the pipeline are
imported only when a codec other than ``none`` is used: an uncompressed
checkpoint keeps its direct, tuned write path (``GANGDCK2``, unchanged).

Every length read back is hostile: a unit's stored length is between 1 and
its raw length (exactly its raw length when stored raw), and a decoder fills
exactly the unit's raw bytes (:func:`gangd.codecs.decode`), never what the
compressed data claims.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..ckptstore import StoreError

UNIT = 1 << 20  # raw bytes compressed as one unit (at least one block)
MAX_CODECS = 64  # identities one file's table holds
KICK = 4 << 20  # bytes: the disk is started on the written units every this many (as blocks.KICK)
RAW = "none@1"


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1)
    starts = idx[np.concatenate(([0], breaks + 1))]
    ends = idx[np.concatenate((breaks, [len(idx) - 1]))] + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def per_unit(block: int) -> int:
    """Blocks of ``block`` bytes in one unit."""
    return max(1, UNIT // block)


def cut(present: np.ndarray, per: int) -> list[tuple[int, int]]:
    """The units of a value: [a, b) block ranges, each run of stored blocks cut every ``per`` blocks."""
    return [(s, min(s + per, b)) for a, b in runs(present) for s in range(a, b, per)]


def raw_length(a: int, b: int, block: int, nbytes: int) -> int:
    """Raw bytes of blocks [a, b) of a value of ``nbytes`` (its last block may be short)."""
    return min(b * block, nbytes) - a * block


def choose(spec: Any, data: memoryview, dtype: np.dtype | None) -> tuple[Any, int]:
    """The codec a value is stored with (``auto`` decides from a sample) and the item size its filters use."""
    from .. import codecs

    if spec.auto:
        from ..codecs import auto

        return codecs.choose(data, dtype), auto.candidate(dtype)[1]
    itemsize = 1 if dtype is None or dtype.itemsize > 255 or dtype.itemsize < 1 else dtype.itemsize
    return spec, itemsize


# ====================================================================== writing


@dataclass
class Written:
    """What :func:`stream` wrote: the codec table, per unit its codec's number and stored length, the stages' figures."""

    codecs: list[str] = field(default_factory=list)
    unit_codec: list[int] = field(default_factory=list)
    unit_len: list[int] = field(default_factory=list)
    written: int = 0
    raw: int = 0
    stages: dict = field(default_factory=dict)


def settings_of(text: object) -> Any:
    """The :class:`gangd.pipeline.Settings` a job's settings text names (``GANGD_CKPT_PIPELINE``,
    canonical), or None for "" (the defaults: gangd.pipeline is then not imported for it)."""
    if not text:
        return None
    from ..pipeline.settings import from_text

    return from_text(text)


def stream(path: Path, todo: Sequence[tuple[memoryview, Any, int]], settings: Any = None,
           hash_unit: Callable[[int, memoryview], None] | None = None) -> tuple[Any, Written]:
    """A chunk for :func:`gangd.ckptstore.write_atomic` that compresses and writes the units ``todo``
    ((raw bytes, codec spec, item size) each, in file order) through a pipeline, and what it wrote
    (filled in when the chunk has run). ``hash_unit(number, raw bytes)``: hashes each unit's blocks
    for the signature (a full's), called by the compress workers before they compress the unit (a
    stage of its own cost a ring and hand-offs, and ran on one thread: bench/pipeline.py section 1,
    x1 0.29-0.31 s against 0.32-0.33 s, alternating runs at load 1.5-2.5). A failing stage aborts
    the write: a full disk is the OSError :func:`~gangd.ckptstore.write_atomic` reports with the
    path, a codec's failure a StoreError."""
    from .. import ckptstore, pipeline
    from ..codecs import CodecError, encode

    done = Written(raw=sum(len(view) for view, _, _ in todo))

    class HashingWrite(pipeline.Write):
        """Writes whole buffers at the fd's position, hashing them (the manifest's checksum) and starting the
        disk on them; or hands them to an appender writing around the page cache (nothing to start then)."""

        def __init__(self, fd: int, digest: Any, at: int, appender: Any):
            super().__init__(fd, offset=None, sink=None if appender is None else appender.write)
            self.digest, self.at, self.kicked = digest, at, 0

        def process_slot(self, slot: Any, out: Any) -> None:
            if self.digest is not None:
                self.digest.update(slot.view[: slot.used])
            super().process_slot(slot, out)
            end = self.result.end
            if self.sink is None and end - self.kicked >= KICK:
                ckptstore.start_writeback(self.fd, self.at + self.kicked, end - self.kicked)
                self.kicked = end

    def run(fd: int, digest: Any, appender: Any = None) -> tuple[int, list]:
        table: dict[str, int] = {}
        numbering = threading.Lock()
        done.unit_codec = [0] * len(todo)

        def compress(key: Any, data: memoryview) -> memoryview:  # (run by several workers at once: see the docstring)
            _, spec, itemsize = todo[key]
            if hash_unit is not None:
                hash_unit(key, data)
            ident, packed = encode(spec, data, itemsize)
            text = str(ident)
            with numbering:
                number = table.setdefault(text, len(table))
            if number >= MAX_CODECS:
                raise CodecError(text, f"a checkpoint file records at most {MAX_CODECS} codecs")
            done.unit_codec[key] = number
            return packed

        writer = HashingWrite(fd, digest, os.lseek(fd, 0, os.SEEK_CUR), appender)
        try:
            stages: list = [pipeline.Transform("compress", compress, parallel=True), writer]
            with pipeline.Pipeline(stages, settings, name="ckpt-write") as pipe:
                for key, (view, _, _) in enumerate(todo):
                    pipe.submit(key, view)
                landing = pipe.finish()
        except pipeline.PipelineError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError):
                raise cause from None  # (write_atomic says "no space left on device writing PATH" and removes the file)
            raise StoreError(f"cannot write {path}: {cause if cause is not None else exc}") from None
        entries = landing.entries  # type: ignore[attr-defined]  # (the write stage's Landing)
        if len(entries) != len(todo):
            raise StoreError(f"cannot write {path}: the pipeline wrote {len(entries)} of {len(todo)} units")
        done.unit_len = [length for _, _, length in entries]
        done.codecs = sorted(table, key=table.__getitem__)
        done.written = landing.size  # type: ignore[attr-defined]
        done.stages = {s.name: {k: round(v, 6) if isinstance(v, float) else v for k, v in s.as_dict().items() if k != "name"}
                       for s in pipe.stats()}  # (per stage: bytes and items in and out, wall, idle, busy and CPU seconds)
        return done.written, []

    return run, done


# ====================================================================== reading


@dataclass(frozen=True)
class Job:
    """One stored unit a restore reads: blocks [a, b) of value ``name``, ``stored`` bytes at ``at``,
    decoded into ``view`` (the value's bytes) where ``want`` (per block of the unit) says."""

    name: str
    a: int
    b: int
    at: int
    stored: int
    ident: str
    view: memoryview
    want: np.ndarray
    block: int
    raw: int


def jobs(name: str, codecs: Sequence[str], cuts: Sequence[tuple[int, int]], lengths: np.ndarray, unit_codec: np.ndarray,
         offset: int, view: memoryview, need: np.ndarray, block: int, nbytes: int) -> list[Job]:
    """The units of one value that hold a block in ``need``, in file order."""
    out: list[Job] = []
    at = offset
    for (a, b), stored, number in zip(cuts, lengths.tolist(), unit_codec.tolist(), strict=True):
        here, at = at, at + stored
        want = need[a:b]
        if want.any():
            out.append(Job(name, a, b, here, stored, codecs[number], view, want, block, raw_length(a, b, block, nbytes)))
    return out


PIPELINED = 4 << 20  # stored bytes from which a file's units are read and decompressed by two threads (a pipeline)


def place(fd: int, path: Path, todo: Sequence[Job], digest: Any, settings: Any = None) -> int:
    """Read the units ``todo`` (in file order), decompress them and place their wanted blocks; returns the bytes read.

    Reading and decompressing overlap (a :class:`gangd.pipeline.ReadRanges`
    source and a decompress stage) once there is enough to overlap. A unit of
    which only some blocks are wanted (newer files placed the others) is
    decompressed aside and only those copied. ``digest``: the whole file's
    checksum, when this is the file the manifest names (every unit is then
    read, in file order). A codec's error is a StoreError naming the file, the
    value and the blocks; a codec this machine lacks is the
    :class:`gangd.codecs.CodecMissing` saying how to install it.
    """
    from ..codecs import CodecError, CodecMissing, decode

    def decompress(key: Any, data: memoryview) -> None:  # (run by several workers at once: each fills its own unit's bytes)
        job = todo[key]
        if len(data) != job.stored:
            raise StoreError(f"{path} is truncated: unit at {job.at} of value {job.name!r} reads {len(data)} of {job.stored} bytes")
        whole = bool(job.want.all())
        start = job.a * job.block
        out = job.view[start : start + job.raw] if whole else memoryview(bytearray(job.raw))
        try:
            decode(job.ident, data, out)
        except CodecMissing:
            raise
        except CodecError as exc:
            raise StoreError(f"{path} is corrupted: blocks {job.a}..{job.b - 1} of value {job.name!r} do not decompress ({exc})") from None
        if not whole:
            for s, e in runs(job.want):
                lo, hi = s * job.block, min(e * job.block, job.raw)
                job.view[start + lo : start + hi] = out[lo:hi]

    total = sum(job.stored for job in todo)
    if total < PIPELINED or len(todo) < 2:
        for key, job in enumerate(todo):
            data = bytearray(job.stored)
            pread(fd, memoryview(data), job.at, path)
            if digest is not None:
                digest.update(data)
            decompress(key, memoryview(data))
        return total
    from .. import pipeline

    class DigestedRead(pipeline.ReadRanges):
        """Reads the units in file order and adds each to the file's checksum as it is read (the order the
        checksum needs, which the parallel decompress stage after it does not keep while it works)."""

        def _read_into(self, view: memoryview, offset: int, key: Any) -> None:
            super()._read_into(view, offset, key)
            if digest is not None:
                digest.update(view)

    try:
        with pipeline.Pipeline([DigestedRead(fd, [(key, job.at, job.stored) for key, job in enumerate(todo)]),
                                pipeline.Transform("decompress", decompress, parallel=True)], settings, name="ckpt-read") as pipe:
            pipe.finish()
    except pipeline.PipelineError as exc:
        cause = exc.__cause__
        if isinstance(cause, StoreError | CodecMissing):
            raise cause from None
        if isinstance(cause, OSError):
            raise StoreError(f"cannot read {path}: {cause.strerror or cause}") from None
        raise StoreError(f"{path} is truncated or corrupted: {cause if cause is not None else exc}") from None
    return total


def pread(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill ``view`` from ``offset`` of ``fd``; a StoreError naming ``path`` if it ends first."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from None
        if not n:
            raise StoreError(f"{path} is truncated (ends before byte {offset + len(view)})")
        done += n
