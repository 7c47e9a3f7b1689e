"""Starting, watching and killing this node's ranks.

Each rank runs in its own session (so its process group is its own), in its
own cgroup where cgroup v2 is available, as the job's owner when the daemon
is root, and with PR_SET_PDEATHSIG so it dies with the daemon. Its stdout and
stderr are pumped into an :class:`~gangd.daemon.outputlog.OutputLog`. When a
rank's main process exits, whatever it left behind in its cgroup is killed
(as Slurm does when a step's task ends), so a stray background child can
neither outlive the job nor keep the output pipes open.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import pwd
import queue
import resource as resource_mod
import signal
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import outcome
import psutil
import trio

from .. import jobs
from . import limits as rlimits_mod
from .cgroup import CgroupTree
from .notify import scrub_environ
from .outputlog import STDERR, STDOUT, OutputLog, OutputStore
from .rankserver import IDLE_TIMEOUT, RankServers, ServedRank, ServerKey, server_key
from .rankserver import SCRIPT as SERVER_SCRIPT

log = logging.getLogger("gangd.ranks")

_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux/glibc
    _prctl = None

#: A rank runs on one core. A BLAS or OpenMP runtime left to size its thread
#: pool by the machine starts threads on cores other ranks and jobs own — and
#: numpy's OpenBLAS spins them up at import, ~0.08 s of CPU in every rank of
#: every start and restart (measured: 4 ranks importing numpy on 2 cores took
#: 0.34 s with them, 0.26 s without). So a rank gets OMP_NUM_THREADS=1 (which
#: OpenBLAS, MKL and OpenMP all honour) unless its job set one of these.
THREAD_VARS = frozenset({"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"})
KILL_GRACE = 2.0  # seconds to drain output after the last process of a rank is gone
#: How long a killed rank may take to die before it is reported as
#: unkillable (stuck in the kernel: D state, a foreign frozen cgroup) and
#: the daemon goes on without it.
KILL_DEADLINE = 10.0


class RankProcess:
    """A rank's main process, spawned from the daemon's main thread.

    Not ``trio.lowlevel.open_process``: trio forks from a worker thread, and
    PR_SET_PDEATHSIG fires when the *thread* that forked exits — trio retires
    idle workers after seconds, which would SIGKILL healthy ranks. The fork
    runs on :class:`Forker`'s one thread instead, which lives as long as the
    daemon: the event loop does not wait the milliseconds a fork and the
    child's way to exec take. Exit is awaited on a pidfd and the pipes are
    trio FdStreams, so nothing blocks afterwards.
    """

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.stdout = trio.lowlevel.FdStream(_take_fd(popen.stdout))
        self.stderr = trio.lowlevel.FdStream(_take_fd(popen.stderr))
        self._pidfd = os.pidfd_open(popen.pid)

    @classmethod
    async def spawn(cls, argv, *, env, preexec_fn, pass_fds=()) -> RankProcess:
        popen = await FORKER.run(cls._popen, argv, env, preexec_fn, tuple(pass_fds))
        return cls(popen)

    @staticmethod
    def _popen(argv, env, preexec_fn, pass_fds) -> subprocess.Popen:
        # No cwd here: subprocess would chdir as root before preexec_fn drops
        # privileges; preexec_fn enters the directory as the user.
        # The argv is the user's own command, run as the user (preexec_fn drops to
        # the job owner's uid before exec): running it is the point, no shell parses it.
        popen = subprocess.Popen(  # noqa: S603 -- the job owner's own argv, exec'd as the owner without a shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            cwd="/",
            env=env,
            start_new_session=True,
            # The only hook that runs in the child between fork and exec: cgroup join, rlimits, setgroups/setgid/setuid,
            # chdir as the user, PDEATHSIG. It uses raw syscalls only (no locks, no logging; see _make_preexec).
            preexec_fn=preexec_fn,  # noqa: PLW1509 -- the only way to drop privileges in the child before exec
            pass_fds=pass_fds,
        )
        return popen

    async def wait(self) -> int:
        await trio.lowlevel.wait_readable(self._pidfd)
        # Exited, not reaped: the zombie still holds the pid, so its process
        # group cannot be anyone else's yet — what the rank left in it dies now.
        self.kill_group()
        code = self.popen.wait()
        os.close(self._pidfd)
        self._pidfd = -1
        return code

    def exited(self) -> bool:
        """Reaped: its pid may be anyone's now."""
        return self.popen.returncode is not None

    def kill_group(self) -> None:
        """SIGKILL the rank's process group (its session's, see spawn) —
        only while the rank is not reaped: after that its pid, and a group
        of that number, may be someone else's."""
        if self.popen.returncode is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def aclose(self) -> None:
        await self.stdout.aclose()
        await self.stderr.aclose()


