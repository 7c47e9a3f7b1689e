"""Per-rank output, kept on the node-local disk and followed live.

Each rank's stdout and stderr land in one file as records
``<stream:1 byte><length:4 bytes><data>`` so the interleaving of the two
streams is kept and ``gang logs`` can replay either. Followers read the file
from an offset and wait for it to grow; the file is the single source of
truth, so a follower that attaches late (or after a daemon restart) sees
exactly what a live one saw.

Why it is shaped like this:

* Output must never strand the cluster. It lives in its own directory
  (``output_dir``, default ``STATE_DIR/output``, may be a file system of its
  own) and never takes the last ``output_reserve`` bytes of that file system
  (at most a quarter of it), which stay for the job table (the table must always be able to record a
  job's end). Each job may leave ``output_limit`` bytes per node. Past either
  limit the rank's output is dropped — the job keeps running — and the log
  itself says so: a notice where the cut is, and at the rank's end how many
  bytes of which rank were dropped, so ``gang run`` and ``gang logs`` show it.
* The daemon's memory is bounded. Writes go through ``trio.to_thread`` (a slow
  disk never stalls the event loop), one at a time per log, and the pump
  reading a rank's pipe waits for its write: at most one chunk per stream is
  held, and a rank writing faster than the disk takes is slowed down by its
  full pipe (backpressure) rather than buffered. Dropped output is drained at
  a bounded rate, so ``yes`` cannot keep a real-time daemon busy either.
* The files are root's. The output directory is reached from ``/`` at
  start-up without following a link, every component checked (root's,
  writable by no one else: :func:`gangd.safefs.open_trusted_dir`), and used
  through that descriptor from then on — a user who owns a directory above
  it, or a link planted on the way, cannot redirect it. It and each job's directory are
  root's and 0700, the logs root's and 0600: no user can reach, replace or
  grow them, so what root parses back is what it wrote. Owners read their
  output through ``gang logs`` (which checks who asks), as they always had to:
  the state directory was never open to them. Every open is ``O_NOFOLLOW``
  relative to a directory descriptor and checked to be a regular file of
  root's; reads are bounded chunks off the event loop; a record that does
  not parse ends the replay with a clear notice instead of a crash or an
  unbounded buffer.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from pathlib import Path

import trio

from .. import safefs

log = logging.getLogger("gangd.outputlog")

STDOUT = 1
STDERR = 2
_HEADER = struct.Struct(">BI")
READ_CHUNK = 256 * 1024
MAX_RECORD = 1024 * 1024  # records are written in pieces of at most WRITE_PIECE; anything longer is damage
WRITE_PIECE = 64 * 1024
DROP_PACE = 0.005  # seconds the pump waits per chunk it drops: ~13 MB/s of `yes` costs the daemon little


class OutputError(Exception):
    pass


def _size(n: int) -> str:
    value: float = n
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError


def _open_dir(name: str, dir_fd: int, create: bool = False) -> int:
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise OutputError(f"{name} is not a directory only gangd may write (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    return fd


def _check_log_fd(fd: int, what: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} is not a regular file")
    if st.st_uid != os.geteuid():
        raise OutputError(f"{what} belongs to uid {st.st_uid}, not to gangd")


class JobQuota:
    """Bytes of one job's output on this node, against ``output_limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.logs = 0  # open logs of the job here; the quota is forgotten when none is left


