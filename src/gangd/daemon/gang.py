"""The Ousterhout matrix: which jobs share the cluster, and in which time slot.

Rows are time slots, columns are nodes; a cell holds the cores a slot's jobs
use on a node. Jobs whose ranks fit side by side share a slot and run
together; jobs that overlap on some node go to different slots, and the
coordinator rotates through the slots one time slice each. At most
``max_slots`` slots exist (the multiprogramming degree); a job that fits in
no slot and would need one more waits in the queue.

Pure bookkeeping, no I/O: the coordinator owns one :class:`Matrix`, rebuilds
it from the job table after a takeover, and does the switching.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

Placer = Callable[[dict, dict[str, int]], "list[str] | None"]


class Matrix:
    def __init__(self, cores: dict[str, int], max_slots: int):
        self.cores = dict(cores)
        self.max_slots = max(1, max_slots)
        self.slots: list[list[int]] = []  # job ids per slot, in admission order
        self.usage: dict[int, Counter] = {}  # job id -> ranks per node
        self.active = 0  # index of the slot running now
        #: Jobs a compaction leaves where they are: spawning jobs and their
        #: spawned children, which must share a slot (see gangd.daemon.spawns).
        self.tied: set[int] = set()

    # ------------------------------------------------------------ queries

    def slot_of(self, job_id: int) -> int | None:
        for index, members in enumerate(self.slots):
            if job_id in members:
                return index
        return None

    def free(self, slot: int, up: set[str] | None = None) -> dict[str, int]:
        """Cores of each node not used by the jobs of ``slot`` (only ``up`` nodes)."""
        free = {node: cores for node, cores in self.cores.items() if up is None or node in up}
        if slot < len(self.slots):
            for job_id in self.slots[slot]:
                for node, count in self.usage[job_id].items():
                    if node in free:
                        free[node] -= count
        return free

    def fits(self, job_id: int, slot: int) -> bool:
        free = self.free(slot)
        return all(free.get(node, 0) >= count for node, count in self.usage[job_id].items())

    def table(self) -> list[dict[str, list[int]]]:
        """Per slot, per node: the jobs using it (what `gang nodes` draws)."""
        rows = []
        for members in self.slots:
            row: dict[str, list[int]] = {node: [] for node in self.cores}
            for job_id in members:
                for node in self.usage[job_id]:
                    row.setdefault(node, []).append(job_id)
            rows.append(row)
        return rows

    # ------------------------------------------------------------ changes

    def admit(self, record: dict, place: Placer, up: set[str]) -> tuple[int, list[str]] | None:
        """Find a slot for ``record``: an existing one where it fits beside
        the others, else a new one if the degree allows. Returns (slot,
        placement) and records it, or None if the job must wait."""
        for slot in range(len(self.slots) + (len(self.slots) < self.max_slots)):
            placement = place(record, {n: c for n, c in self.free(slot, up).items() if c > 0})
            if placement is not None:
                self.add(record["id"], slot, placement)
                return slot, placement
        return None

    def add(self, job_id: int, slot: int, placement: list[str]) -> None:
        while len(self.slots) <= slot:
            self.slots.append([])
        self.slots[slot].append(job_id)
        self.usage[job_id] = Counter(placement)

    def remove(self, job_id: int) -> dict[int, int]:
        """Take a job out and compact. Returns {job id: new slot} for every
        job that moved, so the caller can record it."""
        index = self.slot_of(job_id)
        if index is None:
            return {}
        self.slots[index].remove(job_id)
        del self.usage[job_id]
        self.tied.discard(job_id)
        return self.compact()

    def compact(self) -> dict[int, int]:
        """Pull jobs into earlier slots where they now fit, then drop empty
        slots — fewer slots means each job gets a larger share of time."""
        moved: dict[int, int] = {}
        running = set(self.slots[self.active]) if self.active < len(self.slots) else set()
        # Each slot's free cores, counted once and kept as jobs move (a job's end compacts: it must stay cheap).
        frees = [self.free(slot) for slot in range(len(self.slots))]
        for source in range(1, len(self.slots)):
            for job_id in list(self.slots[source]):
                if job_id in self.tied:
                    continue
                usage = self.usage[job_id]
                for target in range(source):
                    if all(frees[target].get(node, 0) >= count for node, count in usage.items()):
                        self.slots[source].remove(job_id)
                        self.slots[target].append(job_id)
                        for node, count in usage.items():
                            frees[target][node] = frees[target].get(node, 0) - count
                            frees[source][node] = frees[source].get(node, 0) + count
                        moved[job_id] = target
                        break
        kept = [members for members in self.slots if members]
        # Keep the active slot on the jobs that were running (wherever they
        # moved), so a compaction does not cut their time slice short.
        self.active = next((i for i, members in enumerate(kept) if running & set(members)), 0)
        renumber = {id(members): i for i, members in enumerate(kept)}
        for old, members in enumerate(self.slots):
            if members and renumber[id(members)] != old:
                for job_id in members:
                    moved[job_id] = renumber[id(members)]
        self.slots = kept
        return moved