class Forker:
    """One thread, alive as long as the daemon, that starts the ranks.

    PR_SET_PDEATHSIG fires when the thread that forked a rank exits: this one
    never does (it waits for work for ever, and dies with the process), so a
    rank dies with the daemon and only then. Work is done one item at a time,
    in the order asked: ranks start in the order their launches asked for
    them, as they did on the event loop. The answer comes back to the
    event loop through trio's token (no thread of trio's pool is held)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            fn, args, deliver = self._queue.get()
            result: outcome.Outcome
            try:
                result = outcome.Value(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, as its own
                result = outcome.Error(exc)
            try:
                deliver(result)
            except trio.RunFinishedError:  # the caller's run is over: a started child must not be left
                if isinstance(result, outcome.Value) and isinstance(result.value, subprocess.Popen):
                    with contextlib.suppress(OSError):
                        result.value.kill()

    async def run(self, fn, *args):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gangd-forker", daemon=True)
                self._thread.start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def arrived(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        self._queue.put((fn, args, lambda result: token.run_sync_soon(arrived, result)))
        # Not cancellable: a fork asked for is done, and its child must be owned by someone.
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()


FORKER = Forker()


def _tree_cpu(pid: int | None) -> float:
    """user+system seconds of a live process and its live descendants (no cgroup)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            times = proc.cpu_times()
            total += times.user + times.system
    except (psutil.Error, TypeError):
        pass
    return total


def _take_fd(fileobj) -> int:
    fd = os.dup(fileobj.fileno())
    fileobj.close()
    return fd


@dataclass
class Rank:
    job_id: int
    rank: int
    proc: RankProcess | ServedRank | None
    log: OutputLog
    cgroup: Path | None
    killed: bool = False  # gangd killed it (job killed / another rank failed / node shutdown)
    unkillable: bool = False  # reported as ended although SIGKILL did not take effect in time
    signal_stopped: bool = False  # stopped by SIGSTOP (its freezer failed): resuming needs SIGCONT
    status: dict | None = None
    done: trio.Event = field(default_factory=trio.Event)
    # pid -> pidfd of every process of the rank seen so far: gang switches
    # signal through these (no /proc or cgroup reads, and a pidfd can never
    # hit an unrelated process that reused a pid).
    pidfds: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def close_pidfds(self) -> None:
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()


class LaunchError(Exception):
    pass


