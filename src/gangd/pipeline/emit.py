"""Packing a stage's output items into the buffers of the ring after it.

One packer per ring, run in the producing stage's own thread, so packing
costs no extra hand-off. Two policies, chosen by what the consumer needs:

* ``split=False`` (between transform stages): an item is never cut, since a
  codec must see it whole. Small items share a buffer (paper 004's
  aggregation of small writes, done where the data is produced); an item
  that does not fit the buffer's free room starts the next buffer; an item
  larger than half a buffer is passed by reference in a buffer of its own
  (packing gains nothing for it, and not copying it saves a pass over its
  bytes: the caller's array or the bytes a codec returned are queued as
  they are).
* ``split=True`` (into the writer): the aggregation step. Items are copied
  back to back and cut at buffer boundaries, so every buffer the writer
  gets is full (``aggregate_bytes``) except the last, and one write call
  moves a whole buffer. Each part's record says which part of which item it
  is; since the writer writes buffers in ring order at increasing offsets,
  an item's parts land contiguously, and its (offset, length) is where its
  first part lands.

A buffer is handed on when it is full, and the last one when the stage
ends (:meth:`Packer.flush`).
"""

from __future__ import annotations

from collections.abc import Hashable

from .ring import MAX_RECORDS, Ring, Slot
from .stats import StageStats


def as_bytes_view(data: object) -> memoryview:
    """A flat unsigned-byte view of any buffer (bytes, bytearray, a contiguous numpy array, a memoryview)."""
    view = data if isinstance(data, memoryview) else memoryview(data)  # type: ignore[arg-type]  # TypeError for a non-buffer
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # TypeError for a non-contiguous buffer: the caller must pass contiguous memory
    return view


class Packer:
    """Items in, whole buffers out, for one ring."""

    def __init__(self, ring: Ring, stats: StageStats, *, split: bool):
        self.ring, self.stats, self.split = ring, stats, split
        self._slot: Slot | None = None

    def _current(self) -> Slot:
        if self._slot is None:
            self._slot, waited = self.ring.acquire()
            self.stats.idle_out_s += waited
        return self._slot

    def _hand_on(self) -> None:
        if self._slot is not None:
            slot, self._slot = self._slot, None
            self.ring.publish(slot)

    def emit(self, key: Hashable, data: object) -> None:
        """Queue one item (copied, or by reference if it is over half a buffer of a non-splitting ring)."""
        # The hot path (once per item per stage): locals, no helper calls for the common case.
        view = data if type(data) is memoryview and data.format == "B" and data.ndim == 1 else as_bytes_view(data)
        if not view.contiguous:
            raise ValueError("pipeline items must be contiguous buffers")
        total = len(view)
        stats = self.stats
        stats.items_out += 1
        stats.bytes_out += total
        if self.split:
            self._emit_split(key, view, total)
            return
        capacity = self.ring.capacity
        slot = self._slot
        if total * 2 > capacity:
            if slot is not None and slot.records:
                self._hand_on()
            slot = self._current()
            slot.records.append((key, 0, total, 0, total, view))
            self._hand_on()
            return
        if slot is None or slot.used + total > capacity:
            self._hand_on()
            slot = self._current()
        used = slot.used
        end = used + total
        slot.data[used:end] = view
        records = slot.records
        records.append((key, used, total, 0, total, None))
        slot.used = end
        if end >= capacity or len(records) >= MAX_RECORDS:
            self._hand_on()

    def _emit_split(self, key: Hashable, view: memoryview, total: int) -> None:
        capacity = self.ring.capacity
        part = 0
        while True:
            slot = self._current()
            take = min(capacity - slot.used, total - part)
            slot.data[slot.used:slot.used + take] = view[part:part + take]
            slot.records.append((key, slot.used, take, part, total, None))
            slot.used += take
            part += take
            if slot.full:
                self._hand_on()
            if part == total:
                return

    def reserve(self, length: int) -> memoryview:
        """Room for an item of ``length`` <= capacity bytes, to be filled in place (a read) and then :meth:`commit` ted."""
        if not 0 <= length <= self.ring.capacity:
            raise ValueError(f"cannot reserve {length} bytes in a buffer of {self.ring.capacity}")
        slot = self._current()
        if slot.used + length > slot.capacity:
            self._hand_on()
            slot = self._current()
        return slot.view[slot.used:slot.used + length]

    def commit(self, key: Hashable, length: int) -> None:
        """The ``length`` bytes last reserved now hold item ``key``."""
        slot = self._current()
        slot.records.append((key, slot.used, length, 0, length, None))
        slot.used += length
        self.stats.items_out += 1
        self.stats.bytes_out += length
        if slot.full:
            self._hand_on()

    def flush(self) -> None:
        """Hand on the partly filled buffer, if any (the end of the stream)."""
        self._hand_on()
