"""Local clusters pick their ports below the kernel's ephemeral range (a CI run failed when a daemon's
picked port was handed to an outgoing connection before the daemon bound it)."""

from __future__ import annotations

import socket

import pytest

from gangd import ports
from gangd.client import cluster
from gangd.etcd import server as etcd_server


def test_picks_are_below_the_ephemeral_range_and_in_disjoint_bands_for_etcd_and_daemons():
    low, _high = ports.ephemeral_range()
    daemon = {cluster.pick_port(["127.0.0.1", "127.0.0.2"]) for _ in range(50)}
    etcd = {etcd_server._free_port("127.0.0.1", set()) for _ in range(50)}
    assert all(ports.DAEMON_BAND[0] <= p < min(low, ports.DAEMON_BAND[1]) for p in daemon)
    assert all(ports.ETCD_BAND[0] <= p < ports.ETCD_BAND[1] for p in etcd)
    assert len(daemon) > 1 and len(etcd) > 1  # spread, so parallel clusters rarely probe the same port


def test_a_port_in_use_on_any_of_the_addresses_is_not_picked():
    held = []
    try:
        # Hold most of a tiny band on the second address only: every pick must be a port free on both.
        band = (ports.DAEMON_BAND[0], ports.DAEMON_BAND[0] + 8)
        for port in range(band[0], band[1] - 1):
            s = socket.socket()
            s.bind(("127.0.0.2", port))
            s.listen()
            held.append(s)
        free = band[1] - 1
        for _ in range(5):
            assert ports.pick_port(["127.0.0.1", "127.0.0.2"], band) == free
    finally:
        for s in held:
            s.close()


def test_picks_of_one_caller_differ_and_a_full_band_is_a_clear_error():
    band = (ports.ETCD_BAND[0], ports.ETCD_BAND[0] + 2)
    taken: set[int] = set()
    a = ports.pick_port(["127.0.0.1"], band, taken)
    b = ports.pick_port(["127.0.0.1"], band, taken)
    assert {a, b} == set(range(*band))
    with pytest.raises(ports.NoFreePort, match="no free TCP port"):
        ports.pick_port(["127.0.0.1"], band, taken)