def _identity(uid: int, gid: int) -> tuple[dict, list[int]]:
    """Environment overrides and supplementary groups for running as ``uid``."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return {}, []
    try:
        groups = os.getgrouplist(entry.pw_name, gid)
    except OSError:
        groups = [gid]
    return {"HOME": entry.pw_dir, "USER": entry.pw_name, "LOGNAME": entry.pw_name}, groups


class Identities:
    """(uid, gid) -> :func:`_identity`, looked up in a worker thread and
    cached for a while: NSS (LDAP, sssd) can take seconds, and the event
    loop must not wait for it at every launch."""

    TTL = 60.0  # s a found user is kept
    NEGATIVE_TTL = 5.0  # s an unknown uid is kept
    TIMEOUT = 10.0  # s a lookup may take before the launch fails
    SIZE = 1024  # users kept
    THREADS = 2  # lookups at once (one hung NSS server holds these, not trio's pool)

    def __init__(self, lookup=_identity):
        self.lookup = lookup
        self._cache: OrderedDict[tuple[int, int], tuple[tuple[dict, list[int]], float]] = OrderedDict()
        self._threads: trio.CapacityLimiter | None = None  # (made in trio's run)

    async def get(self, uid: int, gid: int) -> tuple[dict, list[int]]:
        key = (uid, gid)
        hit = self._cache.get(key)
        if hit is not None and hit[1] > time.monotonic():
            self._cache.move_to_end(key)
            return hit[0]
        if self._threads is None:
            self._threads = trio.CapacityLimiter(self.THREADS)
        found = None
        with trio.move_on_after(self.TIMEOUT):
            found = await trio.to_thread.run_sync(self.lookup, uid, gid, limiter=self._threads, abandon_on_cancel=True)
        if found is None:
            raise LaunchError(f"looking up user {uid} (its home and groups) took over {self.TIMEOUT:g} s; is the user database (NSS) slow?")
        self._cache[key] = (found, time.monotonic() + (self.TTL if found[0] else self.NEGATIVE_TTL))
        self._cache.move_to_end(key)
        while len(self._cache) > self.SIZE:
            self._cache.popitem(last=False)
        return found


class LaunchFailed:
    """What went wrong in a child between fork and exec, where nothing but raw
    syscalls may run: the child writes an errno and a step number into this
    shared page, the parent turns them into a sentence after Popen failed."""

    STEPS: ClassVar[dict[int, str]] = {1: "cannot enter the working directory", 2: "cannot set the user's resource limits"}

    def __init__(self) -> None:
        self.page = mmap.mmap(-1, 8)

    def set(self, step: int, errno_: int) -> None:
        self.page[:8] = step.to_bytes(4, "little") + errno_.to_bytes(4, "little")

    def get(self) -> tuple[int, int]:
        return int.from_bytes(self.page[:4], "little"), int.from_bytes(self.page[4:8], "little")


def _own_umask() -> int:
    """The daemon's umask (what an exec'd rank inherits), without setting it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _popen_server(argv, env, preexec_fn, fd) -> subprocess.Popen:
    # The job owner's own interpreter, as the owner (preexec_fn drops), without a shell.
    return subprocess.Popen(  # noqa: S603 -- the job's own interpreter, exec'd as the job's owner
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", env=env,
        start_new_session=True, preexec_fn=preexec_fn, pass_fds=(fd,),  # noqa: PLW1509 -- drops privileges before exec
    )


def _make_preexec(
    join: list[str],
    drop: tuple[int, int, list[int]] | None,
    cwd: str | None,
    rlimits: list[tuple[int, int, int]],
    failed: LaunchFailed,
):
    # Runs in the child between fork and exec. Only raw syscalls here: a
    # Python-level lock held by another thread at fork time would deadlock.
    # Order matters: cgroups and limits need root; the working directory is
    # entered only once the child *is* the user (so a directory the user may
    # not enter fails here, with the user's own EACCES/ENOENT, and root never
    # looks into it); the command is then looked up (PATH, a relative path)
    # by exec, as the user, from that directory.

    def preexec() -> None:
        for procs in join:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0" moves the writing process itself
            finally:
                os.close(fd)
        try:
            for resource, soft, hard in rlimits:
                resource_mod.setrlimit(resource, (soft, hard))
        except OSError as exc:
            failed.set(2, exc.errno or 0)
            raise
        if drop:
            uid, gid, groups = drop
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
        if cwd is not None:
            try:
                os.chdir(cwd)
            except OSError as exc:
                failed.set(1, exc.errno or 0)
                raise
        if _prctl is not None:
            # After setuid: a credential change clears the parent-death signal.
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # Last, right before exec: the rank becomes an ordinary task. The
        # daemon may run SCHED_RR (or at a raised nice value), and the fork
        # inherits it; demoting earlier would leave the daemon waiting for
        # this child's exec behind every busy rank of the node.
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass

    return preexec


