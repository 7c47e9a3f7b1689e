"""Redundancy building blocks (issue 16): plans, XOR parity and rebuild, transfers between daemons.

The plan is pure (hypothesis over node counts and losses); XOR parity is
written into and rebuilt from real generation directories (files, manifests,
fsyncs, the rank files' owner a real second uid); transfers run between two
real trio Channels over a real socket pair, the sending side either an
honest :func:`handle_file_read` or a peer that lies about sizes and bytes.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
import trio
from conftest import first_difference, tmpfs
from hypothesis import given
from hypothesis import strategies as st

from gangd import ckptstore
from gangd.protocol import Connection, Role
from gangd.redundancy import plan as rplan
from gangd.redundancy import transfer, xor
from gangd.rpc import Channel, RemoteError, Stream

NOBODY = 65534

# ================================================================ plan

node_lists = st.integers(1, 40).map(lambda n: [f"n{i}" for i in range(n)])


@given(node_lists, st.integers(2, 10))
def test_xor_every_single_loss_per_set_is_rebuildable_and_two_in_a_set_are_not(nodes, k):
    if len(nodes) < 2:
        with pytest.raises(rplan.PlanError, match="at least 2 nodes"):
            rplan.make_plan(nodes, "xor", k)
        return
    plan = rplan.make_plan(nodes, "xor", k)
    assert sorted(n for s in plan.sets for n in s) == sorted(nodes)  # every node in exactly one set
    assert all(2 <= len(s) <= max(k, 3) for s in plan.sets)
    assert max(map(len, plan.sets)) - min(map(len, plan.sets)) <= 1
    assert [n for s in plan.sets for n in s] == nodes  # consecutive
    one_each = [s[len(s) // 2] for s in plan.sets]
    recovery = plan.recovery(one_each)
    assert recovery.ok, recovery.message
    for rebuild in recovery.rebuilds:
        assert rebuild.method == "xor"
        assert set(rebuild.sources) == set(plan.set_of(rebuild.node)) - {rebuild.node}
    first = plan.sets[0]
    recovery = plan.recovery([first[0], first[-1]])
    assert not recovery.ok
    assert f"node {first[0]}'s checkpoint files cannot be rebuilt" in recovery.message
    assert first[-1] in recovery.message


@given(node_lists.filter(lambda n: len(n) >= 2), st.data())
def test_partner_loss_is_rebuildable_unless_the_partner_is_lost_too(nodes, data):
    plan = rplan.make_plan(nodes, "partner")
    lost = data.draw(st.lists(st.sampled_from(nodes), unique=True, min_size=1))
    recovery = plan.recovery(lost)
    for node in lost:
        partner = plan.partner_of(node)
        assert partner != node and plan.partnered_by(partner) == node
        if partner in lost:
            assert any(node in m and partner in m for m in recovery.unrecoverable)
        else:
            assert rplan.Rebuild(node, "partner", (partner,)) in recovery.rebuilds
    assert recovery.ok == (not any(plan.partner_of(n) in lost for n in lost))


@given(st.integers(2, 30), st.integers(2, 12), st.integers(0, 50))
def test_storage_is_b_per_copy_for_partner_and_b_n_over_n_minus_1_for_xor(n, k, m):
    nodes = [f"n{i}" for i in range(n)]
    xplan = rplan.make_plan(nodes, "xor", k)
    # B a multiple of every set's n - 1, so the formula is exact (no padding)
    b = m * math.lcm(*range(1, 12))
    sizes = dict.fromkeys(nodes, b)
    assert rplan.make_plan(nodes, "local").storage(sizes) == n * b
    assert rplan.make_plan(nodes, "partner").storage(sizes) == 2 * n * b
    expected = sum(len(s) * b * len(s) // (len(s) - 1) for s in xplan.sets)
    assert xplan.storage(sizes) == expected
    if n <= k:
        assert xplan.storage(sizes) * (n - 1) == n * b * n  # B·N/(N-1) per node


def test_defaults_and_refusals():
    assert rplan.make_plan(["a"]).level == "local"
    assert rplan.make_plan(["a", "b", "a"]).level == "partner"  # a placement repeats nodes
    p = rplan.make_plan(["a", "b", "c"])
    assert p.level == "xor" and p.sets == (("a", "b", "c"),)
    assert rplan.make_plan([f"n{i}" for i in range(20)]).sets[0] == tuple(f"n{i}" for i in range(7))  # 20 → 7+7+6
    assert rplan.make_plan(["a", "b"], "partner").holds("a") == {"partner": ("b",)}
    assert not rplan.make_plan(["a"]).recovery(["a"]).ok
    with pytest.raises(rplan.PlanError, match="unknown checkpoint redundancy"):
        rplan.make_plan(["a", "b"], "raid6")
    with pytest.raises(rplan.PlanError, match="not a node name"):
        rplan.make_plan(["a", "../b"], "partner")
    with pytest.raises(rplan.PlanError, match="not one of the job's nodes"):
        p.recovery(["zz"])


# ================================================================ xor

SIZES = [0, 1, 4097, xor.BLOCK - 1, xor.BLOCK + 7, 2 * xor.BLOCK + 3]


def make_gen(directory: Path, node: str, files: dict[str, bytes], *, lineage: int = 7, gen: int = 3) -> ckptstore.Manifest:
    directory.mkdir(parents=True)
    (directory / "ranks").mkdir(mode=0o700)
    entries = {}
    for name, data in files.items():
        entries[name] = list(ckptstore.write_atomic(directory / name, [data]))
    manifest = ckptstore.Manifest(lineage, gen, node, 10, entries, [0], time.time())
    ckptstore.write_manifest(directory, manifest)
    return manifest


def make_set(root: Path, n: int, seed: int) -> tuple[list[str], list[Path], dict[str, dict[str, bytes]]]:
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(n)]
    dirs = [ckptstore.gen_dir(root / node, 7, 3) for node in nodes]
    content = {}
    for i, (node, directory) in enumerate(zip(nodes, dirs, strict=True)):
        files = {f"ranks/rank-{2 * i + r}.state": rng.randbytes(rng.choice(SIZES)) for r in range(2)}
        files[f"net-{2 * i}.ctx"] = rng.randbytes(rng.randrange(0, 300))
        files["job.msgpack"] = rng.randbytes(rng.randrange(1, 2000))
        content[node] = files
        make_gen(directory, node, files)
    return nodes, dirs, content


@pytest.mark.parametrize("n", [2, 3, 5])
def test_xor_rebuilds_any_lost_member_bit_identical(tmp_path, n):
    nodes, dirs, content = make_set(tmp_path, n, seed=n)
    metas = xor.encode_set(dirs, nodes)
    sizes = [xor.data_size(ckptstore.read_manifest(d)) for d in dirs]
    assert {m.parity_size for m in metas} == {-(-max(sizes) // (n - 1))}  # each stores 1/(n-1) of the largest
    parities = [(d / "redundancy" / "xor.parity").read_bytes() for d in dirs]
    for lost in range(n):
        shutil.rmtree(dirs[lost])  # the disk is lost
        survivors: list[Path | None] = list(dirs)
        survivors[lost] = None
        manifest = xor.rebuild_local(survivors, lost, dirs[lost], owner=(NOBODY, NOBODY))
        assert manifest.node == nodes[lost]
        for name, data in content[nodes[lost]].items():
            assert (dirs[lost] / name).read_bytes() == data, name
        assert ckptstore.verify(dirs[lost]) == []
        assert (dirs[lost] / "redundancy" / "xor.parity").read_bytes() == parities[lost]  # protected again
        assert xor.read_meta(dirs[lost]) == metas[lost]
        assert os.stat(dirs[lost] / "ranks").st_uid == NOBODY
        assert os.stat(dirs[lost] / f"ranks/rank-{2 * lost}.state").st_uid == NOBODY
        assert os.stat(dirs[lost] / "job.msgpack").st_uid == 0
        assert not any(p.name.startswith(".") for p in dirs[lost].parent.iterdir())  # no partial left


def test_a_corrupted_parity_is_reported_by_node_and_path_and_nothing_is_left(tmp_path):
    nodes, dirs, _ = make_set(tmp_path, 4, seed=11)
    xor.encode_set(dirs, nodes)
    bad = dirs[2] / "redundancy" / "xor.parity"
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    shutil.rmtree(dirs[0])
    with pytest.raises(xor.RebuildError) as err:
        xor.rebuild_local([None, *dirs[1:]], 0, dirs[0])
    assert "node n2" in str(err.value) and str(bad) in str(err.value) and "corrupted" in str(err.value)
    assert "cannot rebuild node n0's job-7/gen-3" in str(err.value)
    assert not dirs[0].exists() and not any(dirs[0].parent.iterdir())


def test_a_survivor_file_of_the_wrong_size_is_named(tmp_path):
    nodes, dirs, _ = make_set(tmp_path, 3, seed=5)
    xor.encode_set(dirs, nodes)
    victim = dirs[1] / "job.msgpack"
    victim.write_bytes(victim.read_bytes() + b"x")
    shutil.rmtree(dirs[0])
    with pytest.raises(xor.RebuildError, match=f"node n1: {victim} is .* bytes, its manifest says"):
        xor.rebuild_local([None, *dirs[1:]], 0, dirs[0])


def test_a_rebuild_onto_a_disk_that_fills_up_stops_naming_it_and_leaves_nothing(tmp_path):
    # The disk the lost node's files are rebuilt onto fills up halfway: the
    # rebuild ends with the error naming the file, and nothing is left.
    import threading

    rng = random.Random(3)
    nodes = ["n0", "n1", "n2"]
    dirs = [ckptstore.gen_dir(tmp_path / node, 7, 3) for node in nodes]
    for node, directory in zip(nodes, dirs, strict=True):
        make_gen(directory, node, {"ranks/rank-0.state": rng.randbytes(24 * xor.BLOCK), "job.msgpack": b"j"})
    xor.encode_set(dirs, nodes)
    small = tmp_path / "small"
    small.mkdir()
    with tmpfs(small, "2m"):
        dest = ckptstore.gen_dir(small, 7, 3)
        dest.parent.mkdir(parents=True)
        outcome: list = []

        def run() -> None:
            try:
                xor.rebuild_local([None, *dirs[1:]], 0, dest)
            except BaseException as exc:  # noqa: BLE001 -- looked at below
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(120)  # (a guard against a hang, not a speed check)
        assert not thread.is_alive(), "the rebuild hung when its disk filled up"
        assert len(outcome) == 1 and isinstance(outcome[0], ckptstore.StoreError), outcome
        assert "no space left on device" in str(outcome[0]) and "rank-0.state" in str(outcome[0]), outcome[0]
        assert list(dest.parent.iterdir()) == []


def test_a_survivor_data_file_that_is_a_symlink_is_not_followed(tmp_path):
    nodes, dirs, _ = make_set(tmp_path, 3, seed=6)
    xor.encode_set(dirs, nodes)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * len((dirs[1] / "job.msgpack").read_bytes()))
    os.unlink(dirs[1] / "job.msgpack")
    os.symlink(secret, dirs[1] / "job.msgpack")
    shutil.rmtree(dirs[0])
    with pytest.raises(xor.RebuildError, match=r"job\.msgpack"):
        xor.rebuild_local([None, *dirs[1:]], 0, dirs[0])


# ================================================================ transfer


async def channel_pair(nursery: trio.Nursery, handler, peer: str = "n2", me: str = "n1") -> Channel:
    """Two real Channels over a socket pair: returns the requester's (node
    ``me``, its channel labelled ``node <peer>``); the other serves ``handler``."""
    secret = b"s" * 32
    a, b = socket.socketpair()
    ours = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(a)), Connection(dialer=True, node=me, role=Role.PEER, secret=secret), label=f"node {peer}")
    theirs = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(b)), Connection(dialer=False, node=peer, secret=secret), label=f"node {me}")
    async with trio.open_nursery() as hs:
        hs.start_soon(ours.handshake)
        hs.start_soon(theirs.handshake)
    nursery.start_soon(theirs.run, handler)
    nursery.start_soon(ours.run, None)
    return ours


def serving(root: Path, lie=None):
    async def handler(channel, request):
        if request.op == "ckpt_file_read":
            stream = await transfer.handle_file_read(root, request.args)
        elif request.op == "ckpt_data_read":
            stream = await transfer.handle_data_read(root, request.args)
        else:
            raise RemoteError("unsupported", request.op)
        if lie is None:
            return stream

        async def produce(emit):
            items: list = []

            async def collect(item):
                items.append(item)

            await stream.produce(collect)
            for item in lie(items):
                await emit(item)

        return Stream(produce)

    return handler


@pytest.fixture
def peer_gen(tmp_path):
    rng = random.Random(3)
    files = {"ranks/rank-0.state": rng.randbytes(3 * transfer.CHUNK + 12345), "ranks/rank-1.state": b"", "job.msgpack": rng.randbytes(999)}
    src = ckptstore.gen_dir(tmp_path / "n2", 7, 3)
    manifest = make_gen(src, "n2", files)
    dest = tmp_path / "n1" / "partner-n2"
    dest.mkdir(parents=True)
    return tmp_path / "n2", manifest, files, dest


async def test_a_generation_moves_between_two_daemons_bit_identical(peer_gen):
    root, manifest, files, dest = peer_gen
    async with trio.open_nursery() as nursery:
        channel = await channel_pair(nursery, serving(root))
        await transfer.fetch_generation(channel, manifest, dest, owner=(NOBODY, NOBODY), depth=2)
        nursery.cancel_scope.cancel()
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert ckptstore.verify(dest) == []
    assert os.stat(dest / "ranks" / "rank-0.state").st_uid == NOBODY


def _honest(items):
    return items


def _extra(items):  # one more chunk after the file's end, and an end that counts it
    *chunks, end = items
    extra = b"x" * 10
    return [*chunks, {"o": end["end"], "d": extra, "h": transfer.chunk_hash(extra)}, {"end": end["end"] + 10, "sum": end["sum"]}]


def _wrong_size(items):  # drops the last chunk and claims the full size
    *chunks, end = items
    return [*chunks[:-1], end]


def _flipped(items):  # a chunk's bytes changed, its hash recomputed: only the whole file's checksum can tell
    *chunks, end = items
    d = bytearray(chunks[1]["d"])
    d[7] ^= 1
    chunks[1] = {"o": chunks[1]["o"], "d": bytes(d), "h": transfer.chunk_hash(bytes(d))}
    return [*chunks, end]


def _bad_chunk_hash(items):
    *chunks, end = items
    d = bytearray(chunks[0]["d"])
    d[0] ^= 1
    chunks[0] = {**chunks[0], "d": bytes(d)}
    return [*chunks, end]


def _after_end(items):
    return [*items, items[0]]


def _big_chunk(items):
    *chunks, end = items
    merged = chunks[0]["d"] + chunks[1]["d"]
    return [{"o": 0, "d": merged, "h": transfer.chunk_hash(merged)}, *chunks[2:], end]


@pytest.mark.parametrize(("lie", "refusal"), [
    (_extra, "more than the"),
    (_wrong_size, "claims"),
    (_flipped, "does not match the manifest"),
    (_bad_chunk_hash, "corrupted"),
    (_after_end, "more after the end"),
    (_big_chunk, "out of order or malformed"),
])
async def test_a_lying_peer_is_refused_and_nothing_is_written(peer_gen, lie, refusal):
    root, manifest, _, dest = peer_gen
    name = "ranks/rank-0.state"
    size, checksum = manifest.files[name]
    async with trio.open_nursery() as nursery:
        channel = await channel_pair(nursery, serving(root, lie))
        with pytest.raises(transfer.TransferError, match=refusal) as err:
            await transfer.fetch_file(channel, lineage=7, gen=3, name=name, size=size, checksum=checksum, dest_dir=dest)
        assert "from node n2" in str(err.value) and name in str(err.value)
        nursery.cancel_scope.cancel()
    assert list(dest.iterdir()) == []


async def test_the_sender_reads_nothing_outside_the_generation(peer_gen, tmp_path):
    root, _, _, dest = peer_gen
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    gen = ckptstore.gen_dir(root, 7, 3)
    os.symlink(outside, gen / "ranks" / "rank-9.state")
    os.symlink(tmp_path, gen / "redundancy")
    async with trio.open_nursery() as nursery:
        channel = await channel_pair(nursery, serving(root))
        for name, refusal in [("../../outside", "not a file of a checkpoint generation"),
                              ("/etc/passwd", "not a file of a checkpoint generation"),
                              ("ranks/rank-9.state", "symbolic link"),
                              ("redundancy/outside", "symbolic link|not a directory")]:
            with pytest.raises(RemoteError, match=refusal):
                await transfer.fetch_file(channel, lineage=7, gen=3, name=name, size=6, checksum="0", dest_dir=dest, dest_name="x")
        with pytest.raises(RemoteError, match="lineage must be an integer"):
            await channel.request("ckpt_file_read", lineage="7/../..", gen=3, name="job.msgpack")
        nursery.cancel_scope.cancel()
    assert list(dest.iterdir()) == []


async def test_a_hard_link_planted_in_ranks_is_not_sent_and_nothing_reaches_the_owner_before_it_checks_out(peer_gen, tmp_path):
    """ranks/ is the job owner's: after the commit they may swap a rank file
    for a hard link to a file they cannot read. The sender refuses a file with
    other names; and a receiver gives a file to the owner only once every byte
    matched the manifest (until then it is root's, 0600)."""
    root, manifest, _files, dest = peer_gen
    secret = ckptstore.gen_dir(root, 7, 3) / "secret"  # (same file system, as a hard link needs)
    secret.write_bytes(b"root's secret")
    rank = ckptstore.gen_dir(root, 7, 3) / "ranks" / "rank-0.state"
    rank.unlink()
    os.link(secret, rank)
    async with trio.open_nursery() as nursery:
        channel = await channel_pair(nursery, serving(root))
        with pytest.raises(RemoteError, match="hard link"):
            await transfer.fetch_file(channel, lineage=7, gen=3, name="ranks/rank-0.state", size=13,
                                      checksum=manifest.files["ranks/rank-0.state"][1], dest_dir=dest, dest_name="r0", owner=(NOBODY, NOBODY))
        nursery.cancel_scope.cancel()
    assert list(dest.iterdir()) == []


async def test_parity_from_peers_streams_equals_the_local_parity(tmp_path):
    """The daemon's path: member 0 computes its parity from the other
    members' data pulled over channels (RemoteData in a worker thread)."""
    nodes, dirs, _ = make_set(tmp_path, 3, seed=9)
    local = xor.encode_set(dirs, nodes)
    expected = (dirs[0] / "redundancy" / "xor.parity").read_bytes()
    shutil.rmtree(dirs[0] / "redundancy")
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    async with trio.open_nursery() as nursery:
        sources: list = [None]
        for node in nodes[1:]:
            channel = await channel_pair(nursery, serving(tmp_path / node))
            sources.append(transfer.RemoteData(nursery, channel, 7, 3, depth=2))
        meta = await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
        nursery.cancel_scope.cancel()
    assert meta == local[0]
    assert (dirs[0] / "redundancy" / "xor.parity").read_bytes() == expected


async def test_partner_copy_then_the_lost_node_rebuilt_from_it_on_a_new_node(tmp_path):
    """n1 keeps n0's copy (pulled over the channel); n0's disk is lost; a
    new node n9 rebuilds n0's generation from n1's copy, bit-identical."""
    rng = random.Random(4)
    files = {"ranks/rank-0.state": rng.randbytes(transfer.CHUNK * 5 + 1), "ranks/rank-1.state": b"", "net-0.ctx": rng.randbytes(77)}
    manifest = make_gen(ckptstore.gen_dir(tmp_path / "n0", 7, 3), "n0", files)
    n1_gen = ckptstore.gen_dir(tmp_path / "n1", 7, 3)
    make_gen(n1_gen, "n1", {"job.msgpack": b"n1"})
    plan = rplan.make_plan(["n0", "n1"], "partner")
    prefix = transfer.partner_prefix("n0")
    (n1_gen / prefix).mkdir(parents=True)
    async with trio.open_nursery() as nursery:
        from_n0 = await channel_pair(nursery, serving(tmp_path / "n0"))
        got = await transfer.fetch_manifest(from_n0, lineage=7, gen=3, node="n0")
        assert got == manifest
        await transfer.fetch_generation(from_n0, got, n1_gen / prefix)
        nursery.cancel_scope.cancel()
    shutil.rmtree(tmp_path / "n0")
    (rebuild,) = plan.recovery(["n0"]).rebuilds
    assert rebuild.sources == ("n1",)
    new_gen = ckptstore.gen_dir(tmp_path / "n9", 7, 3)
    new_gen.mkdir(parents=True)
    async with trio.open_nursery() as nursery:
        from_n1 = await channel_pair(nursery, serving(tmp_path / rebuild.sources[0]))
        copy = await transfer.fetch_manifest(from_n1, lineage=7, gen=3, prefix=prefix, node="n0")
        with pytest.raises(transfer.TransferError, match="not the one asked for"):
            await transfer.fetch_manifest(from_n1, lineage=7, gen=3, node="n0")  # n1's own manifest
        await transfer.fetch_generation(from_n1, copy, new_gen, source_prefix=prefix, owner=(NOBODY, NOBODY))
        nursery.cancel_scope.cancel()
    for name, data in files.items():
        assert (new_gen / name).read_bytes() == data
    assert ckptstore.verify(new_gen) == []


async def test_a_member_rebuilt_on_another_node_from_the_survivors_streams(tmp_path):
    """The daemon's rebuild: the survivors' data and parity pulled over channels."""
    nodes, dirs, content = make_set(tmp_path, 4, seed=21)
    metas = xor.encode_set(dirs, nodes)
    lost = 2
    shutil.rmtree(dirs[lost])
    new_gen = ckptstore.gen_dir(tmp_path / "n9", 7, 3)
    new_gen.parent.mkdir(parents=True)
    async with trio.open_nursery() as nursery:
        data: list = [None] * 4
        parity: list = [None] * 4
        for i, node in enumerate(nodes):
            if i == lost:
                continue
            channel = await channel_pair(nursery, serving(tmp_path / node))
            data[i] = transfer.RemoteData(nursery, channel, 7, 3)
            parity[i] = transfer.RemoteFile(nursery, channel, 7, 3, f"{xor.REDUNDANCY_DIR}/{xor.PARITY}",
                                            metas[i].parity_size, metas[i].parity_checksum)
        await trio.to_thread.run_sync(lambda: xor.rebuild(lost, metas[0], data, parity, new_gen))
        nursery.cancel_scope.cancel()
    for name, blob in content[nodes[lost]].items():
        assert first_difference((new_gen / name).read_bytes(), blob) is None, name
    assert xor.read_meta(new_gen) == metas[lost]


def test_a_share_counts_only_once_its_last_file_landed(tmp_path):
    from gangd.redundancy import held

    nodes, dirs, _ = make_set(tmp_path, 3, seed=2)
    plan = rplan.make_plan(nodes)
    assert "holds no XOR parity" in held.missing(dirs[0], plan, "n0")
    xor.encode_set(dirs, nodes)
    assert [held.missing(d, plan, n) for d, n in zip(dirs, nodes, strict=True)] == [None] * 3
    os.unlink(dirs[1] / "redundancy" / "xor.meta")  # a parity write that died before its meta
    assert "holds no XOR parity" in held.missing(dirs[1], plan, "n1")
    assert "not n0, n1" in held.missing(dirs[0], rplan.make_plan(["n0", "n1", "n2", "n3"], "xor", 2), "n0")
    assert "no whole copy of node n2's files" in held.missing(dirs[0], rplan.make_plan(nodes, "partner"), "n0")


# ================================================================ bulk path

SECRET = b"s" * 32


def bulk_serving(root: Path, server, send=None):
    """A daemon's handler with the bulk op (and the channel ops, for manifests);
    ``send``: a lying sender on the bulk socket instead of the honest one."""
    from gangd.redundancy import bulk

    channel_ops = serving(root)

    async def handler(channel, request):
        if request.op == "ckpt_bulk_read":
            if send is None:
                return await transfer.handle_bulk_read(server, root, request.args)
            where = transfer.Where.from_args(request.args)
            name = transfer.check_name(request.args["name"])
            return await bulk.serve(server, lambda: transfer._open_file(root, where, name), name, send=send)
        return await channel_ops(channel, request)

    return handler


async def bulk_server(nursery, secret=SECRET):
    from gangd.redundancy import bulk

    server = bulk.BulkServer(secret)
    await nursery.start(server.run)
    return server


async def test_a_generation_moves_on_the_bulk_path_bit_identical(peer_gen):
    from gangd.redundancy import bulk

    root, manifest, files, dest = peer_gen
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server))
        await transfer.fetch_generation(channel, manifest, dest, owner=(NOBODY, NOBODY), bulk=bulk.Bulk.from_secret(SECRET))
        assert server.tickets == {}  # every ticket released with its request
        nursery.cancel_scope.cancel()
    for name, data in files.items():
        assert (dest / name).read_bytes() == data
    assert ckptstore.verify(dest) == []
    assert os.stat(dest / "ranks" / "rank-0.state").st_uid == NOBODY


