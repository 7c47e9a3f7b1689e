"""A Python API to the gangd daemons (what the ``gang`` command is built on).

::

    import trio
    from gangd.client.api import connect

    async def main():
        async with connect() as gang:
            record = await gang.submit(["python", "app.py"], nranks=8)
            async with gang.wait(record["id"]) as updates:
                async for record in updates:
                    print(record["state"])

    trio.run(main)

The client talks to one daemon on this machine over its Unix socket; which
socket is found by :func:`locate`.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import trio

from ..protocol import ProtocolError
from ..rpc import RemoteError, dial_unix, running
from .locate import CLUSTER_FILE as CLUSTER_FILE
from .locate import REFUSALS, ClusterNotFound, cluster_dir, locate, unreachable
from .locate import default_cluster_dir as default_cluster_dir
from .locate import read_cluster_file as read_cluster_file
from .session import MAX_FOLLOW as MAX_FOLLOW
from .session import Client, JobList, stale_warning

# (Client and its helpers live in .session, which does not import trio; they are this module's API too.)


@asynccontextmanager
async def connect(cluster: str | os.PathLike | None = None, sockets: list[str] | None = None):
    """Connect to the first reachable daemon of the cluster."""
    candidates = sockets or locate(cluster)
    errors = []
    for path in candidates:
        try:
            channel = await dial_unix(path)
        except ProtocolError as exc:
            if exc.code in REFUSALS:  # it is up and said why: trying another node would not help
                raise RemoteError(exc.code, f"gangd at {path} refused the connection: {exc.message.split(': ', 1)[-1]}") from None
            errors.append(f"{path}: {exc}")
            continue
        except (OSError, RemoteError, trio.TooSlowError) as exc:
            errors.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")
            continue
        async with running(channel):
            yield Client(channel)
        return
    raise unreachable(errors)


__all__ = ["Client", "JobList", "stale_warning", "ClusterNotFound", "RemoteError", "connect", "locate", "cluster_dir"]
