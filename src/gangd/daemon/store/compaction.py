"""Compacting etcd's history of revisions, so what etcd holds does not grow with the cluster's past.

etcd keeps every revision of every key until it is told to forget them (a
compaction): each job's record is rewritten several times in its life, its
environment and hot key are deleted when it moves to the history, and all of
those old values and tombstones stay in etcd's index and database for ever
without one -- a long-lived cluster's etcd would grow with every job ever run
(range reads over the hot table walking the tombstones of every job that
left it), and reach its space quota, past which it refuses every write.

Kubernetes' API server does the same: one compactor (here the coordinator,
while its term lasts), every ``interval`` seconds, compacts up to the
revision it saw one interval earlier. A watcher (a node's job table, the
election's observer) that falls more than an interval behind is told its
revision was compacted and reads the state anew (they all do: see
:meth:`.jobtable.JobTable.follow`). ``interval`` 0: never (a site's etcd
with its own ``--auto-compaction-*``).
"""

from __future__ import annotations

import logging

import trio

from ...etcd.client import Etcd, EtcdError

log = logging.getLogger("gangd.jobtable")


class Compactor:
    def __init__(self, etcd: Etcd, key: str, interval: float):
        """``key``: any key to read etcd's current revision with (its answer's header)."""
        self.etcd = etcd
        self.key = key
        self.interval = interval
        self.compacted = 0  # the last revision compacted to

    async def run(self) -> None:
        """Compact every interval, for ever (cancelled with the term)."""
        if self.interval <= 0:
            return
        seen = 0  # etcd's revision one interval ago
        while True:
            await trio.sleep(self.interval)
            seen = await self.step(seen)

    async def step(self, seen: int) -> int:
        """Compact to ``seen`` (a revision read one interval ago) if that is
        news; the current revision, to compact to next time."""
        try:
            now = (await self.etcd.range(self.key, count_only=True)).revision
            if self.compacted < seen < now:
                await self.etcd.compact(seen, physical=False)
                self.compacted = seen
                log.debug("compacted etcd's history to revision %d", seen)
        except EtcdError as exc:
            if "compacted" in exc.message:  # another compactor (the site's, an earlier term) went further
                self.compacted = max(self.compacted, seen)
            else:  # etcd away or busy for a moment: the next interval tries again
                log.warning("could not compact etcd's history: %s", exc.message)
            return seen
        return now
