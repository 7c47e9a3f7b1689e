"""The trio channel around the sans-I/O connection (:mod:`gangd.rpc`), over real sockets.

What a daemon relies on: every way a connection ends reaches the code
sending on it as :class:`gangd.rpc.Disconnected` (a RemoteError every caller
handles), never as an exception that escapes and takes a task down with it.
"""

from __future__ import annotations

import socket

import pytest
import trio

from gangd.protocol import Connection, Role, State
from gangd.rpc import Channel, Disconnected


async def _client_and_daemon() -> tuple[Channel, Channel]:
    """A client's channel and a daemon's, over a socket pair, handshake done."""
    left, right = socket.socketpair()
    dialer = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(left)), Connection(dialer=True, node="client", role=Role.CLIENT))
    listener = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(right)),
                       Connection(dialer=False, node="n1", accept=frozenset({Role.CLIENT})))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(dialer.handshake)
        nursery.start_soon(listener.handshake)
    return dialer, listener


async def test_a_channel_whose_peer_hung_up_says_disconnected_when_it_sends():
    # The state machine has seen the other side's EOF (its reader got there
    # first) but the channel is not marked closed yet: a note, a request or a
    # reply sent then is a lost connection (Disconnected, which every caller
    # handles), not a ProtocolError that escapes the task sending it.
    dialer, listener = await _client_and_daemon()
    await dialer.transport.aclose()
    assert await listener._next_event() is None  # (the reader's view: the other side hung up)
    assert listener.conn.state is State.CLOSED and not listener.closed
    with pytest.raises(Disconnected):
        await listener.note("progress", n=1)
    with pytest.raises(Disconnected):
        await listener.request("info")
    await listener.transport.aclose()


async def test_a_client_that_hangs_up_before_reading_its_answer_ends_the_channel_quietly():
    # A client sends a request and closes its socket at once: the daemon's
    # answer meets a broken pipe inside the read loop. That is the other side
    # leaving, which `run` promises never to raise for (a daemon logged it as
    # a failed task, with a traceback, for every flooding client that left).
    dialer, listener = await _client_and_daemon()
    _rid, frame = dialer.conn.send_request("info", {}, window=dialer.window)
    await dialer.transport.send_all(frame)
    await dialer.transport.aclose()
    with trio.fail_after(10):
        await listener.run(None)  # answers "unsupported" into a closed socket
    assert listener.closed
