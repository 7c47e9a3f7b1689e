"""Warm rank servers, the daemon's side: a rank forked instead of exec'd.

Half of a Python rank's restart is the interpreter starting and importing
numpy and gangd (issue 16's profile). A rank server (rankserver_main.py) is a
process of the job's owner, running the job's own interpreter, that did those
imports once and forks a rank on request. It is used only where the fork is
exactly what the exec would have been (:func:`server_key`): the command is
``ABSPATH/pythonX[.Y] script ...`` or ``... -m module ...`` with no
interpreter options, and every environment variable the interpreter or numpy
reads at start (:data:`KEY_PREFIXES`) is the server's — servers are keyed by
executable, uid, gid, groups and those variables, so a job never uses another
user's, or another environment's, server.

The server runs as the user, so everything it says is hostile: the pid it
names is used only after checking, through a pidfd (which cannot be
redirected to a reused pid), that the process is the server's child and
entirely the job's uid and gid; it is then moved into the rank's cgroup and
checked to be alive still (so the write moved that process) before it is let
run. Its exit status comes from the server (the server, not the daemon, is its
parent): a status that never comes (the server died, and its ranks with it:
PDEATHSIG) is reported as SIGKILL. Any failure — no server yet, a server slow
or gone, a rank it cannot fork exactly — falls back to exec, which is what
:meth:`RankServers.fork_rank` returning None means. A server is never waited
for: the first launch of a key starts one in the background and execs.

Bounded: at most :data:`MAX_SERVERS` servers per daemon and
:data:`MAX_PER_USER` per user (an idle one is evicted for a new key); each is
killed after ``idle`` seconds without ranks (by the daemon: a server runs the
user's code — their interpreter, their PYTHONPATH — outside any job's
cgroup and gang slot, which is why it must not linger, and why servers are
off by default), and all die with the daemon (PDEATHSIG) or when it kills
all its ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

log = logging.getLogger("gangd.rankserver")

SCRIPT = Path(__file__).with_name("rankserver_main.py")
PROTOCOL = 1
MAX_SERVERS = 8
MAX_PER_USER = 3  # (one user's many environments do not take every server)
MAX_BAD = 256
IDLE_TIMEOUT = 600.0
HELLO_TIMEOUT = 30.0  # its start and imports, on a loaded node
REPLY_TIMEOUT = 5.0  # a fork, and the child's setup
STATUS_TIMEOUT = 5.0  # after the rank is gone, for its status
BAD_KEY_FOR = 600.0  # a key whose server failed to start is not retried for this long
MAX_MESSAGE = 4096
#: Environment variables read once at the interpreter's (or numpy's, or the
#: dynamic linker's) start: a server serves only jobs whose values are its own.
KEY_PREFIXES = ("PYTHON", "LC_", "LD_", "OMP_", "OPENBLAS_", "GOTO_", "MKL_", "BLIS_", "VECLIB_", "NUMEXPR_", "NPY_", "NUMPY_", "MALLOC_")
KEY_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "HOME", "GLIBC_TUNABLES"})
_PYTHON = re.compile(r"python3?(\.\d+)?")


@dataclass(frozen=True)
class ServerKey:
    executable: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    env: tuple[tuple[str, str], ...]


def server_key(argv: list[str], env: dict[str, str], uid: int, gid: int, groups: list[int]) -> ServerKey | None:
    """The server that may fork this rank, or None: exec it."""
    if len(argv) < 2 or not all(isinstance(a, str) and "\0" not in a for a in argv):
        return None
    exe = argv[0]
    if not os.path.isabs(exe) or not _PYTHON.fullmatch(os.path.basename(exe)):
        return None
    if argv[1] == "-m":
        if len(argv) < 3 or not argv[2] or argv[2].startswith("-"):
            return None
    elif not argv[1] or argv[1].startswith("-"):
        return None
    kept = tuple(sorted((k, v) for k, v in env.items() if k in KEY_NAMES or k.startswith(KEY_PREFIXES)))
    return ServerKey(exe, uid, gid, tuple(sorted(set(groups))), kept)


@dataclass
class Server:
    key: ServerKey
    popen: subprocess.Popen
    sock: trio.socket.SocketType
    pidfd: int
    pid: int = 0
    ready: bool = False
    live: int = 0  # its ranks not yet ended
    last_used: float = field(default_factory=time.monotonic)
    lock: trio.Lock = field(default_factory=trio.Lock)
    gone: trio.Event = field(default_factory=trio.Event)

    def kill(self) -> None:
        """SIGKILL the server (the daemon's own child, so its pid is the daemon's to signal until reaped)."""
        if self.popen.returncode is None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class ServedRank:
    """A rank forked by a server: what :class:`~gangd.daemon.ranks.RankProcess` is for an exec'd one."""

    def __init__(self, pid: int, pidfd: int, stdout: int, stderr: int, status: int, server: Server):
        self.pid = pid
        self._pidfd = pidfd
        self.stdout = trio.lowlevel.FdStream(stdout)
        self.stderr = trio.lowlevel.FdStream(stderr)
        self._status = trio.lowlevel.FdStream(status)
        self._server = server
        self.server_pid = server.pid
        self._ended = False
        self.status_lost = False

    def exited(self) -> bool:
        """Whether the process is gone (its pid may then be anyone's)."""
        if self._ended or self._pidfd < 0:
            return True
        try:
            signal.pidfd_send_signal(self._pidfd, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False

    async def wait(self) -> int:
        await trio.lowlevel.wait_readable(self._pidfd)
        self._ended = True
        data = b""
        with trio.move_on_after(STATUS_TIMEOUT):
            while len(data) < 32:
                chunk = await self._status.receive_some(32)
                if not chunk:
                    break
                data += chunk
        os.close(self._pidfd)
        self._pidfd = -1
        self._server.live -= 1
        self._server.last_used = time.monotonic()
        try:
            status = int(data)  # (a server's word: only a real exit or death by a real signal is taken)
            if not 0 <= status <= 0xFFFF:
                raise ValueError(status)
            code = os.waitstatus_to_exitcode(status)
            if not (0 <= code <= 255 or 1 <= -code < signal.NSIG):
                raise ValueError(status)
            return code
        except (ValueError, OverflowError):
            # No status: the server died (and the rank of PDEATHSIG with it), or lied.
            self.status_lost = True
            return -signal.SIGKILL

    def kill_group(self) -> None:
        """SIGKILL the rank's main process through its pidfd (its group and
        everything else it started die with its cgroup: a served rank always has one)."""
        if not self._ended and self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    async def aclose(self) -> None:
        await self.stdout.aclose()
        await self.stderr.aclose()
        await self._status.aclose()


def _ids(pid: int) -> tuple[int, list[int], list[int]]:
    """(parent pid, uids, gids) of ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
    uids: list[int] = []
    gids: list[int] = []
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                uids = [int(x) for x in line.split()[1:]]
            elif line.startswith(b"Gid:"):
                gids = [int(x) for x in line.split()[1:]]
    return ppid, uids, gids


def adopt(pid: object, server_pid: int, uid: int, gid: int) -> int:
    """Check that ``pid`` (named by a server: hostile) is the server's child
    and wholly ``uid``/``gid``; returns a pidfd for it, or raises ValueError
    (nothing was signalled). Blocking (reads /proc): run in a thread."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise ValueError(f"not a pid: {pid!r}")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise ValueError(f"no process {pid}") from exc
    try:
        ppid, uids, gids = _ids(pid)
        # The pidfd still names a live process: the /proc reads above were of it (a pid is not reused while its process lives).
        signal.pidfd_send_signal(pidfd, 0)
    except (OSError, ValueError, IndexError) as exc:
        os.close(pidfd)
        raise ValueError(f"cannot read process {pid}") from exc
    if ppid != server_pid or uids != [uid] * 4 or gids != [gid] * 4:
        os.close(pidfd)
        raise ValueError(f"process {pid} is not the server's child of uid {uid} (parent {ppid}, uids {uids}, gids {gids})")
    return pidfd


def adopt_into(pid: object, server_pid: int, uid: int, gid: int, join: list[str]) -> int:
    """:func:`adopt`, then move the process into the rank's cgroup (the
    ``cgroup.procs`` files ``join``). Only a live pidfd after the writes
    proves they moved that process (its pid cannot have been reused while it
    lived); ValueError if not, or if a write failed."""
    pidfd = adopt(pid, server_pid, uid, gid)
    try:
        for procs in join:
            fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, str(pid).encode())
            finally:
                os.close(fd)
        signal.pidfd_send_signal(pidfd, 0)
    except OSError as exc:
        os.close(pidfd)
        raise ValueError(f"process {pid} could not be moved into its cgroup: {exc.strerror or exc}") from None
    return pidfd


