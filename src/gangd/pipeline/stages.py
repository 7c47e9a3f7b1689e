"""The stages a checkpoint needs: transform (compress, decompress, hash-and-drop), write, read, place.

Both directions of issue 18 are built from these:

* write:   ``submit`` (the snapshot's blocks) -> :class:`Transform` (compress;
  a transform returning None drops the item, e.g. an unchanged block) ->
  :class:`Write` (whole ``aggregate_bytes`` buffers, one ``pwrite`` each;
  ``result`` says where each item landed).
* restart: :class:`ReadRanges` (file ranges into buffers, no copy) ->
  :class:`Transform` (decompress) -> :class:`Place` (each item's bytes into
  the target array at the offset it was given, every length checked).

Nothing here opens a path: stages get file descriptors the caller opened
(``gangd.safefs`` for anything root touches), and every length read from a
file is checked against what the caller expected before it is trusted.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Hashable, Iterable, Mapping

from .emit import Packer
from .engine import Source, Stage
from .ring import Slot
from .settings import MAX_RING_BYTES

#: The largest range :class:`ReadRanges` reads as one item (into a buffer of its own): a ring's
#: whole pool. The file's size does not bound a range: a user's file can be sparse, terabytes
#: of holes that cost its owner nothing, and reading a range allocates all of it.
MAX_ITEM = MAX_RING_BYTES


class Transform(Stage):
    """``fn(key, data)`` -> a bytes-like item, or None to drop it; with ``many=True``, an iterable of (key, bytes-like).

    ``parallel=True``: ``fn`` is thread-safe and worth several threads (a
    codec that releases the GIL); it is then called by ``Settings.workers``
    threads at once, and its results still go on in order.
    """

    def __init__(self, name: str, fn: Callable[[Hashable, memoryview], object], *, many: bool = False, parallel: bool = False):
        super().__init__(name)
        self.fn, self.many, self.parallel = fn, many, parallel

    def work_slot(self, slot: Slot) -> object:
        fn, view = self.fn, slot.view
        return [fn(key, ref if ref is not None else view[start:start + length]) for key, start, length, _, _, ref in slot.records]

    def hand_on(self, slot: Slot, work: object, out: Packer | None) -> None:
        size = 0
        for record, produced in zip(slot.records, work, strict=True):  # type: ignore[call-overload]  # work_slot's list
            size += record[2]
            if out is None or produced is None:
                continue
            if self.many:
                for new_key, item in produced:
                    out.emit(new_key, item)
            else:
                out.emit(record[0], produced)
        self.stats.items_in += len(slot.records)
        self.stats.bytes_in += size

    def process_slot(self, slot: Slot, out: Packer | None) -> None:
        # Stage.process_slot inlined: this loop runs once per item.
        fn, many, view = self.fn, self.many, slot.view
        items = size = 0
        for key, start, length, _, _, ref in slot.records:
            items += 1
            size += length
            produced = fn(key, ref if ref is not None else view[start:start + length])
            if out is None or produced is None:
                continue
            if many:
                for new_key, item in produced:  # type: ignore[attr-defined]  # the contract of many=True
                    out.emit(new_key, item)
            else:
                out.emit(key, produced)
        self.stats.items_in += items
        self.stats.bytes_in += size

    def process(self, key: Hashable, data: memoryview, out: Packer | None) -> None:
        produced = self.fn(key, data)
        if out is None or produced is None:
            return
        if self.many:
            for new_key, item in produced:  # type: ignore[attr-defined]  # the contract of many=True
                out.emit(new_key, item)
        else:
            out.emit(key, produced)


class Landing:
    """Where a writer put each item: ``entries`` is [(key, offset, length)] in submission order."""

    def __init__(self, start: int):
        self.start = start
        self.end = start
        self.entries: list[tuple[Hashable, int, int]] = []
        self.writes = 0  # write calls issued (one per buffer, more only after a short write)

    @property
    def size(self) -> int:
        return self.end - self.start


class Write(Stage):
    """Writes whole buffers to ``fd`` from ``offset`` on, one ``pwrite`` per buffer.

    ``offset=None`` writes with ``write`` at the fd's position instead (a
    pipe or a socket); the landing offsets then count from 0.

    ``fsync=True`` syncs the file once the last buffer is written: a
    checkpoint generation is only complete once its bytes are on disk.

    ``sink``: each buffer is handed to it instead (it takes all of it, or
    raises): an appender writing around the page cache
    (:class:`gangd.directio.Appender`'s ``write``); ``offset`` then only
    says where the landing offsets count from.
    """

    whole_buffers = True

    def __init__(self, fd: int, *, offset: int | None = 0, fsync: bool = False, name: str = "write",
                 sink: Callable[[memoryview], None] | None = None):
        super().__init__(name)
        if fsync and sink is not None:
            raise ValueError("a write stage with a sink cannot fsync: the sink's owner syncs once it has written everything")
        self.fd, self.offset, self.fsync, self.sink = fd, offset, fsync, sink
        self.result: Landing = Landing(offset or 0)

    def process_slot(self, slot: Slot, out: Packer | None) -> None:
        landing = self.result
        base = landing.end
        view = slot.view[:slot.used]
        done = 0
        if self.sink is not None:
            self.sink(view)
            done = len(view)
            landing.writes += 1
        while done < len(view):
            if self.offset is None:
                n = os.write(self.fd, view[done:])
            else:
                n = os.pwrite(self.fd, view[done:], base + done)
            if n <= 0:  # a file system that accepts nothing without saying why: treat it as full
                raise OSError(errno.ENOSPC, "write accepted no bytes")
            done += n
            landing.writes += 1
        landing.end = base + done
        for key, start, length, part, total, _ in slot.records:
            if part == 0:
                landing.entries.append((key, base + start, total))
                self.stats.items_in += 1
            self.stats.bytes_in += length

    def close(self, out: Packer | None) -> None:
        if self.fsync:
            os.fsync(self.fd)


class ReadRanges(Source):
    """Reads ``(key, offset, length)`` ranges of ``fd`` into buffers, in the order given (the restart direction).

    Ranges up to a buffer's size are read in place into the ring's buffers
    (``preadv``: no copy); a larger range is read into a buffer of its own,
    passed on by reference. The ranges come from an index a user can
    write: a range past the end of the file (``fstat`` at the start) or
    longer than :data:`MAX_ITEM` (a sparse file is as long as its owner
    likes) is an error naming it before anything is allocated for it, and
    a file that shrinks meanwhile is an error too, never a short item.
    """

    def __init__(self, fd: int, ranges: Iterable[tuple[Hashable, int, int]], *, name: str = "read"):
        super().__init__(name)
        self.fd, self.ranges = fd, ranges

    def _read_into(self, view: memoryview, offset: int, key: Hashable) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"file ends at {offset + done} inside item {key!r} ({len(view)} bytes at {offset})")
            done += n

    def produce(self, out: Packer) -> None:
        capacity = out.ring.capacity
        size = os.fstat(self.fd).st_size
        for key, offset, length in self.ranges:
            if offset < 0 or length < 0:
                raise ValueError(f"item {key!r}: negative range ({offset}, {length})")
            if offset + length > size:
                raise ValueError(f"item {key!r} ({length} bytes at {offset}) lies past the end of the file ({size} bytes)")
            if length > MAX_ITEM:
                raise ValueError(f"item {key!r} ({length} bytes at {offset}) is larger than the {MAX_ITEM} bytes one item may be")
            self.stats.items_in += 1
            self.stats.bytes_in += length
            if length <= capacity:
                self._read_into(out.reserve(length), offset, key)
                out.commit(key, length)
            else:
                own = bytearray(length)
                self._read_into(memoryview(own), offset, key)
                out.emit(key, own)


class Place(Stage):
    """Copies each item into ``target`` at ``where[key] = (offset, length)``: the mirror of the writer's landing table.

    Items come from a file a user can write: an unknown key, a length other
    than the expected one, a range outside the target, an item placed twice
    or one never placed are all errors, so a restored array is either
    complete and exactly as recorded or the restart fails.
    """

    def __init__(self, target: memoryview, where: Mapping[Hashable, tuple[int, int]], *, name: str = "place"):
        super().__init__(name)
        self.target = target if target.format == "B" and target.ndim == 1 else target.cast("B")
        if self.target.readonly:
            raise ValueError("the target of a Place stage must be writable")
        self.where = where
        self.placed: set[Hashable] = set()
        self.placed_bytes = 0
        self.result = 0  # bytes placed, once the stream ended

    def process(self, key: Hashable, data: memoryview, out: Packer | None) -> None:
        if key not in self.where:
            raise ValueError(f"item {key!r} has no place in the target")
        if key in self.placed:
            raise ValueError(f"item {key!r} arrived twice")
        offset, length = self.where[key]
        if len(data) != length:
            raise ValueError(f"item {key!r} is {len(data)} bytes, {length} expected")
        if offset < 0 or offset + length > len(self.target):
            raise ValueError(f"item {key!r} ({length} bytes at {offset}) lies outside the target ({len(self.target)} bytes)")
        self.target[offset:offset + length] = data
        self.placed.add(key)
        self.placed_bytes += length

    def close(self, out: Packer | None) -> None:
        missing = len(self.where) - len(self.placed)
        if missing:
            raise ValueError(f"{missing} of {len(self.where)} items never arrived")
        self.result = self.placed_bytes
