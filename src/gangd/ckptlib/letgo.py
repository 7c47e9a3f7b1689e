"""A forked snapshot lets go of the job's pages as soon as it has copied them (issue 18).

Why: a background checkpoint is a fork of the job, and until the fork exits
every page of the job's state is shared by the two. The job's first write to
a shared page is a copy-on-write fault: a fault, a fresh page, a 4 KiB copy,
and a transparent huge page split into 512 small pages on the way. The
snapshot lives until its fsync returns, which on a disk-bound checkpoint is
most of its life (seconds for 256 MiB here), so a job that rewrites its
state each iteration (a stencil) paid for nearly every page. Measured on this
2-CPU machine, 256 MiB of float64 written whole after the fork: 0.20-0.23 s
of faults in the job per checkpoint, and the split pages made the *next*
checkpoint's fork copy 512 times more page table: 8-17 ms instead of 1 ms, in
the job's blocked time (the cost grew with every checkpoint until
khugepaged, which scans a few MiB a second, put the huge pages back).

The snapshot is done with the state long before it exits: once its file's
bytes are in the page cache (compressed or not), only the fsync is left. So
right there (:func:`gangd.ckptstore.write_atomic`'s ``after_copy``, after the
last chunk and before the fsync) it drops its own mapping of the protected
arrays' pages (``MADV_DONTNEED``, the whole pages inside each array). Each
page is then the job's alone: the job's next write to it is no copy at all
(the kernel reuses the page; a huge page stays whole), and the next fork is
cheap again. Measured the same way, with the snapshot letting go before the
job writes: 3 ms instead of 0.2 s, the huge pages intact, the next fork 0.8 ms.
Pages the job writes before the snapshot has let go are copied as before, so
a raw file's writer (nothing reads its buffers again once written) lets go
of each array's pages as it writes them (:class:`AsCopied`): the job,
resumed, then writes behind the snapshot rather than ahead of it (the same
bench: 44 ms instead of 60 ms, against 20 ms with no snapshot at all).

Why it is safe:

* ``MADV_DONTNEED`` on a private mapping discards only the calling process's
  view; the job's memory is untouched. On a shared mapping (a memfd, a
  file the program mapped) it drops this process's view of pages that stay
  in their object. It is called only in the forked snapshot
  (:func:`gangd.ckptlib.writer.write`'s child), never in the job.
* In the snapshot the pages read as zeros afterwards, so it is called only
  once nothing there reads the values again: after every chunk of the file
  is written, the late signature hashing and the compress stages included,
  and the snapshot only fsyncs, reports and exits after that.
* Only whole pages strictly inside one contiguous array's bytes are dropped:
  nothing of the allocator's bookkeeping or of another object shares them. A
  strided view (a column, a record's field, every other byte of a bytes
  object) spans bytes it does not cover, and a broadcast array's size counts
  bytes it does not have: both are left alone, as are arrays of Python
  objects (their pointers are what the snapshot's garbage collector would
  follow) and small arrays (nothing to gain).
* Anything it cannot do (a locked or huge-TLB mapping refusing the call, an
  array-like that cannot say where it is) is left: the pages then stay shared
  until the snapshot exits, as before, and the checkpoint, already written,
  does not fail for it.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
from collections.abc import Mapping

MIN_BYTES = 1 << 20  # arrays smaller than this are left to the exit
_PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # a transparent huge page (where a release that is not the array's last ends)


def _madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise() if sys.platform == "linux" else None


def let_go(values: Mapping[str, object]) -> int:
    """Drop this process's mapping of the whole pages inside each large array of ``values``.

    Call it only in a forked snapshot, once nothing in it reads ``values``
    again (see the module docstring). Best effort: whatever it cannot do, it
    leaves (the pages then stay shared until the snapshot exits). Returns the
    bytes let go."""
    np = sys.modules.get("numpy")
    if np is None or _MADVISE is None:
        return 0
    total = 0
    for value in values.values():
        try:
            run = _own_bytes(np, value)
            if run is None:
                continue
            start, end = -(-run[0] // _PAGE) * _PAGE, run[1] // _PAGE * _PAGE
            if end > start and _MADVISE(start, end - start, mmap.MADV_DONTNEED) == 0:
                total += end - start
        except Exception:  # noqa: BLE001,S112 -- a checkpoint already written must not fail for it
            continue
    return total


def _own_bytes(np, value: object) -> tuple[int, int] | None:
    """(first, one past the last) address of ``value``'s bytes if it is an array to let go of, else None.

    Only a large array of no Python objects whose bytes are one run of its own memory: a strided view's
    span holds bytes it does not cover (the other column, a record's other field, the rest of a bytes
    object), and a broadcast array's nbytes counts bytes it does not have."""
    if not isinstance(value, np.ndarray) or value.nbytes < MIN_BYTES or value.dtype.hasobject:
        return None
    if not (value.flags.c_contiguous or value.flags.f_contiguous):
        return None
    low = value.__array_interface__["data"][0]
    return low, low + value.nbytes


