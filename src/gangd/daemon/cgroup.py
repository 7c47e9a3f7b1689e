"""Per-rank cgroups (v2), so every process a rank forks is tracked, frozen and killed with it.

A process group alone is not enough: a rank can call ``setsid`` and escape it.
A cgroup cannot be escaped by an unprivileged process, ``cgroup.procs`` lists
every member, and ``cgroup.kill`` (Linux 5.14+) kills them all at once.
Where cgroup v2 is not mounted or not writable (not root, no delegation) the
rank cgroups go in the v1 freezer hierarchy if there is one (see below), else
the daemon falls back to process groups plus a psutil sweep of descendants.

Gang scheduling stops a job by freezing its cgroups (``cgroup.freeze``, a
core v2 file on Linux 5.2+), not by SIGSTOP: any process of the job's owner
may send SIGCONT, which would let a suspended job compute through other
users' slices; a frozen cgroup stays frozen until root thaws it. The freeze
file stays open (a switch is one ``write`` per rank). Where the rank's v2
cgroup has no ``cgroup.freeze`` (kernel < 5.2) but the v1 ``freezer``
controller is mounted, each rank also joins
``<v1 freezer mount>/<our cgroup>/<name>/job-<id>/rank-<r>`` at launch and is
frozen by writing FROZEN/THAWED to its ``freezer.state`` (kept open too).
Only where neither exists does the daemon fall back to SIGSTOP/SIGCONT. Two
v1 differences matter: freezing is asynchronous (the state reads FREEZING
until every task has stopped, so ``gang suspend`` may answer a moment before
the last task is frozen), and SIGKILL does not take effect on a v1-frozen
task, so ``kill()`` thaws before it kills (for v2 too, so nothing killed
stays frozen). Where there is no usable v2 hierarchy at all, the v1 freezer
hierarchy itself holds the rank cgroups (same layout): its ``cgroup.procs``
tracks every fork as well; there is no ``cgroup.kill`` (each member gets
SIGKILL, after the thaw) nor ``cpu.stat`` (CPU time is read from /proc).

``GANGD_FREEZER`` (environment of the daemon, read once at start) chooses
the freezer, for diagnosis and tests: ``auto`` (default: v2, else v1, else
signals), ``v2`` (v2 or signals), ``v1`` (v1 or signals), ``signals``.

Admin limits per job and node (``[limits] pids_max``/``memory_max``) go on
the job's cgroup: in the v2 tree where the controller is available there,
else in the controller's v1 hierarchy (the job's ranks join
``<v1 mount>/<our cgroup>/<name>/job-<id>`` at launch). Where neither exists
the limit is not enforced and the daemon says so once at start.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("gangd.cgroup")

FREEZERS = ("auto", "v2", "v1", "signals")


def freezer_choice() -> str:
    """``GANGD_FREEZER`` if valid, else ``auto`` (said once in the log)."""
    choice = os.environ.get("GANGD_FREEZER", "auto").strip().lower() or "auto"
    if choice not in FREEZERS:
        log.warning("GANGD_FREEZER=%r is not one of %s: using auto", choice, ", ".join(FREEZERS))
        return "auto"
    return choice


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


def find_cgroup1_root(controller: str) -> Path | None:
    """Our own cgroup directory in the v1 hierarchy of ``controller``, or None."""
    mount = None
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 4 and fields[2] == "cgroup" and controller in fields[3].split(","):
                    mount = Path(fields[1])
                    break
        if mount is None:
            return None
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controller in controllers.split(","):
                    return mount / path.lstrip("/")
    except (OSError, ValueError):
        return None
    return None


#: [limits] setting -> (controller, v2 file, v1 file)
LIMIT_FILES = {
    "pids_max": ("pids", "pids.max", "pids.max"),
    "memory_max": ("memory", "memory.max", "memory.limit_in_bytes"),
}


class CgroupTree:
    """``<our cgroup>/<name>/job-<id>/rank-<r>``; ``name`` keeps several local daemons apart.

    ``limits``: {"pids_max": n, "memory_max": bytes} set on every job's cgroup."""

    def __init__(self, name: str, limits: dict[str, int] | None = None):
        self.base: Path | None = None
        self.name = name
        self._procs: dict[Path, int] = {}  # open cgroup.procs files, see pids()
        # rank path -> (open cgroup.freeze or v1 freezer.state fd, frozen payload, thawed payload), see freeze()
        self._freeze: dict[Path, tuple[int, bytes, bytes]] = {}
        self._v1_freeze_dirs: dict[Path, Path] = {}  # rank path -> its v1 freezer cgroup
        self.freezer = freezer_choice()
        v1_freezer = find_cgroup1_root("freezer")
        # Known even when not used: close() removes what an earlier life made.
        self._v1_freezer: Path | None = v1_freezer / name if v1_freezer is not None else None
        self.limits = {k: v for k, v in (limits or {}).items() if v is not None}
        self._v2_limits: dict[str, int] = {}  # set in the v2 job cgroup
        self._v1_limits: dict[Path, tuple[str, int]] = {}  # v1 hierarchy base -> (file, value)
        self._base_is_v1 = False  # no usable v2: the rank cgroups are in the v1 freezer hierarchy
        root = find_cgroup2_root()
        base = root / name if root is not None else None
        if root is None:
            log.info("no cgroup v2 hierarchy")
        elif base is not None:
            try:
                base.mkdir(exist_ok=True)
                (base / "cgroup.procs").stat()
            except OSError as exc:
                log.info("cannot create cgroups under %s (%s)", root, exc)
                base = None
        if base is None and self.freezer in ("auto", "v1") and self._v1_freezer is not None:
            try:
                self._v1_freezer.mkdir(exist_ok=True)
                base, self._base_is_v1 = self._v1_freezer, True
                log.info("rank cgroups in the v1 freezer hierarchy %s", base)
            except OSError as exc:
                log.warning("cannot create %s: %s", self._v1_freezer, exc)
        if base is None:
            log.info("tracking ranks by process group only")
            self._warn_unenforced(self.limits)
            return
        self.base = base
        self._place_limits(base)
        if not self._base_is_v1 and self.freezer in ("auto", "v1") and self._v1_freezer is not None:
            try:
                self._v1_freezer.mkdir(exist_ok=True)
            except OSError as exc:
                log.warning("cannot create %s: %s", self._v1_freezer, exc)
                self._v1_freezer = None
        log.info("freezer: %s", self.freezer)

    def _place_limits(self, base: Path) -> None:
        """Decide, per limit, where it is enforced: v2 if its controller can be
        enabled below our base, else the controller's v1 hierarchy."""
        missing = {}
        for key, value in self.limits.items():
            controller, v2_file, v1_file = LIMIT_FILES[key]
            try:
                if controller in (base / "cgroup.controllers").read_text().split():
                    (base / "cgroup.subtree_control").write_text(f"+{controller}")
                    self._v2_limits[v2_file] = value
                    continue
            except OSError:
                pass
            v1 = find_cgroup1_root(controller)
            if v1 is not None:
                try:
                    (v1 / self.name).mkdir(exist_ok=True)
                    self._v1_limits[v1 / self.name] = (v1_file, value)
                    continue
                except OSError as exc:
                    log.warning("cannot create %s: %s", v1 / self.name, exc)
            missing[key] = value
        self._warn_unenforced(missing)

    @staticmethod
    def _warn_unenforced(limits: dict[str, int]) -> None:
        for key, value in limits.items():
            log.warning("[limits] %s = %s is NOT enforced: no %s cgroup controller is available to gangd", key, value, LIMIT_FILES[key][0])

    @property
    def enabled(self) -> bool:
        return self.base is not None

    def create(self, job_id: int, rank: int) -> Path | None:
        """The rank's cgroup (its job's with the admin's limits, if new).
        Raises OSError if a configured limit cannot be set: a job must not
        run unlimited where the admin asked for a limit."""
        if self.base is None:
            return None
        job = self.base / f"job-{job_id}"
        path = job / f"rank-{rank}"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot create cgroup %s: %s", path, exc)
            return None
        try:
            for name, value in self._v2_limits.items():
                (job / name).write_text(str(value))
            for v1_base, (name, value) in self._v1_limits.items():
                (v1_base / job.name).mkdir(exist_ok=True)
                (v1_base / job.name / name).write_text(str(value))
        except OSError:
            self.remove(path)
            raise
        if self._base_is_v1:
            try:
                self._freeze[path] = (os.open(path / "freezer.state", os.O_WRONLY | os.O_CLOEXEC), b"FROZEN", b"THAWED")
            except OSError as exc:
                log.warning("cannot use the v1 freezer %s (%s): suspending by signals", path, exc)
            return path
        if self.freezer in ("auto", "v2"):
            try:
                self._freeze[path] = (os.open(path / "cgroup.freeze", os.O_WRONLY | os.O_CLOEXEC), b"1", b"0")
            except OSError:
                pass  # kernel < 5.2: the v1 freezer, else signals
        if path not in self._freeze and self.freezer in ("auto", "v1") and self._v1_freezer is not None:
            v1_rank = self._v1_freezer / job.name / path.name
            try:
                v1_rank.mkdir(parents=True, exist_ok=True)
                fd = os.open(v1_rank / "freezer.state", os.O_WRONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.warning("cannot use the v1 freezer %s (%s): suspending by signals", v1_rank, exc)
                _rmdir(v1_rank)
            else:
                self._freeze[path] = (fd, b"FROZEN", b"THAWED")
                self._v1_freeze_dirs[path] = v1_rank
        return path

    def join_files(self, path: Path) -> list[str]:
        """The ``cgroup.procs`` files a rank's process writes itself into
        before exec: its v2 cgroup, then its job's cgroups of v1 hierarchies."""
        files = [str(path / "cgroup.procs")] + [str(v1 / path.parent.name / "cgroup.procs") for v1 in self._v1_limits]
        if path in self._v1_freeze_dirs:
            files.append(str(self._v1_freeze_dirs[path] / "cgroup.procs"))
        return files

    def freeze(self, path: Path, frozen: bool) -> bool:
        """Freeze (or thaw) every process of the cgroup: one write to a kept
        fd, fast enough for the gang switch. False if there is no freezer.
        Where the v1 freezer is used the write starts the freeze (FREEZING);
        its tasks stop a moment later, and new forks are born frozen."""
        entry = self._freeze.get(path)
        if entry is None:
            return False
        fd, on, off = entry
        try:
            os.pwrite(fd, on if frozen else off, 0)
            return True
        except OSError:
            return False

    def has_freezer(self, path: Path) -> bool:
        return path in self._freeze

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
        """Kill every process in the cgroup (cgroup.kill, else SIGKILL each).
        It is thawed first: a v1-frozen task does not act on SIGKILL until
        thawed (a v2-frozen one does, but nothing of a killed job should stay
        frozen waiting for it)."""
        self.freeze(path, False)
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
        freeze = self._freeze.pop(path, None)
        if freeze is not None:
            os.close(freeze[0])
        _rmdir(path)
        v1_rank = self._v1_freeze_dirs.pop(path, None)
        if v1_rank is not None:
            _rmdir(v1_rank)
        try:
            path.parent.rmdir()
        except OSError:
            return  # other ranks of the job still run here
        for v1_base in self._v1_bases():
            _rmdir(v1_base / path.parent.name)

    def _v1_bases(self) -> list[Path]:
        """Our directories in the v1 hierarchies (limits, freezer) in use."""
        bases = list(self._v1_limits)
        if self._v1_freezer is not None and self.freezer in ("auto", "v1") and not self._base_is_v1:
            bases.append(self._v1_freezer)
        return bases

    def close(self) -> None:
        """On a clean stop: remove what is left of our (by now empty) subtree."""
        if self.base is None:
            return
        while self._procs:
            os.close(self._procs.popitem()[1])
        while self._freeze:
            os.close(self._freeze.popitem()[1][0])
        self._v1_freeze_dirs.clear()
        for job in self.base.glob("job-*"):
            for rank_dir in job.glob("rank-*"):
                _rmdir(rank_dir)
            _rmdir(job)
        _rmdir(self.base)
        v1_bases = list(self._v1_limits)
        if self._v1_freezer is not None and self._v1_freezer.is_dir() and not self._base_is_v1:
            v1_bases.append(self._v1_freezer)
        for v1_base in v1_bases:
            for job in v1_base.glob("job-*"):
                for rank_dir in job.glob("rank-*"):
                    _rmdir(rank_dir)
                _rmdir(job)
            _rmdir(v1_base)

    def sweep(self) -> list[int]:
        """Kill leftovers of a previous life of this daemon; returns the job ids found."""
        if self.base is None:
            return []
        found = []
        for job in self.base.glob("job-*"):
            for rank_dir in job.glob("rank-*"):
                v1_rank = self._v1_freezer / job.name / rank_dir.name if self._v1_freezer is not None else None
                if v1_rank is not None and v1_rank.is_dir():  # (rank_dir itself where _base_is_v1)
                    # A v1-frozen leftover would never act on the SIGKILL below.
                    try:
                        (v1_rank / "freezer.state").write_text("THAWED")
                    except OSError:
                        pass
                    self._v1_freeze_dirs[rank_dir] = v1_rank  # remove() removes it
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
