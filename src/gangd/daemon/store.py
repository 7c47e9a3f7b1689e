"""Durable files on the node-local disk: write to a temporary name, fsync, rename.

Blocking disk work runs in ``trio.to_thread`` so a slow disk never stalls the
daemon's event loop (heartbeats must keep flowing while a record is saved).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import trio


def write_atomic_sync(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


async def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    await trio.to_thread.run_sync(write_atomic_sync, path, data, mode)


def read_msgpack(path: Path) -> Any:
    with open(path, "rb") as fh:
        return msgpack.unpackb(fh.read(), raw=False, strict_map_key=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)
