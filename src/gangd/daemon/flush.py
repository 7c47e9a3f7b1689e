"""The third level: a generation flushed to a shared directory, behind the job (issue 16).

Partner copies and XOR parity survive the loss of one node of each set;
when more nodes are gone (two of one XOR set, a node and its partner), a
copy on a parallel file system still brings the job back, as SCR's flush
and FTI's L4 do. ``[checkpoint] flush_dir`` names a directory mounted at
the same path on every node; every ``flush_every``-th generation of a job
is copied there by each of its nodes, after it is complete (and protected,
where it has redundancy), while the job runs on, at most
``flush_mib_per_s`` per node so the file system is not taken from the
jobs that compute on it.

Layout: ``<flush_dir>/job-L/gen-G/<node>/`` holds what ``<node>`` held of
the generation (its MANIFEST and the files it lists: the ranks' states and
network contexts, the job's record), all root's: directories 0700, files
0600. A node writes into ``<node>.part/`` and renames it into place only
after every file and the MANIFEST are fsynced, so a flush cut short never
looks like a flush; every file is checked against the node's MANIFEST while
it is copied (a local file damaged since the commit is not flushed). The
coordinator records the generation *flushed* in etcd only when every node
answered (``ckpt_flush``); only then does a restart use it.

A restart whose ranks' files are on no live node takes them from there
(``ckpt_unflush``): each node copies the files of its ranks from the
flushed directories of the nodes that held them into its own generation
directory, checked against the flushed MANIFEST, laid out as a checkpoint
lays them out (:class:`gangd.daemon.staging.TargetGeneration` does the
directories, the commit and the undo, as for a staging or a rebuild), so the
restore reads its own disk as always.

Everything here is reached from the trusted ``flush_dir`` down through
descriptors, never through a link; the flush directory itself must be
root's and writable by no one else, like the checkpoint root.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from .. import ckptstore, safefs
from ..ckptstore import Manifest, StoreError
from ..failpoint import hold
from ..redundancy import transfer
from ..redundancy.plan import NODE_NAME
from ..rpc import RemoteError
from ..safefs import UnsafePath
from .staging import TargetGeneration, int_arg, merged, owner_of, pulls_of, timeout_of

log = logging.getLogger("gangd.flush")

#: A hold point (:func:`gangd.failpoint.hold`): a flush waits here before it starts (a test keeps a generation unflushed).
HOLD = "flush.hold"

PART = ".part"
#: How long the start-up check of flush_dir may take (a shared file system that hangs).
CHECK_TIMEOUT = 60.0
#: Longest a flush or an unflush may take, whatever the coordinator asks.
MAX_TIMEOUT = 24 * 3600.0


@dataclass(frozen=True)
class FlushRequest:
    """``ckpt_flush``'s arguments, checked (they come from a peer)."""

    lineage: int
    gen: int
    rate: int  # bytes per second this node may write to the flush directory (0: unthrottled)
    timeout: float

    @classmethod
    def from_args(cls, args: dict) -> FlushRequest:
        return cls(int_arg(args.get("lineage"), "lineage", 1), int_arg(args.get("gen"), "gen", 1),
                   int_arg(args.get("rate", 0), "rate"), timeout_of(args, MAX_TIMEOUT))


@dataclass(frozen=True)
class UnflushRequest:
    """``ckpt_unflush``'s arguments, checked: which ranks' files to take from which node's flushed copy."""

    lineage: int
    gen: int
    owner: tuple[int, int]
    pulls: dict[str, tuple[int, ...]]  # node whose flushed copy holds them -> ranks
    timeout: float

    @classmethod
    def from_args(cls, args: dict, node_names: list[str]) -> UnflushRequest:
        pulls = pulls_of(args, node_names)
        if not all(NODE_NAME.match(node) for node in pulls):  # (a directory name in the flush directory)
            raise RemoteError("bad_request", "'pulls' names a node that is not a directory name")
        return cls(int_arg(args.get("lineage"), "lineage", 1), int_arg(args.get("gen"), "gen", 1), owner_of(args), pulls,
                   timeout_of(args, MAX_TIMEOUT))


def keep_of(args: dict) -> frozenset[int]:
    """``keep`` of a sweep request (a peer's): the generation numbers to leave, bounded."""
    keep = args.get("keep")
    if not isinstance(keep, (list, tuple)) or len(keep) > 4096:
        raise RemoteError("bad_request", "'keep' must list at most 4096 generation numbers")
    return frozenset(int_arg(g, "a generation in 'keep'", 1) for g in keep)


