"""Failpoints: crash a daemon at a named point, once, to test what survives the crash.

As etcd's gofail does for etcd: the tests of the control plane must kill a
coordinator *between* its commit in etcd and anything after it, which no
signal sent from outside can hit reliably. A failpoint is armed only by
root, by starting the daemon with ``GANGD_FAILPOINTS`` naming a directory
(root's, not writable by others) and creating a file named after the point
in it; the first process to reach the point claims the file (unlink: exactly
one wins) and exits at once, as a crash would (no cleanup, no goodbye).
Unset, a failpoint costs one dictionary lookup.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("gangd.failpoint")

_DIRECTORY = os.environ.get("GANGD_FAILPOINTS")


def failpoint(name: str) -> None:
    if not _DIRECTORY:
        return
    try:
        os.unlink(os.path.join(_DIRECTORY, name))
    except OSError:
        return
    log.critical("failpoint %s reached: exiting as a crash would", name)
    logging.shutdown()
    os._exit(70)
