"""Per-rank cgroups (v2), so every process a rank forks is tracked and killed with it.

A process group alone is not enough: a rank can call ``setsid`` and escape it.
A cgroup cannot be escaped by an unprivileged process, ``cgroup.procs`` lists
every member, and ``cgroup.kill`` (Linux 5.14+) kills them all at once.
Where cgroup v2 is not mounted or not writable (not root, no delegation) the
daemon falls back to process groups plus a psutil sweep of descendants.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("gangd.cgroup")


def find_cgroup2_root() -> Path | None:
    """Our own cgroup directory in the v2 hierarchy, or None."""
    mount = None
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "cgroup2":
                    mount = Path(fields[1])
                    break
        if mount is None:
            return None
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                if line.startswith("0::"):
                    return mount / line[3:].strip().lstrip("/")
    except OSError:
        return None
    return None


class CgroupTree:
    """``<our cgroup>/<name>/job-<id>/rank-<r>``; ``name`` keeps several local daemons apart."""

    def __init__(self, name: str):
        self.base: Path | None = None
        self._procs: dict[Path, int] = {}  # open cgroup.procs files, see pids()
        root = find_cgroup2_root()
        if root is None:
            log.info("no cgroup v2 hierarchy: tracking ranks by process group only")
            return
        base = root / name
        try:
            base.mkdir(exist_ok=True)
            (base / "cgroup.procs").stat()
        except OSError as exc:
            log.info("cannot create cgroups under %s (%s): tracking ranks by process group only", root, exc)
            return
        self.base = base

    @property
    def enabled(self) -> bool:
        return self.base is not None

    def create(self, job_id: int, rank: int) -> Path | None:
        if self.base is None:
            return None
        path = self.base / f"job-{job_id}" / f"rank-{rank}"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot create cgroup %s: %s", path, exc)
            return None
        return path

    def pids(self, path: Path) -> list[int]:
        """Every process in the cgroup. Runs after every gang switch, so the
        ``cgroup.procs`` file stays open and is re-read with ``pread``: the
        path lookup of an open costs more than the read itself."""
        fd = self._procs.get(path)
        if fd is None:
            try:
                fd = self._procs[path] = os.open(f"{path}/cgroup.procs", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return []
        data = b""
        try:
            while chunk := os.pread(fd, 65536, len(data)):
                data += chunk
        except OSError:
            return []
        return [int(x) for x in data.split()]

    def cpu_seconds(self, path: Path) -> float | None:
        """CPU time used by every process that ever ran in the cgroup (forks and dead children included)."""
        try:
            for line in (path / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None

    def kill(self, path: Path) -> None:
        """Kill every process in the cgroup (cgroup.kill, else SIGKILL each)."""
        try:
            (path / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
        for pid in self.pids(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, path: Path) -> None:
        """Remove a rank's cgroup, and its job's once that is empty. Blocking:
        call through ``trio.to_thread``."""
        fd = self._procs.pop(path, None)
        if fd is not None:
            os.close(fd)
        _rmdir(path)
        try:
            path.parent.rmdir()
        except OSError:
            pass  # other ranks of the job still run here

    def close(self) -> None:
        """On a clean stop: remove what is left of our (by now empty) subtree."""
        if self.base is None:
            return
        while self._procs:
            os.close(self._procs.popitem()[1])
        for job in self.base.glob("job-*"):
            for rank_dir in job.glob("rank-*"):
                _rmdir(rank_dir)
            _rmdir(job)
        _rmdir(self.base)

    def sweep(self) -> list[int]:
        """Kill leftovers of a previous life of this daemon; returns the job ids found."""
        if self.base is None:
            return []
        found = []
        for job in self.base.glob("job-*"):
            for rank_dir in job.glob("rank-*"):
                if self.pids(rank_dir):
                    self.kill(rank_dir)
                    found.append(int(job.name.split("-", 1)[1]))
                self.remove(rank_dir)
        return sorted(set(found))


def _rmdir(path: Path) -> None:
    # A cgroup can only be removed once its last process is gone; the kernel
    # reaps asynchronously after SIGKILL, so retry briefly.
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.debug("cannot remove cgroup %s: %s", path, exc)
                return
            time.sleep(0.01)
