"""Links to the other daemons: connection, authentication, heartbeats, clocks.

Each daemon dials every other daemon (so each pair has two TCP connections,
one per direction) and sends its requests on the link it dialed; requests
from a peer arrive on the connection that peer dialed. These links carry
what must be fast (gang switches, checkpoint rounds, launches, output);
their heartbeats estimate the peers' clock offsets and say whether a link
works (``link.up``). Whether a *node* is alive is not theirs to judge: that
is etcd's, the same for every node at the same moment
(:mod:`gangd.daemon.controlplane`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..protocol import ProtocolError
from ..rpc import Channel, RemoteError, dial_tcp
from .clock import OffsetFilter
from .config import NodeSpec

log = logging.getLogger("gangd.peers")

#: Notes queued for one peer before more are dropped: a slow or stopped
#: peer costs a bounded queue.
OUTBOX_NOTES = 1024


def natural_key(name: str):
    """n2 sorts before n10 (used to pick the lowest-named live node)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class NodeDown(RemoteError):
    def __init__(self, node: str, why: str):
        super().__init__("node_down", f"node {node} is down: {why}")


@dataclass
class PeerLink:
    spec: NodeSpec
    channel: Channel | None = None
    up: bool = False
    last_ok: float | None = None  # monotonic time of the last answered heartbeat
    last_ok_wall: float | None = None
    info: dict = field(default_factory=dict)  # what the peer said about itself
    why_down: str = "not contacted yet"
    outbox: tuple = ()
    clock: OffsetFilter = field(default_factory=OffsetFilter)  # its wall clock minus ours
    scope: trio.CancelScope | None = None  # the connection's; cancelled to drop it
    #: Which life of the peer's daemon the connection reaches: its start time,
    #: as its first heartbeat answer says (None until then).
    life: float | None = None


