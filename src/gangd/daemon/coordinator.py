"""The coordinator: sole writer of the job table, placement and job lifecycle.

Exactly one daemon acts as coordinator at a time: the winner of etcd's
election (see :mod:`gangd.daemon.controlplane`). Everything it does lives in
its *term* (:meth:`Coordinator.serve_term`): a nursery that is cancelled the
moment the term ends, so no task of a deposed coordinator outlives it. Every
change to a job is one fenced etcd transaction (:meth:`Coordinator.update`,
:class:`gangd.daemon.store.JobTable`): a deposed coordinator cannot write,
and a new one reads the table from etcd, so it sees every commit its
predecessor made. Every command it sends a node carries its term
(:meth:`Coordinator.call`); a node refuses a term older than one it has seen.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from .. import jobs
from ..checkpoint import round as rd
from ..failpoint import hold
from ..rpc import RemoteError
from . import clock, spawns
from .access import check_may_resume, permission_check
from .ckptcoord import CheckpointCoordinator
from .gang import Matrix
from .peers import natural_key
from .ranks import KILL_DEADLINE
from .recover import Recoveries
from .store import Deposed, Fence
from .store.compaction import Compactor
from .store.jobtable import Pacer, pack
from .tasks import contained

if TYPE_CHECKING:
    from .calls import Calls
    from .config import Config
    from .controlplane import ControlPlane
    from .store import JobTable

log = logging.getLogger("gangd.coordinator")

KILL_REPORT_WAIT = 10.0
SCHEDULE_HOLD = "schedule.hold"  # (a test's hold point, gangd.failpoint.hold: queued jobs wait while it exists)
RESTORE_REPORTED = "restore.reported"  # (a test's hold point: a report that a restore failed waits before it is handled)
#: A node answers kill_ranks within its rank kill deadline (ranks.KILL_DEADLINE,
#: after which it reports a stuck rank as unkillable); past this the
#: coordinator stops waiting for the node and goes on.
KILL_WAIT = KILL_DEADLINE + 5.0
SWITCH_TIMEOUT = 5.0  # a node that does not confirm a switch by then is re-sent it
#: Bytes of network contexts (see jobs.MAX_CONTEXT_JOB_BYTES) the coordinator
#: holds for one user's jobs that have not launched yet: they live in its
#: memory only, so their sum is bounded per user, not just per job.
MAX_HELD_CONTEXT_BYTES_PER_USER = 16 * 1024 * 1024


#: Submissions committed together at most (each takes up to 3 of etcd's 128 txn
#: ops) and their bytes (etcd refuses requests above 1.5 MiB by default).
CREATE_BATCH = 40
CREATE_BATCH_BYTES = 1024 * 1024


@dataclass
class _Creation:
    """A submission waiting for the group commit (see Coordinator._create_jobs)."""

    build: Callable[[int], dict]
    env: dict[str, str]
    uid: int
    context_bytes: int
    token: str | None
    size: int
    done: trio.Event = field(default_factory=trio.Event)
    record: dict | None = None
    error: RemoteError | None = None

    def finish(self, *, record: dict | None = None, error: RemoteError | None = None) -> None:
        self.record, self.error = record, error
        self.done.set()


@dataclass
class CheckpointHost:
    """The parts of the node :class:`.ckptcoord.CheckpointCoordinator` uses."""

    node: str
    config: Config
    table: JobTable
    membership: ControlPlane
    ops: Calls  # on_job_nodes, checkpoint_env, to_coordinator


def place(record: dict, free: dict[str, int]) -> list[str] | None:
    """Ranks of ``record`` on nodes with ``free`` cores, or None if they do not fit now.

    Block placement (ranks 0..k-1 on the first node, and so on). With
    ``per_node`` each node takes that many ranks in turn (Slurm's
    --ntasks-per-node). Without it the ranks are spread as evenly as the free
    cores allow — what a user submitting "8 ranks on a 4-node cluster"
    expects. ``nodes`` picks that many nodes, those with the most room.
    """
    if record.get("pinned"):  # a restart: the nodes that hold its checkpoint, or wait
        need: dict[str, int] = {}
        for node in record["pinned"]:
            need[node] = need.get(node, 0) + 1
        return list(record["pinned"]) if all(free.get(node, 0) >= k for node, k in need.items()) else None
    n = record["nranks"]
    per_node = record.get("per_node")
    candidates = sorted((name for name in free if free[name] > 0), key=natural_key)
    if record.get("nodelist"):
        candidates = [c for c in candidates if c in record["nodelist"]]
    room = {c: min(free[c], per_node) if per_node else free[c] for c in candidates}
    if record.get("nodes_wanted"):
        wanted = record["nodes_wanted"]
        if len(candidates) < wanted:
            return None
        chosen = set(sorted(candidates, key=lambda c: -room[c])[:wanted])  # stable: ties keep name order
        candidates = [c for c in candidates if c in chosen]
    if sum(room[c] for c in candidates) < n:
        return None
    counts = dict.fromkeys(candidates, 0)
    remaining = n
    if per_node:
        for c in candidates:
            counts[c] = min(room[c], remaining)
            remaining -= counts[c]
    else:
        while remaining:  # water-filling: one more rank per node with room, in turn
            for c in candidates:
                if remaining and counts[c] < room[c]:
                    counts[c] += 1
                    remaining -= 1
    return [c for c in candidates for _ in range(counts[c])]


def without(spares: set[str]) -> Callable[[dict, dict[str, int]], list[str] | None]:
    """:func:`place` on the nodes that are not ``spares``."""
    def placer(record: dict, free: dict[str, int]) -> list[str] | None:
        return place(record, {n: c for n, c in free.items() if n not in spares})
    return placer


def rebuilt(cores: dict[str, int], max_slots: int, placed: list[dict]) -> Matrix:
    """The matrix of a new coordinator from the placed jobs' records, each in a
    slot of its own then compacted, in id order; a job on a node the
    configuration dropped is left out (check_nodes fails it).

    A family (a job and the jobs it spawned) goes in together, the parent
    tied from the start and its children in its slot: compacted alone into
    an earlier slot, or joined there by another job in the cores its
    children hold, it would leave them no room, or more than
    :func:`.spawns.admit`'s bound past the cores."""
    matrix = Matrix(cores, max_slots)
    parents = {r["spawned_by"] for r in placed if r.get("spawned_by") is not None}
    for record in sorted(placed, key=lambda r: (r["spawned_by"] if r.get("spawned_by") is not None else r["id"], r["id"])):
        if not set(record["placement"]) <= cores.keys():
            continue
        parent_slot = matrix.slot_of(record["spawned_by"]) if record.get("spawned_by") is not None else None
        if parent_slot is not None:
            matrix.add(record["id"], parent_slot, record["placement"])
            matrix.tied.update((record["spawned_by"], record["id"]))
        else:
            matrix.add(record["id"], len(matrix.slots), record["placement"])
            if record["id"] in parents:
                matrix.tied.add(record["id"])
        matrix.compact()
    return matrix


