"""The XOR paths between daemons (issue 16): parity and rebuild over the bulk
path when that path is refused or lies, and a recovery that finds a
survivor's checkpoint wiped.

The transfers run between real trio Channels over real socket pairs, the
bulk bytes on real TCP connections with the HMAC handshake; a lying sender
proves it holds the secret and then sends short, corrupted, cut or
over-long streams. The recovery test runs real daemons, real ranks, a real
etcd.
"""

from __future__ import annotations

import logging
import random
import re
import shutil

import pytest
import trio
from conftest import first_difference
from test_redundancy import SECRET, _bulk_liar, bulk_server, channel_pair, make_gen, serving

from gangd import ckptstore
from gangd.redundancy import bulk, transfer, xor
from gangd.rpc import leaf_error

# ================================================================ the bulk path refused or lying, on the XOR reads

PARITY = f"{xor.REDUNDANCY_DIR}/{xor.PARITY}"


def xor_set(tmp_path, n: int = 3, seed: int = 5):
    """A set of ``n`` generations whose data are several bulk chunks long
    (so a liar can break a slice in its middle), each member's parity written."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(n)]
    dirs = [ckptstore.gen_dir(tmp_path / node, 7, 3) for node in nodes]
    content = {}
    for i, (node, directory) in enumerate(zip(nodes, dirs, strict=True)):
        files = {f"ranks/rank-{i}.state": rng.randbytes(3 * bulk.CHUNK + rng.randrange(1, 5000)),
                 "job.msgpack": rng.randbytes(rng.randrange(1, 2000))}
        content[node] = files
        make_gen(directory, node, files)
    metas = xor.encode_set(dirs, nodes)
    return nodes, dirs, content, metas


def lying_bulk(root, server, kind: str, on: str):
    """A daemon's handler whose bulk sends lie (``kind``, as in test_redundancy)
    for data slices (``on="data"``), whole files (``"file"``) or both; the channel ops honest."""
    channel_ops = serving(root)

    async def handler(channel, request):
        if request.op != "ckpt_bulk_read":
            return await channel_ops(channel, request)
        where = transfer.Where.from_args(request.args)
        if "name" in request.args:
            name = transfer.check_name(request.args["name"])
            send = _bulk_liar(kind) if on in ("file", "both") else bulk.send_source
            return await bulk.serve(server, lambda: transfer._open_file(root, where, name), name, send=send)
        start, length = request.args["start"], request.args["length"]
        protected = request.args.get("protected", False)
        send = _bulk_liar(kind) if on in ("data", "both") else bulk.send_source
        return await bulk.serve(server, lambda: transfer._open_data(root, where, start, length, protected), "data", send=send)

    return handler


async def rebuild_over_bulk(tmp_path, nodes, metas, lost: int, handlers: dict):
    new_gen = ckptstore.gen_dir(tmp_path / "n9", 7, 3)
    new_gen.parent.mkdir(parents=True, exist_ok=True)
    key = bulk.Bulk.from_secret(SECRET)
    try:
        async with trio.open_nursery() as nursery:
            await _rebuild(nursery, nodes, metas, lost, handlers, key, new_gen)
    except BaseExceptionGroup as group:
        raise leaf_error(group) from None
    return new_gen


async def _rebuild(nursery, nodes, metas, lost, handlers, key, new_gen) -> None:
    data: list = [None] * len(nodes)
    parity: list = [None] * len(nodes)
    for i, node in enumerate(nodes):
        if i == lost:
            continue
        channel = await channel_pair(nursery, await handlers[node](nursery))
        data[i] = transfer.RemoteData(nursery, channel, 7, 3, bulk=key, protected=True)
        parity[i] = transfer.RemoteFile(nursery, channel, 7, 3, PARITY, metas[i].parity_size, metas[i].parity_checksum, bulk=key)
    try:
        await trio.to_thread.run_sync(lambda: xor.rebuild(lost, metas[0], data, parity, new_gen))
    finally:
        nursery.cancel_scope.cancel()


def honest(root):
    async def make(nursery):
        server = await bulk_server(nursery)
        from test_redundancy import bulk_serving

        return bulk_serving(root, server)

    return make


def liar(root, kind: str, on: str):
    async def make(nursery):
        return lying_bulk(root, await bulk_server(nursery), kind, on)

    return make


def without_the_secret(root):
    async def make(nursery):
        from test_redundancy import bulk_serving

        return bulk_serving(root, await bulk_server(nursery, secret=b"another cluster's secret"))

    return make


@pytest.mark.parametrize(("kind", "on", "refusal"), [
    ("short", "both", "chunk of .* bytes at offset"),  # the last chunk short: the rest of the slice over the channel
    ("bad_hash", "data", "corrupted"),
    ("cut", "both", "connection ended"),
    ("extra_chunk", "file", "more than the"),
    ("after_end", "both", "more after the end"),
    ("refused", "both", "could not prove it holds the cluster secret"),
])
async def test_an_xor_rebuild_whose_bulk_path_breaks_gets_the_bytes_over_the_channel(tmp_path, kind, on, refusal, caplog):
    # A survivor's bulk sender lies (or its listener cannot prove the
    # secret): what it sent past the last good chunk is never used, and the
    # rest of each slice (a parity: all of it again, the part already used
    # compared) comes over the peer channel; the lost member comes back
    # bit-identical. Before: the rebuild failed with the bulk path's error.
    nodes, dirs, content, metas = xor_set(tmp_path)
    lost = 0
    shutil.rmtree(dirs[lost])
    handlers = {node: honest(tmp_path / node) for node in nodes}
    handlers["n1"] = without_the_secret(tmp_path / "n1") if kind == "refused" else liar(tmp_path / "n1", kind, on)
    with caplog.at_level(logging.WARNING, logger="gangd.transfer"):
        new_gen = await rebuild_over_bulk(tmp_path, nodes, metas, lost, handlers)
    assert re.search(refusal, caplog.text) and "pulling it over the peer channel instead" in caplog.text, caplog.text
    assert "from node n2" in caplog.text  # (the label of the liar's channel in channel_pair)
    for name, blob in content[nodes[lost]].items():
        assert first_difference((new_gen / name).read_bytes(), blob) is None, name
    assert xor.read_meta(new_gen) == metas[lost]


async def test_a_parity_that_arrives_whole_and_wrong_on_the_bulk_path_is_damaged_and_nothing_is_left(tmp_path):
    # Every chunk of the parity checks out and the whole does not match the
    # meta's checksum: the channel would bring the same bytes, so no
    # fallback; the rebuild fails naming the file, and leaves no directory.
    nodes, dirs, _, metas = xor_set(tmp_path)
    shutil.rmtree(dirs[0])
    handlers = {node: honest(tmp_path / node) for node in nodes}
    handlers["n1"] = liar(tmp_path / "n1", "flipped", "file")
    with pytest.raises(xor.Damaged, match=r"xor\.parity of job-7/gen-3 from node n2: checksum .* does not match"):
        await rebuild_over_bulk(tmp_path, nodes, metas, 0, handlers)
    assert list((tmp_path / "n9" / "job-7").iterdir()) == []


@pytest.mark.parametrize("kind", ["short", "cut", "refused"])
async def test_a_parity_written_while_a_peers_bulk_path_breaks_equals_the_local_one(tmp_path, kind, caplog):
    # The same fallback on the write side: member 0's parity from its peers'
    # slices, one peer's bulk sender lying; the parity is the one computed
    # locally, and its meta lands.
    nodes, dirs, _, metas = xor_set(tmp_path, n=4, seed=6)
    expected = (dirs[0] / PARITY).read_bytes()
    shutil.rmtree(dirs[0] / xor.REDUNDANCY_DIR)
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    key = bulk.Bulk.from_secret(SECRET)
    with caplog.at_level(logging.WARNING, logger="gangd.transfer"):
        async with trio.open_nursery() as nursery:
            sources: list = [None]
            for node in nodes[1:]:
                make = honest(tmp_path / node)
                if node == "n2":
                    make = without_the_secret(tmp_path / node) if kind == "refused" else liar(tmp_path / node, kind, "data")
                sources.append(transfer.RemoteData(nursery, await channel_pair(nursery, await make(nursery)), 7, 3, bulk=key))
            meta = await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
            nursery.cancel_scope.cancel()
    assert "pulling it over the peer channel instead" in caplog.text, caplog.text
    assert meta == metas[0]
    assert (dirs[0] / PARITY).read_bytes() == expected


async def test_a_parity_write_that_dies_halfway_leaves_the_generation_unprotected(tmp_path, monkeypatch):
    # A peer whose stream ends short, after the writer thread has written
    # a block of the parity: no parity, no temporary file, no meta; the
    # generation stays complete, never protected.
    from gangd.redundancy import held
    from gangd.redundancy import plan as rplan

    monkeypatch.setattr(xor, "WRITE_BLOCK", xor.BLOCK)
    written: list[int] = []
    real_write = xor.DirectFile.write
    monkeypatch.setattr(xor.DirectFile, "write", lambda self, view: (written.append(len(view)), real_write(self, view))[1])
    nodes, dirs, _, _ = xor_set(tmp_path, n=3, seed=7)
    shutil.rmtree(dirs[0] / xor.REDUNDANCY_DIR)
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    async with trio.open_nursery() as nursery:
        sources: list = [None]
        for node in nodes[1:]:
            lie = (lambda items: items[: len(items) * 9 // 10]) if node == "n2" else None
            sources.append(transfer.RemoteData(nursery, await channel_pair(nursery, serving(tmp_path / node, lie)), 7, 3))
        with pytest.raises(xor.RebuildError, match=r"the stream ended after \d+ of \d+ bytes"):
            await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
        nursery.cancel_scope.cancel()
    assert written and sum(written) >= xor.BLOCK  # (it died after writing)
    assert "holds no XOR parity" in held.missing(dirs[0], rplan.make_plan(nodes), "n0")
    assert sorted(p.name for p in (dirs[0] / xor.REDUNDANCY_DIR).iterdir()) == []


# ================================================================ a survivor wiped during an automatic recovery


def wipe(cluster, node: str) -> None:
    """Everything in ``node``'s checkpoint directory deleted under its running daemon (its disk's files gone)."""
    root = cluster.dir / node / "state" / "checkpoints" / node
    for entry in root.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def lost_and_wiped_while_recovering(cluster, points, job: int) -> tuple[str, str]:
    """A node of the job lost (not the coordinator); while the job is
    RECOVERING (held before it looks at its files), another survivor's
    checkpoint files wiped; then the recovery goes on. (lost, wiped)."""
    from test_recovery import coordinator, lose

    from gangd import jobs

    nodes = jobs.nodes_of(cluster.job(job))
    lead = coordinator(cluster)
    victim = [n for n in nodes if n != lead][-1]
    survivor = next(n for n in nodes if n != victim)
    (points / "recover.hold").touch()
    lose(cluster, victim)
    cluster.wait_state(job, ("RECOVERING",), timeout=120)
    wipe(cluster, survivor)
    (points / "recover.hold").unlink()
    return victim, survivor


def test_a_survivor_wiped_during_the_recovery_of_an_xor_set_fails_the_job_naming_both_nodes(make_cluster, points):
    from ckpthelpers import kill_what_is_left
    from test_recovery import ENDED, protected_held_job

    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",))
    try:
        job, release, _, _ = protected_held_job(cluster, 3, "xor")
        victim, survivor = lost_and_wiped_while_recovering(cluster, points, job)
        release.touch()
        record = cluster.wait_state(job, ENDED, timeout=180)
        assert record["state"] == "FAILED", record
        reason = record["reason"]
        assert reason.startswith(f"node {victim} lost; not recovered: "), reason
        assert f"node {survivor} no longer holds its files" in reason, reason
        assert [r for r in cluster.gang_json("ps", "--all") if r.get("lineage") == job and r["id"] != job] == []
    finally:
        kill_what_is_left(cluster)


def test_a_survivor_wiped_during_the_recovery_of_a_partner_ring_is_rebuilt_too_and_the_job_comes_back(make_cluster, points):
    # A ring of four: the lost node's copy is on its successor, and the wiped
    # node (the one across the ring) has its copy on a live node too: both
    # are rebuilt where their ranks now run, the lost node's on the spare,
    # and the job ends bit-identical to an uninterrupted run.
    from ckpthelpers import kill_what_is_left, reference, result_of
    from test_recovery import ARGV, ENDED, coordinator, lose, protected_held_job

    from gangd import jobs
    from gangd.redundancy.plan import make_plan

    cluster = make_cluster(5, cores=2, time_slice=0.1, spares=("n5",))
    try:
        expected = reference(cluster, ARGV, 4, "--per-node", "1")
        job, release, record, taken = protected_held_job(cluster, 4, "partner")
        nodes = jobs.nodes_of(record)
        assert len(nodes) == 4 and "n5" not in nodes, nodes
        plan = make_plan(list(dict.fromkeys(taken["placement"])), "partner")
        lead = coordinator(cluster)
        victim = [n for n in nodes if n != lead][-1]
        survivor = next(n for n in nodes if n not in (victim, plan.partner_of(victim)) and plan.partner_of(n) != victim)
        (points / "recover.hold").touch()
        lose(cluster, victim)
        cluster.wait_state(job, ("RECOVERING",), timeout=120)
        wipe(cluster, survivor)
        (points / "recover.hold").unlink()
        release.touch()
        old = cluster.wait_state(job, ENDED, timeout=180)
        assert old["state"] == "REQUEUED", old
        new = cluster.job(old["requeued_as"])
        assert new["restart_of"]["gen"] == taken["gen"], new
        # Both nodes' files rebuilt (the wiped node's ranks may move to the spare with the lost node's: it counts as down for them).
        rebuilt = new["recovery_of"]["rebuilt"]
        assert set(rebuilt) == {victim, survivor} and victim not in rebuilt.values(), new["recovery_of"]
        assert rebuilt[victim] == "n5", rebuilt
        assert new["placement"] == [rebuilt.get(n, n) for n in taken["placement"]], new["placement"]
        assert result_of(cluster, new["id"], timeout=300) == expected
    finally:
        kill_what_is_left(cluster)


def test_a_survivor_wiped_during_the_recovery_of_an_xor_set_falls_back_to_the_older_flushed_generation(make_cluster, points, tmp_path):
    # Generation A is protected and flushed; B is protected, its flush held
    # (never done). A node lost, a survivor wiped: neither generation can be
    # rebuilt from the XOR set (two of its three members), so B is passed
    # over, saying why, and the job comes back from A's flushed copy,
    # bit-identical.
    from ckpthelpers import checkpoint, generations, kill_what_is_left, reference, result_of
    from conftest import wait_for
    from test_recovery import ARGV, ENDED, protected_held_job, wait_protected

    shared = tmp_path / "shared"
    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",), flush_dir=shared)
    try:
        expected = reference(cluster, ARGV, 3, "--per-node", "1")
        job, release, _, first = protected_held_job(cluster, 3, "xor")
        wait_for(lambda: next(g for g in generations(cluster, job) if g["gen"] == first["gen"]).get("flushed"), 60, "A flushed")
        (points / "flush.hold").touch()
        second = checkpoint(cluster, job)
        wait_protected(cluster, job, second["gen"])
        victim, survivor = lost_and_wiped_while_recovering(cluster, points, job)
        release.touch()
        old = cluster.wait_state(job, ENDED, timeout=180)
        assert old["state"] == "REQUEUED", old
        new = cluster.job(old["requeued_as"])
        assert new["restart_of"]["gen"] == first["gen"], new
        skipped = " ".join(new["recovery_of"].get("skipped") or [])
        assert f"generation {second['gen']}: node {survivor} no longer holds its files" in skipped, new["recovery_of"]
        assert victim not in new["placement"], new["placement"]
        assert result_of(cluster, new["id"], timeout=300) == expected
    finally:
        (points / "flush.hold").unlink(missing_ok=True)
        kill_what_is_left(cluster)


# ================================================================ a cancelled transfer stops at once


def hung(root, kept: list, sent: trio.Event):
    """A daemon's handler whose bulk sender of data slices sends one chunk,
    then nothing, and never lets go: its connection is left open when the
    request is cancelled (a peer that is hung or hostile; an honest sender
    shuts its socket down then). ``kept``: those sockets, for the test;
    ``sent`` set once the chunk is sent."""
    from gangd.rpc import Stream

    channel_ops = serving(root)

    async def make(nursery):
        server = await bulk_server(nursery)

        async def handler(channel, request):
            if request.op != "ckpt_bulk_read":
                return await channel_ops(channel, request)

            async def produce(emit) -> None:
                ticket, slot = server.issue()
                await emit({"ticket": ticket, "port": server.port, "size": request.args["length"]})
                await slot.claimed.wait()
                sock, slot.sock = slot.sock, None
                kept.append(sock)
                first = bytes(bulk.CHUNK)
                sock.sendall(bulk.HEADER.pack(len(first), bulk.chunk_hash(first)) + first)
                sent.set()
                await trio.sleep_forever()

            return Stream(produce)

        return handler

    return make


async def test_a_parity_write_cancelled_while_a_peer_stalls_stops_at_once_and_leaves_nothing(tmp_path):
    # The parity's thread is blocked reading a peer's bulk socket, the peer
    # hung (or hostile): one chunk sent, then nothing, and it never lets go
    # of its connection, not even when the request is cancelled. Cancelling
    # the parity (as the daemon does when the redundancy write fails or the
    # daemon stops) cuts the socket on this side: the thread stops now, not
    # after the bulk path's 60 s timeout; the peer sees the connection end;
    # no parity, temporary file or meta is left. Before: the task holding
    # the request was cancelled but the socket the thread read was not shut
    # down, and the thread waited out the timeout (an honest sender, whose
    # request is cancelled too, shuts its end down: that hid it).
    nodes, dirs, _, _ = xor_set(tmp_path, n=3, seed=8)
    shutil.rmtree(dirs[0] / xor.REDUNDANCY_DIR)
    manifests = [ckptstore.read_manifest(d) for d in dirs]
    key = bulk.Bulk.from_secret(SECRET)
    kept: list = []
    sent = trio.Event()
    assert bulk.IO_TIMEOUT >= 60
    async with trio.open_nursery() as peers:  # the peers live on: only the parity is cancelled
        channels = [await channel_pair(peers, await honest(tmp_path / "n1")(peers)),
                    await channel_pair(peers, await hung(tmp_path / "n2", kept, sent)(peers))]
        with trio.fail_after(30):
            async with trio.open_nursery() as parity:
                sources: list = [None] + [transfer.RemoteData(parity, channel, 7, 3, bulk=key) for channel in channels]

                async def cancel_once_stalled() -> None:
                    await sent.wait()
                    await trio.sleep(0.2)  # (the thread is then blocked reading the second chunk)
                    parity.cancel_scope.cancel()

                parity.start_soon(cancel_once_stalled)
                with pytest.raises(BaseException) as err:  # (whatever the thread ends with: it ends)
                    await trio.to_thread.run_sync(xor.write_parity, dirs[0], xor.meta_for(manifests, nodes, 0), sources)
        # the puller closed its end: the hung peer sees the end of the stream after the one chunk
        bulk.blocking(kept[0], 10.0)
        rest = b""
        while chunk := kept[0].recv(1 << 16):
            rest += chunk
        kept[0].close()
        peers.cancel_scope.cancel()
    assert rest == b""
    assert isinstance(err.value, (xor.RebuildError, trio.Cancelled)), repr(err.value)
    assert sorted(p.name for p in (dirs[0] / xor.REDUNDANCY_DIR).iterdir()) == []