async def test_strangers_holding_idle_connections_cannot_lock_the_peers_out_of_the_bulk_path(peer_gen):
    """Any local user can connect to the listener: 80 connections that never
    say a word (more than the handshakes it keeps at once) must not keep a
    real peer's transfer from getting through."""
    from gangd.redundancy import bulk

    root, manifest, files, dest = peer_gen
    idle = []
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        for _ in range(bulk.MAX_HANDSHAKES + 16):
            idle.append(await trio.open_tcp_stream("127.0.0.1", server.port))
        channel = await channel_pair(nursery, bulk_serving(root, server))
        with trio.fail_after(30):
            await transfer.fetch_generation(channel, manifest, dest, bulk=bulk.Bulk.from_secret(SECRET))
        assert len(server._pending) <= bulk.MAX_HANDSHAKES
        for stream in idle:
            await stream.aclose()
        nursery.cancel_scope.cancel()
    for name, data in files.items():
        assert (dest / name).read_bytes() == data


async def test_parity_and_a_rebuild_on_the_bulk_path_equal_the_local_ones(tmp_path):
    from gangd.redundancy import bulk

    nodes, dirs, content = make_set(tmp_path, 4, seed=31)
    metas = xor.encode_set(dirs, nodes)
    expected = (dirs[0] / "redundancy" / "xor.parity").read_bytes()
    shutil.rmtree(dirs[0] / "redundancy")
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    key = bulk.Bulk.from_secret(SECRET)
    async with trio.open_nursery() as nursery:
        channels = {}
        for node in nodes:
            server = await bulk_server(nursery)
            channels[node] = await channel_pair(nursery, bulk_serving(tmp_path / node, server))
        sources: list = [None] + [transfer.RemoteData(nursery, channels[n], 7, 3, bulk=key) for n in nodes[1:]]
        meta = await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
        assert meta == metas[0]
        assert (dirs[0] / "redundancy" / "xor.parity").read_bytes() == expected
        lost = 2
        shutil.rmtree(dirs[lost])
        new_gen = ckptstore.gen_dir(tmp_path / "n9", 7, 3)
        new_gen.parent.mkdir(parents=True)
        data: list = [None] * 4
        parity: list = [None] * 4
        for i, node in enumerate(nodes):
            if i != lost:
                data[i] = transfer.RemoteData(nursery, channels[node], 7, 3, bulk=key)
                parity[i] = transfer.RemoteFile(nursery, channels[node], 7, 3, f"{xor.REDUNDANCY_DIR}/{xor.PARITY}",
                                                metas[i].parity_size, metas[i].parity_checksum, bulk=key)
        await trio.to_thread.run_sync(lambda: xor.rebuild(lost, metas[0], data, parity, new_gen))
        nursery.cancel_scope.cancel()
    for name, blob in content[nodes[lost]].items():
        assert first_difference((new_gen / name).read_bytes(), blob) is None, name
    assert xor.read_meta(new_gen) == metas[lost]


