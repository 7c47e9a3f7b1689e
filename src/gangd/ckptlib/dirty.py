"""Which blocks of the protected arrays were written since a cut: hash only those (issue 17).

Why: an incremental checkpoint has to find what changed, and without the
kernel's help that means hashing every block -- at raw xxh3 speed, 22-30 ms
for 256 MiB, most of a checkpoint's time when 5 % of the blocks changed
(``bench/delta.py``). The kernel knows which pages were written since a
moment. CRIU's incremental dumps ask it through soft-dirty bits, which not
every kernel has (this machine's does not); this module asks through
userfaultfd's asynchronous write protection (``UFFD_FEATURE_WP_ASYNC``,
Linux 6.7) and the ``PAGEMAP_SCAN`` ioctl of ``/proc/self/pagemap``, the
interface made for exactly this (CRIU, Wine's write watches): at a cut each
tracked array's pages are write-protected; the first write to a page after
that faults once, the kernel lifts the protection itself (no handler thread,
the program never notices), and the page reads *written* until the next
cut's scan reports it and protects it again, in the same call.

At a cut, in the job before the snapshot is forked or the inline write
starts, :meth:`WriteWatch.cut` scans every tracked array and ORs the
written pages, as blocks, into a mask per recent cut ("written since
generation g"). The writing process (a forked snapshot inherits the masks)
asks :meth:`WriteWatch.unchanged` for a value's blocks not written since a
reference generation's cut, and copies their hashes from that generation's
signature instead of hashing them (:func:`gangd.ckptlib.blocks.save_generation`).
Only a generation this process cut can be such a reference; anything else --
the first generation after a restart, an array protected again at another
address, a scan that failed -- answers None, and every block is hashed as
before. A scan failing turns tracking off for that array.

What it costs, and when it is off (measured on the 2-CPU machine, a 256 MiB
array of which 5 % of the 16 KiB blocks are written between checkpoints,
medians of 6: the program's writes 1.3-1.6 ms slower (the faults), the scan
1.4-1.7 ms, the fork of the snapshot 4-5 ms instead of 1 ms (a written huge
page is split into small pages, more page table to copy); against ~25 ms of
hashing saved in the writing process, which on a cluster competes with the
ranks for their cores, and off the checkpoint's time):

* One minor fault per page per interval, in the job (~2 us). For an array
  written all over between two cuts that is more than hashing it (65 k
  faults for 256 MiB, ~0.1 s, against ~25 ms of hashing), so an array found
  at least :data:`DENSE` written is no longer tracked (hashed whole), and is
  tried again :data:`RETRY_AFTER` cuts later. Arrays under
  :data:`MIN_BYTES` are not tracked: hashing them costs microseconds.
* The scan runs in the job at the cut: ~1 ms for 3 000 written pages of a
  256 MiB array. It first only counts the written pages, so that an array
  found dense is let go without protecting its pages again (~18 ms for
  256 MiB of small pages: a write splits a huge page into small ones), and
  each time an array is found dense again it rests twice as long.
* Only private anonymous memory is tracked (what numpy allocates): the
  kernel registers any memory for asynchronous write protection, but only
  writes through this mapping fault, and shared memory another process
  writes, a memfd or file written with ``pwrite``, or the file under a
  private file mapping change an array without one. Arrays that share
  memory (one array under two names, a view of another) are not tracked
  either: each one's scan protects the pages again and would hide their
  writes from the other's.
* Writes the page tables do not see are not seen: a device writing into an
  array by DMA (an RDMA receive buffer registered with the NIC). Another
  thread of the program writing a protected array *during* a cut is not
  either (the scan comes before the fork), but that already makes the
  snapshot itself torn. ``GANGD_CKPT_WRITE_WATCH=off`` (the rank's
  environment) hashes every block.
* Not available (a kernel before 6.9 or 6.8.10, whose scan could read a
  swapped-out or migrating written page as unwritten; a seccomp filter refusing
  ``userfaultfd``, not Linux, not x86-64/aarch64): every block is hashed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .blocks import nblocks

#: Arrays smaller than this are hashed whole (a few microseconds).
MIN_BYTES = 256 << 10
#: The fraction of an array's pages written between two cuts at which tracking it costs more than hashing it.
DENSE = 0.5
#: Cuts after which an array found dense is tracked again (its writes may have become sparse).
RETRY_AFTER = 4
#: Recent cuts remembered per array: a reference generation older than this is hashed against whole.
HISTORY = 12
#: Page regions one PAGEMAP_SCAN call returns at most (24 bytes each).
VEC = 4096

_SYSCALLS = {"x86_64": 323, "aarch64": 282}  # __NR_userfaultfd
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1


def _ioc(direction: int, kind: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _ioc(3, _UFFD_API, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, _UFFD_API, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, _UFFD_API, 0x01, 16)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)


class _Kernel:
    """The two file descriptors and three calls this module needs. Raises OSError."""

    def __init__(self) -> None:
        number = _SYSCALLS.get(platform.machine())
        if number is None:
            raise OSError(0, f"no userfaultfd system call number known for {platform.machine()}")
        if not _scan_reads_swapped_pages(platform.release()):
            raise OSError(0, f"Linux {platform.release()}'s PAGEMAP_SCAN can report a written page that is swapped out "
                             "or migrating as unwritten (fixed in 6.9 and 6.8.10)")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
        fd = self.libc.syscall(ctypes.c_long(number), ctypes.c_int(os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        self.uffd = fd
        try:
            wanted = _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED
            api = (ctypes.c_uint64 * 3)(_UFFD_API, wanted, 0)
            self._ioctl(self.uffd, _UFFDIO_API, api, "UFFDIO_API")
            if api[1] & wanted != wanted:
                raise OSError(0, "the kernel has no asynchronous write protection (UFFD_FEATURE_WP_ASYNC)")
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.uffd)
            raise
        self.vec = np.zeros((VEC, 3), dtype=np.uint64)

    def _ioctl(self, fd: int, request: int, arg, what: str) -> int:
        got = self.libc.ioctl(fd, request, ctypes.cast(arg, ctypes.c_void_p))
        if got < 0:
            raise OSError(ctypes.get_errno(), what)
        return got

    def register(self, lo: int, hi: int) -> None:
        self._ioctl(self.uffd, _UFFDIO_REGISTER, (ctypes.c_uint64 * 4)(lo, hi - lo, _UFFDIO_REGISTER_MODE_WP, 0), "UFFDIO_REGISTER")

    def unregister(self, lo: int, hi: int) -> None:
        try:
            self._ioctl(self.uffd, _UFFDIO_UNREGISTER, (ctypes.c_uint64 * 2)(lo, hi - lo), "UFFDIO_UNREGISTER")
        except OSError:
            pass  # (the memory is gone already: nothing left to unregister)

    def close(self) -> None:
        """Close both descriptors (closing the userfaultfd unregisters every range)."""
        for fd in (self.pagemap, self.uffd):
            try:
                os.close(fd)
            except OSError:
                pass

    def written(self, lo: int, hi: int, *, protect: bool = True) -> np.ndarray:
        """The pages of [lo, hi) written since they were last protected, as
        (start, end) address rows; with ``protect``, protects them again (one
        call per :data:`VEC` regions)."""
        found = []
        start = lo
        flags = _PM_SCAN_CHECK_WPASYNC | (_PM_SCAN_WP_MATCHING if protect else 0)
        while start < hi:
            arg = (ctypes.c_uint64 * 12)(96, flags, start, hi, 0, self.vec.ctypes.data, VEC, 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN)
            count = self._ioctl(self.pagemap, _PAGEMAP_SCAN, arg, "PAGEMAP_SCAN")
            found.append(self.vec[:count, :2].copy())
            if count < VEC:
                break
            if arg[4] <= start:  # (walk_end did not move: never loop)
                raise OSError(0, "PAGEMAP_SCAN made no progress")
            start = arg[4]
        return np.concatenate(found) if found else np.zeros((0, 2), dtype=np.uint64)


def _scan_reads_swapped_pages(release: str) -> bool:
    """Whether this kernel's PAGEMAP_SCAN reads a page that is not present right.

    Before Linux commit 2c7ad9a590d1 (6.9; 6.8.10) the scan's fast path --
    the one a scan for written pages only takes -- read the write-protect
    bit of a swapped-out or migrating page's entry where a present page
    keeps it: on x86-64 a bit of the swap offset, so such a page written
    since the cut read unwritten about half the time."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", release)
    if found is None:
        return False
    major, minor, patch = int(found[1]), int(found[2]), int(found[3] or 0)
    return (major, minor) >= (6, 9) or (major, minor, patch) >= (6, 8, 10)


