"""MPI's name service (MPI_Publish_name / Lookup_name / Unpublish_name), run by the coordinator.

A name is for the whole cluster but for one user: job A publishes
``service -> port``, any later job of the same uid on any node looks it up;
another uid's lookup finds nothing, and it can neither overwrite nor
unpublish it (it sees its own, separate names). Hence the key
``names/<uid>/<service>`` (:class:`~.store.Keys`): the uid comes from the
publishing job's record in the coordinator's table, never from the rank.

Kept in etcd, so a name outlives a coordinator change. Bounded: service and
port lengths are PMI's (checked in :mod:`gangd.protocol.pmi` before a
request gets here), and a user holds at most :data:`NAMES_PER_USER` names.

A name belongs to the job that published it and goes when that job ends
(MPI leaves unpublishing to the program, but a scheduler that let every
crashed job's names pile up would leak them, and a later job would find a
port nobody listens on). The coordinator removes them when it sees the
job end; a name whose job ended unseen (a coordinator change in between)
counts as absent wherever it is read, and is removed then.

Publishes and unpublishes run one at a time (a lock): the count a publish
checks is the count it writes against. Every write is fenced by the
coordinator's term, as the job table's are: a deposed coordinator (whose
cache no longer knows the jobs the new one started, so their names look
stale to it) neither deletes the new term's names nor publishes past the
per-user bound beside the new coordinator's lock.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import trio

from .. import jobs
from ..etcd.client import Compare, EtcdError, KeyValue, Op, Range
from ..rpc import RemoteError
from .store import Deposed, Fence

log = logging.getLogger("gangd.names")

NAMES_PER_USER = 64


class NameService:
    def __init__(self, *, etcd, keys, table, spawn, fence: Callable[[], Fence]):
        """``spawn``: the daemon's contained tasks (a removal after a job ended runs in one);
        ``fence``: this node's term as coordinator (raises :class:`~.store.Deposed` when it has none)."""
        self.etcd = etcd
        self.fence = fence
        self.keys = keys
        self.table = table
        self.spawn = spawn
        self._lock = trio.Lock()
        self._publishers: set[int] = set()  # jobs that published, as far as this coordinator saw

    # ------------------------------------------------------------ what the ranks ask (through their node)

    async def publish(self, job_id: int, service: str, port: str) -> None:
        uid = self._owner(job_id)
        key = self.keys.name(uid, service)
        async with self._lock:
            fence = self.fence()
            found = await self._live_names(fence, uid)
            if key.encode() in found:
                raise RemoteError("name_exists", f"service {service!r} is already published")
            if len(found) >= NAMES_PER_USER:
                raise RemoteError("names_full", f"user {uid} has published {NAMES_PER_USER} service names, the most gangd keeps")
            self._publishers.add(job_id)
            value = json.dumps({"job": job_id, "port": port}).encode()
            # (absent now: a stale name of an ended job was removed by _live_names)
            if not await self._fenced(fence, [Compare.create_revision(key) == 0], [Op.put(key, value)]):
                raise RemoteError("name_exists", f"service {service!r} is already published")
        log.info("job %d (uid %d) published service %r", job_id, uid, service)

    async def lookup(self, job_id: int, service: str) -> str:
        self.fence()  # (a deposed coordinator's table no longer says which jobs run)
        uid = self._owner(job_id)
        kv = await self._etcd(self.etcd.get(self.keys.name(uid, service)))
        entry = self._live(kv) if kv is not None else None
        if entry is None:
            raise RemoteError("name_not_found", f"service {service!r} is not published")
        return entry[1]

    async def unpublish(self, job_id: int, service: str) -> None:
        uid = self._owner(job_id)
        key = self.keys.name(uid, service)
        async with self._lock:
            fence = self.fence()
            kv = await self._etcd(self.etcd.get(key))
            if kv is None or self._live(kv) is None:
                raise RemoteError("name_not_found", f"service {service!r} is not published")
            await self._delete(fence, kv)
        log.info("job %d (uid %d) unpublished service %r", job_id, uid, service)

    # ------------------------------------------------------------ a job ends

    def on_record(self, record: dict) -> None:
        """Table listener: a job that published names ended, its names go."""
        if record["id"] in self._publishers and jobs.is_terminal(record):
            self._publishers.discard(record["id"])
            self.spawn(self._drop_job, record["id"], int(record["owner_uid"]))

    async def _drop_job(self, job_id: int, uid: int) -> None:
        async with self._lock:
            try:
                fence = self.fence()
                response = await self.etcd.range(self.keys.names_of(uid), prefix=True, limit=NAMES_PER_USER * 2)
                for kv in response.kvs:
                    if self._entry(kv)[0] == job_id:
                        await self._delete(fence, kv)
            except (EtcdError, RemoteError) as exc:  # (read as absent meanwhile; the next publish of that user removes them)
                log.warning("could not remove the service names of job %d: %s", job_id, exc)

    # ------------------------------------------------------------ helpers

    def _owner(self, job_id: int) -> int:
        record = self.table.get(job_id)
        if record is None or jobs.is_terminal(record):
            raise RemoteError("no_such_job", f"job {job_id} is not running")
        return int(record["owner_uid"])

    @staticmethod
    def _entry(kv: KeyValue) -> tuple[int, str]:
        try:
            entry = json.loads(kv.value)
            return int(entry["job"]), str(entry["port"])
        except (ValueError, KeyError, TypeError):
            return -1, ""

    def _live(self, kv: KeyValue) -> tuple[int, str] | None:
        """(job, port) of a name whose job still runs; None for one an ended job left."""
        job_id, port = self._entry(kv)
        record = self.table.get(job_id)
        if record is None or jobs.is_terminal(record):
            return None
        return job_id, port

    async def _live_names(self, fence: Fence, uid: int) -> set[bytes]:
        """The keys of ``uid``'s names whose jobs still run; the others are removed."""
        response = await self._etcd(self.etcd.range(self.keys.names_of(uid), prefix=True, limit=NAMES_PER_USER * 2))
        live = set()
        for kv in response.kvs:
            if self._live(kv) is None:
                await self._delete(fence, kv)
            else:
                live.add(kv.key)
        return live

    async def _delete(self, fence: Fence, kv: KeyValue) -> None:
        """Delete a name as read (not one published again since)."""
        await self._fenced(fence, [Compare.mod_revision(kv.key) == kv.mod_revision], [Op.delete(kv.key)])

    async def _fenced(self, fence: Fence, compare: list, ops: list) -> bool:
        """Apply ``ops`` if ``compare`` holds and ``fence``'s term still does; whether they were applied.
        :class:`~.store.Deposed` when the term is over (the node asking retries with the new coordinator)."""
        result = await self._etcd(self.etcd.txn([fence.compare(), *compare], ops, [Op.get(fence.key)]))
        if result.succeeded:
            return True
        found = result.responses[0] if result.responses else None
        held = found.kvs[0] if isinstance(found, Range) and found.kvs else None
        if held is None or held.create_revision != fence.term:
            raise Deposed(f"this node's term {fence.term} as coordinator is over (etcd holds another leader)")
        return False

    @staticmethod
    async def _etcd(awaitable):
        try:
            return await awaitable
        except EtcdError as exc:
            raise RemoteError("unavailable", f"the cluster's store is unavailable: {exc}") from None