def _bulk_liar(kind):
    """A sender that proves itself (it holds the secret) and then lies on the bulk socket."""
    from gangd.redundancy import bulk

    def send(sock, source):
        data = bytearray(source.size)
        source.read_into(0, memoryview(data))
        chunks = [bytes(data[i : i + bulk.CHUNK]) for i in range(0, len(data), bulk.CHUNK)]
        out = []
        if kind == "flipped":  # a byte changed, its chunk hash recomputed: only the manifest's checksum can tell
            chunks[0] = bytes([chunks[0][0] ^ 1]) + chunks[0][1:]
        if kind == "short":
            chunks[-1] = chunks[-1][:-1]
        for i, chunk in enumerate(chunks):
            h = bulk.chunk_hash(chunk)
            if kind == "bad_hash" and i == 0:
                h ^= 1
            out.append(bulk.HEADER.pack(len(chunk), h) + chunk)
        if kind == "extra_chunk":
            out.append(bulk.HEADER.pack(10, bulk.chunk_hash(b"x" * 10)) + b"x" * 10)
        out.append(bulk.HEADER.pack(0, 0))
        if kind == "after_end":
            out.append(b"more")
        if kind == "cut":
            out = [b"".join(out)[: bulk.CHUNK // 2]]
        sock.sendall(b"".join(out))
        sock.shutdown(socket.SHUT_WR)
        return source.size

    return send


@pytest.mark.parametrize(("kind", "refusal"), [
    ("flipped", "does not match the manifest"),
    ("short", "chunk of .* bytes at offset"),
    ("bad_hash", "corrupted"),
    ("extra_chunk", "more than the"),
    ("after_end", "more after the end"),
    ("cut", "connection ended"),
])
async def test_a_liar_on_the_bulk_socket_is_refused_and_the_file_comes_over_the_channel(tmp_path, kind, refusal, caplog):
    # What the liar sent is never kept. A file that arrived whole and wrong
    # ("flipped") fails the transfer: the channel would bring the same bytes.
    # Any other broken bulk transfer is pulled again over the peer channel,
    # every byte checked the same way.
    from gangd.redundancy import bulk

    rng = random.Random(8)
    blob = rng.randbytes(2 * bulk.CHUNK + 777)
    root = tmp_path / "n2"
    manifest = make_gen(ckptstore.gen_dir(root, 7, 3), "n2", {"ranks/rank-0.state": blob})
    dest = tmp_path / "dest"
    dest.mkdir()
    size, checksum = manifest.files["ranks/rank-0.state"]
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server, send=_bulk_liar(kind)))

        async def fetch() -> None:
            await transfer.fetch_file(channel, lineage=7, gen=3, name="ranks/rank-0.state", size=size, checksum=checksum,
                                      dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))

        if kind == "flipped":
            with pytest.raises(bulk.BulkError, match=refusal) as err:
                await fetch()
            assert "rank-0.state of job-7/gen-3 from node n2" in str(err.value)
        else:
            with caplog.at_level(logging.WARNING, logger="gangd.transfer"):
                await fetch()
            assert re.search(refusal, caplog.text) and "pulling it over the peer channel instead" in caplog.text, caplog.text
        nursery.cancel_scope.cancel()
    if kind == "flipped":
        assert list(dest.iterdir()) == []
    else:
        assert [f.name for f in dest.iterdir()] == ["rank-0.state"] and first_difference((dest / "rank-0.state").read_bytes(), blob) is None


