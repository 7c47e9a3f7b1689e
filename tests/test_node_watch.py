"""A node watches the jobs placed on it, not the whole table (issue 15).

On a real etcd: the coordinator's writes keep each placed job's copies for
its nodes in the same transaction (so a node's cache, fed only by its own
copies, follows every change of its jobs and forgets those that leave it),
the coordinator widens its cache to the whole table for its term and narrows
it back, and a wait or a listing about a job placed elsewhere reads etcd.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys

import trio

from gangd import jobs
from gangd.daemon.handlers.jobs import Listing
from gangd.daemon.store import Fence, JobTable, Keys, jobtable
from gangd.etcd.client import Etcd
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease


def build(job_id: int, nranks: int = 1) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["app"], "nranks": nranks}, owner_uid=0, owner_name="root", owner_gid=0)


async def leader(etcd: Etcd, keys: Keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


def place(nodes: list[str]):
    def change(record: dict) -> None:
        record["placement"] = list(nodes)
        record["state"] = jobs.RUNNING
    return change


def end(record: dict) -> None:
    record["state"] = jobs.DONE
    record["ended"] = 1.0


async def until(table: JobTable, condition, timeout: float = 30) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await table.wait_changed()


@contextlib.asynccontextmanager
async def following(etcd: Etcd, keys: Keys, node: str):
    table = JobTable(etcd, keys, node=node)
    await table.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(table.follow)
        yield table
        nursery.cancel_scope.cancel()


async def test_a_node_caches_only_the_jobs_placed_on_it_and_follows_them_until_they_leave(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        here, there, queued = [(await writer.create(fence, build, {}))["id"] for _ in range(3)]
        await writer.update(fence, here, place(["n2"]))
        await writer.update(fence, there, place(["n1"]))
        # A node that starts now reads its copies (load), one that was up follows them (watch).
        async with following(etcd, keys, "n2") as n2:
            assert sorted(n2.records) == [here]
            wide = await writer.update(fence, queued, place([f"n{i}" for i in range(1, 12)]))  # (on many nodes: one copy for all)
            assert (await etcd.get(keys.copy(None, queued))) is not None
            await until(n2, lambda: queued in n2.records)
            assert n2.get(queued)["seq"] == wide["seq"]
            # Every change of its jobs arrives, with the record's own revision.
            done = await writer.update(fence, here, end)
            await until(n2, lambda: n2.get(here)["state"] == jobs.DONE)
            assert n2.get(here)["seq"] == done["seq"]
            # A job that moves away is forgotten; one that moves here is taken.
            await writer.update(fence, queued, place(["n1"]))
            await writer.update(fence, there, place(["n2", "n3"]))
            await until(n2, lambda: queued not in n2.records and there in n2.records)
            assert (await etcd.get(keys.copy(None, queued))) is None and (await etcd.get(keys.copy("n1", queued))) is not None
            # Moved to the history: every copy goes with it.
            assert await writer.retire(fence, [writer.get(here)]) == 1
            await until(n2, lambda: here not in n2.records)
            assert (await etcd.range(keys.placed, prefix=True, keys_only=True)).count == 3  # (there on n2, n3; queued on n1)
        # Reading again from scratch gives the same as following did.
        fresh = JobTable(etcd, keys, node="n2")
        await fresh.load()
        assert sorted(fresh.records) == [there]


async def test_a_node_that_missed_changes_reads_its_copies_again_and_drops_what_left_it(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        first, second = [(await writer.create(fence, build, {}))["id"] for _ in range(2)]
        await writer.update(fence, first, place(["n2"]))
        behind = JobTable(etcd, keys, node="n2")
        await behind.load()
        assert sorted(behind.records) == [first]
        # While it was away: its job moved elsewhere, another came, and etcd compacted past it.
        await writer.update(fence, first, place(["n1"]))
        await writer.update(fence, second, place(["n2"]))
        now = (await etcd.range(keys.ids, count_only=True)).revision
        await etcd.compact(now)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(behind.follow)
            await until(behind, lambda: sorted(behind.records) == [second])
            nursery.cancel_scope.cancel()


async def test_the_coordinator_widens_its_cache_for_its_term_and_narrows_it_after(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        ids = [(await writer.create(fence, build, {}))["id"] for _ in range(3)]
        await writer.update(fence, ids[0], place(["n2"]))
        await writer.update(fence, ids[1], place(["n1"]))
        async with following(etcd, keys, "n2") as n2:
            assert sorted(n2.records) == [ids[0]]
            with trio.fail_after(30):
                await n2.widen()
            assert sorted(n2.records) == ids
            # The coordinator, the only writer, follows its own commits.
            await n2.update(fence, ids[2], place(["n3"]))
            assert n2.get(ids[2])["placement"] == ["n3"]
            await n2.update(fence, ids[0], place(["n1"]))  # (its copy for n2 deleted: still in the table)
            await trio.sleep(0.3)
            assert n2.get(ids[0])["placement"] == ["n1"]
            await n2.update(fence, ids[0], place(["n2"]))
            n2.narrow()
            await until(n2, lambda: sorted(n2.records) == [ids[0]])
            # And it follows only its own again.
            await writer.update(fence, ids[1], place(["n2"]))
            await until(n2, lambda: ids[1] in n2.records)
            await writer.update(fence, ids[2], end)
            await trio.sleep(0.3)
            assert ids[2] not in n2.records


async def test_a_wait_for_a_job_placed_elsewhere_sees_each_change_until_it_ends(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        job = (await writer.create(fence, build, {}))["id"]
        async with following(etcd, keys, "n2") as n2:
            states: list[str] = []

            async def seen(record: dict) -> bool:
                states.append(record["state"])
                return False

            async with trio.open_nursery() as nursery:
                nursery.start_soon(n2.watch_job, job, seen)
                await trio.sleep(0.2)
                await writer.update(fence, job, place(["n1"]))
                await trio.sleep(0.2)
                await writer.update(fence, job, end)
            assert states == [jobs.QUEUED, jobs.RUNNING, jobs.DONE]
            assert job not in n2.records
            # Once in the history, a wait answers at once.
            await writer.retire(fence, [writer.get(job)])
            with trio.fail_after(10):
                last = await n2.watch_job(job, seen)
            assert last["state"] == jobs.DONE


async def test_a_listing_on_a_node_shows_the_jobs_placed_elsewhere(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        ids = [(await writer.create(fence, build, {}))["id"] for _ in range(4)]
        await writer.update(fence, ids[0], lambda r: r.update(placement=["n1"]))  # (being launched on n1)
        await writer.update(fence, ids[1], end)
        await writer.retire(fence, [writer.get(ids[1])])
        n2 = JobTable(etcd, keys, node="n2")
        await n2.load()
        assert not n2.records
        listing = Listing(table=n2, calls=None, membership=None)
        root = {"uid": 0, "gid": 0, "user": "root"}
        shown = [r["id"] for r in await listing.list_jobs(root, {"all": True}, None)]
        assert shown == ids
        page = [r["id"] for r in await listing.list_jobs(root, {"all": True, "after": ids[0], "limit": 2}, None)]
        assert page == ids[1:3]
        assert [r["id"] for r in await listing.history(root, {}, None)] == [ids[1]]


def test_a_job_on_many_nodes_or_with_a_large_record_has_one_copy_and_an_update_stays_within_etcds_limits(keys):
    record = build(7, nranks=4)
    record["placement"] = ["n1", "n2", "n1", "n3"]
    assert jobtable.copies(keys, record, 100) == [keys.copy("n1", 7), keys.copy("n2", 7), keys.copy("n3", 7)]
    assert jobtable.copies(keys, record, jobtable.FANOUT_BYTES) == [keys.copy(None, 7)]
    record["placement"] = [f"n{i}" for i in range(jobtable.FANOUT_NODES + 1)]
    assert jobtable.copies(keys, record, 100) == [keys.copy(None, 7)]
    record["placement"] = ["../n1"]  # (a name that is no key's: never a path in etcd's keyspace)
    assert jobtable.copies(keys, record, 100) == [keys.copy(None, 7)]
    # Moving between layouts: one put, the old copies deleted, in the same transaction.
    old = dict(record, placement=["n1", "n2"])
    ops = jobtable.copy_ops(keys, old, dict(record, placement=["n2", "n3"]), b"x")
    assert sorted((op.kind, base64.b64decode(op.body["key"]).decode()) for op in ops) == sorted(
        [("request_put", keys.copy("n2", 7)), ("request_put", keys.copy("n3", 7)), ("request_delete_range", keys.copy("n1", 7))])


async def test_a_large_record_is_not_copied_and_its_node_reads_it_from_the_jobs_key(etcd_endpoints, keys):
    # A copy of a record near etcd's request limit would make the update too
    # large to commit (seen: a job with a long command line never placed).
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer = JobTable(etcd, keys)
        big = (await writer.create(fence, lambda job_id: dict(build(job_id), argv=["app", "x" * 900_000]), {}))["id"]
        async with following(etcd, keys, "n2") as n2:
            placed = await writer.update(fence, big, place(["n2"]))
            await until(n2, lambda: big in n2.records)
            assert n2.get(big)["seq"] == placed["seq"] and len(n2.get(big)["argv"][1]) == 900_000
            assert (await etcd.get(keys.copy(None, big))).value == b""
            await writer.update(fence, big, end)
            await until(n2, lambda: n2.get(big)["state"] == jobs.DONE)
        fresh = JobTable(etcd, keys, node="n2")
        await fresh.load()
        assert fresh.get(big)["state"] == jobs.DONE


def test_a_node_lists_waits_for_and_shows_the_output_of_jobs_placed_on_another(make_cluster):
    # n2 holds none of n1's jobs: `gang ps`, `gang wait`, `gang job` and
    # `gang logs` through n2 read etcd (and n1) for them.
    from test_control_plane import gang_on, json_on, submit_on

    cluster = make_cluster(2, cores=4)
    sleepers = [submit_on(cluster, "n1", "-n", 1, "-w", "n1", "--", "sleep", 300) for _ in range(3)]
    echo = submit_on(cluster, "n1", "-n", 1, "-w", "n1", "--", "sh", "-c", "echo hello from n1")
    for job in sleepers:
        cluster.wait_state(job, "RUNNING")
    listed = json_on(cluster, "n2", "ps")
    assert {r["id"]: r["state"] for r in listed if r["id"] in sleepers} == dict.fromkeys(sleepers, "RUNNING")
    assert all(r["nodes"] == ["n1"] for r in listed)
    first_two = gang_on(cluster, "n2", "ps", "-n", 2)
    assert first_two.returncode == 0, first_two.stderr
    assert [line.split()[0] for line in first_two.stdout.splitlines()[1:]] == [str(j) for j in sorted([*sleepers, echo])[:2]]
    waited = gang_on(cluster, "n2", "wait", echo)
    assert waited.returncode == 0, waited.stderr
    assert json_on(cluster, "n2", "job", echo)["state"] == "DONE"
    logs = gang_on(cluster, "n2", "logs", echo)
    assert logs.returncode == 0 and "hello from n1" in logs.stdout, logs.stderr
    # A wait through n2 hears of a kill through n1 (its key watched, not n2's cache).
    env = {k: v for k, v in os.environ.items() if k != "GANGD_CLUSTER"}
    env["GANGD_SOCKET"] = str(cluster.files["n2"].socket)
    waiting = subprocess.Popen([sys.executable, "-m", "gangd.client.cli", "wait", str(sleepers[0])], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        gang_on(cluster, "n1", "kill", sleepers[0])
        out, err = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == jobs.EXIT_KILLED, (out, err)
    for job in sleepers[1:]:
        gang_on(cluster, "n1", "kill", job)
