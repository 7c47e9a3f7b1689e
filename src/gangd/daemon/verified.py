"""What this node knows to be unchanged since a checkpoint's files were last
checked: the restart's verification without reading every byte again.

Before a restart the coordinator has every node verify its files of the
generation against the manifest (:meth:`NodeCheckpoints.verify`), so that a
damaged generation is skipped for an older one before any rank starts. That
read is whole-file: 64 MiB per rank of the ring workload, on the restart's
critical path (issue 16's profile: nearly all of the coordinator's share of a
restart), and the ranks read and check the same bytes again as they restore
them (``ckptlib``: every file against the manifest's size and checksum, each
block against its signature).

So the node remembers, per file, the identity and times the file had when
it was last known to match the manifest (``fstat``: device, inode, size,
mtime and ctime, with the manifest's checksum): at commit (the rank wrote and
fsynced it, reporting that checksum, and the node checked its size), and after
each whole-file check that found it intact. A later verification that finds
the same identity and times skips the read; anything that changed the file
through the file system — a write, a truncation, a replacement, a
``touch`` — changes its ctime, which no user can set back, and the file is
read whole as before (so such damage is still found before the restart and
an older generation used). What the stamp cannot see is damage below the
file system (a bad sector) or a write in the same clock tick as the stamp;
the ranks' own checks find that as they restore, the restarted job fails
naming the file, and the coordinator marks the generation damaged after a
whole-file check (``full``), so the next ``gang restart`` starts from an
older one (:meth:`Restarts.on_restored`).

Kept in memory only (a daemon that restarts reads everything once again) and
bounded (:data:`MAX_FILES`, oldest forgotten first).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from .. import ckptstore

MAX_FILES = 4096

Stamp = tuple[int, int, int, int, int]


def stamp(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stats_at(dir_fd: int, directory: Path, names: list[str]) -> dict[str, os.stat_result]:
    """``fstat`` of each of a generation's files that can be opened (as the
    verification opens them: no links followed); the others are left out."""
    found = {}
    for name in names:
        try:
            fd = ckptstore.open_in(dir_fd, name, directory)
        except OSError:
            continue
        try:
            found[name] = os.fstat(fd)
        finally:
            os.close(fd)
    return found


class Verified:
    """(generation directory, file name) -> (stamp, checksum) of files known
    intact; used from the daemon's verification threads, hence the lock."""

    def __init__(self, max_files: int = MAX_FILES):
        self.max_files = max_files
        self._known: OrderedDict[tuple[str, str], tuple[Stamp, str]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, directory: Path, name: str, st: os.stat_result, digest: str) -> None:
        key = (str(directory), name)
        with self._lock:
            self._known[key] = (stamp(st), digest)
            self._known.move_to_end(key)
            while len(self._known) > self.max_files:
                self._known.popitem(last=False)

    def intact(self, directory: Path, name: str, st: os.stat_result, digest: str) -> bool:
        """Whether ``name`` is the very file last found to match ``digest``."""
        with self._lock:
            known = self._known.get((str(directory), name))
        return known is not None and known == (stamp(st), digest)

    def forget(self, directory: Path) -> None:
        """Every file of a generation directory (removed, or rewritten by a staging)."""
        prefix = str(directory)
        with self._lock:
            for key in [k for k in self._known if k[0] == prefix]:
                del self._known[key]