def _stall_after_one_chunk(wait: float, stalled=None, released=None):
    """A bulk sender that sends one chunk, then nothing, holding its connection
    open (up to ``wait`` s) until the puller closes it; ``stalled`` and
    ``released`` (threading.Events) set once it stalls and once it saw the close."""
    from gangd.redundancy import bulk

    def stall(sock, source):
        first = bytearray(bulk.CHUNK)
        source.read_into(0, memoryview(first))
        sock.sendall(bulk.HEADER.pack(len(first), bulk.chunk_hash(first)) + first)
        bulk.blocking(sock, wait)
        if stalled is not None:
            stalled.set()
        try:  # then nothing, until the puller gives up and closes
            while sock.recv(1):
                pass
        except OSError:
            pass
        if released is not None:
            released.set()
        return bulk.CHUNK

    return stall


async def test_a_sender_that_stalls_mid_file_fails_the_bulk_path_and_the_file_comes_over_the_channel(tmp_path, caplog, monkeypatch):
    # The bulk sockets are blocking with the kernel's timeout (SO_RCVTIMEO),
    # not Python's: a peer that sends one chunk and then nothing, holding
    # the connection open, still fails the transfer once the timeout passes.
    from gangd.redundancy import bulk

    monkeypatch.setattr(bulk, "IO_TIMEOUT", 0.5)
    blob = random.Random(9).randbytes(2 * bulk.CHUNK + 5)
    root = tmp_path / "n2"
    manifest = make_gen(ckptstore.gen_dir(root, 7, 3), "n2", {"ranks/rank-0.state": blob})
    size, checksum = manifest.files["ranks/rank-0.state"]
    dest = tmp_path / "dest"
    dest.mkdir()

    stall = _stall_after_one_chunk(30.0)  # (this end waits longer than the puller)
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server, send=stall))
        with caplog.at_level(logging.WARNING, logger="gangd.transfer"):
            await transfer.fetch_file(channel, lineage=7, gen=3, name="ranks/rank-0.state", size=size, checksum=checksum,
                                      dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))
        nursery.cancel_scope.cancel()
    assert "the peer sent nothing for" in caplog.text and "pulling it over the peer channel instead" in caplog.text, caplog.text
    assert first_difference((dest / "rank-0.state").read_bytes(), blob) is None


