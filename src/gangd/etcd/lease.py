"""An etcd lease kept alive by its holder, with a local deadline it can trust.

A node's liveness and a coordinator's leadership are leases: the keys attached to one vanish for everyone
when the holder stops renewing it. The holder must stop acting *before* the others may act, so its own idea
of when the lease ends must never be later than etcd's. etcd starts a renewed TTL when it receives the
keepalive, which is after the holder sent it; so the local deadline is computed from when each keepalive
request was SENT plus the TTL etcd granted. A process that was stopped (SIGSTOP, swapping, a long GC) wakes
up with its deadline already past and ``lost`` set, instead of believing the answer it gets afterwards.
trio's clock is monotonic, so a wall-clock jump changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from gangd.etcd.client import Etcd, EtcdError

__all__ = ["Lease", "open_lease"]

log = logging.getLogger("gangd.etcd.lease")


class Lease:
    """A lease held by this process. ``lost`` is set (once, for good) when etcd says the lease is gone or its
    local deadline passed without a renewal; the holder must then stop everything the lease stood for."""

    def __init__(self, etcd: Etcd, lease_id: int, ttl: int, deadline: float) -> None:
        self.etcd = etcd
        self.id = lease_id
        self.ttl = ttl
        self.lost = trio.Event()
        self._deadline = deadline
        self._renewed = trio.Event()  # wakes the watchdog to a new deadline
        self._keepalive_scope = trio.CancelScope()

    def remaining(self) -> float:
        """Seconds until the local deadline (negative once it passed)."""
        return self._deadline - trio.current_time()

    @property
    def deadline(self) -> float:
        """The local deadline on trio's clock."""
        return self._deadline

    def stop_keepalive(self) -> None:
        """Stop renewing (the lease then runs out): for tests of a stalled holder, and for a holder that gives
        up its lease without revoking it."""
        self._keepalive_scope.cancel()

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            log.warning("etcd lease %x lost: %s", self.id, why)
            self.lost.set()

    async def _keepalive(self) -> None:
        with self._keepalive_scope:
            interval = max(self.ttl / 3, 0.2)
            while not self.lost.is_set():
                await trio.sleep(interval)
                sent = trio.current_time()
                try:
                    # Past the deadline an answer is worthless: the lease may be gone and someone else acting.
                    with trio.move_on_after(max(self.remaining(), 0.0)):
                        ttl = await self.etcd.lease_keepalive(self.id)
                        if ttl <= 0:
                            self._lose("etcd says the lease no longer exists")
                            return
                        if not self.lost.is_set():
                            self._deadline = max(self._deadline, sent + ttl)
                            self._renewed.set()
                except EtcdError as e:
                    # Unreachable for now: keep trying (faster) until the deadline decides.
                    log.info("etcd lease %x keepalive failed (%.1f s left): %s", self.id, self.remaining(), e)
                    interval = max(min(self.ttl / 6, self.remaining() / 2), 0.1)
                    continue
                interval = max(self.ttl / 3, 0.2)

    async def _watchdog(self) -> None:
        while not self.lost.is_set():
            with trio.move_on_at(self._deadline):
                await self._renewed.wait()
            self._renewed = trio.Event()
            if trio.current_time() >= self._deadline:
                self._lose(f"no renewal within its TTL of {self.ttl} s")
                return

    async def revoke(self) -> None:
        """Revoke now (best effort, shielded, short): its keys vanish at once instead of after the TTL."""
        self.stop_keepalive()
        self.lost.set()  # deliberately: nothing may act on it any more
        with trio.CancelScope(shield=True), trio.move_on_after(min(2.0, self.etcd.timeout)):
            try:
                await self.etcd.lease_revoke(self.id)
            except EtcdError as e:
                log.info("etcd lease %x not revoked (it runs out by itself): %s", self.id, e)


@asynccontextmanager
async def open_lease(etcd: Etcd, ttl: int) -> AsyncIterator[Lease]:
    """Grant a lease of ``ttl`` seconds, keep it alive (every ttl/3) while the block runs, revoke it on exit."""
    if ttl < 1:
        raise ValueError("an etcd lease lasts at least 1 s")
    sent = trio.current_time()
    lease_id, granted = await etcd.lease_grant(ttl)
    lease = Lease(etcd, lease_id, granted, sent + granted)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lease._keepalive)
            nursery.start_soon(lease._watchdog)
            try:
                yield lease
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await lease.revoke()
