"""Durable files on the node-local disk: write to a temporary name, fsync, rename.

Blocking disk work runs in ``trio.to_thread`` so a slow disk never stalls the
daemon's event loop (heartbeats must keep flowing while a record is saved).
"""

from __future__ import annotations

import os
import stat
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


class UnsafePath(Exception):
    """A directory root would write into is not root's own."""


def check_private_dir(path: Path) -> None:
    """``path`` is a real directory (not a link) of this daemon's uid that no
    one else may write: what root writes and later reads there is its own."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafePath(f"{path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to gangd's uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise UnsafePath(f"{path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}); make it 0700")
