"""The node daemon: owns this node's ranks, talks to its peers and its users.

One trio task tree per process. The root nursery holds the listeners, the
peer links, this node's session with etcd (which runs the coordinator's
term when this node wins the election, see :mod:`.controlplane`), the exit
reporter and the rank watchers; nothing runs outside it. This class is
where the components are built and wired: each gets what it uses. Requests from local users arrive on a Unix socket
(their uid comes from SO_PEERCRED, never from the wire); requests from peers
arrive on TCP after the HMAC handshake. See :mod:`gangd.daemon.handlers` for what
each request does.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import math
import os
import signal
import socket
import stat
import time
from typing import Any

import trio

from .. import safefs
from ..etcd.client import Etcd
from ..protocol import Connection, ProtocolError, Request, Role
from ..protocol import State as ConnState
from ..rpc import HANDSHAKE_TIMEOUT, Channel, RemoteError, peer_credentials
from ..safefs import UnsafePath
from .admission import Counter, Handshakes, Limits, Refused, SharedBytes, TokenBucket, UserNames
from .calls import Calls
from .cgroup import CgroupTree
from .checkpoint import NodeCheckpoints
from .config import Config
from .controlplane import ControlPlane
from .coordinator import Coordinator
from .flush import Flusher
from .handlers import Dispatcher, Services
from .handlers.jobs import Listing
from .jobnet import JobNet
from .names import NameService
from .node import NodeJobs
from .notify import SystemdNotifier, watchdog_loop
from .outputlog import OutputError, OutputStore
from .peers import Peers
from .pmi import PmiServer
from .ranks import LocalRanks, Rank
from .store import JobTable, Keys
from .tasks import Tasks

log = logging.getLogger("gangd.daemon")


class StartupError(Exception):
    pass


class Daemon:
    """Builds the node's components, each with what it uses, and runs their
    tasks. Dependencies point one way: the handlers (:mod:`.handlers`) call
    the domain (the coordinator, this node's jobs, the checkpoints), which
    calls the infrastructure (etcd's table and membership, the peer links
    through :mod:`.calls`, the ranks); nothing below calls back up."""

    def __init__(self, config: Config):
        self.config = config
        self.node = config.node_name
        self.secret = config.read_secret()
        self.etcd = _etcd_client(config)
        self.table = JobTable(self.etcd, Keys(config.etcd.prefix), node=self.node)
        self.tasks = Tasks()
        self.peers = Peers(config=config, secret=self.secret, heartbeat_info=self.heartbeat_info, spawn=self.tasks.spawn)
        self.membership = ControlPlane(
            etcd=self.etcd, keys=self.table.keys, node=self.node, node_info=self._node_info, ttl=config.etcd.lease_ttl,
            grace=config.etcd.grace, table=self.table, serve_term=self._serve_term,
            on_session=self._session_started, on_nodes_changed=self._nodes_changed, on_grace_over=self._grace_over,
            preferred=config.master,
        )
        self.peers.is_alive = self.membership.is_up
        self.peers.last_life = self.membership.last_life
        self.calls = Calls(
            node=self.node, peers=self.peers, membership=self.membership,
            patience=config.etcd.lease_ttl + 2 * config.heartbeat_timeout,
        )
        self.coordinator = Coordinator(
            node=self.node, config=config, table=self.table, membership=self.membership, calls=self.calls, peers=self.peers,
        )
        tag = hashlib.sha1(str(config.state_dir.resolve()).encode(), usedforsecurity=False).hexdigest()[:8]
        instance = f"gangd-{self.node}-{tag}"
        self.cgroups = CgroupTree(instance, config.cgroup_limits)
        self.outputs = OutputStore(config.output_root, self.node, config.output_limit, config.output_reserve)
        self.ranks = LocalRanks(
            node=self.node, socket_path=config.socket, cgroups=self.cgroups, on_exit=self._rank_exited, rlimit_caps=config.rlimit_caps,
            outputs=self.outputs, rank_server=config.rank_server,
        )
        # Rank sockets and counters: in root's runtime directory (systemd's
        # RuntimeDirectory, a tmpfs; a local cluster's node directory), never
        # a predictable name in a world-writable one such as /dev/shm.
        self.jobnet = JobNet(
            node=self.node, address=config.node.address, runtime_dir=config.runtime_root, table=self.table, ranks=self.ranks,
            tasks=self.tasks, call=self.calls.call, on_job_gone=self._job_gone,
        )
        self.table.listeners.append(self.jobnet.on_record)
        self.checkpoints = NodeCheckpoints(
            node=self.node, config=config, table=self.table, jobnet=self.jobnet, peers=self.peers, calls=self.calls, secret=self.secret,
            job_env=lambda job_id: self.ranks.envs.get(job_id, {}), spawn=self.tasks.spawn,
        )
        self.pmi = PmiServer(node=self.node, table=self.table, calls=self.calls, spawn=self.tasks.spawn, note=self.ranks.note)
        self.names = NameService(
            etcd=self.etcd, keys=self.table.keys, table=self.table, spawn=self.tasks.spawn, fence=self.coordinator.current_fence,
        )
        self.table.listeners.append(self.names.on_record)
        self.node_jobs = NodeJobs(
            node=self.node, table=self.table, ranks=self.ranks, jobnet=self.jobnet, pmi=self.pmi, checkpoints=self.checkpoints,
            outputs=self.outputs, membership=self.membership, spawn=self.tasks.spawn, jobs_dir=config.state_dir / "jobs",
            checkpoint_root=config.checkpoint_root, call=self.calls.call,
        )
        self.table.listeners.append(self.node_jobs.kill_if_ended)
        self.flusher = Flusher(node=self.node, root=self.checkpoints.root, flush_dir=config.checkpoint_flush_dir,
                               max_file=config.checkpoint_max_rank_bytes)
        self.dispatcher = Dispatcher(
            Services(
                node=self.node, config=config, table=self.table, membership=self.membership, calls=self.calls,
                coordinator=self.coordinator, node_jobs=self.node_jobs,
                listing=Listing(table=self.table, calls=self.calls, membership=self.membership),
                jobnet=self.jobnet, pmi=self.pmi, names=self.names, checkpoints=self.checkpoints, peers=self.peers, ranks=self.ranks,
                flusher=self.flusher,
                spawn=self.tasks.spawn, heartbeat_info=self.heartbeat_info, resend_exits=self.node_jobs.resend_exits,
            ),
            check_term=self.membership.check_term,
        )
        self.calls.local = self.dispatcher.dispatch_peer
        self.started = time.time()
        self._membership = trio.Event()
        self.shutting_down = False

    # ------------------------------------------------------------ helpers for the parts

    def spawn(self, fn, *args) -> None:
        """Start a task owned by the daemon's root nursery, contained (see :mod:`.tasks`)."""
        self.tasks.spawn(fn, *args)

    async def _serve_term(self, fence, lease) -> None:
        await self.coordinator.serve_term(fence, lease)

    def _job_gone(self, job_id: int) -> None:
        """An ended job's last rank here is gone: its checkpoint and PMI state go too."""
        self.checkpoints.forget(job_id)
        self.pmi.forget(job_id)

    def heartbeat_info(self) -> dict:
        return {
            "node": self.node,
            "cores": self.config.node.cores,
            "running": self.ranks.running(),
            "started": self.started,
        }

    def _node_info(self) -> dict:
        """What this node's key in etcd says about it."""
        return {"cores": self.config.node.cores, "endpoint": self.config.node.endpoint, "started": self.started, "pid": os.getpid()}

    # ------------------------------------------------------------ the session with etcd

    async def _session_started(self) -> None:
        await self.node_jobs.session_started()

    async def _grace_over(self, why: str) -> None:
        await self.node_jobs.grace_over(why)

    def _rank_exited(self, entry: Rank) -> None:
        self.node_jobs.rank_exited(entry)

    def _nodes_changed(self) -> None:
        self.peers.drop_dead()
        if self.coordinator.active:
            self.coordinator.nodes_changed()

    # ------------------------------------------------------------ main

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        self._prepare_state_dir()
        self._raise_priority()
        try:
            self.outputs.prepare()
        except OutputError as exc:
            raise StartupError(str(exc)) from None
        # Both checked from / (owner root, no links, writable by no one
        # else) and used through their fds from here on (gangd.safefs).
        try:
            self.jobnet.open_runtime()
        except UnsafePath as exc:
            raise StartupError(f"refusing the runtime directory (runtime_dir): {exc}") from None
        try:
            self.checkpoints.open_root()
        except UnsafePath as exc:
            raise StartupError(f"refusing the checkpoint directory (checkpoint_dir): {exc}") from None
        leftovers = self.cgroups.sweep()
        if leftovers:
            log.warning("killed processes left over from a previous run in jobs %s", leftovers)
        notifier = SystemdNotifier.from_environ()
        unix_listener = self._open_unix_listener()
        tcp_listeners = await self._open_tcp_listeners()
        log.info(
            "gangd %s listening on %s and %s (%d nodes, state in %s)",
            self.node, config.node.endpoint, config.socket, len(config.nodes), config.state_dir,
        )
        try:
            async with trio.open_nursery() as nursery:
                self.tasks.nursery = nursery
                nursery.start_soon(self._serve_listeners, unix_listener, Role.CLIENT)
                for listener in tcp_listeners:
                    nursery.start_soon(self._serve_listeners, listener, Role.PEER)
                nursery.start_soon(self.peers.run, self.dispatcher.handle)
                nursery.start_soon(self.membership.run)
                nursery.start_soon(self.node_jobs.report_exits)
                nursery.start_soon(self.flusher.check_at_start)  # (in a thread: a hung shared file system never holds the start)
                nursery.start_soon(self._handle_signals, nursery.cancel_scope, notifier)
                if notifier:
                    nursery.start_soon(watchdog_loop, notifier)
                    notifier.ready(f"serving {len(config.nodes)}-node cluster as {self.node}")
                task_status.started(self)
        finally:
            try:
                os.unlink(config.socket)
            except OSError:
                pass
            self.cgroups.close()
            self.outputs.close()
            self.jobnet.close_runtime()
            self.checkpoints.close_root()
            with trio.CancelScope(shield=True):
                await self.etcd.aclose()
            log.info("gangd %s stopped", self.node)

    def _prepare_state_dir(self) -> None:
        state = self.config.state_dir
        try:
            fd = safefs.open_trusted_dir(state, create_mode=0o711)
        except UnsafePath as exc:
            raise StartupError(f"refusing the state directory: {exc}") from None
        try:
            # Traversable, not listable: job owners' ranks reach their
            # checkpoint directories below it (every file in it has its own mode).
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o011 != 0o011:
                os.fchmod(fd, mode | 0o011)
            probe = os.open(".write-test", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            os.close(probe)
            os.unlink(".write-test", dir_fd=fd)
        except OSError as exc:
            raise StartupError(f"state directory {state} is not usable: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def _raise_priority(self) -> None:
        # A node full of busy ranks must not starve the daemon: heartbeats
        # and gang switches are latency-critical. A raised nice value is not
        # enough for switches — CFS still lets each busy rank finish its
        # slice first (milliseconds) — so where allowed the daemon runs
        # SCHED_RR: it preempts ranks the moment it has work, and is idle
        # otherwise (the kernel's RT throttling still bounds it). Ranks are
        # demoted to ordinary tasks just before their exec (ranks.py);
        # helper threads (disk writes) keep the priority, so a node full of
        # busy ranks cannot starve the job table's fsyncs either.
        config = self.config
        if config.realtime_priority > 0:
            try:
                os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(config.realtime_priority))
                log.info("running SCHED_RR priority %d", config.realtime_priority)
                return
            except OSError as exc:
                log.info("could not use real-time scheduling (SCHED_RR %d): %s", config.realtime_priority, exc.strerror)
        if config.nice < 0:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, config.nice)
                log.info("running at nice %d", config.nice)
            except OSError as exc:
                log.info("could not raise scheduling priority (nice %d): %s", config.nice, exc.strerror)

    def _open_unix_listener(self) -> trio.SocketListener:
        path = self.config.socket
        # Its directory is root's and writable by no one else (a sticky one
        # such as /tmp at most), so nobody can swap the name for a link
        # between the checks below and the chmod.
        try:
            dir_fd = safefs.open_trusted_dir(path.parent, create_mode=0o755, sticky_ok=True)
        except UnsafePath as exc:
            raise StartupError(f"refusing the socket's directory: {exc}") from None
        try:
            try:
                info = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                info = None
            if info is not None:
                if not stat.S_ISSOCK(info.st_mode) or info.st_uid not in safefs.trusted_uids():
                    raise StartupError(f"{path} exists and is not a socket of root's: remove it, or choose another socket path")
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(path))
                except OSError:
                    os.unlink(path.name, dir_fd=dir_fd)  # stale socket of a daemon that died
                else:
                    raise StartupError(f"another gangd is already serving {path}")
                finally:
                    probe.close()
            # Sync bind on a fresh socket: trio's async bind resolves names we do not have.
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.bind(str(path))
            sock = trio.socket.from_stdlib_socket(raw)
            # Anybody may connect; who they are comes from SO_PEERCRED. The
            # mode is set through an O_PATH fd of the socket just bound
            # (Linux has no lchmod): never through a link.
            node = os.open(path.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if not stat.S_ISSOCK(os.fstat(node).st_mode):
                    raise StartupError(f"{path} was replaced while the daemon bound it")
                os.chmod(f"/proc/self/fd/{node}", 0o666)  # noqa: S103 -- every user may connect; SO_PEERCRED says who
            finally:
                os.close(node)
        finally:
            os.close(dir_fd)
        sock.listen(128)
        return trio.SocketListener(sock)

    async def _open_tcp_listeners(self):
        spec = self.config.node
        try:
            return await trio.open_tcp_listeners(spec.port, host=spec.address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"{spec.endpoint} is already in use (another gangd?)") from None
            raise StartupError(f"cannot listen on {spec.endpoint}: {exc.strerror or exc}") from None

    @functools.cached_property
    def _guard(self) -> _ConnectionGuard:
        return _ConnectionGuard(Limits())

    async def _serve_listeners(self, listener: trio.SocketListener, role: Role) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:  # EMFILE and friends: back off, keep serving
                    log.error("accept failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                self.spawn(self._serve_connection, stream, role)

    async def _serve_connection(self, stream, role: Role) -> None:
        """One accepted connection, from its limits through its handshake to its end.

        Limits are checked before anything else is spent on it: a TCP
        connection takes a handshake slot of its address (released once it
        authenticated: then it holds the cluster secret, and is trusted as a
        node; a newer connection from a full address evicts the oldest), a
        Unix connection a slot of its uid for its whole life.
        """
        guard = self._guard
        limits = guard.limits
        try:
            if role is Role.PEER:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                host, port = stream.socket.getpeername()[:2]
                label = f"peer connection from {host}:{port}"
                conn = Connection(
                    dialer=False, node=self.node, secret=self.secret, accept=frozenset({Role.PEER}),
                    max_in_flight=limits.peer_in_flight,
                )
            else:
                pid, uid, gid = peer_credentials(stream)
                label = f"client pid {pid} uid {uid}"
                conn = Connection(
                    dialer=False, node=self.node, accept=frozenset({Role.CLIENT}), max_in_flight=limits.client_in_flight,
                    max_request_frame=limits.client_max_frame, max_in_flight_bytes=limits.client_in_flight_bytes,
                    budget=None if uid == 0 else guard.in_flight_bytes.budget(uid),
                )
        except OSError:  # gone before we looked at it
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        # Cancelled when a newer connection from the same address evicts this one.
        evictable = trio.CancelScope()
        try:
            if role is Role.PEER:
                slot: Any = guard.handshakes.admit(host, evictable.cancel, lambda: conn.state is ConnState.HELLO)
            else:
                slot = guard.hold_uid(uid, self._local_ranks_of(uid))
        except Refused as refused:
            log.warning("refused %s: %s", label, refused.message)
            await _refuse(stream, conn, refused)
            return
        with slot:
            if role is Role.CLIENT:
                context: dict[str, Any] = {"peer": False, "cred": await self._credentials(uid, gid), "pid": pid}
                channel = Channel(stream, conn, label=label, read_size=limits.client_read_size)
                timeout = HANDSHAKE_TIMEOUT
            else:
                context = {"peer": True}
                channel = Channel(stream, conn, label=label, max_notes=limits.peer_in_flight)
                timeout = limits.peer_handshake_timeout
            channel.context = context
            ready = None
            try:
                with evictable:
                    ready = await channel.handshake(timeout)
            except (ProtocolError, trio.TooSlowError, RemoteError) as exc:
                why = f"no handshake within {timeout:g} s" if isinstance(exc, trio.TooSlowError) else str(exc)
                log.warning("refused %s: %s", label, why)
            if ready is None:
                if evictable.cancelled_caught:
                    guard.log_eviction(label, host)
                with trio.CancelScope(shield=True), trio.move_on_after(0.5):
                    try:
                        await stream.send_all(conn.data_to_send())
                    except Exception:  # noqa: BLE001, S110 -- best effort: the reason for a refusal, to a client that may be gone
                        pass
                    await stream.aclose()
                return
            if role is Role.PEER:
                slot.close()  # authenticated: no longer counts against its address
                channel.label = f"node {ready.node}"
                context["node"] = ready.node
                if ready.node not in {n.name for n in self.config.nodes}:
                    log.warning("refused %s: node %r is not in this cluster's [[nodes]]", label, ready.node)
                    await channel.aclose()
                    return
            else:
                handler = guard.rate_limited(context["cred"]["uid"], self.dispatcher.handle)
            try:
                await channel.run(self.dispatcher.handle if role is Role.PEER else handler)
            finally:
                self.jobnet.detached(channel)
                self.checkpoints.detached(channel)

    def _local_ranks_of(self, uid: int) -> int:
        """Ranks of ``uid``'s jobs running on this node (each may hold a few connections)."""
        count = 0
        for (job_id, _), entry in self.ranks.ranks.items():
            record = self.table.get(job_id)
            if entry.status is None and record is not None and record["owner_uid"] == uid:
                count += 1
        return count

    async def _credentials(self, uid: int, gid: int) -> dict:
        """Who a local client is: the kernel's uid/gid, the name from NSS (off the loop, cached)."""
        return {"uid": uid, "gid": gid, "user": await self._guard.names.name(uid)}

    # ------------------------------------------------------------ signals

    async def _checkpoint_all(self) -> None:
        try:
            started = await self.calls.to_coordinator("coord_checkpoint_all", trigger=f"SIGUSR1 to gangd on {self.node}")
        except RemoteError as exc:
            log.warning("SIGUSR1: could not start the checkpoints: %s", exc)
            return
        said = [f"job {c['job']}: not checkpointed ({c['refused']})" if "refused" in c else f"job {c['job']} generation {c['gen']}" for c in started]
        log.info("SIGUSR1: checkpoints started: %s", ", ".join(said) or "no running jobs")

    async def _handle_signals(self, scope: trio.CancelScope, notifier) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    log.info("received SIGUSR1: checkpointing every running job of the cluster")
                    self.spawn(self._checkpoint_all)
                    continue
                log.info("received %s: stopping (killing this node's ranks)", signal.Signals(signum).name)
                self.shutting_down = True
                if notifier:
                    notifier.stopping("killing ranks")
                with trio.move_on_after(10):
                    await self.ranks.kill_all()
                    # Give the exit reports a moment to reach the coordinator.
                    await self.node_jobs.drain_reports(1)
                scope.cancel()
                return



class _Slot:
    """A held connection slot; released once, by close() or at the end of the with-block."""

    def __init__(self, counter: Counter, key):
        self._counter: Counter | None = counter
        self._key = key

    def close(self) -> None:
        if self._counter is not None:
            self._counter.release(self._key)
            self._counter = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ConnectionGuard:
    """The daemon's connection limits, rate limits and user-name cache (see :mod:`.admission`)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.handshakes = Handshakes(limits.handshakes_per_address, limits.handshakes_total)
        self.by_uid = Counter(
            limits.connections_per_uid, "uid",
            "{what} {key} has {held} connections to this daemon already (limit {limit}, with its ranks running here)",
        )
        self.in_flight_bytes = SharedBytes(limits.uid_in_flight_bytes)
        self._evicted = 0
        self._evicted_logged = -math.inf
        self.requests = TokenBucket(limits.requests_per_second, limits.request_burst)
        self.names = UserNames(limits)

    def log_eviction(self, label: str, host: str) -> None:
        """Log an evicted handshake, at most once a second (a churning attacker must not flood the log)."""
        self._evicted += 1
        now = time.monotonic()
        if now - self._evicted_logged >= 1.0:
            log.warning(
                "dropped %s: still in its handshake when a newer connection from %s needed its slot (%d per address;"
                " %d dropped since the last such message)", label, host, self.limits.handshakes_per_address, self._evicted,
            )
            self._evicted_logged, self._evicted = now, 0

    def hold_uid(self, uid: int, local_ranks: int = 0) -> _Slot:
        limits = self.limits
        limit = limits.connections_root if uid == 0 else limits.connections_per_uid + limits.connections_per_rank * local_ranks
        self.by_uid.take(uid, limit)
        return _Slot(self.by_uid, uid)

    def rate_limited(self, uid: int, handle):
        """``handle`` behind uid's token bucket (requests only; notes are the
        ranks' messaging and bounded by the channel instead). Root is exempt."""
        if uid == 0:
            return handle
        bucket = self.requests

        async def limited(channel, message):
            if isinstance(message, Request) and not bucket.take(uid):
                raise RemoteError(
                    "busy",
                    f"busy: uid {uid} sent more than {bucket.rate:.0f} requests a second (burst {bucket.burst:.0f}); retry in a moment",
                )
            return await handle(channel, message)

        return limited


async def _refuse(stream, conn: Connection, refused: Refused) -> None:
    """Tell a connection beyond a limit why (a bye frame its client shows), then close it."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(0.5):
            try:
                await stream.send_all(conn.send_bye(refused.code, refused.message))
                # Take the hello it sent before closing: a socket closed with
                # unread data resets the connection, and the reset could
                # overtake the bye on its way to the client.
                await stream.receive_some(4096)
            except Exception:  # noqa: BLE001, S110 -- best effort: the bye to a refused client that may be gone
                pass
        await stream.aclose()


def _etcd_client(config: Config) -> Etcd:
    settings = config.etcd
    return Etcd(
        list(settings.endpoints), ca=_str(settings.ca_file), cert=_str(settings.cert_file), key=_str(settings.key_file),
        user=settings.user, password=settings.read_password(),
    )


def _str(path) -> str | None:
    return None if path is None else str(path)
