"""XOR parity over a set of nodes' generation files: encode, and rebuild one lost member.

SCR's XOR scheme. A member's *data* is its generation's files (every file
its MANIFEST lists, in sorted-name order) concatenated, zero-padded to
``(n - 1) · chunk`` bytes, where ``chunk = ceil(largest member's data / (n - 1))``.
Member ``i``'s data is ``n - 1`` chunks; its chunk ``s`` goes into the parity
of member ``(i + s + 1) mod n``, so every member ``j`` stores

    P_j = XOR over i ≠ j of chunk_i[(j - i - 1) mod n]

(a reduce-scatter: every member's parity is ``chunk`` bytes, ``1/(n - 1)`` of
its data). A lost member ``x`` comes back from the survivors: its chunk ``s``
is ``P_j`` (``j = (x + s + 1) mod n``) XOR the other survivors' chunks for
``j``, and its own parity is recomputed from their data.

Each member keeps, next to its parity, every member's manifest
(``redundancy/xor.meta``): the rebuilt files are checked against the lost
member's manifest — the end-to-end check — and each parity's own checksum
says *which* node's parity rotted when they do not match.

Everything streams in :data:`BLOCK`-sized pieces (memory ``O(n · BLOCK)``
whatever the files' sizes), XORs with numpy in place (``out=``), reads files
without following links, and writes under temporary names, fsynced,
renamed; a rebuilt generation appears under its final name whole or not at
all. A parity is computed and written at once: the XOR fills one of
:data:`WRITE_DEPTH` buffers of :data:`WRITE_BLOCK` bytes while a writer
thread hashes and writes (O_DIRECT) the previous ones, so the network the
sources wait on, the XOR and the disk overlap (profiled on the benchmark:
the parity's writes, in 1 MiB pieces after each XOR, were a third of the
redundancy phase). Sources are
anything with ``blocks(start, length)``: a local directory
(:class:`NodeData`, :class:`ParityFile`) or a peer's stream
(:mod:`gangd.redundancy.transfer`). All of it is blocking file I/O: the
daemon runs it in a thread (``trio.to_thread.run_sync``); a peer's source
reads its bulk socket in that same thread (it dials there too), so a
parity's transfers cost no thread of their own on the puller's side.

What a parity costs (``bench/recovery.py``: 8 nodes, one XOR set of 8, on
2 CPUs shared by the 8 "nodes" and by other work, load 10-20): each node
pulls a slice from each of its 7 peers and serves one to each, 14
transfers, one per peer pair and direction; nothing to batch. Their
control (a channel request, a ticket, the handshake, a connection, the
hand-offs between the event loop and threads) is a fixed cost per node
and generation: with the hand-offs cut to one per side and transfer
(:mod:`gangd.redundancy.bulk`), CPU per MiB of the redundancy phase went
from 13.3-16.5 to 10.6-11.3 ms at 4 MiB per node (2 runs each), 4.2-6.0
to 3.6-4.5 at 16 MiB (4 each), and at 128 MiB from 1.75-2.03 to
1.66-1.91 (4 each: within this machine's noise), alternating with the code
before in the same session. At 128 MiB the bytes dominate: reading them
from the page cache, sending, receiving, hashing and XORing them costs
~0.8-1.2 ms/MiB of CPU here, about what the local write itself costs
(0.9-1.9 ms/MiB in those runs). While the CPUs and not the disk bound a
run (here, always: 8 nodes on 2 CPUs), xor's ratio to a local write stays
near local / (local + redundancy) CPU — 0.4-0.7 in run in those runs, on
either code — whatever the control costs: the 0.75 target is out of reach
on this machine (a cluster's nodes each have CPUs of their own; the
bench's ``--alone`` mode is the nearest this machine gets to one).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack

from .. import ckptstore, safefs
from ..ckptstore import Manifest, StoreError
from ..directio import DirectFile, aligned_buffer

BLOCK = 1 << 20
REDUNDANCY_DIR = "redundancy"
PARITY = "xor.parity"
META = "xor.meta"
FORMAT = 1
#: A meta holds up to a set's manifests (k ≤ 64 here): read to this limit.
MAX_META = 64 << 20
MAX_SET = 64
#: Bytes a source asks the kernel to read ahead when it opens (:meth:`NodeData.advise`).
ADVISE = 16 << 20


class RebuildError(StoreError):
    """A member cannot be rebuilt or parity cannot be written; the message names node and path."""


class Damaged(RebuildError):
    """What a rebuild reads is there but wrong (a parity, a partner copy or a
    survivor's data missing, of the wrong size, or not matching its checksum):
    unlike a peer that went away, it does not heal, and the generation is no
    longer protected (the coordinator records it: :meth:`Restarts._rebuild`)."""


class Source(Protocol):
    def blocks(self, start: int, length: int) -> Iterator[memoryview | bytes]:
        """Bytes ``[start, start + length)`` in pieces of :data:`BLOCK` (the last shorter)."""
        ...


# ---------------------------------------------------------------- layout


def data_files(manifest: Manifest) -> list[tuple[str, int]]:
    """(name, size) of a member's files in the order its data concatenates them."""
    return [(name, manifest.files[name][0]) for name in sorted(manifest.files)]


def data_size(manifest: Manifest) -> int:
    return sum(size for _, size in data_files(manifest))


@dataclass(frozen=True)
class SetLayout:
    sizes: tuple[int, ...]  # every member's data size, in set order

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def chunk(self) -> int:
        return math.ceil(max(self.sizes) / (self.n - 1)) if self.sizes else 0

    def slot(self, holder: int, member: int) -> int:
        """Which chunk of ``member`` is in ``holder``'s parity."""
        if holder == member:
            raise ValueError("a member's own chunks are in the others' parity, not its own")
        return (holder - member - 1) % self.n

    def holder(self, member: int, slot: int) -> int:
        return (member + slot + 1) % self.n


# ---------------------------------------------------------------- meta


@dataclass(frozen=True)
class XorMeta:
    """What a member keeps next to its parity: the set, the layout, its
    parity's checksum, and every member's manifest (packed)."""

    lineage: int
    gen: int
    nodes: tuple[str, ...]
    index: int
    sizes: tuple[int, ...]
    parity_size: int
    parity_checksum: str
    manifests: tuple[bytes, ...]

    @property
    def layout(self) -> SetLayout:
        return SetLayout(self.sizes)

    def manifest(self, i: int) -> Manifest:
        return Manifest.unpack(self.manifests[i], Path(f"<manifest of {self.nodes[i]} in xor.meta>"))

    def pack(self) -> bytes:
        return msgpack.packb({"format": FORMAT, "lineage": self.lineage, "gen": self.gen, "nodes": list(self.nodes),
                              "index": self.index, "sizes": list(self.sizes), "parity": [self.parity_size, self.parity_checksum],
                              "manifests": list(self.manifests)}, use_bin_type=True)

    @classmethod
    def unpack(cls, data: bytes, where: Path | str) -> XorMeta:
        try:
            raw = msgpack.unpackb(data, raw=False)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            nodes, sizes, manifests = raw["nodes"], raw["sizes"], raw["manifests"]
            size, checksum = raw["parity"]
            if not (isinstance(nodes, list) and 2 <= len(nodes) <= MAX_SET and all(isinstance(n, str) for n in nodes)
                    and isinstance(sizes, list) and len(sizes) == len(nodes) and all(type(s) is int and s >= 0 for s in sizes)
                    and isinstance(manifests, list) and len(manifests) == len(nodes) and all(isinstance(m, bytes) for m in manifests)
                    and type(raw["index"]) is int and 0 <= raw["index"] < len(nodes)
                    and type(raw["lineage"]) is int and type(raw["gen"]) is int
                    and type(size) is int and isinstance(checksum, str)):
                raise ValueError("fields of the wrong type")
            meta = cls(raw["lineage"], raw["gen"], tuple(nodes), raw["index"], tuple(sizes), size, checksum, tuple(manifests))
            if size != meta.layout.chunk:
                raise ValueError(f"parity of {size} bytes, the layout says {meta.layout.chunk}")
            for i in range(len(nodes)):
                if data_size(meta.manifest(i)) != sizes[i]:
                    raise ValueError(f"member {nodes[i]}'s manifest does not add up to its size {sizes[i]}")
            return meta
        except StoreError as exc:
            raise StoreError(f"{where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 -- a file on disk: any garbage is a StoreError naming it
            raise StoreError(f"{where}: unreadable XOR metadata ({type(exc).__name__}: {exc})") from None


def read_meta(gen_dir: Path) -> XorMeta:
    where = Path(gen_dir) / REDUNDANCY_DIR / META
    fd = _open_dir(Path(gen_dir))
    try:
        try:
            sub = safefs.open_dir_at(fd, REDUNDANCY_DIR, gen_dir, trusted=False)
        except safefs.UnsafePath as exc:
            raise StoreError(f"{where}: {exc}") from None
        try:
            data = safefs.read_bounded_at(sub, META, MAX_META, Path(gen_dir) / REDUNDANCY_DIR)
        except FileNotFoundError:
            raise StoreError(f"{where} is missing: this node holds no parity of the generation") from None
        except (OSError, safefs.UnsafePath) as exc:
            raise StoreError(f"cannot read {where}: {exc}") from None
        finally:
            os.close(sub)
    finally:
        os.close(fd)
    return XorMeta.unpack(data, where)


# ---------------------------------------------------------------- sources


def _open_dir(path: Path) -> int:
    try:
        return os.open(path, safefs.DIR_FLAGS)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror}") from None


class NodeData:
    """A member's data, read from its generation directory: its files
    concatenated (sorted names), zeros past their end. Each file is opened
    without following links and must have the size its manifest says."""

    def __init__(self, directory: Path, manifest: Manifest, *, node: str = "?"):
        self.directory = Path(directory)
        self.node = node
        self.files = data_files(manifest)
        self.starts = []
        pos = 0
        for _, size in self.files:
            self.starts.append(pos)
            pos += size
        self.size = pos
        self._fds: dict[str, int] = {}
        self._dir_fd: int | None = None

    def _fd(self, name: str, size: int) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if self._dir_fd is None:
                self._dir_fd = _open_dir(self.directory)
            path = self.directory / name
            try:
                fd = ckptstore.open_in(self._dir_fd, name, self.directory)
            except FileNotFoundError:
                raise Damaged(f"node {self.node}: {path} is missing") from None
            except OSError as exc:
                raise RebuildError(f"node {self.node}: cannot read {path}: {exc.strerror}") from None
            if (actual := os.fstat(fd).st_size) != size:
                os.close(fd)
                raise Damaged(f"node {self.node}: {path} is {actual} bytes, its manifest says {size}")
            self._fds[name] = fd
        return fd

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the data at ``offset``."""
        done = 0
        want = len(view)
        # first file that ends after offset
        i = _bisect(self.starts, offset)
        while done < want:
            pos = offset + done
            if i >= len(self.files) or pos >= self.size:
                view[done:] = bytes(want - done)
                return
            name, size = self.files[i]
            start = self.starts[i]
            if pos >= start + size:
                i += 1
                continue
            n = min(want - done, start + size - pos)
            got = os.preadv(self._fd(name, size), [view[done : done + n]], pos - start)
            if got != n:
                raise RebuildError(f"node {self.node}: {self.directory / name} shrank while it was read")
            done += n

    def advise(self, start: int, length: int) -> None:
        """Tell the kernel the bytes ``[start, start + length)`` will be read
        (``POSIX_FADV_WILLNEED``, the first :data:`ADVISE` of them: the
        kernel's own read-ahead follows a sequential read): files not in the
        page cache any more are read while the first blocks are sent."""
        end = min(start + min(length, ADVISE), self.size)
        i = _bisect(self.starts, start)
        while i < len(self.files) and self.starts[i] < end:
            name, size = self.files[i]
            lo = max(start, self.starts[i]) - self.starts[i]
            hi = min(end, self.starts[i] + size) - self.starts[i]
            if hi > lo:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(self._fd(name, size), lo, hi - lo, os.POSIX_FADV_WILLNEED)
            i += 1

    def blocks(self, start: int, length: int) -> Iterator[memoryview]:
        buf = memoryview(bytearray(min(BLOCK, max(length, 1))))
        for off in range(0, length, BLOCK):
            n = min(BLOCK, length - off)
            self.read_into(start + off, buf[:n])
            yield buf[:n]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bisect(starts: list[int], offset: int) -> int:
    return max(0, bisect.bisect_right(starts, offset) - 1)


class ParityFile:
    """A member's parity, read whole and in order (the rebuild reads each
    survivor's exactly once), its checksum compared with its meta's at the end."""

    def __init__(self, gen_dir: Path, meta: XorMeta):
        self.path = Path(gen_dir) / REDUNDANCY_DIR / PARITY
        self.gen_dir = Path(gen_dir)
        self.meta = meta
        self.node = meta.nodes[meta.index]

    def blocks(self, start: int, length: int) -> Iterator[memoryview]:
        if (start, length) != (0, self.meta.parity_size):
            raise ValueError("a parity is read whole, in order")
        fd = _open_dir(self.gen_dir)
        try:
            try:
                sub = safefs.open_dir_at(fd, REDUNDANCY_DIR, self.gen_dir, trusted=False)
                try:
                    pfd = safefs.open_regular_at(sub, PARITY, self.path.parent)
                finally:
                    os.close(sub)
            except (OSError, safefs.UnsafePath) as exc:
                raise RebuildError(f"node {self.node}: cannot read its parity {self.path}: {exc}") from None
        finally:
            os.close(fd)
        try:
            if (actual := os.fstat(pfd).st_size) != length:
                raise Damaged(f"node {self.node}: parity {self.path} is {actual} bytes, its meta says {length}")
            digest = ckptstore.hasher()
            buf = memoryview(bytearray(min(BLOCK, max(length, 1))))
            for off in range(0, length, BLOCK):
                n = min(BLOCK, length - off)
                if os.preadv(pfd, [buf[:n]], off) != n:
                    raise RebuildError(f"node {self.node}: parity {self.path} shrank while it was read")
                digest.update(buf[:n])
                yield buf[:n]
            if digest.hexdigest() != self.meta.parity_checksum:
                raise Damaged(f"node {self.node}: parity {self.path} is corrupted: checksum "
                                   f"{digest.hexdigest()[:16]}… does not match its meta's {self.meta.parity_checksum[:16]}…")
        finally:
            os.close(pfd)


# ---------------------------------------------------------------- xor


def warm() -> None:
    """Load what computing parity needs (numpy), ahead of the generation's redundancy phase.

    The daemon starts without numpy (0.25-0.5 s of CPU to import, paid by
    every node start, and most daemons never XOR). The first parity a daemon
    computed paid it inside the redundancy phase, on the path from complete
    to protected, on every node of the set at once. A node calls this in a
    worker thread when a checkpoint of a job that may be XOR-protected
    begins, so the import runs while the ranks agree and write; afterwards
    it costs a dictionary lookup.
    """
    import numpy  # noqa: F401


class XorStreams:
    """Equally long block streams XORed into the caller's buffers, in order.
    Each stream gives :data:`BLOCK`-sized blocks (the last shorter); a view
    to :meth:`fill` is a whole number of blocks (but the last). No memory of
    its own: the XOR lands in the view (numpy, ``out=``), the first stream's
    block copied rather than XORed into zeros (one pass less)."""

    def __init__(self, sources: Sequence[Iterator], length: int, names: Sequence[str] | None = None):
        self.sources, self.length, self.done = list(sources), length, 0
        self.names = list(names) if names is not None else [f"source {k}" for k in range(len(self.sources))]

    def fill(self, view: memoryview) -> None:
        import numpy as np  # (here: a daemon imports this module to start, and numpy is 0.1 s of it)

        acc = np.frombuffer(view, dtype=np.uint8)
        for off in range(0, len(view), BLOCK):
            n = min(BLOCK, len(view) - off)
            if self.done + n > self.length:
                raise RebuildError(f"asked past the end ({self.length} bytes)")
            out = acc[off : off + n]
            if not self.sources:
                out[:] = 0
            for k, src in enumerate(self.sources):
                block = next(src, None)
                if block is None or len(block) != n:
                    raise RebuildError(f"{self.names[k]} gave {0 if block is None else len(block)} bytes at offset {self.done}, expected {n}")
                if k == 0:
                    out[:] = np.frombuffer(block, dtype=np.uint8)
                else:
                    np.bitwise_xor(out, np.frombuffer(block, dtype=np.uint8), out=out)
            self.done += n

    def finish(self) -> None:
        """Every stream at its end (the parity streams check their checksums there)."""
        if self.done != self.length:
            raise RebuildError(f"XOR of {self.done} bytes, {self.length} expected")
        for src in self.sources:
            if next(src, None) is not None:
                raise RebuildError(f"a source gave more than {self.length} bytes")

    def close(self) -> None:
        """Close every stream here, in this thread (a peer's releases its
        transfer through the event loop: it must not be left to the garbage
        collector, which may run it anywhere)."""
        for src in self.sources:
            close = getattr(src, "close", None)
            if close is not None:
                close()


def xor_blocks(sources: Sequence[Iterator], length: int, names: Sequence[str] | None = None) -> Iterator[memoryview]:
    """XOR of equally long block streams, block by block (memory: one block)."""
    acc = aligned_buffer(min(BLOCK, length))
    streams = XorStreams(sources, length, names)
    try:
        while streams.done < length:
            n = min(BLOCK, length - streams.done)
            streams.fill(acc[:n])
            yield acc[:n]
        streams.finish()
    finally:
        streams.close()


def parity_streams(holder: int, layout: SetLayout, data: Sequence[Source | None], nodes: Sequence[str] | None = None) -> XorStreams:
    """Member ``holder``'s parity from the other members' data (``data[holder]`` unused)."""
    c = layout.chunk
    others = [i for i in range(layout.n) if i != holder]
    names = [f"node {nodes[i]}'s data" for i in others] if nodes is not None else None
    return XorStreams([iter(data[i].blocks(layout.slot(holder, i) * c, c)) for i in others], c, names)  # type: ignore[union-attr]


def _redundancy_dir(gen_fd: int, gen_dir: Path) -> int:
    try:
        return safefs.open_dir_at(gen_fd, REDUNDANCY_DIR, gen_dir, create_mode=0o700)
    except safefs.UnsafePath as exc:
        raise RebuildError(str(exc)) from None


def write_parity(gen_dir: Path, meta_base: XorMeta, data: Sequence[Source | None]) -> XorMeta:
    """Compute and store member ``meta_base.index``'s parity in ``gen_dir``
    (``redundancy/xor.parity``, then ``xor.meta`` last: the meta's presence
    is this member's protection). ``meta_base``: everything but the parity's
    checksum. Returns the meta written."""
    gen_dir = Path(gen_dir)
    gen_fd = _open_dir(gen_dir)
    try:
        sub = _redundancy_dir(gen_fd, gen_dir)
        try:
            try:
                os.unlink(META, dir_fd=sub)  # a rewrite is unprotected until its new meta lands
            except FileNotFoundError:
                pass
            where = gen_dir / REDUNDANCY_DIR
            size, checksum = _write_direct(sub, PARITY, where, parity_streams(meta_base.index, meta_base.layout, data, meta_base.nodes))
            meta = XorMeta(meta_base.lineage, meta_base.gen, meta_base.nodes, meta_base.index, meta_base.sizes, size, checksum, meta_base.manifests)
            ckptstore.write_atomic(where / META, [meta.pack()], dir_fd=sub)
            return meta
        finally:
            os.close(sub)
    finally:
        os.close(gen_fd)


#: Bytes per parity write (a multiple of :data:`BLOCK`): few, large requests keep the disk busy.
WRITE_BLOCK = 8 << 20
#: Parity buffers of a write: one being computed while the others wait for, or are in, the disk.
WRITE_DEPTH = 3


class _Writer:
    """A thread hashing and writing the buffers handed to it, in order, while
    the caller computes the next: the XOR (and the network it waits for)
    and the disk work at once. Bounded: :data:`WRITE_DEPTH` buffers of
    ``block`` bytes go round (:meth:`buffer` waits for one the disk is done
    with). A failed write is raised to the caller at its next :meth:`buffer`
    or at :meth:`finish`; the thread keeps returning buffers until told to
    stop, so the caller never waits on a dead writer."""

    def __init__(self, out: DirectFile, digest, block: int, depth: int = WRITE_DEPTH):
        self.out, self.digest = out, digest
        self.free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self.todo: queue.SimpleQueue[tuple[memoryview, int] | None] = queue.SimpleQueue()
        for _ in range(depth):
            self.free.put(aligned_buffer(block))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gangd-parity-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n = item
            if self.error is None:
                try:
                    self.digest.update(buf[:n])
                    self.out.write(buf[:n])
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                    self.error = exc
            self.free.put(buf)

    def buffer(self) -> memoryview:
        buf = self.free.get()
        self._check()
        return buf

    def submit(self, buf: memoryview, n: int) -> None:
        self.todo.put((buf, n))

    def stop(self) -> None:
        if self.thread.is_alive():
            self.todo.put(None)
            self.thread.join()

    def finish(self) -> None:
        self.stop()
        self._check()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error


def _write_direct(dir_fd: int, name: str, where: Path, streams: XorStreams) -> tuple[int, str]:
    """Like :func:`gangd.ckptstore.write_atomic` (a temporary name, fsync,
    rename, fsync of the directory), around the page cache
    (:mod:`gangd.directio`): a parity is read only if a node is
    lost. Computed and written at once (:class:`_Writer`)."""
    tmp = f".{name}.tmp"
    digest = ckptstore.hasher()
    out: DirectFile | None = None
    writer: _Writer | None = None
    done = False
    length = streams.length
    try:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        out = DirectFile(tmp, dir_fd)
        if length:
            with contextlib.suppress(OSError):  # (the blocks of the file at once: O_DIRECT writes then allocate nothing)
                os.posix_fallocate(out.fd, 0, length)
        writer = _Writer(out, digest, min(WRITE_BLOCK, max(length, 1)))
        while streams.done < length:
            n = min(WRITE_BLOCK, length - streams.done)
            buf = writer.buffer()
            streams.fill(buf[:n])
            writer.submit(buf, n)
        writer.finish()
        streams.finish()
        os.fsync(out.fd)
        size = out.off
        out.close()
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        done = True
        os.fsync(dir_fd)
        return size, digest.hexdigest()
    except OSError as exc:
        raise RebuildError(ckptstore.describe_os_error(exc, where / name)) from None
    finally:
        streams.close()
        if writer is not None:
            writer.stop()
        if out is not None:
            out.close()
        if not done:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass


def encode_set(dirs: Sequence[Path], nodes: Sequence[str]) -> list[XorMeta]:
    """Parity for every member of a set whose generation directories are all
    reachable here (one machine: tests, the benchmark; a daemon computes its
    own member's parity with :func:`write_parity` over peers' streams)."""
    manifests = [ckptstore.read_manifest(Path(d)) for d in dirs]
    base = meta_for(manifests, nodes, 0)
    readers = [NodeData(Path(d), m, node=n) for d, m, n in zip(dirs, manifests, nodes, strict=True)]
    try:
        return [write_parity(Path(d), _with_index(base, j), readers) for j, d in enumerate(dirs)]
    finally:
        for r in readers:
            r.close()


def meta_for(manifests: Sequence[Manifest], nodes: Sequence[str], index: int) -> XorMeta:
    """The meta of member ``index`` before its parity is written."""
    if len(manifests) != len(nodes) or not 2 <= len(nodes) <= MAX_SET:
        raise RebuildError(f"an XOR set has 2 to {MAX_SET} members, each with a manifest")
    first = manifests[0]
    for m in manifests:
        if (m.lineage, m.gen) != (first.lineage, first.gen):
            raise RebuildError(f"the set's manifests are of different generations ({m.node}: job-{m.lineage}/gen-{m.gen})")
    sizes = tuple(data_size(m) for m in manifests)
    layout = SetLayout(sizes)
    return XorMeta(first.lineage, first.gen, tuple(nodes), index, sizes, layout.chunk, "", tuple(m.pack() for m in manifests))


def _with_index(meta: XorMeta, index: int) -> XorMeta:
    return XorMeta(meta.lineage, meta.gen, meta.nodes, index, meta.sizes, meta.parity_size, meta.parity_checksum, meta.manifests)


# ---------------------------------------------------------------- rebuild


class _Take:
    """Cut a stream of blocks into consecutive pieces of given lengths."""

    def __init__(self, blocks: Generator):
        self.blocks = blocks
        self.carry = b""

    def take(self, size: int) -> Iterator[bytes | memoryview]:
        left = size
        while left:
            if not self.carry:
                block = next(self.blocks, None)
                if block is None:
                    raise RebuildError("the rebuilt data ended early")
                if len(block) <= left:
                    left -= len(block)
                    yield block
                    continue
                self.carry = bytes(block)  # (the block's buffer is reused by its producer)
            piece, self.carry = self.carry[:left], self.carry[left:]
            left -= len(piece)
            yield piece

    def drain(self) -> None:
        if self.carry:
            self.carry = b""
        for _ in self.blocks:
            pass


def rebuild(lost: int, meta: XorMeta, data: Sequence[Source | None], parity: Sequence[Source | None], dest: Path,
            *, owner: tuple[int, int] | None = None, own_parity: bool = True) -> Manifest:
    """Rebuild member ``lost`` of the set ``meta`` (any survivor's) into the
    new directory ``dest``: its files, its MANIFEST (last) and its parity and
    meta, each checked (files against the lost member's manifest, every
    parity read against its own checksum). ``data[i]``/``parity[i]``: the
    survivors' (None for ``lost``). ``owner``: of ``ranks/`` and the rank
    files in it (the job's user). Written under ``.<dest>.partial`` and
    renamed: ``dest`` appears whole or not at all. ``own_parity=False``: not
    the lost member's parity and meta (a second pass over every survivor's
    data; a restart that moves the files into a live generation needs only
    them). Raises :class:`RebuildError` naming what failed."""
    manifest = meta.manifest(lost)
    node = meta.nodes[lost]
    dest = Path(dest)
    partial = dest.parent / f".{dest.name}.partial"
    parent_fd = _open_dir(dest.parent)
    try:
        safefs.rmtree_at(parent_fd, partial.name)
        os.mkdir(partial.name, 0o711, dir_fd=parent_fd)
        gen_fd = os.open(partial.name, safefs.DIR_FLAGS, dir_fd=parent_fd)
        try:
            try:
                _rebuild_into(gen_fd, partial, lost, meta, manifest, data, parity, owner, own_parity)
            except RebuildError as exc:
                raise type(exc)(f"cannot rebuild node {node}'s job-{meta.lineage}/gen-{meta.gen}: {exc}") from None
            except OSError as exc:
                raise RebuildError(f"cannot rebuild node {node}'s files in {dest}: {ckptstore.describe_os_error(exc, partial)}") from None
            os.fsync(gen_fd)
        finally:
            os.close(gen_fd)
        safefs.rmtree_at(parent_fd, dest.name)
        os.rename(partial.name, dest.name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        os.fsync(parent_fd)
    except BaseException:
        safefs.rmtree_at(parent_fd, partial.name)
        raise
    finally:
        os.close(parent_fd)
    return manifest


def _rebuild_into(gen_fd: int, where: Path, lost: int, meta: XorMeta, manifest: Manifest,
                  data: Sequence[Source | None], parity: Sequence[Source | None], owner: tuple[int, int] | None,
                  own_parity: bool = True) -> None:
    layout = meta.layout
    n, c = layout.n, layout.chunk
    survivors = [i for i in range(n) if i != lost]
    if any(data[i] is None or parity[i] is None for i in survivors):
        raise RebuildError("every survivor's data and parity are needed")

    def lost_data() -> Generator[memoryview, None, None]:
        for s in range(n - 1):
            j = layout.holder(lost, s)
            streams = [iter(parity[j].blocks(0, c))]  # type: ignore[union-attr]
            streams += [iter(data[i].blocks(layout.slot(j, i) * c, c)) for i in survivors if i != j]  # type: ignore[union-attr]
            names = [f"node {meta.nodes[j]}'s parity"] + [f"node {meta.nodes[i]}'s data" for i in survivors if i != j]
            yield from xor_blocks(streams, c, names)

    stream = _Take(lost_data())
    problems: list[str] = []
    dirs: dict[str, int] = {}
    offset = 0  # (of the file being rebuilt in the lost member's data: named if its bytes cannot be had)
    try:
        for name, size in data_files(manifest):
            *parts, leaf = name.split("/")
            if len(parts) > 1 or not leaf or any(p in ("", ".", "..") for p in (*parts, leaf)):
                raise RebuildError(f"{name!r} in the manifest is not a file name the daemon writes")
            fd = gen_fd
            if parts:
                fd = dirs.get(parts[0]) or _subdir(gen_fd, parts[0], where, owner, dirs)
            file_owner = owner if parts else None
            try:
                got_size, got = ckptstore.write_atomic(where / name, stream.take(size), owner=file_owner, durable=True, dir_fd=fd)
            except RebuildError as exc:  # (a survivor's stream: what of the lost node's could not be rebuilt, then why)
                raise type(exc)(f"its {name} ({size} bytes at offset {offset} of its data) could not be rebuilt: {exc}") from None
            offset += size
            want_size, want = manifest.files[name]
            if (got_size, got) != (want_size, want):
                problems.append(f"{name}: rebuilt checksum {got[:16]}… does not match the manifest's {want[:16]}…")
        stream.drain()  # (reads the parities to their end: their checksums are checked there)
    finally:
        stream.blocks.close()  # (a failed rebuild's peer streams closed here, not by the garbage collector)
        for fd in dirs.values():
            os.close(fd)
    if problems:
        raise Damaged("the rebuilt files do not match the lost node's manifest (" + "; ".join(problems) + ")")
    # Its own parity, from the survivors' data, and its meta; then the MANIFEST last.
    if own_parity:
        write_parity(where, _with_index(meta, lost), data)
    ckptstore.write_manifest(where, manifest, dir_fd=gen_fd)


def _subdir(gen_fd: int, name: str, where: Path, owner: tuple[int, int] | None, dirs: dict[str, int]) -> int:
    os.mkdir(name, 0o700, dir_fd=gen_fd)
    fd = os.open(name, safefs.DIR_FLAGS, dir_fd=gen_fd)
    if owner is not None:
        os.fchown(fd, *owner)
    dirs[name] = fd
    return fd


def rebuild_local(dirs: Sequence[Path | None], lost: int, dest: Path, *, owner: tuple[int, int] | None = None) -> Manifest:
    """Rebuild member ``lost`` from survivors whose directories are all here
    (``dirs[lost]`` None or gone): tests, the benchmark, one-machine clusters."""
    survivors = [i for i, d in enumerate(dirs) if i != lost and d is not None]
    if len(survivors) != len(dirs) - 1:
        raise RebuildError("every survivor's directory is needed")
    metas = {i: read_meta(Path(dirs[i])) for i in survivors}  # type: ignore[arg-type]
    meta = metas[survivors[0]]
    for i, m in metas.items():
        if (m.nodes, m.sizes, m.manifests, m.index) != (meta.nodes, meta.sizes, meta.manifests, i):
            raise RebuildError(f"node {meta.nodes[i]}'s XOR metadata does not agree with node {meta.nodes[survivors[0]]}'s")
    data: list[NodeData | None] = [None] * len(dirs)
    parity: list[ParityFile | None] = [None] * len(dirs)
    for i in survivors:
        data[i] = NodeData(Path(dirs[i]), meta.manifest(i), node=meta.nodes[i])  # type: ignore[arg-type]
        parity[i] = ParityFile(Path(dirs[i]), metas[i])  # type: ignore[arg-type]
    try:
        return rebuild(lost, meta, data, parity, dest, owner=owner)
    finally:
        for d in data:
            if d is not None:
                d.close()
