"""The job table: etcd's job keys, and each node's cache of the jobs that concern it, kept current by a watch.

What a node caches: the jobs placed on it (what its launches, kills,
switches, rank exits, checkpoints and output read), not the whole table: a
node watching every job would cost every submit and every change one event
per node, and hold the cluster's whole hot table in every daemon's memory.
Every write of a placed job also writes a *copy* of its record for each
node it is placed on (``PREFIX/on/<node>/<id>``, in the same transaction,
so with the same mod revision), or one copy every node watches
(``PREFIX/on/+/<id>``) for a job on many nodes or with a large record; a
node loads and watches only those. The copies of nodes a job leaves are
deleted in the same transaction, and all of them when it moves to the
history. The coordinator, which schedules over every job, reads the whole
table when its term begins (:meth:`JobTable.widen`; every commit of the
terms before is in it) and from then on follows its own commits -- it is
the only writer, and fenced -- and narrows its cache back when the term ends. Listings and waits for a job that is not here
read etcd (:meth:`JobTable.hot_page`, :meth:`JobTable.watch_job`).

etcd is read once (a range at one revision, page by page) and then only
says what changed (a watch from the next revision), so a read costs no round
trip, and no change is ever missed: the watch resumes from the last revision
it delivered, and a node whose revision was compacted away reads its part
anew. Each cached record carries its key's mod revision as ``seq``: a newer
revision always wins, an older one (a watch event behind a write this node
made itself) changes nothing; a copy's delete removes a record only if no
newer write of it was seen (a copy moved between keys in one transaction).

Writes: only the coordinator writes, and only through a :class:`Fence`. Every
write is one etcd transaction that also compares the coordinator's election
key with its term, so a deposed coordinator's write fails in etcd itself,
whatever that coordinator still believes (:class:`Deposed`). An update also
compares the job key's mod revision with the one its change was computed
from: a change is applied exactly once, to the record it was computed from,
or computed again. Job ids come from a counter moved in the same
transaction that creates the job: never handed out twice, across any
failover. Updates that wait at the same moment share one transaction (a
group commit, as submissions do): each keeps its own comparison, so a batch
costs one round trip and one fsync, and answers exactly what each update
alone would have.

A job's environment (the submitter's, up to 2 MiB) is a key of its own,
written once with the job and deleted in the transaction that ends it: the
record, rewritten on every change, stays small. The node that created the job
keeps that environment in memory until the launch takes it (bounded), so a
launch does not read back what was just written. Ended jobs move to the
history after the retention period (:meth:`JobTable.retire`), so the hot
table, and what a submit costs, does not grow with the cluster's past; and a
page of the history reads a bounded span of ids, so a listing's cost does
not grow with it either. The history is kept in blocks of BLOCK_IDS
consecutive ids, one etcd key each (:class:`HistoryBlock`): etcd's key
count, and its own costs that grow with it, stay those of the hot table
plus the past divided by BLOCK_IDS. A history written one key per job (by
gangd before the blocks, or a record too large for its block) is read
alongside, merged in id order.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from ... import jobs
from ...etcd.client import Compacted, Compare, Etcd, EtcdError, Indeterminate, KeyValue, Op, Range, Unavailable
from ...failpoint import failpoint
from ...rpc import RemoteError
from .keys import ID_DIGITS, Keys

log = logging.getLogger("gangd.jobtable")

#: Jobs per range read when (re)loading the table or paging the history.
PAGE = 500
#: How long a listing waits for a daemon that has just started to read the table.
LOAD_WAIT = 10.0
#: Largest record the table accepts (records hold no environment: far below).
MAX_RECORD_BYTES = 1024 * 1024
#: Largest environment value accepted back (jobs.MAX_ARGV_ENV_BYTES, packed).
MAX_ENV_BYTES = 3 * 1024 * 1024
#: Ended jobs moved to the history in one transaction at most (each also
#: bounded by TXN_OPS: a job's move is one comparison and up to ten operations).
RETIRE_BATCH = 100
RETIRE_BATCH_BYTES = 1024 * 1024  # (etcd refuses requests above 1.5 MiB by default)
#: The history is kept in blocks: the ended jobs of BLOCK_IDS consecutive ids
#: in one key (see :class:`HistoryBlock`), so etcd holds a key per block, not
#: per job ever run; a retirement rewrites the blocks its jobs fall in.
BLOCK_IDS = 64
#: A block's packed size at most; a record that would take its block past it,
#: or larger than BLOCK_RECORD_BYTES alone, is kept in a key of its own (as
#: the history was before the blocks). A retirement's transaction then holds
#: one block or one such record (etcd refuses requests above 1.5 MiB by default).
BLOCK_BYTES = 256 * 1024
BLOCK_RECORD_BYTES = 32 * 1024
#: Largest block value accepted back from etcd.
MAX_BLOCK_BYTES = 2 * 1024 * 1024
#: Blocks the coordinator keeps as it last wrote them (the next retirement
#: appends to them without reading them back: jobs end in about id order).
BLOCKS_KEPT = 8
#: Bytes of environments of jobs this node created and has not launched yet,
#: kept in memory so the launch need not read them back from etcd (oldest dropped first: then read from etcd).
FRESH_ENV_BYTES = 32 * 1024 * 1024
#: Job updates committed in one transaction at most: each is a comparison, up
#: to two operations and a get on failure (etcd allows 128 of each).
UPDATE_BATCH = 40
UPDATE_BATCH_BYTES = 1024 * 1024
#: A group commit that follows the previous one by less than BUSY seconds
#: first waits LINGER seconds for more of the burst to join it (MySQL's
#: binlog_group_commit_sync_delay, Kafka's linger.ms): under load each
#: transaction -- a round trip, an fsync, etcd's CPU and this daemon's for
#: one request -- carries more jobs; a change on a quiet cluster goes at once.
LINGER = 0.002
BUSY = 0.02
#: Updates (a job placed, started, ended) wait longer: no user waits on
#: them as on a submit, and a burst's jobs then share fewer transactions.
UPDATE_LINGER = 0.01
UPDATE_BUSY = 0.05
#: Ids a history page reads at first, doubled while too few are found. etcd
#: counts every key of a range it is asked for (and sorts all of them for a
#: newest-first read) whatever the limit: a page over the whole history would
#: cost the whole history, so each read covers a bounded span of ids.
HISTORY_SPAN = 1024
#: A job placed on at most this many nodes, whose record times that many is
#: at most FANOUT_BYTES, gets a copy for each of its nodes; any other gets one
#: copy every node watches (an update's operations and bytes stay bounded).
FANOUT_NODES = 8
FANOUT_BYTES = 64 * 1024
#: Operations in one transaction at most (etcd's --max-txn-ops is 128 by default).
TXN_OPS = 120
#: Checkpoint lineages whose members in the history a node keeps in memory
#: (read by :meth:`JobTable.read_lineage`; least recently read dropped first).
LINEAGES_KEPT = 256
#: Members of one lineage read back from the history at most (a lineage is
#: a job and its restarts: a few).
LINEAGE_MEMBERS = 1000
#: Seconds a creation whose answer was lost keeps asking etcd whether it
#: committed before its submitters are told it may or may not have.
INDETERMINATE_PATIENCE = 15.0


class Deposed(RemoteError):
    """The coordinator's term is over: etcd no longer holds its election key at its term."""

    def __init__(self, why: str):
        super().__init__("not_coordinator", why)