async def test_a_bulk_file_transfer_cancelled_while_the_sender_stalls_stops_at_once_and_leaves_nothing(tmp_path, monkeypatch):
    # The worker thread that dialled and receives is blocked on its socket;
    # cancelling the transfer cuts it (the thread's call fails now, not
    # after the 60 s timeout), the sender sees the close, and neither the
    # file nor its temporary name is left once the cancel returns: it waits
    # for the cut thread's cleanup (slowed here, as a busy disk would:
    # before, it could still be there: seen once under load).
    import threading

    from gangd.redundancy import bulk

    assert bulk.IO_TIMEOUT >= 60
    blob = random.Random(10).randbytes(2 * bulk.CHUNK + 5)
    root = tmp_path / "n2"
    manifest = make_gen(ckptstore.gen_dir(root, 7, 3), "n2", {"ranks/rank-0.state": blob})
    size, checksum = manifest.files["ranks/rank-0.state"]
    dest = tmp_path / "dest"
    dest.mkdir()
    stalled, released = threading.Event(), threading.Event()
    stall = _stall_after_one_chunk(120.0, stalled, released)
    real_close = bulk.DirectFile.close

    def slow_close(self) -> None:
        time.sleep(0.3)
        real_close(self)

    monkeypatch.setattr(bulk.DirectFile, "close", slow_close)
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server, send=stall))
        with trio.fail_after(30):
            async with trio.open_nursery() as transfer_scope:

                async def cancel_once_stalled() -> None:
                    await trio.to_thread.run_sync(stalled.wait)
                    transfer_scope.cancel_scope.cancel()

                transfer_scope.start_soon(cancel_once_stalled)
                await transfer.fetch_file(channel, lineage=7, gen=3, name="ranks/rank-0.state", size=size, checksum=checksum,
                                          dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))
                raise AssertionError("the transfer was not cancelled")
            await trio.to_thread.run_sync(released.wait)
        nursery.cancel_scope.cancel()
    assert list(dest.iterdir()) == []


