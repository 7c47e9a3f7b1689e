"""Bounds on what one address or one user may take of a daemon.

The daemon runs as root on every node and answers anybody who can reach its
TCP port or its Unix socket, so nothing about a connection may cost it
unbounded memory, tasks or event-loop time:

* :class:`Handshakes` — TCP connections still in their handshake, per
  source address and in total. A new one beyond a limit is never refused:
  it *evicts* the oldest unauthenticated connection of its address (of the
  address holding the most, when the total is full) — the oldest that has
  not even sent a hello, if any. A local user can open
  connections from any node's address (the node it is logged in on, or any
  127.x on the node itself); were the newest refused, holding 16 silent
  connections would keep that node's daemon from re-dialling and make it
  declare this one down. Evicting the oldest lets the attacker only churn:
  a real peer's handshake takes milliseconds, and the listener gives an
  unauthenticated connection ``peer_handshake_timeout`` (1 s). A real
  peer's hello arrives with its first packet, so silent connections go
  first: each one evicted and re-opened lands behind the peer's.
* :class:`Counter` — connections per local uid, refused beyond the limit
  with a ``bye`` that says why (the client shows it). The limit grows by
  ``connections_per_rank`` for every rank of that uid running on the node:
  each rank holds a link for its messaging and one for its checkpoint
  agent, so a fixed limit would refuse a user's own full-node job on a node
  of more than 128 cores. (Rather than exempting rank processes by pid: a
  rank may fork, and its children would need the same walk of the cgroup.)
* :class:`SharedBytes` — bytes of request (and note) frames a uid has in
  flight across all its connections; beyond it requests are answered
  ``busy``, a large frame is refused before its payload is read (see
  :mod:`gangd.protocol.connection`, "Bounds").
* :class:`TokenBucket` — requests per uid and second; beyond it a request is
  answered ``busy`` (the client may retry). Root is exempt: the admin's
  tools and the daemons' own cluster start-up must never be throttled.
* :class:`UserNames` — uid → user name off the event loop: NSS may be LDAP,
  and a lookup that hangs on the loop of a SCHED_RR daemon makes the node
  miss its heartbeats ("down") and its gang switches. Results are cached
  with a TTL, the cache is bounded, lookups for one uid are shared, and a
  lookup that takes too long falls back to the number.

All of it is plain state driven by the server; the numbers live in
:class:`Limits`.

Worst case per local uid
------------------------
What one user's connections can make the daemon hold, with the defaults:
``uid_in_flight_bytes`` (64 MiB) of request and note frames being served,
plus per connection at most one small frame being received
(:data:`~gangd.protocol.connection.BIG_FRAME`, 64 KiB; bigger ones are
charged to the 64 MiB before they are read), one read (``client_read_size``,
64 KiB) and the unsent ``busy`` answers
(:data:`~gangd.protocol.connection.DEFAULT_MAX_OUTBOX`, 64 KiB): ~192 KiB.
With ``connections_per_uid`` (256) connections that is 64 + 48 = 112 MiB,
and 4 x 192 KiB more per rank of theirs running here. (Bytes of frames:
decoded msgpack objects are larger, by a small factor for real arguments.)
Root is not held to the per-uid byte budget (the daemons' own tools), only
to the per-connection one.
"""

from __future__ import annotations

import logging
import pwd
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..protocol import MAX_CLIENT_REQUEST

log = logging.getLogger("gangd.admission")


