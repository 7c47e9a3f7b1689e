"""The history kept in blocks of ids: what etcd holds stays small, and every reader still finds each ended job once.

On a real etcd. The history used to be one key per ended job: a long-lived
cluster's etcd then held a key per job ever run (100 000 jobs slowed etcd's
own transactions by about 17 %). Now a block of BLOCK_IDS consecutive ids
is one key; a cluster upgraded in place still has its jobs in keys of their
own, and every read merges the two.
"""

from __future__ import annotations

import time

import pytest
import trio

from gangd import jobs
from gangd.daemon.store import Deposed, Fence, JobTable, Keys, jobtable
from gangd.daemon.store.jobtable import BLOCK_IDS, HistoryBlock, block_first, pack
from gangd.etcd.client import Etcd, Op
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease


def build(job_id: int, nranks: int = 1) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["app"], "nranks": nranks}, owner_uid=0, owner_name="root", owner_gid=0)


def ended(job_id: int, **extra) -> dict:
    return dict(build(job_id), state=jobs.DONE, placement=["n1"], ranks=[{"code": 0}], ended=time.time(), **extra)


async def leader(etcd: Etcd, keys: Keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


async def create_ended(table: JobTable, fence: Fence, count: int) -> list[int]:
    """``count`` jobs created and ended through the table (placed on n1, so each has its node's copy too)."""
    ids = []
    for _ in range(count):
        ids.append((await table.create(fence, build, {"HOME": "/root"}))["id"])
    for job_id in ids:
        await table.update(fence, job_id, lambda r: r.update(placement=["n1"]))
        await table.update(fence, job_id, lambda r: r.update(state=jobs.DONE, ranks=[{"code": 0}], ended=time.time()))
    return ids


async def count(etcd: Etcd, prefix: str) -> int:
    return (await etcd.range(prefix, prefix=True, count_only=True)).count


async def test_retired_jobs_go_into_blocks_and_read_back_in_every_direction(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys, node="n1")
        await table.widen()
        ids = await create_ended(table, fence, 300)
        # Retired in several rounds, out of id order, as jobs end.
        for part in (ids[150:], ids[:75], ids[75:150]):
            assert await table.retire(fence, [table.get(j) for j in part]) == len(part)
        assert table.records == {}
        # One key per block of ids, none per job; no job key, no copy, no environment left.
        assert await count(etcd, keys.blocks) == len({block_first(j) for j in ids})
        assert await count(etcd, keys.history) == 0
        for prefix in (keys.jobs, keys.placed, keys.env_prefix):
            assert await count(etcd, prefix) == 0
        reader = JobTable(etcd, keys, node="n2")
        assert [r["id"] for r in await reader.history(0, 1000)] == ids
        assert [r["id"] for r in await reader.history_before(None, 1000)] == ids[::-1]
        forward, after = [], 0
        while page := await reader.history(after, 37):  # (pages that end inside blocks)
            forward += [r["id"] for r in page]
            after = page[-1]["id"]
        assert forward == ids
        backward: list[int] = []
        before: int | None = None
        while page := await reader.history_before(before, 37):
            backward += [r["id"] for r in page]
            before = page[-1]["id"]
        assert backward == ids[::-1]
        # One job, and waiting on one (ended: answered at once).
        record = await reader.fetch(ids[100])
        assert record is not None and record["id"] == ids[100] and record["state"] == jobs.DONE
        async def not_yet(record: dict) -> bool:
            return False

        with trio.fail_after(10):
            assert (await reader.watch_job(ids[7], not_yet))["state"] == jobs.DONE
        assert await reader.fetch(ids[-1] + 1) is None
        # The counter goes on past them (a fresh coordinator reads it again).
        assert (await JobTable(etcd, keys).create(fence, build, {}))["id"] == ids[-1] + 1


async def test_a_history_an_older_gangd_wrote_job_by_job_reads_with_the_blocks(etcd_endpoints, keys):
    """A cluster upgraded in place: its history's jobs are keys of their own.
    Listings, fetches and lineages find those and the new blocks' jobs, in
    id order, each once; and an old one's record still learns (fenced)."""
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        old = [1, 2, 3, 70, 71, 200]
        for job_id in old:  # (as an older gangd's retire wrote them)
            await etcd.put(keys.past(job_id), pack(ended(job_id)))
        await etcd.put(keys.ids, "200")
        table = JobTable(etcd, keys)
        new = await create_ended(table, fence, 80)  # ids 201..280: blocks 192, 256
        assert await table.retire(fence, [table.get(j) for j in new]) == 80
        everything = sorted(old + new)
        assert [r["id"] for r in await table.history(0, 1000)] == everything
        assert [r["id"] for r in await table.history_before(None, 1000)] == everything[::-1]
        assert [r["id"] for r in await table.history(2, 3)] == [3, 70, 71]
        assert [r["id"] for r in await table.history_before(202, 3)] == [201, 200, 71]
        assert (await table.fetch(70))["id"] == 70 and (await table.fetch(250))["id"] == 250
        changed = await table.update(fence, 70, lambda r: r.update(reason="learnt"))
        assert changed["reason"] == "learnt" and (await JobTable(etcd, keys).fetch(70))["reason"] == "learnt"


async def test_an_ended_record_in_a_block_still_learns_fenced_and_compared_with_its_block(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd:
        async with open_lease(etcd, 10) as lease:
            fence = await leader(etcd, keys, lease)
            table = JobTable(etcd, keys)
            entry = {"gen": 1, "state": "complete", "placement": ["n1"]}
            ids = await create_ended(table, fence, 3)
            await table.update(fence, ids[0], lambda r: r.update(checkpoints=[dict(entry)]))
            assert await table.retire(fence, [table.get(j) for j in ids[:2]]) == 2
            # The lineage index finds it in its block.
            reader = JobTable(etcd, keys)
            await reader.read_lineage(ids[0])
            assert [r["id"] for r in reader.lineage(ids[0])] == [ids[0]]
            # Another retirement rewrites the block meanwhile: the change is
            # made to the newer block, and loses neither it nor the job it added.
            stale = await reader.fetch(ids[0])
            assert await table.retire(fence, [table.get(ids[2])]) == 1  # (same block: its revision moves)
            marked = await table._update_past(fence, ids[0], stale, lambda r: r["checkpoints"][0].update(state="removed"))
            assert marked["checkpoints"][0]["state"] == "removed"
            assert (await JobTable(etcd, keys).fetch(ids[0]))["checkpoints"][0]["state"] == "removed"
            assert [r["id"] for r in await reader.history(0, 10)] == ids
        # A deposed coordinator can neither retire into a block nor change one.
        async with open_lease(etcd, 10) as other:
            await leader(etcd, keys, other)
            now = await leader(etcd, keys, other)
            more = await JobTable(etcd, keys).history(0, 10)
            with pytest.raises(Deposed):
                await table.update(fence, ids[1], lambda r: r.update(reason="x"))
            assert "reason" not in more[1] or more[1]["reason"] != "x"
            assert (await JobTable(etcd, keys).fetch(ids[1]))["reason"] != "x"
            hot = (await table.create(now, build, {}))["id"]
            await table.update(now, hot, lambda r: r.update(state=jobs.DONE))
            with pytest.raises(Deposed):
                await table.retire(fence, [table.get(hot)])
            assert await count(etcd, keys.job(hot)) == 1  # (still hot: nothing of the deposed one's retirement applied)


async def test_a_record_too_large_for_a_block_gets_a_key_of_its_own(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        ids = await create_ended(table, fence, 3)
        await table.update(fence, ids[1], lambda r: r.update(reason="x" * (jobtable.BLOCK_RECORD_BYTES + 10)))
        assert await table.retire(fence, [table.get(j) for j in ids]) == 3
        assert await count(etcd, keys.history) == 1 and await count(etcd, keys.blocks) == 1
        listed = await table.history(0, 10)
        assert [r["id"] for r in listed] == ids and len(listed[1]["reason"]) > jobtable.BLOCK_RECORD_BYTES


async def test_a_damaged_block_costs_its_own_jobs_only(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        good = HistoryBlock(BLOCK_IDS, {BLOCK_IDS + 1: pack(ended(BLOCK_IDS + 1))})
        await etcd.put(keys.block(BLOCK_IDS), good.pack())
        for first, junk in ((0, b"\xc1"), (2 * BLOCK_IDS, pack({"v": 1, "jobs": {5: b"x"}})), (3 * BLOCK_IDS, pack([1, 2]))):
            await etcd.put(keys.block(first), junk)
        # A member filed under another id than its own is not served as that id.
        liar = HistoryBlock(4 * BLOCK_IDS, {4 * BLOCK_IDS + 1: pack(ended(4 * BLOCK_IDS + 2))})
        await etcd.put(keys.block(4 * BLOCK_IDS), liar.pack())
        await etcd.put(keys.ids, str(5 * BLOCK_IDS))
        assert [r["id"] for r in await table.history(0, 1000)] == [BLOCK_IDS + 1]
        assert [r["id"] for r in await table.history_before(None, 1000)] == [BLOCK_IDS + 1]
        assert await table.fetch(1) is None and await table.fetch(4 * BLOCK_IDS + 1) is None
        # Jobs retired into a damaged block's ids get keys of their own; the block is left as it was.
        await etcd.put(keys.ids, "0")  # (set back by hand: the next ids must still pass the blocks')
        table = JobTable(etcd, keys)
        created = await create_ended(table, fence, 1)
        assert created[0] > 4 * BLOCK_IDS + 1
        await etcd.put(keys.block(block_first(created[0])), b"\xc1")
        assert await table.retire(fence, [table.get(created[0])]) == 1
        assert (await table.fetch(created[0]))["id"] == created[0]
        assert (await etcd.get(keys.block(block_first(created[0])))).value == b"\xc1"


async def test_a_retirement_transaction_stays_within_etcd_limits(etcd_endpoints, keys):
    """Many jobs of one block, each on many nodes (a copy key each to delete):
    split into transactions of at most TXN_OPS operations, all moved."""
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        nodes = [f"n{i}" for i in range(8)]
        ids = []
        for _ in range(BLOCK_IDS - 1):
            ids.append((await table.create(fence, lambda i: build(i, 8), {}))["id"])
        for job_id in ids:
            await table.update(fence, job_id, lambda r: r.update(placement=nodes))
            await table.update(fence, job_id, lambda r: r.update(state=jobs.DONE, ranks=[{"code": 0}] * 8))
        assert await count(etcd, keys.placed) == 8 * len(ids)
        assert await table.retire(fence, [table.get(j) for j in ids]) == len(ids)
        assert await count(etcd, keys.placed) == 0 and await count(etcd, keys.blocks) == 1
        assert [r["id"] for r in await table.history(0, 100)] == ids


async def test_the_old_format_jobs_of_a_block_span_and_the_block_are_each_listed_once(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd:
        ids = list(range(1, 3 * BLOCK_IDS))
        ops = [Op.put(keys.past(j), pack(ended(j))) for j in ids if j % 3 == 0]
        await etcd.txn([], ops[:100])
        await etcd.txn([], ops[100:])
        for first in (0, BLOCK_IDS, 2 * BLOCK_IDS):
            block = HistoryBlock(first, {j: pack(ended(j)) for j in ids if block_first(j) == first and j % 3})
            await etcd.put(keys.block(first), block.pack())
        await etcd.put(keys.ids, str(ids[-1]))
        table = JobTable(etcd, keys)
        for size in (1, 7, 64, 65, 500):
            forward, after = [], 0
            while page := await table.history(after, size):
                forward += [r["id"] for r in page]
                after = page[-1]["id"]
            assert forward == ids, size
            backward: list[int] = []
            before: int | None = None
            while page := await table.history_before(before, size):
                backward += [r["id"] for r in page]
                before = page[-1]["id"]
            assert backward == ids[::-1], size


NOBODY = 65534


def test_jobs_retired_into_blocks_are_listed_waited_on_and_kept_from_strangers(make_cluster):
    """Real daemons, a retention of one second: the jobs leave the hot table
    for the history's blocks; `gang ps --all` and `gang history` list them,
    their owner reads their output and waits on them, a stranger does neither."""
    from conftest import as_uid, tried_on, wait_for

    from gangd.client.api import connect

    cluster = make_cluster(2, job_retention=1.0)
    ids = [int(cluster.gang("submit", "-n", 1, "--name", f"j{i}", "--", "sh", "-c", f"echo out{i}", check=True).stdout) for i in range(5)]
    settings = cluster.etcd_settings
    keys = Keys(settings.prefix)

    async def where() -> tuple[int, int, int]:
        async with Etcd(list(settings.endpoints), user=settings.user, password=settings.read_password()) as etcd:
            hot = sum([await count(etcd, keys.job(j)) for j in ids])
            return hot, await count(etcd, keys.blocks), await count(etcd, keys.history)

    wait_for(lambda: trio.run(where)[0] == 0, 60, "the jobs retired to the history")
    _, blocks, alone = trio.run(where)
    assert blocks == len({block_first(j) for j in ids}) and alone == 0
    listed = [r["id"] for r in cluster.gang_json("ps", "--all")]
    assert listed == sorted(set(listed)) and set(ids) <= set(listed)
    newest = [r["id"] for r in cluster.gang_json("history")]
    assert newest[:5] == ids[::-1]
    for i, job in enumerate(ids):
        assert cluster.gang("logs", job, check=True).stdout.strip() == f"0: out{i}"

    async def owner() -> list[str]:
        async with connect(cluster.dir) as gang:
            return [(await gang.wait_done(j))["state"] for j in ids]

    assert trio.run(owner) == ["DONE"] * 5

    def meddle():
        async def main():
            async with connect(cluster.dir) as gang:
                return await tried_on(gang, ids[0])

        return trio.run(main)

    outcome = as_uid(NOBODY, meddle)
    assert "exception" not in outcome, outcome
    for action in ("job", "wait", "output"):
        assert outcome[action][0] == "permission_denied", (action, outcome)
