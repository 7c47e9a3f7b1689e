"""What a lost node's rebuild that cannot finish names (issue 16: "the job
fails with a message naming what could not be rebuilt").

A survivor of an XOR set whose streams are cut halfway during the rebuild
of a lost member: the error names the lost node and its generation, the
file of it being rebuilt when the bytes ran out (and where in its data),
and the survivor that failed. Real trio Channels over real socket pairs
(each labelled with its peer's name, as a daemon's are), real files, a
real ``xor.rebuild`` into a real directory; nothing is left behind.
"""

from __future__ import annotations

import socket

import pytest
import trio
from test_redundancy import serving
from test_xor_paths import PARITY, xor_set

from gangd import ckptstore
from gangd.protocol import Connection, Role
from gangd.redundancy import transfer, xor
from gangd.rpc import Channel, leaf_error


async def labelled_channel(nursery: trio.Nursery, handler, peer: str) -> Channel:
    """A requester's real Channel to ``peer`` (labelled ``node <peer>``), the other end serving ``handler``."""
    secret = b"s" * 32
    a, b = socket.socketpair()
    ours = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a)), Connection(dialer=True, node="n9", role=Role.PEER, secret=secret),
                   label=f"node {peer}")
    theirs = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)), Connection(dialer=False, node=peer, secret=secret), label="node n9")
    async with trio.open_nursery() as hs:
        hs.start_soon(ours.handshake)
        hs.start_soon(theirs.handshake)
    nursery.start_soon(theirs.run, handler)
    nursery.start_soon(ours.run, None)
    return ours


@pytest.mark.parametrize("liar", ["n1", "n2"])
async def test_a_survivor_cut_during_a_rebuild_is_named_with_the_lost_file(tmp_path, liar):
    nodes, _dirs, content, metas = xor_set(tmp_path, n=3, seed=21)
    lost = 0
    new_gen = ckptstore.gen_dir(tmp_path / "n9", 7, 3)
    new_gen.parent.mkdir(parents=True)
    try:
        async with trio.open_nursery() as nursery:
            data: list = [None] * 3
            parity: list = [None] * 3
            for i, node in enumerate(nodes):
                if i == lost:
                    continue
                lie = (lambda items: items[: len(items) // 2]) if node == liar else None
                channel = await labelled_channel(nursery, serving(tmp_path / node, lie), node)
                data[i] = transfer.RemoteData(nursery, channel, 7, 3, protected=True)
                parity[i] = transfer.RemoteFile(nursery, channel, 7, 3, PARITY, metas[i].parity_size, metas[i].parity_checksum)
            try:
                with pytest.raises(xor.RebuildError) as err:
                    await trio.to_thread.run_sync(lambda: xor.rebuild(lost, metas[0], data, parity, new_gen))
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise leaf_error(group) from None
    message = str(err.value)
    assert message.startswith("cannot rebuild node n0's job-7/gen-3: its "), message
    # the lost node's file whose bytes ran out (its data: job.msgpack, then ranks/rank-0.state), and the survivor that cut
    named = [name for name in content["n0"] if f"its {name} (" in message]
    assert len(named) == 1 and "could not be rebuilt" in message, message
    assert f"node {liar}" in message and f"node {({'n1', 'n2'} - {liar}).pop()}" not in message, message
    assert not new_gen.exists() and list(new_gen.parent.iterdir()) == []  # nothing left