class Peers:
    def __init__(self, *, config, secret: bytes, heartbeat_info: Callable[[], dict], spawn: Callable[..., None]):
        """``heartbeat_info``: what this node says about itself in each ping;
        ``spawn``: the daemon's contained tasks."""
        self.config = config
        self.secret = secret
        self.heartbeat_info = heartbeat_info
        self.spawn = spawn
        self.links: dict[str, PeerLink] = {spec.name: PeerLink(spec) for spec in self.config.peers}
        for link in self.links.values():
            link.outbox = trio.open_memory_channel(OUTBOX_NOTES)
        #: Whether etcd holds a node alive: the daemon plugs its membership in
        #: (that is not the links' to judge; every node alive until then).
        self.is_alive: Callable[[str], bool] = lambda _name: True
        #: The life (daemon start time) of the node's key that etcd last held:
        #: the life a "down" event ended (None if unknown).
        self.last_life: Callable[[str], object] = lambda _name: None

    # ------------------------------------------------------------ queries

    def drop_dead(self) -> None:
        """Drop the connection to every node etcd no longer holds alive: requests
        under way to it fail now (node_down) instead of waiting for a stalled peer.

        Only a connection to the life that ended: a daemon started again
        within its old lease's TTL revokes that lease (its key is deleted, the
        "down" the others see) and registers a moment later. A connection
        already made to that new life is kept, with the calls under way on
        it (a restart's rebuild on the returning node)."""
        for name, link in self.links.items():
            if link.scope is not None and self._reaches_an_ended_life(name, link):
                link.scope.cancel()

    def _reaches_an_ended_life(self, name: str, link: PeerLink) -> bool:
        if self.is_alive(name):
            return False
        ended = self.last_life(name)
        return link.life is None or ended is None or link.life == ended

    def link_up(self, name: str) -> bool:
        return name == self.config.node_name or (name in self.links and self.links[name].up)

    def clock_offset(self, name: str) -> float:
        """How far node ``name``'s wall clock is ahead of ours (seconds, estimated; 0 for this node)."""
        link = self.links.get(name)
        return link.clock.offset if link is not None else 0.0

    # ------------------------------------------------------------ calls

    def connected(self, name: str) -> bool:
        """Its connection is open right now (``link_up`` stays true through a
        dropped connection's grace period, while the link dials again)."""
        link = self.links.get(name)
        return name == self.config.node_name or (link is not None and link.up and link.channel is not None and not link.channel.closed)

    async def call(self, node: str, op: str, **args):
        return await (await self._open_channel(node)).request(op, **args)

    async def _open_channel(self, node: str) -> Channel:
        """The node's channel; a node that etcd holds alive but whose link is
        still dialing (it has just come back: the dial loop backs off up to a
        heartbeat interval, then shakes hands) is given a heartbeat timeout to
        connect -- the patience a link has for a dropped connection -- instead
        of being called down the moment it is up."""
        link = self.links.get(node)
        if link is not None and (link.channel is None or link.channel.closed) and self.is_alive(node):
            with trio.move_on_after(self.config.heartbeat_timeout):
                while (link.channel is None or link.channel.closed) and self.is_alive(node):  # noqa: ASYNC110 -- the dial loop sets no event
                    await trio.sleep(0.05)
        return self.channel(node)

    def channel(self, node: str) -> Channel:
        link = self.links.get(node)
        if link is None:
            raise RemoteError("no_such_node", f"no node named {node!r} in this cluster")
        if link.channel is None or link.channel.closed:
            raise NodeDown(node, link.why_down)
        return link.channel

    def broadcast(self, op: str, **args) -> None:
        """Queue a one-way note to every peer that is up (lost if it goes down
        or its queue is full: see OUTBOX_NOTES)."""
        for link in self.links.values():
            if link.up:
                self._queue(link, op, args)

    def send_note(self, node: str, op: str, **args) -> None:
        link = self.links.get(node)
        if link is not None and link.up:
            self._queue(link, op, args)

    @staticmethod
    def _queue(link: PeerLink, op: str, args: dict) -> None:
        try:
            link.outbox[0].send_nowait((op, args))
        except trio.WouldBlock:
            log.warning("node %s is not taking notes (%d queued); dropped a %r note", link.spec.name, OUTBOX_NOTES, op)

    # ------------------------------------------------------------ the links

    async def run(self, handler) -> None:
        async with trio.open_nursery() as nursery:
            for link in self.links.values():
                nursery.start_soon(self._maintain, link, handler)

    async def _maintain(self, link: PeerLink, handler) -> None:
        # This loop must outlive anything a peer does to us: a bug here would
        # otherwise cut this node off from the cluster for good.
        while True:
            try:
                await self._maintain_once(link, handler)
            except Exception:
                log.exception("link to %s failed unexpectedly; re-dialling", link.spec.name)
                link.channel = None
                self._mark_down(link, "internal error on the link (see log)", grace=True)
                await trio.sleep(self.config.heartbeat_interval)

    async def _maintain_once(self, link: PeerLink, handler) -> None:
        delay = 0.05
        spec = link.spec
        while True:
            try:
                channel = await dial_tcp(
                    spec.address,
                    spec.port,
                    node=self.config.node_name,
                    secret=self.secret,
                    label=f"node {spec.name} ({spec.endpoint})",
                    timeout=self.config.heartbeat_timeout,
                )
            except ProtocolError as exc:
                link.why_down = str(exc)
                log.error("node %s (%s) refused us: %s", spec.name, spec.endpoint, exc.message)
                self._mark_down(link, exc.message)
                await trio.sleep(max(delay, 1.0))
                continue
            except (OSError, trio.TooSlowError, RemoteError) as exc:
                # RemoteError: the connection broke mid-handshake (peer restarting).
                self._mark_down(link, f"cannot connect to {spec.endpoint}: {getattr(exc, 'strerror', None) or exc}")
                await trio.sleep(delay)
                delay = min(delay * 2, self.config.heartbeat_interval)
                continue
            delay = 0.05
            if channel.remote_node != spec.name:
                log.error("%s answered as node %r, expected %r; check [[nodes]]", spec.endpoint, channel.remote_node, spec.name)
                await channel.aclose()
                self._mark_down(link, f"{spec.endpoint} is node {channel.remote_node!r}, not {spec.name!r}")
                await trio.sleep(1.0)
                continue
            link.channel, link.life = channel, None
            async with trio.open_nursery() as nursery:
                link.scope = nursery.cancel_scope
                nursery.start_soon(self._run_channel, channel, handler, nursery.cancel_scope)
                nursery.start_soon(self._heartbeat, link, channel, nursery.cancel_scope)
                nursery.start_soon(self._drain_outbox, link, channel)
            link.channel = None
            self._mark_down(link, f"connection lost ({channel.close_reason or 'closed'})", grace=True)

    async def _run_channel(self, channel: Channel, handler, scope: trio.CancelScope) -> None:
        await channel.run(handler)
        scope.cancel()

    async def _drain_outbox(self, link: PeerLink, channel: Channel) -> None:
        receive = link.outbox[1]
        async for op, args in receive:
            try:
                await channel.note(op, **args)
            except RemoteError:
                return
            except ProtocolError as exc:  # larger than a frame: drop it, the catch-up resends by seq
                log.error("could not send %r to %s: %s", op, link.spec.name, exc)

    async def _heartbeat(self, link: PeerLink, channel: Channel, scope: trio.CancelScope) -> None:
        interval = self.config.heartbeat_interval
        timeout = self.config.heartbeat_timeout
        while True:
            sent, sent_wall = trio.current_time(), time.time()
            try:
                with trio.fail_after(timeout):
                    info = await channel.request("ping", **self.heartbeat_info())
            except trio.TooSlowError:
                # Slow, not gone: a peer that etcd still holds alive (busy, or
                # stalled for less than its lease) keeps its connection:
                # dropping it would fail every request under way on it, a
                # launch included. Once etcd says it is down, it is dropped here
                # (drop_dead() drops it at once if it reaches the life that ended).
                self._mark_down(link, f"no heartbeat answer on the link for {timeout:.1f} s (the peer is busy or stalled)")
                if not self.is_alive(link.spec.name):  # (whatever its life: a new one that is silent and not in etcd is stalled too)
                    scope.cancel()
                    return
                continue
            except RemoteError as exc:
                self._mark_down(link, str(exc))
                scope.cancel()  # drop the connection and dial again
                return
            link.last_ok = time.monotonic()
            link.last_ok_wall = time.time()
            link.info = info if isinstance(info, dict) else {}
            if link.life is None and isinstance(link.info.get("started"), float):
                link.life = link.info["started"]
            stamps = link.info.get("clock")
            if isinstance(stamps, list) and len(stamps) == 3 and all(isinstance(t, float) for t in stamps[:2]):
                link.clock.add(sent_wall, stamps[0], stamps[1], link.last_ok_wall)
                link.clock.heard(stamps[2])
            if not link.up:
                link.up = True
                link.why_down = ""
                log.info("link to node %s (%s) is up", link.spec.name, link.spec.endpoint)
            await trio.sleep_until(sent + interval)

    def _mark_down(self, link: PeerLink, why: str, grace: bool = False) -> None:
        """A dropped connection alone gets ``grace``: the peer is only declared
        down once it has also missed heartbeats for ``heartbeat_timeout``."""
        link.why_down = why
        if not link.up:
            return
        if grace and link.last_ok is not None and time.monotonic() - link.last_ok < self.config.heartbeat_timeout:
            # Keep it up for now; the re-dial loop either restores the link
            # in time or the next check declares the node down.
            self.spawn(self._expire, link)
            return
        link.up = False
        log.info("link to node %s (%s) is down: %s", link.spec.name, link.spec.endpoint, why)

    async def _expire(self, link: PeerLink) -> None:
        deadline = (link.last_ok or 0) + self.config.heartbeat_timeout
        await trio.sleep(max(0.0, deadline - time.monotonic()))
        if link.up and (link.channel is None or link.channel.closed or time.monotonic() - (link.last_ok or 0) >= self.config.heartbeat_timeout):
            link.up = False
            why = f"no heartbeat for {self.config.heartbeat_timeout:.1f} s ({link.why_down})"
            link.why_down = why
            log.info("link to node %s (%s) is down: %s", link.spec.name, link.spec.endpoint, why)
