"""Restoring a large array by mapping its checkpoint file, not by copying it (issue 16's restart speed).

Why: a restart used to read every array into fresh memory -- the kernel
zeroes each new page, then copies the file's bytes over it out of the page
cache. On the peers' ring workload (4 ranks x 64 MiB on 2 cores) that copy
was most of ``ckpt.init()``: ~40 ms of CPU per rank for 64 MiB, four ranks
at once. A private file mapping (``MAP_PRIVATE``) gives the same array
without the copy: its pages *are* the page cache's until the program writes
one, and the kernel then copies just that page (copy-on-write). This is a
lazy restore, as CRIU's lazy pages are: the job computes sooner, and the
copy is paid later, page by page as the program writes, and for the rest
at its next checkpoint (below).

When a value is mapped (else it is read as before):

* it is an array of a plain or record dtype (no Python objects, no
  top-level subarray) of at least :data:`MIN_BYTES`, all of whose blocks
  one file of the chain stores raw and in order at an offset aligned for
  its dtype, and that file supplies at least half of them (a full, or the
  base a delta chain ends at: the newer files' blocks are read over the
  mapping, which copies their pages);
* ``GANGD_CKPT_RESTORE`` is ``map`` (the default); ``read`` turns it off.

Only the value's own pages are mapped (at an address aligned for huge
pages), no descriptor is kept, and before anything of the program runs
every page is faulted in with ``MADV_POPULATE_READ`` (an I/O error then is
an ``OSError`` and the value is read instead, where the error is reported
as before) and checked as a read value is: the file's checksum against the
manifest, or every block against its signature.

**Settled at the next checkpoint.** A mapping is not what the program's
memory should stay: its pages are not in transparent huge pages, the write
watch of incremental checkpoints (:mod:`.dirty`) tracks only private
anonymous memory, a snapshot's fork copies more page table, and the file
stays allocated on disk while it is mapped, even after retention deletes
it. So at the next checkpoint's cut, in the job before the snapshot is
forked or the state written, :func:`settle` copies each mapped region into
fresh anonymous memory (huge pages asked for) and moves that memory over
the mapping's addresses (``mremap``): the arrays keep their addresses, the
file is let go. That copy is the one the restart skipped; it lengthens that
one checkpoint's blocked time by about the time to copy the mapped bytes,
and it is then charged to the job's memory cgroup (the pages the program
had written, twice until the move). The copy and the move keep the GIL, so
no Python thread of the program runs meanwhile; but a write from another
thread that does not hold it (numpy releases the GIL in large operations,
as C extensions may) during the cut is lost from the program's own memory,
not only from the snapshot: a program's other threads must not write its
protected arrays during a checkpoint's cut. A failed move never leaves a
hole under the arrays: the region is refilled, or the process stops.
Mappings are placed only on x86-64 and arm64 Linux, whose flag numbers
this module uses; elsewhere every value is read.

Safe because gangd never writes a generation's file after it is committed
(every state file is created new, ``O_EXCL``, and renamed into place): a
mapped page not yet copied shows the file's bytes, so a file changed in
place -- by its owner, the job's user, the only one who can (mode 0600) --
would change the restored state before it settles. Until then, a page the
kernel dropped under memory pressure is read again from the file when
touched: a disk failing in that window fails the rank with SIGBUS where a
read restart would have failed its next checkpoint. The page-cache pages
are charged to whichever cgroup first read them (a daemon's staging, the
snapshot that wrote them), not to the job, until the job writes them or
they settle.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

import numpy as np

MIN_BYTES = 1 << 20  # smaller values are read: a copy of under a MiB costs less than its mapping's faults and VMA
MIN_SHARE = 0.5  # a file must supply at least this share of a value's blocks for the value to be its mapping
ENV = "GANGD_CKPT_RESTORE"
CHOICES = ("map", "read")

_PAGE = mmap.PAGESIZE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_PROT_NONE = 0
# Flags Python 3.11's mmap does not name, as x86-64's and arm64's Linux number them (other
# architectures number some differently: there every value is read, see _libc).
_MAP_FIXED, _MAP_NORESERVE, _MAP_FIXED_NOREPLACE = 0x10, 0x4000, 0x100000
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_POPULATE_READ = 22  # Linux 5.14
_ARCHES = ("x86_64", "aarch64")


def _huge_page() -> int:
    """The size of a transparent huge page here (2 MiB with 4 KiB pages): where mappings are placed."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as fh:
            size = int(fh.read())
    except (OSError, ValueError):
        size = 2 << 20
    return size if size > 0 and size % _PAGE == 0 else 2 << 20


_HUGE = _huge_page()


class RestoreSettingError(ValueError):
    """``GANGD_CKPT_RESTORE`` is neither ``map`` nor ``read``."""


def wanted(environ=os.environ) -> bool:
    """Whether a restore maps what it can (``GANGD_CKPT_RESTORE``, default ``map``)."""
    value = environ.get(ENV, "map").strip().lower() or "map"
    if value not in CHOICES:
        raise RestoreSettingError(f"{ENV} must be {' or '.join(CHOICES)}, not {value[:40]!r}")
    return value == "map"


