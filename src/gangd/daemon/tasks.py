"""Background tasks that must not take the daemon down with them.

A task started for a request, a peer or a rank (an output relay, a
deferred kill, a rendezvous report) is owned by a nursery (the daemon's
root, or the coordinator's term) and *contained*: a bug in it, or anything
a peer or client provoked, is logged and ends that task only. Kept apart
from the daemon object so every component can be handed just this.
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger("gangd.daemon")


async def contained(fn, args) -> None:
    """Run ``fn(*args)``; an exception is logged, never raised (cancellation still is)."""
    try:
        await fn(*args)
    except Exception:
        log.exception("task %s failed", getattr(fn, "__qualname__", fn))
    except BaseExceptionGroup as group:
        rest = group.subgroup(lambda e: not isinstance(e, Exception))
        log.error("task %s failed", getattr(fn, "__qualname__", fn), exc_info=group)
        if rest is not None:
            raise rest from None  # the group was logged just above, whole


class Tasks:
    """The daemon's root nursery, once it is open: ``spawn`` starts a contained task in it."""

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None

    @property
    def running(self) -> bool:
        return self.nursery is not None

    def spawn(self, fn, *args) -> None:
        if self.nursery is None:
            raise RuntimeError("spawn() before the daemon's nursery is open")
        self.nursery.start_soon(contained, fn, args, name=getattr(fn, "__qualname__", repr(fn)))