@dataclass
class _Tracked:
    """One array, registered as the page-aligned [lo, hi) inside its bytes."""

    start: int
    nbytes: int
    block: int
    lo: int
    hi: int
    edges: np.ndarray  # blocks that overlap the partial pages at either end: never known unchanged
    since: dict[int, np.ndarray] = field(default_factory=dict)  # gen -> blocks written since that gen's cut
    scanned: bool = False  # the first scan reports every page (none was protected yet)

    @property
    def nblocks(self) -> int:
        return nblocks(self.nbytes, self.block)

    def blocks_of(self, regions: np.ndarray) -> np.ndarray:
        mask = np.zeros(self.nblocks + 1, dtype=np.int32)
        if len(regions):
            first = (regions[:, 0].astype(np.int64) - self.start) // self.block
            last = (regions[:, 1].astype(np.int64) - 1 - self.start) // self.block
            np.add.at(mask, np.clip(first, 0, self.nblocks), 1)
            np.add.at(mask, np.clip(last + 1, 0, self.nblocks), -1)
        return np.cumsum(mask[:-1]) > 0


def _overlapping(spans: dict[str, tuple[int, int]]) -> set[str]:
    """The names whose (start, nbytes) overlaps another's: the same array under two names, a view of another."""
    out: set[str] = set()
    group: list[str] = []
    reach = -1
    for name, (start, nbytes) in sorted(spans.items(), key=lambda item: item[1][0]):
        if start >= reach:
            if len(group) > 1:
                out.update(group)
            group = []
        group.append(name)
        reach = max(reach, start + nbytes)
    if len(group) > 1:
        out.update(group)
    return out


