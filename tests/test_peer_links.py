"""A daemon's links to its peers (:mod:`gangd.daemon.peers`), against a real peer listener on a real socket.

What a coordinator relies on: a node that etcd says is up answers the calls
sent to it, even in the moment between its coming back and this daemon's link
dialing it again (the dial loop backs off up to a heartbeat interval).
"""

from __future__ import annotations

from pathlib import Path

import trio

from gangd import ports
from gangd.daemon.config import Config, EtcdSettings, NodeSpec
from gangd.daemon.peers import Peers
from gangd.protocol import Connection, Role
from gangd.rpc import Channel

SECRET = b"s" * 32


async def _serve_as_n2(port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Node n2: the peer handshake, and an answer to every request."""

    async def handler(channel, request):
        return {"op": request.op}

    async def one(stream) -> None:
        channel = Channel(stream, Connection(dialer=False, node="n2", secret=SECRET, accept=frozenset({Role.PEER})), label="n1")
        await channel.handshake()
        await channel.run(handler)

    await trio.serve_tcp(one, port, host="127.0.0.2", task_status=task_status)


async def test_a_call_to_a_node_that_just_came_back_waits_for_the_link_instead_of_failing(tmp_path: Path):
    port = ports.pick_port(["127.0.0.2"], ports.DAEMON_BAND)
    config = Config(
        node_name="n1",
        nodes=(NodeSpec("n1", "127.0.0.1", port, cores=1), NodeSpec("n2", "127.0.0.2", port, cores=1)),
        state_dir=tmp_path, socket=tmp_path / "gangd.sock", secret_file=tmp_path / "secret",
        etcd=EtcdSettings(endpoints=("http://127.0.0.1:1",), prefix="/unused", lease_ttl=5),
    )
    peers = Peers(config=config, secret=SECRET, heartbeat_info=dict, spawn=lambda *a: None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peers.run, None)
        # n2 is down: the link dials, fails, and backs off to a heartbeat interval.
        await trio.sleep(3 * config.heartbeat_interval)
        assert not peers.link_up("n2")
        # n2 comes back (etcd would now say it is up: is_alive is true by default)
        # and is called at once, before the link's next dial.
        await nursery.start(_serve_as_n2, port)
        with trio.fail_after(10):
            assert await peers.call("n2", "status") == {"op": "status"}
        nursery.cancel_scope.cancel()