class RankServers:
    """The daemon's table of warm rank servers (see the module docstring)."""

    def __init__(self, start: Callable[[ServerKey, int, list], Awaitable[subprocess.Popen]], *, idle: float = IDLE_TIMEOUT, max_servers: int = MAX_SERVERS):
        self._start_process = start
        self.idle = idle
        self.max_servers = max_servers
        self.servers: dict[ServerKey, Server] = {}
        self._starting: set[ServerKey] = set()
        self._bad: dict[ServerKey, float] = {}
        self.forked = 0  # ranks started through a server (for tests and the bench)
        self.fallbacks = 0  # eligible ranks exec'd instead (no server ready, or it failed)

    def ready(self, key: ServerKey, spawn, rlimits: list) -> Server | None:
        """The ready server for ``key``, or None (and one is started in the
        background, with ``rlimits``: the user's own, as this job's ranks get
        them — a later job whose hard limits are higher is exec'd)."""
        server = self.servers.get(key)
        if server is not None and server.ready and server.popen.returncode is None and not server.gone.is_set():
            return server
        if server is None and key not in self._starting and self._bad.get(key, 0) < time.monotonic():
            mine = [s for s in self.servers.values() if s.key.uid == key.uid] + [k for k in self._starting if k.uid == key.uid]
            if len(self.servers) + len(self._starting) >= self.max_servers or len(mine) >= MAX_PER_USER:
                pool = [s for s in self.servers.values() if s.key.uid == key.uid] if len(mine) >= MAX_PER_USER else list(self.servers.values())
                idle = [s for s in pool if s.live == 0 and not s.lock.locked()]
                if not idle:
                    return None
                self._retire(min(idle, key=lambda s: s.last_used))
            self._starting.add(key)
            spawn(self._run_server, key, rlimits)
        return None

    async def _run_server(self, key: ServerKey, rlimits: list) -> None:
        """Start a server for ``key``, and own it until it exits."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                popen = await self._start_process(key, theirs.fileno(), rlimits)
            except Exception as exc:  # noqa: BLE001 -- a server that cannot start means exec, for a while
                log.info("no rank server for %s (uid %d): %s", key.executable, key.uid, exc)
                self._mark_bad(key)
                ours.close()
                return
        finally:
            theirs.close()
            self._starting.discard(key)
        server = Server(key, popen, trio.socket.from_stdlib_socket(ours), os.pidfd_open(popen.pid))
        self.servers[key] = server
        try:
            await self._hello(server)  # (EOF if the server dies meanwhile)
            while True:
                with trio.move_on_after(min(self.idle, 60.0)):
                    await trio.lowlevel.wait_readable(server.pidfd)
                    break
                # The server is the user's code, outside any job's cgroup: it does not outlive
                # its use by more than ``idle``, whatever it does (its own timer is its courtesy).
                if server.live <= 0 and time.monotonic() - server.last_used > self.idle:
                    log.debug("rank server %d (uid %d) idle for %g s: killed", server.pid, server.key.uid, self.idle)
                    self._retire(server)
        finally:
            server.gone.set()
            server.kill()
            if self.servers.get(key) is server:
                del self.servers[key]
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(popen.wait)
            os.close(server.pidfd)
            server.sock.close()

    async def _hello(self, server: Server) -> None:
        hello = None
        with trio.move_on_after(HELLO_TIMEOUT):
            hello = await _receive(server.sock)
        if not (isinstance(hello, dict) and hello.get("hello") == PROTOCOL and hello.get("pid") == server.popen.pid):
            log.info("rank server for %s (uid %d) did not start: %s", server.key.executable, server.key.uid, hello)
            self._mark_bad(server.key)
            server.kill()
            return
        server.pid = server.popen.pid
        server.ready = True
        log.debug("rank server %d for %s (uid %d) ready, warm: %s", server.pid, server.key.executable, server.key.uid, hello.get("warm"))

    async def fork_rank(self, server: Server, request: dict, fds: dict[str, int], join: list[str]) -> ServedRank | None:
        """Ask ``server`` for a rank; None: exec it instead (the server is retired if it misbehaved).
        ``fds``: the rank's stdout and stderr pipes; this closes the child's ends (``stdout``, ``stderr``)."""
        local: list[int] = []
        try:
            return await self._fork(server, request, fds, join, local)
        finally:
            for fd in local:
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def _fork(self, server: Server, request: dict, fds: dict[str, int], join: list[str], local: list[int]) -> ServedRank | None:
        local += [fds["stdout"], fds["stderr"]]  # (every fd here is closed on the way out unless it is the rank's)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        local += [ready_r, ready_w]
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        local += [go_r, go_w]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        local += [status_r, status_w]
        theirs = [fds["stdout"], fds["stderr"], ready_w, go_r, status_w]  # (sent or not, ours are closed: the server has copies)
        payload = json.dumps(request).encode()
        async with server.lock:
            if server.gone.is_set():
                return None
            server.last_used = time.monotonic()
            reply = None
            with trio.move_on_after(REPLY_TIMEOUT):
                try:
                    await server.sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(theirs))])
                except OSError:
                    pass
                else:
                    reply = await _receive(server.sock)
            for fd in theirs:
                local.remove(fd)
                os.close(fd)
            pid = reply.get("pid") if isinstance(reply, dict) else None
            if pid is None:
                log.warning("rank server %d (uid %d) failed a request (%s); ranks are exec'd", server.pid, server.key.uid, reply)
                self._retire(server)
                return None
            server.live += 1  # (until proven otherwise: the server's count of children)
        try:
            # Checked, then moved into the rank's cgroup while it sets itself up (it waits for "go" to run anything of the user's).
            pidfd = await trio.to_thread.run_sync(adopt_into, pid, server.pid, server.key.uid, server.key.gid, join)
        except ValueError as exc:
            server.live -= 1
            log.warning("rank server %d (uid %d) named %s; ranks are exec'd", server.pid, server.key.uid, exc)
            self._retire(server)
            return None
        local.append(pidfd)
        said = b""
        with trio.move_on_after(REPLY_TIMEOUT):
            stream = trio.lowlevel.FdStream(os.dup(ready_r))
            try:
                said = await stream.receive_some(256)  # "R", or "F" and why (then the child exits)
            finally:
                await stream.aclose()
        if not said.startswith(b"R"):
            # The child cannot be this rank exactly (or is stuck): it goes; the rank is exec'd.
            log.debug("rank server %d: child %d declined (%s); exec instead", server.pid, pid, said[1:].decode(errors="replace"))
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            server.live -= 1
            if said.startswith(b"Fstale"):  # its modules changed on disk since it imported them: a new server will
                self._retire(server)
            return None
        with contextlib.suppress(OSError):
            os.write(go_w, b"G")
        local.remove(pidfd)
        local.remove(status_r)
        self.forked += 1
        return ServedRank(pid, pidfd, fds["stdout_r"], fds["stderr_r"], status_r, server)

    def _mark_bad(self, key: ServerKey) -> None:
        """No server for ``key`` for a while (its start failed). Bounded: the oldest marks go first."""
        now = time.monotonic()
        for old in [k for k, until in self._bad.items() if until < now]:
            del self._bad[old]
        while len(self._bad) >= MAX_BAD:
            del self._bad[next(iter(self._bad))]
        self._bad[key] = now + BAD_KEY_FOR

    def _retire(self, server: Server) -> None:
        """Use ``server`` no more. Killed if it has no ranks; else told to end
        (its socket closed: it stops serving, and exits once its ranks have),
        for killing it would kill its ranks (PDEATHSIG), other jobs' among them."""
        if self.servers.get(server.key) is server:
            del self.servers[server.key]
        server.gone.set()
        if server.live <= 0:
            server.kill()
        else:
            server.sock.close()

    async def stop(self) -> None:
        for server in list(self.servers.values()):
            server.kill()
        self.servers.clear()


def _fd_bytes(fds: list[int]) -> bytes:
    import array

    return array.array("i", fds).tobytes()


async def _receive(sock) -> object:
    """One message from a server: JSON, bounded; any fds it tried to pass are closed."""
    data, ancdata, _, _ = await sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(16 * 4))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for fd in memoryview(payload[: len(payload) - len(payload) % 4]).cast("i"):
                with contextlib.suppress(OSError):
                    os.close(fd)
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None
