"""What a lost node's rebuild that cannot finish names (issue 16: "the job
fails with a message naming what could not be rebuilt").

A survivor of an XOR set whose streams are cut halfway during the rebuild
of a lost member: the error names the lost node and its generation, the
file of it being rebuilt when the bytes ran out (and where in its data),
and the survivor that failed. A rebuild that does not finish in its time
(``ckpt_rebuild``'s own side, :class:`gangd.daemon.rebuild.Rebuilder`)
names the lost node's files it did not rebuild and where it was reading them from. Real trio Channels over real socket pairs
(each labelled with its peer's name, as a daemon's are), real files, a
real ``xor.rebuild`` into a real directory; nothing is left behind.
"""

from __future__ import annotations

import pytest
import trio
from test_redundancy import channel_pair, make_gen, serving
from test_xor_paths import PARITY, xor_set

from gangd import ckptstore
from gangd.daemon.rebuild import Rebuilder, RebuildRequest
from gangd.redundancy import transfer, xor
from gangd.rpc import RemoteError, leaf_error


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
                channel = await channel_pair(nursery, serving(tmp_path / node, lie), peer=node, me="n9")
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


async def test_a_rebuild_that_runs_out_of_time_names_the_files_it_did_not_rebuild(tmp_path):
    # n3 is lost; its partner n2 keeps its copy and answers its MANIFEST,
    # then never sends a byte of its files: the rebuild on n9 ends at its
    # timeout naming them, and leaves nothing listed.
    files = {"ranks/rank-2.state": b"s" * 5000, "job.msgpack": b"j" * 100}
    copy = ckptstore.gen_dir(tmp_path / "n2", 7, 3) / xor.REDUNDANCY_DIR / "partner-n3"
    make_gen(copy, "n3", files)
    honest = serving(tmp_path / "n2")

    async def stalling(channel, request):
        if request.args.get("name", "").endswith(ckptstore.MANIFEST):
            return await honest(channel, request)
        await trio.sleep_forever()

    root = tmp_path / "n9"
    root.mkdir(mode=0o711)
    async with trio.open_nursery() as nursery:
        channel = await channel_pair(nursery, stalling, peer="n2", me="n9")
        rebuilder = Rebuilder(node="n9", root=root, channel=lambda node: channel, reserve=0, max_file=1 << 30)
        request = RebuildRequest(7, 3, (65534, 65534), "n3", "partner", ("n2",), 1.0)
        with pytest.raises(RemoteError) as err:
            await rebuilder.rebuild(request)
        nursery.cancel_scope.cancel()
    message = err.value.message
    assert message.startswith("n9: rebuilding node n3's job-7/gen-3: not done within 1 s; "), message
    assert "node n3's files not rebuilt from its partner copy on n2: job.msgpack, ranks/rank-2.state (5100 bytes)" in message, message
    gen = ckptstore.gen_dir(root, 7, 3)
    assert not (gen / ckptstore.MANIFEST).exists() and not any((gen / "ranks").iterdir())