@dataclass(frozen=True)
class Limits:
    #: Connections from one address still in their handshake (unauthenticated).
    handshakes_per_address: int = 16
    #: Connections in their handshake from all addresses together.
    handshakes_total: int = 128
    #: How long an unauthenticated TCP connection may take for its handshake.
    peer_handshake_timeout: float = 1.0
    #: Unix-socket connections of one uid, and how many more per rank of that
    #: uid running on this node (each rank holds one or two).
    connections_per_uid: int = 256
    connections_per_rank: int = 4
    #: ... of root (the daemons' tools, the admin).
    connections_root: int = 4096
    #: Requests of one client connection in flight at once.
    client_in_flight: int = 64
    #: Requests of one peer connection in flight at once (the coordinator fans out).
    peer_in_flight: int = 1024
    #: Largest frame a local client may send. The largest legitimate one is a
    #: submit: argv and environment, which Linux caps at ~2 MiB together for an
    #: exec (a quarter of the default 8 MiB stack limit; msgpack adds a few
    #: bytes per string), so 4 MiB admits any job that can start at all.
    #: Peers keep the protocol's 16 MiB (table records, network contexts);
    #: replies to the daemon's own requests (a rank's network context) too.
    client_max_frame: int = MAX_CLIENT_REQUEST
    #: Bytes of request and note frames one client connection may have in
    #: flight, and one uid across its connections (root: per connection only).
    client_in_flight_bytes: int = 8 * 1024 * 1024
    uid_in_flight_bytes: int = 64 * 1024 * 1024
    #: Bytes read from a client connection at a time.
    client_read_size: int = 64 * 1024
    #: Client requests per uid and second (sustained), and the burst allowed.
    requests_per_second: float = 200.0
    request_burst: float = 1000.0
    #: NSS lookups: how long one may take before the uid stands for the name,
    #: how long answers are kept, how many are kept, how many run at once.
    nss_timeout: float = 2.0
    nss_ttl: float = 300.0
    nss_negative_ttl: float = 10.0
    nss_cache_size: int = 4096
    nss_threads: int = 4


class Refused(Exception):
    """A connection beyond a limit; ``code`` and ``message`` go into the bye."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Handshake:
    """One connection in its handshake; ``close()`` once it is done (or gone)."""

    def __init__(self, owner: Handshakes, address: str, on_evict: Callable[[], None], silent: Callable[[], bool]):
        self._owner: Handshakes | None = owner
        self.address = address
        self.evicted = False
        self.silent = silent
        self._on_evict = on_evict

    def close(self) -> None:
        if self._owner is not None:
            self._owner._forget(self)
            self._owner = None

    def evict(self) -> None:
        self.close()
        self.evicted = True
        self._on_evict()

    def __enter__(self) -> Handshake:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Handshakes:
    """Connections in their handshake, oldest first, per source address (see the module docstring)."""

    def __init__(self, per_address: int, total: int):
        self.per_address = per_address
        self.total = total
        self._by_address: dict[str, OrderedDict[Handshake, None]] = {}
        self.count = 0
        self.evictions = 0

    def admit(self, address: str, on_evict: Callable[[], None], silent: Callable[[], bool] = lambda: True) -> Handshake:
        """A new connection from ``address``; may evict an older one (``on_evict`` of that one runs).
        ``silent()`` says whether it has sent nothing useful yet (no hello)."""
        mine = self._by_address.get(address)
        if mine is not None and len(mine) >= self.per_address:
            self._evict_oldest(mine)
        elif self.count >= self.total:
            self._evict_oldest(max(self._by_address.values(), key=len))
        handshake = Handshake(self, address, on_evict, silent)
        self._by_address.setdefault(address, OrderedDict())[handshake] = None
        self.count += 1
        return handshake

    def held(self, address: str) -> int:
        return len(self._by_address.get(address, ()))

    def _evict_oldest(self, queue: OrderedDict[Handshake, None]) -> None:
        self.evictions += 1
        victim = next((h for h in queue if h.silent()), None) or next(iter(queue))
        victim.evict()

    def _forget(self, handshake: Handshake) -> None:
        queue = self._by_address.get(handshake.address)
        if queue is not None and queue.pop(handshake, False) is None:
            self.count -= 1
            if not queue:
                del self._by_address[handshake.address]


class SharedBytes:
    """Bytes held per key (a uid) across its connections, up to ``limit``."""

    def __init__(self, limit: int, what: str = "uid"):
        self.limit = limit
        self.what = what
        self.held: dict[object, int] = {}

    def budget(self, key) -> KeyBytes:
        return KeyBytes(self, key)


class KeyBytes:
    """One key's share of a :class:`SharedBytes` (a :class:`gangd.protocol.connection.ByteBudget`)."""

    def __init__(self, shared: SharedBytes, key):
        self.shared = shared
        self.key = key

    def take(self, n: int) -> bool:
        held = self.shared.held.get(self.key, 0)
        if held + n > self.shared.limit:
            return False
        self.shared.held[self.key] = held + n
        return True

    def release(self, n: int) -> None:
        held = self.shared.held.get(self.key, 0) - n
        if held > 0:
            self.shared.held[self.key] = held
        else:
            self.shared.held.pop(self.key, None)

    def describe(self) -> str:
        held = self.shared.held.get(self.key, 0)
        return f"requests of {self.shared.what} {self.key} in flight hold {held} bytes (limit {self.shared.limit} across its connections)"