class LocalRanks:
    def __init__(
        self,
        *,
        node: str,
        socket_path: Path,
        cgroups: CgroupTree,
        on_exit: Callable[[Rank], None],
        rlimit_caps: dict[str, int] | None = None,
        kill_deadline: float = KILL_DEADLINE,
        outputs: OutputStore,
        rank_server: bool = False,
        rank_server_idle: float | None = None,
    ):
        self.node = node
        self.outputs = outputs
        self.rlimit_caps = dict(rlimit_caps or {})
        self.kill_deadline = kill_deadline
        # For jobs whose record has no user limits: the system's defaults.
        self._default_rlimits = rlimits_mod.read_process_limits(1)
        self.socket_path = socket_path
        self.cgroups = cgroups
        self.on_exit = on_exit
        self.envs: dict[int, dict[str, str]] = {}  # job -> its environment, while it has ranks here
        self.ranks: dict[tuple[int, int], Rank] = {}  # (add through _add: it keeps the index by job)
        self._by_job: dict[int, list[Rank]] = {}
        self._launching: dict[int, trio.Lock] = {}  # a job's launch under way here
        self.logs: dict[tuple[int, int], OutputLog] = {}
        self._running_as_root = os.geteuid() == 0
        self.identities = Identities()
        # Warm rank servers (config rank_server): Python ranks forked, not exec'd; see rankserver.
        self.servers = RankServers(self._start_server, idle=rank_server_idle or IDLE_TIMEOUT) if rank_server else None
        self._umask = _own_umask()

    # ------------------------------------------------------------ queries

    def running(self) -> int:
        return sum(1 for r in self.ranks.values() if r.status is None)

    def of_job(self, job_id: int) -> list[Rank]:
        return list(self._by_job.get(job_id, ()))

    def _add(self, entry: Rank) -> None:
        self.ranks[(entry.job_id, entry.rank)] = entry
        self._by_job.setdefault(entry.job_id, []).append(entry)

    def is_rank_process(self, job_id: int, rank: int, pid: int) -> bool:
        """Whether ``pid`` is a live process of the rank: its main process is
        known at once; anything else takes a walk of what it forked (every
        rank's comm and ckptlib attach asks, on the event loop)."""
        entry = self.ranks.get((job_id, rank))
        if entry is not None and entry.status is None and entry.pid == pid and entry.proc is not None and not entry.proc.exited():
            return True
        return pid in self.rank_processes(job_id, rank)

    def rank_processes(self, job_id: int, rank: int) -> set[int]:
        """Live pids of one rank: its main process and everything it forked."""
        entry = self.ranks.get((job_id, rank))
        if entry is None or entry.status is not None or entry.pid is None:
            return set()
        pids = {entry.pid} if entry.proc is not None and not entry.proc.exited() else set()
        if entry.cgroup is not None:
            pids.update(self.cgroups.pids(entry.cgroup))
        else:
            try:
                pids.update(p.pid for p in psutil.Process(entry.pid).children(recursive=True))
            except psutil.Error:
                pass
        return pids

    def signal_job(self, job_id: int, signum: int) -> int:
        """Send ``signum`` to every process of the job here; returns how many.

        This is the inner loop of a gang switch, so it signals the processes
        it already knows through their pidfds; :meth:`signal_new` catches
        those forked since, right after the switch, off its critical path.
        Resuming needs no such pass: a stopped process cannot fork.

        Where the rank has a cgroup freezer, SIGSTOP and SIGCONT are not
        sent but done by freezing and thawing the cgroup instead (one write
        per rank): the job's owner can SIGCONT their own processes, not thaw
        a cgroup, so a job out of its slice stays off the CPUs. Frozen tasks
        sleep in the kernel's freezer trap (state S), not T; a SIGSTOP on
        top would stay pending behind the freeze. Signals remain the
        fallback where there is no freezer (or its write failed).
        """
        count = 0
        for entry in self.of_job(job_id):
            if entry.status is not None:
                continue
            if entry.cgroup is not None and signum in (signal.SIGSTOP, signal.SIGCONT):
                if self.cgroups.freeze(entry.cgroup, signum == signal.SIGSTOP) and not entry.signal_stopped:
                    count += 1
                    continue
            if signum in (signal.SIGSTOP, signal.SIGCONT):
                entry.signal_stopped = signum == signal.SIGSTOP
            if not entry.pidfds:
                self._refresh_pidfds(entry)
            count += _signal_all(entry.pidfds, entry.pidfds.keys(), signum)
        return count

    def signal_new(self, job_id: int, signum: int) -> int:
        """Send ``signum`` to the job's processes forked since they were last
        looked up (``cgroup.procs``, else /proc), and only to those. Not
        needed where the freezer stopped the rank: its forks are born frozen."""
        count = 0
        for entry in self.of_job(job_id):
            if entry.cgroup is not None and signum == signal.SIGSTOP and self.cgroups.has_freezer(entry.cgroup) and not entry.signal_stopped:
                continue
            if entry.status is None:
                count += _signal_all(entry.pidfds, self._refresh_pidfds(entry), signum)
        return count

    def _refresh_pidfds(self, entry: Rank) -> list[int]:
        """Open pidfds for the rank's processes not known yet; returns their pids."""
        found = []
        for pid in self.rank_processes(entry.job_id, entry.rank) - entry.pidfds.keys():
            try:
                entry.pidfds[pid] = os.pidfd_open(pid)
                found.append(pid)
            except OSError:  # gone meanwhile
                pass
        return found

    def cpu_seconds(self, job_id: int) -> float:
        """CPU time the job's ranks on this node used so far (ended ranks included)."""
        total = 0.0
        for entry in self.of_job(job_id):
            if entry.status is not None:
                total += entry.status.get("cpu", 0.0)
                continue
            used = self.cgroups.cpu_seconds(entry.cgroup) if entry.cgroup is not None else None
            if used is None:
                used = _tree_cpu(entry.pid)
            total += used
        return total

    # ------------------------------------------------------------ launch

    async def launch(self, spawn, record: dict, job_dir: Path, extra: dict[str, str] | None = None, rank_setup=None) -> dict[int, int | None]:
        """Start this node's ranks of ``record``; returns {rank: pid}.

        ``rank_setup(rank)`` (MPI jobs) returns the rank's own environment
        and a file descriptor it inherits (its PMI socket). Launches of one
        job run one at a time: a repeated request (a coordinator's retry)
        finds the ranks the first one started, never starts them twice."""
        lock = self._launching.setdefault(record["id"], trio.Lock())
        try:
            async with lock:
                return await self._launch(spawn, record, job_dir, extra, rank_setup)
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._launching.pop(record["id"], None)

    async def _launch(self, spawn, record: dict, job_dir: Path, extra: dict[str, str] | None, rank_setup) -> dict[int, int | None]:
        my_ranks = jobs.ranks_on(record, self.node)
        log.debug("job %d: launching ranks %s", record["id"], my_ranks)
        uid, gid = record["owner_uid"], record["owner_gid"]
        if self._running_as_root:
            drop = None if uid == 0 else (uid, gid)
        elif uid != os.geteuid():
            raise LaunchError(f"gangd on {self.node} runs as uid {os.geteuid()} and cannot start ranks for uid {uid}")
        else:
            drop = None
        extra_env, groups = await self.identities.get(uid, gid) if drop else ({}, [])
        limits = rlimits_mod.effective(record.get("rlimits"), self.rlimit_caps, self._default_rlimits) if self._running_as_root else []
        await trio.to_thread.run_sync(lambda: job_dir.mkdir(parents=True, exist_ok=True))
        # Kept while the job has ranks here: its checkpoints save it (a record carries no environment).
        self.envs[record["id"]] = dict(record["env"])
        base_env = scrub_environ(record["env"])
        if not THREAD_VARS & base_env.keys():
            base_env["OMP_NUM_THREADS"] = "1"
        base_env.update(extra_env)
        base_env.update(
            GANGD_JOB=str(record["id"]),
            GANGD_SIZE=str(record["nranks"]),
            GANGD_NODE=self.node,
            GANGD_SOCKET=str(self.socket_path),
            GANGD_JOB_NAME=record["name"],
        )
        if record.get("ckpt_mode"):  # issue 17: the job's --ckpt-mode, for ckptlib (a restart's comes with `extra`)
            base_env["GANGD_CKPT_MODE"] = record["ckpt_mode"]
        base_env.update(extra or {})
        pids: dict[int, int | None] = {}  # None: a rank of a repeated launch that failed to start
        for rank in my_ranks:
            key = (record["id"], rank)
            if key in self.ranks:  # a repeated launch request (coordinator retry)
                pids[rank] = self.ranks[key].pid
                continue
            output = await self.outputs.open(record["id"], rank)
            self.logs[key] = output
            try:
                cgroup = self.cgroups.create(record["id"], rank)
            except OSError as exc:
                raise LaunchError(f"cannot set the job's limits on {self.node}: {exc.strerror or exc}") from None
            env = dict(base_env, GANGD_RANK=str(rank))
            inherited: list[int] = []
            if rank_setup is not None:
                rank_env, fd = rank_setup(rank)
                env.update(rank_env)
                inherited.append(fd)
            if self.servers is not None and cgroup is not None and not inherited:
                served = await self._fork_served(spawn, record, env, uid, gid, groups, limits, cgroup)
                if served is not None:
                    entry = Rank(record["id"], rank, served, output, cgroup)
                    self._add(entry)
                    pids[rank] = served.pid
                    spawn(self._watch, entry, served)
                    log.debug("job %d rank %d: forked by rank server %d as %d", record["id"], rank, served.server_pid, served.pid)
                    continue
            failed = LaunchFailed()
            argv, _ = jobs.segment_of(record, rank)
            try:
                proc = await RankProcess.spawn(
                    argv,
                    env=env,
                    preexec_fn=_make_preexec(
                        self.cgroups.join_files(cgroup) if cgroup is not None else [],
                        (uid, gid, groups) if drop else None,
                        record["cwd"] or None,
                        limits,
                        failed,
                    ),
                    pass_fds=inherited,
                )
            # OSError from exec, a NUL byte / bad type in argv or env, SubprocessError from preexec_fn:
            # whatever it is, the rank ends with 126/127 and a sentence, and its fds are closed.
            except Exception as exc:  # noqa: BLE001 -- any failure to start becomes the rank's exit status
                for fd in inherited:
                    os.close(fd)
                step, number = failed.get()
                if step:
                    # Failed before exec, as the user (see _make_preexec): the
                    # user's own errno on the user's own path, nothing more.
                    code = 126
                    what = f"{LaunchFailed.STEPS[step]}{' ' + record['cwd'] if step == 1 else ''}: {os.strerror(number)}"
                    line = f"gangd: cannot start rank {rank} on {self.node}: {what}\n"
                else:
                    # Same convention as a shell: 127 not found, 126 cannot execute.
                    code = 127 if isinstance(exc, FileNotFoundError) else 126
                    what = getattr(exc, "strerror", None) or str(exc)
                    line = f"gangd: cannot start rank {rank} on {self.node}: {argv[0]}: {what}\n"
                if cgroup is not None:
                    await trio.to_thread.run_sync(self.cgroups.remove, cgroup)
                output.append(STDERR, line.encode())
                output.close()
                entry = Rank(record["id"], rank, None, output, cgroup, status={"code": code, "node": self.node, "why": what})
                self._add(entry)
                entry.done.set()
                self.on_exit(entry)
                continue
            for fd in inherited:  # the child's end, now the child's alone
                os.close(fd)
            entry = Rank(record["id"], rank, proc, output, cgroup)
            self._add(entry)
            pids[rank] = proc.pid
            spawn(self._watch, entry, proc)
            log.debug("job %d rank %d: exec'd as %d", record["id"], rank, proc.pid)
        return pids

    def note(self, job_id: int, rank: int, text: str) -> None:
        """A line of the daemon's own in the rank's stderr (what `gang logs` shows), while its output is open."""
        output = self.logs.get((job_id, rank))
        if output is not None and not output.closed:
            output.append(STDERR, f"gangd: {text}\n".encode())

    async def _watch(self, entry: Rank, proc: RankProcess | ServedRank) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drain, proc, entry.log)
            code = await proc.wait()
            # The main process is gone: nothing it left behind may live on, and
            # the pipes get a bounded time to drain what was already written.
            self._kill_leftovers(entry)
            nursery.cancel_scope.deadline = trio.current_time() + KILL_GRACE
        with trio.CancelScope(shield=True):
            await proc.aclose()
        await entry.log.aclose()
        if entry.unkillable:
            # Already reported as ended (see kill_job); now it really is.
            log.warning("job %d rank %d on %s finally died, %s after it was reported unkillable",
                        entry.job_id, entry.rank, self.node, "exit" if code >= 0 else "signal")
            entry.close_pidfds()
            if entry.cgroup is not None:
                await trio.to_thread.run_sync(self.cgroups.remove, entry.cgroup)
            return
        status = {"code": code, "node": self.node} if code >= 0 else {"signal": -code, "node": self.node}
        if entry.killed:
            status["killed"] = True
        if isinstance(proc, ServedRank) and proc.status_lost and not entry.killed:
            status["why"] = "its exit status was lost: its rank server died (and the rank with it)"
        used = self.cgroups.cpu_seconds(entry.cgroup) if entry.cgroup is not None else None
        if used is not None:
            status["cpu"] = round(used, 3)
        entry.status = status
        entry.close_pidfds()
        entry.done.set()
        if entry.cgroup is not None:
            await trio.to_thread.run_sync(self.cgroups.remove, entry.cgroup)
        self.on_exit(entry)

    async def _drain(self, proc: RankProcess | ServedRank, output: OutputLog) -> None:
        async with trio.open_nursery() as pumps:
            pumps.start_soon(self._pump, proc.stdout, output, STDOUT)
            pumps.start_soon(self._pump, proc.stderr, output, STDERR)

    async def _pump(self, stream, output: OutputLog, which: int) -> None:
        try:
            async for chunk in stream:
                await output.write(which, chunk)  # waits for the disk: backpressure, see outputlog
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _kill_leftovers(self, entry: Rank) -> None:
        if entry.cgroup is not None:
            if self.cgroups.pids(entry.cgroup):
                self.cgroups.kill(entry.cgroup)
        if entry.proc is not None:
            entry.proc.kill_group()  # (a no-op once reaped: the pid may be reused)

    # ------------------------------------------------------------ kill

    async def kill_job(self, job_id: int) -> list[int]:
        """SIGKILL every process of the job here and wait until its ranks are
        reaped, or ``kill_deadline`` passed: a rank still alive then (stuck
        in the kernel, where SIGKILL waits) is reported as ended, marked
        ``unkillable``, so its job can end and the caller can go on. Returns
        those ranks."""
        victims = [r for r in self.of_job(job_id) if r.status is None]
        for entry in victims:
            entry.killed = True
            descendants = []
            if entry.proc is not None and not entry.proc.exited():
                try:
                    descendants = psutil.Process(entry.pid).children(recursive=True)
                except psutil.Error:
                    pass
            if entry.cgroup is not None:
                self.cgroups.kill(entry.cgroup)
            self._kill_leftovers(entry)
            for child in descendants:  # the fallback for machines without cgroups
                try:
                    child.kill()
                except psutil.Error:
                    pass
        with trio.move_on_after(self.kill_deadline):
            for entry in victims:
                await entry.done.wait()
        stuck = [entry for entry in victims if not entry.done.is_set()]
        for entry in stuck:
            self._report_unkillable(entry)
        return [entry.rank for entry in stuck]

    def _report_unkillable(self, entry: Rank) -> None:
        pids = sorted(self.rank_processes(entry.job_id, entry.rank))
        why = f"unkillable: still alive {self.kill_deadline:g} s after SIGKILL (pids {', '.join(map(str, pids)) or '?'}, stuck in the kernel)"
        log.error("job %d rank %d on %s is %s; going on without it", entry.job_id, entry.rank, self.node, why)
        entry.unkillable = True
        entry.status = {"signal": signal.SIGKILL, "killed": True, "unkillable": True, "node": self.node, "why": why}
        entry.done.set()
        self.on_exit(entry)

    async def kill_all(self) -> None:
        if self.servers is not None:
            await self.servers.stop()
        async with trio.open_nursery() as nursery:
            for job_id in {j for (j, _) in self.ranks}:
                nursery.start_soon(self.kill_job, job_id)

    # ------------------------------------------------------------ rank servers

    async def _start_server(self, key: ServerKey, fd: int, limits: list[tuple[int, int, int]]) -> subprocess.Popen:
        """Start a rank server for ``key``: as its user (the daemon's child, so
        it dies with the daemon), with the user's rlimits (``limits``, those
        of the job it is started for) and only the key's environment."""
        drop = (key.uid, key.gid, list(key.groups)) if self._running_as_root and key.uid != 0 else None
        env = dict(key.env)
        if self.servers is not None:
            env["GANGD_RANK_SERVER_IDLE"] = str(self.servers.idle)
        # Room for a rank's environment in what /proc/PID/environ shows (see rankserver_main).
        env["GANGD_RANK_SERVER_ROOM"] = "x" * 65536
        return await FORKER.run(_popen_server, [key.executable, str(SERVER_SCRIPT), str(fd)], env,
                                _make_preexec([], drop, "/", limits, LaunchFailed()), fd)

    async def _fork_served(self, spawn, record: dict, env: dict[str, str], uid: int, gid: int, groups: list[int],
                           limits: list[tuple[int, int, int]], cgroup: Path) -> ServedRank | None:
        """The rank forked by a warm server, or None: exec it."""
        if self.servers is None:
            return None
        if not self._running_as_root:
            uid, gid, groups = os.geteuid(), os.getegid(), os.getgroups()
        elif uid == 0:
            gid, groups = os.getegid(), os.getgroups()
        key = server_key(record["argv"], env, uid, gid, groups)
        if key is None:
            return None
        server = self.servers.ready(key, spawn, limits)
        if server is None:
            self.servers.fallbacks += 1
            return None
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        request = {"argv": record["argv"], "env": env, "cwd": record["cwd"] or None, "umask": self._umask, "rlimits": limits}
        try:
            proc = await self.servers.fork_rank(server, request, {"stdout": out_w, "stderr": err_w, "stdout_r": out_r, "stderr_r": err_r},
                                                self.cgroups.join_files(cgroup))
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        if proc is None:
            os.close(out_r)
            os.close(err_r)
            self.servers.fallbacks += 1
        return proc


def _signal_all(pidfds: dict[int, int], pids, signum: int) -> int:
    """Signal ``pids`` through their pidfds; forgets (and closes) those that exited."""
    count = 0
    for pid in list(pids):
        try:
            signal.pidfd_send_signal(pidfds[pid], signum)
            count += 1
        except ProcessLookupError:  # exited
            os.close(pidfds.pop(pid))
        except PermissionError:
            pass
    return count
