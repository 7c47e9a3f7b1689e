"""Leader election on etcd: the recipe of etcd's client/v3/concurrency, over gangd's trio client.

Each campaigner creates ``<prefix>/<lease id hex>`` (in a txn, only if absent) attached to its lease; the
leader is the key with the lowest create_revision, and a campaigner waits for the deletion of the key created
just before its own -- no herd, and the order is etcd's. Leadership ends for everyone at once when the key is
deleted: by ``resign``, or by etcd when the lease runs out (a crashed or stalled leader). The leader's *term*
is its key's create_revision: a later leader's key was necessarily created later, so its term is strictly
higher, and a node that remembers the highest term it saw can refuse a deposed leader's commands.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import trio

from gangd.etcd.client import Compacted, Compare, Etcd, EtcdError, Op, Range, Unavailable
from gangd.etcd.lease import Lease

__all__ = ["Election", "Leadership", "LeaseLost"]


class LeaseLost(EtcdError):
    """The campaign's lease ran out before (or while) it became leader."""


@dataclass(frozen=True, slots=True)
class Leadership:
    key: bytes
    term: int  # the create_revision of ``key``
    lease_id: int


class Election:
    def __init__(self, etcd: Etcd, prefix: str, *, progress_timeout: float | None = None) -> None:
        self.etcd = etcd
        self.prefix = prefix.rstrip("/") + "/"
        self.progress_timeout = progress_timeout  # for its watches: see Etcd.watch

    async def campaign(self, lease: Lease, value: bytes) -> Leadership:
        """Block until this lease's key is the oldest under the prefix: then this process leads. Cancelling it (or the
        lease being lost) withdraws the candidacy."""
        key = f"{self.prefix}{lease.id:x}".encode()
        result = await self.etcd.txn([Compare.create_revision(key) == 0], [Op.put(key, value, lease.id)], [Op.get(key)])
        if result.succeeded:
            term = result.revision
        else:
            got = result.responses[0]
            if not isinstance(got, Range) or not got.kvs:
                raise EtcdError(f"the election key {key!r} vanished while campaigning")
            term = got.kvs[0].create_revision
            if got.kvs[0].value != value:
                await self.etcd.put(key, value, lease=lease.id)
        leadership = Leadership(key, term, lease.id)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._lose_with, lease, nursery.cancel_scope)
                await self._wait_predecessors(term)
                nursery.cancel_scope.cancel()
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(2), contextlib.suppress(EtcdError):
                await self.resign(leadership)
            raise
        if lease.lost.is_set():
            raise LeaseLost(f"the lease {lease.id:x} ran out while campaigning")
        return leadership

    async def _lose_with(self, lease: Lease, scope: trio.CancelScope) -> None:
        await lease.lost.wait()
        scope.cancel()

    async def _wait_predecessors(self, term: int) -> None:
        """Until no key under the prefix is older than ours."""
        while True:
            older = await self.etcd.range(self.prefix, prefix=True, max_create_revision=term - 1, sort_target="CREATE",
                                          sort_order="DESCEND", limit=1)
            if not older.kvs:
                return
            predecessor = older.kvs[0].key
            with contextlib.suppress(Compacted):  # (a quiet watch resumed past a compaction: look again)
                async with self.etcd.watch(predecessor, start_revision=older.revision + 1, progress_timeout=self.progress_timeout) as w:
                    async for batch in w:
                        if any(e.type == "DELETE" for e in batch):
                            break

    async def resign(self, leadership: Leadership) -> None:
        """Give up leadership (or the candidacy): delete the key if it is still ours."""
        await self.etcd.txn([Compare.create_revision(leadership.key) == leadership.term], [Op.delete(leadership.key)])

    async def wait_deposed(self, leadership: Leadership) -> None:
        """Return when ``leadership``'s key is gone (resigned, deleted, or its lease expired on etcd). A leader
        races this with its ``Lease.lost``, which fires earlier on a stalled holder."""
        while True:
            r = await self.etcd.range(leadership.key)
            if not r.kvs or r.kvs[0].create_revision != leadership.term:
                return
            with contextlib.suppress(Compacted):  # (a quiet watch resumed past a compaction: look again)
                async with self.etcd.watch(leadership.key, start_revision=r.revision + 1, progress_timeout=self.progress_timeout) as w:
                    async for batch in w:
                        if any(e.type == "DELETE" for e in batch):
                            return

    async def leader(self) -> tuple[bytes, int] | None:
        """The current leader's value and term, or None."""
        r = await self.etcd.range(self.prefix, prefix=True, sort_target="CREATE", sort_order="ASCEND", limit=1)
        return (r.kvs[0].value, r.kvs[0].create_revision) if r.kvs else None

    async def _leader_at(self) -> tuple[tuple[bytes, int] | None, int]:
        r = await self.etcd.range(self.prefix, prefix=True, sort_target="CREATE", sort_order="ASCEND", limit=1)
        return ((r.kvs[0].value, r.kvs[0].create_revision) if r.kvs else None), r.revision

    async def observe(self) -> AsyncGenerator[tuple[bytes, int] | None, None]:
        """The current leader (value, term) or None, then again each time it changes (a new leader, or none, or
        the same leader's new value). Use as ``async with contextlib.aclosing(election.observe()) as it:``."""
        current, revision = await self._leader_at()
        yield current
        while True:
            try:
                async with self.etcd.watch(self.prefix, prefix=True, start_revision=revision + 1,
                                           progress_timeout=self.progress_timeout) as w:
                    async for _batch in w:
                        now, revision = await self._leader_at()
                        if now != current:
                            current = now
                            yield current
            except Compacted:
                # Changes were compacted away before the watch could see them: look again from now.
                now, revision = await self._leader_at()
                if now != current:
                    current = now
                    yield current
            except Unavailable:
                await trio.sleep(0.5)
