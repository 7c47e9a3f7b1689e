"""The job table: etcd's job keys, cached on every node and kept current by a watch.

Why a cache: every request a node serves (``ps``, ``wait``, ``logs``, a
launch's checks) reads jobs. etcd is read once (a range at one revision,
page by page) and then only says what changed (a watch from the next
revision), so a read costs no round trip, and no change is ever missed: the
watch resumes from the last revision it delivered, and a node whose
revision was compacted away reads the table anew. Each cached record carries
its key's mod revision as ``seq``: a newer revision always wins, an older one
(a watch event behind a write this node made itself) changes nothing.

Writes: only the coordinator writes, and only through a :class:`Fence`. Every
write is one etcd transaction that also compares the coordinator's election
key with its term, so a deposed coordinator's write fails in etcd itself,
whatever that coordinator still believes (:class:`Deposed`). An update also
compares the job key's mod revision with the one its change was computed
from: a change is applied exactly once, to the record it was computed from,
or computed again. Job ids come from a counter moved in the same
transaction that creates the job: never handed out twice, across any
failover.

A job's environment (the submitter's, up to 2 MiB) is a key of its own,
written once with the job and deleted in the transaction that ends it: the
record, rewritten on every change, stays small. Ended jobs move to the
history after the retention period (:meth:`JobTable.retire`), so the hot
table, and what a submit costs, does not grow with the cluster's past.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from ... import jobs
from ...etcd.client import Compacted, Compare, Etcd, EtcdError, KeyValue, Op, Range, Unavailable
from ...failpoint import failpoint
from ...rpc import RemoteError
from .keys import Keys

log = logging.getLogger("gangd.jobtable")

#: Jobs per range read when (re)loading the table or paging the history.
PAGE = 500
#: Largest record the table accepts (records hold no environment: far below).
MAX_RECORD_BYTES = 1024 * 1024
#: Largest environment value accepted back (jobs.MAX_ARGV_ENV_BYTES, packed).
MAX_ENV_BYTES = 3 * 1024 * 1024
#: Ended jobs moved to the history in one transaction: three operations and
#: one comparison each, and etcd allows 128 of either (--max-txn-ops).
RETIRE_BATCH = 40
RETIRE_BATCH_BYTES = 1024 * 1024  # (etcd refuses requests above 1.5 MiB by default)


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
    record = msgpack.unpackb(value, raw=False, strict_map_key=False)
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
    if not isinstance(record.get("placement"), list):
        raise ValueError("bad placement")
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


def _batches(records: list[dict]) -> Iterator[list[tuple[dict, bytes]]]:
    """Each record with its packed form for the history, in batches etcd takes
    in one transaction: at most RETIRE_BATCH of them and RETIRE_BATCH_BYTES."""
    batch: list[tuple[dict, bytes]] = []
    size = 0
    for r in records:
        data = pack({k: v for k, v in r.items() if k != "seq"})
        if batch and (len(batch) >= RETIRE_BATCH or size + len(data) > RETIRE_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append((r, data))
        size += len(data)
    if batch:
        yield batch


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


def unavailable(exc: EtcdError) -> RemoteError:
    return RemoteError("etcd_unavailable", f"the cluster's etcd cannot be reached: {exc.message}")


class JobTable:
    def __init__(self, etcd: Etcd, keys: Keys):
        self.etcd = etcd
        self.keys = keys
        self.records: dict[int, dict] = {}
        self.revision = 0  # the etcd revision this cache reflects (at least)
        self.listeners: list[Callable[[dict], None]] = []  # called with each record that changed
        self._changed = trio.Event()
        self._counter: tuple[int, int] | None = None  # (last id handed out, the counter's mod revision), coordinator only
        self.by_token: dict[str, int] = {}  # a submission's token -> its job (see Coordinator.submit)

    # ------------------------------------------------------------ reads (cache)

    def get(self, job_id: int) -> dict | None:
        return self.records.get(job_id)

    def active(self) -> list[dict]:
        return [r for r in self.records.values() if r["state"] in jobs.ACTIVE_STATES]

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
        record = self.records.pop(job_id, None)
        if record is not None and isinstance(record.get("submit_token"), str):
            self.by_token.pop(record["submit_token"], None)

    def _take_kv(self, kv: KeyValue) -> None:
        try:
            record = decode_record(kv.value)
        except Exception as exc:  # noqa: BLE001 -- one damaged record is skipped, never the daemon
            log.error("ignoring unreadable job record %s: %s", kv.key.decode("utf-8", "replace"), exc)
            return
        self.take(record, kv.mod_revision)

    # ------------------------------------------------------------ following etcd

    async def load(self) -> None:
        """Read the whole hot table at one revision (page by page) and make the cache that."""
        revision = 0
        seen: set[int] = set()
        start: str | bytes = self.keys.jobs
        end = prefix_end(self.keys.jobs)
        while True:
            page = await self.etcd.range(start, range_end=end, limit=PAGE, revision=revision)
            revision = revision or page.revision
            for kv in page.kvs:
                job_id = Keys.job_id(kv.key, self.keys.jobs)
                if job_id is None:
                    continue
                seen.add(job_id)
                current = self.records.get(job_id)
                if current is None or current.get("seq", 0) < kv.mod_revision:
                    self._take_kv(kv)
            if not page.more or not page.kvs:
                break
            start = page.kvs[-1].key + b"\0"
        for job_id in [j for j in self.records if j not in seen and self.records[j].get("seq", 0) <= revision]:
            self._forget(job_id)  # retired to the history meanwhile
        self.revision = max(self.revision, revision)
        self.notify_changed()

    async def follow(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Apply every change after :attr:`revision`, for ever (run after :meth:`load`)."""
        started = False
        while True:
            try:
                async with self.etcd.watch(self.keys.jobs, prefix=True, start_revision=self.revision + 1) as batches:
                    if not started:
                        started = True
                        task_status.started()
                    async for batch in batches:
                        for event in batch.events:
                            self._apply_event(event)
                        self.revision = max(self.revision, batch.revision)
            except Compacted:
                log.warning("the job table's watch fell behind etcd's compaction; reading the table again")
                await self.load()
            except Unavailable:
                await trio.sleep(0.5)

    def _apply_event(self, event) -> None:
        job_id = Keys.job_id(event.kv.key, self.keys.jobs)
        if job_id is None:
            return
        if event.type == "PUT":
            self._take_kv(event.kv)
        else:
            current = self.records.get(job_id)
            if current is not None and current.get("seq", 0) < event.kv.mod_revision:
                self._forget(job_id)  # moved to the history
                self.notify_changed()

    async def fetch(self, job_id: int) -> dict | None:
        """Job ``job_id`` from the cache, else from etcd (just submitted elsewhere, or in the history)."""
        record = self.records.get(job_id)
        if record is not None:
            return record
        try:
            for key in (self.keys.job(job_id), self.keys.past(job_id)):
                kv = await self.etcd.get(key)
                if kv is not None:
                    record = decode_record(kv.value)
                    record["seq"] = kv.mod_revision
                    if key == self.keys.job(job_id):
                        self.take(record, kv.mod_revision)
                    return record
        except EtcdError as exc:
            raise unavailable(exc) from None
        except ValueError as exc:
            raise RemoteError("internal", f"job {job_id}'s record in etcd is damaged: {exc}") from None
        return None

    async def env(self, job_id: int) -> dict[str, str]:
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
        return await self._history_page(self.keys.past(after + 1), prefix_end(self.keys.history), limit)

    async def history_before(self, before: int | None, limit: int) -> list[dict]:
        """Up to ``limit`` jobs of the history with ids below ``before`` (all if None), newest first."""
        end = self.keys.past(before) if before is not None else prefix_end(self.keys.history)
        return await self._history_page(self.keys.history, end, limit, newest_first=True)

    async def _history_page(self, start: str, end: str | bytes, limit: int, newest_first: bool = False) -> list[dict]:
        try:
            page = await self.etcd.range(
                start, range_end=end, limit=limit, sort_target="KEY" if newest_first else None, sort_order="DESCEND" if newest_first else None,
            )
        except EtcdError as exc:
            raise unavailable(exc) from None
        records = []
        for kv in page.kvs:
            try:
                record = decode_record(kv.value)
            except Exception as exc:  # noqa: BLE001 -- skipped, with a log line
                log.error("ignoring unreadable history record %s: %s", kv.key.decode("utf-8", "replace"), exc)
                continue
            record["seq"] = kv.mod_revision
            records.append(record)
        return records

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
                    self._counter = (int(kv.value), kv.mod_revision) if kv is not None else (0, 0)
                last, counted_at = self._counter
                records = []
                compare = [fence.compare(), Compare.mod_revision(keys.ids) == counted_at]
                success = [Op.put(keys.ids, str(last + len(items)))]
                for offset, (build, env) in enumerate(items, 1):
                    job_id = last + offset
                    record = build(job_id)
                    record.pop("env", None)
                    records.append(record)
                    compare += [Compare.version(keys.job(job_id)) == 0, Compare.version(keys.past(job_id)) == 0]
                    success.append(Op.put(keys.job(job_id), pack(record)))
                    if env:
                        success.append(Op.put(keys.env(job_id), pack(env)))
                result = await self.etcd.txn(compare, success, [Op.get(fence.key), Op.get(keys.ids)])
            except EtcdError as exc:
                self._counter = None
                raise self._write_error(exc) from None
            if result.succeeded:
                failpoint("jobtable.created")
                self._counter = (last + len(items), result.revision)
                for record in records:
                    self.take(record, result.revision)
                return records
            self._check_fence(fence, result.responses[0])
            counter = _kvs(result.responses[1])
            now = (int(counter[0].value), counter[0].mod_revision) if counter else (0, 0)
            # The same counter and still no luck: an id's key exists (the
            # counter was reset by hand): skip past them.
            self._counter = (last + len(items), now[1]) if now == self._counter else now

    async def update(self, fence: Fence, job_id: int, change: Callable[[dict], object]) -> dict:
        """Apply ``change(record)`` to a copy of the record and commit it, fenced.

        ``change`` returning False means: nothing to do (the current record is
        returned). It may run more than once: when the record changed in etcd
        meanwhile, it is computed again from the newer one."""
        keys = self.keys
        while True:
            current = self.records.get(job_id)
            if current is None:
                current = await self.fetch(job_id)
                if current is None or job_id not in self.records:
                    raise RemoteError("no_such_job", f"no job {job_id} in the cluster's job table")
            record = copy.deepcopy(current)
            if change(record) is False:
                return current
            revision = record.pop("seq", 0)
            success = [Op.put(keys.job(job_id), pack(record))]
            if jobs.is_terminal(record):
                success.append(Op.delete(keys.env(job_id)))
            try:
                result = await self.etcd.txn(
                    [fence.compare(), Compare.mod_revision(keys.job(job_id)) == revision],
                    success,
                    [Op.get(fence.key), Op.get(keys.job(job_id))],
                )
            except EtcdError as exc:
                raise self._write_error(exc) from None
            if result.succeeded:
                failpoint("jobtable.updated")
                self.take(record, result.revision)
                return record
            self._check_fence(fence, result.responses[0])
            found = _kvs(result.responses[1])
            if not found:
                self._forget(job_id)
                raise RemoteError("no_such_job", f"job {job_id} is no longer in the hot job table")
            self._take_kv(found[0])

    async def retire(self, fence: Fence, records: list[dict]) -> int:
        """Move ended jobs to the history (one transaction per batch, each job
        only if unchanged since it was read); how many moved."""
        keys = self.keys
        moved = 0
        for batch in _batches([r for r in records if jobs.is_terminal(r)]):
            compare = [fence.compare()] + [Compare.mod_revision(keys.job(r["id"])) == r.get("seq", 0) for r, _ in batch]
            success = []
            for r, data in batch:
                success += [Op.put(keys.past(r["id"]), data), Op.delete(keys.job(r["id"])), Op.delete(keys.env(r["id"]))]
            try:
                result = await self.etcd.txn(compare, success, [Op.get(fence.key)])
            except EtcdError as exc:
                raise self._write_error(exc) from None
            if not result.succeeded:
                self._check_fence(fence, result.responses[0])
                continue  # one of them changed meanwhile: the next round sees it
            for r, _ in batch:
                if self.records.get(r["id"]) is not None and self.records[r["id"]].get("seq", 0) <= r.get("seq", 0):
                    self._forget(r["id"])
            moved += len(batch)
        if moved:
            self.notify_changed()
        return moved

    @staticmethod
    def _write_error(exc: EtcdError) -> RemoteError:
        if isinstance(exc, Unavailable):
            return unavailable(exc)
        if "too large" in exc.message:
            return RemoteError("too_large", f"etcd refused the job's record: {exc.message}")
        return RemoteError("etcd", f"etcd refused the change: {exc.message}")
