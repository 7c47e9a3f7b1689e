"""Staging a generation's files onto the node a rank restarts on (``gang restart -w/-N``).

A generation's files live where its ranks ran: each node holds its ranks'
state files, network contexts and the job's record under
``<root>/job-<L>/gen-<G>/``, listed in that node's MANIFEST. A restart on
other nodes first brings each moved rank's files to the node it will run
on, so that the node-side restore (:meth:`NodeCheckpoints.prepare_restart`)
reads only its own disk, exactly as for a restart in place.

The target *pulls* (peer op ``ckpt_stage``, fenced: only the coordinator
commands it): for each source node it reads that node's MANIFEST
(:func:`gangd.redundancy.transfer.fetch_manifest`, checked to be that node's
``job-L/gen-G``), then each file it needs over the peer channel
(``ckpt_file_read``), every chunk and the whole file checked against the
source manifest's size and XXH3 before it gets its final name. Files move
two at a time and are fsynced together, with their directories, before the
node's MANIFEST is (re)written atomically with the union of what it held
and what it received: the MANIFEST alone says what this node has, so a
staging that fails or is cut leaves nothing listed, and the files it pulled
are removed.

Directories and owners as :mod:`gangd.ckptstore` says: ``job-L`` and
``gen-G`` root's 0711, ``ranks/`` the job owner's 0700 and the state files
in it the owner's 0600, every other file root's 0600; every directory
reached through descriptors from the trusted checkpoint root, never through
a link.
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
from ..redundancy import transfer
from ..redundancy.bulk import Bulk
from ..rpc import RemoteError, leaf_error
from ..safefs import UnsafePath

log = logging.getLogger("gangd.staging")

#: Files moving at once into one node.
PARALLEL = 2
#: Longest a staging may take, whatever the coordinator asks.
MAX_TIMEOUT = 3600.0


def int_arg(value: object, what: str, low: int = 0, high: int = 1 << 62) -> int:
    """A peer's integer argument, checked to be one (not a bool) in [low, high]."""
    if type(value) is not int or not low <= value <= high:
        raise RemoteError("bad_request", f"{what} must be an integer from {low} to {high}")
    return value


def owner_of(args: dict) -> tuple[int, int]:
    """A request's ``owner`` ([uid, gid] of the job's owner: the state files become theirs), checked."""
    owner = args.get("owner")
    if not isinstance(owner, (list, tuple)) or len(owner) != 2:
        raise RemoteError("bad_request", "'owner' must be [uid, gid]")
    return int_arg(owner[0], "the owner's uid", 0, 2**32 - 2), int_arg(owner[1], "the owner's gid", 0, 2**32 - 2)


def pulls_of(args: dict, node_names: list[str], refused: str | None = None) -> dict[str, tuple[int, ...]]:
    """A request's ``pulls`` (node -> the ranks whose files come from it),
    checked: nodes of the cluster (not ``refused``), each rank once."""
    pulls_in = args.get("pulls")
    if not isinstance(pulls_in, dict) or not pulls_in or len(pulls_in) > len(node_names):
        raise RemoteError("bad_request", "'pulls' must map nodes of the cluster to ranks")
    pulls: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for node, ranks in pulls_in.items():
        if node not in node_names or node == refused:
            raise RemoteError("bad_request", f"{str(node)[:64]!r} is not {'another' if refused else 'a'} node of the cluster")
        if not isinstance(ranks, (list, tuple)) or not ranks or len(ranks) > 1 << 16:
            raise RemoteError("bad_request", "each node gives a list of ranks")
        checked = tuple(int_arg(r, "a rank", 0, 1 << 20) for r in ranks)
        if seen & set(checked) or len(set(checked)) != len(checked):
            raise RemoteError("bad_request", "a rank is pulled twice")
        seen |= set(checked)
        pulls[node] = checked
    return pulls


def timeout_of(args: dict, cap: float) -> float:
    """A request's ``timeout`` (positive seconds), at most ``cap``."""
    timeout = args.get("timeout")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout:
        raise RemoteError("bad_request", "'timeout' must be a positive number of seconds")
    return min(float(timeout), cap)


