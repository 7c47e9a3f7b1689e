"""Rebuilding a lost node's files of a protected generation on another node (``ckpt_rebuild``).

A *protected* generation survives the loss of a node (:mod:`gangd.daemon.protect`
wrote its redundancy), but only if something puts the lost node's files
back on a disk before the restart. The coordinator, restarting a job whose
ranks' files are only on nodes that are down (:meth:`Restarts.restart`,
:meth:`~gangd.daemon.ckptrestart.Restarts.recover`), plans it
(:meth:`gangd.redundancy.plan.Plan.recovery`) and commands the node that
takes the lost node's ranks, with the fenced peer op ``ckpt_rebuild``:

``partner``  pull the lost node's MANIFEST and files from the copy its ring
             partner keeps (``gen-G/redundancy/partner-<lost>/``), or copy
             them locally if this node is that partner;
``xor``      read every surviving member's ``xor.meta`` (they must agree),
             then reconstruct the lost member's data from the survivors'
             data and parity (:func:`gangd.redundancy.xor.rebuild`, the
             remote ones streamed) into a scratch directory
             ``gen-G/redundancy/rebuilt-<lost>`` and move its files into place.

Either way, the node ends holding the lost node's files exactly as if a
staging (:mod:`gangd.daemon.staging`) had pulled them from it: each file
checked against the lost node's manifest (the copy the partner or the
XOR set keeps; size and XXH3), under ``gen-G/`` and ``gen-G/ranks/`` with
the owners and modes :mod:`gangd.ckptstore` gives them, fsynced, and the
node's MANIFEST rewritten atomically with the union of what it held and
what it received. A rebuild that fails or is cut leaves nothing listed, and
removes what it wrote; its error (``rebuild_failed``, or ``transfer_failed``
for a peer's bytes that did not check out) names the node and the file.
A parity, partner copy or survivor's data that is there but wrong answers
``redundancy_damaged`` (:data:`DAMAGED`): it will not heal, and the
coordinator records the generation as no longer protected.

A node that is *up* may have lost its files too: it came back with its
checkpoint disk wiped. :func:`holds` (``ckpt_holds``) tells the coordinator
so (absence only: a file there but wrong is the verification's), and the
node then counts as lost for that generation: its files are rebuilt like a
down node's, on a replacement or, when the restart runs on it again, on
itself (allowed only while it holds no manifest of the generation).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .. import ckptstore, safefs
from ..ckptstore import Manifest, StoreError
from ..failpoint import hold
from ..redundancy import transfer, xor
from ..redundancy.bulk import Bulk, BulkMismatch
from ..redundancy.plan import NODE_NAME
from ..rpc import RemoteError, leaf_error
from ..safefs import UnsafePath
from .staging import MAX_TIMEOUT, PARALLEL, TargetGeneration, int_arg, merged, owner_of, timeout_of

log = logging.getLogger("gangd.rebuild")

METHODS = ("partner", "xor")
#: The error code of a rebuild that read a damaged parity, partner copy or
#: survivor's data: the generation's redundancy is not whole any more.
DAMAGED = "redundancy_damaged"
READ_BLOCK = 1 << 20
HOLD = "rebuild.hold"  # (a test's hold point: see gangd.failpoint.hold)


@dataclass(frozen=True)
class RebuildRequest:
    """``ckpt_rebuild``'s arguments, checked (they come from a peer): rebuild
    node ``lost``'s files of ``job-<lineage>/gen-<gen>`` here, by ``method``
    from ``sources`` (the partner holding its copy, or the surviving members
    of its XOR set), the state files given to ``owner``."""

    lineage: int
    gen: int
    owner: tuple[int, int]
    lost: str
    method: str
    sources: tuple[str, ...]
    timeout: float

    @classmethod
    def from_args(cls, args: dict, node_names: list[str], this_node: str) -> RebuildRequest:
        lineage, gen = int_arg(args.get("lineage"), "lineage", 1), int_arg(args.get("gen"), "gen", 1)
        uid, gid = owner_of(args)
        lost = args.get("lost")
        if not isinstance(lost, str) or not NODE_NAME.match(lost) or lost not in node_names:
            raise RemoteError("bad_request", f"'lost' must name a node of the cluster, not {str(lost)[:64]!r}")
        method = args.get("method")
        if method not in METHODS:
            raise RemoteError("bad_request", f"'method' must be one of {', '.join(METHODS)}")
        sources = args.get("sources")
        if (not isinstance(sources, (list, tuple)) or not 1 <= len(sources) < xor.MAX_SET
                or not all(isinstance(n, str) and n in node_names for n in sources) or len(set(sources)) != len(sources)):
            raise RemoteError("bad_request", "'sources' must list distinct nodes of the cluster")
        if lost in sources:
            raise RemoteError("bad_request", f"the lost node {lost} cannot be a source of its own rebuild")
        if method == "partner" and len(sources) != 1:
            raise RemoteError("bad_request", "a partner rebuild has one source: the node holding the copy")
        return cls(lineage, gen, (uid, gid), lost, method, tuple(sources), timeout_of(args, MAX_TIMEOUT))


class Rebuilder:
    """This node's side of ``ckpt_rebuild``. ``channel(node)``: the peer
    channel to a node; ``bulk``: the bulk path for the bytes (None: the channel)."""

    def __init__(self, *, node: str, root: Path, channel, reserve: int, max_file: int, bulk: Bulk | None = None):
        self.node = node
        self.root = Path(root)
        self.channel = channel
        self.bulk = bulk
        self.max_file = max_file
        self.target = TargetGeneration(self.root, reserve)

    async def rebuild(self, request: RebuildRequest) -> dict:
        started = time.monotonic()
        await hold(HOLD)
        directory = ckptstore.gen_dir(self.root, request.lineage, request.gen)
        where = f"{self.node}: rebuilding node {request.lost}'s job-{request.lineage}/gen-{request.gen}"
        try:
            local = await trio.to_thread.run_sync(self.target.open_dirs, directory, request.owner)
        except (UnsafePath, OSError, StoreError) as exc:
            raise RemoteError("rebuild_failed", f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
        if request.lost == self.node and local is not None:  # (its disk was wiped: it may take its own files back)
            raise RemoteError("bad_request", f"{self.node} cannot rebuild its own files of job-{request.lineage}/gen-{request.gen}: "
                                             "it still holds its manifest of them")
        from .checkpoint import NoRoom  # (checkpoint imports nothing of this module)

        landed: list[str] = []  # final names this call wrote (removed again if it fails)
        todo: list[tuple[str, int, str]] = []  # the lost node's files this call rebuilds, once its manifest is known
        scratch = f"rebuilt-{request.lost}"
        try:
            with trio.fail_after(request.timeout):
                if request.method == "partner":
                    lost, wanted = await self._partner(request, directory, local, landed, todo)
                else:
                    lost, wanted = await self._xor(request, directory, local, landed, scratch, todo)
                manifest = merged(local, request.lineage, request.gen, self.node, lost.iteration,
                                  {name: [size, checksum] for name, size, checksum in wanted}, set(lost.ranks),
                                  {name: lost.links(name) for name, _, _ in wanted if lost.links(name)})
                await trio.to_thread.run_sync(self.target.commit, directory, manifest, [name for name, _, _ in wanted])
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self.target.undo(directory, landed)
                await trio.to_thread.run_sync(self._remove_scratch, directory, scratch)
            if isinstance(exc, BaseExceptionGroup):
                exc = leaf_error(exc)
            if isinstance(exc, trio.TooSlowError):
                raise RemoteError("rebuild_failed", f"{where}: not done within {request.timeout:.0f} s; {_not_rebuilt(request, todo)}") from None
            if isinstance(exc, transfer.Mismatch | BulkMismatch):
                raise RemoteError(DAMAGED, f"{where}: {exc.message}") from None
            if isinstance(exc, RemoteError):
                code = exc.code if exc.code in ("transfer_failed", "bad_request", "no_such_node", DAMAGED) else "rebuild_failed"
                raise RemoteError(code, exc.message if exc.message.startswith(f"{self.node}:") else f"{where}: {exc.message}") from None
            if isinstance(exc, NoRoom | StoreError | UnsafePath):
                said = str(exc).removeprefix(f"cannot rebuild node {request.lost}'s job-{request.lineage}/gen-{request.gen}: ")
                raise RemoteError(DAMAGED if isinstance(exc, xor.Damaged) else "rebuild_failed", f"{where}: {said}") from None
            if isinstance(exc, OSError):
                raise RemoteError("rebuild_failed", f"{where}: {ckptstore.describe_os_error(exc, directory)}") from None
            raise
        await trio.to_thread.run_sync(self._remove_scratch, directory, scratch)
        size = sum(s for _, s, _ in wanted)
        seconds = time.monotonic() - started
        log.info("rebuilt node %s's job-%d/gen-%d here by %s from %s: %d files, %d bytes in %.2f s", request.lost, request.lineage,
                 request.gen, request.method, ", ".join(request.sources), len(wanted), size, seconds)
        return {"node": self.node, "lost": request.lost, "method": request.method, "ranks": sorted(lost.ranks),
                "files": [name for name, _, _ in wanted], "bytes": size, "seconds": round(seconds, 6)}

    # ------------------------------------------------------------ what lands

    def _wanted(self, request: RebuildRequest, lost: Manifest, local: Manifest | None) -> list[tuple[str, int, str]]:
        """(name, size, checksum) of each of the lost node's files this node
        does not hold yet: a file it already lists must be the same (the job's
        record excepted: every node keeps its own)."""
        if (lost.lineage, lost.gen, lost.node) != (request.lineage, request.gen, request.lost):
            raise RemoteError("rebuild_failed", f"the manifest found is node {lost.node}'s job-{lost.lineage}/gen-{lost.gen}, not the one asked for")
        if not lost.ranks:
            raise RemoteError("rebuild_failed", f"node {request.lost}'s manifest lists no ranks")
        if local is not None and local.iteration != lost.iteration:
            raise RemoteError("rebuild_failed", f"node {request.lost}'s manifest is of iteration {lost.iteration}, "
                              f"{self.node}'s of {local.iteration}: not one generation")
        have = local.files if local is not None else {}
        wanted = []
        for name in sorted(lost.files):
            transfer.check_name(name)
            if "/" in name and not name.startswith(f"{ckptstore.RANKS_DIR}/"):
                raise RemoteError("rebuild_failed", f"node {request.lost}'s manifest lists {name!r}, not a file of a node's generation")
            size, checksum = lost.files[name]
            if name in have:
                if name == "job.msgpack" or have[name] == lost.files[name]:
                    continue
                raise RemoteError("rebuild_failed", f"{self.node}'s job-{request.lineage}/gen-{request.gen}/{name} differs from node {request.lost}'s")
            if size > self.max_file:
                raise RemoteError("rebuild_failed", f"node {request.lost}'s {name} is {size} bytes, more than one file may hold "
                                  f"(checkpoint_max_rank_bytes = {self.max_file})")
            wanted.append((name, size, checksum))
        return wanted

    # ------------------------------------------------------------ partner

    async def _partner(self, request: RebuildRequest, directory: Path, local: Manifest | None,
                       landed: list[str], todo: list[tuple[str, int, str]]) -> tuple[Manifest, list[tuple[str, int, str]]]:
        holder = request.sources[0]
        prefix = transfer.partner_prefix(request.lost)
        if holder == self.node:
            lost = await trio.to_thread.run_sync(self._partner_manifest, directory, request.lost)
        else:
            lost = await transfer.fetch_manifest(self.channel(holder), lineage=request.lineage, gen=request.gen, prefix=prefix, node=request.lost)
        wanted = self._wanted(request, lost, local)
        todo[:] = wanted
        await trio.to_thread.run_sync(self.target.room, directory, sum(size for _, size, _ in wanted))
        if holder == self.node:
            await trio.to_thread.run_sync(self._copy_partner, directory, request, wanted, landed)
            return lost, wanted
        limiter = trio.Semaphore(PARALLEL)

        async def one(name: str, size: int, checksum: str) -> None:
            async with limiter:
                in_ranks = name.startswith(f"{ckptstore.RANKS_DIR}/")
                landed.append(name)
                try:
                    await transfer.fetch_file(
                        self.channel(holder), lineage=request.lineage, gen=request.gen, name=prefix + name, size=size, checksum=checksum,
                        dest_dir=directory / ckptstore.RANKS_DIR if in_ranks else directory, dest_name=name.rsplit("/", 1)[-1],
                        owner=request.owner if in_ranks else None, durable=False, bulk=self.bulk,
                    )
                except RemoteError as exc:
                    code = DAMAGED if isinstance(exc, transfer.Mismatch | BulkMismatch) else exc.code
                    raise RemoteError(code, f"node {holder}'s job-{request.lineage}/gen-{request.gen}/{prefix}{name}: {exc.message}") from None

        async with trio.open_nursery() as nursery:
            for name, size, checksum in wanted:
                nursery.start_soon(one, name, size, checksum)
        return lost, wanted

    def _partner_dir(self, directory: Path, lost: str) -> int:
        gen = self.target.gen_fd(directory)
        try:
            red = safefs.open_dir_at(gen, xor.REDUNDANCY_DIR, directory)
        finally:
            os.close(gen)
        try:
            return safefs.open_dir_at(red, f"partner-{lost}", directory / xor.REDUNDANCY_DIR)
        finally:
            os.close(red)

    def _partner_manifest(self, directory: Path, lost: str) -> Manifest:
        fd = self._partner_dir(directory, lost)
        try:
            return ckptstore.read_manifest(directory / transfer.partner_prefix(lost), dir_fd=fd, owner=os.geteuid())
        finally:
            os.close(fd)

    def _copy_partner(self, directory: Path, request: RebuildRequest, wanted: list[tuple[str, int, str]], landed: list[str]) -> None:
        """The lost node's files from the copy this node keeps as its partner, each checked as it is written."""
        copy = directory / transfer.partner_prefix(request.lost)
        src = self._partner_dir(directory, request.lost)
        gen = self.target.gen_fd(directory)
        ranks = safefs.open_dir_at(gen, ckptstore.RANKS_DIR, directory, trusted=False, owner=request.owner[0])
        try:
            for name, size, checksum in wanted:
                in_ranks = name.startswith(f"{ckptstore.RANKS_DIR}/")
                fd = ckptstore.open_in(src, name, copy)
                try:
                    landed.append(name)
                    got = ckptstore.write_atomic(directory / name, _blocks(fd), owner=request.owner if in_ranks else None,
                                                 durable=False, dir_fd=ranks if in_ranks else gen)
                finally:
                    os.close(fd)
                if got != (size, checksum):
                    raise xor.Damaged(f"{copy / name} is corrupted: {got[0]} bytes, checksum {got[1][:16]}…; "
                                           f"node {request.lost}'s manifest says {size} bytes, {checksum[:16]}…")
        finally:
            for fd in (ranks, gen, src):
                os.close(fd)

    # ------------------------------------------------------------ xor

    async def _metas(self, request: RebuildRequest, directory: Path) -> dict[str, xor.XorMeta]:
        metas: dict[str, xor.XorMeta] = {}

        async def one(source: str) -> None:
            if source == self.node:
                metas[source] = await trio.to_thread.run_sync(xor.read_meta, directory)
            else:
                metas[source] = await transfer.fetch_meta(self.channel(source), lineage=request.lineage, gen=request.gen, node=source)

        async with trio.open_nursery() as nursery:
            for source in request.sources:
                nursery.start_soon(one, source)
        return metas

    async def _xor(self, request: RebuildRequest, directory: Path, local: Manifest | None, landed: list[str],
                   scratch: str, todo: list[tuple[str, int, str]]) -> tuple[Manifest, list[tuple[str, int, str]]]:
        metas = await self._metas(request, directory)
        first = metas[request.sources[0]]
        for source, meta in metas.items():
            if (meta.lineage, meta.gen) != (request.lineage, request.gen) or meta.nodes[meta.index] != source:
                raise RemoteError("rebuild_failed", f"node {source}'s XOR metadata is not its own of job-{request.lineage}/gen-{request.gen}")
            if (meta.nodes, meta.sizes, meta.manifests) != (first.nodes, first.sizes, first.manifests):
                raise RemoteError("rebuild_failed", f"node {source}'s XOR metadata does not agree with node {request.sources[0]}'s")
        if set(first.nodes) != {request.lost, *request.sources}:
            raise RemoteError("rebuild_failed", f"the XOR set of node {request.lost} is {', '.join(first.nodes)}, "
                              f"not it and {', '.join(request.sources)}")
        index = first.nodes.index(request.lost)
        try:
            lost = first.manifest(index)
        except StoreError as exc:
            raise RemoteError("rebuild_failed", str(exc)) from None
        wanted = self._wanted(request, lost, local)
        todo[:] = wanted
        await trio.to_thread.run_sync(self.target.room, directory, xor.data_size(lost))
        dest = await trio.to_thread.run_sync(self._scratch, directory, scratch)
        readers: list[xor.NodeData] = []
        async with trio.open_nursery() as nursery:
            data: list = [None] * len(first.nodes)
            parity: list = [None] * len(first.nodes)
            for i, member in enumerate(first.nodes):
                if member == request.lost:
                    continue
                if member == self.node:
                    reader = xor.NodeData(directory, first.manifest(i), node=member)
                    readers.append(reader)
                    data[i], parity[i] = reader, xor.ParityFile(directory, metas[member])
                else:
                    channel = self.channel(member)
                    data[i] = transfer.RemoteData(nursery, channel, request.lineage, request.gen, bulk=self.bulk, protected=True)
                    parity[i] = transfer.RemoteFile(nursery, channel, request.lineage, request.gen, f"{xor.REDUNDANCY_DIR}/{xor.PARITY}",
                                                    metas[member].parity_size, metas[member].parity_checksum, bulk=self.bulk)
            try:
                await trio.to_thread.run_sync(lambda: xor.rebuild(index, first, data, parity, dest, owner=request.owner, own_parity=False))
            finally:
                nursery.cancel_scope.cancel()  # (pumps of a failed rebuild stop with it)
                for reader in readers:
                    reader.close()
        await trio.to_thread.run_sync(self._move_in, directory, scratch, wanted, landed)
        return lost, wanted

    def _scratch(self, directory: Path, scratch: str) -> Path:
        """``gen-G/redundancy/`` (root's, 0700) without a leftover ``scratch``: where the rebuild writes."""
        gen = self.target.gen_fd(directory)
        try:
            red = safefs.open_dir_at(gen, xor.REDUNDANCY_DIR, directory, create_mode=0o700)
        finally:
            os.close(gen)
        try:
            os.fchmod(red, 0o700)
            safefs.rmtree_at(red, scratch)
            safefs.rmtree_at(red, f".{scratch}.partial")
        finally:
            os.close(red)
        return directory / xor.REDUNDANCY_DIR / scratch

    def _move_in(self, directory: Path, scratch: str, wanted: list[tuple[str, int, str]], landed: list[str]) -> None:
        """The rebuilt files renamed from the scratch directory to their places in the generation."""
        gen = self.target.gen_fd(directory)
        fds = [gen]
        try:
            red = safefs.open_dir_at(gen, xor.REDUNDANCY_DIR, directory)
            fds.append(red)
            src = safefs.open_dir_at(red, scratch, directory / xor.REDUNDANCY_DIR)
            fds.append(src)
            src_ranks = dst_ranks = None
            for name, _, _ in wanted:
                *parts, leaf = name.split("/")
                if parts:
                    if src_ranks is None:
                        src_ranks = safefs.open_dir_at(src, ckptstore.RANKS_DIR, directory, trusted=False)
                        fds.append(src_ranks)
                        dst_ranks = safefs.open_dir_at(gen, ckptstore.RANKS_DIR, directory, trusted=False)
                        fds.append(dst_ranks)
                    landed.append(name)
                    os.rename(leaf, leaf, src_dir_fd=src_ranks, dst_dir_fd=dst_ranks)
                else:
                    landed.append(name)
                    os.rename(leaf, leaf, src_dir_fd=src, dst_dir_fd=gen)
        finally:
            for fd in reversed(fds):
                os.close(fd)

    def _remove_scratch(self, directory: Path, scratch: str) -> None:
        try:
            gen = self.target.gen_fd(directory)
        except (UnsafePath, OSError):
            return
        try:
            try:
                red = safefs.open_dir_at(gen, xor.REDUNDANCY_DIR, directory)
            except (UnsafePath, OSError):
                return
            try:
                safefs.rmtree_at(red, scratch)
                safefs.rmtree_at(red, f".{scratch}.partial")
            finally:
                os.close(red)
        finally:
            os.close(gen)


