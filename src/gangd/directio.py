"""Writing checkpoint files around the page cache (O_DIRECT).

Writing a new file through the page cache costs CPU for every byte: a page
allocated, the bytes copied into it, the page put on the LRU, accounted
dirty, written back and eventually reclaimed (ext4 here: ~1.7 ms of system
time per MiB; ~0.1-0.2 ms direct, the copy into an aligned buffer
included). A checkpoint is CPU-bound that way on a node whose cores are
busy -- the job runs on while its forked snapshot writes -- and its bytes
have no business in the cache anyway: they are read back only by a restart
(a rank's state) or only if a node is lost (a partner's copy, a parity),
and meanwhile they would push the job's own cached files out.

So these files are written O_DIRECT where the file system allows it (tmpfs
does not: then through the cache, as before), from page-aligned buffers at
aligned offsets, the unaligned tail of the last piece through the cache
(O_DIRECT cleared on the fd). Callers still fsync: O_DIRECT bypasses the
cache, not the device's, and the file's size and extents are metadata.

* :class:`DirectFile` -- a new file written in order from buffers the caller
  keeps page-aligned (the redundancy streams, whose buffers are theirs);
* :class:`Appender` -- any bytes appended at an fd's position, copied into a
  few aligned buffers that a thread writes while the next one fills (a
  rank's state: views of the job's arrays, at any address and length).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading
from collections.abc import Mapping

#: O_DIRECT writes: offsets, lengths and buffer addresses multiples of this.
ALIGN = 4096
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: A program's switch for its own checkpoint files: ``0`` (or no, false, off) writes them through the
#: page cache, as before (a file system whose direct writes are slow; a restart on the same node
#: right after, wanting the state still cached). The daemons' redundancy files are always direct.
ENV = "GANGD_CKPT_DIRECT"


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this program writes its checkpoint files around the page cache (``GANGD_CKPT_DIRECT``, default yes)."""
    return environ.get(ENV, "1").strip().lower() not in ("0", "no", "false", "off")


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned writable buffer of ``size`` bytes (at least 1): private anonymous memory (not
    shmem, which a memory cgroup counts apart and a forked child would share)."""
    return memoryview(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE))


def set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False if the file system refuses it (EINVAL), other errors raised."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


class DirectFile:
    """A new file ``name`` in ``dir_fd`` (O_EXCL, no link followed), written in order."""

    def __init__(self, name: str, dir_fd: int, mode: int = 0o600):
        # Created first, O_DIRECT asked for after: a file system that refuses
        # it may do so only once open(O_CREAT | O_DIRECT) has made the file,
        # and the O_EXCL retry would then find it there.
        self.fd = os.open(name, CREATE, mode, dir_fd=dir_fd)
        try:
            self.direct = set_direct(self.fd, True)  # (False: through the page cache, then)
        except OSError:
            os.close(self.fd)
            raise
        self.off = 0

    def write(self, view: memoryview) -> None:
        """Append ``view`` (page-aligned if it is to go direct). After a
        piece whose length is not a multiple of :data:`ALIGN`, the rest of
        the file goes through the cache."""
        if self.direct and (len(view) % ALIGN or self.off % ALIGN):
            aligned = len(view) - len(view) % ALIGN if self.off % ALIGN == 0 else 0
            self._write(view[:aligned])
            set_direct(self.fd, False)
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


#: An :class:`Appender`'s buffers: one filling while the others are written. 8 MiB a write keeps
#: the disk's queue full (the block layer splits it into the device's largest requests).
APPEND_BUFFER = 8 << 20
APPEND_BUFFERS = 3
#: A buffer holding this much goes to the disk at once if the disk has nothing else to write: a
#: producer slower than the disk (a compress stage) is then followed closely, and what is left to
#: write when it ends is its last piece, not up to a whole buffer (paper 004's pipeline drain).
APPEND_EAGER = 1 << 20


class Appender:
    """Bytes appended to ``fd`` from its current position, O_DIRECT where the file system allows it.

    :meth:`write` copies a view (any address, any length) into the buffer
    being filled; each full buffer is written (``pwrite`` at its aligned
    offset) by a thread of this appender while the caller fills the next,
    so the copy and the disk overlap. At most ``count`` buffers of ``size``
    bytes exist: a caller faster than the disk waits for a free one.
    :meth:`close` writes what is left (its whole pages direct, the last
    partial page through the cache) and leaves the fd at the end, with
    O_DIRECT off, for whatever the caller writes after (an index, a footer).

    Not direct at all (every buffer through the cache, still by the thread)
    when the fd's position is not a multiple of :data:`ALIGN` or the file
    system refuses O_DIRECT; a direct write refused later (EINVAL: a device
    with larger sectors) turns it off for the rest and writes that buffer
    again through the cache. A write error (a full disk) is raised by the
    next :meth:`write` or by :meth:`close`; :meth:`abort` stops the thread
    without raising (the caller is already failing). The caller fsyncs.
    """

    def __init__(self, fd: int, *, size: int = APPEND_BUFFER, count: int = APPEND_BUFFERS):
        if size <= 0 or size % ALIGN or count < 2:
            raise ValueError(f"an appender needs at least 2 buffers of a positive multiple of {ALIGN} bytes")
        self.fd, self.size = fd, size
        self.at = os.lseek(fd, 0, os.SEEK_CUR)  # the file offset of the buffer being filled
        self.direct = self.at % ALIGN == 0 and set_direct(fd, True)
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self._made = 0
        self._count = count
        self._full: queue.SimpleQueue[tuple[memoryview, int, int] | None] = queue.SimpleQueue()
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._buf: memoryview | None = None
        self._used = 0
        self._stop = False  # (abort: the thread writes nothing more)
        self._writing = False  # (the thread is in a write: read without a lock, a hint only)
        self.closed = False

    def write(self, view: memoryview) -> None:
        """Append ``view``'s bytes (copied: the caller may reuse or drop its memory once this returns)."""
        view = memoryview(view).cast("B")
        while view:
            if self._buf is None:
                self._buf = self._take()
            n = min(len(view), self.size - self._used)
            _copy(self._buf[self._used : self._used + n], view[:n])
            self._used += n
            view = view[n:]
            if self._used == self.size:
                self._hand()
        if self._used >= APPEND_EAGER and self.idle:  # (the disk is idle: keep it busy)
            tail = self._used % ALIGN if self.direct else 0
            self._hand(self._used - tail, keep=tail)

    @property
    def idle(self) -> bool:
        """Nothing handed over is waiting or being written (a hint: the thread may be just about to)."""
        return not self._writing and self._full.empty()

    def close(self) -> int:
        """Write the rest, wait for every write; the file's end (the fd is left there, O_DIRECT off)."""
        if self.closed:
            return self.at
        try:
            self._finish()  # (every buffer handed over written: the flag and the offset are settled)
            self._raise()
            if self._buf is not None and self._used:  # its whole pages direct, the last partial page through the cache
                tail = self._used % ALIGN if self.direct else 0
                self._pwrite(self._buf[: self._used - tail], self.at)
                if tail:
                    set_direct(self.fd, False)
                    self.direct = False
                    self._pwrite(self._buf[self._used - tail : self._used], self.at + self._used - tail)
                self.at += self._used
                self._used = 0
            if self.direct:
                set_direct(self.fd, False)
            os.lseek(self.fd, self.at, os.SEEK_SET)
            return self.at
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the thread (waiting for a write under way); nothing raised, the file as it is."""
        self.closed = self._stop = True
        self._finish()
        self._buf = None
        while True:  # (the buffers go now, not with whatever keeps this appender: an error's traceback)
            try:
                self._free.get_nowait()
            except queue.Empty:
                break

    # ------------------------------------------------------------------ inside

    def _take(self) -> memoryview:
        self._raise()
        if self._made < self._count:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._made += 1
                return aligned_buffer(self.size)
        buf = self._free.get()
        self._raise()
        return buf

    def _hand(self, length: int | None = None, keep: int = 0) -> None:
        """Queue the first ``length`` bytes of the buffer being filled (all of it) for the thread; ``keep``
        bytes after them move to a fresh buffer's start (an eager hand-off's unaligned tail)."""
        buf, length = self._buf, self._used if length is None else length
        assert buf is not None  # noqa: S101 (called with a buffer)
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="gangd-direct-write", daemon=True)
            self._thread.start()
        if keep:
            fresh = self._take()
            _copy(fresh[:keep], buf[length : length + keep])
        self._full.put((buf, length, self.at))
        self.at += length
        self._buf, self._used = (fresh, keep) if keep else (None, 0)

    def _writer(self) -> None:
        while (item := self._full.get()) is not None:
            buf, length, at = item
            try:
                if self._error is None and not self._stop:
                    self._writing = True
                    self._pwrite(buf[:length], at)
            except Exception as exc:  # noqa: BLE001 -- raised in the caller's thread (a full disk, say)
                self._error = exc.with_traceback(None)  # (its frames would keep this appender and its buffers)
            finally:
                self._writing = False
                self._free.put(buf)  # (always: a caller waiting for a buffer must not wait forever)

    def _pwrite(self, view: memoryview, at: int) -> None:
        while view:
            if self._stop:  # (aborted: the caller may be closing the fd, whose number could be reused)
                raise OSError(errno.ECANCELED, "the write was abandoned")
            try:
                n = os.pwrite(self.fd, view, at)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                set_direct(self.fd, False)  # (refused after all: the rest through the cache)
                self.direct = False
                continue
            if n <= 0:
                raise OSError(errno.EIO, "a write wrote nothing")
            view, at = view[n:], at + n
            if self.direct and (n % ALIGN):  # (a short direct write that left the rest unaligned)
                set_direct(self.fd, False)
                self.direct = False

    def _finish(self) -> None:
        if self._thread is not None:
            self._full.put(None)
            self._thread.join()
            self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, without holding the GIL for large copies (numpy lets go of it): the pipeline's
    compress workers and the job's own threads run meanwhile."""
    if len(src) < 1 << 16:
        dst[:] = src
    else:
        import numpy as np  # (here: the daemon, which writes only DirectFiles, starts without numpy)

        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
