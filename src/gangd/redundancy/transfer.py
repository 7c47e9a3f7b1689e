"""Streaming checkpoint bytes between daemons: a file, or a slice of a node's data.

Partner copies, XOR parity, rebuilds and restarts on other nodes all move
generation files from one daemon to another. The fast path (``bulk=`` on
every function here; the peer op ``ckpt_bulk_read``) keeps the request on
the channel and moves the bytes on a bulk connection (:mod:`.bulk`); without
it they ride the peers' channels (:mod:`gangd.rpc`), 3-8x slower (the
channel packs, frames and credits every 128 KiB on the daemons' event
loops). On the channel path the receiver *pulls* with a streamed request
(``ckpt_file_read`` for a file, ``ckpt_data_read`` for a slice of a node's
concatenated data, the XOR scheme's unit), so flow control is the
channel's credit: the sender emits a chunk only once the receiver has taken
the previous ones, and the receiver holds at most ``depth`` chunks waiting
for the disk. Memory per transfer: ``(depth + 2) · CHUNK`` on either side,
whatever the file's size.

A peer's bytes are hostile until checked. The receiver knows what it wants
before it asks — a size and a checksum from a manifest it already holds —
and refuses, before writing a byte past it, a chunk out of order, larger
than ``CHUNK``, beyond the declared size, whose own xxh3-64 does not match,
or a stream that ends short, claims another size or checksum, or goes on
after its end. The file lands under a temporary name, fsynced, renamed, the
directory fsynced; a refused or cut transfer leaves nothing under the final
name. The sender opens only names of the form ``[ranks/]name`` below
``<root>/job-<L>/gen-<G>/`` (``redundancy/`` too), each component without
following a link, so a request cannot make it read outside the job's
checkpoint directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio
import xxhash

from .. import ckptstore, safefs
from ..ckptstore import Manifest, StoreError
from ..rpc import Channel, RemoteError, Stream, leaf_error
from . import bulk as bulkpath
from . import xor
from .bulk import Bulk, BulkServer

if bulkpath.CHUNK != xor.BLOCK:  # RemoteData hands the bulk chunks to the XOR code as its blocks
    raise ImportError("gangd.redundancy.bulk.CHUNK must equal gangd.redundancy.xor.BLOCK")

#: Bytes per stream item: half the channel's credit window
#: (:data:`gangd.protocol.DEFAULT_WINDOW`), so two are in flight and the
#: receiver's credit comes back before the sender runs dry.
CHUNK = 128 << 10
#: Bytes read from the disk at a time (cut into items).
READ_BLOCK = 1 << 20
#: Items waiting for the receiver's disk.
DEFAULT_DEPTH = 16
#: Bytes written in one call when items have piled up.
WRITE_BATCH = 2 << 20
#: A file name component in a generation (``ranks/rank-3.state``, ``redundancy/xor.parity``).
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
#: The files of a generation: ``[redundancy/partner-<node>/][ranks/]<leaf>`` or ``redundancy/<leaf>``.
_NAME = re.compile(r"(redundancy/(partner-[A-Za-z0-9][A-Za-z0-9._-]{0,62}/)?)?(ranks/)?[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
MAX_LENGTH = 1 << 50

log = logging.getLogger("gangd.transfer")


class TransferError(RemoteError):
    """A transfer refused or failed; the message names the peer and the file."""

    def __init__(self, message: str):
        super().__init__("transfer_failed", message)


class Mismatch(TransferError):
    """Every byte the peer sent arrived as it sent them, and they are not what
    the manifest says: the peer's file is damaged (not the transfer)."""


