"""A node's part of consistent checkpoints and restarts (paper 000, Fig. 1 and 2).

The coordinator drives each checkpoint through rounds that every node of the
job answers (:mod:`gangd.daemon.ckptcoord`); this module is what one node
does in each round, and the rank-facing side of it (``ckpt_*`` requests and
notes from :mod:`gangd.ckptlib`):

``begin``    SIGQUIT to each local rank; wait for each to report the lowest
             iteration boundary it can still stop at. The coordinator takes
             the largest report of all nodes as the cut.
``cut``      tell the ranks the cut; wait until each reached it (it asks for
             the start sync and blocks); close the job's send gate and wait
             until every rank confirmed. Returns the send counters.
``capture``  drain the network up to those counters, write the network
             context and the job record to the generation's directory
             (into the page cache: their fsyncs run behind the round while
             the ranks write, and the commit waits for them),
             release the ranks to write their state; wait until each wrote
             (or forked its snapshot).
``resume``   open the gate, answer the ranks' end sync: the job runs again.
``commit``   wait for the ranks' files to be on disk; write the manifest.
``abort``    release everything, tell the ranks, remove the directory.

Every wait ends early if a rank of the job exits or its checkpoint
connection closes: the round fails with the reason and the coordinator
aborts the generation on every node.

Files: this node's checkpoint root (``<checkpoint_dir>/<node>``) is checked
at start-up and reached again from ``/`` for every operation (an admin may
mount a disk there later), always through directory descriptors
(:mod:`gangd.safefs`); every file the daemon writes is root's, and the
files it reads back are read in a thread, without following links, to a
size limit (see :mod:`gangd.ckptstore`).

Incremental checkpoints (issue 17): the rank decides what its file holds,
because only it sees its state's block hashes; this node decides what it may
build on. At the begin it plans, per rank, the *offer* the start sync answers
with (:class:`~gangd.checkpoint.messages.DeltaOffer`): the newest sound
generation of the lineage (complete or protected, its redundancy never
failed, taken with the job's present placement) whose MANIFEST here lists
the rank's file, and every generation that file needs, each listed here too
— or nothing (a full file) for the first checkpoint, after the ranks moved,
in mode ``full``, or when the coordinator asks (``force_full``). The rank's
report may name only a tail of that chain, at most ``chain_max`` long
(:meth:`~gangd.checkpoint.messages.WriteReport.parse`): a hostile rank cannot
pin old generations against retention or point a restore elsewhere. The
commit writes what each file needs into the MANIFEST (format 2), and a
restart hands each rank its chain, every link checked to be listed here.
Ranks that write whole files (mode full, or an SPC without blocks) report no links: their
generations are what they always were, MANIFEST format 1 included.

The round's state and every rule about what a rank's message means in which
phase are the pure :class:`gangd.checkpoint.node.NodeRound` (and
:class:`~gangd.checkpoint.node.NodeJobs`: a begin after its abort, a late
abort of an older generation); this module is its trio shell — signals,
notes, gates, files — that feeds it events and waits on its predicates.

What a rank reports is hostile until checked
(:class:`gangd.checkpoint.messages.WriteReport`): its
state file may be at most ``checkpoint_max_rank_bytes``, because a
restart checksums it whole (its rank as it restores; the node, if the file
changed since it was last found intact: :mod:`gangd.daemon.verified`) — a rank that truncates its file to 16 TiB
(sparse, no disk used) and reports that size would otherwise make each
``gang restart`` read 16 TiB. Those checksums run in a few threads of their
own (:data:`VERIFY_THREADS`) at normal scheduling, nice 10: the daemon's
real-time priority is for gang switches and the table, not for reading a
user's file. A round does not start on a checkpoint disk that is nearly
full, and a commit that left it nearly full is aborted (its files removed):
by default checkpoints share the state directory's disk, and the job table
must always find room there (the reserve is ``output_reserve``, as for rank
output; see :mod:`gangd.daemon.outputlog`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgpack
import trio

from .. import ckptstore, jobs, safefs, text
from ..checkpoint import node as nd
from ..checkpoint.messages import (
    MAX_ITERATION,
    MAX_LINKS,
    BadMessage,
    DeltaOffer,
    Link,
    PlanNote,
    RankProgress,
    RankRefused,
    RankReport,
    RankWritten,
    merge_pipelines,
    rank_note,
)
from ..ckptstore import StoreError
from ..failpoint import refuse
from ..redundancy import xor
from ..redundancy.bulk import Bulk, BulkServer
from ..rpc import Channel, RemoteError
from ..safefs import UnsafePath
from .jobnet import caller_rank
from .protect import BulkService, Protector
from .staging import open_root
from .verified import Verified
from .verified import stamp as verified_stamp
from .verified import stats_at as _stats

log = logging.getLogger("gangd.checkpoint")

#: A test's failpoint (:func:`gangd.failpoint.refuse`): the fsync of a generation's own files fails unforeseen.
SYNC_FAILS = "checkpoint.sync"

NOTE_TIMEOUT = 1.0
RESTORED_REPEAT = 1.0  # seconds between reports that this node's ranks of a restarted job loaded their state
#: The longest a failed restore's rank exits wait for the coordinator to have heard why (see :meth:`exits_after_report`).
EXITS_WAIT = 30.0
AGREE_TIMEOUT = 30.0  # every rank reports within this after SIGQUIT (its thread answers at once)
EXIT_REPORT_GRACE = 2.0  # s a rank's write report may trail its exit
RESTORE_TIMEOUT = 600.0
VERIFY_THREADS = 2  # checksumming threads per daemon (restarts beyond that wait their turn)
VERIFY_NICE = 10
OFFER_CANDIDATES = 4  # newest usable generations searched for a rank's parent (each a MANIFEST read)
MANIFESTS_KEPT = 256  # MANIFESTs this node committed, kept parsed for the offers (a begin then reads no file)


class _NotKept(Exception):
    """A MANIFEST the offer needs is not kept in memory: it is read in a thread."""


class NoRoom(Exception):
    """The checkpoint disk is (nearly) full; the message says how full."""


def room_left(fd: int, reserve: int, where: Path | str) -> None:
    """Raise :class:`NoRoom` if the file system of ``fd`` has less than
    ``reserve`` bytes free (at most a quarter of it: a small disk still
    takes checkpoints)."""
    enough, free, reserve = ckptstore.room_for(fd, 0, reserve)
    if not enough:
        raise NoRoom(
            f"the checkpoint disk ({where}) has {free} bytes free, less than the {reserve} bytes gangd keeps free "
            "there for the job table (output_reserve); free space, or give checkpoint_dir a file system of its own"
        )


def _at_low_priority(fn, *args):
    """``fn(*args)`` in this worker thread at SCHED_OTHER and nice
    :data:`VERIFY_NICE`, restored afterwards (trio reuses its threads, and
    they inherit the daemon's real-time policy). As another user than root
    there is no real-time policy to leave, nor a way back from nice 10."""
    if os.geteuid() != 0:
        return fn(*args)
    tid = threading.get_native_id()
    policy, param = os.sched_getscheduler(tid), os.sched_getparam(tid)
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, VERIFY_NICE))
    except OSError:
        pass
    try:
        return fn(*args)
    finally:
        try:
            os.sched_setscheduler(tid, policy, param)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:
            log.warning("could not restore a worker thread's priority: %s", exc.strerror)


def _why_not(exc: OSError | UnsafePath, directory: Path) -> str:
    """Why a generation's directory could not be opened, naming it once."""
    if isinstance(exc, UnsafePath):
        return str(exc)
    return f"{exc.strerror or exc} ({directory})"


@dataclass
class RankAgent:
    """A rank's ckptlib connection."""

    job_id: int
    rank: int
    pid: int
    pidfd: int
    channel: Channel

    def close(self) -> None:
        try:
            os.close(self.pidfd)
        except OSError:
            pass


@dataclass
class Pending(nd.NodeRound):
    """One checkpoint of one job on this node: the pure
    :class:`~gangd.checkpoint.node.NodeRound`, and what its trio shell needs
    besides (where, whose, the daemon's own files, timings, a wake-up)."""

    directory: Path = Path()
    owner: tuple[int, int] | None = None
    files: dict[str, list] = field(default_factory=dict)  # name -> [size, digest] written by the daemon
    times: dict[str, float] = field(default_factory=dict)
    planned: dict[int, DeltaOffer] = field(default_factory=dict)  # what each rank may write a delta of (made at the begin)
    changed: trio.Event = field(default_factory=trio.Event)
    synced: trio.Event | None = None  # the daemon's own files fsynced behind the capture (see NodeCheckpoints.capture)
    sync_error: str | None = None

    @property
    def job_id(self) -> int:
        return self.job

    def feed(self, event: nd.NodeEvent) -> list[nd.AwaitWrite]:
        """The machine's instructions: wake the waiters; the rest for the caller."""
        out = self.handle(event)
        if self.all_written() and self.released and "written" not in self.times and self.failed is None:
            self.times["written"] = time.time()  # the last rank's state is on disk
        if out:
            self.poke()
        return [i for i in out if isinstance(i, nd.AwaitWrite)]

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def fail(self, why: str) -> None:
        self.feed(nd.Fail(why))

    async def until(self, done, timeout: float, what: str) -> None:
        """Wait until ``done()``; raise with the reason if the checkpoint failed or time ran out."""
        with trio.move_on_after(timeout):
            while True:
                if self.failed:
                    raise RemoteError("checkpoint_failed", self.failed)
                if done():
                    return
                await self.changed.wait()
        raise RemoteError("timeout", f"{what} within {timeout:.0f} s")


class NodeCheckpoints:
    def __init__(self, *, node: str, config, table, jobnet, peers, calls, secret: bytes,
                 job_env: Callable[[int], dict], spawn: Callable[..., None]):
        """``config``: the daemon's (checkpoint settings, this node's address); ``table``: the job
        table; ``jobnet``: this node's send gates and network contexts (and, for
        :func:`~.jobnet.caller_rank`, its ranks); ``peers``: the links to the other daemons (the
        redundancy writes); ``calls``: calls to other nodes and the coordinator; ``secret``: the
        cluster's (the bulk path's tickets); ``job_env(job)``: the environment the job's ranks here
        got (kept with a checkpoint: a restart takes it from there); ``spawn``: the daemon's contained tasks."""
        self.node, self.config, self.table, self.jobnet, self.peers, self.calls = node, config, table, jobnet, peers, calls
        self.secret, self.job_env, self.spawn = secret, job_env, spawn
        self.root = config.checkpoint_root
        self.agents: dict[tuple[int, int], RankAgent] = {}
        self.rounds = nd.NodeJobs(node, config.checkpoint_max_rank_bytes)
        self.pending = cast("dict[int, Pending]", self.rounds.rounds)  # (every round here is a Pending)
        self.restarts: dict[int, dict] = {}  # job -> {"gen", "lineage", "directory", "manifest", "ranks"}
        self._requesting: set[int] = set()  # jobs whose ranks asked for a checkpoint just now
        self._verify_threads: trio.CapacityLimiter | None = None  # (made in trio's run)
        self.verified = Verified()  # files known intact since commit or a whole-file check (daemon/verified.py)
        self._protector: Protector | None = None
        self._bulk: BulkService | None = None
        # (lineage, gen) -> the MANIFEST this node committed, newest last (MANIFESTS_KEPT at most): the offers' reads
        self.kept: dict[tuple[int, int], ckptstore.Manifest] = {}
        # ``--ckpt-every auto`` (issue 19): each job's interval plan as the coordinator last sent it (a
        # rank that attaches later hears it too), and each attached rank's last progress report.
        self.plans: dict[int, PlanNote] = {}
        self.progress: dict[tuple[int, int], tuple[RankProgress, float]] = {}  # (job, rank) -> (report, when)
        self._parity_warm = False  # (numpy loaded for the XOR: _warm_parity)
        # (job, rank) -> set once the checkpoint connection of a rank of a job being restored here, which
        # exited, has been read to its end (detached): what it said before it died is heard before its exit.
        self._draining: dict[tuple[int, int], tuple[Channel, trio.Event]] = {}
        # (job, rank) -> why its ckpt.init() refused its settings: said with its exit if it ends on that
        # error (one per rank of this node: a rank's attach is checked against its process; dropped with the job).
        self._last_words: dict[tuple[int, int], str] = {}

    def _may_xor(self, record: dict) -> bool:
        """Whether this job's generations may be XOR-protected (the coordinator decides the level, from the
        job's, its lineage's or the cluster's; a set needs 3 nodes). A restarted job whose lineage asked for
        another level may load numpy for nothing, once per daemon."""
        asked = record.get("ckpt_redundancy") or self.config.checkpoint_redundancy
        return len(jobs.nodes_of(record)) >= 3 and asked in ("auto", "xor")

    def _warm_parity(self) -> None:
        """Load the XOR's numpy in a worker thread, once, while this first generation's ranks agree and
        write (:func:`gangd.redundancy.xor.warm`): not on the path from complete to protected."""
        if self._parity_warm:
            return
        self._parity_warm = True
        self.spawn(trio.to_thread.run_sync, xor.warm)

    def _keep(self, manifest: ckptstore.Manifest) -> None:
        self.kept.pop((manifest.lineage, manifest.gen), None)
        self.kept[(manifest.lineage, manifest.gen)] = manifest
        while len(self.kept) > MANIFESTS_KEPT:
            del self.kept[next(iter(self.kept))]

    # ------------------------------------------------------------ the directories

    def open_root(self) -> None:
        """At start-up: this node's checkpoint root exists and can be trusted
        (raises :class:`UnsafePath` saying why not)."""
        os.close(open_root(self.root))

    def close_root(self) -> None:
        pass  # (nothing kept open: every operation reaches the root afresh)

    def _gen_fd(self, directory: Path) -> int:
        """An fd of a generation's directory ``<root>/job-L/gen-G`` (in a thread)."""
        return ckptstore.open_generation(self.root, directory)

    def _held_manifest(self, held: dict[int, ckptstore.Manifest], lineage: int, gen: int, why: str) -> ckptstore.Manifest:
        """(In a thread.) This node's MANIFEST of ``job-<lineage>/gen-<gen>``,
        read once into ``held``; a StoreError "generation G, <why>: ..." if it cannot be."""
        if gen not in held:
            directory = ckptstore.gen_dir(self.root, lineage, gen)
            try:
                fd = self._gen_fd(directory)
            except (UnsafePath, OSError) as exc:
                raise StoreError(f"generation {gen}, {why}: {_why_not(exc, directory)}") from None
            try:
                held[gen] = ckptstore.read_manifest(directory, dir_fd=fd, owner=os.geteuid())
            finally:
                os.close(fd)
        return held[gen]

    def _remove(self, directory: Path) -> None:
        """Remove a generation's directory, never following a link (in a thread)."""
        try:
            root = safefs.open_trusted_dir(self.root)
            try:
                job = safefs.open_dir_at(root, directory.parent.name, self.root)
            finally:
                os.close(root)
        except UnsafePath as exc:
            if directory.parent.exists():
                log.warning("not removing %s: %s", directory, exc)
            return
        try:
            safefs.rmtree_at(job, directory.name)
        finally:
            os.close(job)

    def _make_dirs(self, directory: Path, owner: tuple[int, int] | None) -> None:
        """The generation's directory (the daemon's; a leftover of an attempt that
        died with its coordinator is replaced) and the owner's ``ranks/`` in it.
        Raises :class:`NoRoom` first if the disk is nearly full."""
        root = open_root(self.root)
        try:
            room_left(root, self.config.output_reserve, self.root)
            job = safefs.open_dir_at(root, directory.parent.name, self.root, create_mode=0o711)
        finally:
            os.close(root)
        try:
            os.fchmod(job, 0o711)  # traversable, not listable
            safefs.rmtree_at(job, directory.name)
            gen = safefs.open_dir_at(job, directory.name, directory.parent, create_mode=0o711)
        finally:
            os.close(job)
        try:
            os.fchmod(gen, 0o711)
            ranks = safefs.open_dir_at(gen, ckptstore.RANKS_DIR, directory, create_mode=0o700)
            try:
                if owner is not None:
                    os.fchown(ranks, *owner)
            finally:
                os.close(ranks)
        finally:
            os.close(gen)

    # ------------------------------------------------------------ rank connections

    async def attach(self, cred: dict, pid: int, args: dict, channel: Channel) -> dict:
        record, rank = caller_rank(self.jobnet, cred, pid, args, "ckpt_attach")
        job_id = record["id"]
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise RemoteError("permission_denied", f"process {pid} is gone: {exc.strerror}") from None
        old = self.agents.pop((job_id, rank), None)
        if old is not None:
            old.close()
        self.agents[(job_id, rank)] = RankAgent(job_id, rank, pid, pidfd, channel)
        channel.context["ckpt_of"] = (job_id, rank)
        reply: dict = {"restart": None, "auto": record.get("ckpt_every") == "auto"}
        plan = self.plans.get(job_id)
        if plan is not None:  # (after the reply: the rank's thread reads it as its first note)
            self.spawn(self._note, channel, plan.op, plan.to_wire())
        restart = self.restarts.get(job_id)
        if restart is not None:
            name = ckptstore.cluster_rank_file(rank)
            reply["restart"] = {
                "gen": restart["gen"],
                "path": str(restart["directory"] / name),
                "expect": restart["manifest"].files[name],
                "chain": [link.to_wire() for link in restart["chains"].get(rank, ())],  # ([]: a whole file)
            }
        return reply

    def detached(self, channel: Channel) -> None:
        key = channel.context.get("ckpt_of")
        if key is not None and key in self._draining and self._draining[key][0] is channel:
            self._draining.pop(key)[1].set()
        if key is None or self.agents.get(key, None) is None or self.agents[key].channel is not channel:
            return
        self.agents.pop(key).close()
        self.progress.pop(key, None)
        pending = self.pending.get(key[0])
        if pending is not None and not pending.resumed:
            pending.feed(nd.RankGone(key[1], f"rank {key[1]} on {self.node} closed its checkpoint connection (it exited or called fini)"))

    def refused(self, channel: Channel, args: dict) -> bool:
        """A rank's ``ckpt.init()`` refused its settings (a codec this machine
        lacks): kept as its last words (:meth:`last_words`). Not the job's
        reason yet: a program may catch the error and run on without checkpoints."""
        key = channel.context.get("ckpt_of")
        if key is None:
            raise RemoteError("bad_request", "ckpt_refused before ckpt_attach")
        try:
            note = RankRefused.from_wire(args)
        except BadMessage as exc:
            raise RemoteError("bad_request", f"ckpt_refused: {exc}") from None
        record = self.table.get(key[0])
        if record is None or jobs.is_terminal(record):
            return False
        self._last_words[key] = f"ckpt.init() refused its settings; the rank said: {note.error}"
        return True

    def last_words(self, job_id: int, rank: int) -> str | None:
        """What the rank said before it exited, once (:meth:`refused`), or None."""
        return self._last_words.pop((job_id, rank), None)

    def rank_exited(self, job_id: int, rank: int, why: str) -> None:
        pending = self.pending.get(job_id)
        if pending is not None:
            # Past the end sync, its snapshot was being written: a rank
            # that ends there (a checkpoint at the program's last step)
            # reports the write before it exits, but the report may
            # still be unread on its connection (left open to be read).
            grace = pending.feed(nd.RankGone(rank, why))
            if grace:
                self.spawn(self._exited_while_writing, pending, grace[0])
                return
        agent = self.agents.pop((job_id, rank), None)
        if agent is not None:
            if job_id in self.restarts:  # (its connection may be closed and its last notes not yet handled: detached says when)
                self._draining[(job_id, rank)] = (agent.channel, trio.Event())
            agent.close()

    async def _writes_arrive(self, pending: Pending, ranks) -> bool:
        """True once the write reports of ``ranks`` are in (they may trail
        the ranks' exit by a moment); False after the grace, or if the
        checkpoint failed meanwhile."""
        with trio.move_on_after(EXIT_REPORT_GRACE):
            try:
                await pending.until(lambda: set(ranks) <= set(pending.written), math.inf, "")
                return True
            except RemoteError:
                return False
        return False

    async def _ended_while_writing(self, pending: Pending) -> None:
        if await self._writes_arrive(pending, pending.ranks):
            return
        self.rounds.finished(pending)
        pending.fail(f"job {pending.job_id} ended before every rank's state was written")

    async def _exited_while_writing(self, pending: Pending, grace: nd.AwaitWrite) -> None:
        if not await self._writes_arrive(pending, [grace.rank]):
            pending.fail(grace.why)  # (no-op if it failed already)
        agent = self.agents.pop((pending.job_id, grace.rank), None)
        if agent is not None:
            agent.close()

    def on_note(self, channel: Channel, op: str, args: dict) -> None:
        key = channel.context.get("ckpt_of")
        if key is None:
            return
        job_id, rank = key
        try:
            note = rank_note(op, args)
        except BadMessage as exc:
            log.info("job %d rank %d sent a malformed %s: %s", job_id, rank, text.printable(op)[:40], exc)
            pending = self.pending.get(job_id)
            if pending is not None and op in ("ckpt_report", "ckpt_written"):
                pending.fail(f"rank {rank} on {self.node} sent a malformed {op}: {exc}")
            return
        if op == "ckpt_restored":
            self._restored(job_id, rank, args)
            return
        if isinstance(note, RankProgress):
            agent = self.agents.get(key)
            if agent is not None and agent.channel is channel:  # (not a replaced or forgotten rank's: kept until it detaches)
                self.progress[key] = (note, time.monotonic())
            return
        pending = self.pending.get(job_id)
        if isinstance(note, RankReport):
            if pending is None:
                what = nd.outside_round(note)
                if what is nd.Outside.REQUEST:  # the program's own SIGQUIT or ckpt.request(), or its interval plan
                    self._requested_by_rank(job_id, rank, channel, note.iteration)
                elif what is nd.Outside.ABORT:  # a generation that is over: let the rank go
                    self.spawn(self._note, channel, "ckpt_abort", {"gen": note.gen, "why": "it is over"})
                else:
                    self.spawn(self._note, channel, "ckpt_none", {})
            else:
                pending.feed(nd.Reported(rank, note))
        elif isinstance(note, RankWritten) and pending is not None and note.gen == pending.gen:
            pending.feed(nd.Written(rank, note.result))

    def _requested_by_rank(self, job_id: int, rank: int, channel: Channel, at: int | None) -> None:
        if job_id in self._requesting:
            return
        self._requesting.add(job_id)
        self.spawn(self._request_checkpoint, job_id, rank, channel, at)

    async def _request_checkpoint(self, job_id: int, rank: int, channel: Channel, at: int | None) -> None:
        record = self.table.get(job_id)
        plan = self.plans.get(job_id)
        planned = plan is not None and at is not None and at >= plan.next  # (its plan's iteration, or the first it can reach)
        trigger = f"planned interval (iteration {at})" if planned else f"SIGQUIT or ckpt.request() in rank {rank}"
        try:
            cred = {"uid": record["owner_uid"], "gid": record["owner_gid"], "user": record["owner"]}
            await self.calls.to_coordinator("coord_checkpoint", job=job_id, cred=cred, wait=False, trigger=trigger,
                                                 **({"at": at} if planned else {}))
        except RemoteError as exc:
            log.info("job %d: rank %d asked for a checkpoint: %s", job_id, rank, exc.message)
            await self._note(channel, "ckpt_none", {})
        finally:
            self._requesting.discard(job_id)

    async def _bounded_note(self, agent: RankAgent, op: str, args: dict) -> None:
        """A note to a rank, in order; a rank that stopped reading its connection loses it."""
        with trio.move_on_after(NOTE_TIMEOUT) as scope:
            await self._note(agent.channel, op, args)
        if scope.cancelled_caught:
            log.warning("job %d rank %d does not read its checkpoint connection; dropping it", agent.job_id, agent.rank)
            self.spawn(agent.channel.aclose)

    async def _note(self, channel: Channel, op: str, args: dict) -> None:
        try:
            await channel.note(op, **args)
        except RemoteError:
            pass

    def _pending_of(self, channel: Channel, args: dict) -> tuple[Pending, int]:
        key = channel.context.get("ckpt_of")
        pending = self.pending.get(key[0]) if key else None
        if key is None or pending is None or args.get("gen") != pending.gen:
            raise RemoteError("no_checkpoint", f"checkpoint {args.get('gen')} is not under way (it was aborted)")
        return pending, key[1]

    async def rank_start(self, channel: Channel, args: dict) -> dict:
        """A rank reached the cut: block it until this node's start sync is done."""
        pending, rank = self._pending_of(channel, args)
        iteration = args.get("iteration")
        pending.feed(nd.Arrived(rank, iteration if type(iteration) is int else None, time.time()))
        await pending.until(lambda: pending.released, math.inf, "release")
        offer = pending.offers.get(rank) or self._full_offer(self._job_mode(self.table.get(pending.job_id)))
        return {"path": pending.path[rank], "delta": offer.to_wire()}

    async def rank_end(self, channel: Channel, args: dict) -> bool:
        """A rank wrote its state (or forked the snapshot that writes it): block it until the end sync."""
        pending, rank = self._pending_of(channel, args)
        result = args.get("result")
        if result is not None and not isinstance(result, dict):
            result = {"size": None}  # (a malformed report: the machine says so)
        pending.feed(nd.Ended(rank, result))
        await pending.until(lambda: pending.resumed, math.inf, "resume")
        return True

    # ------------------------------------------------------------ the rounds

    def _check_ranks(self, record: dict) -> list[int]:
        mine = jobs.ranks_on(record, self.node)
        for rank in mine:
            if record["ranks"][rank] is not None:
                raise RemoteError("not_ready", f"rank {rank} of job {record['id']} already ended; a checkpoint needs every rank")
            if (record["id"], rank) not in self.agents:
                raise RemoteError(
                    "not_ready",
                    f"rank {rank} of job {record['id']} on {self.node} does not take checkpoints "
                    "(it has not called gangd.ckptlib.init(), or has already called fini())",
                )
        return mine

    async def begin(self, args: dict) -> dict:
        record = self._record(args)
        job_id, gen = record["id"], args["gen"]
        if type(gen) is not int or gen < 1:
            raise RemoteError("bad_request", "'gen' must be a generation number")
        mine = self._check_ranks(record)
        lineage = int(args["lineage"])
        try:  # before any await: an abort meanwhile must find it
            pending = cast(Pending, self.rounds.begin(job_id, gen, lineage, mine, make=Pending))
        except nd.Refusal as exc:
            raise RemoteError(exc.code, exc.message) from None
        if self._may_xor(record):
            self._warm_parity()
        directory = pending.directory = ckptstore.gen_dir(self.root, lineage, gen)
        owner = pending.owner = (record["owner_uid"], record["owner_gid"]) if os.geteuid() == 0 else None
        pending.times["begin"] = time.time()
        try:
            await trio.to_thread.run_sync(self._make_dirs, directory, owner)
        except NoRoom as exc:
            raise RemoteError("no_space", f"{self.node}: {exc}") from None
        except (UnsafePath, OSError) as exc:
            raise RemoteError("write_failed", f"{self.node}: cannot create {directory}: {getattr(exc, 'strerror', None) or exc}") from None
        if pending.failed:
            # Aborted while the directories were made: the abort's removal may
            # have come first; what was made is removed here.
            await trio.to_thread.run_sync(self._remove, directory)
            raise RemoteError("checkpoint_failed", pending.failed)
        at = args.get("at")  # (a planned generation's iteration: no rank reports a boundary before it)
        begin_note = {"gen": gen, **({"at": at} if type(at) is int and 0 <= at <= MAX_ITERATION else {})}
        for rank in mine:
            agent = self.agents[(job_id, rank)]
            try:
                signal.pidfd_send_signal(agent.pidfd, signal.SIGQUIT)
            except OSError as exc:
                pending.fail(f"cannot signal rank {rank} on {self.node}: {exc.strerror}")
            # The note reaches the rank's thread even while its main thread is in a long C call.
            await self._bounded_note(agent, "ckpt_begin", begin_note)
        pending.planned = await self._plan_offers(record, pending, force_full=args.get("force_full") is True)
        silent = f"ranks {sorted(set(mine) - set(pending.reports))} did not answer SIGQUIT"
        await pending.until(pending.all_reported, AGREE_TIMEOUT, silent)
        pending.times["reported"] = time.time()
        return {"iteration": pending.cut_answer()}

    # ------------------------------------------------------------ incremental checkpoints: the offer

    def _job_mode(self, record: dict | None) -> str:
        """The job's checkpoint mode: its ``--ckpt-mode``, else its lineage's
        (a restart inherits it), else the cluster's ``[checkpoint] mode``."""
        return self._asked_mode(record) or self.config.checkpoint_mode

    def _asked_mode(self, record: dict | None) -> str | None:
        if record is None:
            return None
        if record.get("ckpt_mode"):
            return record["ckpt_mode"]
        members = self.table.lineage(record.get("lineage") or record["id"])
        return next((r["ckpt_mode"] for r in members if r.get("ckpt_mode")), None)

    def job_codec(self, record: dict) -> str:
        """The codec the job's ranks get as ``GANGD_CKPT_CODEC`` (issue 18):
        its ``--ckpt-codec``, else its lineage's (a restart keeps it), else
        the cluster's ``[checkpoint] codec``. Always given, unlike the mode
        (which reaches ckptlib in each checkpoint's offer): the environment
        is the codec's only way to the ranks, and the job spec must win over
        a ``GANGD_CKPT_CODEC`` the submitter's environment happened to hold.
        A record's value was canonicalised at submit; one that is not
        (a record from elsewhere) is passed over, never handed to a rank."""
        return self._lineage_setting(record, "ckpt_codec", jobs.ckpt_codec) or self.config.checkpoint_codec

    def job_pipeline(self, record: dict) -> str:
        """The pipeline settings the job's ranks get as ``GANGD_CKPT_PIPELINE``, found as
        :meth:`job_codec` finds the codec: the job's ``--ckpt-pipeline``, its lineage's, else the
        cluster's ``[checkpoint] pipeline`` ("" : every setting its default)."""
        return self._lineage_setting(record, "ckpt_pipeline", jobs.ckpt_pipeline) or self.config.checkpoint_pipeline

    def _lineage_setting(self, record: dict, key: str, canonical) -> str | None:
        """``record[key]``, else the newest of its lineage's that has one; only a value that is
        already its own canonical form (``canonical(value) == value``) is taken."""
        lineage = record.get("lineage") or record["id"]
        # (A restart's record carries its lineage's settings (ckptcoord); older ones are looked up.)
        members = [record] if record.get(key) or lineage == record["id"] else self.table.lineage(lineage)
        for member in members:
            asked = member.get(key)
            if asked is not None:
                try:
                    if canonical(asked) == asked:
                        return str(asked)
                except jobs.BadSpec:
                    pass
                log.warning("job %d: ignoring its recorded %s %s (not canonical)", member.get("id"), key, text.brief(asked, 40))
        return None

    def _full_offer(self, mode: str) -> DeltaOffer:
        config = self.config
        return DeltaOffer(mode, config.checkpoint_block_kib, config.checkpoint_chain_max, config.checkpoint_adaptive_threshold, True)

    async def _plan_offers(self, record: dict, pending: Pending, *, force_full: bool) -> dict[int, DeltaOffer]:
        """What each rank of ``pending`` may write a delta of: the newest sound
        generation of the lineage whose MANIFEST here lists the rank's file,
        and every link that file needs (each listed here too); none — a full
        file — for the first checkpoint, after the ranks moved, in mode
        ``full``, or when the coordinator asks (``force_full``). Never fails
        the round: what cannot be read is not offered."""
        mode = self._job_mode(record)
        if force_full:  # (the coordinator: this job is in mode full, ckptcoord.CheckpointCoordinator.delta_gate)
            return dict.fromkeys(pending.ranks, self._full_offer("full"))
        full = self._full_offer(mode)
        offers = dict.fromkeys(pending.ranks, full)
        if mode == "full":
            return offers
        lineage = pending.lineage
        members = self.table.lineage(lineage)
        if not any(nd.sound(e) for r in members for e in r.get("checkpoints") or []) and lineage != record["id"]:
            try:  # a restarted job's first checkpoint: the lineage's generations are in the history
                await self.table.read_lineage(lineage)
            except RemoteError as exc:
                log.info("job %d: no delta offered for checkpoint %d: %s", record["id"], pending.gen, exc.message)
                return offers
            members = self.table.lineage(lineage)
        entries = [e for r in members for e in r.get("checkpoints") or []]
        candidates = nd.parent_candidates(entries, list(record.get("placement") or ()), pending.gen, OFFER_CANDIDATES)
        if not candidates.parents:
            log.debug("job %d checkpoint %d: full files (%s)", record["id"], pending.gen, candidates.why)
            return offers
        try:  # (the MANIFESTs this node committed: no file read, no thread, the begin's common case)
            chains = self._find_chains(lineage, pending.ranks, candidates, read=False)
        except _NotKept:
            chains = await trio.to_thread.run_sync(self._find_chains, lineage, pending.ranks, candidates)
        for rank, links in chains.items():
            offers[rank] = DeltaOffer(mode, full.block_kib, full.chain_max, full.threshold, False, links)
        return offers

    def _find_chains(self, lineage: int, ranks: list[int], candidates: nd.Candidates, read: bool = True) -> dict[int, tuple[Link, ...]]:
        """(In a thread, unless ``read`` is false.) For each rank, the links of
        its newest candidate parent whose whole chain this node's MANIFESTs
        list: the parent, then what its file needs, newest first. The
        MANIFESTs this node committed are taken as it wrote them
        (:attr:`kept`); ``read`` false: :class:`_NotKept` where one is not.
        (Staging, rebuilds and unflushes write the same files, checksums
        and all; a file gone since makes the rank, which checks each
        offered link's size and index, write a full one.)"""
        manifests: dict[int, ckptstore.Manifest | None] = {}

        def manifest(gen: int) -> ckptstore.Manifest | None:
            if gen not in manifests and (lineage, gen) in self.kept:
                manifests[gen] = self.kept[(lineage, gen)]
            if gen not in manifests:
                if not read:
                    raise _NotKept
                directory = ckptstore.gen_dir(self.root, lineage, gen)
                try:
                    fd = self._gen_fd(directory)
                except (UnsafePath, OSError):
                    manifests[gen] = None
                    return None
                try:
                    manifests[gen] = ckptstore.read_manifest(directory, dir_fd=fd, owner=os.geteuid())
                except StoreError as exc:
                    log.info("not offering generation %d of lineage %d: %s", gen, lineage, exc)
                    manifests[gen] = None
                finally:
                    os.close(fd)
            return manifests[gen]

        out: dict[int, tuple[Link, ...]] = {}
        for rank in ranks:
            name = ckptstore.cluster_rank_file(rank)
            for parent in candidates.parents:
                top = manifest(parent)
                if top is None or name not in top.files:
                    continue
                chain = [parent, *top.links(name)]
                if len(chain) > MAX_LINKS or not all(g in candidates.linkable for g in chain):
                    continue
                links = []
                for gen in chain:
                    held = manifest(gen)
                    if held is None or name not in held.files:
                        break
                    size, digest = held.files[name]
                    links.append(Link(gen, str(ckptstore.gen_dir(self.root, lineage, gen) / name), (size, digest)))
                else:
                    out[rank] = tuple(links)
                    break
        return out

    async def cut(self, args: dict) -> dict:
        pending = self._pending(args)
        pending.feed(nd.CutSet(int(args["iteration"])))
        if pending.failed:
            raise RemoteError("checkpoint_failed", pending.failed)
        for rank in pending.ranks:
            agent = self.agents.get((pending.job_id, rank))
            if agent is not None:  # (in order after its ckpt_begin: same connection, same task)
                await self._bounded_note(agent, "ckpt_cut", {"gen": pending.gen, "iteration": pending.cut})
        await pending.until(pending.all_arrived, self._timeout(args), "the ranks did not reach the cut")
        pending.times["at_cut"] = max(pending.arrived.values(), default=time.time())
        jobnet = self.jobnet
        await jobnet.hold_gate(pending.job_id, "checkpoint", True)
        await jobnet.wait_gate_closed(pending.job_id)
        pending.times["closed"] = time.time()
        return jobnet.counters(pending.job_id)

    async def capture(self, args: dict) -> dict:
        pending = self._pending(args)
        pending.times["capture"] = time.time()
        contexts = await self.jobnet.capture(pending.job_id, args.get("expect") or {})
        # With its environment (etcd keeps none for ended jobs; a restart takes it from here).
        record = {**self.table.get(pending.job_id), "env": self.job_env(pending.job_id)}
        job_blob = msgpack.packb({"record": record, "gen": pending.gen, "iteration": pending.cut, "node": self.node}, use_bin_type=True)
        try:
            files = await trio.to_thread.run_sync(self._write_daemon_files, pending, contexts, job_blob)
        except StoreError as exc:
            raise RemoteError("write_failed", f"{self.node}: {exc}") from None
        pending.files.update(files)
        # Their fsyncs (and the directory's) run now, while the ranks write, not on the commit's path;
        # the commit waits for them before the manifest, as it did when it made them itself.
        pending.synced = trio.Event()
        self.spawn(self._sync_daemon_files, pending)
        pending.times["released"] = time.time()
        pending.feed(nd.Released({rank: str(pending.directory / ckptstore.cluster_rank_file(rank)) for rank in pending.ranks}, pending.planned))
        await pending.until(pending.all_ended, self._timeout(args), "the ranks did not save their state")
        pending.times["saved"] = time.time()
        return self._times(pending)

    def _write_daemon_files(self, pending: Pending, contexts: dict, job_blob: bytes) -> dict:
        # Into the page cache only: the job is blocked meanwhile, and the
        # fsyncs can wait for the commit, which does them before the manifest.
        # Root's, 0600: the owner can neither read the job's token in them
        # nor rewrite what the daemon parses at a restart.
        files = {}
        try:
            gen = self._gen_fd(pending.directory)
        except (UnsafePath, OSError) as exc:
            raise StoreError(f"{pending.directory}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            for rank, blob in contexts.items():
                name = ckptstore.net_file(int(rank))
                files[name] = list(ckptstore.write_atomic(pending.directory / name, [blob], durable=False, dir_fd=gen))
            files["job.msgpack"] = list(ckptstore.write_atomic(pending.directory / "job.msgpack", [job_blob], durable=False, dir_fd=gen))
        finally:
            os.close(gen)
        return files

    async def _sync_daemon_files(self, pending: Pending) -> None:
        try:
            await trio.to_thread.run_sync(self._sync_files, pending)
        except StoreError as exc:
            pending.sync_error = str(exc)
        except Exception as exc:  # (whatever it was, these files are not known durable: the commit must fail)
            log.exception("job %d: fsync of checkpoint %d's own files failed", pending.job_id, pending.gen)
            pending.sync_error = f"could not fsync the generation's files: {type(exc).__name__}: {exc}"
        finally:
            if pending.synced is not None:
                pending.synced.set()

    def _sync_files(self, pending: Pending) -> None:
        """(In a thread.) fsync the daemon's own files of the generation, then its directory
        (the ranks fsync theirs, and ``ranks/``)."""
        if refuse(SYNC_FAILS):
            raise RuntimeError(f"failpoint {SYNC_FAILS}")
        try:
            gen = self._gen_fd(pending.directory)
        except (UnsafePath, OSError) as exc:
            raise StoreError(f"{pending.directory}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            ckptstore.sync(pending.directory, list(pending.files), dir_fd=gen)
        except OSError as exc:
            raise StoreError(ckptstore.describe_os_error(exc, pending.directory)) from None
        finally:
            os.close(gen)

    async def resume(self, args: dict) -> dict:
        pending = self._pending(args)
        pending.times["resume"] = time.time()
        await self.jobnet.hold_gate(pending.job_id, "checkpoint", False)
        pending.feed(nd.Resumed())
        if pending.failed:
            raise RemoteError("checkpoint_failed", pending.failed)
        pending.times["resumed"] = time.time()
        return self._times(pending)

    async def commit(self, args: dict) -> dict:
        pending = self._pending(args)
        await pending.until(lambda: pending.phase is nd.NodePhase.WRITTEN, self._timeout(args), "the ranks did not finish writing")
        if pending.cut is None:  # (the coordinator commits only after the cut)
            raise RemoteError("no_checkpoint", f"checkpoint {pending.gen} of job {pending.job_id} has no cut on {self.node}")
        if pending.synced is not None:
            await pending.synced.wait()  # (in practice long done: the ranks wrote meanwhile)
        if pending.sync_error is not None:
            raise RemoteError("write_failed", f"{self.node}: {pending.sync_error}")
        files = dict(pending.files)
        for rank, report in pending.written.items():
            files[ckptstore.cluster_rank_file(rank)] = [report.size, report.digest]
        needs = {ckptstore.cluster_rank_file(rank): links for rank, links in pending.needs().items()}
        manifest = ckptstore.Manifest(int(args["lineage"]), pending.gen, self.node, pending.cut, files, pending.ranks, time.time(), needs)
        try:
            await trio.to_thread.run_sync(self._check_and_commit, pending, manifest)
        except StoreError as exc:
            # (a link gone or rewritten since the offer: what was offered is read from disk again next time)
            for offer in pending.planned.values():
                for link in offer.links:
                    self.kept.pop((pending.lineage, link.gen), None)
            raise RemoteError("write_failed", f"{self.node}: {exc}") from None
        except NoRoom as exc:
            raise RemoteError("no_space", f"{self.node}: after the ranks wrote, {exc}") from None
        pending.times["committed"] = time.time()
        pending.feed(nd.Committed())
        self.rounds.finished(pending)
        if pending.failed:  # (aborted while the manifest was written: the abort removes the directory)
            raise RemoteError("checkpoint_failed", pending.failed)
        self._keep(manifest)
        result = self._times(pending)
        result["bytes"] = sum(size for size, _ in files.values())
        result["state_bytes"] = sum(r.state for r in pending.written.values())  # (logical: a full file's size)
        result["written"] = sum(r.size for r in pending.written.values())
        result["restore"] = sum(r.restore for r in pending.written.values())
        result["needs"] = sorted({g for links in needs.values() for g in links}, reverse=True)
        result["modes"] = dict(Counter(r.role for r in pending.written.values()))
        result["rank_write_seconds"] = max((r.seconds for r in pending.written.values()), default=0.0)
        pipeline = merge_pipelines([r.pipeline for r in pending.written.values()])  # (issue 18: compressed writes)
        if pipeline is not None:
            result["pipeline"] = pipeline
        codecs = sorted({c for r in pending.written.values() for c in r.codecs})
        if codecs:
            result["codecs"] = codecs
        return result

    def _check_and_commit(self, pending: Pending, manifest: ckptstore.Manifest) -> None:
        try:
            gen = self._gen_fd(pending.directory)
        except (UnsafePath, OSError) as exc:
            raise StoreError(f"{pending.directory}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            room_left(gen, self.config.output_reserve, self.root)
            cap = self.config.checkpoint_max_rank_bytes
            stats = {}
            for name, (size, _) in manifest.files.items():
                path = pending.directory / name
                if size > cap:  # (a report past the cap never gets here; the check is where the manifest is made)
                    raise StoreError(f"{path} is {size} bytes, more than the {cap} bytes one rank may commit (checkpoint_max_rank_bytes)")
                try:
                    fd = ckptstore.open_in(gen, name, pending.directory)  # (ranks/ is the owner's: no links)
                    try:
                        stats[name] = os.fstat(fd)
                        actual = stats[name].st_size
                    finally:
                        os.close(fd)
                except OSError as exc:
                    raise StoreError(f"{path}: {exc.strerror}") from None
                if actual != size:
                    raise StoreError(f"{path} has {actual} bytes, its writer reported {size}")
            self._links_intact(pending)
            if pending.synced is None:  # (else fsynced behind the capture: _sync_files)
                try:
                    ckptstore.sync(pending.directory, pending.files, dir_fd=gen)  # the daemon's own files (the ranks fsynced theirs)
                except OSError as exc:
                    raise StoreError(ckptstore.describe_os_error(exc, pending.directory)) from None
            ckptstore.write_manifest(pending.directory, manifest, dir_fd=gen)
            for name, st in stats.items():  # (as its writer reported it; see daemon/verified.py)
                self.verified.record(pending.directory, name, st, manifest.files[name][1])
        finally:
            os.close(gen)

    def _links_intact(self, pending: Pending) -> None:
        """(In a thread.) Every generation a rank's delta needs still lists
        the file it was offered, unchanged: a generation removed or rewritten
        since the offer (retention, a restart's staging) would leave this one
        a chain no restore can follow. Raises :class:`StoreError` naming it."""
        held: dict[int, ckptstore.Manifest] = {}
        for rank, report in sorted(pending.written.items()):
            offered = {link.gen: link for link in pending.offers[rank].links} if rank in pending.offers else {}
            name = ckptstore.cluster_rank_file(rank)
            for gen in report.links:
                directory = ckptstore.gen_dir(self.root, pending.lineage, gen)
                listed = self._held_manifest(held, pending.lineage, gen, f"which rank {rank}'s file needs, is gone").files.get(name)
                if gen not in offered or listed is None or tuple(listed) != offered[gen].expect:
                    raise StoreError(f"{directory / name}, which rank {rank}'s file needs, is no longer what it was offered as")

    async def abort(self, args: dict) -> bool:
        job_id, gen, why = int(args["job"]), args.get("gen"), text.printable(str(args.get("why") or "aborted"))
        applies, ended = self.rounds.abort(job_id, gen if type(gen) is int else None, why)
        if not applies:
            return False  # a late abort of an older generation must not touch the one under way
        if ended is not None:
            cast(Pending, ended).poke()  # (its waiters raise the reason)
        for (j, _), agent in list(self.agents.items()):
            if j == job_id:
                await self._bounded_note(agent, "ckpt_abort", {"gen": gen, "why": why})
        if job_id in self.jobnet.states:
            await self.jobnet.hold_gate(job_id, "checkpoint", False)
        if args.get("lineage") is not None and gen is not None:
            self.kept.pop((int(args["lineage"]), gen), None)
            await trio.to_thread.run_sync(self._remove, ckptstore.gen_dir(self.root, int(args["lineage"]), gen))
        return True

    async def abort_all(self, args: dict) -> list[dict]:
        """A new coordinator took over: checkpoints the old one was running can
        never finish. Returns each as ``{"job", "gen"}``, for the new
        coordinator to record as aborted (the old one never did)."""
        why = str(args.get("why") or "the coordinator changed during the checkpoint")
        under_way = [(job_id, p.gen, p.lineage) for job_id, p in self.pending.items()]  # (the awaits below change it)
        for job_id, gen, lineage in under_way:
            await self.abort({"job": job_id, "gen": gen, "lineage": lineage, "why": why})
        return [{"job": job_id, "gen": gen} for job_id, gen, _ in under_way]

    def _times(self, pending: Pending) -> dict:
        return {"node": self.node, "times": dict(pending.times), "ranks": len(pending.ranks)}

    def _record(self, args: dict) -> dict:
        record = self.table.get(args.get("job"))
        if args.get("record"):
            record = args["record"]
        if record is None:
            raise RemoteError("no_such_job", f"job {args.get('job')} is unknown on {self.node}")
        return record

    def _timeout(self, args: dict) -> float:
        """A round's deadline: the coordinator's, else checkpoint_timeout."""
        return float(args.get("timeout") or self.config.checkpoint_timeout)

    def _pending(self, args: dict) -> Pending:
        try:
            pending = self.rounds.get(args.get("job"), args.get("gen"))
        except nd.Refusal as exc:
            raise RemoteError(exc.code, exc.message) from None
        return cast(Pending, pending)  # (every round here is one)

    # ------------------------------------------------------------ storage upkeep

    async def prune(self, args: dict) -> list[int]:
        lineage = int(args["lineage"])
        gens = [int(g) for g in args.get("gens") or []]
        for gen in gens:
            self.kept.pop((lineage, gen), None)
            await trio.to_thread.run_sync(self._remove, ckptstore.gen_dir(self.root, lineage, gen))
        return gens

    async def protect(self, args: dict) -> dict:
        """``ckpt_protect``: write this node's share of a complete generation's
        redundancy (:mod:`gangd.daemon.protect`)."""
        if self._protector is None:
            bulk = Bulk.from_secret(self.secret)
            self._protector = Protector(node=self.node, checkpoints=self, peers=self.peers, bulk=bulk)
        return await self._protector.protect(args)

    async def bulk_server(self) -> BulkServer:
        """This node's bulk listener for checkpoint bytes (started on first use)."""
        if self._bulk is None:
            self._bulk = BulkService(secret=self.secret, host=self.config.node.address, spawn=self.spawn)
        return await self._bulk.server()

    async def verify(self, args: dict) -> list[str]:
        """Problems with this node's files of a generation ([] = intact).
        A file unchanged since it was last found intact is not read again
        (daemon/verified.py) unless ``full``."""
        directory = ckptstore.gen_dir(self.root, int(args["lineage"]), int(args["gen"]))
        ranks = [int(r) for r in args.get("ranks") or []]
        full = args.get("full") is True

        def check() -> list[str]:
            try:
                gen = self._gen_fd(directory)
            except (UnsafePath, OSError) as exc:
                return [f"{self.node}: cannot open {directory}: {getattr(exc, 'strerror', None) or exc}"]
            try:
                try:
                    manifest = ckptstore.read_manifest(directory, dir_fd=gen, owner=os.geteuid())
                except StoreError as exc:
                    return [f"{self.node}: {exc}"]
                names = [n for n in manifest.files if n == "job.msgpack" or any(n in (ckptstore.cluster_rank_file(r), ckptstore.net_file(r)) for r in ranks)]
                missing = [ckptstore.cluster_rank_file(r) for r in ranks if ckptstore.cluster_rank_file(r) not in manifest.files]
                problems = [f"{self.node}: {directory / n} is not in the manifest" for n in missing]
                before = _stats(gen, directory, names)
                unread = [n for n in names if full or not (n in before and self.verified.intact(directory, n, before[n], manifest.files[n][1]))]
                found = ckptstore.verify(directory, unread, dir_fd=gen, owner=os.geteuid())
                if not found:  # (read whole and intact, and unchanged meanwhile: the next check need not read it)
                    for n, st in _stats(gen, directory, unread).items():
                        if n in before and verified_stamp(before[n]) == verified_stamp(st):
                            self.verified.record(directory, n, st, manifest.files[n][1])
                return problems + [f"{self.node}: {p}" for p in found]
            finally:
                os.close(gen)

        if self._verify_threads is None:
            self._verify_threads = trio.CapacityLimiter(VERIFY_THREADS)
        return await trio.to_thread.run_sync(_at_low_priority, check, limiter=self._verify_threads)

    # ------------------------------------------------------------ restart

    async def prepare_restart(self, record: dict) -> dict[str, str]:
        """Before a restarted job's ranks start here: its network context
        from disk, its gate held closed, where each rank finds its state."""
        origin = record["restart_of"]
        lineage, gen = int(record["lineage"]), int(origin["gen"])
        directory = ckptstore.gen_dir(self.root, lineage, gen)
        mine = jobs.ranks_on(record, self.node)
        # The gate is held closed from the moment the job's state exists
        # (jobnet.prepare, just before), across the read below.
        jobnet = self.jobnet
        state = jobnet.state(record["id"])
        state.holds.add("restart")
        state.gate_open = False

        def load() -> tuple[ckptstore.Manifest, dict[str, bytes], dict[int, tuple[Link, ...]]]:
            # The daemon's own files, each read to the size its manifest gives.
            fd = self._gen_fd(directory)
            try:
                manifest = ckptstore.read_manifest(directory, dir_fd=fd, owner=os.geteuid())
                contexts = {}
                for rank in mine:
                    name = ckptstore.net_file(rank)
                    if name in manifest.files:
                        contexts[str(rank)] = safefs.read_bounded_at(fd, name, manifest.files[name][0], directory, owner=os.geteuid())
            finally:
                os.close(fd)
            return manifest, contexts, self._restore_chains(lineage, gen, manifest, mine)

        try:
            manifest, contexts, chains = await trio.to_thread.run_sync(load)
        except (StoreError, UnsafePath) as exc:
            raise RemoteError("restart_failed", f"{self.node}: {exc}") from None
        except OSError as exc:
            raise RemoteError("restart_failed", f"{self.node}: cannot read {directory}: {exc.strerror or exc}") from None
        # Every rank placed here must find its state here (a restart elsewhere
        # staged it first: gangd.daemon.staging); say which is missing, where.
        absent = [ckptstore.cluster_rank_file(rank) for rank in mine if ckptstore.cluster_rank_file(rank) not in manifest.files]
        if absent:
            raise RemoteError("restart_failed", f"{self.node}: {directory / ckptstore.MANIFEST} lists no {', '.join(absent)}")
        current = self.table.get(record["id"])
        if current is None or jobs.is_terminal(current) or current.get("kill_requested"):
            # A kill overtook the read: starting ranks now would orphan them.
            raise RemoteError("job_ended", f"job {record['id']} ended while its checkpoint was read; not starting its ranks")
        if contexts:
            jobnet.set_context(record["id"], contexts)
        restart = {"gen": gen, "lineage": lineage, "directory": directory, "manifest": manifest, "ranks": mine, "failed": None, "chains": chains,
                   "restored": set(), "heard": trio.Event()}  # (set once the coordinator answered a report that the restore failed)
        self.restarts[record["id"]] = restart
        self.spawn(self._restore_deadline, record["id"], restart)
        env = {"GANGD_RESTART_GEN": str(gen)}
        mode = self._asked_mode(record)
        if mode and not record.get("ckpt_mode"):
            env["GANGD_CKPT_MODE"] = mode  # (the lineage's --ckpt-mode: a restart keeps it)
        return env

    def _restore_chains(self, lineage: int, gen: int, manifest: ckptstore.Manifest, ranks: list[int]) -> dict[int, tuple[Link, ...]]:
        """(In a thread.) Each rank's links for a restart of ``gen``: what its
        file needs, newest first, each listed by that generation's MANIFEST
        here; raises :class:`StoreError` naming the link that is not."""
        out: dict[int, tuple[Link, ...]] = {}
        held: dict[int, ckptstore.Manifest] = {}
        for rank in ranks:
            name = ckptstore.cluster_rank_file(rank)
            links = []
            for link in manifest.links(name):
                directory = ckptstore.gen_dir(self.root, lineage, link)
                self._held_manifest(held, lineage, link, f"which {name} of generation {gen} needs, cannot be opened")
                if name not in held[link].files:
                    raise StoreError(f"{directory / ckptstore.MANIFEST} lists no {name}, which {name} of generation {gen} needs")
                size, digest = held[link].files[name]
                links.append(Link(link, str(directory / name), (size, digest)))
            out[rank] = tuple(links)
        return out

    async def _restore_deadline(self, job_id: int, restart: dict) -> None:
        """Ranks that never load their state (the program does not call
        ckpt.init()) would keep the job's gates closed forever: fail it."""
        await trio.sleep(self.config.checkpoint_timeout)
        if self.restarts.get(job_id) is restart and not restart.get("reporting"):
            missing = [r for r in restart["ranks"] if r not in restart["restored"]]
            restart["failed"] = (
                f"ranks {missing} on {self.node} did not load their checkpoint within "
                f"{self.config.checkpoint_timeout:.0f} s (does the program call gangd.ckptlib.init()?)"
            )
            restart["reporting"] = True
            await self._report_restored(job_id, restart)

    def _restored(self, job_id: int, rank: int, args: dict) -> None:
        restart = self.restarts.get(job_id)
        if restart is None:
            return
        if args.get("error"):
            restart["failed"] = f"rank {rank} on {self.node}: {text.printable(args['error'])}"
        elif rank in restart["ranks"]:
            # (in the restart, not on the rank's agent: a rank that restored and exited at once has had its
            # agent dropped by the time its note is read, and its restore counts all the same)
            restart["restored"].add(rank)
        done = restart["failed"] or set(restart["ranks"]) <= restart["restored"]
        if done and not restart.get("reporting"):
            restart["reporting"] = True
            self.spawn(self._report_restored, job_id, restart)

    async def _report_restored(self, job_id: int, restart: dict) -> None:
        """Tell the coordinator, again and again until the gates open: the one
        that hears it may die, and its successor must hear it too."""
        while self.restarts.get(job_id) is restart:
            try:
                await self.calls.to_coordinator("coord_ckpt_restored", job=job_id, reporter=self.node, error=restart["failed"])
                if restart["failed"]:
                    restart["heard"].set()
            except RemoteError as exc:
                log.warning("job %d: could not report the restore to the coordinator: %s", job_id, exc)
            await trio.sleep(RESTORED_REPEAT)

    def _stop_draining(self, job_id: int) -> None:
        """The job is no longer being restored here (its gates open, or it ended): its exits wait for nothing."""
        for key in [key for key in self._draining if key[0] == job_id]:
            self._draining.pop(key)[1].set()

    def exits_held(self, job_id: int) -> bool:
        """Whether the exits of ``job_id``'s ranks here wait (:meth:`exits_after_report`): a rank could not
        restore and the coordinator has not answered that yet, or an exited rank's connection is still
        being read (it may say so)."""
        restart = self.restarts.get(job_id)
        if restart is None:
            return False
        return (bool(restart["failed"]) and not restart["heard"].is_set()) or any(key[0] == job_id for key in self._draining)

    async def exits_after_report(self, job_id: int) -> None:
        """Return once this node's report that the job's ranks could not
        restore their state was answered (at most :data:`EXITS_WAIT`), or at
        once if there is none. The rank that could not restore exits right
        after saying so: were its exit heard first, the coordinator could
        end the job FAILED before it learns why, and a job a recovery
        started would not be recovered again from an older generation
        (:meth:`gangd.daemon.recover.Recoveries.restore_failed`)."""
        # A rank that could not restore says so on its checkpoint connection and exits: its exit can be
        # seen before that note is read. What it sent is read first, to the connection's end (a moment:
        # the process is gone; bounded, a snapshot child it forked may hold the connection open).
        ends = [(key, event) for key, (_, event) in self._draining.items() if key[0] == job_id]
        with trio.move_on_after(EXIT_REPORT_GRACE):
            for _, event in ends:
                await event.wait()
        for key, event in ends:  # (not read to its end in time: forgotten; a later exit's entry is its own waiter's)
            if key in self._draining and self._draining[key][1] is event:
                del self._draining[key]
        restart = self.restarts.get(job_id)
        if restart is None or not restart["failed"]:
            return
        with trio.move_on_after(EXITS_WAIT):
            await restart["heard"].wait()
        if not restart["heard"].is_set():
            log.warning("job %d: the coordinator has not answered that its ranks here could not restore; reporting their exits anyway",
                        job_id)

    async def open_restarted(self, args: dict) -> bool:
        job_id = int(args["job"])
        self.restarts.pop(job_id, None)
        self._stop_draining(job_id)
        if job_id in self.jobnet.states:
            await self.jobnet.hold_gate(job_id, "restart", False)
        return True

    # ------------------------------------------------------------ the interval plan (issue 19)

    def pace(self, job_id: int) -> dict:
        """Where this node's ranks of a job are, for the coordinator's
        planner: the furthest boundary any reported, the slowest smoothed
        time per iteration, and how many ranks reported (the latest report
        of each rank still attached)."""
        reports = [(p, when) for (job, _), (p, when) in self.progress.items() if job == job_id]
        paces = [p.t_iter for p, _ in reports if p.t_iter is not None]
        return {"ranks": len(reports), "iteration": max((p.iteration for p, _ in reports), default=None),
                "t_iter": max(paces, default=None), "age": round(time.monotonic() - max((w for _, w in reports), default=time.monotonic()), 3)}

    async def set_plan(self, job_id: int, plan: PlanNote) -> bool:
        """The coordinator's plan for a job: kept for ranks that attach later, and told to each rank here now."""
        record = self.table.get(job_id)
        if record is None or jobs.is_terminal(record):  # (it ended meanwhile: forget() has run, nothing to keep)
            return False
        self.plans[job_id] = plan
        for (job, _), agent in list(self.agents.items()):
            if job == job_id:
                await self._bounded_note(agent, plan.op, plan.to_wire())
        return True

    def forget(self, job_id: int) -> None:
        """The job ended on this node."""
        self.plans.pop(job_id, None)
        for key in [k for k in self.progress if k[0] == job_id]:
            del self.progress[key]
        self.restarts.pop(job_id, None)
        self._stop_draining(job_id)
        for key in [k for k in self._last_words if k[0] == job_id]:
            del self._last_words[key]
        self.rounds.forget(job_id)
        pending = self.pending.get(job_id)
        if pending is not None:
            if pending.resumed:
                # A checkpoint at the program's last step: once every rank's
                # state is on disk the commit is the daemons' part alone.
                self.spawn(self._ended_while_writing, pending)
            else:
                self.rounds.finished(pending)
                pending.fail(f"job {job_id} ended")
        for key in [k for k in self.agents if k[0] == job_id]:
            self.agents.pop(key).close()