class OutputStore:
    """This node's rank output: where it goes and what it may take."""

    def __init__(self, root: Path, node: str, limit: int = 1 << 30, reserve: int = 64 << 20):
        self.root = root
        self.node = node
        self.limit = limit
        self.reserve = reserve
        self.quotas: dict[int, JobQuota] = {}
        self.root_fd: int | None = None

    def prepare(self) -> None:
        """At start-up: the output directory exists, is root's and private,
        every directory on the way to it too; kept open from here on."""
        try:
            fd = safefs.open_trusted_dir(self.root, create_mode=0o700)
        except safefs.UnsafePath as exc:
            raise OutputError(f"refusing the output directory (output_dir): {exc}") from None
        try:
            os.fchmod(fd, 0o700)
        except OSError as exc:
            os.close(fd)
            raise OutputError(f"output directory {self.root} is not usable: {exc.strerror or exc}") from None
        if self.root_fd is not None:
            os.close(self.root_fd)
        self.root_fd = fd

    def close(self) -> None:
        if self.root_fd is not None:
            os.close(self.root_fd)
            self.root_fd = None

    def _root(self) -> int:
        if self.root_fd is None:
            raise OutputError(f"the output directory {self.root} is not open")
        return self.root_fd

    def path(self, job_id: int, rank: int) -> Path:
        return self.root / str(job_id) / f"rank-{rank}.log"

    async def open(self, job_id: int, rank: int) -> OutputLog:
        fd = await trio.to_thread.run_sync(self._open_sync, job_id, rank)
        quota = self.quotas.get(job_id)
        if quota is None:
            quota = self.quotas[job_id] = JobQuota(self.limit)
        quota.logs += 1
        quota.used += os.fstat(fd).st_size
        return OutputLog(self, job_id, rank, fd, quota)

    def _open_sync(self, job_id: int, rank: int) -> int:
        return self._open_log(job_id, rank, os.O_RDWR | os.O_CREAT | os.O_APPEND, create=True)

    def open_for_read(self, job_id: int, rank: int) -> int:
        """A read descriptor of a rank's log (blocking: call in a thread)."""
        return self._open_log(job_id, rank, os.O_RDONLY, create=False)

    def _open_log(self, job_id: int, rank: int, flags: int, *, create: bool) -> int:
        """Rank ``rank``'s log of job ``job_id``, opened relative to the job's
        directory, never through a link, and checked to be root's regular file."""
        job = _open_dir(str(job_id), self._root(), create=create)
        try:
            fd = os.open(f"rank-{rank}.log", flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=job)
        finally:
            os.close(job)
        try:
            _check_log_fd(fd, str(self.path(job_id, rank)))
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def read(self, job_id: int, rank: int):
        """Yield ``(stream, data)`` of a rank's log file (after a restart, when only the file is left)."""
        try:
            fd = await trio.to_thread.run_sync(self.open_for_read, job_id, rank)
        except FileNotFoundError:
            return
        except (OSError, OutputError) as exc:
            why = "it is a symbolic link" if getattr(exc, "errno", None) == errno.ELOOP else getattr(exc, "strerror", None) or str(exc)
            log.warning("refusing to read the output of job %d rank %d: %s", job_id, rank, why)
            yield STDERR, f"gangd: cannot read rank {rank}'s output on {self.node}: {why}\n".encode()
            return
        try:
            async for item in read_records(fd, label=f"rank {rank}'s output log on {self.node}"):
                yield item
        finally:
            os.close(fd)

    def _closed(self, log_: OutputLog) -> None:
        quota = self.quotas.get(log_.job_id)
        if quota is not None:
            quota.logs -= 1
            if quota.logs <= 0:
                del self.quotas[log_.job_id]