@dataclass(frozen=True)
class StageRequest:
    """``ckpt_stage``'s arguments, checked: which ranks' files to pull from which node."""

    lineage: int
    gen: int
    owner: tuple[int, int]
    pulls: dict[str, tuple[int, ...]]  # source node -> ranks whose files it gives
    timeout: float

    @classmethod
    def from_args(cls, args: dict, node_names: list[str], this_node: str) -> StageRequest:
        return cls(int_arg(args.get("lineage"), "lineage"), int_arg(args.get("gen"), "gen"), owner_of(args),
                   pulls_of(args, node_names, refused=this_node), timeout_of(args, MAX_TIMEOUT))


class Stager:
    """This node's side of ``ckpt_stage``. ``channel(node)``: the peer channel to a node;
    ``bulk``: the bulk path for the bytes (a file it fails for goes over the channel; None: the channel only)."""

    def __init__(self, *, node: str, root: Path, channel, reserve: int, max_file: int, bulk: Bulk | None = None):
        self.node = node
        self.root = Path(root)
        self.channel = channel
        self.bulk = bulk
        self.target = TargetGeneration(self.root, reserve)
        #: A file larger than this is refused unread (a source's manifest is a peer's word: checkpoint_max_rank_bytes).
        self.max_file = max_file

    async def stage(self, request: StageRequest) -> dict:
        started = time.monotonic()
        directory = ckptstore.gen_dir(self.root, request.lineage, request.gen)
        where = f"{self.node}: staging {directory}"
        try:
            local = await trio.to_thread.run_sync(self.target.open_dirs, directory, request.owner)
        except (UnsafePath, OSError, StoreError) as exc:
            raise RemoteError("restart_failed", f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
        from .checkpoint import NoRoom  # (checkpoint imports nothing of this module)

        pulled: list[str] = []  # final names this call wrote (removed again if it fails)
        try:
            with trio.fail_after(request.timeout):
                manifests: dict[str, Manifest] = {}

                async def read_manifest(source: str) -> None:
                    manifests[source] = await transfer.fetch_manifest(self.channel(source), lineage=request.lineage, gen=request.gen, node=source)

                async with trio.open_nursery() as nursery:
                    for source in request.pulls:
                        nursery.start_soon(read_manifest, source)
                wanted = self._plan(request, manifests, local)
                limiter = trio.Semaphore(PARALLEL)

                async def one(source: str, name: str, size: int, checksum: str) -> None:
                    async with limiter:
                        in_ranks = name.startswith(f"{ckptstore.RANKS_DIR}/")
                        dest = directory / ckptstore.RANKS_DIR if in_ranks else directory
                        pulled.append(name)
                        try:
                            await transfer.fetch_file(
                                self.channel(source), lineage=request.lineage, gen=request.gen, name=name, size=size,
                                checksum=checksum, dest_dir=dest, owner=request.owner if in_ranks else None, durable=False,
                                bulk=self.bulk,
                            )
                        except RemoteError as exc:
                            raise RemoteError(exc.code, f"node {source}'s job-{request.lineage}/gen-{request.gen}/{name}: {exc.message}") from None

                await trio.to_thread.run_sync(self.target.room, directory, sum(size for _, _, size, _ in wanted))
                async with trio.open_nursery() as nursery:
                    for source, name, size, checksum in wanted:
                        nursery.start_soon(one, source, name, size, checksum)
                iteration = next(iter(manifests.values())).iteration
                manifest = merged(local, request.lineage, request.gen, self.node, iteration,
                                  {name: [size, checksum] for _, name, size, checksum in wanted},
                                  {r for ranks_of in request.pulls.values() for r in ranks_of},
                                  {name: list(manifests[source].links(name)) for source, name, _, _ in wanted if manifests[source].links(name)})
                await trio.to_thread.run_sync(self.target.commit, directory, manifest, [name for _, name, _, _ in wanted])
        except trio.TooSlowError:
            await self.target.undo(directory, pulled)
            raise RemoteError("timeout", f"{where}: the files did not arrive within {request.timeout:.0f} s") from None
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self.target.undo(directory, pulled)
            if isinstance(exc, BaseExceptionGroup):
                exc = leaf_error(exc)
            if isinstance(exc, RemoteError):
                message = exc.message if exc.message.startswith(f"{self.node}:") else f"{where}: {exc.message}"
                raise RemoteError(exc.code, message) from None
            if isinstance(exc, NoRoom | StoreError):
                raise RemoteError("restart_failed", f"{where}: {exc}") from None
            if isinstance(exc, OSError):
                raise RemoteError("restart_failed", f"{where}: {ckptstore.describe_os_error(exc, directory)}") from None
            raise
        size = sum(s for _, _, s, _ in wanted)
        log.info("staged %d files (%d bytes) of job-%d/gen-%d from %s in %.2f s", len(wanted), size, request.lineage, request.gen,
                 ", ".join(sorted(request.pulls)), time.monotonic() - started)
        return {"node": self.node, "files": [name for _, name, _, _ in wanted], "bytes": size, "seconds": time.monotonic() - started}

    def _plan(self, request: StageRequest, manifests: dict[str, Manifest], local: Manifest | None) -> list[tuple[str, str, int, str]]:
        """(source, name, size, checksum) of every file to pull: each rank's
        state file (which must be there) and network context (if it had
        one), and the job's record unless this node holds one already."""
        iterations = {m.iteration for m in manifests.values()} | ({local.iteration} if local is not None else set())
        if len(iterations) > 1:
            raise RemoteError("restart_failed", f"the manifests of job-{request.lineage}/gen-{request.gen} disagree on its iteration ({sorted(iterations)})")
        have = local.files if local is not None else {}
        wanted: list[tuple[str, str, int, str]] = []
        for source, ranks in request.pulls.items():
            listed = manifests[source].files
            for rank in ranks:
                state = ckptstore.cluster_rank_file(rank)
                if state not in listed:
                    raise RemoteError("restart_failed", f"node {source}'s job-{request.lineage}/gen-{request.gen}/MANIFEST lists no {state}")
                for name in (state, ckptstore.net_file(rank)):
                    if name not in listed or have.get(name) == listed[name]:
                        continue  # (a rank without messages in flight has no context; a file staged before is here)
                    if name in have:
                        raise RemoteError("restart_failed", f"{self.node}'s job-{request.lineage}/gen-{request.gen}/{name} differs from node {source}'s")
                    if listed[name][0] > self.max_file:
                        raise RemoteError("restart_failed", f"node {source}'s job-{request.lineage}/gen-{request.gen}/{name} is "
                                          f"{listed[name][0]} bytes, more than one file may hold (checkpoint_max_rank_bytes = {self.max_file})")
                    wanted.append((source, name, *listed[name]))
        if "job.msgpack" not in have:
            for source in sorted(request.pulls):
                if "job.msgpack" in manifests[source].files and manifests[source].files["job.msgpack"][0] <= self.max_file:
                    wanted.append((source, "job.msgpack", *manifests[source].files["job.msgpack"]))
                    break
        return wanted



def merged(local: Manifest | None, lineage: int, gen: int, node: str, iteration: int, files: dict[str, list], ranks: set[int],
           needs: dict[str, list[int]] | None = None) -> Manifest:
    """This node's MANIFEST of the generation once ``files`` (name -> [size,
    checksum]) of ``ranks`` landed: the union with what it listed (``local``).
    ``needs``: the links of the landed files that are deltas (their source's
    MANIFEST's); a file that stays keeps its own."""
    union = dict(local.files) if local is not None else {}
    union.update(files)
    links = {name: gens for name, gens in (local.needs if local is not None else {}).items() if name not in files}
    links.update(needs or {})
    return Manifest(lineage, gen, node, iteration, union, sorted(set(local.ranks if local is not None else ()) | ranks), time.time(), links)


#: A node's checkpoint root: traversable by job owners (each job's ``ranks/``
#: is theirs), not listable.
ROOT_MODE = 0o711


def open_root(root: Path) -> int:
    """An fd of this node's checkpoint root, made again (root's, ROOT_MODE) if
    it is gone: a disk wiped or replaced under the running daemon takes the
    root with it, and the checkpoints and rebuilds that land here after must
    not fail for it. Blocking."""
    fd = safefs.open_trusted_dir(root, create_mode=ROOT_MODE)
    try:
        os.fchmod(fd, ROOT_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


class TargetGeneration:
    """A node's generation directory that files of other nodes land in (a
    staging, a rebuild: :mod:`gangd.daemon.rebuild`), and the commit that
    lists them: made as a checkpoint makes it, filled under the final names
    but unlisted until :meth:`commit` rewrites the MANIFEST with the union, and
    emptied of what a failed attempt wrote (:meth:`undo`). Blocking: run in
    threads (``trio.to_thread.run_sync``), but for :meth:`undo`."""

    def __init__(self, root: Path, reserve: int):
        self.root = Path(root)
        self.reserve = reserve

    def open_dirs(self, directory: Path, owner: tuple[int, int]) -> Manifest | None:
        """``job-L/gen-G/ranks`` made (or found) as a checkpoint makes them;
        this node's manifest of the generation if it has one. A generation
        directory without a manifest is a leftover (an aborted staging or
        checkpoint): it is replaced."""
        root = open_root(self.root)
        try:
            job = safefs.open_dir_at(root, directory.parent.name, self.root, create_mode=0o711)
        finally:
            os.close(root)
        try:
            os.fchmod(job, 0o711)
            local: Manifest | None = None
            try:
                os.stat(directory.name, dir_fd=job, follow_symlinks=False)
                exists = True
            except FileNotFoundError:
                exists = False
            if exists:
                gen = safefs.open_dir_at(job, directory.name, directory.parent)
                try:
                    local = ckptstore.read_manifest(directory, dir_fd=gen, owner=os.geteuid())
                except StoreError:
                    local = None
                finally:
                    os.close(gen)
                if local is not None and (local.lineage, local.gen) != (int(directory.parent.name[4:]), int(directory.name[4:])):
                    raise StoreError(f"{directory / ckptstore.MANIFEST} is another generation's")
                if local is None:
                    safefs.rmtree_at(job, directory.name)
            gen = safefs.open_dir_at(job, directory.name, directory.parent, create_mode=0o711)
        finally:
            os.close(job)
        try:
            os.fchmod(gen, 0o711)
            ranks = safefs.open_dir_at(gen, ckptstore.RANKS_DIR, directory, create_mode=0o700, trusted=False, owner=owner[0])
            try:
                if local is None:
                    os.fchown(ranks, *owner)
                elif os.fstat(ranks).st_uid != owner[0]:
                    raise StoreError(f"{directory / ckptstore.RANKS_DIR} belongs to uid {os.fstat(ranks).st_uid}, not to the job's owner {owner[0]}")
            finally:
                os.close(ranks)
        finally:
            os.close(gen)
        return local

    def gen_fd(self, directory: Path) -> int:
        return ckptstore.open_generation(self.root, directory)

    def room(self, directory: Path, incoming: int) -> None:
        """Raise NoRoom unless the disk takes ``incoming`` bytes and still keeps its reserve."""
        from .checkpoint import NoRoom

        fd = self.gen_fd(directory)
        try:
            enough, free, reserve = ckptstore.room_for(fd, incoming, self.reserve)
        finally:
            os.close(fd)
        if not enough:
            raise NoRoom(f"the checkpoint disk ({self.root}) has {free} bytes free; the files to copy need {incoming} "
                         f"and gangd keeps {reserve} free there (output_reserve)")

    def commit(self, directory: Path, manifest: Manifest, names: list[str]) -> None:
        fd = self.gen_fd(directory)
        try:
            ckptstore.sync(directory, names, dir_fd=fd)
            if any(n.startswith(f"{ckptstore.RANKS_DIR}/") for n in names):
                ranks = safefs.open_dir_at(fd, ckptstore.RANKS_DIR, directory, trusted=False)
                try:
                    os.fsync(ranks)
                finally:
                    os.close(ranks)
            ckptstore.write_manifest(directory, manifest, dir_fd=fd)
        finally:
            os.close(fd)

    async def undo(self, directory: Path, names: list[str]) -> None:
        """Remove what a failed staging pulled (not in the manifest: never taken for staged)."""
        def remove() -> None:
            try:
                fd = self.gen_fd(directory)
            except (UnsafePath, OSError):
                return
            try:
                for name in names:
                    *dirs, leaf = name.split("/")
                    try:
                        if dirs:
                            sub = safefs.open_dir_at(fd, dirs[0], directory, trusted=False)
                            try:
                                os.unlink(leaf, dir_fd=sub)
                            finally:
                                os.close(sub)
                        else:
                            os.unlink(leaf, dir_fd=fd)
                    except (OSError, UnsafePath):
                        pass
            finally:
                os.close(fd)

        await trio.to_thread.run_sync(remove)
