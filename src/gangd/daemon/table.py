"""This node's replica of the cluster job table, persisted on local disk.

The coordinator is the only writer: it stamps each changed record with the
next sequence number and pushes it to every node. A node applies a record only
if its ``seq`` is newer than what it holds, so repeated or reordered pushes
are harmless, and a node that was away catches up by asking for everything
newer than its highest ``seq``. Because every node holds (and fsyncs) the
whole table, a restarted daemon knows its jobs' history and any node can take
over as coordinator.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from .. import jobs
from .store import pack, read_msgpack, write_atomic, write_atomic_sync

log = logging.getLogger("gangd.table")


class JobTable:
    def __init__(self, state_dir: Path):
        self.dir = state_dir / "jobs"
        self.records: dict[int, dict] = {}
        self.seq = 0
        self._changed = trio.Event()
        self._save_lock = trio.Lock()
        self.listeners: list = []  # called with each record that changed

    def job_dir(self, job_id: int) -> Path:
        return self.dir / str(job_id)

    def load(self) -> None:
        """Read every record from disk (at start-up, before the event loop is busy)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.glob("*/job.msgpack"):
            try:
                record = read_msgpack(path)
                job_id, seq = record["id"], record.get("seq", 0)
                if not isinstance(job_id, int) or not isinstance(seq, int):
                    raise ValueError("id or seq is not an integer")
            except Exception as exc:
                log.error("ignoring unreadable job record %s: %s", path, exc)
                continue
            if jobs.is_terminal(record) and any(k in record for k in jobs.PRIVATE_FIELDS):
                write_atomic_sync(path, pack(jobs.at_rest(record)))  # (kept by an older gangd)
            self.records[job_id] = record
            self.seq = max(self.seq, seq)

    def get(self, job_id: int) -> dict | None:
        return self.records.get(job_id)

    def next_job_id(self) -> int:
        return max(self.records, default=0) + 1

    def since(self, seq: int) -> list[dict]:
        return sorted((r for r in self.records.values() if r.get("seq", 0) > seq), key=lambda r: r["seq"])

    def active(self) -> list[dict]:
        return [r for r in self.records.values() if r["state"] in jobs.ACTIVE_STATES]

    async def apply(self, record: dict) -> bool:
        """Store ``record`` if it is newer than ours; True if it changed anything."""
        jobs.at_rest(record)  # an ended job's environment is kept nowhere
        current = self.records.get(record["id"])
        if current is not None and current.get("seq", 0) >= record.get("seq", 0):
            return False
        self.records[record["id"]] = record
        self.seq = max(self.seq, record.get("seq", 0))
        self.notify_changed()
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("table listener failed for job %d", record["id"])
        job_dir = self.job_dir(record["id"])
        async with self._save_lock:
            await trio.to_thread.run_sync(lambda: job_dir.mkdir(parents=True, exist_ok=True))
            await write_atomic(job_dir / "job.msgpack", pack(record))
        return True

    async def commit(self, record: dict) -> dict:
        """Coordinator only: stamp ``record`` with the next sequence number and store it."""
        self.seq += 1
        record["seq"] = self.seq
        await self.apply(record)
        return record

    def notify_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def change_event(self) -> trio.Event:
        """Set at the next change. Take it *before* reading the table when
        something awaited in between could miss that change."""
        return self._changed