class OutputLog:
    def __init__(self, store: OutputStore, job_id: int, rank: int, fd: int, quota: JobQuota):
        self.store = store
        self.job_id = job_id
        self.rank = rank
        self.path = store.path(job_id, rank)
        self._fd = fd
        self.quota = quota
        self.size = os.fstat(fd).st_size
        self.closed = False
        self.dropped = 0  # bytes of the rank's output not kept
        self.drop_reason: str | None = None
        self.unwritten: list[bytes] = []  # notices the disk had no room for: shown to followers from memory
        self._grew = trio.Event()
        self._lock = trio.Lock()

    # ------------------------------------------------------------ writing

    def append(self, stream: int, data: bytes) -> None:
        """A short message of the daemon's own (a launch error): written inline."""
        try:
            self._write_sync(_HEADER.pack(stream, len(data)) + data, reserve=0)
            self.size += _HEADER.size + len(data)
        except _NoRoom:
            self.unwritten.append(data)
        self._wake()

    async def write(self, stream: int, data: bytes) -> None:
        """Append a chunk of the rank's output, or drop it past a limit. The
        caller (the pump of the rank's pipe) waits: that is the backpressure."""
        async with self._lock:
            if self.closed:
                return
            pos = 0
            if self.drop_reason is None:
                keep = min(len(data), max(self.quota.limit - self.quota.used, 0))
                try:
                    while pos < keep:
                        piece = data[pos:min(pos + WRITE_PIECE, keep)]
                        await self._write(stream, piece, self.store.reserve)
                        self.quota.used += len(piece)
                        pos += len(piece)
                except _NoRoom as exc:
                    await self._start_dropping(str(exc))
                else:
                    if pos < len(data):
                        await self._start_dropping(f"the job's output limit on {self.store.node} ({_size(self.quota.limit)}) is reached")
            if pos < len(data):
                self.dropped += len(data) - pos
                await trio.sleep(DROP_PACE)

    async def _write(self, stream: int, data: bytes, reserve: int) -> None:
        record = _HEADER.pack(stream, len(data)) + data
        await trio.to_thread.run_sync(self._write_sync, record, reserve)
        self.size += len(record)
        self._wake()

    def _write_sync(self, record: bytes, reserve: int) -> None:
        if reserve:
            vfs = os.fstatvfs(self._fd)
            reserve = min(reserve, vfs.f_blocks * vfs.f_frsize // 4)  # a small disk still takes some output
            if vfs.f_bavail * vfs.f_frsize < reserve + len(record):
                raise _NoRoom(f"the output disk of {self.store.node} is nearly full (gangd keeps {_size(reserve)} free for the job table)")
        try:
            written = os.write(self._fd, record)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _NoRoom(f"the output disk of {self.store.node} is full") from None
            raise _NoRoom(f"writing it on {self.store.node} failed: {exc.strerror}") from None
        if written != len(record):  # a short append: cut the partial record off again
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - written)
            raise _NoRoom(f"the output disk of {self.store.node} is full")

    async def _start_dropping(self, reason: str) -> None:
        self.drop_reason = reason
        log.warning("job %d rank %d: dropping output: %s", self.job_id, self.rank, reason)
        await self._notice(f"gangd: rank {self.rank}'s output is cut here: {reason}; the rest is dropped (the job goes on)\n")

    async def _notice(self, text: str) -> None:
        """A notice of gangd's in the log, written into the reserve; kept in memory if even that fails."""
        try:
            await self._write(STDERR, text.encode(), reserve=0)
        except _NoRoom:
            self.unwritten.append(text.encode())
            self._wake()

    async def aclose(self) -> None:
        """The rank is gone: say what was lost, then close."""
        async with self._lock:
            try:
                if self.dropped and not self.closed:
                    await self._notice(
                        f"gangd: {self.dropped} bytes ({_size(self.dropped)}) of rank {self.rank}'s output on {self.store.node} "
                        f"were dropped: {self.drop_reason}\n"
                    )
            finally:
                self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
            self.store._closed(self)
            self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = trio.Event()

    # ------------------------------------------------------------ reading

    async def follow(self, follow: bool = True):
        """Yield ``(stream, data)`` from the start; with ``follow``, until the log is closed."""
        label = f"rank {self.rank}'s output log on {self.store.node}"
        fd = None
        try:
            if not self.closed:
                fd = os.dup(self._fd)  # the same file, whatever happens to its name
            else:
                try:
                    fd = await trio.to_thread.run_sync(self.store.open_for_read, self.job_id, self.rank)
                except (OSError, OutputError) as exc:
                    yield STDERR, f"gangd: cannot read {label}: {getattr(exc, 'strerror', None) or exc}\n".encode()
                    return
            offset = 0
            shown = 0
            while True:
                end, closed = self.size, self.closed
                if offset < end:
                    reader = _Reader(fd, label)
                    async for item in reader.records(offset, end):
                        yield item
                    if reader.damaged:
                        return
                    offset = end
                    continue
                while shown < len(self.unwritten):
                    yield STDERR, self.unwritten[shown]
                    shown += 1
                if not follow or closed:
                    return
                # No checkpoint between the size check and this wait, so no append can slip in.
                await self._grew.wait()
        finally:
            if fd is not None:
                os.close(fd)


class _NoRoom(Exception):
    pass


class _Reader:
    """Parses records from a descriptor in bounded chunks, off the event loop."""

    def __init__(self, fd: int, label: str):
        self.fd = fd
        self.label = label
        self.damaged = False

    async def records(self, start: int = 0, end: int | None = None):
        offset = start
        pending = b""
        base = start  # file offset of pending[0]
        while end is None or offset < end:
            want = READ_CHUNK if end is None else min(READ_CHUNK, end - offset)
            chunk = await trio.to_thread.run_sync(os.pread, self.fd, want, offset)
            if not chunk:
                break
            offset += len(chunk)
            pending += chunk
            pos = 0  # parse in place; one slice per chunk, not one per record
            while len(pending) - pos >= _HEADER.size:
                stream, length = _HEADER.unpack_from(pending, pos)
                if stream not in (STDOUT, STDERR) or length > MAX_RECORD:
                    self.damaged = True
                    log.error("%s is damaged at byte %d (stream %d, length %d)", self.label, base + pos, stream, length)
                    yield STDERR, f"gangd: {self.label} is damaged at byte {base + pos}; the rest of it is not shown\n".encode()
                    return
                body = pos + _HEADER.size
                if len(pending) < body + length:
                    break
                yield stream, pending[body:body + length]
                pos = body + length
            pending = pending[pos:]
            base += pos
        if pending and end is None:
            self.damaged = True
            yield STDERR, f"gangd: {self.label} ends in the middle of a record (byte {base}); its last {len(pending)} bytes are not shown\n".encode()


async def read_records(fd: int, start: int = 0, end: int | None = None, label: str = "an output log"):
    """Yield ``(stream, data)`` records of a log descriptor between byte offsets (record boundaries)."""
    async for item in _Reader(fd, label).records(start, end):
        yield item