class Cancelled(Exception):
    """The copy was abandoned (its caller was cancelled or timed out)."""


class Throttle:
    """At most ``rate`` bytes per second on average since the first byte (0: no limit)."""

    def __init__(self, rate: int, stop: threading.Event):
        self.rate = rate
        self.stop = stop
        self.started = time.monotonic()
        self.moved = 0

    def spend(self, n: int) -> None:
        if self.stop.is_set():
            raise Cancelled
        self.moved += n
        if self.rate:
            ahead = self.moved / self.rate - (time.monotonic() - self.started)
            if ahead > 0 and self.stop.wait(ahead):
                raise Cancelled


def _copy(src_fd: int, dst_fd: int, size: int, throttle: Throttle) -> str:
    """Copy ``size`` bytes (exactly: a file that changed size is refused); the copy's checksum."""
    digest = ckptstore.hasher()
    buf = bytearray(min(ckptstore.CHUNK, max(size, 1)))
    view = memoryview(buf)
    done = 0
    while done < size:
        n = os.preadv(src_fd, [view[: min(len(buf), size - done)]], done)
        if n == 0:
            raise StoreError(f"is {done} bytes, not the {size} its manifest says")
        digest.update(view[:n])
        ckptstore.write_chunks(dst_fd, [view[:n]])
        done += n
        throttle.spend(n)
    if os.fstat(src_fd).st_size != size:
        raise StoreError(f"is {os.fstat(src_fd).st_size} bytes, not the {size} its manifest says")
    return digest.hexdigest()


def _open_flushed(node_fd: int, name: str, where: Path) -> int:
    """A flushed file (``name`` under a node's flushed directory), as the
    daemon wrote it: every directory on the way root's and writable by no one
    else, the file root's with no other name, no link followed. The shared
    file system is reachable by others (other hosts' roots, a squashed root):
    what is there is hostile until these hold, and then checked against its
    MANIFEST as it is copied."""
    *dirs, leaf = name.split("/")
    fd, owned = node_fd, False
    try:
        for part in dirs:
            sub = safefs.open_dir_at(fd, part, where)  # (trusted: root's, not writable by others)
            if owned:
                os.close(fd)
            fd, where, owned = sub, where / part, True
        return safefs.open_owned_regular_at(fd, leaf, where, owner=os.geteuid())
    finally:
        if owned:
            os.close(fd)


def _create(dir_fd: int, name: str, owner: tuple[int, int] | None = None) -> int:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    if owner is not None:
        os.fchown(fd, *owner)
    return fd