def _not_rebuilt(request: RebuildRequest, todo: list[tuple[str, int, str]], shown: int = 8) -> str:
    """What a rebuild cut short had not rebuilt: the lost node's files (or its manifest, not read yet)."""
    source = f"{request.method} {'copy on' if request.method == 'partner' else 'set of'} {', '.join(request.sources)}"
    if not todo:
        return f"node {request.lost}'s manifest of the generation was not read from its {source} yet"
    names = [name for name, _, _ in todo]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (f"node {request.lost}'s files not rebuilt from its {source}: {', '.join(names[:shown])}{more} "
            f"({sum(size for _, size, _ in todo)} bytes)")


def holds(root: Path, lineage: int, gen: int) -> str:
    """``ckpt_holds``: "" if this node holds its files of ``job-<lineage>/gen-<gen>``
    (its MANIFEST and every file it lists are there), else a sentence saying
    what is gone. Only *absence* counts: a node whose disk was wiped (it came
    back empty, or its checkpoint directory was deleted) has lost its files
    as surely as a node that is down, and the coordinator then rebuilds them
    from the redundancy instead of calling the generation damaged; a file that
    is there but wrong is :meth:`verify`'s business. Nothing is read but the
    MANIFEST (root's, bounded); no link is followed."""
    directory = ckptstore.gen_dir(root, lineage, gen)
    root = Path(root)
    try:
        fd = safefs.open_trusted_dir(root)
    except (UnsafePath, OSError):
        return f"{root} is gone" if not os.path.lexists(root) else ""
    try:
        for path in (directory.parent, directory):  # (each looked at before it is opened: absence is the answer)
            try:
                os.stat(path.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                return f"{path} is gone"
            child = safefs.open_dir_at(fd, path.name, path.parent)
            os.close(fd)
            fd = child
    except (UnsafePath, OSError):
        os.close(fd)
        return ""  # (there but unsafe or unreadable: not "absent"; the verification names it)
    try:
        try:
            manifest = ckptstore.read_manifest(directory, dir_fd=fd, owner=os.geteuid())
        except StoreError:
            try:
                os.stat(ckptstore.MANIFEST, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return f"{directory / ckptstore.MANIFEST} is gone"
            except OSError:
                pass
            return ""
        ranks: int | None = None
        try:
            for name in manifest.files:
                *parts, leaf = name.split("/")
                where = fd
                if parts:
                    if parts != [ckptstore.RANKS_DIR]:
                        continue
                    if ranks is None:
                        try:
                            ranks = safefs.open_dir_at(fd, ckptstore.RANKS_DIR, directory, trusted=False)
                        except FileNotFoundError:
                            return f"{directory / ckptstore.RANKS_DIR} is gone"
                        except (UnsafePath, OSError):
                            return ""
                    where = ranks
                try:
                    os.stat(leaf, dir_fd=where, follow_symlinks=False)
                except FileNotFoundError:
                    return f"{directory / name} is gone"
                except OSError:
                    pass
        finally:
            if ranks is not None:
                os.close(ranks)
        return ""
    finally:
        os.close(fd)


def _blocks(fd: int):
    offset = 0
    while block := os.pread(fd, READ_BLOCK, offset):
        offset += len(block)
        yield block