async def test_a_wrong_size_offer_or_a_listener_without_the_secret_is_refused(peer_gen, caplog):
    from gangd.redundancy import bulk

    root, manifest, _, dest = peer_gen
    name = "ranks/rank-0.state"
    size, checksum = manifest.files[name]
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery, secret=b"another cluster's secret")
        channel = await channel_pair(nursery, bulk_serving(root, server))
        with caplog.at_level(logging.WARNING, logger="gangd.transfer"):
            # A size that is not the manifest's: refused on the bulk path, then on the channel.
            with pytest.raises(transfer.TransferError, match=r"more than the .* bytes expected"):
                await transfer.fetch_file(channel, lineage=7, gen=3, name=name, size=size - 1, checksum=checksum,
                                          dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))
            assert re.search(r"offers .* bytes; .* were expected", caplog.text), caplog.text
            assert list(dest.iterdir()) == []
            # A bulk listener that cannot prove the secret is never read from; the channel brings the file.
            await transfer.fetch_file(channel, lineage=7, gen=3, name=name, size=size, checksum=checksum,
                                      dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))
            assert "could not prove it holds the cluster secret" in caplog.text, caplog.text
        nursery.cancel_scope.cancel()
    assert ckptstore.checksum_file(dest / "rank-0.state") == (size, checksum)


