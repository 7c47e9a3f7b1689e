"""Leader side of "every node of a job reports, then every node hears all of it".

The job's leader (the node of rank 0) collects one value per node for a
round — the ranks' addresses at rendezvous (:mod:`.jobnet`), the PMI puts at
each barrier (:mod:`.pmi`) — and answers every reporter once the last node
of the job came in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import trio


class Gathers:
    def __init__(self) -> None:
        self._tables: dict[Hashable, dict[str, object]] = {}
        self._done: dict[Hashable, trio.Event] = {}

    async def gather(self, key: Hashable, node: str, value: object, nodes: Iterable[str]) -> dict[str, object]:
        """Record ``node``'s ``value`` for round ``key``; {node: value} once all ``nodes`` reported."""
        table = self._tables.setdefault(key, {})
        done = self._done.setdefault(key, trio.Event())
        table[node] = value
        if set(table) >= set(nodes):
            done.set()
        await done.wait()
        return table

    def forget(self, match: Callable[[Hashable], bool]) -> None:
        """Drop the rounds whose key matches; whoever still waits in one is answered with what came."""
        for key in [k for k in self._tables if match(k)]:
            self._tables.pop(key, None)
        for key in [k for k in self._done if match(k)]:
            self._done.pop(key).set()
