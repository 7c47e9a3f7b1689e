"""Picking TCP ports for local clusters (``gang demo``, ``gang cluster up``, the tests).

A local cluster's daemons and etcd members bind ports that were picked a moment earlier by a probe bind.
A port inside the kernel's ephemeral range is free only until the kernel hands it out by itself: on a busy
machine every rank engine's bind to port 0 and every outgoing connection draws from that range, and one
landed on a picked port between the probe and the daemon's bind often enough to fail CI ("already in use").
So picks come from below that range, where only another explicit pick can collide, and etcd and the gangd
daemons pick from disjoint bands so that two parallel local clusters' etcd and daemons never race each other.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Final

__all__ = ["ETCD_BAND", "DAEMON_BAND", "ephemeral_range", "pick_port", "NoFreePort"]

# Half-open bands [low, high); both are cut at the start of the ephemeral range.
ETCD_BAND: Final = (10000, 20000)
DAEMON_BAND: Final = (20000, 65536)


class NoFreePort(RuntimeError):
    """No port of the band was free on every address."""


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel picks ports from by itself (a bind to port 0, an outgoing connection)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _candidates(band: tuple[int, int]) -> range:
    low, high = band
    high = min(high, ephemeral_range()[0])
    if high - low < 1000:  # an ephemeral range reaching low down: fall back to the whole band
        return range(band[0], band[1])
    return range(low, high)


def pick_port(addresses: Iterable[str], band: tuple[int, int], avoid: set[int] | None = None, tries: int = 200) -> int:
    """A TCP port of ``band`` below the ephemeral range, free now on every one of ``addresses`` (nodes of a
    local cluster share a port number on their own loopback address) and not in ``avoid``; the port is added
    to ``avoid`` so that one caller's several picks differ."""
    hosts = list(addresses)
    rng = random.Random()  # noqa: S311 -- spreads the picks of parallel local clusters; no secret in it
    candidates = _candidates(band)
    taken = avoid if avoid is not None else set()
    for _ in range(tries):
        port = rng.choice(candidates)
        if port in taken:
            continue
        socks: list[socket.socket] = []
        try:
            for host in hosts:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        taken.add(port)
        return port
    raise NoFreePort(f"no free TCP port in {candidates.start}-{candidates.stop - 1} on {', '.join(hosts)}")