class Flusher:
    """This node's side of ``ckpt_flush``, ``ckpt_unflush`` and ``ckpt_flush_remove``."""

    def __init__(self, *, node: str, root: Path, flush_dir: Path | None, max_file: int):
        self.node = node
        self.root = Path(root)
        self.flush_dir = Path(flush_dir) if flush_dir is not None else None
        self.max_file = max_file
        #: Generations whose flush runs (until its thread has ended, even one abandoned by a timeout).
        self.busy: set[tuple[int, int]] = set()
        # Threads of their own, so a hung shared file system holds only these,
        # never the default limiter the checkpoint commits use: flushes one at
        # a time (so flush_mib_per_s bounds the node, not each flush), restores
        # (a restart waits on them) and removals apart.
        self._flushes = trio.CapacityLimiter(1)
        self._restores = trio.CapacityLimiter(2)
        self._removals = trio.CapacityLimiter(1)

    # ------------------------------------------------------------ the directory itself

    def check(self) -> str:
        """Why ``flush_dir`` cannot be used ("" if it can); blocking (a thread).

        What is safe, and why:

        - it must **exist**: the daemon never creates it, so a shared file
          system that is not mounted yet is not silently replaced by a
          directory on the local disk (whose copies would die with the node);
        - it must be a **directory reached without a link**, every ancestor
          root's and writable by others only with the sticky bit (the
          rules of :func:`gangd.safefs.open_trusted_dir`);
        - it must be **root's and writable by no one else, sticky or not**:
          the daemon creates ``job-L`` names in it, and a user who may create
          names there could take ``job-L`` first (a directory of theirs the
          daemon then refuses: no flush of that job ever again) or plant what
          a restart would read;
        - root must be able to **write it as root**: a probe directory created
          there must be root's. Under NFS root squash the daemon's files would
          belong to ``nobody``, so they could be rewritten by anyone mapped to
          that uid, and every later ownership check would refuse them.
        """
        if self.flush_dir is None:
            return ""
        where = self.flush_dir
        try:
            top = safefs.open_trusted_dir(where)
        except UnsafePath as exc:
            return str(exc)
        probe = f".probe-{self.node}"
        try:
            try:
                safefs.rmtree_at(top, probe)
                os.mkdir(probe, 0o700, dir_fd=top)
            except OSError as exc:
                return f"root cannot create entries in {where}: {exc.strerror or exc}"
            try:
                uid = os.stat(probe, dir_fd=top, follow_symlinks=False).st_uid
            finally:
                safefs.rmtree_at(top, probe)
            if uid != os.geteuid():
                return (f"what root creates in {where} belongs to uid {uid} (root squash?): the daemon's copies "
                        "there would not be root's; export it without root squash for the gangd nodes")
            return ""
        finally:
            os.close(top)

    async def check_at_start(self) -> None:
        """Start-up: say clearly, once, if ``flush_dir`` cannot be used (the
        daemon runs on: checkpoints and the other levels do not depend on it,
        and each flush checks again, so a mount that comes up later is used)."""
        if self.flush_dir is None:
            return
        try:
            with trio.fail_after(CHECK_TIMEOUT):
                problem = await trio.to_thread.run_sync(self.check, abandon_on_cancel=True, limiter=self._removals)
        except trio.TooSlowError:
            problem = f"{self.flush_dir} did not answer within {CHECK_TIMEOUT:.0f} s (a hung shared file system?)"
        except OSError as exc:
            problem = f"{self.flush_dir}: {exc.strerror or exc}"
        if problem:
            log.error("[checkpoint] flush_dir cannot be used; no generation is flushed until it can: %s", problem)
        else:
            log.info("flush directory %s checked: root's, written as root, writable by no one else", self.flush_dir)

    def _require(self) -> Path:
        if self.flush_dir is None:
            raise RemoteError("not_configured", f"{self.node} has no [checkpoint] flush_dir")
        return self.flush_dir

    def _where(self, lineage: int, gen: int) -> Path:
        return self._require() / f"job-{lineage}" / f"gen-{gen}"

    async def _in_thread(self, fn, timeout: float, what: str, limiter: trio.CapacityLimiter, key: tuple[int, int] | None = None):
        """``fn(stop)`` in a thread of ``limiter``, abandoned (told to stop) on
        cancellation or after ``timeout``; ``key`` leaves :attr:`busy` only
        when the thread has ended (an abandoned thread may still be writing)."""
        stop, started = threading.Event(), threading.Event()

        def run(stop: threading.Event):
            started.set()
            try:
                return fn(stop)
            finally:
                if key is not None:
                    self.busy.discard(key)

        try:
            with trio.fail_after(timeout):
                return await trio.to_thread.run_sync(run, stop, abandon_on_cancel=True, limiter=limiter)
        except trio.TooSlowError:
            raise RemoteError("timeout", f"{self.node}: {what} took more than {timeout:.0f} s") from None
        finally:
            stop.set()
            if key is not None and not started.is_set():
                self.busy.discard(key)  # (never started: cancelled while waiting for its turn)

    # ------------------------------------------------------------ flush

    async def flush(self, request: FlushRequest) -> dict:
        await hold(HOLD)
        key = (request.lineage, request.gen)
        where = self._where(*key)
        if key in self.busy:
            raise RemoteError("busy", f"{self.node} is already flushing job-{request.lineage}/gen-{request.gen}")
        self.busy.add(key)
        started = time.monotonic()
        try:
            size, files = await self._in_thread(lambda stop: self._flush(request, stop), request.timeout, f"flushing to {where}",
                                                self._flushes, key)
        except (StoreError, UnsafePath, OSError, Cancelled) as exc:
            text = ckptstore.describe_os_error(exc, where) if isinstance(exc, OSError) else str(exc) or "stopped"
            raise RemoteError("flush_failed", f"{self.node}: flushing job-{request.lineage}/gen-{request.gen} to {where}: {text}") from None
        except RemoteError as exc:
            raise RemoteError(exc.code, exc.message if exc.message.startswith(f"{self.node}:") else f"{self.node}: {exc.message}") from None
        seconds = time.monotonic() - started
        log.info("flushed job-%d/gen-%d (%d files, %d bytes) to %s in %.2f s", request.lineage, request.gen, files, size, where, seconds)
        return {"node": self.node, "bytes": size, "files": files, "seconds": seconds}

    def _flush(self, request: FlushRequest, stop: threading.Event) -> tuple[int, int]:
        directory = ckptstore.gen_dir(self.root, request.lineage, request.gen)
        gen_fd = ckptstore.open_generation(self.root, directory)
        try:
            manifest = ckptstore.read_manifest(directory, dir_fd=gen_fd, owner=os.geteuid())
            if (manifest.lineage, manifest.gen) != (request.lineage, request.gen):
                raise StoreError(f"{directory / ckptstore.MANIFEST} is another generation's")
            for name in manifest.files:
                transfer.check_name(name)
            total = sum(size for size, _ in manifest.files.values())
            dest_gen = self._open_flush_gen(request.lineage, request.gen, create=True)
            try:
                enough, free, _ = ckptstore.room_for(dest_gen, total, 0)
                if not enough:
                    raise StoreError(f"the flush directory has {free} bytes free; this node's files need {total}")
                part = self.node + PART
                safefs.rmtree_at(dest_gen, part)  # (a flush cut short before)
                os.mkdir(part, 0o700, dir_fd=dest_gen)
                part_fd = safefs.open_dir_at(dest_gen, part, self._where(request.lineage, request.gen))
                try:
                    self._copy_out(directory, gen_fd, part_fd, manifest, Throttle(request.rate, stop))
                    ckptstore.write_manifest(self._where(request.lineage, request.gen) / part, manifest, dir_fd=part_fd)
                    os.fsync(part_fd)
                finally:
                    os.close(part_fd)
                safefs.rmtree_at(dest_gen, self.node)  # (an earlier flush of the same generation)
                os.rename(part, self.node, src_dir_fd=dest_gen, dst_dir_fd=dest_gen)
                os.fsync(dest_gen)
            finally:
                os.close(dest_gen)
            return total, len(manifest.files)
        finally:
            os.close(gen_fd)

    def _copy_out(self, directory: Path, gen_fd: int, part_fd: int, manifest: Manifest, throttle: Throttle) -> None:
        subdirs: dict[str, int] = {}
        try:
            for name, (size, checksum) in sorted(manifest.files.items()):
                *dirs, leaf = name.split("/")
                target = part_fd
                if dirs:
                    if dirs[0] not in subdirs:
                        os.mkdir(dirs[0], 0o700, dir_fd=part_fd)
                        subdirs[dirs[0]] = safefs.open_dir_at(part_fd, dirs[0], directory)
                    target = subdirs[dirs[0]]
                src = ckptstore.open_in(gen_fd, name, directory)
                try:
                    dst = _create(target, leaf)
                    try:
                        got = _copy(src, dst, size, throttle)
                        os.fsync(dst)
                    finally:
                        os.close(dst)
                except StoreError as exc:
                    raise StoreError(f"{directory / name} {exc}") from None
                finally:
                    os.close(src)
                if got != checksum:
                    raise StoreError(f"{directory / name} does not match its MANIFEST (damaged since the checkpoint); not flushed")
            for fd in subdirs.values():
                os.fsync(fd)
        finally:
            for fd in subdirs.values():
                os.close(fd)

    def _open_flush_gen(self, lineage: int, gen: int, *, create: bool) -> int:
        flush_dir = self._require()
        top = safefs.open_trusted_dir(flush_dir)
        try:
            job = safefs.open_dir_at(top, f"job-{lineage}", flush_dir, create_mode=0o700 if create else None)
            if create:
                os.fsync(top)  # (the new directory's entry, before anything in it is taken for flushed)
        finally:
            os.close(top)
        try:
            gen_fd = safefs.open_dir_at(job, f"gen-{gen}", flush_dir / f"job-{lineage}", create_mode=0o700 if create else None)
            if create:
                os.fsync(job)
            return gen_fd
        finally:
            os.close(job)

    # ------------------------------------------------------------ unflush (a restart's files)

    async def unflush(self, request: UnflushRequest, target: TargetGeneration) -> dict:
        """Copy the files of ``request``'s ranks from the flushed directories
        into this node's generation directory (``target``: this node's
        checkpoint root, for the directories, the commit and the undo)."""
        started = time.monotonic()
        directory = ckptstore.gen_dir(self.root, request.lineage, request.gen)
        where = f"{self.node}: restoring {directory} from {self._where(request.lineage, request.gen)}"
        try:
            local = await trio.to_thread.run_sync(target.open_dirs, directory, request.owner)
        except (UnsafePath, OSError, StoreError) as exc:
            raise RemoteError("restart_failed", f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
        copied: list[str] = []
        try:
            size, manifest = await self._in_thread(lambda stop: self._unflush(request, directory, local, copied, stop, target.reserve),
                                                   request.timeout, where, self._restores)
            await trio.to_thread.run_sync(target.commit, directory, manifest, list(copied))
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await target.undo(directory, list(copied))
            if isinstance(exc, RemoteError):
                raise
            if isinstance(exc, (StoreError, UnsafePath)):
                raise RemoteError("restart_failed", f"{where}: {exc}") from None
            if isinstance(exc, OSError):
                raise RemoteError("restart_failed", f"{where}: {ckptstore.describe_os_error(exc, directory)}") from None
            raise
        seconds = time.monotonic() - started
        log.info("restored %d files (%d bytes) of job-%d/gen-%d from the flush directory in %.2f s", len(copied), size,
                 request.lineage, request.gen, seconds)
        return {"node": self.node, "files": copied, "bytes": size, "seconds": seconds}

    def _unflush(self, request: UnflushRequest, directory: Path, local: Manifest | None, copied: list[str],
                 stop: threading.Event, reserve: int) -> tuple[int, Manifest]:
        flushed = self._where(request.lineage, request.gen)
        gen_flush = self._open_flush_gen(request.lineage, request.gen, create=False)
        gen_fd = ckptstore.open_generation(self.root, directory)
        throttle = Throttle(0, stop)
        files = dict(local.files) if local is not None else {}
        landed: dict[str, list] = {}
        needs: dict[str, list[int]] = {}
        ranks: set[int] = set()
        iteration = local.iteration if local is not None else None
        total = 0
        try:
            for source, wanted_ranks in sorted(request.pulls.items()):
                node_fd = safefs.open_dir_at(gen_flush, source, flushed)
                try:
                    theirs = ckptstore.read_manifest(flushed / source, dir_fd=node_fd, owner=os.geteuid())
                    if (theirs.lineage, theirs.gen, theirs.node) != (request.lineage, request.gen, source):
                        raise StoreError(f"{flushed / source / ckptstore.MANIFEST} is not {source}'s job-{request.lineage}/gen-{request.gen}")
                    if iteration is not None and theirs.iteration != iteration:
                        raise StoreError(f"the flushed generation's iteration ({theirs.iteration}) is not this node's ({iteration})")
                    iteration = theirs.iteration
                    names = []
                    for rank in wanted_ranks:
                        state = ckptstore.cluster_rank_file(rank)
                        if state not in theirs.files:
                            raise StoreError(f"{flushed / source / ckptstore.MANIFEST} lists no {state}")
                        names += [n for n in (state, ckptstore.net_file(rank)) if n in theirs.files]
                    if "job.msgpack" not in files and "job.msgpack" in theirs.files:
                        names.append("job.msgpack")
                    incoming = sum(theirs.files[n][0] for n in names if files.get(n) != theirs.files[n])
                    enough, free, kept = ckptstore.room_for(gen_fd, incoming, reserve)
                    if not enough:
                        raise StoreError(f"the checkpoint disk has {free} bytes free; the files to restore need {incoming} "
                                         f"and gangd keeps {kept} free there (output_reserve)")
                    for name in names:
                        size, checksum = theirs.files[name]
                        if files.get(name) == [size, checksum]:
                            continue  # (already here, the same)
                        if name in files:
                            raise StoreError(f"{directory / name} differs from {source}'s flushed copy")
                        if size > self.max_file:
                            raise StoreError(f"{flushed / source / name} is {size} bytes, more than one file may hold "
                                             f"(checkpoint_max_rank_bytes = {self.max_file})")
                        self._copy_in(flushed / source, node_fd, name, size, checksum, directory, gen_fd,
                                      request.owner if name.startswith(f"{ckptstore.RANKS_DIR}/") else None, throttle, copied)
                        files[name] = landed[name] = [size, checksum]
                        if theirs.links(name):  # (a delta: the generations it needs, as its node's MANIFEST said)
                            needs[name] = theirs.links(name)
                        total += size
                    ranks |= set(wanted_ranks)
                finally:
                    os.close(node_fd)
        finally:
            os.close(gen_flush)
            os.close(gen_fd)
        if iteration is None:  # (pulls is never empty: the request says so)
            raise StoreError("nothing to restore")
        return total, merged(local, request.lineage, request.gen, self.node, iteration, landed, ranks, needs)

    def _copy_in(self, source_dir: Path, source_fd: int, name: str, size: int, checksum: str, directory: Path, gen_fd: int,
                 owner: tuple[int, int] | None, throttle: Throttle, copied: list[str]) -> None:
        src = _open_flushed(source_fd, transfer.check_name(name), source_dir)
        *dirs, leaf = name.split("/")
        try:
            target = safefs.open_dir_at(gen_fd, dirs[0], directory, trusted=False) if dirs else gen_fd
            try:
                try:
                    os.unlink(leaf, dir_fd=target)  # (a leftover no MANIFEST lists)
                except FileNotFoundError:
                    pass
                dst = _create(target, leaf, owner)
                copied.append(name)
                try:
                    try:
                        got = _copy(src, dst, size, throttle)
                    except StoreError as exc:
                        raise StoreError(f"{source_dir / name} {exc}") from None
                finally:
                    os.close(dst)
            finally:
                if dirs:
                    os.close(target)
        finally:
            os.close(src)
        if got != checksum:
            raise StoreError(f"{source_dir / name} does not match its flushed MANIFEST (damaged on the shared file system)")

    # ------------------------------------------------------------ remove

    async def sweep(self, lineage: int, keep: frozenset[int]) -> list[int]:
        """Remove every ``gen-G`` of ``job-<lineage>`` in the flush directory but
        those of ``keep`` (the coordinator's: the generations recorded flushed,
        and the one flushing now): copies a flush left when its coordinator
        stepped down mid-way and the next one flushed another generation, so
        nothing ever recorded them and retention would never remove them.
        Other names are left alone (the daemon writes none). The generations removed."""
        def sweep() -> list[int]:
            top, job = self._job_dir(lineage)
            os.close(top)
            if job is None:
                return []
            try:
                doomed = sorted(int(name[4:]) for name in os.listdir(job)
                                if name.startswith("gen-") and name[4:].isdigit() and len(name) < 24 and int(name[4:]) not in keep)
                for gen in doomed:
                    safefs.rmtree_at(job, f"gen-{gen}")
                return doomed
            finally:
                os.close(job)

        swept = await self._removing(sweep, f"sweeping job-{lineage}")
        if swept:
            log.warning("removed job-%d/%s from %s: flushed copies nothing records (a flush cut short by a coordinator change)",
                        lineage, ", ".join(f"gen-{g}" for g in swept), self.flush_dir)
        return swept

    async def remove(self, lineage: int, gen: int) -> None:
        """Remove a generation's flushed copy (retention); the job's directory too once it is empty."""
        def remove() -> None:
            top, job = self._job_dir(lineage)
            try:
                if job is None:
                    return
                try:
                    safefs.rmtree_at(job, f"gen-{gen}")
                    empty = not os.listdir(job)
                finally:
                    os.close(job)
                if empty:
                    try:
                        os.rmdir(f"job-{lineage}", dir_fd=top)
                    except OSError:
                        pass
            finally:
                os.close(top)

        await self._removing(remove, f"removing job-{lineage}/gen-{gen}")

    def _job_dir(self, lineage: int) -> tuple[int, int | None]:
        """The flush directory and its ``job-<lineage>`` (None if it is not
        there), both opened without following a link; the caller closes them."""
        flush_dir = self._require()
        top = safefs.open_trusted_dir(flush_dir)
        try:
            return top, safefs.open_dir_at(top, f"job-{lineage}", flush_dir)
        except UnsafePath:
            return top, None
        except BaseException:
            os.close(top)
            raise

    async def _removing(self, fn, what: str):
        """``fn()`` in a removal thread (a hung shared file system holds that
        thread, not the daemon), at most 600 s; its failure as a RemoteError."""
        try:
            with trio.fail_after(600):
                return await trio.to_thread.run_sync(fn, abandon_on_cancel=True, limiter=self._removals)
        except trio.TooSlowError:
            raise RemoteError("timeout", f"{self.node}: {what} in {self.flush_dir} took more than 600 s") from None
        except (UnsafePath, OSError) as exc:
            raise RemoteError("flush_failed", f"{self.node}: {what} in {self.flush_dir}: {exc}") from None
