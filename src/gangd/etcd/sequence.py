"""Ids that are never handed out twice, from a counter key in etcd, in one txn per id.

The obvious recipe -- read the counter, then compare-and-put -- costs two round trips per id. A sequence used
mostly by one process (the coordinator) can remember the counter's value and mod_revision from its own last
write and go straight to the compare-and-put; when another writer moved the counter (a previous coordinator,
a second process), the txn's failure branch reads the counter in the same round trip and the next attempt
uses that. The id is written in the same txn as whatever it names (``ops``), so an id is used iff its
record exists. A write whose answer was lost (``Indeterminate``) forgets the cache: the id may be consumed,
and the next one is read afresh -- ids can be skipped, never repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio

from gangd.etcd.client import Bytes, Compare, Etcd, EtcdError, Op, Range, TxnResult, Unavailable

__all__ = ["Sequence"]


class Sequence:
    def __init__(self, etcd: Etcd, key: Bytes) -> None:
        self.etcd = etcd
        self.key = key
        self._known: tuple[int, int] | None = None  # (value, mod_revision) of the counter as last seen
        self._lock = trio.Lock()  # the cache is one writer's: tasks of this process take turns

    async def next(self, ops: Callable[[int], Iterable[Op]] = lambda n: (), compare: Iterable[Compare] = (),
                   max_attempts: int = 100) -> tuple[int, TxnResult]:
        """The next id ``n`` and the txn that took it, which also applied ``ops(n)`` -- if every ``compare``
        held. When one of them did not, the result's ``succeeded`` is False and no id was taken."""
        compare = list(compare)
        async with self._lock:
            for _ in range(max_attempts):
                if self._known is None:
                    kv = await self.etcd.get(self.key)
                    self._known = (int(kv.value), kv.mod_revision) if kv is not None else (0, 0)
                value, revision = self._known
                guard = Compare.version(self.key) == 0 if revision == 0 else Compare.mod_revision(self.key) == revision
                n = value + 1
                try:
                    result = await self.etcd.txn([guard, *compare], [Op.put(self.key, str(n)), *ops(n)], [Op.get(self.key)])
                except Unavailable:
                    self._known = None
                    raise
                if result.succeeded:
                    self._known = (n, result.revision)
                    return n, result
                current = result.responses[0] if result.responses else None
                if not isinstance(current, Range):
                    raise EtcdError("a sequence txn failed without reading its counter")
                now = (int(current.kvs[0].value), current.kvs[0].mod_revision) if current.kvs else (0, 0)
                if now == self._known:
                    return 0, result  # the counter was as expected: the caller's compare failed
                self._known = now
            raise EtcdError(f"the sequence {self.key!r} moved under {max_attempts} attempts in a row")