def _stranger(port: int, ticket: bytes, secret_file: str) -> dict:
    """Run as uid nobody: read the cluster secret, then open a bulk transfer
    with a made-up ticket, then with a valid ticket and a guessed key."""
    from gangd.redundancy import bulk

    result: dict = {}
    try:
        with open(secret_file, "rb") as f:
            result["secret"] = f.read().hex()
    except OSError as exc:
        result["secret"] = type(exc).__name__
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(bulk.MAGIC + os.urandom(bulk.NONCE) + os.urandom(bulk.TICKET))
        result["unknown_ticket_answer"] = len(sock.recv(1 << 16))
    key = bulk.bulk_key(b"guessed secret, not the cluster's")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        nonce_d = os.urandom(bulk.NONCE)
        sock.sendall(bulk.MAGIC + nonce_d + ticket)
        answer = b""
        while len(answer) < bulk.NONCE + bulk.MAC:
            got = sock.recv(bulk.NONCE + bulk.MAC - len(answer))
            if not got:
                break
            answer += got
        sock.sendall(bulk.proof(key, b"dialer", nonce_d, answer[: bulk.NONCE], ticket))
        rest = b""
        while got := sock.recv(1 << 16):
            rest += got
        result["after_proof"] = len(rest)
    return result


async def test_a_stranger_uid_cannot_open_a_bulk_transfer(peer_gen, tmp_path):
    from conftest import as_uid

    from gangd.redundancy import bulk

    root, manifest, files, dest = peer_gen
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    name = "ranks/rank-0.state"
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server))
        async with channel.stream("ckpt_bulk_read", lineage=7, gen=3, name=name) as items:
            offer = await bulk.first_item(items, name)
            ticket, port = bulk.check_offer(offer, manifest.files[name][0], name)  # (a ticket leaked to the stranger)
            result = await trio.to_thread.run_sync(as_uid, NOBODY, lambda: _stranger(port, ticket, str(secret_file)))
            assert result == {"secret": "PermissionError", "unknown_ticket_answer": 0, "after_proof": 0}, result
            # the ticket is still the puller's: the real transfer goes through
            sock = await trio.to_thread.run_sync(bulk.dial, "127.0.0.1", port, bulk.bulk_key(SECRET), ticket, name)
            await bulk.run_on_socket(sock, bulk.receive_file, sock, dest, "copy", *manifest.files[name], None, name)
        nursery.cancel_scope.cancel()
    assert (dest / "copy").read_bytes() == files[name]


