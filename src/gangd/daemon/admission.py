"""Bounds on what one address or one user may take of a daemon.

The daemon runs as root on every node and answers anybody who can reach its
TCP port or its Unix socket, so nothing about a connection may cost it
unbounded memory, tasks or event-loop time:

* :class:`Counter` — connections per key (a remote address before it has
  authenticated, a local uid); beyond the limit a connection is refused with
  a ``bye`` that says why (the client shows it).
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
"""

from __future__ import annotations

import logging
import pwd
import time
from collections import OrderedDict
from dataclasses import dataclass

import trio

log = logging.getLogger("gangd.admission")


@dataclass(frozen=True)
class Limits:
    #: Connections from one address still in their handshake (unauthenticated).
    handshakes_per_address: int = 16
    #: Connections in their handshake from all addresses together.
    handshakes_total: int = 128
    #: Unix-socket connections of one uid (each rank holds one or two).
    connections_per_uid: int = 256
    #: ... of root (the daemons' tools, the admin).
    connections_root: int = 4096
    #: Requests of one client connection in flight at once.
    client_in_flight: int = 64
    #: Requests of one peer connection in flight at once (the coordinator fans out).
    peer_in_flight: int = 1024
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