class Counter:
    """How many connections each key holds, refusing beyond ``limit``."""

    def __init__(self, limit: int, what: str, template: str = "{what} {key} has {held} connections to this daemon already (limit {limit})"):
        self.limit = limit
        self.what = what
        self.template = template
        self.counts: dict[object, int] = {}

    def take(self, key, limit: int | None = None) -> None:
        limit = self.limit if limit is None else limit
        held = self.counts.get(key, 0)
        if held >= limit:
            raise Refused("too_many_connections", self.template.format(what=self.what, key=key, held=held, limit=limit))
        self.counts[key] = held + 1

    def release(self, key) -> None:
        held = self.counts.get(key, 0) - 1
        if held > 0:
            self.counts[key] = held
        else:
            self.counts.pop(key, None)

    def total(self) -> int:
        return sum(self.counts.values())


class TokenBucket:
    """Per-key token buckets: ``rate`` tokens a second up to ``burst``.

    Buckets that are full again carry no information and are forgotten, so
    the table holds only keys that were busy within the last ``burst/rate``
    seconds.
    """

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: dict[object, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key) -> bool:
        now = self.clock()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > 1024:
            self._forget_full(now)
        return True

    def _forget_full(self, now: float) -> None:
        for key, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[key]


def _lookup(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class UserNames:
    """uid -> user name, looked up in a worker thread, cached with a TTL."""

    def __init__(self, limits: Limits, lookup=_lookup):
        self.limits = limits
        self.lookup = lookup
        self._cache: OrderedDict[int, tuple[str, float]] = OrderedDict()  # uid -> (name, expires)
        self._running: dict[int, trio.Event] = {}
        self._threads = trio.CapacityLimiter(limits.nss_threads)

    async def name(self, uid: int) -> str:
        while True:
            hit = self._cache.get(uid)
            if hit is not None and hit[1] > time.monotonic():
                self._cache.move_to_end(uid)
                return hit[0]
            running = self._running.get(uid)
            if running is None:
                break
            await running.wait()  # somebody is looking it up already
            if uid not in self._cache:  # (their lookup was cancelled)
                continue
        done = self._running[uid] = trio.Event()
        try:
            name, ttl = str(uid), self.limits.nss_negative_ttl
            with trio.move_on_after(self.limits.nss_timeout) as scope:
                found = await trio.to_thread.run_sync(self.lookup, uid, limiter=self._threads, abandon_on_cancel=True)
                if found is not None:
                    name, ttl = found, self.limits.nss_ttl
            if scope.cancelled_caught:
                log.warning("user name lookup of uid %d took over %.1f s (NSS slow?); using the number", uid, self.limits.nss_timeout)
            self._store(uid, name, ttl)
            return name
        finally:
            del self._running[uid]
            done.set()

    def _store(self, uid: int, name: str, ttl: float) -> None:
        self._cache[uid] = (name, time.monotonic() + ttl)
        self._cache.move_to_end(uid)
        while len(self._cache) > self.limits.nss_cache_size:
            self._cache.popitem(last=False)