async def test_a_ticket_nobody_claims_is_released_and_a_bad_name_or_link_is_refused(peer_gen, monkeypatch):
    from gangd.redundancy import bulk

    monkeypatch.setattr(bulk, "CLAIM_TIMEOUT", 0.5)
    root, _, _, dest = peer_gen
    async with trio.open_nursery() as nursery:
        server = await bulk_server(nursery)
        channel = await channel_pair(nursery, bulk_serving(root, server))
        with pytest.raises(RemoteError, match="did not open its bulk connection"):
            async with channel.stream("ckpt_bulk_read", lineage=7, gen=3, name="job.msgpack") as items:
                async for _ in items:
                    assert len(server.tickets) == 1  # issued, never claimed
        assert server.tickets == {}
        with pytest.raises(RemoteError, match="not a file of a checkpoint generation"):
            await channel.request("ckpt_bulk_read", lineage=7, gen=3, name="../../etc/passwd")
        os.symlink("/etc/passwd", ckptstore.gen_dir(root, 7, 3) / "ranks" / "rank-9.state")
        with pytest.raises(RemoteError, match="symbolic link"):
            await transfer.fetch_file(channel, lineage=7, gen=3, name="ranks/rank-9.state", size=6, checksum="0",
                                      dest_dir=dest, bulk=bulk.Bulk.from_secret(SECRET))
        assert list(dest.iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_a_parity_on_the_bulk_path_with_a_peer_that_lacks_its_data_fails_and_leaves_no_meta(tmp_path):
    from gangd.redundancy import bulk, held

    nodes, dirs, _ = make_set(tmp_path, 3, seed=41)
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    shutil.rmtree(dirs[2])  # n2 lost its generation after it committed
    key = bulk.Bulk.from_secret(SECRET)
    async with trio.open_nursery() as nursery:
        sources: list = [None]
        for node in nodes[1:]:
            server = await bulk_server(nursery)
            sources.append(transfer.RemoteData(nursery, await channel_pair(nursery, bulk_serving(tmp_path / node, server)), 7, 3, bulk=key))
        with pytest.raises(xor.RebuildError, match="gen-3"):
            await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
        nursery.cancel_scope.cancel()
    assert "holds no XOR parity" in held.missing(dirs[0], rplan.make_plan(nodes), "n0")
    assert not (dirs[0] / "redundancy" / ".xor.parity.tmp").exists()
