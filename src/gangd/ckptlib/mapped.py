"""Restoring a large array by mapping its checkpoint file, not by copying it (issue 16's restart speed).

Why: a restart used to read every array into fresh memory -- the kernel
zeroes each new page, then copies the file's bytes over it out of the page
cache. On the peers' ring workload (4 ranks x 64 MiB on 2 cores) that copy
was most of ``ckpt.init()``: ~40 ms of CPU per rank for 64 MiB, four ranks
at once. A private file mapping (``MAP_PRIVATE``) gives the same array
without the copy: its pages *are* the page cache's until the program writes
one, and the kernel then copies just that page (copy-on-write), so the cost
moves from the restart to the pages the program actually changes, spread
over its run, and a program that changes little pays little.

When a value is mapped (else it is read as before):

* it is an array of a plain or record dtype (no Python objects) of at least
  :data:`MIN_BYTES`, all of whose blocks one file of the chain stores raw
  and in order (a full, or the base a delta chain ends at: the newer
  files' blocks are then read over the mapping, which copies only their
  pages), at an offset aligned for its dtype;
* at most :data:`MAX_FILES` files are mapped per restore: Python's mmap
  keeps a descriptor of its file open, one per file, not per value;
* ``GANGD_CKPT_RESTORE`` is ``map`` (the default); ``read`` turns it off.

Before anything of the program runs, every mapped page is faulted in with
``MADV_POPULATE_READ`` (an I/O error then is an ``OSError`` and the value
is read instead, where the error is reported as before, not a SIGBUS later)
and checked as a read value is: the file's checksum against the manifest
for the generation's own file, every block against its signature.

What it costs, and why it is safe:

* gangd never writes a generation's file after it is committed (every
  state file is created new, ``O_EXCL``, and renamed into place); a mapped
  page not yet copied shows the file's bytes, so a file changed in place
  -- by its owner, the job's user -- would change the restored state. The
  files are the job's user's own (mode 0600); no other user can.
* The file's disk space stays allocated while the rank runs, even after
  retention deletes the generation (an unlinked file in use keeps its
  blocks): one generation more per restarted job, freed when it ends.
* Mapped arrays are not in transparent huge pages, and
  :mod:`.dirty`'s write watch tracks only private anonymous memory: an
  incremental checkpoint of a restarted job hashes those arrays whole (in
  the writing process, off the job's path), and a snapshot's fork copies
  more page table.
* The pages the program has not written are clean page cache: under memory
  pressure the kernel drops them and reads them again from the file when
  touched -- a disk failing after the restart could then fail the rank
  with SIGBUS where a read restart would have failed its next checkpoint.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

MIN_BYTES = 1 << 20  # smaller values are read: a copy of under a MiB costs less than its mapping's faults and VMA
MAX_FILES = 64  # files mapped by one restore (each holds a descriptor while the rank runs)
ENV = "GANGD_CKPT_RESTORE"
CHOICES = ("map", "read")
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.11's mmap does not name it
_PAGE = mmap.ALLOCATIONGRANULARITY


class RestoreSettingError(ValueError):
    """``GANGD_CKPT_RESTORE`` is neither ``map`` nor ``read``."""


def wanted(environ=os.environ) -> bool:
    """Whether a restore maps what it can (``GANGD_CKPT_RESTORE``, default ``map``)."""
    value = environ.get(ENV, "map").strip().lower() or "map"
    if value not in CHOICES:
        raise RestoreSettingError(f"{ENV} must be {' or '.join(CHOICES)}, not {value[:40]!r}")
    return value == "map"


class FileMaps:
    """The files of one restore mapped so far: one mapping per file, every mapped value a view of it."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap | None] = {}  # file number -> its mapping, None: it cannot be mapped

    def array(self, number: int, fd: int, offset: int, nbytes: int, dtype: np.dtype, shape) -> np.ndarray | None:
        """``nbytes`` at ``offset`` of file ``number`` (``fd``) as a writable array of ``dtype`` and ``shape``,
        its pages faulted in; None: read it instead (too small, misaligned, or the file cannot be mapped)."""
        if nbytes < MIN_BYTES or dtype.hasobject or dtype.itemsize == 0 or offset % max(dtype.alignment, 1) \
                or nbytes % dtype.itemsize:
            return None
        whole = self._file(number, fd)
        if whole is None or offset + nbytes > len(whole):
            return None
        start = offset - offset % _PAGE
        try:
            whole.madvise(_POPULATE_READ, start, offset + nbytes - start)
        except (OSError, ValueError):  # (an I/O error, or a kernel before 5.14: read it, and let the read say why)
            return None
        arr = np.frombuffer(whole, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
        return arr.reshape(shape)

    def _file(self, number: int, fd: int) -> mmap.mmap | None:
        if number in self._maps:
            return self._maps[number]
        whole = None
        if sum(m is not None for m in self._maps.values()) < MAX_FILES:
            try:
                size = os.fstat(fd).st_size
                if size:
                    whole = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):  # (a file system that cannot map, an address space full...)
                whole = None
        self._maps[number] = whole
        return whole