def _span(array) -> tuple[int, int]:
    """The first and one past the last byte address ``array`` touches (any strides)."""
    low = high = array.__array_interface__["data"][0]
    for extent, stride in zip(array.shape, array.strides, strict=True):
        if extent == 0:
            return low, low
        if stride < 0:
            low += stride * (extent - 1)
        else:
            high += stride * (extent - 1)
    return low, high + array.itemsize


class AsCopied:
    """Let go of each large array's pages as its bytes are written, not only once the whole file is.

    For a write whose buffers nothing reads again once written (the raw full
    file :func:`gangd.ckptlib.spc.write` writes: no late signature, no
    pipeline; :func:`gangd.ckptstore.write_chunks` refuses any other with
    it): called with each part of a buffer once written, in order
    (``write_chunks``' ``copied``). The sooner a page is let go, the fewer of
    the job's writes find it still shared: the job, resumed, writes behind
    the snapshot instead of ahead of it.

    An array whose memory overlaps any other value's (one array under two
    names, a view of another) is left for :func:`let_go` at the end: its
    bytes may be read again under the other name. Releases end on huge page
    boundaries but at the array's end, so that no huge page is left half
    mapped in the snapshot while the rest of it is still to be written.
    """

    def __init__(self, values: Mapping[str, object]):
        self._starts: list[int] = []
        self._arrays: list[list[int]] = []  # [low, high, released up to], by low
        np = sys.modules.get("numpy")
        if np is None or _MADVISE is None:
            return
        spans, mine = [], []
        for value in values.values():
            try:
                if isinstance(value, np.ndarray):
                    spans.append(_span(value))
                    run = _own_bytes(np, value)
                    if run is not None:
                        mine.append(run)
            except Exception:  # noqa: BLE001,S112 -- an array-like that cannot say where it is: not let go
                continue
        for low, high in sorted(mine):
            if sum(1 for a, b in spans if a < high and b > low) == 1:  # (itself only)
                self._starts.append(low)
                self._arrays.append([low, high, -(-low // _PAGE) * _PAGE])

    def __call__(self, part: memoryview) -> None:
        if not self._arrays or not len(part):
            return
        try:
            np = sys.modules["numpy"]
            address = np.frombuffer(part, dtype=np.uint8).__array_interface__["data"][0]
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return
            _, high, mark = self._arrays[i]
            end = address + len(part)
            if end > high:
                return
            upto = (high // _PAGE * _PAGE) if end == high else end // _HUGE * _HUGE
            if upto > mark and _MADVISE(mark, upto - mark, mmap.MADV_DONTNEED) == 0:  # type: ignore[misc]
                self._arrays[i][2] = upto
        except Exception:  # noqa: BLE001,S110 -- best effort: the pages then wait for let_go or the exit
            pass
