"""Per-rank output, kept on the node-local disk and followed live.

Each rank's stdout and stderr land in one file as records
``<stream:1 byte><length:4 bytes><data>`` so the interleaving of the two
streams is kept and ``gang logs`` can replay either. Followers read the file
from an offset and wait for it to grow; the file is the single source of
truth, so a follower that attaches late (or after a daemon restart) sees
exactly what a live one saw.

Appends are small writes into the page cache (never fsynced: output is not
worth a disk flush per line), done inline; reads go through
``trio.to_thread``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import trio

STDOUT = 1
STDERR = 2
_HEADER = struct.Struct(">BI")
READ_CHUNK = 256 * 1024


class OutputLog:
    def __init__(self, path: Path, owner: tuple[int, int] | None = None):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if owner is not None and os.geteuid() == 0:
            os.fchown(self._fd, *owner)
        self.size = os.fstat(self._fd).st_size
        self.closed = False
        self._grew = trio.Event()

    def append(self, stream: int, data: bytes) -> None:
        record = _HEADER.pack(stream, len(data)) + data
        os.write(self._fd, record)
        self.size += len(record)
        self._wake()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)
            self._wake()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = trio.Event()

    async def follow(self, follow: bool = True):
        """Yield ``(stream, data)`` from the start; with ``follow``, until the log is closed."""
        offset = 0
        while True:
            end, closed = self.size, self.closed
            if offset < end:
                async for item in read_records(self.path, start=offset, end=end):
                    yield item
                offset = end
                continue
            if not follow or closed:
                return
            # No checkpoint between the size check and this wait, so no append can slip in.
            await self._grew.wait()


async def read_records(path: Path, start: int = 0, end: int | None = None):
    """Yield ``(stream, data)`` records of a log file between byte offsets (record boundaries)."""
    offset = start
    pending = b""
    while end is None or offset < end:
        want = READ_CHUNK if end is None else min(READ_CHUNK, end - offset)
        chunk = await trio.to_thread.run_sync(_pread, path, offset, want)
        if not chunk:
            break
        offset += len(chunk)
        pending += chunk
        pos = 0  # parse in place; one slice per chunk, not one per record
        while len(pending) - pos >= _HEADER.size:
            stream, length = _HEADER.unpack_from(pending, pos)
            start = pos + _HEADER.size
            if len(pending) < start + length:
                break
            yield stream, pending[start:start + length]
            pos = start + length
        pending = pending[pos:]


def _pread(path: Path, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(size)
    except FileNotFoundError:
        return b""
