"""Writing redundancy files around the page cache (O_DIRECT).

A partner's copy or a parity is read only if a node is lost; it has no
business in this node's page cache, and writing it through the cache cost
this machine more CPU than moving it over the network (ext4 here: ~1.7 ms
per MiB into a new file, ~0.1 ms direct). So such files are opened
O_DIRECT where the file system allows it (tmpfs does not: then through the
cache), written from page-aligned buffers (:func:`aligned_buffer`) at
aligned offsets, the unaligned tail of the last piece through the cache
(O_DIRECT cleared on the fd). Callers still fsync: O_DIRECT bypasses the
cache, not the device's.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

#: O_DIRECT writes: offsets, lengths and buffer addresses multiples of this.
ALIGN = 4096
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned writable buffer of ``size`` bytes (at least 1)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))


class DirectFile:
    """A new file ``name`` in ``dir_fd`` (O_EXCL, no link followed), written in order."""

    def __init__(self, name: str, dir_fd: int, mode: int = 0o600):
        # Created first, O_DIRECT asked for after: a file system that refuses
        # it may do so only once open(O_CREAT | O_DIRECT) has made the file,
        # and the O_EXCL retry would then find it there.
        self.fd, self.direct = os.open(name, CREATE, mode, dir_fd=dir_fd), True
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                os.close(self.fd)
                raise
            self.direct = False  # (through the page cache, then)
        self.off = 0

    def write(self, view: memoryview) -> None:
        """Append ``view`` (page-aligned if it is to go direct). After a
        piece whose length is not a multiple of :data:`ALIGN`, the rest of
        the file goes through the cache."""
        if self.direct and (len(view) % ALIGN or self.off % ALIGN):
            aligned = len(view) - len(view) % ALIGN if self.off % ALIGN == 0 else 0
            self._write(view[:aligned])
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            view = view[aligned:]
        self._write(view)

    def _write(self, view: memoryview) -> None:
        while view:
            n = os.pwrite(self.fd, view, self.off)
            self.off += n
            view = view[n:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