@dataclass(frozen=True)
class Fence:
    """A coordinator's term: its election key and that key's create revision."""

    key: str | bytes
    term: int

    def compare(self):
        return Compare.create_revision(self.key) == self.term


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_record(value: bytes) -> dict:
    """A job record read from etcd, checked for shape (ValueError says why not)."""
    if len(value) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(value)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        record = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises ValueError, TypeError (an unhashable key) and its own errors
        raise ValueError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError("not a map")
    job_id = record.get("id")
    if not isinstance(job_id, int) or isinstance(job_id, bool) or job_id < 1:
        raise ValueError(f"bad job id {job_id!r}")
    if record.get("state") not in jobs.ACTIVE_STATES + jobs.TERMINAL_STATES:
        raise ValueError(f"unknown state {record.get('state')!r}")
    nranks = record.get("nranks")
    if not isinstance(nranks, int) or not isinstance(record.get("ranks"), list) or len(record["ranks"]) != nranks:
        raise ValueError("ranks do not match nranks")
    if not isinstance(record.get("placement"), list) or not all(isinstance(n, str) for n in record["placement"]):
        raise ValueError("bad placement")
    lineage = record.get("lineage")
    if lineage is not None and (not isinstance(lineage, int) or isinstance(lineage, bool) or lineage < 1):
        raise ValueError(f"bad lineage {lineage!r}")
    requeued_as = record.get("requeued_as")
    if requeued_as is not None and (not isinstance(requeued_as, int) or isinstance(requeued_as, bool) or requeued_as <= job_id):
        raise ValueError(f"bad requeued_as {requeued_as!r}")  # (a later job: `gang wait` follows it, never round in a loop)
    generations = record.get("checkpoints")
    if generations is not None and (not isinstance(generations, list) or not all(
            isinstance(e, dict) and isinstance(e.get("gen"), int) and isinstance(e.get("state"), str) for e in generations)):
        raise ValueError("bad checkpoint entries")
    return record


def decode_env(value: bytes) -> dict[str, str]:
    if len(value) > MAX_ENV_BYTES:
        raise ValueError(f"{len(value)} bytes, more than {MAX_ENV_BYTES}")
    env = msgpack.unpackb(value, raw=False)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("not a map of strings")
    return env


def _kvs(response: Range | int) -> list[KeyValue]:
    """The key-values a txn's get answered (a put or delete answers an int)."""
    return response.kvs if isinstance(response, Range) else []


def block_first(job_id: int) -> int:
    """The first id of the history block job ``job_id`` belongs in."""
    return job_id - job_id % BLOCK_IDS


