"""What the job table keeps on the node-local disk is msgpack (:func:`pack`)
in a directory only root may change (:func:`check_private_dir`): records
root later reads back must be root's own. The table itself writes each
record durably, through directory fds (:meth:`gangd.daemon.table.JobTable._save_sync`).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import msgpack

from ..safefs import UnsafePath, check_dir

__all__ = ["UnsafePath", "check_private_dir", "pack"]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def check_private_dir(path: Path) -> None:
    """``path`` is a real directory (not a link) of root's that no one else
    may write: what root writes and later reads there is its own. The
    directories above it are checked at start-up (:func:`safefs.open_trusted_dir`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafePath(f"{path} is a symbolic link" if exc.errno == errno.ELOOP else f"{path}: {exc.strerror}") from None
    try:
        check_dir(os.fstat(fd), path)
    finally:
        os.close(fd)
