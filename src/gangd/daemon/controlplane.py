"""This node's standing in the cluster, as etcd says it: alive, who else is, who coordinates.

Before etcd, each daemon judged from its own heartbeats who was alive and
who coordinated, so two nodes could judge differently: a stalled
coordinator came back to find its role taken, kept acting, and its ranks
ran on with no job to own them. Now one authority decides for everyone at
the same moment:

* **Liveness** is a lease per node (``lease_ttl`` seconds). Its node key
  lives on it; when the node stops renewing (a crash, a stall longer than
  the TTL, a partition from etcd) the key vanishes for every node at once,
  and the coordinator fails that node's jobs, once.
* **The coordinator** is the winner of etcd's election recipe, campaigning
  on the same lease, and its **term** is its election key's create
  revision. The term runs in a nursery of its own
  (:meth:`gangd.daemon.coordinator.Coordinator.serve_term`) that is
  cancelled the moment the lease is lost or another leader is observed: a
  deposed coordinator stops acting at once. Its writes are fenced in etcd
  (:class:`gangd.daemon.store.Fence`) and its commands carry the term:
  :meth:`ControlPlane.check_term` refuses a term older than the highest
  this node has seen.
* **A session** is one lease's life: register, read this node's part of
  the job table (the jobs placed on it), follow it, campaign. When the lease is lost the session ends and a new one
  starts as soon as etcd answers: the node reads the table anew and
  :func:`on_session` brings its ranks in line (a rank of a job no longer
  running here is killed), so a node back from a stall never keeps orphans
  and never takes back work it lost.
* **Its history.** Each session is a *life* of the node in etcd
  (:class:`gangd.daemon.store.NodeLog`): the node opens it, closes it as
  clean when it is stopped, and the coordinator closes it as *lost* when
  the node's key goes without that (a new coordinator sweeps the lives
  left open while nobody watched). The cluster's failure rates come from
  there, not from any one node's memory.
* **Isolated** (no session: etcd unreachable from here) the node accepts no
  new work and keeps its running ranks for ``grace`` seconds, then kills
  them (the coordinator failed their jobs when the lease expired).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable

import msgpack
import trio

from ..etcd.client import Compacted, Etcd, EtcdError
from ..etcd.election import Election
from ..etcd.lease import Lease, open_lease
from ..failpoint import hold
from ..rpc import RemoteError
from .peers import natural_key
from .store import Fence, JobTable, Keys, NodeLog

#: A test's hold point (:func:`gangd.failpoint.hold`): a node's new life waits
#: there before it takes its key from its previous life.
REGISTER_HOLD = "controlplane.register"

log = logging.getLogger("gangd.controlplane")


class ControlPlane:
    def __init__(
        self,
        *,
        etcd: Etcd,
        keys: Keys,
        node: str,
        node_info: Callable[[], dict],
        ttl: int,
        grace: float,
        table: JobTable,
        serve_term: Callable[[Fence, Lease], Awaitable[None]],
        on_session: Callable[[], Awaitable[None]],
        on_nodes_changed: Callable[[], None],
        on_grace_over: Callable[[str], Awaitable[None]],
        preferred: str | None = None,
    ):
        self.etcd = etcd
        self.keys = keys
        self.node = node
        self._node_info = node_info
        self.ttl = ttl
        self.grace = grace
        self.table = table
        self._serve_term = serve_term
        self._on_session = on_session
        self._on_nodes_changed = on_nodes_changed
        self._on_grace_over = on_grace_over
        self.preferred = preferred  # the configured master: others let it campaign first
        self.election = Election(etcd, keys.leader)
        self.nodelog = NodeLog(etcd, keys)
        # Nodes whose key went while this node coordinated: (name, lease), for the recorder.
        self._gone_send, self._gone_recv = trio.open_memory_channel[tuple[str, int]](256)
        self.up: set[str] = set()  # nodes whose key exists in etcd
        self.node_info: dict[str, dict] = {}
        self.leader: str | None = None
        self.leader_term = 0
        self.highest_term = 0  # the highest coordinator term this node has seen
        self.connected = False
        self.isolated_since: float | None = time.monotonic()
        self.why_isolated = "not connected to etcd yet"
        self.ready = trio.Event()  # the first session is up
        self._term_scope: trio.CancelScope | None = None
        self._my_term = 0

    # ------------------------------------------------------------ queries

    def is_up(self, name: str) -> bool:
        return name in self.up or (name == self.node and self.connected)

    def last_life(self, name: str) -> object:
        """Which life of the node's daemon its key in etcd last named (its start
        time; kept after the key goes: the life a "down" ended)."""
        return self.node_info.get(name, {}).get("started")

    def up_nodes(self) -> list[str]:
        return sorted(self.up | ({self.node} if self.connected else set()), key=natural_key)

    def coordinator(self) -> str | None:
        return self.leader

    def refuse_if_isolated(self) -> None:
        """New work needs etcd: say why not, plainly, when this node has no session."""
        if self.connected:
            return
        since = time.monotonic() - (self.isolated_since or time.monotonic())
        endpoints = ", ".join(self.etcd.endpoints)
        raise RemoteError(
            "etcd_unavailable",
            f"node {self.node} cannot reach the cluster's etcd ({endpoints}) for {since:.0f} s: {self.why_isolated}. "
            f"It takes no new work until it can; its running ranks keep running for up to {self.grace:g} s",
        )

    def check_term(self, term: object, op: str, from_node: str | None) -> None:
        """A coordinator's command: refused if its term is older than one this node has seen."""
        if not isinstance(term, int) or isinstance(term, bool) or term <= 0:
            raise RemoteError("stale_term", f"{op!r} needs the coordinator's term")
        if term < self.highest_term:
            log.warning("refused %r from %s: its coordinator term %d is older than term %d", op, from_node, term, self.highest_term)
            raise RemoteError("stale_term", f"refused {op!r}: coordinator term {term} is over (term {self.highest_term} is current)")
        self.highest_term = term

    # ------------------------------------------------------------ the sessions

    async def run(self) -> None:
        delay = 0.1
        grace_over = False
        while True:
            try:
                await self._session()
                why = "its lease in etcd was lost (a stall or a partition longer than the lease TTL)"
            except EtcdError as exc:
                why = exc.message
            except Exception:  # a bug must not cut the node off for good: logged, retried
                log.exception("the etcd session failed")
                why = "internal error (see the log)"
            if self.connected or self.isolated_since is None:
                self.isolated_since = time.monotonic()
                grace_over = False
                log.warning("node %s has no session with etcd: %s; no new work until it has", self.node, why)
            self.connected = False
            self.why_isolated = why
            if not grace_over and time.monotonic() - self.isolated_since >= self.grace and self.ready.is_set():
                grace_over = True
                await self._on_grace_over(f"node {self.node} could not reach etcd for {self.grace:g} s")
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _session(self) -> None:
        async with open_lease(self.etcd, self.ttl) as lease:
            await self.nodelog.begin(self.node, lease.id)
            try:
                await self._serve_session(lease)
            finally:
                if trio.current_effective_deadline() == -math.inf and not lease.lost.is_set():
                    # Cancelled from outside: the daemon is being stopped. This
                    # life ends clean (written before the lease is revoked, so
                    # no coordinator counts a loss).
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        try:
                            await self.nodelog.end(self.node, lease.id, clean=True, reason="the daemon was stopped")
                        except EtcdError as exc:
                            log.info("could not record a clean stop in etcd: %s", exc.message)

    async def _serve_session(self, lease: Lease) -> None:
        self.table.narrow()  # (this node's jobs: a term, which widens it, lives inside a session)
        await self.table.load()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._record_losses)
            await nursery.start(self.table.follow)
            await nursery.start(self._watch_nodes)
            await nursery.start(self._observe)
            # Up for the others only now that this node can take work: its
            # table is read and followed (a launch sent on seeing the key is
            # not refused for "not connected yet").
            await self._register(lease)
            self.connected = True
            self.isolated_since = None
            log.info("node %s joined the cluster in etcd (lease %x, ttl %d s, revision %d)", self.node, lease.id, lease.ttl, self.table.revision)
            await self._on_session()
            self.ready.set()
            nursery.start_soon(self._campaign, lease)
            await lease.lost.wait()
            nursery.cancel_scope.cancel()

    async def _register(self, lease: Lease) -> None:
        key = self.keys.node(self.node)
        await hold(REGISTER_HOLD)
        previous = await self.etcd.get(key)
        if previous is not None and previous.lease and previous.lease != lease.id:
            # This node's previous life (a restart, or a session that lost
            # its lease): give up its lease now, so its election key goes at
            # once rather than at the end of its TTL.
            try:
                await self.etcd.lease_revoke(previous.lease)
            except EtcdError as exc:
                log.debug("revoking the previous lease %x: %s", previous.lease, exc)
        await self.etcd.put(key, msgpack.packb({**self._node_info(), "lease": lease.id}), lease=lease.id)

    async def _watch_nodes(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            page = await self.etcd.range(self.keys.nodes, prefix=True)
            self.up, self.node_info = set(), {}
            for kv in page.kvs:
                self._node_put(kv.key, kv.value)
            self._on_nodes_changed()
            if not started:
                started = True
                task_status.started()
            try:
                async with self.etcd.watch(self.keys.nodes, prefix=True, start_revision=page.revision + 1) as batches:
                    async for batch in batches:
                        for event in batch:
                            if event.type == "PUT":
                                self._node_put(event.kv.key, event.kv.value)
                            else:
                                name = event.kv.key.decode("utf-8", "replace")[len(self.keys.nodes):]
                                if name in self.up:
                                    self.up.discard(name)
                                    log.warning("node %s is down: its lease in etcd expired or was revoked", name)
                                    lease = self.node_info.get(name, {}).get("lease")
                                    if self._term_scope is not None and isinstance(lease, int):
                                        try:
                                            self._gone_send.send_nowait((name, lease))
                                        except trio.WouldBlock:  # (the next coordinator's sweep closes it)
                                            pass
                        self._on_nodes_changed()
            except Compacted:
                continue

    async def _record_losses(self) -> None:
        """Close the life of each node whose key went while this node coordinated (once: a CAS)."""
        async for name, lease in self._gone_recv:
            try:
                await self.nodelog.end(name, lease, clean=False, reason=f"its lease in etcd expired (no keep-alive for {self.ttl} s)")
            except EtcdError as exc:
                log.warning("could not record the loss of node %s: %s", name, exc.message)

    async def _sweep_lives(self) -> None:
        """A new coordinator: lives left open by nodes lost while nobody coordinated are closed as lost."""
        alive = {name: info["lease"] for name, info in self.node_info.items() if name in self.up and isinstance(info.get("lease"), int)}
        try:
            await self.nodelog.sweep(alive)
        except EtcdError as exc:
            log.warning("could not sweep the nodes' lives: %s", exc.message)

    def _node_put(self, key: bytes, value: bytes) -> None:
        name = key.decode("utf-8", "replace")[len(self.keys.nodes):]
        try:
            info = msgpack.unpackb(value, raw=False)
        except Exception:  # noqa: BLE001 -- a damaged value still says the node is alive
            info = {}
        if name not in self.up:
            log.info("node %s is up", name)
        self.up.add(name)
        self.node_info[name] = info if isinstance(info, dict) else {}

    async def _observe(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        started = False
        async with contextlib.aclosing(self.election.observe()) as leaders:
            async for current in leaders:
                self._observed(current)
                if not started:
                    started = True
                    task_status.started()

    def _observed(self, current: tuple[bytes, int] | None) -> None:
        if current is None:
            self.leader, self.leader_term = None, 0
            return
        value, term = current
        self.leader, self.leader_term = value.decode("utf-8", "replace"), term
        self.highest_term = max(self.highest_term, term)
        log.info("coordinator: %s (term %d)", self.leader, term)
        if self._term_scope is not None and term != self._my_term:
            log.warning("another coordinator (%s, term %d) observed: ending term %d", self.leader, term, self._my_term)
            self._term_scope.cancel()

    async def _campaign(self, lease: Lease) -> None:
        if self.preferred and self.preferred != self.node and self.preferred in self.up and self.leader is None:
            await trio.sleep(min(2.0, self.ttl / 2))  # the configured master first, if it is alive
        while not lease.lost.is_set():
            leadership = await self.election.campaign(lease, self.node.encode())
            fence = Fence(leadership.key, leadership.term)
            self.highest_term = max(self.highest_term, fence.term)
            self._my_term = fence.term
            log.info("node %s is the coordinator, term %d", self.node, fence.term)
            try:
                with trio.CancelScope() as self._term_scope:
                    await self._sweep_lives()
                    await self._serve_term(fence, lease)
            except RemoteError as exc:  # Deposed: etcd refused a fenced write
                log.warning("term %d ended: %s", fence.term, exc.message)
            except Exception:
                log.exception("term %d as coordinator failed", fence.term)
            finally:
                self._term_scope = None
                self._my_term = 0
                log.info("node %s's term %d as coordinator ended", self.node, fence.term)
            if not lease.lost.is_set():
                # The term ended with the lease still ours (a newer leader was
                # observed, or the term failed): give the key up and campaign again.
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    try:
                        await self.election.resign(leadership)
                    except EtcdError:
                        pass
                await trio.sleep(self.ttl / 2)
