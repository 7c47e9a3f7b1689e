"""Checkpoint generations on the node-local disk: layout, atomic writes, checksums, manifests.

Shared by the daemons (cluster checkpoints) and by :mod:`gangd.ckptlib` when
a program runs alone. One directory per generation::

    <root>/job-<lineage>/gen-<G>/     (root's, 0711: only the daemon adds or removes files)
        ranks/rank-<R>.state  a rank's protected state (ranks/ is the job owner's, 0700)
        net-<R>.ctx           its network context (written by the daemon)
        job.msgpack           the daemon's record of the job at the cut
        MANIFEST              this node's commit: every file above with size and checksum,
                              and (format 2) the older generations a delta file needs

(``<root>`` is ``<checkpoint_dir>/<node>``: each node its own, see the README.)
The rank state files are the job owner's (the ranks write them); every file
the daemon writes is root's, mode 0600, so the owner can neither rewrite nor
truncate what root later parses. Nothing on the owner's side needs them:
the daemon hands a restarted rank its network context and what its state
file must hold. (0640 with the owner's group would leak the job's token and
context to everyone sharing that group, often a whole project.) The daemon
works in a generation only through directory descriptors
(:mod:`gangd.safefs`: ``dir_fd=`` below), never writes into a directory the
owner controls, and reads the ranks' files without following symlinks; a
file it parses (the manifest) is read to a size limit, so a sparse or
oversized one is an error, not an out-of-memory kill. A program running
alone keeps its state at ``gen-<G>/rank-0.state`` (its own files, as its user).

Every file is written under a temporary name, fsynced, then renamed, and the
directory fsynced: a crash leaves either the old name or the whole new file,
never a torn one under the final name. ``MANIFEST`` is written last, so a
node's generation without one was never committed. A generation is
*complete* only when every node committed; the daemons record that in the
(replicated, fsynced) job table, never on one node's disk alone.

Checksums are XXH3-128: they catch torn or flipped bytes at several GB/s,
which is what a checkpoint on a local disk needs (not a defence against an
adversary, who could as well rewrite the manifest).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from . import directio, safefs

MANIFEST = "MANIFEST"
FORMAT = 1  # a manifest of whole files (what daemons wrote before incremental checkpoints)
FORMAT_DELTA = 2  # ... with ``needs``: some file is a delta of older generations
CHUNK = 8 << 20  # what one write/read moves: large enough for full disk speed
MAX_MANIFEST = 16 << 20  # bytes: ~250,000 files' entries; a larger one is refused unread


class StoreError(Exception):
    """A checkpoint file is missing, short, corrupted or cannot be written; the message says which."""


def job_dir(root: Path, lineage: int) -> Path:
    return Path(root) / f"job-{lineage}"


def gen_dir(root: Path, lineage: int, gen: int) -> Path:
    return job_dir(root, lineage) / f"gen-{gen}"


RANKS_DIR = "ranks"


def rank_file(rank: int) -> str:
    """A rank's state file in a standalone generation."""
    return f"rank-{rank}.state"


def cluster_rank_file(rank: int) -> str:
    """A rank's state file in a cluster generation (in the owner's ``ranks/``)."""
    return f"{RANKS_DIR}/rank-{rank}.state"


def net_file(rank: int) -> str:
    return f"net-{rank}.ctx"


def hasher():
    return xxhash.xxh3_128()


def describe_os_error(exc: OSError, path: Path | str) -> str:
    if exc.errno == errno.ENOSPC:
        return f"no space left on device writing {path}"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded writing {path}"
    return f"{exc.strerror or exc} ({path})"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>
