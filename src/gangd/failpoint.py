"""Failpoints: crash a daemon at a named point, once, to test what survives the crash.

As etcd's gofail does for etcd: the tests of the control plane must kill a
coordinator *between* its commit in etcd and anything after it, which no
signal sent from outside can hit reliably. A failpoint is armed only by
root, by starting the daemon with ``GANGD_FAILPOINTS`` naming a directory
(root's, not writable by others) and creating a file named after the point
in it; the first process to reach the point claims the file (unlink: exactly
one wins) and exits at once, as a crash would (no cleanup, no goodbye).
Unset, a failpoint costs one dictionary lookup.

A *hold point* (:func:`hold`) is armed the same way but pauses instead of
crashing: while its file exists the daemon waits there, so a test can act
while a step is under way (depose the coordinator, lose a node).

A *refusal* (:func:`refuse`) is armed the same way and claimed once, as a
failpoint is, but only makes the caller act as if etcd refused its write
(gofail's ``return`` term): what a daemon does when a write it cannot do
without fails for a moment.
"""

from __future__ import annotations

import logging
import os

import trio

log = logging.getLogger("gangd.failpoint")

_DIRECTORY = os.environ.get("GANGD_FAILPOINTS")


def _claim(name: str) -> bool:
    """True once if the point is armed: the first process to unlink its file wins."""
    if not _DIRECTORY:
        return False
    try:
        os.unlink(os.path.join(_DIRECTORY, name))
    except OSError:
        return False
    return True


def failpoint(name: str) -> None:
    if not _claim(name):
        return
    log.critical("failpoint %s reached: exiting as a crash would", name)
    logging.shutdown()
    os._exit(70)


def refuse(name: str) -> bool:
    """True once when ``$GANGD_FAILPOINTS/<name>`` exists (claimed, as a
    failpoint is): the caller fails that request as a broken path would, and
    the daemon runs on."""
    if not _claim(name):
        return False
    log.warning("failpoint %s reached: refusing this request", name)
    return True


async def hold(name: str) -> None:
    """Wait while ``$GANGD_FAILPOINTS/<name>`` exists (a test removes it to release)."""
    if not _DIRECTORY:
        return
    path = os.path.join(_DIRECTORY, name)
    if not await trio.to_thread.run_sync(os.path.exists, path):
        return
    log.warning("hold point %s reached: waiting while its file exists", name)
    while await trio.to_thread.run_sync(os.path.exists, path):  # noqa: ASYNC110 -- a file a test removes: no event to wait on
        await trio.sleep(0.05)
    log.warning("hold point %s released", name)