def chunk_hash(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def check_name(name: object) -> str:
    """``name`` if it is a file a generation may hold, else a refusal."""
    if not isinstance(name, str):
        raise RemoteError("bad_request", "a file name is a string")
    if not _NAME.match(name) or "/../" in f"/{name}/" or "/./" in f"/{name}/":
        raise RemoteError("bad_request", f"{name[:200]!r} is not a file of a checkpoint generation")
    return name


def _int(args: dict, key: str, low: int = 0, high: int = MAX_LENGTH) -> int:
    value = args.get(key)
    if type(value) is not int or not low <= value <= high:
        raise RemoteError("bad_request", f"{key} must be an integer from {low} to {high}")
    return value


@dataclass(frozen=True)
class Where:
    """A generation on this node, from a request's (hostile) arguments."""

    lineage: int
    gen: int

    @classmethod
    def from_args(cls, args: dict) -> Where:
        return cls(_int(args, "lineage"), _int(args, "gen"))

    def open(self, root: Path) -> tuple[int, Path]:
        """An fd of ``<root>/job-L/gen-G`` reached without following a link."""
        directory = ckptstore.gen_dir(root, self.lineage, self.gen)
        try:
            root_fd = os.open(root, safefs.DIR_FLAGS)
        except OSError as exc:
            raise RemoteError("no_such_generation", f"{root}: {exc.strerror}") from None
        try:
            job_fd = safefs.open_dir_at(root_fd, f"job-{self.lineage}", root, trusted=False)
            try:
                return safefs.open_dir_at(job_fd, f"gen-{self.gen}", directory.parent, trusted=False), directory
            finally:
                os.close(job_fd)
        except safefs.UnsafePath as exc:
            raise RemoteError("no_such_generation", str(exc)) from None
        finally:
            os.close(root_fd)


# ---------------------------------------------------------------- serving


def _open_sendable(root: Path, where: Where, name: str) -> tuple[int, int, Path]:
    """(fd, size, path) of a generation's file ``name`` that may be sent to a
    peer: inside the generation, no link followed, no other names."""
    gen_fd, directory = where.open(root)
    try:
        fd = ckptstore.open_in(gen_fd, name, directory)
    except FileNotFoundError:
        raise RemoteError("no_such_file", f"{directory / name} does not exist") from None
    except OSError as exc:
        raise RemoteError("no_such_file", f"cannot read {directory / name}: {exc.strerror}") from None
    finally:
        os.close(gen_fd)
    return fd, _single_link(fd, directory / name).st_size, directory / name


def _file_blocks(root: Path, where: Where, name: str) -> tuple[int, _Owned]:
    fd, size, path = _open_sendable(root, where, name)

    def blocks() -> Iterator[memoryview]:
        buf = memoryview(bytearray(READ_BLOCK))
        off = 0
        while off < size:
            n = os.preadv(fd, [buf[: min(READ_BLOCK, size - off)]], off)
            if n == 0:
                raise RemoteError("transfer_failed", f"{path} shrank while it was sent")
            yield buf[:n]
            off += n

    return size, _Owned(blocks(), lambda: os.close(fd))


def _data_manifest(directory: Path, as_protected: bool) -> Manifest:
    """The manifest whose files make this node's data of a generation: its
    MANIFEST, or (``as_protected``: a rebuild reading a survivor of an XOR
    set) the one its ``xor.meta`` keeps — the files its parity was computed
    over, even if a restart has added files to the MANIFEST since."""
    try:
        if as_protected:
            meta = xor.read_meta(directory)
            return meta.manifest(meta.index)
        return ckptstore.read_manifest(directory)
    except StoreError as exc:
        raise RemoteError("no_such_generation", str(exc)) from None


def _protected(args: dict) -> bool:
    value = args.get("protected", False)
    if type(value) is not bool:
        raise RemoteError("bad_request", "'protected' must be true or false")
    return value


def _data_blocks(root: Path, where: Where, start: int, length: int, as_protected: bool = False) -> _Owned:
    gen_fd, directory = where.open(root)
    os.close(gen_fd)
    data = xor.NodeData(directory, _data_manifest(directory, as_protected))
    return _Owned(iter(data.blocks(start, length)), data.close)


class _Owned:
    """An iterator and what its ``close`` releases — even if it never started
    (a generator's ``finally`` would not run then)."""

    def __init__(self, it: Iterator[memoryview], release):
        self.it, self.release = it, release

    def __iter__(self):
        return self

    def __next__(self) -> memoryview:
        return next(self.it)

    def close(self) -> None:
        try:
            getattr(self.it, "close", lambda: None)()
        finally:
            self.release()


def _read_ahead(blocks: _Owned, digest) -> list[tuple[bytes, int]] | None:
    """The next block, cut into items with their hashes (in a worker thread)."""
    block = next(blocks, None)
    if block is None:
        return None
    data = bytes(block)
    digest.update(data)
    pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    return [(piece, chunk_hash(piece)) for piece in pieces]


async def _produce(emit, blocks: _Owned, size: int) -> None:
    """Emit ``blocks`` as items while the next block is read (one block
    ahead): the disk and the link work at once."""
    digest = ckptstore.hasher()
    off = 0
    send, receive = trio.open_memory_channel[list](1)

    async def read() -> None:
        async with send:
            try:
                while (pieces := await trio.to_thread.run_sync(_read_ahead, blocks, digest)) is not None:
                    await send.send(pieces)
            except StoreError as exc:
                raise RemoteError("transfer_failed", str(exc)) from None
            except OSError as exc:
                raise RemoteError("transfer_failed", f"reading for the transfer: {exc.strerror or exc}") from None

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            async with receive:
                async for pieces in receive:
                    for data, h in pieces:
                        await emit({"o": off, "d": data, "h": h})
                        off += len(data)
    except BaseExceptionGroup as group:
        raise leaf_error(group) from None
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(blocks.close)
    await emit({"end": off, "sum": digest.hexdigest()})


async def handle_file_read(root: Path, args: dict) -> Stream:
    """Peer op ``ckpt_file_read {lineage, gen, name}``: stream a generation's
    file (``root``: this node's checkpoint root). Items ``{o, d, h}`` then
    ``{end, sum}`` (size, XXH3-128)."""
    where, name = Where.from_args(args), check_name(args.get("name"))
    size, blocks = await trio.to_thread.run_sync(_file_blocks, root, where, name)
    return Stream(lambda emit: _produce(emit, blocks, size))


async def handle_data_read(root: Path, args: dict) -> Stream:
    """Peer op ``ckpt_data_read {lineage, gen, start, length}``: stream bytes
    ``[start, start + length)`` of this node's data of a generation (its
    files concatenated, zeros past the end: :class:`gangd.redundancy.xor.NodeData`)."""
    where, start, length = Where.from_args(args), _int(args, "start"), _int(args, "length")
    blocks = await trio.to_thread.run_sync(_data_blocks, root, where, start, length, _protected(args))
    return Stream(lambda emit: _produce(emit, blocks, length))


def _open_file(root: Path, where: Where, name: str) -> bulkpath.Source:
    fd, size, path = _open_sendable(root, where, name)
    return bulkpath.file_source(fd, size, str(path))


def _single_link(fd: int, path: Path) -> os.stat_result:
    """``fd``'s stat, refused (and closed) if the file has other names: a
    rank's ``ranks/`` directory is its owner's, and a hard link planted there
    after the commit would have root send another file's bytes to a peer."""
    st = os.fstat(fd)
    if st.st_nlink != 1:
        os.close(fd)
        raise RemoteError("no_such_file", f"{path} has {st.st_nlink} names (a hard link): not a file the checkpoint wrote; refused")
    return st


def _open_data(root: Path, where: Where, start: int, length: int, as_protected: bool = False) -> bulkpath.Source:
    gen_fd, directory = where.open(root)
    os.close(gen_fd)
    data = xor.NodeData(directory, _data_manifest(directory, as_protected))
    try:
        data.advise(start, length)
    except StoreError as exc:
        data.close()
        raise RemoteError("transfer_failed", str(exc)) from None

    def read_into(offset: int, view: memoryview) -> None:
        try:
            data.read_into(start + offset, view)
        except StoreError as exc:
            raise RemoteError("transfer_failed", str(exc)) from None

    return bulkpath.Source(length, read_into, data.close)


async def handle_bulk_read(server: BulkServer, root: Path, args: dict) -> Stream:
    """Peer op ``ckpt_bulk_read {lineage, gen, name}`` or ``{lineage, gen,
    start, length}``: what ``ckpt_file_read`` / ``ckpt_data_read`` stream,
    sent instead on a bulk connection to ``server``
    (:mod:`gangd.redundancy.bulk`). Items: ``{ticket, port, size}``, then
    ``{end}`` once the bytes are sent."""
    where = Where.from_args(args)
    if "name" in args:
        name = check_name(args.get("name"))
        return await bulkpath.serve(server, lambda: _open_file(root, where, name),
                                    f"{name} of job-{where.lineage}/gen-{where.gen}")
    start, length, as_protected = _int(args, "start"), _int(args, "length"), _protected(args)
    return await bulkpath.serve(server, lambda: _open_data(root, where, start, length, as_protected),
                                f"data [{start}, {start + length}) of job-{where.lineage}/gen-{where.gen}")


# ---------------------------------------------------------------- receiving


async def verified_chunks(items: AsyncIterator, size: int, checksum: str | None, what: str, *, exact: bool = True) -> AsyncIterator[bytes]:
    """The chunks of a peer's stream, each checked before it is handed on:
    in order, at most ``CHUNK``, never past ``size``, its own hash right;
    then the end: exactly ``size`` bytes (``exact=False``: at most) and (if
    given) ``checksum``, and nothing after it."""
    digest = ckptstore.hasher()
    off = 0
    ended = False
    async for item in items:
        if ended:
            raise TransferError(f"{what}: the peer sent more after the end of the file")
        if not isinstance(item, dict):
            raise TransferError(f"{what}: the peer sent a malformed chunk")
        if "end" in item:
            end, got = item.get("end"), item.get("sum")
            if end != off or (exact and off != size):
                raise TransferError(f"{what}: the peer sent {off} bytes and claims {end!r}; {size} were expected")
            mine = digest.hexdigest()
            if got != mine or (checksum is not None and mine != checksum):
                raise (Mismatch if got == mine else TransferError)(f"{what}: checksum {mine[:16]}… of the bytes received does not match "
                                    f"{'the manifest' if checksum is not None else 'the sender'}'s {str(checksum or got)[:16]}…")
            ended = True
            continue
        o, d, h = item.get("o"), item.get("d"), item.get("h")
        if o != off or not isinstance(d, bytes) or not 0 < len(d) <= CHUNK or type(h) is not int:
            raise TransferError(f"{what}: the peer sent a chunk out of order or malformed at offset {off}")
        if off + len(d) > size:
            raise TransferError(f"{what}: the peer sent more than the {size} bytes expected")
        if chunk_hash(d) != h:
            raise TransferError(f"{what}: the chunk at offset {off} is corrupted (its checksum does not match)")
        digest.update(d)
        off += len(d)
        yield d
    if not ended:
        raise TransferError(f"{what}: the stream ended after {off} of {size} bytes")


def _check_leaf(name: str) -> str:
    if not _COMPONENT.match(name):
        raise TransferError(f"{name!r} is not a file name to write")
    return name


async def fetch_file(channel: Channel, *, lineage: int, gen: int, name: str, size: int, checksum: str,
                     dest_dir: Path, dest_name: str | None = None, owner: tuple[int, int] | None = None,
                     depth: int = DEFAULT_DEPTH, bulk: Bulk | None = None, durable: bool = True) -> None:
    """Pull the peer's ``job-<lineage>/gen-<gen>/<name>`` into ``dest_dir``
    (a directory of the daemon's; its last component not followed) as
    ``dest_name`` (default: the last component of ``name``), checked against
    ``size`` and ``checksum`` (from a manifest this node holds). At most
    ``depth`` chunks wait for the disk. Raises :class:`TransferError` (or the
    peer's RemoteError) with nothing left under the final name. ``bulk``:
    the bytes move on a bulk connection (:mod:`gangd.redundancy.bulk`), not
    the channel. ``durable=False``: neither the file nor ``dest_dir`` fsynced
    (a caller that syncs a batch of files before it commits them)."""
    check_name(name)
    leaf = _check_leaf(dest_name or name.rsplit("/", 1)[-1])
    what = f"{name} of job-{lineage}/gen-{gen} from {channel.label}"
    dest_dir = Path(dest_dir)
    if bulk is not None:
        try:
            async with channel.stream("ckpt_bulk_read", lineage=lineage, gen=gen, name=name) as items:
                ticket, port = bulkpath.check_offer(await bulkpath.first_item(items, what), size, what)
                line = bulkpath.Line()
                await bulkpath.run_on_line(line, _dial_and_receive, line, bulk.host_of(channel), port, bulk.key, ticket,
                                           dest_dir, leaf, size, checksum, owner, what, durable)
            return
        except bulkpath.BulkMismatch:
            raise  # (the bytes arrived whole and are wrong: the channel would bring the same)
        except (RemoteError, OSError) as exc:
            # The bulk path is an optimisation: a port a firewall drops, a
            # listener that failed, a peer without it. The channel still
            # carries every byte, checked the same way.
            why = exc.message if isinstance(exc, RemoteError) else str(exc)
            log.warning("%s: the bulk path failed (%s); pulling it over the peer channel instead", what, why[:300])
    tmp = f".{leaf}.transfer"
    try:
        dir_fd = os.open(dest_dir, safefs.DIR_FLAGS)
    except OSError as exc:
        raise TransferError(f"{what}: cannot open {dest_dir}: {exc.strerror}") from None
    fd = -1
    try:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        send, receive = trio.open_memory_channel[bytes](depth)

        async def receive_all() -> None:
            async with send, channel.stream("ckpt_file_read", lineage=lineage, gen=gen, name=name) as items:
                async for chunk in verified_chunks(items, size, checksum, what):
                    await send.send(chunk)

        async def write_all() -> None:
            async with receive:
                async for chunk in receive:
                    batch, total = [chunk], len(chunk)
                    while total < WRITE_BATCH:
                        try:
                            more = receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        batch.append(more)
                        total += len(more)
                    await trio.to_thread.run_sync(_write_all, fd, b"".join(batch) if len(batch) > 1 else chunk)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_all)
                nursery.start_soon(write_all)
        except BaseExceptionGroup as group:
            raise leaf_error(group) from None
        if owner is not None:  # only once every byte checked out: until then the file is root's, 0600
            os.fchown(fd, *owner)
        if durable:
            await trio.to_thread.run_sync(os.fsync, fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if durable:
            await trio.to_thread.run_sync(os.fsync, dir_fd)
    except OSError as exc:
        raise TransferError(f"{what}: {ckptstore.describe_os_error(exc, dest_dir / leaf)}") from None
    finally:
        if fd >= 0:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
        os.close(dir_fd)


def _dial_and_receive(line: bulkpath.Line, host: str, port: int, key: bytes, ticket: bytes, dest_dir: Path, leaf: str, size: int,
                      checksum: str, owner: tuple[int, int] | None, what: str, durable: bool) -> None:
    """A worker thread's whole share of a bulk file transfer: dial, then
    receive (one hand-off from the event loop, not one per step)."""
    try:
        sock = bulkpath.dial(host, port, key, ticket, what, line=line)
    except OSError as exc:
        raise bulkpath.BulkError(f"{what}: the bulk handshake failed: {exc.strerror or exc}") from None
    bulkpath.receive_file(sock, dest_dir, leaf, size, checksum, owner, what, durable)


def _write_all(fd: int, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


async def fetch_manifest(channel: Channel, *, lineage: int, gen: int, prefix: str = "", node: str | None = None) -> Manifest:
    """The MANIFEST of the peer's generation (``prefix``: of the copy it
    keeps under ``redundancy/partner-<node>/``), read to
    :data:`ckptstore.MAX_MANIFEST` bytes and checked: its lineage, generation
    and (``node``) node must be the ones asked for."""
    name = check_name(f"{prefix}{ckptstore.MANIFEST}")
    what = f"{name} of job-{lineage}/gen-{gen} from {channel.label}"
    data = bytearray()
    async with channel.stream("ckpt_file_read", lineage=lineage, gen=gen, name=name) as items:
        async for chunk in verified_chunks(items, ckptstore.MAX_MANIFEST, None, what, exact=False):
            data += chunk
    try:
        manifest = Manifest.unpack(bytes(data), Path(what))
    except StoreError as exc:
        raise TransferError(str(exc)) from None
    if (manifest.lineage, manifest.gen) != (lineage, gen) or (node is not None and manifest.node != node):
        raise TransferError(f"{what} is node {manifest.node}'s job-{manifest.lineage}/gen-{manifest.gen}, not the one asked for")
    for file in manifest.files:
        check_name(file)
        if "/" in file and not file.startswith(f"{ckptstore.RANKS_DIR}/"):
            raise TransferError(f"{what} lists {file!r}, not a file of a node's generation")
    return manifest


async def fetch_meta(channel: Channel, *, lineage: int, gen: int, node: str) -> xor.XorMeta:
    """The peer's ``redundancy/xor.meta`` of a generation (its XOR set, its
    parity's size and checksum, every member's manifest), read to
    :data:`xor.MAX_META` bytes and checked: it must be ``node``'s own of
    ``job-<lineage>/gen-<gen>``."""
    name = check_name(f"{xor.REDUNDANCY_DIR}/{xor.META}")
    what = f"{name} of job-{lineage}/gen-{gen} from {channel.label}"
    data = bytearray()
    async with channel.stream("ckpt_file_read", lineage=lineage, gen=gen, name=name) as items:
        async for chunk in verified_chunks(items, xor.MAX_META, None, what, exact=False):
            data += chunk
    try:
        meta = xor.XorMeta.unpack(bytes(data), what)
    except StoreError as exc:
        raise TransferError(str(exc)) from None
    if (meta.lineage, meta.gen) != (lineage, gen) or meta.nodes[meta.index] != node:
        raise TransferError(f"{what} is node {meta.nodes[meta.index]}'s of job-{meta.lineage}/gen-{meta.gen}, not the one asked for")
    return meta


def partner_prefix(node: str) -> str:
    """Where a node keeps its ring predecessor ``node``'s copy, in its own generation directory."""
    return f"{xor.REDUNDANCY_DIR}/partner-{node}/"


async def fetch_generation(channel: Channel, manifest: Manifest, dest_dir: Path, *, source_prefix: str = "",
                           owner: tuple[int, int] | None = None, depth: int = DEFAULT_DEPTH, bulk: Bulk | None = None,
                           parallel: int = 2) -> None:
    """Pull every file of the peer's generation that ``manifest`` lists into
    ``dest_dir`` (``ranks/`` made 0700 and given to ``owner``), then write
    the manifest there last: a partner's copy (``dest_dir`` =
    ``gen-G/`` + :func:`partner_prefix`), a lost node's files from its
    partner's copy (``source_prefix`` = :func:`partner_prefix`), or a
    rank's files moved to the node it restarts on. Each file checked
    against ``manifest``; the MANIFEST written last marks the copy whole.
    Up to ``parallel`` files move at once, none fsynced on its own: all of
    them, and their directories, are synced once before the MANIFEST (as a
    local commit does), so the disk writes back while the next bytes arrive."""
    dest_dir = Path(dest_dir)
    jobs = []
    subdirs: set[Path] = set()
    for name in sorted(manifest.files):
        check_name(name)
        check_name(source_prefix + name)
        size, checksum = manifest.files[name]
        *parts, leaf = name.split("/")
        target = dest_dir
        for part in parts:
            target = target / part
            if target not in subdirs:
                await trio.to_thread.run_sync(_make_subdir, target, owner)
                subdirs.add(target)
        jobs.append({"name": source_prefix + name, "size": size, "checksum": checksum, "dest_dir": target, "dest_name": leaf,
                     "owner": owner if parts else None})
    limiter = trio.Semaphore(max(1, parallel))

    async def one(job: dict) -> None:
        async with limiter:
            await fetch_file(channel, lineage=manifest.lineage, gen=manifest.gen, depth=depth, bulk=bulk, durable=False, **job)

    try:
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(one, job)
    except BaseExceptionGroup as group:
        raise leaf_error(group) from None
    await trio.to_thread.run_sync(_sync_all, dest_dir, manifest, sorted(subdirs))
    await trio.to_thread.run_sync(lambda: ckptstore.write_manifest(dest_dir, manifest))


def _sync_all(dest_dir: Path, manifest: Manifest, subdirs: list[Path]) -> None:
    try:
        for sub in subdirs:  # (made by _make_subdir: no link followed)
            fd = os.open(sub, safefs.DIR_FLAGS)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dir_fd = os.open(dest_dir, safefs.DIR_FLAGS)
        try:
            ckptstore.sync(dest_dir, sorted(manifest.files), dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise TransferError(f"syncing the files copied into {dest_dir}: {ckptstore.describe_os_error(exc, dest_dir)}") from None


def _make_subdir(path: Path, owner: tuple[int, int] | None) -> None:
    parent_fd = os.open(path.parent, safefs.DIR_FLAGS)
    try:
        fd = safefs.open_dir_at(parent_fd, path.name, path.parent, create_mode=0o700, trusted=False)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


@asynccontextmanager
async def data_stream(channel: Channel, *, lineage: int, gen: int, start: int, length: int,
                      protected: bool = False) -> AsyncIterator[AsyncIterator[bytes]]:
    """``async with data_stream(...) as chunks``: the peer's data slice
    ``[start, start + length)`` (for XOR parity and rebuilds), each chunk
    checked; no checksum to compare the whole with (a slice is in no
    manifest): what is built from it is checked against the manifests."""
    what = f"data [{start}, {start + length}) of job-{lineage}/gen-{gen} from {channel.label}"
    extra = {"protected": True} if protected else {}  # (older peers know no such argument)
    async with channel.stream("ckpt_data_read", lineage=lineage, gen=gen, start=start, length=length, **extra) as items:
        yield verified_chunks(items, length, None, what)


class _Opening:
    """A bulk connection being opened for one slice. A task on the event
    loop (:meth:`RemoteData._begin_bulk`) sends the control request and
    holds it open until the sender has sent everything (its ``{end}``);
    the reader thread waits for the offer on a ``threading.Event`` (no
    round trip through the event loop), then dials and reads on ``line``
    itself, which that task cuts if it is cancelled."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.ready = threading.Event()
        self.offer: tuple[bytes, int] | None = None
        self.error = ""
        self.line = bulkpath.Line()

    def wait(self, what: str) -> tuple[bytes, int]:
        if not self.ready.wait(bulkpath.CLAIM_TIMEOUT):
            raise bulkpath.BulkError(f"{what}: no offer from the peer within {bulkpath.CLAIM_TIMEOUT:.0f} s")
        if self.offer is None:
            raise bulkpath.BulkError(self.error or f"{what}: the transfer was cancelled")
        return self.offer


class RemoteData:
    """A peer's data as a :class:`gangd.redundancy.xor.Source`, for the XOR
    code running in a worker thread (``trio.to_thread.run_sync``).

    With ``bulk``, each ``blocks()`` call starts its control request at once
    (a task in ``nursery``, started with ``run_sync_soon``: the thread does
    not wait for the event loop; every source of a parity or a rebuild asks
    in parallel, before the first byte is wanted), and when the bytes are
    wanted the thread waits for the offer, dials and reads the socket itself
    (:class:`gangd.redundancy.bulk.Receiver`, every chunk checked). The
    request is held until the sender's ``{end}``; cancelled, it cuts the
    thread's socket (:class:`gangd.redundancy.bulk.Line`). If the bulk path is refused (no listener, a listener without
    the secret, a malformed offer) or breaks (a chunk short, corrupted, cut,
    or bytes after the end), the rest of the slice comes over the channel,
    every byte checked the same way, as :func:`fetch_file` does; the bytes
    already handed on are not asked again (a whole file's are, and must be
    the same). A file that arrives whole and does not match its checksum
    is :class:`gangd.redundancy.xor.Damaged`: the channel would bring the same.

    On the channel, a pump task in ``nursery`` pulls the slice into a channel
    of ``depth`` chunks; the thread takes them with ``trio.from_thread.run``
    in :data:`xor.BLOCK` pieces. ``protected``: the data the peer's parity
    was computed over (the files its ``xor.meta`` lists), for a rebuild."""

    def __init__(self, nursery: trio.Nursery, channel: Channel, lineage: int, gen: int, depth: int = DEFAULT_DEPTH,
                 bulk: Bulk | None = None, protected: bool = False):
        self.nursery, self.channel, self.lineage, self.gen, self.depth = nursery, channel, lineage, gen, depth
        self.bulk = bulk
        self.protected = protected
        self.name: str | None = None
        self.checksum: str | None = None
        self.host = bulk.host_of(channel) if bulk is not None else ""
        try:  # (made on the event loop's thread, as the daemon and the tests do; else a round trip per request)
            self.token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:
            self.token = None

    def _what(self, start: int, length: int) -> str:
        if self.name:
            return f"{self.name} of job-{self.lineage}/gen-{self.gen} from {self.channel.label}"
        return f"data [{start}, {start + length}) of job-{self.lineage}/gen-{self.gen} from {self.channel.label}"

    async def _open(self, start: int, length: int) -> trio.MemoryReceiveChannel:
        send, receive = trio.open_memory_channel[object](max(1, self.depth * CHUNK // xor.BLOCK))

        async def pump() -> None:
            async with send:
                try:
                    pending = bytearray()
                    async with self._stream(start, length) as chunks:
                        async for chunk in chunks:
                            pending += chunk
                            if len(pending) >= xor.BLOCK:
                                await send.send(bytes(pending[: xor.BLOCK]))
                                del pending[: xor.BLOCK]
                    if pending:
                        await send.send(bytes(pending))
                except RemoteError as exc:
                    with contextlib.suppress(trio.BrokenResourceError):
                        await send.send(exc)
                except trio.BrokenResourceError:
                    pass  # the XOR code stopped reading (it failed): this slice is no longer wanted

        self.nursery.start_soon(pump)
        return receive

    def _stream(self, start: int, length: int):
        return data_stream(self.channel, lineage=self.lineage, gen=self.gen, start=start, length=length, protected=self.protected)

    def _request_args(self, start: int, length: int) -> dict:
        return {"start": start, "length": length, **({"protected": True} if self.protected else {})}

    def _begin_bulk(self, opening: _Opening, start: int, length: int, what: str) -> None:
        """Start the control request of ``opening`` (on the event loop, from
        ``run_sync_soon``: it must not raise)."""

        async def hold() -> None:
            settled = False
            try:
                async with self.channel.stream("ckpt_bulk_read", lineage=self.lineage, gen=self.gen,
                                               **self._request_args(start, length)) as items:
                    opening.offer = bulkpath.check_offer(await bulkpath.first_item(items, what), length, what)
                    opening.ready.set()
                    async for _ in items:  # (the sender's {end}: the request lives until every byte is sent)
                        pass
                settled = True
            except (RemoteError, OSError) as exc:
                settled = True  # (the reader learns it from its socket, or already has every byte)
                opening.error = exc.message if isinstance(exc, RemoteError) else str(exc)
            finally:
                if not settled:  # cancelled: the reader's blocking call fails at once
                    opening.line.cut()
                opening.ready.set()

        try:
            self.nursery.start_soon(hold)
        except RuntimeError as exc:  # (the nursery is closed)
            opening.error = f"{what}: {exc}"
            opening.ready.set()

    def blocks(self, start: int, length: int) -> Iterator[bytes | memoryview]:
        if self.bulk is not None:
            what = self._what(start, length)
            opening = _Opening(self.host)
            if self.token is not None:
                try:  # (no wait for the event loop: the request starts while this thread goes on)
                    self.token.run_sync_soon(self._begin_bulk, opening, start, length, what)
                except trio.RunFinishedError:
                    opening.error = f"{what}: the event loop has finished"
                    opening.ready.set()
            else:
                trio.from_thread.run_sync(self._begin_bulk, opening, start, length, what)
            return self._bulk_blocks(self.bulk.key, opening, start, length, what)
        return self._channel_blocks(start, length)

    def _bulk_blocks(self, key: bytes, opening: _Opening, start: int, length: int, what: str) -> Iterator[bytes | memoryview]:
        got = 0
        digest = ckptstore.hasher() if self.checksum is not None else None
        try:
            ticket, port = opening.wait(what)
            try:
                sock = bulkpath.dial(opening.host, port, key, ticket, what, line=opening.line)
            except OSError as exc:
                raise bulkpath.BulkError(f"{what}: the bulk handshake failed: {exc.strerror or exc}") from None
            try:
                for chunk in bulkpath.Receiver(sock, length, what, digest=digest).chunks():
                    got += len(chunk)
                    yield chunk
            finally:
                sock.close()
        except bulkpath.BulkError as exc:
            # The bulk path is an optimisation (see fetch_file): the rest comes over the channel.
            log.warning("%s: the bulk path failed (%s); pulling it over the peer channel instead", what, exc.message[:300])
        else:
            if digest is not None and self.checksum is not None and (mine := digest.hexdigest()) != self.checksum:
                raise xor.Damaged(f"{what}: checksum {mine[:16]}… of the bytes received does not match {self.checksum[:16]}…")
            return
        yield from self._fallback(start, length, got, digest)

    def _fallback(self, start: int, length: int, got: int, digest) -> Iterator[bytes | memoryview]:
        """The slice's bytes after the ``got`` handed on from the bulk path, over the channel."""
        if got < length:
            yield from self._channel_blocks(start + got, length - got)

    def _channel_blocks(self, start: int, length: int) -> Iterator[bytes | memoryview]:
        receive = trio.from_thread.run(self._open, start, length)
        try:
            done = 0
            while done < length:
                try:
                    block = trio.from_thread.run(receive.receive)
                except trio.EndOfChannel:
                    raise xor.RebuildError(f"{self.channel.label} sent {done} of {length} bytes") from None
                if isinstance(block, RemoteError):
                    raise xor.RebuildError(str(block))
                if not isinstance(block, bytes) or len(block) != min(xor.BLOCK, length - done):
                    raise xor.RebuildError(f"{self.channel.label}: a block of the wrong size at {done}")
                done += len(block)
                yield block
        finally:
            try:
                trio.from_thread.run_sync(receive.close)
            except RuntimeError:  # (finalised on the event loop's own thread)
                receive.close()


class RemoteFile(RemoteData):
    """A peer's whole file (a parity) as a :class:`gangd.redundancy.xor.Source`,
    checked against ``size`` and ``checksum`` (from the meta this node holds)."""

    def __init__(self, nursery: trio.Nursery, channel: Channel, lineage: int, gen: int, name: str, size: int, checksum: str,
                 depth: int = DEFAULT_DEPTH, bulk: Bulk | None = None):
        super().__init__(nursery, channel, lineage, gen, depth, bulk)
        self.name, self.size, self.checksum = check_name(name), size, checksum

    def _request_args(self, start: int, length: int) -> dict:
        if (start, length) != (0, self.size):
            raise RemoteError("bad_request", "a remote file is read whole")
        return {"name": self.name}

    @asynccontextmanager
    async def _stream(self, start: int, length: int):
        if (start, length) != (0, self.size):
            raise RemoteError("bad_request", "a remote file is read whole")
        what = f"{self.name} of job-{self.lineage}/gen-{self.gen} from {self.channel.label}"
        async with self.channel.stream("ckpt_file_read", lineage=self.lineage, gen=self.gen, name=self.name) as items:
            yield verified_chunks(items, self.size, self.checksum, what)

    def _fallback(self, start: int, length: int, got: int, digest) -> Iterator[bytes | memoryview]:
        """A file is read over the channel from its start (the op has no
        offset): its first ``got`` bytes, already handed on, must be the ones
        the bulk path brought; the whole is checked against the checksum."""
        prefix = digest.hexdigest() if digest is not None else None
        again = ckptstore.hasher()
        skipped = 0
        for block in self._channel_blocks(start, length):
            if skipped < got:
                if len(block) > got - skipped:  # (bulk chunks and blocks are both xor.BLOCK: never split)
                    raise xor.RebuildError(f"{self._what(start, length)}: the channel's blocks do not line up with the bulk path's")
                again.update(block)
                skipped += len(block)
                if skipped == got and prefix is not None and again.hexdigest() != prefix:
                    raise xor.RebuildError(f"{self._what(start, length)}: the channel sends other bytes than the bulk path did")
                continue
            yield block