_libc: object = None  # ctypes' libc once looked up; False where it has no sync_file_range
IOV = 512  # buffers one writev takes at most (IOV_MAX is 1024 on Linux)


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages in [offset, offset + nbytes)
    (0: to the end) and return at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
    which :mod:`os` does not offer): the fsync that follows waits only for what is left."""
    global _libc
    if _libc is False:
        return
    try:
        if _libc is None:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _libc = libc
        _libc.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # type: ignore[attr-defined]  # (an error: no head start, nothing else)
    except (OSError, AttributeError):
        _libc = False


def _writev(fd: int, views: list[memoryview]) -> None:
    """All of ``views``, in order, in as few system calls as the kernel allows (it may take part of them)."""
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


class Streamed:
    """A chunk that writes itself: ``fn(fd, digest, appender)`` writes at ``fd``'s position (advancing
    it, the digest updated with what it wrote) -- or, if ``appender`` (a :class:`gangd.directio.Appender`
    open on ``fd``) is not None, through its ``write`` -- and returns (bytes written, the buffers to
    write after it). A compressed checkpoint's blocks: their sizes are known only once compressed, by
    the pipeline that writes them (:mod:`gangd.ckptlib.blocks`)."""

    def __init__(self, fn: Callable[[int, Any, Any], tuple[int, list]]):
        self.fn = fn


def write_chunks(fd: int, chunks: Iterable, digest=None, *, kick: int = 0, stable: bool = False, _at: int = 0,
                 copied: Callable[[memoryview], object] | None = None, direct: directio.Appender | None = None) -> int:
    """Write every buffer of ``chunks`` (bytes-like, any size) to ``fd``; returns bytes written.
    A callable chunk is called with ``fd`` once everything before it is written, and the buffers it
    returns are written in its place (a checkpoint's index, hashed while the disk writes its blocks);
    a :class:`Streamed` one writes its own bytes first.

    ``stable``: the chunks stay as they are until this returns (views of a snapshot's arrays), so
    small ones go out together (``writev``, up to :data:`CHUNK` bytes or :data:`IOV` buffers a
    call): a delta's file is hundreds of 16 KiB runs. Otherwise each chunk is written before the
    next is asked for: a stream may hand out one buffer refilled for every chunk. ``kick``: each time that many more bytes are
    written, the disk is asked to start on them (:func:`start_writeback`), so it works while the
    rest is copied and the writer's fsync waits only for the tail (``_at``: the file's offset of
    the first chunk, for a callable's recursion). ``copied``: called with each part of a buffer once
    it is written and hashed, in order (a forked snapshot lets go of the job's pages as it goes:
    :class:`gangd.ckptlib.letgo.AsCopied`); a callable or :class:`Streamed` chunk may read what came
    before it, so with ``copied`` one is refused (ValueError) rather than handed let-go memory.
    ``direct``: the buffers go through this appender (around the page cache, :mod:`gangd.directio`;
    ``copied`` is then called once a part is copied into its buffers), a :class:`Streamed` chunk's
    too, up to the first callable chunk, where it is closed: that and what follows it are written
    at the fd. Closed at the end (the fd is left there)."""
    total, kicked = 0, 0
    batch: list[memoryview] = []
    queued = 0

    def flush() -> None:
        nonlocal queued, kicked
        if direct is not None and not direct.closed:
            for part in batch:
                direct.write(part)
                if copied is not None:
                    copied(part)
            batch.clear()
            queued = 0
            return
        if copied is None:
            _writev(fd, batch)
        else:
            written = batch.copy()  # (_writev empties the list)
            _writev(fd, batch)
            for part in written:
                copied(part)
        queued = 0
        if kick and total - kicked >= kick:
            start_writeback(fd, _at + kicked, total - kicked)
            kicked = total

    for chunk in chunks:
        if copied is not None and (isinstance(chunk, Streamed) or callable(chunk)):
            raise ValueError("a chunk that writes or builds itself may read the buffers before it: not with copied")
        if isinstance(chunk, Streamed):
            flush()
            appender = direct if direct is not None and not direct.closed else None
            written, after = chunk.fn(fd, digest, appender)
            total += written
            total += write_chunks(fd, after, digest, kick=kick, stable=stable, _at=_at + total, direct=appender)
            kicked = total
            continue
        if callable(chunk):
            flush()
            if direct is not None:
                direct.close()  # (it may read or write at the fd: everything before it is there)
            total += write_chunks(fd, chunk(fd), digest, kick=kick, stable=stable, _at=_at + total)
            kicked = total
            continue
        view = memoryview(chunk).cast("B")
        if digest is not None:
            digest.update(view)
        for start in range(0, len(view), CHUNK):
            part = view[start : start + CHUNK]
            if queued + len(part) > CHUNK or len(batch) >= IOV:
                flush()
            batch.append(part)
            queued += len(part)
            total += len(part)
        if not stable:
            flush()
    flush()
    if direct is not None:
        direct.close()
    return total


def write_atomic(path: Path, chunks: Iterable, *, mode: int = 0o600, owner: tuple[int, int] | None = None,
                 durable: bool = True, dir_fd: int | None = None, kick: int = 0, stable: bool = False,
                 after_copy: Callable[[], object] | None = None, copied: Callable[[memoryview], object] | None = None,
                 direct: bool = False) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` via a temporary name, fsync, rename, fsync the directory.

    Returns (size, checksum). Raises :class:`StoreError` with the path on any
    failure (a full disk included), leaving nothing under the final name.
    ``durable=False`` skips both fsyncs: for files whose durability a later
    :func:`sync` before the manifest ensures (the manifest alone commits).
    ``dir_fd``: the directory, opened by the caller (``path`` then only names
    the file in messages; its last component is the name in ``dir_fd``).
    ``kick``: start the disk on every that many bytes as they are written (:func:`write_chunks`;
    durable writes only: a file left to a later :func:`sync` is not pushed out early); ``stable``: the
    chunks do not change until this returns (:func:`write_chunks`). ``after_copy``: called once every
    chunk is written (nothing reads them again), before the fsync (a forked snapshot lets go of the
    job's pages there: :mod:`gangd.ckptlib.letgo`); ``copied``: see :func:`write_chunks`. ``direct``:
    the chunks (a :class:`Streamed` one's too) before the first callable one are written around the
    page cache where the file system allows it (:class:`gangd.directio.Appender`; ``kick`` is then moot for them;
    ``False`` on the write path of a program that set ``GANGD_CKPT_DIRECT=0``: :func:`gangd.directio.wanted`).
    """
    path = Path(path)
    name, tmp = path.name, f".{path.name}.tmp"
    digest = hasher()
    own_fd = dir_fd is None
    try:
        if dir_fd is None:  # own_fd
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.unlink(tmp, dir_fd=dir_fd)  # a leftover of a crash (O_EXCL below refuses anything already there)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
                appender = directio.Appender(fd) if direct else None
                try:
                    size = write_chunks(fd, chunks, digest, kick=kick if durable else 0, stable=stable, copied=copied,
                                        direct=appender)
                finally:
                    if appender is not None:
                        appender.abort()  # (its thread stopped before the fd is closed; nothing left to do after a close)
                if after_copy is not None:
                    after_copy()
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            if durable:
                os.fsync(dir_fd)
        except BaseException:  # (a failing chunk -- a codec's error in a Streamed one -- leaves no temporary file either)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        finally:
            if own_fd:
                os.close(dir_fd)
    except OSError as exc:
        raise StoreError(describe_os_error(exc, path)) from None
    return size, digest.hexdigest()


def open_regular(path: Path) -> int:
    """An fd of ``path`` if it is a regular file — never through a symlink, never
    blocking on a FIFO (the daemon reads files in directories users control)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def open_generation(root: Path, directory: Path) -> int:
    """An fd of a generation's directory ``<root>/job-L/gen-G`` (root's):
    each component opened from the trusted root down, no link followed."""
    root_fd = safefs.open_trusted_dir(root)
    try:
        job = safefs.open_dir_at(root_fd, directory.parent.name, root)
    finally:
        os.close(root_fd)
    try:
        return safefs.open_dir_at(job, directory.name, directory.parent)
    finally:
        os.close(job)


def room_for(fd: int, incoming: int, reserve: int) -> tuple[bool, int, int]:
    """Whether the file system of ``fd`` takes ``incoming`` more bytes and
    still keeps ``reserve`` free (at most a quarter of it: a small disk still
    takes checkpoints); also the bytes free and the reserve applied."""
    vfs = os.fstatvfs(fd)
    reserve = min(reserve, vfs.f_blocks * vfs.f_frsize // 4)
    free = vfs.f_bavail * vfs.f_frsize
    return free >= incoming + reserve, free, reserve


def open_in(dir_fd: int | None, name: str, directory: Path) -> int:
    """An fd of the regular file ``name`` (may have a subdirectory: ``ranks/...``)
    under ``dir_fd`` — no component followed through a link, no FIFO opened.
    ``dir_fd`` None: ``directory / name`` by path (a program's own files)."""
    if dir_fd is None:
        return open_regular(Path(directory) / name)
    *dirs, leaf = name.split("/")
    fd, where, owned = dir_fd, Path(directory), False
    try:
        for part in dirs:
            sub = safefs.open_dir_at(fd, part, where, trusted=False)
            if owned:
                os.close(fd)
            fd, where, owned = sub, where / part, True
        return safefs.open_regular_at(fd, leaf, where)
    except safefs.UnsafePath as exc:
        raise OSError(errno.EINVAL, str(exc)) from None
    finally:
        if owned:
            os.close(fd)


def sync(directory: Path, names: Iterable[str], *, dir_fd: int | None = None) -> None:
    """fsync files written with ``durable=False``, then their directory."""
    for name in names:
        fd = open_in(dir_fd, name, directory)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if dir_fd is None:
        fsync_dir(directory)
    else:
        os.fsync(dir_fd)


def checksum_fd(fd: int) -> tuple[int, str]:
    """(size, checksum) of an open file, read from its start in CHUNK pieces."""
    digest = hasher()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := os.preadv(fd, [buf], size):
        digest.update(view[:n])
        size += n
    return size, digest.hexdigest()


def checksum_file(path: Path) -> tuple[int, str]:
    fd = open_regular(path)
    try:
        return checksum_fd(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------ manifests


MAX_NEEDS = 64  # generations one file may need (a restore chain; chain_max is far below it)


@dataclass
class Manifest:
    """A node's commit of a generation.

    ``needs`` (format 2): for a file that is a delta (issue 17), every older
    generation a restore of it reads, newest first (its *links*; each lists
    the same file name in its own MANIFEST on this node). A file not in
    ``needs`` is whole. A manifest with no delta file is written as format 1,
    byte for byte what daemons wrote before deltas existed, so full
    generations stay readable by every daemon and tool of a cluster being
    upgraded; format 1 is read as "nothing needed"."""

    lineage: int
    gen: int
    node: str
    iteration: int
    files: dict[str, list]  # name -> [size, checksum]
    ranks: list[int]
    committed: float
    needs: dict[str, list[int]] = field(default_factory=dict)  # name -> generations its restore reads, newest first

    def links(self, name: str) -> list[int]:
        """The generations a restore of ``name`` reads besides this one ([]: whole)."""
        return list(self.needs.get(name, ()))

    def pack(self) -> bytes:
        fields = {"lineage": self.lineage, "gen": self.gen, "node": self.node, "iteration": self.iteration,
                  "files": self.files, "ranks": self.ranks, "committed": self.committed}
        if any(self.needs.values()):
            return msgpack.packb({"format": FORMAT_DELTA, **fields, "needs": {k: list(v) for k, v in self.needs.items() if v}}, use_bin_type=True)
        return msgpack.packb({"format": FORMAT, **fields}, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes, where: Path) -> Manifest:
        try:
            raw = msgpack.unpackb(data, raw=False)
            fmt = raw.pop("format")
            if fmt not in (FORMAT, FORMAT_DELTA):
                raise StoreError(f"{where}: manifest format {_show(fmt)} is not supported (this daemon reads {FORMAT} and {FORMAT_DELTA})")
            if fmt == FORMAT and "needs" in raw:
                raise ValueError("a format 1 manifest has no 'needs'")
            manifest = cls(**raw)
            ints = (manifest.lineage, manifest.gen, manifest.iteration, *manifest.ranks)
            if not (all(type(v) is int for v in ints) and isinstance(manifest.node, str)
                    and isinstance(manifest.committed, (int, float)) and isinstance(manifest.files, dict)
                    and all(isinstance(k, str) and isinstance(v, list) and len(v) == 2 and type(v[0]) is int
                            and 0 <= v[0] < 1 << 50 and isinstance(v[1], str) for k, v in manifest.files.items())):
                raise ValueError("fields of the wrong type")
            _check_needs(manifest)
            return manifest
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a manifest is user-writable: any garbage (msgpack errors, wrong keys or types) is a StoreError
            raise StoreError(f"{where}: unreadable manifest ({type(exc).__name__}: {exc})") from None


def _show(value: object) -> str:
    return repr(value)[:40]


def _check_needs(manifest: Manifest) -> None:
    """``needs`` names listed files, each with older generations, newest first, none twice."""
    needs = manifest.needs
    if not isinstance(needs, dict) or len(needs) > len(manifest.files):
        raise ValueError("'needs' must map listed files to generations")
    for name, gens in needs.items():
        if name not in manifest.files:
            raise ValueError(f"'needs' names {_show(name)}, which the manifest does not list")
        if not isinstance(gens, list) or len(gens) > MAX_NEEDS or not all(type(g) is int and 1 <= g < manifest.gen for g in gens):
            raise ValueError(f"'needs' of {_show(name)} must be at most {MAX_NEEDS} generations older than {manifest.gen}")
        if any(a <= b for a, b in zip(gens, gens[1:], strict=False)):
            raise ValueError(f"'needs' of {_show(name)} must be newest first, each generation once")


def write_manifest(directory: Path, manifest: Manifest, owner: tuple[int, int] | None = None, *, dir_fd: int | None = None) -> None:
    write_atomic(directory / MANIFEST, [manifest.pack()], mode=0o600, owner=owner, dir_fd=dir_fd)


def read_manifest(directory: Path, *, dir_fd: int | None = None, owner: int | None = None) -> Manifest:
    """The manifest of a generation: read to :data:`MAX_MANIFEST` bytes, never
    through a link; ``dir_fd``: the generation's directory, opened by the
    caller; ``owner``: the file must belong to that uid (the daemon's own)."""
    path = Path(directory) / MANIFEST
    try:
        data = safefs.read_bounded_at(dir_fd, MANIFEST if dir_fd is not None else str(path), MAX_MANIFEST, directory, owner=owner)
    except FileNotFoundError:
        raise StoreError(f"{path} is missing: this node never committed the generation") from None
    except safefs.UnsafePath as exc:
        raise StoreError(f"refusing {path}: {exc}") from None
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}") from None
    return Manifest.unpack(data, path)


def verify(directory: Path, names: Iterable[str] | None = None, *, dir_fd: int | None = None, owner: int | None = None) -> list[str]:
    """Check the files of a committed generation against its manifest.

    Returns one line per problem, each naming the file ("" list: intact).
    ``names`` limits the check to some files (default: every file listed).
    ``dir_fd``/``owner``: as for :func:`read_manifest`.
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory, dir_fd=dir_fd, owner=owner)
    except StoreError as exc:
        return [str(exc)]
    problems = []
    for name in names if names is not None else manifest.files:
        path = directory / name
        if name not in manifest.files:
            problems.append(f"{path} is not in the manifest")
            continue
        size, digest = manifest.files[name]
        try:
            fd = open_in(dir_fd, name, directory)
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        except OSError as exc:
            problems.append(f"{path} cannot be read: {exc.strerror}")
            continue
        try:
            actual = os.fstat(fd).st_size
            if actual != size:  # (checked first: never read more than the manifest says)
                problems.append(f"{path} is truncated or grew: {actual} bytes, the manifest says {size}")
                continue
            _, found = checksum_fd(fd)
        except OSError as exc:
            problems.append(f"{path} cannot be read: {exc.strerror}")
            continue
        finally:
            os.close(fd)
        if found != digest:
            problems.append(f"{path} is corrupted: checksum {found[:16]}… does not match the manifest's {digest[:16]}…")
    return problems


def remove(directory: Path) -> None:
    import shutil  # (here: its import pulls in bz2, lzma and zlib, which a rank's start-up need not pay)

    shutil.rmtree(directory, ignore_errors=True)


def generations(root: Path, lineage: int) -> list[int]:
    """Generation numbers present on this disk (committed or not), ascending."""
    out = []
    try:
        entries = os.listdir(job_dir(root, lineage))
    except OSError:
        return []
    for entry in entries:
        if entry.startswith("gen-") and entry[4:].isdigit():
            out.append(int(entry[4:]))
    return sorted(out)