def _libc():
    """The C library's calls, or None where the flags above may be wrong (every value is then read).

    A PyDLL: the calls keep the GIL, so no Python thread of the program runs while :func:`settle` copies a
    region and moves the copy over it (a write from one meanwhile would be lost; see the module docstring)."""
    import platform

    if platform.system() != "Linux" or platform.machine() not in _ARCHES:
        return None
    libc = ctypes.PyDLL(None, use_errno=True)
    calls = {
        "mmap": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]),
        "munmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
        "mremap": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
        "madvise": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
        "memmove": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    }
    for name, (restype, argtypes) in calls.items():
        fn = getattr(libc, name)
        fn.restype, fn.argtypes = restype, argtypes
    return libc


try:
    _C = _libc()
except (OSError, AttributeError):  # (no C library to call: every value is read)
    _C = None
_FAILED = ctypes.c_void_p(-1).value


def _map(length: int, prot: int, flags: int, fd: int = -1, offset: int = 0, at: int | None = None) -> int:
    """mmap(2); an OSError when it fails (or where there is no C library to call)."""
    if _C is None:
        raise OSError(0, "no C library")
    address = _C.mmap(at, length, prot, flags | (_MAP_FIXED if at is not None else 0), fd, offset)
    if address in (None, _FAILED):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    if at is not None and address != at:  # (MAP_FIXED not honoured: never a mapping where it was not asked)
        _unmap(address, length)
        raise OSError(0, "the mapping was not placed where asked")
    return address


def _unmap(address: int, length: int) -> None:
    if length > 0:
        _C.munmap(address, length)


def _aligned(length: int, prot: int, flags: int) -> int:
    """An anonymous ``length`` bytes at an address aligned for huge pages (the rest of the reservation returned)."""
    base = _map(length + _HUGE, prot, flags | mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = -(-base // _HUGE) * _HUGE
    _unmap(base, address - base)
    _unmap(address + length, base + _HUGE - address)
    return address


def _region(address: int, length: int) -> ctypes.Array:
    """The memory at ``address`` as a buffer the restored arrays are views of (their base keeps it
    alive); unmapped when the last of them goes. Until :func:`settle` it is a mapping of a file."""
    buffer = (ctypes.c_ubyte * length).from_address(address)
    # Not at the interpreter's exit: exit handlers, daemon threads and finalizers may still use the arrays
    # then (the process's end frees the memory anyway).
    weakref.finalize(buffer, _unmap, address, length).atexit = False
    return buffer


_unsettled: weakref.WeakValueDictionary[int, ctypes.Array] = weakref.WeakValueDictionary()  # address -> region, while a mapping


def array(fd: int, offset: int, nbytes: int, dtype: np.dtype, shape) -> np.ndarray | None:
    """``nbytes`` at ``offset`` of ``fd`` as a writable array of ``dtype`` and ``shape``, a private mapping of
    the file with its pages faulted in; None: read it instead (too small, misaligned, or it cannot be mapped)."""
    if (_C is None or nbytes < MIN_BYTES or dtype.hasobject or dtype.subdtype is not None or dtype.itemsize == 0
            or offset % max(dtype.alignment, 1) or nbytes % dtype.itemsize):
        return None
    start = offset - offset % _PAGE
    length = -(-(offset + nbytes - start) // _PAGE) * _PAGE
    try:
        address = _aligned(length, _PROT_NONE, _MAP_NORESERVE)
    except OSError:
        return None
    try:
        _map(length, _PROT_RW, mmap.MAP_PRIVATE, fd, start, at=address)
    except OSError:  # (a file system that cannot map; the reservation goes)
        _unmap(address, length)
        return None
    region = _region(address, length)  # (from here the region is unmapped with its last array, or now)
    if _C.madvise(address, length, _MADV_POPULATE_READ) != 0:  # (an I/O error, a kernel before 5.14: read it)
        return None
    _unsettled[address] = region
    view = np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8, count=nbytes, offset=offset - start)
    return view.view(dtype).reshape(shape)


def settle() -> int:
    """Copy every region still a file mapping into anonymous memory moved over it (see the module
    docstring); returns the bytes copied. One that cannot be settled stays a mapping."""
    copied = 0
    for address, region in list(_unsettled.items()):
        length = len(region)
        try:
            fresh = _aligned(length, _PROT_RW, 0)
        except OSError:
            continue
        _C.madvise(fresh, length, mmap.MADV_HUGEPAGE)  # (best effort)
        _C.memmove(fresh, address, length)
        moved = _C.mremap(fresh, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
        if moved != address and not _refill(address, fresh, length):
            _unmap(fresh, length)
            continue
        del _unsettled[address]
        copied += length
    return copied


def _refill(address: int, fresh: int, length: int) -> bool:
    """After a failed ``mremap`` onto ``address``: True if the region there was settled after all (the
    kernel had unmapped it before failing: anonymous memory is mapped there anew and ``fresh``, the
    copy, put into it); False if the file mapping is still there, intact. The arrays never see a hole
    another mapping could take: if neither can be told, the process stops."""
    again = _C.mmap(address, length, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
    if again == address:
        _C.memmove(address, fresh, length)
        _unmap(fresh, length)
        return True
    if again in (None, _FAILED) and ctypes.get_errno() == errno.EEXIST:
        return False
    if again not in (None, _FAILED):  # (a kernel before 4.17 took the flag as a hint: something else is at address)
        _unmap(again, length)
        return False
    os.write(2, b"gangd.ckptlib: a restored array's memory could not be settled nor kept (mremap and mmap failed); stopping\n")
    os.abort()


def unsettled() -> int:
    """Bytes of this process's memory that are still file mappings."""
    return sum(len(region) for region in _unsettled.values())