@dataclass
class HistoryBlock:
    """Ended jobs of ids ``first`` .. ``first + BLOCK_IDS - 1``, as one etcd value.

    Each member is kept packed, exactly as a job's key of its own holds it (a
    reader decodes and checks only what it reads; a retirement appends
    without decoding the others): the value is ``{"v": 1, "jobs": {id:
    packed record}}``. ``revision``: the key's mod revision (0: no such key yet)."""

    first: int
    members: dict[int, bytes] = field(default_factory=dict)
    revision: int = 0

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.members.values()) + 16

    def pack(self) -> bytes:
        return pack({"v": 1, "jobs": dict(sorted(self.members.items()))})

    @classmethod
    def unpack(cls, first: int, value: bytes, revision: int) -> HistoryBlock:
        """A block read from etcd (ValueError if the value is not one; each
        member is checked only when decoded, see :meth:`records`)."""
        if len(value) > MAX_BLOCK_BYTES:
            raise ValueError(f"{len(value)} bytes, more than {MAX_BLOCK_BYTES}")
        try:
            found = msgpack.unpackb(value, raw=False, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 -- msgpack's own errors, as in decode_record
            raise ValueError(f"not msgpack: {type(exc).__name__}: {exc}") from None
        if not isinstance(found, dict) or found.get("v") != 1 or not isinstance(found.get("jobs"), dict):
            raise ValueError("not a history block")
        block = cls(first, revision=revision)
        for job_id, packed in found["jobs"].items():
            # (the id is checked against the record's own when it is decoded)
            if not isinstance(packed, bytes) or not isinstance(job_id, int) or isinstance(job_id, bool) \
                    or not first <= job_id < first + BLOCK_IDS:
                raise ValueError(f"a member that is not a packed record of an id of the block ({job_id!r})")
            block.members[job_id] = packed
        return block

    def record(self, job_id: int) -> dict | None:
        """Member ``job_id`` decoded (``seq``: the block's revision); None if absent or damaged."""
        packed = self.members.get(job_id)
        if packed is None:
            return None
        try:
            record = decode_record(packed)
        except ValueError as exc:
            log.error("ignoring unreadable history record of job %d: %s", job_id, exc)
            return None
        if record["id"] != job_id:
            log.error("ignoring history record of job %d filed as job %d", record["id"], job_id)
            return None
        record["seq"] = self.revision
        return record

    def records(self, low: int = 0, high: int | None = None) -> list[dict]:
        """The members with ids in [low, high), decoded, in id order."""
        out = []
        for job_id in sorted(self.members):
            if job_id >= low and (high is None or job_id < high) and (record := self.record(job_id)) is not None:
                out.append(record)
        return out


_NODE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


def copies(keys: Keys, record: dict, size: int) -> list[str]:
    """The keys of the copies of ``record`` (``size`` bytes packed): one for
    each node it is placed on, or the one every node watches (see the module
    docstring); none before it is placed."""
    nodes = sorted(set(record["placement"]))
    if not nodes:
        return []
    if len(nodes) <= FANOUT_NODES and size * len(nodes) <= FANOUT_BYTES and all(_NODE_KEY.match(n) for n in nodes):
        return [keys.copy(n, record["id"]) for n in nodes]
    return [keys.copy(None, record["id"])]


def copy_ops(keys: Keys, old: dict | None, record: dict | None, data: bytes) -> list[Op]:
    """The operations that keep a job's copies in line with its record
    going from ``old`` to ``record`` (None: the job leaves the hot table).
    A record larger than FANOUT_BYTES is not copied: its one copy is empty,
    and says "read the job's key at my revision" (see :meth:`JobTable._resolve`):
    a transaction holds at most one large record (etcd refuses requests above 1.5 MiB)."""
    new = copies(keys, record, len(data)) if record is not None else []
    gone = [k for k in (copies(keys, old, len(data)) if old is not None else []) if k not in new]
    value = data if len(data) <= FANOUT_BYTES else b""
    return [Op.put(k, value) for k in new] + [Op.delete(k) for k in gone]


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


def unavailable(exc: EtcdError) -> RemoteError:
    return RemoteError("etcd_unavailable", f"the cluster's etcd cannot be reached: {exc.message}")


class Pacer:
    """When a group commit goes (see LINGER)."""

    def __init__(self, linger: float | None = None, busy: float | None = None) -> None:
        self._last = -math.inf
        self._linger, self._busy = linger, busy

    async def linger(self, full: Callable[[], bool]) -> None:
        """Wait a moment for more to join, if the last commit was a moment ago and ``full()`` is not already true."""
        busy = BUSY if self._busy is None else self._busy
        if not full() and trio.current_time() - self._last < busy:
            await trio.sleep(LINGER if self._linger is None else self._linger)

    def sent(self) -> None:
        self._last = trio.current_time()


@dataclass(eq=False)
class _Write:
    """One job's update waiting for the group commit (see :meth:`JobTable._commit`)."""

    fence: Fence
    job_id: int
    revision: int  # the job key's mod revision the change was computed from
    old: dict  # the record as of that revision
    record: dict  # what it becomes (every change that joined it applied)
    ops: list[Op]
    size: int
    waiters: int = 1  # the updates waiting for it (it was joined by the others, see JobTable.update)
    done: bool = False
    revision_written: int = 0
    found: list[KeyValue] = field(default_factory=list)  # the job's key when it had changed meanwhile
    error: RemoteError | None = None

    @property
    def committed(self) -> bool:
        return self.revision_written > 0

    def finish(self, *, revision: int = 0, found: list[KeyValue] | None = None, error: RemoteError | None = None) -> None:
        self.done, self.revision_written, self.found, self.error = True, revision, found or [], error


class JobTable:
    def __init__(self, etcd: Etcd, keys: Keys, node: str | None = None):
        """``node``: this node's name, whose jobs the cache holds (the whole
        table while :meth:`widen` lasts); None: always the whole table."""
        self.etcd = etcd
        self.keys = keys
        self.node = node
        self.records: dict[int, dict] = {}
        self.revision = 0  # the etcd revision this cache reflects (at least)
        # What the cache holds: the whole table, or the jobs placed on ``node``.
        # Each change of scope is a generation: the follower reads the new
        # scope and watches it from there (see :meth:`follow`).
        self.wide = node is None
        self._scope_gen = 0
        self._scope_loaded = trio.Event()  # set when the follower has read the scope of _scope_gen
        self._follow_scope: trio.CancelScope | None = None
        self._following = False
        self.loaded = trio.Event()  # set once the first load() is done: before it, the cache knows no job
        self.listeners: list[Callable[[dict], None]] = []  # called with each record that changed
        self._changed = trio.Event()
        self._counter: tuple[int, int] | None = None  # (last id handed out, the counter's mod revision), coordinator only
        self.by_token: dict[str, int] = {}  # a submission's token -> its job (see Coordinator.submit)
        # Queued jobs with no placement yet (what a scheduling pass reads), in
        # the order they are admitted: job id -> its sort key, and the keys sorted.
        self._unplaced: dict[int, tuple[int, int]] = {}
        self._queue: list[tuple[int, int]] = []
        # Spawned jobs (MPI_Comm_spawn) with no placement yet: not in the queue (see unplaced_spawned).
        self._unplaced_spawned: set[int] = set()
        # Queued jobs of each owner (what a submit checks a user's room against, without reading every record).
        self._queued_by_uid: dict[int, set[int]] = {}
        # Environments this node committed with their jobs, until the launch takes them (see :meth:`env`).
        self._fresh_env: dict[int, tuple[dict[str, str], int]] = {}
        self._fresh_env_bytes = 0
        # Checkpoint lineage root -> {job id: record} of its members in the history (see :meth:`lineage`).
        self._past_lineage: collections.OrderedDict[int, dict[int, dict]] = collections.OrderedDict()
        # History blocks as this coordinator last wrote them (see :meth:`retire`).
        self._blocks: collections.OrderedDict[int, HistoryBlock] = collections.OrderedDict()
        # Updates waiting for the group commit (see :meth:`_commit`).
        self._writes: collections.deque[_Write] = collections.deque()
        self._queued: dict[int, _Write] = {}  # job id -> its write in _writes (not sent yet)
        self._writing = False
        self._batch_done = trio.Event()
        self.pacer = Pacer(UPDATE_LINGER, UPDATE_BUSY)  # (of the updates' group commit; the creations' is the coordinator's)

    # ------------------------------------------------------------ reads (cache)

    def get(self, job_id: int) -> dict | None:
        return self.records.get(job_id)

    def active(self) -> list[dict]:
        return [r for r in self.records.values() if r["state"] in jobs.ACTIVE_STATES]

    def unplaced(self) -> Iterator[dict]:
        """Queued jobs not placed yet, highest priority first, then oldest
        first: the order kept as records change, so a scheduling pass (one per
        submit and per end, which stops at the first job that must wait) costs
        what it admits, not a sort of the whole queue each time. Safe to
        change the table while iterating (a job placed or gone meanwhile is skipped)."""
        for _, job_id in list(self._queue):
            record = self.records.get(job_id)
            if record is not None and job_id in self._unplaced:
                yield record

    def unplaced_spawned(self) -> list[dict]:
        """Spawned jobs not placed yet, oldest first. They are not in
        :meth:`unplaced`'s queue: their parent runs and waits for them, so they
        go before it, in the parent's time slot or nowhere (see
        :func:`gangd.daemon.spawns.admit`)."""
        return [record for job_id in sorted(self._unplaced_spawned) if (record := self.records.get(job_id)) is not None]

    def queued_of(self, uid: int) -> set[int]:
        """The ids of ``uid``'s queued jobs (placed or not)."""
        return self._queued_by_uid.get(uid, set())

    def _set_queued(self, old: dict | None, record: dict | None) -> None:
        if old is not None and old["state"] == jobs.QUEUED and isinstance(uid := old.get("owner_uid"), int):
            mine = self._queued_by_uid.get(uid)
            if mine is not None:
                mine.discard(old["id"])
                if not mine:
                    del self._queued_by_uid[uid]
        if record is not None and record["state"] == jobs.QUEUED and isinstance(uid := record.get("owner_uid"), int):
            self._queued_by_uid.setdefault(uid, set()).add(record["id"])

    def _set_unplaced(self, record: dict) -> None:
        job_id = record["id"]
        if record.get("spawned_by") is not None:  # (set when the job is made, never changed)
            if record["state"] == jobs.QUEUED and not record["placement"]:
                self._unplaced_spawned.add(job_id)
            else:
                self._unplaced_spawned.discard(job_id)
            return
        old = self._unplaced.get(job_id)
        priority = record.get("priority", 0)
        key = (-priority if isinstance(priority, int) else 0, job_id)
        if record["state"] != jobs.QUEUED or record["placement"]:
            self._drop_unplaced(job_id)
        elif old != key:
            self._drop_unplaced(job_id)
            self._unplaced[job_id] = key
            bisect.insort(self._queue, key)

    def _drop_unplaced(self, job_id: int) -> None:
        self._unplaced_spawned.discard(job_id)
        key = self._unplaced.pop(job_id, None)
        if key is not None:
            i = bisect.bisect_left(self._queue, key)
            if i < len(self._queue) and self._queue[i] == key:
                del self._queue[i]

    def notify_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def change_event(self) -> trio.Event:
        """Set at the next change. Take it *before* reading the table when
        something awaited in between could miss that change."""
        return self._changed

    def take(self, record: dict, revision: int) -> bool:
        """``record`` as of etcd revision ``revision``, if newer than what is
        cached; True if it changed anything."""
        current = self.records.get(record["id"])
        if current is not None and current.get("seq", 0) >= revision:
            return False
        record["seq"] = revision
        self.records[record["id"]] = record
        self._set_queued(current, record)
        self._set_unplaced(record)
        if self._fresh_env and jobs.is_terminal(record):
            self._drop_env(record["id"])
        token = record.get("submit_token")
        if isinstance(token, str):
            self.by_token[token] = record["id"]
        self.notify_changed()
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("table listener failed for job %d", record["id"])
        return True

    def _forget(self, job_id: int) -> None:
        """The job left the hot table (moved to the history)."""
        self._drop_env(job_id)
        self._drop_unplaced(job_id)
        record = self.records.pop(job_id, None)
        if record is None:
            return
        self._set_queued(record, None)
        if isinstance(record.get("submit_token"), str):
            self.by_token.pop(record["submit_token"], None)
        members = self._past_lineage.get(record.get("lineage") or job_id)
        if members is not None:  # a lineage kept here: it stays whole
            members[job_id] = record

    # ------------------------------------------------------------ checkpoint lineages

    @staticmethod
    def in_lineage(record: dict) -> bool:
        """Whether the history must find this job by its lineage (it took checkpoints, or is a restart)."""
        # (every record names its lineage, its own id when it is no restart: that alone does not count)
        return bool(record.get("checkpoints")) or (record.get("lineage") or record["id"]) != record["id"]

    def lineage(self, root: int) -> list[dict]:
        """The jobs of checkpoint lineage ``root`` (the job and every restart
        of it): those of the cache, and those of the history (and, on a node
        that holds only its own jobs, of the hot table) as last read by
        :meth:`read_lineage` (call it first where the answer matters)."""
        hot = {r["id"]: r for r in self.records.values() if (r.get("lineage") or r["id"]) == root}
        past = self._past_lineage.get(root, {})
        return sorted([*hot.values(), *(r for job_id, r in past.items() if job_id not in hot)], key=lambda r: r["id"])

    async def read_lineage(self, root: int) -> None:
        """Read lineage ``root``'s members in the history (its index, then
        each record); and, on a node that holds only its own jobs, those in
        the hot table too (ids from ``root`` on: a restart comes after its job)."""
        try:
            members: dict[int, dict] = {}
            if not self.wide:
                members.update((r["id"], r) for r in await self.hot_page(root - 1, 1 << 30, lambda r: (r.get("lineage") or r["id"]) == root))
            found = await self.etcd.range(self.keys.lineage(root), range_end=prefix_end(self.keys.lineage(root)),
                                          limit=LINEAGE_MEMBERS, keys_only=True)
            for kv in found.kvs:
                job_id = Keys.job_id(kv.key, self.keys.lineage(root))
                if job_id is None:
                    continue
                try:
                    record = await self._read_past(job_id)
                except ValueError as exc:
                    log.error("ignoring unreadable history record of job %d: %s", job_id, exc)
                    continue
                if record is not None:
                    members[job_id] = record
        except EtcdError as exc:
            raise unavailable(exc) from None
        self._past_lineage[root] = members
        self._past_lineage.move_to_end(root)
        while len(self._past_lineage) > LINEAGES_KEPT:
            self._past_lineage.popitem(last=False)

    def _take_kv(self, kv: KeyValue) -> None:
        record = self._decode_kv(kv)
        if record is not None:
            self.take(record, kv.mod_revision)

    # ------------------------------------------------------------ following etcd

    def _prefixes(self, *, watched: bool = False) -> list[str]:
        """What the cache reads: the whole table, or this node's copies and
        those every node watches; and what it watches (``watched``): the
        same, but nothing on the coordinator -- the table's only writer,
        fenced, its cache follows its own commits (a watch would send it
        each of its writes back)."""
        if self.node is None:
            return [self.keys.jobs]
        if self.wide:
            return [] if watched else [self.keys.jobs]
        return [self.keys.placed_on(self.node), self.keys.placed_on_many]

    def _mine(self, record: dict) -> bool:
        """Whether a copy's record belongs in a node's cache (one every node watches: only if placed here)."""
        return self.wide or self.node in record["placement"]

    async def load(self) -> None:
        """Read what the cache holds (the whole hot table, or this node's
        copies) at one revision, page by page, and make the cache that."""
        revision = 0
        seen: set[int] = set()
        for prefix in self._prefixes():
            start: str | bytes = prefix
            end = prefix_end(prefix)
            while True:
                page = await self.etcd.range(start, range_end=end, limit=PAGE, revision=revision)
                revision = revision or page.revision
                for kv in page.kvs:
                    job_id = Keys.job_id(kv.key, prefix)
                    if job_id is None:
                        continue
                    current = self.records.get(job_id)
                    if current is not None and current.get("seq", 0) >= kv.mod_revision:
                        seen.add(job_id)
                        continue
                    record, as_of = await self._resolve(kv, prefix, job_id)
                    if record is not None and self._mine(record):
                        seen.add(job_id)
                        self.take(record, as_of)
                if not page.more or not page.kvs:
                    break
                start = page.kvs[-1].key + b"\0"
        for job_id in [j for j in self.records if j not in seen and self.records[j].get("seq", 0) <= revision]:
            self._forget(job_id)  # retired to the history meanwhile, or (a node's) no longer placed here
        self.revision = max(self.revision, revision)
        self.loaded.set()
        self.notify_changed()

    async def widen(self) -> None:
        """Hold the whole table from now on (a coordinator's term begins):
        returns once it is read (then the term's own commits keep it)."""
        self._blocks.clear()  # (history blocks as an earlier term of this node wrote them: read again)
        if self.node is None:
            await self.load()
            return
        gen = self._rescope(True)
        if not self._following:  # (nobody follows: read it here)
            await self.load()
            return
        while self._scope_gen == gen and not self._scope_loaded.is_set():
            await self._scope_loaded.wait()

    def narrow(self) -> None:
        """Back to this node's jobs (the term is over): the follower reads this node's copies, and forgets the rest."""
        if self.node is not None and self.wide:
            self._rescope(False)

    def _rescope(self, wide: bool) -> int:
        self.wide = wide
        self._scope_gen += 1
        self._scope_loaded = trio.Event()
        if self._follow_scope is not None:
            self._follow_scope.cancel()
        return self._scope_gen

    async def _resolve(self, kv: KeyValue, prefix: str, job_id: int) -> tuple[dict | None, int]:
        """The record a key holds; for an empty copy (a large record, see
        :func:`copy_ops`), the job's key as of the copy's revision (both are
        written in one transaction), or now if that revision was compacted
        (None if the job has left the table since: its copy's delete follows);
        and the revision it is as of."""
        if kv.value or prefix == self.keys.jobs:
            return self._decode_kv(kv), kv.mod_revision
        try:
            found = await self.etcd.range(self.keys.job(job_id), revision=kv.mod_revision)
        except Unavailable:
            raise
        except EtcdError:  # (compacted: the newer record is as good)
            found = await self.etcd.range(self.keys.job(job_id))
        if not found.kvs:
            return None, 0
        return self._decode_kv(found.kvs[0]), found.kvs[0].mod_revision

    def _decode_kv(self, kv: KeyValue) -> dict | None:
        try:
            return decode_record(kv.value)
        except Exception as exc:  # noqa: BLE001 -- one damaged record is skipped, never the daemon
            log.error("ignoring unreadable job record %s: %s", kv.key.decode("utf-8", "replace"), exc)
            return None

    async def wait_loaded(self, timeout: float = LOAD_WAIT) -> None:
        """Return once the cache holds the table (a daemon serves its socket
        before it has read etcd: a listing then would say "no jobs"), or
        raise ``etcd_unavailable`` after ``timeout`` seconds."""
        if self.loaded.is_set():
            return
        with trio.move_on_after(timeout):
            await self.loaded.wait()
            return
        raise RemoteError("etcd_unavailable", "this node has not read the cluster's job table from etcd yet "
                                              "(it has just started, or cannot reach etcd): try again, or ask another node")

    async def follow(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Apply every change after :attr:`revision`, for ever (run after
        :meth:`load`); on a change of scope (:meth:`widen`, :meth:`narrow`),
        read the new scope and follow that from the revision it was read at."""
        started = False

        def on_started() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        loaded = self._scope_gen  # (load() ran before, for this scope)
        self._following = True
        try:
            while True:
                gen = self._scope_gen
                try:
                    with trio.CancelScope() as self._follow_scope:
                        if loaded != gen:
                            await self.load()
                            loaded = gen
                            if gen == self._scope_gen:
                                self._scope_loaded.set()
                        await self._watch(on_started)
                except* Compacted:  # (except*: a scope's watches run in a nursery)
                    log.warning("the job table's watch fell behind etcd's compaction; reading the table again")
                    loaded = -1
                except* Unavailable:
                    await trio.sleep(0.5)
                finally:
                    self._follow_scope = None
        finally:
            self._following = False

    async def _watch(self, on_started: Callable[[], None]) -> None:
        """Watch the scope's prefixes from :attr:`revision` on (each its own
        watch; :attr:`revision` is then the lowest either delivered)."""
        prefixes = self._prefixes(watched=True)
        start = self.revision
        reached = dict.fromkeys(prefixes, start)

        async def one(prefix: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with self.etcd.watch(prefix, prefix=True, start_revision=start + 1) as batches:
                task_status.started()
                async for batch in batches:
                    for event in batch.events:
                        await self._apply_event(event, prefix)
                    reached[prefix] = max(reached[prefix], batch.revision)
                    self.revision = max(self.revision, min(reached.values()))

        async with trio.open_nursery() as nursery:
            for prefix in prefixes:
                await nursery.start(one, prefix)
            on_started()
            if not prefixes:
                await trio.sleep_forever()  # (until the scope changes)

    async def _apply_event(self, event, prefix: str) -> None:
        job_id = Keys.job_id(event.kv.key, prefix)
        if job_id is None:
            return
        current = self.records.get(job_id)
        if event.type == "PUT":
            if current is not None and current.get("seq", 0) >= event.kv.mod_revision:
                return  # this node's own write, cached when it committed: not decoded again
            record, as_of = await self._resolve(event.kv, prefix, job_id)
            if record is None:
                return
            current = self.records.get(job_id)  # (read again: the read above waited)
            if self._mine(record):
                self.take(record, as_of)
            elif current is not None:  # (a copy every node watches, of a job no longer placed here)
                self._forget(job_id)
                self.notify_changed()
        elif self.wide and prefix != self.keys.jobs:
            return  # (a copy deleted by this coordinator's own write: the job stays in the table)
        elif current is not None and current.get("seq", 0) < event.kv.mod_revision:
            self._forget(job_id)  # moved to the history (or, a copy: no longer placed here)
            self.notify_changed()

    async def fetch(self, job_id: int) -> dict | None:
        """Job ``job_id`` from the cache, else from etcd (not placed on this
        node, just submitted elsewhere, or in the history)."""
        record = self.records.get(job_id)
        if record is not None:
            return record
        record, revision = await self._read_job(job_id)
        if record is not None and revision and self._mine(record):  # (in the hot table)
            self.take(record, record["seq"])  # (the watch brings it too, maybe later)
        return record

    async def watch_job(self, job_id: int, seen: Callable[[dict], Awaitable[bool]], first: dict | None = None) -> dict:
        """Call ``seen(record)`` with job ``job_id``'s record, then again at
        each change, until it returns True or the job has ended; the last
        record. From this node's cache when the job is in it, else from etcd
        (its key watched: no change is missed, and none of another job wakes
        it). ``first``: the record just read (an ended one is not read again)."""
        last = -1
        while True:
            changed = self.change_event()  # (taken before reading: a change meanwhile is not lost)
            current = self.records.get(job_id)
            revision = 0
            if current is None and first is not None and jobs.is_terminal(first):
                current = first  # (an ended job changes no more)
            elif current is None:
                current, revision = await self._read_job(job_id)
                if current is None:
                    raise RemoteError("no_such_job", f"no job {job_id}")
            if current["seq"] != last:
                last = current["seq"]
                if await seen(current) or jobs.is_terminal(current):
                    return current
            elif jobs.is_terminal(current):
                return current
            if revision == 0:
                await changed.wait()
                continue
            try:  # not cached here: the next change of its key (or its move to the history), then read again
                async with self.etcd.watch(self.keys.job(job_id), start_revision=revision + 1) as batches:
                    async for _ in batches:
                        break
            except Compacted:
                pass
            except Unavailable as exc:
                raise unavailable(exc) from None

    async def _read_job(self, job_id: int) -> tuple[dict | None, int]:
        """Job ``job_id``'s record from etcd (the hot table, else the history;
        None if in neither) and the revision it was read at (0 for the
        history: it never changes there but by a coordinator's cleanup, and
        nothing waits for that)."""
        try:
            # One round trip: its hot key, its history block, its history key of its own.
            found = await self.etcd.txn([], [Op.get(self.keys.job(job_id)), *self._past_gets(job_id)])
            hot = _kvs(found.responses[0])
            if hot:
                record = decode_record(hot[0].value)
                record["seq"] = hot[0].mod_revision
                return record, found.revision
            return self._past_found(job_id, found.responses[1:]), 0
        except EtcdError as exc:
            raise unavailable(exc) from None
        except ValueError as exc:
            raise RemoteError("internal", f"job {job_id}'s record in etcd is damaged: {exc}") from None

    def _past_gets(self, job_id: int) -> list[Op]:
        """The reads that find job ``job_id`` in the history: its block, and its key of its own (see :meth:`_past_found`)."""
        return [Op.get(self.keys.block(block_first(job_id))), Op.get(self.keys.past(job_id))]

    def _past_found(self, job_id: int, responses: list) -> dict | None:
        """Job ``job_id``'s history record from the answers to :meth:`_past_gets` (ValueError: damaged)."""
        blocks, alone = _kvs(responses[0]), _kvs(responses[1])
        if blocks and (block := self._decode_block(blocks[0])) is not None and job_id in block.members:
            return block.record(job_id)
        if not alone:
            return None
        record = decode_record(alone[0].value)
        record["seq"] = alone[0].mod_revision
        return record

    async def _read_past(self, job_id: int) -> dict | None:
        """Job ``job_id`` from the history (None: not there; ValueError: damaged; EtcdError)."""
        found = await self.etcd.txn([], self._past_gets(job_id))
        return self._past_found(job_id, found.responses)

    def _decode_block(self, kv: KeyValue) -> HistoryBlock | None:
        first = Keys.job_id(kv.key, self.keys.blocks)
        try:
            if first is None or first % BLOCK_IDS:
                raise ValueError("not the key of a block")
            return HistoryBlock.unpack(first, kv.value, kv.mod_revision)
        except ValueError as exc:  # one damaged block is skipped (its jobs are not found), never the daemon
            log.error("ignoring unreadable history block %s: %s", kv.key.decode("utf-8", "replace"), exc)
            return None

    async def _past_range(self, low: int, high: int | None, want: int, *, newest_first: bool = False) -> list[dict]:
        """Up to ``want`` jobs of the history with ids in [low, high) (None:
        no bound), oldest first (or newest first): from the blocks and from
        the keys of single jobs, merged. Raises EtcdError."""
        keys = self.keys
        end: str | bytes = keys.past(high) if high is not None else prefix_end(keys.history)
        if newest_first:
            alone = await self._range_newest_first(keys.past(low), end, want)
        else:
            alone = await self.etcd.range(keys.past(low), range_end=end, limit=want)
        found = {r["id"]: r for r in self._decode_history(alone.kvs)}
        start: str | bytes = keys.block(block_first(low))
        last = block_first(high - 1) + BLOCK_IDS if high is not None else None
        stop: str | bytes = keys.block(last) if last is not None and last < 10 ** ID_DIGITS else prefix_end(keys.blocks)
        per_read = max(2, want // BLOCK_IDS + 2)
        got = 0
        while True:
            if newest_first:
                page = await self._range_newest_first(start, stop, per_read)
            else:
                page = await self.etcd.range(start, range_end=stop, limit=per_read)
            for kv in page.kvs:
                block = self._decode_block(kv)
                for record in block.records(low, high) if block is not None else []:
                    found.setdefault(record["id"], record)
                    got += 1
            if got >= want or not page.more or not page.kvs:
                break
            if newest_first:
                stop = page.kvs[-1].key
            else:
                start = page.kvs[-1].key + b"\0"
        return sorted(found.values(), key=lambda r: r["id"], reverse=newest_first)[:want]

    async def hot_page(self, after: int, limit: int, keep: Callable[[dict], bool], below: int | None = None) -> list[dict]:
        """Up to ``limit`` jobs of the hot table with ids above ``after`` (and below ``below``) that
        ``keep``, in id order, read from etcd (a linearizable range per PAGE:
        the hot table is kept small by the retention period; on every node
        alike, the coordinator's cache of it is for scheduling)."""
        out: list[dict] = []
        start: str | bytes = self.keys.job(after + 1)
        end = prefix_end(self.keys.jobs) if below is None else self.keys.job(below)
        try:
            while len(out) < limit:
                page = await self.etcd.range(start, range_end=end, limit=max(PAGE, limit - len(out)))
                for record in self._decode_history(page.kvs):
                    if keep(record):
                        out.append(record)
                        if len(out) >= limit:
                            break
                if not page.more or not page.kvs:
                    break
                start = page.kvs[-1].key + b"\0"
        except EtcdError as exc:
            raise unavailable(exc) from None
        return out

    def cached_page(self, after: int, limit: int, keep: Callable[[dict], bool]) -> list[dict]:
        """:meth:`hot_page` from this node's cache alone (what a node cut off from etcd knows: its own jobs)."""
        ids = sorted(j for j, r in self.records.items() if j > after and keep(r))
        return [self.records[j] for j in ids[:limit]]

    async def hot_before(self, before: int | None, limit: int, keep: Callable[[dict], bool]) -> list[dict]:
        """Up to ``limit`` jobs of the hot table with ids below ``before`` (all if None) that ``keep``, newest first."""
        out: list[dict] = []
        end: str | bytes = self.keys.job(before) if before is not None else prefix_end(self.keys.jobs)
        try:
            while len(out) < limit:
                page = await self._range_newest_first(self.keys.jobs, end, PAGE)
                out += [r for r in self._decode_history(page.kvs) if keep(r)]
                if not page.more or not page.kvs:
                    break
                end = page.kvs[-1].key
        except EtcdError as exc:
            raise unavailable(exc) from None
        return out[:limit]

    def _keep_env(self, job_id: int, env: dict[str, str], size: int) -> None:
        if size > FRESH_ENV_BYTES:
            return
        self._fresh_env[job_id] = (env, size)
        self._fresh_env_bytes += size
        while self._fresh_env_bytes > FRESH_ENV_BYTES:
            self._drop_env(next(iter(self._fresh_env)))

    def _drop_env(self, job_id: int) -> dict[str, str] | None:
        kept = self._fresh_env.pop(job_id, None)
        if kept is None:
            return None
        self._fresh_env_bytes -= kept[1]
        return kept[0]

    async def env(self, job_id: int) -> dict[str, str]:
        """The job's environment: kept from its creation on this node (taken: a
        second launch reads etcd), else read from etcd (empty once the job ended)."""
        kept = self._drop_env(job_id)
        record = self.records.get(job_id)
        if kept is not None and record is not None and not jobs.is_terminal(record):
            return kept
        try:
            kv = await self.etcd.get(self.keys.env(job_id))
        except EtcdError as exc:
            raise unavailable(exc) from None
        if kv is None:
            return {}
        try:
            return decode_env(kv.value)
        except Exception as exc:  # noqa: BLE001 -- a damaged value costs the job its environment, with a log line
            log.error("job %d: ignoring its unreadable environment in etcd: %s", job_id, exc)
            return {}

    async def history(self, after: int, limit: int) -> list[dict]:
        """Up to ``limit`` jobs of the history with ids above ``after``, in id order."""
        try:
            top = await self._top_id()
            out: list[dict] = []
            low, span = max(after + 1, 1), max(limit, HISTORY_SPAN)
            while len(out) < limit and low <= top:
                high = min(low + span, top + 1)
                out += await self._past_range(low, high, limit - len(out))
                low, span = high, span * 2
            if len(out) < limit:  # ids past the counter's: none, unless the counter was set back by hand
                out += await self._past_range(low, None, limit - len(out))
        except EtcdError as exc:
            raise unavailable(exc) from None
        return out

    async def history_before(self, before: int | None, limit: int) -> list[dict]:
        """Up to ``limit`` jobs of the history with ids below ``before`` (all if None), newest first."""
        try:
            out: list[dict] = []
            if before is None:
                top = await self._top_id()
                out += await self._past_range(top + 1, None, limit, newest_first=True)
            else:
                top = before - 1
            high, span = top + 1, max(limit, HISTORY_SPAN)
            while len(out) < limit and high > 1:
                low = max(1, high - span)
                out += await self._past_range(low, high, limit - len(out), newest_first=True)
                high, span = low, span * 2
        except EtcdError as exc:
            raise unavailable(exc) from None
        return out

    async def _last_block_id(self) -> int:
        """The highest id in the history's blocks (0: none). Raises EtcdError."""
        keys = self.keys
        last = await self._range_newest_first(keys.blocks, prefix_end(keys.blocks), 1)
        block = self._decode_block(last.kvs[0]) if last.kvs else None
        if block is None:  # (none, or damaged: its ids are at most its first's last)
            first = Keys.job_id(last.kvs[0].key, keys.blocks) if last.kvs else None
            return first + BLOCK_IDS - 1 if first is not None else 0
        return max(block.members, default=block.first)

    async def _top_id(self) -> int:
        """The last job id handed out (the counter): no history key lies above it."""
        kv = await self.etcd.get(self.keys.ids)
        try:
            return int(kv.value) if kv is not None else 0
        except ValueError:
            return 0

    async def _range_newest_first(self, start: str | bytes, end: str | bytes, limit: int) -> Range:
        return await self.etcd.range(start, range_end=end, limit=limit, sort_target="KEY", sort_order="DESCEND")

    def _decode_history(self, kvs: list[KeyValue]) -> list[dict]:
        records = []
        for kv in kvs:
            record = self._decode_kv(kv)  # (a damaged one is skipped, with a log line)
            if record is not None:
                record["seq"] = kv.mod_revision
                records.append(record)
        return records

    async def backfill_lineages(self, fence: Fence) -> int:
        """Index the history's lineage members that have no index key (moved
        there by a gangd from before the index): once per cluster, page by
        page, fenced; then :attr:`Keys.lineages_indexed` says it is done. How
        many were indexed. Without it a restart of such an old lineage would
        find none of its generations that ended in the history."""
        keys = self.keys
        try:
            if await self.etcd.get(keys.lineages_indexed) is not None:
                return 0
            added = 0
            start: str | bytes = keys.history
            end = prefix_end(keys.history)
            while True:
                page = await self.etcd.range(start, range_end=end, limit=PAGE)
                ops = []
                for record in self._decode_history(page.kvs):
                    if self.in_lineage(record):
                        ops.append(Op.put(keys.lineage_member(record.get("lineage") or record["id"], record["id"]), b""))
                for at in range(0, len(ops), UPDATE_BATCH):  # (etcd's 128 operations per transaction)
                    result = await self.etcd.txn([fence.compare()], ops[at:at + UPDATE_BATCH], [Op.get(fence.key)])
                    if not result.succeeded:
                        self._check_fence(fence, result.responses[0])
                    added += len(ops[at:at + UPDATE_BATCH])
                if not page.more or not page.kvs:
                    break
                start = page.kvs[-1].key + b"\0"
            result = await self.etcd.txn([fence.compare()], [Op.put(keys.lineages_indexed, b"1")], [Op.get(fence.key)])
            if not result.succeeded:
                self._check_fence(fence, result.responses[0])
        except EtcdError as exc:
            raise self._write_error(exc) from None
        if added:
            log.info("indexed %d jobs of checkpoint lineages in the history (moved there by an older gangd)", added)
        return added

    # ------------------------------------------------------------ writes (the coordinator, fenced)

    @staticmethod
    def _check_fence(fence: Fence, found: Range | int) -> None:
        kvs = _kvs(found)
        kv = kvs[0] if kvs else None
        if kv is None or kv.create_revision != fence.term:
            raise Deposed(f"this node's term {fence.term} as coordinator is over (etcd holds another leader)")

    async def create(self, fence: Fence, build: Callable[[int], dict], env: dict[str, str]) -> dict:
        """A new job: ``build(job_id)`` with the next id, created with the counter in one transaction."""
        return (await self.create_many(fence, [(build, env)]))[0]

    async def create_many(self, fence: Fence, items: list[tuple[Callable[[int], dict], dict[str, str]]]) -> list[dict]:
        """New jobs, consecutive ids, in one transaction (a group commit: one
        etcd round trip and fsync for every submission that waited)."""
        keys = self.keys
        while True:
            try:
                if self._counter is None:
                    kv = await self.etcd.get(keys.ids)
                    counted = (int(kv.value), kv.mod_revision) if kv is not None else (0, 0)
                    # Never an id of the history's blocks (a job's key, hot or of its own, is compared below;
                    # a member of a block cannot be): the counter set back by hand is moved past them.
                    self._counter = (max(counted[0], await self._last_block_id()), counted[1])
                last, counted_at = self._counter
                records = []
                envs: list[tuple[int, dict[str, str], int]] = []
                compare = [fence.compare(), Compare.mod_revision(keys.ids) == counted_at]
                success = [Op.put(keys.ids, str(last + len(items)))]
                for offset, (build, env) in enumerate(items, 1):
                    job_id = last + offset
                    record = build(job_id)
                    record.pop("env", None)
                    records.append(record)
                    compare += [Compare.version(keys.job(job_id)) == 0, Compare.version(keys.past(job_id)) == 0]
                    data = pack(record)
                    success.append(Op.put(keys.job(job_id), data))
                    success += copy_ops(keys, None, record, data)  # (none unless created placed)
                    if env:
                        packed = pack(env)
                        envs.append((job_id, env, len(packed)))
                        success.append(Op.put(keys.env(job_id), packed))
                result = await self.etcd.txn(compare, success, [Op.get(fence.key), Op.get(keys.ids)])
            except Indeterminate as exc:
                # The answer was lost: the jobs may exist. Settle it before
                # answering anyone (an error here made users submit twice).
                self._counter = None
                revision = await self._settle(fence, last, counted_at, pack(records[0]), exc)
                if revision is None:
                    continue  # not committed, and now it never can be: sent again (next ids)
            except EtcdError as exc:
                self._counter = None
                raise self._write_error(exc) from None
            else:
                if not result.succeeded:
                    self._check_fence(fence, result.responses[0])
                    counter = _kvs(result.responses[1])
                    now = (int(counter[0].value), counter[0].mod_revision) if counter else (0, 0)
                    # The same counter and still no luck: an id's key exists (the
                    # counter was reset by hand): skip past them.
                    self._counter = (last + len(items), now[1]) if now == self._counter else now
                    continue
                revision = result.revision
            failpoint("jobtable.created")
            self._counter = (last + len(items), revision)
            for record in records:
                self.take(record, revision)
            for job_id, env, size in envs:
                self._keep_env(job_id, env, size)
            return records

    async def _settle(self, fence: Fence, last: int, counted_at: int, first: bytes, lost: EtcdError) -> int | None:
        """Whether a creation whose answer was lost committed: its revision, or None (and then it never will).

        Reading the job's key alone would not settle it: a transaction still
        on its way inside etcd may apply after the read. So the counter is
        written again, unchanged, on the same comparisons the creation made
        (the term and the counter's revision): if that commits, the creation
        never can (the counter's revision moved past the one it compares);
        if it fails, the creation committed or never will, and the first
        job's key says which -- it holds exactly this transaction's record
        (each record carries its job's own random token), or another's, or
        nothing. Retried while etcd cannot be reached, for a bounded time;
        still unknown then, the submitters are told so, and how to check."""
        deadline = trio.current_time() + INDETERMINATE_PATIENCE
        key = self.keys.job(last + 1)
        while True:
            try:
                result = await self.etcd.txn(
                    [fence.compare(), Compare.mod_revision(self.keys.ids) == counted_at],
                    [Op.put(self.keys.ids, str(last))],
                    [Op.get(key)],
                )
            except Unavailable as exc:  # (Indeterminate too: this write may be tried again as often as needed)
                if trio.current_time() > deadline:
                    log.error("jobs from %d on: whether they were created is unknown (%s; then %s)", last + 1, lost.message, exc.message)
                    raise RemoteError(
                        "indeterminate",
                        f"etcd did not answer whether the job was created ({lost.message}), and could not be reached "
                        f"for {INDETERMINATE_PATIENCE:g} s to find out: the job may or may not exist. "
                        "Check with `gang ps` before submitting it again.",
                    ) from None
                await trio.sleep(0.2)
                continue
            except EtcdError as exc:
                raise self._write_error(exc) from None
            if result.succeeded:
                log.warning("jobs from %d on were not created (etcd's answer was lost: %s); sending them again", last + 1, lost.message)
                return None
            found = _kvs(result.responses[0])
            if found and found[0].value == first:
                log.warning("jobs from %d on were created although etcd's answer was lost (%s)", last + 1, lost.message)
                return found[0].mod_revision
            return None

    async def update(self, fence: Fence, job_id: int, change: Callable[[dict], object]) -> dict:
        """Apply ``change(record)`` to a copy of the record and commit it, fenced.

        ``change`` returning False means: nothing to do (the current record is
        returned). It may run more than once: when the record changed in etcd
        meanwhile, it is computed again from the newer one.

        A change to a job whose previous change still waits for its group
        commit joins that write (computed from the record it writes): both
        go in one transaction, and both callers get the record it wrote. A
        short job's start and end, when its ranks are done before its start
        is written, cost one write, one watch event on its nodes, not two."""
        while True:
            queued = self._queued.get(job_id)
            if queued is not None and queued.fence == fence:
                record = copy.deepcopy(queued.record)
                if change(record) is not False:
                    queued.record = record
                    queued.ops, queued.size = self._write_ops(queued.old, record)
                write = queued
                write.waiters += 1
                await self._commit(write, joined=True)
            else:
                current = self.records.get(job_id)
                if current is None:
                    current = await self.fetch(job_id)
                    if current is None:
                        raise RemoteError("no_such_job", f"no job {job_id} in the cluster's job table")
                    if job_id not in self.records:  # in the history
                        return await self._update_past(fence, job_id, current, change)
                    continue  # (read meanwhile: another change may be waiting to join)
                record = copy.deepcopy(current)
                if change(record) is False:
                    return current
                revision = record.pop("seq", 0)
                ops, size = self._write_ops(current, record)
                write = _Write(fence, job_id, revision, current, record, ops, size)
                await self._commit(write)
            if write.error is not None:
                raise write.error
            if write.committed:
                failpoint("jobtable.updated")
                self.take(write.record, write.revision_written)
                return write.record
            found = write.found
            if not found:
                self._forget(job_id)
                raise RemoteError("no_such_job", f"job {job_id} is no longer in the hot job table")
            self._take_kv(found[0])

    def waiting_write(self, job_id: int) -> bool:
        """Whether an update of the job waits for its group commit (a change now would join it)."""
        return job_id in self._queued

    def _write_ops(self, old: dict, record: dict) -> tuple[list[Op], int]:
        """What an update from ``old`` to ``record`` writes (its record, its copies; its environment goes when it ends), and its bytes."""
        keys = self.keys
        data = pack(record)
        success = [Op.put(keys.job(record["id"]), data)]
        if jobs.is_terminal(record):
            success.append(Op.delete(keys.env(record["id"])))
        success += copy_ops(keys, old, record, data)  # (the nodes it is placed on watch these)
        return success, sum(len(op.body.get("value", "")) for op in success)

    async def _update_past(self, fence: Fence, job_id: int, current: dict, change: Callable[[dict], object]) -> dict:
        """:meth:`update` for a job in the history: what an ended job's record
        may still learn (its checkpoint generations removed or found damaged),
        fenced and compared with the revision it was computed from, as in the
        hot table (the revision of its block, when it is in one). It stays
        ended: a history record never becomes a live job."""
        keys = self.keys
        first = block_first(job_id)
        while True:
            try:
                kv = await self.etcd.get(keys.block(first))
            except EtcdError as exc:
                raise self._write_error(exc) from None
            block = self._decode_block(kv) if kv is not None else None
            in_block = block is not None and job_id in block.members
            if block is not None and in_block:
                found = block.record(job_id)
                if found is None:
                    raise RemoteError("internal", f"job {job_id}'s record in etcd is damaged")
                current = found
            record = copy.deepcopy(current)
            if change(record) is False:
                return current
            if not jobs.is_terminal(record):
                raise RemoteError("bad_state", f"job {job_id} ended and is in the history: it cannot become {record['state']}")
            revision = record.pop("seq", 0)
            data = pack(record)
            if block is not None and in_block:
                key = keys.block(first)
                if len(data) > BLOCK_RECORD_BYTES or block.size - len(block.members[job_id]) + len(data) > BLOCK_BYTES:
                    del block.members[job_id]  # (grown too large for its block: a key of its own, in the same transaction)
                    ops = [Op.put(key, block.pack()), Op.put(keys.past(job_id), data)]
                else:
                    block.members[job_id] = data
                    ops = [Op.put(key, block.pack())]
            else:
                key = keys.past(job_id)
                ops = [Op.put(key, data)]
            try:
                result = await self.etcd.txn([fence.compare(), Compare.mod_revision(key) == revision], ops, [Op.get(fence.key), Op.get(key)])
            except EtcdError as exc:
                raise self._write_error(exc) from None
            self._blocks.pop(first, None)  # (the coordinator's copy: read again when it next appends)
            if result.succeeded:
                record["seq"] = result.revision
                members = self._past_lineage.get(record.get("lineage") or job_id)
                if members is not None and job_id in members:
                    members[job_id] = record
                return record
            self._check_fence(fence, result.responses[0])
            if in_block:
                continue  # (the block changed: read again)
            alone = _kvs(result.responses[1])
            if not alone:
                raise RemoteError("no_such_job", f"no job {job_id} in the cluster's job table")
            try:
                current = decode_record(alone[0].value)
            except ValueError as exc:
                raise RemoteError("internal", f"job {job_id}'s record in etcd is damaged: {exc}") from None
            current["seq"] = alone[0].mod_revision

    async def _commit(self, write: _Write, *, joined: bool = False) -> None:
        """Commit ``write`` together with the other updates waiting meanwhile
        (a group commit: one etcd round trip for a burst of job changes, as
        for submissions). One waiting task at a time sends a batch; when it
        returns, the next one sends whatever queued up behind it. Each update
        keeps its own comparison: a batch whose transaction fails because
        some of its jobs changed is answered for those, the others are sent again."""
        if not joined:
            self._writes.append(write)
            self._queued[write.job_id] = write
        try:
            while not write.done:
                if self._writing:
                    await self._batch_done.wait()
                    continue
                self._writing = True
                try:
                    # Shielded: the batch holds other tasks' updates, which must all hear how it went.
                    with trio.CancelScope(shield=True):
                        await self.pacer.linger(lambda: len(self._writes) >= UPDATE_BATCH)
                        await self._commit_batch()
                        self.pacer.sent()
                finally:
                    self._writing = False
                    done, self._batch_done = self._batch_done, trio.Event()
                    done.set()
        finally:
            write.waiters -= 1
            if not write.done and not write.waiters:  # cancelled while waiting its turn (all who joined it too): never sent
                with contextlib.suppress(ValueError):
                    self._writes.remove(write)
                if self._queued.get(write.job_id) is write:
                    del self._queued[write.job_id]

    async def _commit_batch(self) -> None:
        first = self._writes[0]
        batch: list[_Write] = []
        rest: collections.deque[_Write] = collections.deque()
        ids: set[int] = set()
        size = ops = 0
        for w in self._writes:
            # One transaction may not touch a key twice, nor mix terms; and etcd bounds its operations and bytes.
            if (w.fence != first.fence or w.job_id in ids or len(batch) >= UPDATE_BATCH
                    or (batch and (size + w.size > UPDATE_BATCH_BYTES or ops + len(w.ops) > TXN_OPS))):
                rest.append(w)
                continue
            batch.append(w)
            if self._queued.get(w.job_id) is w:
                del self._queued[w.job_id]  # (sent now: a later change is a write of its own)
            ids.add(w.job_id)
            size += w.size
            ops += len(w.ops)
        self._writes = rest
        try:
            await self._send_batch(first.fence, batch)
        finally:
            for w in batch:
                if not w.done and w not in self._writes:  # a bug: each update of the batch hears of it, none waits for ever
                    log.error("job %d: its batched update was left without an answer", w.job_id)
                    w.finish(error=RemoteError("internal", f"the update of job {w.job_id} failed (see the coordinator's log)"))

    async def _send_batch(self, fence: Fence, batch: list[_Write]) -> None:
        keys = self.keys
        try:
            result = await self.etcd.txn(
                [fence.compare()] + [Compare.mod_revision(keys.job(w.job_id)) == w.revision for w in batch],
                [op for w in batch for op in w.ops],
                [Op.get(fence.key)] + [Op.get(keys.job(w.job_id)) for w in batch],
            )
        except EtcdError as exc:
            for w in batch:
                w.finish(error=self._write_error(exc))
            return
        if result.succeeded:
            for w in batch:
                w.finish(revision=result.revision)
            return
        try:
            self._check_fence(fence, result.responses[0])
        except Deposed as exc:
            for w in batch:
                w.finish(error=exc)
            return
        again = []
        for w, response in zip(batch, result.responses[1:], strict=True):
            found = _kvs(response)
            if found and found[0].mod_revision == w.revision:
                again.append(w)  # not the one that changed: sent again with the next batch
            else:
                w.finish(found=found)
        if len(again) == len(batch):  # cannot be (a comparison failed): answered rather than sent for ever
            for w in again:
                w.finish(error=RemoteError("internal", f"etcd refused the update of job {w.job_id} without saying why"))
            return
        self._writes.extendleft(reversed(again))
        for w in again:
            self._queued.setdefault(w.job_id, w)

    async def retire(self, fence: Fence, records: list[dict]) -> int:
        """Move ended jobs to the history (each only if unchanged since it was
        read): into the blocks of their ids, one transaction per block (or
        per RETIRE_BATCH jobs of it), fenced and compared with the block's
        revision; how many moved."""
        groups: dict[int, list[dict]] = {}
        for r in sorted((r for r in records if jobs.is_terminal(r)), key=lambda r: r["id"]):
            groups.setdefault(block_first(r["id"]), []).append(r)
        moved = 0
        try:
            for first, group in groups.items():
                moved += await self._retire_into(fence, first, group)
        except EtcdError as exc:
            raise self._write_error(exc) from None
        finally:
            if moved:
                self.notify_changed()
        return moved

    async def _retire_into(self, fence: Fence, first: int, group: list[dict]) -> int:
        """:meth:`retire` for the jobs of block ``first``: how many moved."""
        keys = self.keys
        key = keys.block(first)
        block = self._blocks.get(first)
        if block is None:
            kv = await self.etcd.get(key)
            block = self._decode_block(kv) if kv is not None else HistoryBlock(first)
            usable = block is not None
            if block is None:  # damaged: left as it is, and these jobs get keys of their own
                block = HistoryBlock(first, revision=kv.mod_revision if kv is not None else 0)
        else:
            usable = True
        moved = 0
        todo = list(group)
        while todo:
            members, size = dict(block.members), block.size
            chunk: list[dict] = []
            ops: list[Op] = []
            alone_bytes, modified = 0, False  # (the bytes this transaction carries: those, and the block if it changes)
            for r in todo:
                data = pack({k: v for k, v in r.items() if k != "seq"})
                moves = [Op.delete(keys.job(r["id"]))] + copy_ops(keys, r, None, data)
                if self.in_lineage(r):  # (a restart finds its checkpoints through this)
                    moves.append(Op.put(keys.lineage_member(r.get("lineage") or r["id"], r["id"]), b""))
                alone = not usable or len(data) > BLOCK_RECORD_BYTES or size + len(data) > BLOCK_BYTES
                if alone:
                    moves.append(Op.put(keys.past(r["id"]), data))
                grown = alone_bytes + len(data) + (size if modified else 0) if alone else alone_bytes + size + len(data)
                if chunk and (len(chunk) >= RETIRE_BATCH or len(ops) + len(moves) + 1 > TXN_OPS or grown > RETIRE_BATCH_BYTES):
                    break
                chunk.append(r)
                ops += moves
                if alone:
                    alone_bytes += len(data)
                else:
                    members[r["id"]] = data
                    size += len(data)
                    modified = True
            if modified:
                ops.insert(0, Op.put(key, HistoryBlock(first, members).pack()))
            compare = [fence.compare(), Compare.mod_revision(key) == block.revision]
            compare += [Compare.mod_revision(keys.job(r["id"])) == r.get("seq", 0) for r in chunk]
            result = await self.etcd.txn(compare, ops, [Op.get(fence.key)])
            if not result.succeeded:
                self._check_fence(fence, result.responses[0])
                self._blocks.pop(first, None)
                return moved  # one of them (or the block) changed meanwhile: the next round sees it
            block = HistoryBlock(first, members, result.revision if modified else block.revision)
            if usable:
                self._blocks[first] = block
                self._blocks.move_to_end(first)
                while len(self._blocks) > BLOCKS_KEPT:
                    self._blocks.popitem(last=False)
            for r in chunk:
                if self.records.get(r["id"]) is not None and self.records[r["id"]].get("seq", 0) <= r.get("seq", 0):
                    self._forget(r["id"])
            moved += len(chunk)
            todo = todo[len(chunk):]
        return moved

    @staticmethod
    def _write_error(exc: EtcdError) -> RemoteError:
        if isinstance(exc, Unavailable):
            return unavailable(exc)
        if "too large" in exc.message:
            return RemoteError("too_large", f"etcd refused the job's record: {exc.message}")
        return RemoteError("etcd", f"etcd refused the change: {exc.message}")