def _maps() -> list[bytes]:
    """This process's mappings, one line each (``/proc/self/maps``); none if it cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            return fh.read().splitlines()
    except OSError:
        return []


def _private_anonymous(lo: int, hi: int, lines: list[bytes]) -> bool:
    """Whether [lo, hi) is mapped, and only privately and anonymously (an inode of 0, a ``p``),
    in ``lines`` (:func:`_maps`).

    Asynchronous write protection registers any memory, but only writes
    through *this* mapping fault: a page of shared memory another process
    writes, a memfd or file written with ``pwrite``, the file under a private
    mapping's unwritten pages -- all change what the array holds without a
    fault here."""
    covered = lo
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        first, _, last = fields[0].partition(b"-")
        start, end = int(first, 16), int(last, 16)
        if end <= covered or start >= hi:
            continue
        if start > covered or fields[1][3:4] != b"p" or fields[4] != b"0":
            return False
        covered = end
        if covered >= hi:
            return True
    return False


def _bytes(regions: np.ndarray) -> int:
    """Bytes in the (start, end) rows."""
    return int((regions[:, 1] - regions[:, 0]).sum()) if len(regions) else 0


def _page() -> int:
    return os.sysconf("SC_PAGE_SIZE")


class WriteWatch:
    """The write tracking of this process's protected arrays (see the module docstring)."""

    def __init__(self, kernel: _Kernel):
        self.kernel = kernel
        self.pid = os.getpid()  # (a forked child inherits the masks to read, not the registrations)
        self.page = _page()
        self.tracked: dict[str, _Tracked] = {}
        self.resting: dict[str, int] = {}  # name -> the generation from which a dense array is tried again
        self.dense: dict[str, int] = {}  # name -> how many times it was found dense (its rest doubles each time)

    def close(self) -> None:
        """Stop tracking everything (a test's own watch; the process's lives as long as it)."""
        self.tracked.clear()
        self.kernel.close()

    def _drop(self, name: str) -> None:
        t = self.tracked.pop(name, None)
        if t is not None:
            self.kernel.unregister(t.lo, t.hi)

    def _register(self, name: str, start: int, nbytes: int, block: int, maps: Callable[[], list[bytes]]) -> _Tracked | None:
        lo = -(-start // self.page) * self.page
        hi = (start + nbytes) // self.page * self.page
        if hi - lo < 2 * self.page or not _private_anonymous(lo, hi, maps()):
            return None
        try:
            self.kernel.register(lo, hi)
        except OSError:  # (a seccomp filter, a range that went away)
            return None
        t = _Tracked(start, nbytes, block, lo, hi, np.zeros(nblocks(nbytes, block), dtype=bool))
        if lo > start:  # (the partial page before lo and the one after hi are not registered)
            t.edges[: (lo - start - 1) // block + 1] = True
        if hi < start + nbytes:
            t.edges[(hi - start) // block :] = True
        self.tracked[name] = t
        return t

    def cut(self, gen: int, values: dict, block: int) -> None:
        """Generation ``gen`` is cut now: record, for every tracked array among
        ``values``, the blocks written since each recent cut."""
        if os.getpid() != self.pid:  # (a child of the job: its pages were never protected)
            self.tracked.clear()
            return
        arrays = {name: value for name, value in values.items()
                  if isinstance(value, np.ndarray) and value.flags.c_contiguous and value.nbytes >= MIN_BYTES}
        shared = _overlapping({name: (value.ctypes.data, value.nbytes) for name, value in arrays.items()})
        maps = functools.cache(_maps)  # (read once per cut, when an array is to be registered: not once per array)

        for name in [n for n in self.tracked if n not in arrays or n in shared]:
            self._drop(name)
        for name, value in arrays.items():
            if name in shared:  # (one scan protecting the pages again would hide their writes from the other's)
                continue
            start, nbytes = value.ctypes.data, value.nbytes
            t = self.tracked.get(name)
            if t is not None and (t.start, t.nbytes, t.block) != (start, nbytes, block):
                self._drop(name)
                t = None
            if t is None:
                if gen < self.resting.get(name, 0):
                    continue
                self.resting.pop(name, None)
                t = self._register(name, start, nbytes, block, maps)
                if t is None:
                    continue
            try:
                if t.scanned and _bytes(self.kernel.written(t.lo, t.hi, protect=False)) >= DENSE * (t.hi - t.lo):
                    # Written nearly all over: hashing it costs less than the faults. Let it go (unprotected).
                    self._drop(name)
                    count = self.dense[name] = self.dense.get(name, 0) + 1
                    self.resting[name] = gen + (RETRY_AFTER << min(count - 1, 4))
                    continue
                regions = self.kernel.written(t.lo, t.hi)
            except OSError:  # (the memory was unmapped or remapped under the array: hash it whole from now on)
                self._drop(name)
                continue
            written = t.blocks_of(regions)
            for mask in t.since.values():
                np.logical_or(mask, written, out=mask)
            # A number cut again (a generation retried, say) keeps its first mask: a superset of the
            # writes since either cut, right whichever snapshot the file of that number holds.
            t.since.setdefault(gen, np.zeros(t.nblocks, dtype=bool))
            for old in sorted(t.since)[:-HISTORY]:
                del t.since[old]
            t.scanned = True

    def unchanged(self, name: str, gen: int, start: int, nbytes: int, block: int) -> np.ndarray | None:
        """The blocks of ``name`` (now at ``start``, ``nbytes``) not written
        since generation ``gen``'s cut, or None when that is not known."""
        t = self.tracked.get(name)
        if t is None or (t.start, t.nbytes, t.block) != (start, nbytes, block):
            return None
        written = t.since.get(gen)
        if written is None:
            return None
        return ~(written | t.edges)


_watch: WriteWatch | None = None
_tried = False


def watch() -> WriteWatch | None:
    """This process's :class:`WriteWatch`, made at the first call; None
    when the kernel cannot track writes or ``GANGD_CKPT_WRITE_WATCH=off``."""
    global _watch, _tried
    if not _tried:
        _tried = True
        if os.environ.get("GANGD_CKPT_WRITE_WATCH", "auto").strip().lower() not in ("off", "0", "no", "false"):
            try:
                _watch = WriteWatch(_Kernel())
            except (OSError, AttributeError):
                _watch = None
    return _watch


def current() -> WriteWatch | None:
    """This process's :class:`WriteWatch` if a cut made one (a forked snapshot inherits it), else None."""
    return _watch
