"""This node's replica of the cluster job table, persisted on local disk.

The coordinator is the only writer: it stamps each changed record with the
next sequence number and pushes it to every node. A node applies a record only
if its ``seq`` is newer than what it holds, so repeated or reordered pushes
are harmless, and a node that was away catches up by asking for everything
newer than what it holds. Because every node holds (and fsyncs) the
whole table, a restarted daemon knows its jobs' history and any node can take
over as coordinator.

Durable first, then memory. A record reaches the in-memory table (and the
listeners, and through the coordinator every other node) only once it is on
disk: written to a temporary file, fsynced, renamed. If the write fails — the
state disk is full, typically — nothing changes: the caller gets a
``RemoteError("state_disk", ...)`` and retries later (a rank's exit report is
retried until it lands, a follower is re-sent what it could not save through
the heartbeat catch-up, see :meth:`JobTable.held_seq`). A half-applied change
(a job ended in memory but never broadcast, its cores never freed) cannot
happen.

Trust: the table lives in ``STATE_DIR/jobs``, which the daemon creates
root-owned and 0700 and checks at start-up (owner, mode, not a link). No user
can write there, so its records are trusted as the daemon's own; they are
still read without following links, size-limited and checked for shape, so a
damaged file (a crash, a bad disk) costs that record, never the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import msgpack
import trio

from .. import jobs, safefs
from ..rpc import RemoteError
from .store import UnsafePath, check_private_dir, pack

log = logging.getLogger("gangd.table")

MAX_RECORD_BYTES = 64 * 1024 * 1024  # a record holds the job's argv and env: far below this
#: Most bytes of records in one catch-up note or ``table_since`` answer (at
#: least one record goes in each): a long history travels in several, each far
#: below the wire's frame limit, so no history is too large to replicate.
BATCH_BYTES = 4 * 1024 * 1024
RECORD = "job.msgpack"


class TableError(Exception):
    """The table directory cannot be trusted or used (start-up)."""


def read_record_file(path: Path, dir_fd: int | None = None) -> dict:
    """One record file: not a link, a regular file, at most MAX_RECORD_BYTES, a
    map with an integer id and seq. Raises ValueError/OSError saying why not."""
    try:
        data = safefs.read_bounded_at(dir_fd, str(path), MAX_RECORD_BYTES, "" if dir_fd is None else "<job table>")
    except safefs.UnsafePath as exc:
        raise ValueError(str(exc)) from None
    record = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(record, dict):
        raise ValueError("not a map")
    job_id, seq = record.get("id"), record.get("seq", 0)
    if not isinstance(job_id, int) or isinstance(job_id, bool) or job_id < 1:
        raise ValueError(f"bad job id {job_id!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValueError(f"bad sequence number {seq!r}")
    if record.get("state") not in jobs.ACTIVE_STATES + jobs.TERMINAL_STATES:
        raise ValueError(f"unknown state {record.get('state')!r}")
    return record


class JobTable:
    def __init__(self, state_dir: Path):
        self.dir = state_dir / "jobs"
        self.records: dict[int, dict] = {}
        self.seq = 0
        #: The seq through which this replica is known complete: every record
        #: stamped up to it that still exists is here. ``seq`` itself may be
        #: ahead (a newer record pushed while a catch-up is under way); the
        #: heartbeat reports this one, so the catch-up never skips a record.
        self.synced = 0
        self._failing: set[int] = set()  # jobs whose last save failed (for the log)
        self._unsaved: dict[int, int] = {}  # job id -> lowest seq pushed to us that we failed to save
        self._changed = trio.Event()
        self._save_lock = trio.Lock()
        self.listeners: list = []  # called with each record that changed

    def job_dir(self, job_id: int) -> Path:
        return self.dir / str(job_id)

    def load(self) -> None:
        """Read every record from disk (at start-up, before the event loop is busy)."""
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise TableError(f"cannot create the job table directory {self.dir}: {exc.strerror}") from None
        try:
            check_private_dir(self.dir.parent)
            check_private_dir(self.dir)
        except UnsafePath as exc:
            raise TableError(f"refusing the job table: {exc}") from None
        for name in os.listdir(self.dir):
            if not name.isdigit():
                continue  # temporary files of an interrupted write, or foreign names
            path = self.dir / name / RECORD
            try:
                record = read_record_file(path)
                if record["id"] != int(name):
                    raise ValueError(f"holds job {record['id']}, not job {name}")
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001 -- one damaged record is skipped, never the daemon's start
                log.error("ignoring unreadable job record %s: %s", path, exc)
                continue
            if jobs.is_terminal(record) and any(k in record for k in jobs.PRIVATE_FIELDS):
                self._save_sync(record["id"], pack(jobs.at_rest(record)))  # (kept by an older gangd)
            self.records[record["id"]] = record
            self.seq = max(self.seq, record.get("seq", 0))
        self.synced = self.seq

    def get(self, job_id: int) -> dict | None:
        return self.records.get(job_id)

    def next_job_id(self) -> int:
        return max(self.records, default=0) + 1

    def since(self, seq: int) -> list[dict]:
        return sorted((r for r in self.records.values() if r.get("seq", 0) > seq), key=lambda r: r["seq"])

    def batch_since(self, seq: int, max_bytes: int = BATCH_BYTES) -> tuple[list[dict], int]:
        """The records newer than ``seq``, oldest first, as many as fit in
        ``max_bytes`` packed (at least one), and the seq the batch covers
        through: every record stamped in (``seq``, through] is in it."""
        batch: list[dict] = []
        size = 0
        for record in self.since(seq):
            length = len(pack(record))
            if batch and size + length > max_bytes:
                return batch, batch[-1]["seq"]
            batch.append(record)
            size += length
        return batch, self.seq

    def caught_up(self, since: int, through: int) -> None:
        """Every record stamped in (``since``, ``through``] was applied (a
        catch-up batch): if that starts where this replica is complete, it is
        complete through ``through`` now."""
        if since <= self.synced < through:
            self.synced = through

    def mark_complete(self) -> None:
        """This replica is the whole table (the coordinator, after its takeover merged every node's)."""
        self.synced = self.seq

    def _advance(self, seq: int) -> None:
        if seq == self.synced + 1:  # the next one in line: pushes arrive in order
            self.synced = seq

    def active(self) -> list[dict]:
        return [r for r in self.records.values() if r["state"] in jobs.ACTIVE_STATES]

    def held_seq(self) -> int:
        """The sequence number up to which this replica holds everything it
        was sent: what heartbeats report, so the coordinator re-sends a record
        this node could not save (its disk was full) until it can."""
        if not self._unsaved:
            return self.synced
        return min(self.synced, min(self._unsaved.values()) - 1)

    async def apply(self, record: dict) -> bool:
        """Store ``record`` if it is newer than ours; True if it changed anything.

        On disk first: if the write fails, nothing changes and RemoteError
        ``state_disk`` is raised. An ended job's environment is kept nowhere."""
        jobs.at_rest(record)
        async with self._save_lock:
            current = self.records.get(record["id"])
            if current is not None and current.get("seq", 0) >= record.get("seq", 0):
                self._advance(record.get("seq", 0))
                return False
            await self._save(record, pushed=True)
            self._take(record)
            self._advance(record.get("seq", 0))
        return True

    async def commit(self, record: dict) -> dict:
        """Coordinator only: stamp ``record`` with the next sequence number and store it.

        The number is taken only once the record is on disk: a failed write
        (RemoteError ``state_disk``) leaves the table exactly as it was."""
        jobs.at_rest(record)
        async with self._save_lock:
            record["seq"] = self.seq + 1
            await self._save(record)
            self._take(record)
            self._advance(record["seq"])
        return record

    async def _save(self, record: dict, pushed: bool = False) -> None:
        try:
            await trio.to_thread.run_sync(self._save_sync, record["id"], pack(record))
        except OSError as exc:
            if pushed:  # the coordinator has it: ask for it again (see held_seq)
                seq = record.get("seq", 0)
                self._unsaved[record["id"]] = min(self._unsaved.get(record["id"], seq), seq)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            # Said once per job until a save of it works again (the callers retry often).
            level = logging.DEBUG if record["id"] in self._failing else logging.ERROR
            self._failing.add(record["id"])
            log.log(level, "cannot save job %d (seq %d) in %s: %s", record["id"], record.get("seq", 0), self.dir, exc.strerror or exc)
            raise RemoteError(
                "state_disk",
                f"gangd could not save job {record['id']}'s record in {self.dir}"
                + (": the state disk is full" if full else f": {exc.strerror or exc}")
                + "; nothing was changed, the change is retried",
            ) from None

    def _save_sync(self, job_id: int, data: bytes) -> None:
        """Write ``data`` as job ``job_id``'s record: temp file, fsync, rename, fsync the directory."""
        try:
            os.mkdir(self.dir, 0o700)  # (made by load() in the daemon)
        except FileExistsError:
            pass
        base = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                os.mkdir(str(job_id), 0o700, dir_fd=base)
            except FileExistsError:
                pass
            job_fd = os.open(str(job_id), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
        finally:
            os.close(base)
        try:
            tmp = f".{RECORD}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=job_fd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, RECORD, src_dir_fd=job_fd, dst_dir_fd=job_fd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=job_fd)  # give the space back
                except OSError:
                    pass
                raise
            os.fsync(job_fd)  # make the rename itself durable
        finally:
            os.close(job_fd)

    def _take(self, record: dict) -> None:
        """The record is on disk: now the memory, then whoever listens."""
        self.records[record["id"]] = record
        if record["id"] in self._failing:
            self._failing.discard(record["id"])
            log.info("job %d saved again", record["id"])
        self.seq = max(self.seq, record.get("seq", 0))
        unsaved = self._unsaved.get(record["id"])
        if unsaved is not None and record.get("seq", 0) >= unsaved:
            del self._unsaved[record["id"]]
        self.notify_changed()
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("table listener failed for job %d", record["id"])

    def notify_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def change_event(self) -> trio.Event:
        """Set at the next change. Take it *before* reading the table when
        something awaited in between could miss that change."""
        return self._changed
