"""A ring of preallocated buffers between two stages: the pipeline's only queue, and its bound.

Paper 004's ring buffer queue: a fixed pool of equal buffers, each Empty
(free), Busy (a stage is filling or draining it) or Ready (filled, waiting
for the next stage). The producer takes Empty buffers in the order they
were freed and publishes them in the order it filled them; the consumer
drains them in that same order, so it sees items exactly in the order they
were produced, with no sequence numbers and no reordering. When every
buffer is Busy or Ready the producer waits: memory in flight between two
stages is at most ``count`` buffers, whatever the speeds of the stages
(back-pressure). Buffers are allocated once, when the pipeline starts
(anonymous memory, whose pages cost nothing until filled), and reused; a
drained buffer's records are cleared in place.

A parallel stage (several worker threads, :mod:`.engine`) drains its ring
from several threads: :meth:`take` is then called under the stage's take
lock (which also numbers the buffers, so the workers can hand on in order)
and buffers go back with :meth:`release_now`, which shares no list between
threads.

A buffer carries the items packed into it as records (key, where
in the buffer, how long, and which part of the item if the item was split
across buffers). An item over half a buffer, in a ring that must not split
items, travels *by reference*: the record holds a view of the bytes
(the caller's array, or the bytes a codec returned) in a buffer of its own,
so it is never copied just to be queued and still counts as one buffer in
flight.

:meth:`Ring.abort` wakes every waiter with :class:`Aborted`: that is how a
failure in one stage stops the others at their next hand-off.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Hashable
from enum import Enum
from queue import Empty, SimpleQueue

MAX_RECORDS = 4096  # items per buffer: a stream of empty items must not grow a record list without bound


class State(Enum):
    EMPTY = "empty"
    BUSY = "busy"
    READY = "ready"


class Aborted(Exception):
    """The pipeline is being torn down; the stage that sees this stops without reporting an error."""


#: One item (or one part of an item) in a buffer: (key, start in the buffer, length, offset of this part
#: in the item, the item's whole length, the view it is held by if by reference, else None). A plain tuple:
#: one is made per item per stage, and a class with __init__ costs 5x as much to build (0.67 vs 0.12 us).
Record = tuple[Hashable, int, int, int, int, "memoryview | None"]


class Slot:
    """One preallocated buffer of a ring, with the records of what it holds."""

    __slots__ = ("capacity", "data", "index", "records", "state", "used", "view")

    def __init__(self, index: int, capacity: int):
        self.index, self.capacity = index, capacity
        # Anonymous memory: the kernel hands out zero pages on first touch, so a buffer costs nothing
        # until it is used (a bytearray is zeroed up front, a pass over every page of every buffer).
        self.data = mmap.mmap(-1, capacity)
        self.view = memoryview(self.data)
        self.used = 0
        self.records: list[Record] = []
        self.state = State.EMPTY

    def item(self, record: Record) -> memoryview:
        """The bytes of ``record``: a slice of this buffer, or the view it holds by reference."""
        _, start, length, _, _, ref = record
        return ref if ref is not None else self.view[start:start + length]

    @property
    def full(self) -> bool:
        return self.used >= self.capacity or len(self.records) >= MAX_RECORDS

    def clear(self) -> None:
        self.used = 0
        self.records.clear()  # drops views held by reference: the caller's memory is not kept alive by the pool


class Ring:
    """``count`` buffers of ``capacity`` bytes between one producer thread and one consumer thread.

    The hand-offs are two FIFO queues of buffers, ``free`` (Empty) and
    ``ready`` (Ready): :class:`queue.SimpleQueue`, written in C, so a
    hand-off takes no Python-level lock and abort is one sentinel per
    queue. Only ``count`` buffers exist, so neither queue can hold more
    (plus the sentinel).
    """

    def __init__(self, name: str, count: int, capacity: int):
        self.name, self.capacity = name, capacity
        self.slots = [Slot(i, capacity) for i in range(count)]
        self._free: SimpleQueue[Slot | None] = SimpleQueue()
        self._ready: SimpleQueue[Slot | None] = SimpleQueue()
        for slot in self.slots:
            self._free.put(slot)
        # Drained buffers go back to the producer in batches of half the ring (the consumer's own list):
        # a producer held by back-pressure is then woken once per batch, not once per buffer.
        self._freed: list[Slot] = []
        self._batch = max(1, count // 2)
        self._aborted = False
        self.producer_waiting = False
        self.peak = 0  # most buffers ever not Empty at once

    @property
    def in_use(self) -> int:
        """Buffers not Empty (exact when no thread is using the ring)."""
        return sum(slot.state is not State.EMPTY for slot in self.slots)

    @staticmethod
    def _get(queue: SimpleQueue[Slot | None]) -> tuple[Slot | None, float]:
        try:
            return queue.get_nowait(), 0.0
        except Empty:
            began = time.perf_counter()
            item = queue.get()
            return item, time.perf_counter() - began

    def acquire(self) -> tuple[Slot, float]:
        """The next Empty buffer, now Busy for the producer; with the seconds spent waiting for it."""
        try:
            slot, waited = self._free.get_nowait(), 0.0
        except Empty:
            self.producer_waiting = True  # held by back-pressure (a statistic, and what tests wait for)
            slot, waited = self._get(self._free)
            self.producer_waiting = False
        if slot is None or self._aborted:
            self._free.put(None)  # the next waiter (if any) is woken too
            raise Aborted
        slot.state = State.BUSY
        self.peak = max(self.peak, self.in_use)
        return slot, waited

    def publish(self, slot: Slot) -> None:
        """The producer is done with ``slot``: Busy -> Ready."""
        slot.state = State.READY
        self._ready.put(slot)

    def take(self) -> tuple[Slot | None, float]:
        """The next Ready buffer in order, now Busy for the consumer (None once the producer closed the ring and all were taken)."""
        try:
            slot, waited = self._ready.get_nowait(), 0.0
        except Empty:
            self._give_back()  # never sleep on freed buffers: the producer may be waiting for one
            slot, waited = self._get(self._ready)
        if self._aborted:
            self._ready.put(None)
            raise Aborted
        if slot is None:  # closed: every buffer published before the close was taken before this
            self._ready.put(None)
            return None, waited
        slot.state = State.BUSY
        return slot, waited

    def release(self, slot: Slot) -> None:
        """The consumer is done with ``slot``: Busy -> Empty, its records cleared."""
        slot.clear()
        slot.state = State.EMPTY
        self._freed.append(slot)
        if len(self._freed) >= self._batch:
            self._give_back()

    def release_now(self, slot: Slot) -> None:
        """:meth:`release` for a ring drained by several threads (a parallel stage's workers): no batch, so no
        list shared between threads; one hand-off per buffer, each through the C queue (thread-safe)."""
        slot.clear()
        slot.state = State.EMPTY
        self._free.put(slot)

    def _give_back(self) -> None:
        for slot in self._freed:
            self._free.put(slot)
        self._freed.clear()

    def close(self) -> None:
        """The producer will publish nothing more."""
        self._ready.put(None)

    def abort(self) -> None:
        """Wake both sides with :class:`Aborted` (from any thread)."""
        self._aborted = True
        self._free.put(None)
        self._ready.put(None)

    def reclaim(self) -> None:
        """Every buffer back to Empty, after every thread using the ring has ended (teardown)."""
        self._free, self._ready = SimpleQueue(), SimpleQueue()
        self._freed.clear()
        for slot in self.slots:
            slot.clear()
            slot.state = State.EMPTY
            self._free.put(slot)

    def states(self) -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in State), 0)
        for slot in self.slots:
            counts[slot.state.value] += 1
        return counts