class Coordinator:
    """Built with what it uses: this node's name, the cluster's config, the
    job table, who is up and who leads (``membership``), calls to the nodes
    (``calls``: this node's own commands go the same way), and the peer links
    for the switch's pipelined requests and the nodes' clock offsets."""

    def __init__(self, *, node: str, config, table, membership, calls, peers):
        self.node = node
        self.config = config
        self.table = table
        self.membership = membership
        self.calls = calls
        self.peers = peers
        self.fence: Fence | None = None  # this node's term as coordinator, while it lasts
        self._lease = None
        self._nursery: trio.Nursery | None = None  # the term's
        self._creations: deque[_Creation] = deque()  # submissions waiting for the group commit
        self._creations_waiting = trio.Event()
        self._creation_pacer = Pacer()
        self._job_locks: dict[int, trio.Lock] = {}
        self._kick = trio.Event()
        # Gang scheduling (soft state, rebuilt from the table on takeover).
        self.matrix = Matrix({n.name: n.cores for n in config.nodes}, config.max_slots)
        self.running: set[int] | None = set()  # jobs resumed right now; None = unknown (after a takeover)
        self.acct: dict[int, dict] = {}  # job id -> run/suspended seconds so far
        self.switches: deque[dict] = deque(maxlen=4096)  # measurements of recent switches
        self._delivery: deque[float] = deque(maxlen=16)  # decision -> last node had the request (s)
        self._gang_changed = trio.Event()
        self._switch_lock = trio.Lock()
        self._contexts: dict[int, dict[str, bytes]] = {}  # network contexts to restore at launch
        self._spawning: dict[int, list[int]] = {}  # parent job -> processes of its spawns under way (counted by the bounds)
        self.pinned: set[int] = set()  # jobs that must run whatever their slot (checkpoint under way)
        # The checkpoint coordinator: this term through its narrow port (ckptcoord.TermPort), the node's parts it uses.
        self.ckpt = CheckpointCoordinator(self, CheckpointHost(node=node, config=config, table=table, membership=membership, ops=calls))
        # Jobs that lost a node and come back (see recover.py): this term through its narrow port (recover.RecoveryTerm).
        self.recoveries = Recoveries(self, self.ckpt, config=config, table=table, membership=membership, peers=peers)

    # ------------------------------------------------------------ plumbing

    @property
    def active(self) -> bool:
        return self.fence is not None

    @property
    def term(self) -> int:
        return self.fence.term if self.fence is not None else 0

    def current_fence(self) -> Fence:
        """This node's term, :class:`~.store.Deposed` when it has none (or its lease ran out): what a write is fenced by."""
        return self._fence()

    def _fence(self) -> Fence:
        fence = self.fence
        if fence is None or (self._lease is not None and self._lease.remaining() <= 0):
            raise Deposed(f"{self.node} is no longer the coordinator")
        return fence

    def spawn(self, fn, *args) -> None:
        """Start a task owned by the term: it ends when the term does."""
        if self._nursery is None:
            raise Deposed(f"{self.node} is no longer the coordinator")
        self._nursery.start_soon(contained, fn, args, name=getattr(fn, "__qualname__", repr(fn)))

    async def call(self, node: str, op: str, **args):
        """A command to ``node``, carrying this term (a node refuses an older one)."""
        return await self.calls.call(node, op, term=self._fence().term, **args)

    async def update(self, job_id: int, change) -> dict:
        """Apply ``change(record)`` to a copy of the record and commit it in etcd (fenced by the term).

        Changes to one job are serialised here, but one that comes while the
        change before it waits for its group commit joins that write (see
        JobTable.update: computed from the record it writes); ``change`` may
        still run twice if the record changed in etcd meanwhile, so it must
        only change the record."""
        before = self.table.get(job_id)
        lock = self._job_locks.setdefault(job_id, trio.Lock())
        if lock.locked() and self.table.waiting_write(job_id):
            record = await self.table.update(self._fence(), job_id, change)
        else:
            async with lock:
                record = await self.table.update(self._fence(), job_id, change)
        if not lock.locked() and not lock.statistics().tasks_waiting:
            self._job_locks.pop(job_id, None)
        if jobs.is_terminal(record):
            self._contexts.pop(record["id"], None)
            self.acct.pop(record["id"], None)
            if record["id"] in self.matrix.usage:
                self._leave_matrix(record["id"])
            if before is not None and not jobs.is_terminal(before) and (record.get("children") or record.get("spawned_by") is not None):
                spawns.family_ended(self, record)
        return record

    def kick(self) -> None:
        self._kick.set()
        self._gang_changed.set()

    def gang_changed(self) -> None:
        self._gang_changed.set()

    async def run(self) -> None:
        """The scheduling loop: start queued jobs whenever something changed."""
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            try:
                await self._schedule()
            except Deposed:
                raise
            except Exception:  # e.g. etcd unreachable for a moment: log, retry on the next kick
                log.exception("scheduling pass failed")
                self.spawn(self._retry_kick)

    # ------------------------------------------------------------ the term

    async def serve_term(self, fence: Fence, lease) -> None:
        """Coordinate until the term ends (this is cancelled then): everything
        the coordinator does runs in this nursery, and stops with it."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.fence, self._lease = fence, lease
                await self.take_over()
                nursery.start_soon(self.run)
                nursery.start_soon(self.run_gang)
                nursery.start_soon(self._retire_ended)
                nursery.start_soon(self._create_jobs)
                # One compactor of etcd's old revisions, the coordinator's (see store/compaction.py).
                nursery.start_soon(self._backfill_lineages)
                nursery.start_soon(contained, Compactor(self.table.etcd, self.table.keys.ids, self.config.etcd.compact_every).run, ())
                await trio.sleep_forever()
        finally:
            self.table.narrow()  # (this node's jobs only, again: see store/jobtable.py)
            self.fence, self._lease, self._nursery = None, None, None
            self._drop_creations()
            self.running = None
            self._job_locks.clear()

    async def take_over(self) -> None:
        """The term begins: read the table from etcd (every commit of the
        previous coordinator is in it), rebuild the soft state, finish what
        the predecessor left half-done. A node's cache holds only its own
        jobs: the coordinator's holds the whole table for its term."""
        await self.table.widen()
        self._rebuild_matrix()
        log.info("this node is now the coordinator, term %d (%d jobs in the table, revision %d)", self.term, len(self.table.records), self.table.revision)
        await self.check_nodes()
        for record in self.table.active():
            if record["state"] == jobs.QUEUED and record["placement"]:
                # The previous coordinator died while launching it; launch is idempotent per rank.
                log.info("job %d was being launched by the previous coordinator; launching again", record["id"])
                self.spawn(self._start, record["id"])
            elif record["state"] in (jobs.RUNNING, jobs.SUSPENDED):
                self.ckpt.job_started(record)
                self.ckpt.resume_protection(record)
        # Collect the exits the previous coordinator may have taken to its grave.
        for node in self.membership.up_nodes():
            if node not in self.matrix.cores:
                continue  # alive in etcd, but not a node of this configuration
            try:
                await self.call(node, "resend_exits")
                # Checkpoints the previous coordinator was running cannot finish: release their ranks.
                why = f"the coordinator changed to {self.node} during the checkpoint"
                aborted = await self.call(node, "ckpt_abort_all", why=why)
                if aborted:
                    log.warning("aborted the checkpoints %s on %s, left by the previous coordinator", aborted, node)
                    await self.ckpt.record_abandoned(aborted if isinstance(aborted, list) else [], why)
            except RemoteError as exc:
                if isinstance(exc, Deposed):
                    raise
                log.warning("could not ask %s to resend rank exits: %s", node, exc)
        self.kick()

    async def _backfill_lineages(self) -> None:
        """Once per cluster: index the checkpoint lineages an older gangd moved to the history without it."""
        while True:
            try:
                await self.table.backfill_lineages(self._fence())
                return
            except Deposed:
                raise
            except RemoteError as exc:  # etcd away for a moment: later
                log.warning("could not index the history's checkpoint lineages yet: %s", exc.message)
            await trio.sleep(10)

    async def _retire_ended(self) -> None:
        """Move jobs ended longer than ``job_retention`` ago to the history:
        the hot table (what every node holds, what a submit reads) stays the
        size of what is going on, whatever the cluster's past."""
        retention = self.config.job_retention
        while True:
            await trio.sleep(min(max(retention / 4, 0.5), 30))
            cutoff = time.time() - retention
            ended = sorted(
                # (a job with checkpoints goes too: a restart finds its lineage in the history, see JobTable.lineage)
                (r for r in self.table.records.values() if jobs.is_terminal(r) and (r.get("ended") or 0) <= cutoff),
                key=lambda r: r["id"],
            )
            if ended:
                try:
                    moved = await self.table.retire(self._fence(), ended)
                except Deposed:
                    raise
                except RemoteError as exc:  # etcd busy or away for a moment: the next round tries again
                    log.warning("could not move ended jobs to the history: %s", exc.message)
                    continue
                log.debug("moved %d ended jobs to the history", moved)

    # ------------------------------------------------------------ submit

    def capacity(self, spec: dict) -> tuple[int, str]:
        """Most ranks the cluster could ever hold for this job, and how that was counted."""
        config = self.config
        nodes = list(config.nodes)
        if spec.get("nodelist"):
            nodes = [n for n in nodes if n.name in spec["nodelist"]]
        if spec.get("nodes"):
            nodes = sorted(nodes, key=lambda n: -n.cores)[: spec["nodes"]]
        per_node = spec.get("per_node")
        total = sum(min(n.cores, per_node) if per_node else n.cores for n in nodes)
        how = f"{len(nodes)} node(s) x " + (f"{per_node} per node" if per_node else "their cores")
        return total, how

    async def submit(self, spec: dict, cred: dict, internal: dict | None = None, token: str | None = None) -> dict:
        """A new job. ``internal``: fields only the daemons set (a restart's lineage, origin and nodes).

        ``token``: the submission's own, chosen by the node the client came
        through. A node retries a submit whose answer it lost (its
        coordinator died after the commit); the token makes the retry return
        the job the first attempt created instead of creating a second one."""
        if token is not None:
            existing = self.table.by_token.get(token)
            if existing is not None and (record := self.table.get(existing)) is not None:
                return record
        try:
            checked = jobs.JobSpec.from_wire(spec, [n.name for n in self.config.nodes])
        except jobs.BadSpec as exc:
            raise RemoteError(exc.code, exc.message) from None
        if checked.priority is not None and checked.priority > 0 and cred["uid"] != 0:
            raise RemoteError("permission_denied", "only root may raise a job's priority above 0 (use a negative one to go last)")
        slice_ = checked.slice
        if slice_ is not None and slice_ > self.config.time_slice and cred["uid"] != 0:
            # A longer slice would make every other slot, other users' jobs, wait longer.
            raise RemoteError(
                "permission_denied",
                f"only root may ask for a time slice longer than the cluster's ({self.config.time_slice:g} s), not {slice_:g} s",
            )
        contexts = checked.net_context
        spec = checked.as_spec()
        nranks = checked.nranks
        capacity, how = self.capacity(spec)
        # (spawned processes may share their parent's cores: spawns.admit bounds them, with its own reason)
        if nranks > capacity and (internal or {}).get("spawned_by") is None:
            raise RemoteError(
                "too_large",
                f"job asks for {nranks} ranks but the cluster can hold at most {capacity} ({how})",
            )
        if os.geteuid() != 0 and cred["uid"] != os.geteuid():
            raise RemoteError(
                "permission_denied",
                f"gangd runs as uid {os.geteuid()} (not root) and can only run jobs for that user",
            )
        def build(job_id: int) -> dict:
            record = jobs.new_record(
                job_id=job_id, spec=spec, owner_uid=cred["uid"], owner_name=cred["user"], owner_gid=cred["gid"]
            )
            record.update(internal or {})
            # The submitting user's rlimits, read from the kernel by the node
            # the client is connected to (see limits.py); the ranks get them.
            record["rlimits"] = cred.get("rlimits")
            if token is not None:
                record["submit_token"] = token
            return record

        self._fence()
        creation = _Creation(build, dict(spec.get("env") or {}), cred["uid"], checked.context_bytes, token, len(pack(spec)))
        self._creations.append(creation)
        self._creations_waiting.set()
        await creation.done.wait()
        if creation.error is not None:
            raise creation.error
        record = creation.record
        if record is None:
            raise RemoteError("internal", "the submission was dropped without an answer (see the coordinator's log)")
        job_id = record["id"]
        if contexts:
            # Handed to the nodes with the launch, not kept in the (replicated) record.
            self._contexts[job_id] = contexts
        log.info("job %d (%s) submitted by %s: %d ranks", job_id, record["name"], cred["user"], nranks)
        self.kick()
        return record

    async def _create_jobs(self) -> None:
        """The term's one writer of new jobs: whatever submissions wait go
        into etcd together, in one transaction (a group commit), so many
        clients submitting at once cost one round trip and fsync per batch,
        not one each, and the id counter never sees two writers."""
        while True:
            await self._creations_waiting.wait()
            self._creations_waiting = trio.Event()
            while self._creations:
                await self._creation_pacer.linger(lambda: len(self._creations) >= CREATE_BATCH)
                batch: list[_Creation] = []
                size = 0
                while self._creations and len(batch) < CREATE_BATCH and (not batch or size + self._creations[0].size <= CREATE_BATCH_BYTES):
                    creation = self._creations.popleft()
                    existing = self.table.by_token.get(creation.token) if creation.token else None
                    if existing is not None and (record := self.table.get(existing)) is not None:
                        creation.finish(record=record)  # a retried submission: the job its first attempt created
                        continue
                    try:
                        self._check_user_room(creation.uid, creation.context_bytes, sum(c.uid == creation.uid for c in batch))
                    except RemoteError as exc:
                        creation.finish(error=exc)
                        continue
                    batch.append(creation)
                    size += creation.size
                if not batch:
                    continue
                try:
                    records = await self.table.create_many(self._fence(), [(c.build, c.env) for c in batch])
                except RemoteError as exc:
                    for creation in batch:
                        creation.finish(error=exc)
                    if isinstance(exc, Deposed):
                        raise
                    continue
                except Exception as exc:  # a bug: every waiting submission hears of it, the loop goes on
                    log.exception("creating %d jobs failed", len(batch))
                    for creation in batch:
                        creation.finish(error=RemoteError("internal", f"creating the job failed: {type(exc).__name__}: {exc}"))
                    continue
                finally:
                    self._creation_pacer.sent()
                for creation, record in zip(batch, records, strict=True):
                    creation.finish(record=record)

    def _drop_creations(self) -> None:
        """The term is over: submissions still waiting are answered (the node retries them with the next coordinator)."""
        while self._creations:
            self._creations.popleft().finish(error=Deposed(f"{self.node} is no longer the coordinator"))

    def _check_user_room(self, uid: int, context_bytes: int, also_queued: int = 0) -> None:
        """Refuse a job past what one user may have waiting: jobs queued (every
        node keeps their records) and network contexts held for them (in this
        daemon's memory until they launch). Root is not limited."""
        if uid == 0:
            return
        limit = self.config.max_queued_per_user
        queued = self.table.queued_of(uid)  # (kept by the table: a submit does not read every record)
        if len(queued) + also_queued >= limit:
            raise RemoteError(
                "too_many_jobs",
                f"you have {len(queued) + also_queued} jobs waiting to start, the most this cluster queues for one user "
                f"(max_queued_per_user = {limit}); submit more once some have started",
            )
        if context_bytes:
            held = sum(sum(len(b) for b in self._contexts.get(job_id, {}).values()) for job_id in queued)
            if held + context_bytes > MAX_HELD_CONTEXT_BYTES_PER_USER:
                raise RemoteError(
                    "too_many_jobs",
                    f"your queued jobs hold {held} bytes of network context already; with this job's {context_bytes} that would pass "
                    f"the {MAX_HELD_CONTEXT_BYTES_PER_USER} bytes one user may have waiting; submit it once some have started",
                )

    # ------------------------------------------------------------ placement

    async def _schedule(self) -> None:
        """Admit queued jobs into the matrix, highest priority first, then first come first served.

        The matrix decides in order, here, at once; the placements are then
        written to etcd concurrently: the table group-commits updates that
        wait together, so a burst of admitted jobs costs one transaction,
        not one round trip and fsync each in turn."""
        await hold(SCHEDULE_HOLD)
        up = {name for name in self.matrix.cores if self.membership.is_up(name)}
        spares = {n.name for n in self.config.nodes if getattr(n, "spare", False)}
        admitted_jobs: list[tuple[int, list[str]]] = []
        # Spawned processes first (their parent runs and waits for them: the
        # head of the queue must not hold them up), in their parent's slot or
        # not at all; then the queue (which holds no spawned job): highest
        # priority first, then first come first served.
        for record in self.table.unplaced_spawned():
            try:
                child = spawns.admit(self.matrix, record, place, up)
            except Exception as exc:  # a bug: fail it (its spawn fails with the reason), keep scheduling
                log.exception("placing spawned job %d failed", record["id"])
                child = str(exc)
            if isinstance(child, str):
                await self.fail(record["id"], f"cannot place the spawned processes: {child}")
                continue
            admitted_jobs.append((record["id"], child[1]))
        for record in self.table.unplaced():
            try:
                # Spares are kept for recoveries: a job goes there only if it fits nowhere else.
                admitted = self.matrix.admit(record, without(spares), up) if spares else None
                if admitted is None:
                    admitted = self.matrix.admit(record, place, up)
            except Exception as exc:  # a bug or a record from an older version: fail it, keep the queue moving
                log.exception("placing job %d failed", record["id"])
                await self.fail(record["id"], f"cannot place the job: {exc}")
                continue
            if admitted is None:
                if record.get("pinned") or place(record, {n: self.matrix.cores[n] for n in up}) is None:
                    # It waits for a node, not for cores (a restart for its
                    # own nodes, a job for a node that is down): it must not
                    # hold up the queue meanwhile.
                    continue
                break  # nobody overtakes the head of the queue
            slot, placement = admitted
            log.debug("job %d admitted to slot %d on %s", record["id"], slot, jobs.compress_nodes(jobs.nodes_of({"placement": placement})))
            admitted_jobs.append((record["id"], placement))
        if not admitted_jobs:
            return
        retry = []

        async def record_placement(job_id: int, placement: list[str]) -> None:
            try:
                await self.update(job_id, lambda r: r.update(placement=placement))
            except Deposed:
                raise
            except RemoteError as exc:
                # Not recorded (etcd refused or is away): the matrix must not
                # hold cores for it either. A later pass tries again.
                self.matrix.remove(job_id)
                self._gang_changed.set()
                log.warning("job %d not placed: %s", job_id, exc.message)
                retry.append(exc.code)
                return
            self.spawn(self._start, job_id)

        async with trio.open_nursery() as nursery:
            for job_id, placement in admitted_jobs:
                nursery.start_soon(record_placement, job_id, placement)
        if retry:
            self.spawn(self._retry_kick)

    async def _retry_kick(self) -> None:
        await trio.sleep(self.config.heartbeat_interval)
        self.kick()

    async def _update_until_saved(self, job_id: int, change) -> dict:
        """:meth:`update`, retried while the state disk has no room for the
        record (nothing of a failed attempt is applied): for changes that
        must not be lost, like a launched job becoming RUNNING."""
        while True:
            try:
                return await self.update(job_id, change)
            except RemoteError as exc:
                if exc.code != "etcd_unavailable" or isinstance(exc, Deposed):
                    raise
                log.warning("job %d: %s", job_id, exc.message)
            await trio.sleep(self.config.heartbeat_interval)

    async def _start(self, job_id: int) -> None:
        record = self.table.get(job_id)
        nodes = jobs.nodes_of(record)
        failures: list[str] = []
        contexts = self._contexts.pop(job_id, {})
        # The environment travels with the launch only (its key in etcd goes when the job ends).
        launching = {**record, "env": await self.table.env(job_id)}

        async def launch_on(node: str) -> None:
            # A node alive in etcd whose link from here is not up (yet: just
            # started; or again: a dropped connection being re-dialled) gets a
            # moment before its launch counts as failed. The request was not
            # sent (node_down), and a launch is idempotent per rank anyway.
            # Likewise a node that is alive in etcd but has no session with it
            # this instant (etcd_unavailable: its lease outlives a short cut).
            patience = trio.current_time() + max(self.config.heartbeat_timeout, self.config.etcd.lease_ttl)
            while True:
                try:
                    mine = {str(r): contexts[str(r)] for r in jobs.ranks_on(record, node) if str(r) in contexts}
                    await self.call(node, "launch", record=launching, contexts=mine)
                    return
                except RemoteError as exc:
                    if exc.code in ("node_down", "etcd_unavailable") and self.membership.is_up(node) and trio.current_time() < patience:
                        await trio.sleep(0.1)
                        continue
                    failures.append(f"{node}: {exc.message}")
                    return
                except Exception as exc:  # e.g. this node's own disk failing
                    log.exception("job %d: launch on %s failed", job_id, node)
                    failures.append(f"{node}: {type(exc).__name__}: {exc}")
                    return

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(launch_on, node)
        if failures:
            reason = "launch failed on " + "; ".join(failures)
            log.error("job %d: %s", job_id, reason)
            await self.fail(job_id, reason)
            return

        def running(r):
            if r["state"] != jobs.QUEUED:
                return False  # killed or failed while launching
            r["state"] = jobs.RUNNING
            r["started"] = time.time()

        record = await self._update_until_saved(job_id, running)
        if record["state"] != jobs.RUNNING:
            # Killed or failed while launching: whatever did start must go;
            # unless every rank's exit was reported (its end joined its start's write).
            if any(s is None or s.get("never_started") or s.get("lost") for s in record["ranks"]):
                await self._kill_everywhere(job_id)
            return
        # Its ranks run from the start; the gang loop stops them at once if
        # their slot is not the one running now.
        now = time.time()
        self.acct[job_id] = {"run": 0.0, "suspended": 0.0, "since": now, "on": True}
        if self.running is not None:
            self.running.add(job_id)
        self._gang_changed.set()
        self.ckpt.job_started(record)

    # ------------------------------------------------------------ exits and kills

    async def ranks_exited(self, job_id: int, exits: list[tuple[int, dict]]) -> None:
        """Record the exit of some of a job's ranks (one node's batch) in one update."""
        record = self.table.get(job_id)
        if record is None:
            return
        exits = [(rank, status) for rank, status in exits if 0 <= rank < record["nranks"] and record["ranks"][rank] is None]
        if not exits:
            return
        culprit = None
        # (an MPI_Abort names the reason first; the aborting rank's exit still takes the others down)
        if record["kill_on_bad_exit"] and (not record["reason"] or record.get("abort_pending")):
            for rank, status in exits:
                if (status.get("signal") or status.get("code", 0) != 0) and not status.get("killed"):
                    culprit = (rank, status)
                    break

        def change(r):
            if jobs.is_terminal(r):
                return False
            jobs.record_exits(r["ranks"], exits)
            if culprit and not r["reason"]:
                rank, status = culprit
                r["reason"] = f"rank {rank} on {status.get('node', '?')} {jobs.describe_status(status)}"
            if culprit:
                r["abort_pending"] = False
            self._finish_if_done(r)

        record = await self.update(job_id, change)
        if culprit and not jobs.is_terminal(record):
            log.info("job %d: %s; killing the other ranks", job_id, record["reason"])
            self.spawn(self._kill_everywhere, job_id)
        if jobs.is_terminal(record):
            self.kick()

    def _finish_if_done(self, record: dict) -> None:
        if record["state"] == jobs.RECOVERING:
            if not record["kill_requested"]:
                return  # (its recovery ends it: recover.Recoveries)
            # Killed while it recovers: its ranks are gone or going; the recovery sees the kill.
            record["ranks"] = [s or {"killed": True, "signal": signal.SIGKILL, "why": "killed while recovering"} for s in record["ranks"]]
        if jobs.is_terminal(record) or any(s is None for s in record["ranks"]):
            return
        if record["kill_requested"]:
            record["state"] = jobs.KILLED
        elif record["reason"] or any(s.get("signal") or s.get("code", 0) or s.get("lost") for s in record["ranks"]):
            record["state"] = jobs.FAILED
        else:
            record["state"] = jobs.DONE
        record["ended"] = time.time()
        acct = copy.deepcopy(self.acct.get(record["id"]))  # (popped once the change is committed: update())
        if acct is not None:
            self._account(acct, record["ended"], acct["on"])
            record["run_seconds"] = round(acct["run"], 3)
            record["suspended_seconds"] = round(acct["suspended"], 3)
        elif isinstance(record.get("started"), (int, float)):  # (ended before its start was written: never suspended)
            record["run_seconds"] = round(max(0.0, record["ended"] - record["started"]), 3)
            record["suspended_seconds"] = 0.0
        log.info("job %d %s%s", record["id"], record["state"], f": {record['reason']}" if record["reason"] else "")

    async def kill(self, job_id: int, cred: dict) -> dict:
        record = self.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, "kill")
        if jobs.is_terminal(record):
            return record
        await self._kill(job_id, cred["user"], f"killed by {cred['user']}")
        # Every rank is reaped by now; answer once their exit reports are in,
        # so `gang kill` returns when the job really is over.
        with trio.move_on_after(KILL_REPORT_WAIT):
            while not jobs.is_terminal(record := self.table.get(job_id)):
                await self.table.wait_changed()
        return record

    async def kill_for(self, job_id: int, reason: str) -> None:
        """gangd kills the job (its parent ended, see :mod:`.spawns`): as `gang kill`, ``reason`` said."""
        await self._kill(job_id, "gangd", reason)

    async def _kill(self, job_id: int, who: str, reason: str) -> None:
        def change(r):
            if jobs.is_terminal(r):
                return False
            r["kill_requested"] = who
            r["reason"] = r["reason"] or reason
            if not r["placement"] or (r["state"] == jobs.QUEUED and not r["started"]):
                # never launched: nothing to wait for
                r["ranks"] = [s or {"killed": True, "signal": signal.SIGKILL, "never_started": True} for s in r["ranks"]]
            self._finish_if_done(r)

        await self.update(job_id, change)
        await self._kill_everywhere(job_id)
        self.kick()

    async def spawn_job(
        self, parent_id: int, rank: int, segments: list, preput: dict[str, str], hosts: list[str] | None = None, token: str | None = None,
    ) -> dict:
        """MPI_Comm_spawn from rank ``rank`` of ``parent_id``: a child job (:mod:`.spawns`),
        answered once it runs, or an error saying why it cannot. ``hosts``: its
        ``host`` info key's nodes (:func:`.spawns.resolve_hosts`).

        ``token``: the spawn's own, chosen by the rank's node, which retries
        the call when the coordinator changes; as a submission's token, it
        makes a retry after the child job was created (the answer lost with
        the old coordinator) wait for that child instead of making a second."""
        parent = self.table.get(parent_id)
        if parent is None:
            raise RemoteError("no_such_job", f"no job {parent_id}")
        if parent["state"] != jobs.RUNNING or not parent.get("mpi"):
            raise RemoteError("bad_state", f"job {parent_id} is {parent['state']}; only a running --mpi job can spawn")
        nodelist = spawns.resolve_hosts(hosts or [], self.config.nodes, parent_id, self.membership.is_up) if hosts else None
        nprocs = sum(int(n) for _, n, _ in segments)
        made = self.table.get(self.table.by_token[token]) if token is not None and token in self.table.by_token else None
        if made is not None and made.get("spawned_by") != parent_id:
            raise RemoteError("bad_request", f"spawn token {str(token)[:64]!r} is another job's")
        under_way = self._spawning.setdefault(parent_id, [])
        if made is None:
            children = [c for c in (self.table.get(i) for i in parent.get("children") or ()) if c is not None]
            # (spawns of other ranks under way count too: two ranks spawning at once cannot both pass the bound)
            spawns.bounds_check(parent, children + [{"nranks": n} for n in under_way], nprocs)
        under_way.append(nprocs)
        try:
            if made is None:
                spec, cred, internal = spawns.child_request(parent, await self.table.env(parent_id), segments, preput, rank, nodelist)
                made = await self.submit(spec, cred, internal=internal, token=token)
            else:
                log.info("job %d rank %d: the spawn of job %d asked again (the coordinator changed): the same child", parent_id, rank, made["id"])
            child_id = made["id"]

            def adopt(r):
                if jobs.is_terminal(r):
                    return False
                if child_id in (r.get("children") or ()):
                    return False  # (a retried spawn whose child the parent holds already)
                r["children"] = [*(r.get("children") or []), child_id]

            parent = await self.update(parent_id, adopt)
        finally:
            under_way.remove(nprocs)
            if not under_way:
                self._spawning.pop(parent_id, None)
        if jobs.is_terminal(parent):
            await self.kill_for(child_id, f"its parent job {parent_id} ended ({parent['state']})")
            raise RemoteError("job_ended", f"job {parent_id} ended while its spawn was being placed")
        with trio.move_on_after(spawns.SPAWN_TIMEOUT):
            while (child := self.table.get(child_id)) is not None and child["state"] == jobs.QUEUED:
                await self.table.wait_changed()
        if child is None or child["state"] == jobs.QUEUED:
            await self.kill_for(child_id, f"not started within {spawns.SPAWN_TIMEOUT:g} s of the spawn")
            raise RemoteError("spawn_failed", f"the spawned processes (job {child_id}) did not start within {spawns.SPAWN_TIMEOUT:g} s")
        if jobs.is_terminal(child) and child["state"] != jobs.DONE:  # (DONE: it ran, and ended before this looked)
            raise RemoteError("spawn_failed", f"spawned job {child_id} {child['state']}: {child['reason']}")
        log.info("job %d rank %d spawned job %d (%d processes)", parent_id, rank, child_id, child["nranks"])
        return {"job": child_id}

    async def kill_everywhere(self, job_id: int) -> None:
        """Kill the job's ranks on every live node of it (a recovery's survivors too)."""
        await self._kill_everywhere(job_id)

    def left(self, job_id: int) -> None:
        """The job holds no cores any more (it is recovering elsewhere): out of the matrix and the accounts."""
        self._contexts.pop(job_id, None)
        self.acct.pop(job_id, None)
        if job_id in self.matrix.usage:
            self._leave_matrix(job_id)
        self._gang_changed.set()

    async def _kill_everywhere(self, job_id: int) -> None:
        record = self.table.get(job_id)

        async def kill_on(node):
            if node not in self.matrix.cores or not self.membership.is_up(node):
                return  # (down, or not a node of this configuration: nothing of ours to reach there)
            with trio.move_on_after(KILL_WAIT) as scope:
                try:
                    await self.call(node, "kill_ranks", job=job_id)
                except RemoteError as exc:
                    log.warning("job %d: could not kill ranks on %s: %s", job_id, node, exc)
            if scope.cancelled_caught:
                # Never wait for one node forever: node failures, other
                # kills and the rotation must go on (see ranks.kill_job).
                log.error("job %d: %s did not confirm the kill of its ranks within %.0f s; going on", job_id, node, KILL_WAIT)

        async with trio.open_nursery() as nursery:
            for node in jobs.nodes_of(record):
                nursery.start_soon(kill_on, node)

    async def set_reason(self, job_id: int, reason: str, code: int | None = None) -> None:
        """Why the job is failing (the first reason wins), before its ranks are
        gone; ``code``: the exit code the job ends with (MPI_Abort's)."""
        def change(r):
            if jobs.is_terminal(r) or r["reason"]:
                return False
            r["reason"] = reason
            r["abort_pending"] = True
            r["abort_code"] = code

        await self.update(job_id, change)

    async def restore_reported(self, job_id: int, node: str, error: str | None) -> None:
        """A node's ranks of a restarted job loaded their state, or could not
        (``error``): a job a recovery started is recovered again from an older
        generation (:meth:`Recoveries.restore_failed`); any other restart
        fails, its generation checked (:meth:`Restarts.on_restored`)."""
        record = self.table.get(job_id)
        if record is None or jobs.is_terminal(record) or not isinstance(record.get("restart_of"), dict) or node not in jobs.nodes_of(record):
            # From a peer: only a node of a job being restored speaks for it (else any holder of the
            # secret could fail, or open the gates of, a job it has nothing to do with).
            log.warning("job %d: a restore report from %s, for a job that is not being restored there; ignored", job_id, node)
            return
        if error:
            log.info("job %d: node %s says its ranks could not restore their state: %s", job_id, node, error)
            await hold(RESTORE_REPORTED)
            record = self.table.get(job_id)
            if record is not None and await self.recoveries.restore_failed(record, node, error):
                return
        await self.ckpt.restarts.on_restored(job_id, node, error)

    async def fail(self, job_id: int, reason: str, lost_nodes: frozenset = frozenset(), *, cause: bool = False) -> None:
        """End the job as FAILED with ``reason`` and kill whatever of it still runs.

        ``cause``: ``reason`` is the cause, whatever the record said first (a
        lost node: its ranks' peers exit with errors before its lease expires)."""
        def change(r):
            if jobs.is_terminal(r):
                return False
            r["reason"] = reason if cause else (r["reason"] or reason)
            if not r["placement"]:  # never placed: nothing ran, nothing to wait for (as a kill of a queued job)
                r["ranks"] = [s or {"never_started": True, "why": reason} for s in r["ranks"]]
            for rank, node in enumerate(r["placement"]):
                if r["ranks"][rank] is None and (node in lost_nodes or not r["started"]):
                    r["ranks"][rank] = {"lost": True, "node": node, "why": reason}
            self._finish_if_done(r)

        await self.update(job_id, change)
        await self._kill_everywhere(job_id)
        self.kick()

    def nodes_changed(self) -> None:
        """etcd says a node came or went: fail what it took down, place what now fits."""
        if self._nursery is not None:
            self.spawn(self._on_nodes_changed)

    async def _on_nodes_changed(self) -> None:
        await self.check_nodes()
        self.kick()

    async def check_nodes(self) -> None:
        """Every active job that has ranks on a node that is down, or that the
        configuration no longer names (an operator took it out), is recovered
        from its checkpoint on live nodes or, if it cannot be, fails saying
        why (:mod:`.recover`). A checkpoint round under way for it learns of
        the loss at once (it aborts; or, writing its redundancy, stays
        complete): the previous protected generation is the one to use."""
        membership = self.membership
        ttl = self.config.etcd.lease_ttl
        known = self.matrix.cores
        for record in list(self.table.active()):
            if record["state"] == jobs.RECOVERING:
                self.recoveries.ensure(record)  # (lost a node already: its recovery is under way, or taken up again)
                continue
            if record["state"] == jobs.QUEUED and not record["placement"] and record.get("pinned"):
                pinned_down = sorted({n for n in record["pinned"] if n not in known or not membership.is_up(n)}, key=natural_key)
                if pinned_down:  # a restart whose files are (or were rebuilt) on a node that then went down
                    self.recoveries.repin(record, pinned_down)
                continue
            gone = sorted({n for n in record["placement"] if n not in known}, key=natural_key)
            down = sorted({n for n in record["placement"] if n in known and not membership.is_up(n)}, key=natural_key)
            if not down and not gone:
                continue
            why = "; ".join(
                [f"node {n} is no longer in the cluster's configuration" for n in gone]
                + [
                    f"node {n} ({self.config.spec(n).endpoint}) went down: its lease in etcd expired "
                    f"(no keep-alive for {ttl} s: a crash, a stall or a partition)" for n in down
                ]
            )
            self.spawn(self.ckpt_node_lost, record["id"], down + gone)
            await self.recoveries.node_lost(record, down + gone, why)

    async def ckpt_node_lost(self, job_id: int, lost: list[str]) -> None:
        """Tell a checkpoint round under way for the job that ``lost`` are gone
        (:class:`gangd.checkpoint.round.NodeLost`) and carry out what it says."""
        live = self.ckpt.live.get(job_id)
        record = self.table.get(job_id)
        if live is None or record is None:
            return
        for node in lost:
            for instruction in live.round.handle(rd.NodeLost(node)):
                await self.ckpt._execute(record, live, instruction)

    # ------------------------------------------------------------ gang scheduling

    def _rebuild_matrix(self) -> None:
        """After a takeover: the matrix from the placed jobs in the table; who
        runs right now is unknown until the first switch says so everywhere."""
        self.acct = {}  # whatever an earlier term as coordinator left is stale
        placed = [r for r in self.table.active() if r["placement"] and r["state"] != jobs.RECOVERING]  # (recovering: no ranks, no cores)
        self.matrix = rebuilt(self.matrix.cores, self.matrix.max_slots, placed)
        for record in placed:
            if record["id"] in self.matrix.usage and record["state"] in (jobs.RUNNING, jobs.SUSPENDED):
                self.acct.setdefault(record["id"], {"run": 0.0, "suspended": 0.0, "since": time.time(), "on": False})
        self.running = None
        self._gang_changed.set()

    def _leave_matrix(self, job_id: int) -> None:
        """A job ended: free its cells at once and compact the matrix."""
        moved = self.matrix.remove(job_id)
        if self.running is not None:
            self.running.discard(job_id)
        if moved:
            log.debug("matrix compacted: %s", ", ".join(f"job {j} -> slot {s}" for j, s in sorted(moved.items())))
        self.kick()

    def _launched(self, job_id: int) -> bool:
        record = self.table.get(job_id)
        return record is not None and record["state"] in (jobs.RUNNING, jobs.SUSPENDED)

    def _runnable(self, job_id: int) -> bool:
        record = self.table.get(job_id)
        return record is not None and record["state"] == jobs.RUNNING and not record.get("held")

    def _runnable_slots(self) -> list[int]:
        return [i for i, members in enumerate(self.matrix.slots) if any(self._runnable(j) for j in members)]

    def _slice(self, slot: int) -> float:
        """A slot runs for the shortest time slice any of its jobs asked for,
        counting a user's ask only where that user's jobs have the slot to
        themselves (root's always counts): sharing a slot with another
        user's job must not cut that job's time short."""
        members = [r for j in self.matrix.slots[slot] if (r := self.table.get(j))]
        owners = {r["owner_uid"] for r in members}
        asked = [r["slice"] for r in members if r.get("slice") and (r["owner_uid"] == 0 or len(owners) == 1)]
        return min(asked) if asked else self.config.time_slice

    def _lead(self, slice_: float) -> float:
        """How long before a slice ends its switch is announced: the configured
        lead, or more if requests took long to reach every node lately (twice
        that, and the nodes' hold, see ``clock``), never more than half the slice."""
        lead = self.config.switch_lead
        if lead <= 0:
            return 0.0
        return min(max(lead, 2 * max(self._delivery, default=0.0) + clock.HOLD), slice_ / 2)

    async def run_gang(self) -> None:
        """Rotate through the matrix's slots, one time slice each.

        Also the single place where the processes running on the cluster
        are brought in line with the matrix: after a launch, an end, a
        compaction, a suspend or a resume, the loop wakes up and switches
        whatever differs, at once. The rotation itself is foreseeable: its
        switch is sent ``_lead`` ahead and every node makes it when the
        slice ends by its own clock, so the network is not on its path.
        """
        deadline = announce = math.inf  # the slice ends; its switch is sent
        while True:
            with trio.move_on_at(announce):
                await self._gang_changed.wait()
            self._gang_changed = trio.Event()
            if not self.active:
                deadline = announce = math.inf
                continue
            try:
                runnable = self._runnable_slots()
                now = trio.current_time()
                switched, at = False, None
                if runnable and (self.matrix.active not in runnable or (len(runnable) > 1 and now >= announce)):
                    if self.matrix.active in runnable and now < deadline:
                        at = deadline  # the rotation, announced ahead
                    after = [s for s in runnable if s > self.matrix.active]
                    self.matrix.active = (after or runnable)[0]
                    switched = True
                await self.reconcile(at=None if at is None else time.time() + at - now)
                if len(runnable) <= 1:
                    deadline = announce = math.inf
                elif switched or deadline == math.inf:
                    slice_ = self._slice(self.matrix.active)
                    deadline = (now if at is None else at) + slice_
                    announce = deadline - self._lead(slice_)
            except Exception:
                log.exception("gang scheduling pass failed")
                await trio.sleep(self.config.time_slice)
                self._gang_changed.set()

    async def reconcile(self, at: float | None = None) -> None:
        """Stop what runs but should not, resume what should run but does not
        (at wall-clock instant ``at``, or now)."""
        async with self._switch_lock:
            active = self.matrix.slots[self.matrix.active] if self.matrix.active < len(self.matrix.slots) else []
            launched = {j for j in self.matrix.usage if self._launched(j)}
            desired = {j for j in active if self._runnable(j)} | (self.pinned & launched)
            current = launched if self.running is None else self.running & launched
            stop = current - desired
            cont = desired - current if self.running is not None else desired
            if stop or cont:
                await self._switch(sorted(stop), sorted(cont), at)

    async def _switch(self, stop: list[int], cont: list[int], at: float | None = None) -> None:
        """One cluster-wide switch: every node stops ``stop`` and resumes
        ``cont`` at once — now, or at wall-clock instant ``at`` (each node is
        sent it in its own clock)."""
        per_node: dict[str, dict[str, list[int]]] = {}
        for key, group in (("stop", stop), ("cont", cont)):
            for job_id in group:
                for node in jobs.nodes_of(self.table.get(job_id)):
                    per_node.setdefault(node, {"stop": [], "cont": []})[key].append(job_id)
        results: dict[str, dict] = {}
        me = self.node
        offset = {node: self.peers.clock_offset(node) for node in per_node}  # (0 for this node)
        t0 = time.time()
        when = t0 if at is None else at  # the switch's instant, by our clock
        # Every remote node's request goes on the wire before this node does
        # its own part, so the nodes switch at (nearly) the same moment.
        async with contextlib.AsyncExitStack() as stack:
            replies = {}
            for node, lists in per_node.items():
                if node == me:
                    continue
                timing = {} if at is None else {"at": at + offset[node]}
                try:
                    pending = self.peers.channel(node).pending("switch", term=self._fence().term, **lists, **timing)
                    replies[node] = await stack.enter_async_context(pending)
                except RemoteError as exc:  # node down: check_nodes fails its jobs
                    log.warning("switch on %s failed: %s", node, exc)
            if me in per_node:
                results[me] = await self.calls.call(me, "switch", term=self._fence().term, **per_node[me], at=at)
            for node, reply in replies.items():
                with trio.move_on_after(SWITCH_TIMEOUT) as scope:
                    try:
                        results[node] = await reply()
                    except RemoteError as exc:
                        log.warning("switch on %s failed: %s", node, exc)
                if scope.cancelled_caught:
                    log.warning("switch on %s got no answer within %.0f s", node, SWITCH_TIMEOUT)
        t_end = time.time()
        if self.running is None:
            self.running = set()
        self.running -= set(stop)
        self.running |= set(cont)
        if set(results) != set(per_node):
            # Some node may not have switched: forget what runs where, so the
            # next pass sends every job's stop or cont to every node again.
            self.running = None
            self.spawn(self._retry_gang)
        for job_id in stop:
            if job_id in self.acct:
                self._account(self.acct[job_id], when, False)
        for job_id in cont:
            if job_id in self.acct:
                self._account(self.acct[job_id], when, True)
        if results:
            # Every node's times, in our clock.
            times = {n: {k: r.get(k, r["done"]) - offset[n] for k in ("received", "start", "done")} for n, r in results.items()}
            done = [t["done"] for t in times.values()]
            self._delivery.append(max(t["received"] for t in times.values()) - t0)
            self.switches.append(
                {
                    "at": when,
                    "announced": when - t0,  # 0: switched on decision
                    "nodes": len(results),
                    "stop": stop,
                    "cont": cont,
                    "latency": max(done) - when,  # the switch's instant (decision, or announced) -> last node resumed
                    "skew": max(done) - min(done),  # first node done -> last node done
                    "round_trip": t_end - t0,
                    "per_node": {
                        n: {"received": t["received"] - when, "start": t["start"] - when, "done": t["done"] - when,
                            "cpu": results[n].get("cpu", 0), "offset": offset[n]}
                        for n, t in times.items()
                    },
                }
            )

    async def _retry_gang(self) -> None:
        await trio.sleep(self.config.heartbeat_interval)
        self._gang_changed.set()

    @staticmethod
    def _account(acct: dict, at: float, on: bool) -> None:
        spent = max(0.0, at - acct["since"])
        acct["run" if acct["on"] else "suspended"] += spent
        acct["since"], acct["on"] = at, on

    def live_times(self, job_id: int) -> dict | None:
        acct = self.acct.get(job_id)
        if acct is None:
            return None
        now = time.time()
        spent = max(0.0, now - acct["since"])
        return {
            "run_seconds": acct["run"] + (spent if acct["on"] else 0.0),
            "suspended_seconds": acct["suspended"] + (0.0 if acct["on"] else spent),
            "running_now": acct["on"],
        }

    def schedule(self) -> dict:
        """The matrix as `gang nodes` and `gang ps` show it."""
        return {
            "active_slot": self.matrix.active,
            "max_slots": self.matrix.max_slots,
            "time_slice": self.config.time_slice,
            "slots": self.matrix.table(),
            "jobs": {str(j): self.live_times(j) for j in self.matrix.usage if j in self.acct},
            "switches": len(self.switches),
        }

    async def suspend(self, job_id: int, cred: dict, hold: bool) -> dict:
        """`gang suspend` / `gang resume`: the owner takes the job out of (or back into) the rotation."""
        record = self.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, "suspend" if hold else "resume")
        if jobs.is_terminal(record):
            raise RemoteError("job_ended", f"job {job_id} is {record['state']}")
        if hold and record["state"] != jobs.RUNNING:
            raise RemoteError("bad_state", f"job {job_id} is {record['state']}; only a running job can be suspended")
        if not hold and record["state"] != jobs.SUSPENDED:
            raise RemoteError("bad_state", f"job {job_id} is {record['state']}, not suspended")
        if not hold:
            check_may_resume(record, cred)

        def change(r):
            if r["state"] != (jobs.RUNNING if hold else jobs.SUSPENDED):
                return False
            if not hold:
                check_may_resume(r, cred)  # (suspended again by root since the check above)
            r["state"] = jobs.SUSPENDED if hold else jobs.RUNNING
            r["held"] = cred["user"] if hold else None
            r["held_uid"] = cred["uid"] if hold else None

        record = await self.update(job_id, change)
        # Answer once the processes really are stopped (or resumed, if its slot is the active one).
        await self.reconcile()
        self._gang_changed.set()
        return record
