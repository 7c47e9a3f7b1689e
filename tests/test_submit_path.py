"""The submission path's batching, functionally (no timings): group commits of
job updates, the environment kept from creation to launch, many concurrent
submits through real daemons, and ``ps --all`` over a history of many pages.

Batching must never change what a single write would have done: each update
is applied once, to the record it was computed from; a change that raced
another is computed again; nothing is lost or duplicated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import trio
from conftest import wait_for

from gangd import jobs
from gangd.client.api import connect
from gangd.daemon import config as cfg
from gangd.daemon.store import Fence, JobTable, Keys
from gangd.daemon.store.jobtable import pack
from gangd.etcd.client import Etcd, Op
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease
from gangd.etcd.server import LocalEtcd

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}




def build(job_id: int) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["app"], "nranks": 1}, owner_uid=0, owner_name="root", owner_gid=0)


async def leader(etcd: Etcd, keys: Keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


async def test_concurrent_updates_of_many_jobs_are_each_applied_once(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        created = await table.create_many(fence, [(build, {}) for _ in range(60)])
        ids = [r["id"] for r in created]

        def bump(r: dict) -> None:
            r["reason"] = str(int(r["reason"] or "0") + 1)

        # 60 jobs x 5 increments, all at once: different jobs share transactions,
        # the same job's changes must not be lost to one another.
        async with trio.open_nursery() as nursery:
            for job_id in ids:
                for _ in range(5):
                    nursery.start_soon(table.update, fence, job_id, bump)

        reader = JobTable(etcd, keys)
        await reader.load()
        assert {job_id: reader.records[job_id]["reason"] for job_id in ids} == dict.fromkeys(ids, "5")
        assert {job_id: table.records[job_id]["reason"] for job_id in ids} == dict.fromkeys(ids, "5")


async def test_an_update_that_raced_another_writer_is_computed_again_and_the_rest_of_its_batch_commits(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        ids = [r["id"] for r in await table.create_many(fence, [(build, {}) for _ in range(10)])]
        # Another writer changes job ids[3] behind the table's back (its cache is stale now).
        behind = dict(table.records[ids[3]])
        behind.pop("seq")
        behind["name"] = "changed-elsewhere"
        await etcd.put(keys.job(ids[3]), pack(behind))
        seen: dict[int, list[str]] = {}

        def rename(r: dict) -> None:
            seen.setdefault(r["id"], []).append(r["name"])
            r["reason"] = "renamed"

        async with trio.open_nursery() as nursery:
            for job_id in ids:
                nursery.start_soon(table.update, fence, job_id, rename)
        reader = JobTable(etcd, keys)
        await reader.load()
        assert all(reader.records[j]["reason"] == "renamed" for j in ids)
        # The raced job's change was computed again, from the other writer's record, which it kept.
        assert reader.records[ids[3]]["name"] == "changed-elsewhere"
        assert seen[ids[3]][-1] == "changed-elsewhere" and len(seen[ids[3]]) == 2
        assert all(len(seen[j]) == 1 for j in ids if j != ids[3])


async def test_a_deposed_coordinators_batched_updates_all_fail(etcd_endpoints, keys):
    from gangd.daemon.store import Deposed

    async with Etcd(etcd_endpoints) as etcd:
        async with open_lease(etcd, 10) as lease:
            old = await leader(etcd, keys, lease)
            table = JobTable(etcd, keys)
            ids = [r["id"] for r in await table.create_many(old, [(build, {}) for _ in range(8)])]
        # The lease is revoked: the election key is gone, a new leader takes it.
        async with open_lease(etcd, 10) as lease:
            await leader(etcd, keys, lease)
            outcomes: list[str] = []

            async def try_update(job_id: int) -> None:
                try:
                    await table.update(old, job_id, lambda r: r.update(reason="stale"))
                    outcomes.append("written")
                except Deposed:
                    outcomes.append("deposed")

            async with trio.open_nursery() as nursery:
                for job_id in ids:
                    nursery.start_soon(try_update, job_id)
            assert outcomes == ["deposed"] * 8
            kvs = (await etcd.range(keys.jobs, prefix=True)).kvs
            assert len(kvs) == 8 and all(b"stale" not in kv.value for kv in kvs)


async def test_the_environment_is_kept_from_creation_to_launch_and_gone_once_the_job_ended(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        first, second = await table.create_many(fence, [(build, {"A": "1"}), (build, {"B": "2"})])
        # Read back with no etcd round trip, and equal to what etcd holds.
        assert await table.env(first["id"]) == {"A": "1"}
        assert await JobTable(etcd, keys).env(first["id"]) == {"A": "1"}
        # Read a second time (a second launch): from etcd, still there.
        assert await table.env(first["id"]) == {"A": "1"}
        # A job that ended before its launch: no environment, in memory or in etcd.
        await table.update(fence, second["id"], lambda r: r.update(state=jobs.DONE, ended=time.time()))
        assert await table.env(second["id"]) == {}
        assert await etcd.get(keys.env(second["id"])) is None


def _cluster_etcd(directory: Path) -> tuple[Etcd, Keys]:
    settings = cfg.load(directory / "n1" / "gangd.toml").etcd
    return Etcd(list(settings.endpoints), user=settings.user, password=settings.read_password()), Keys(settings.prefix)


def test_concurrent_submits_get_distinct_ids_all_committed_and_ps_all_lists_every_job_once(make_cluster):
    cluster = make_cluster(2)
    directory = cluster.dir

    async def submit_many() -> list[int]:
        ids: list[int] = []

        async def client(n: int) -> None:
            async with connect(directory) as gang:
                for _ in range(n):
                    ids.append((await gang.submit(["true"], 1, cwd="/", env=ENV))["id"])

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(client, 10)
        return ids

    ids = trio.run(submit_many)
    assert len(ids) == len(set(ids)) == 120

    async def seed_and_check() -> tuple[list[bytes], int]:
        etcd, keys = _cluster_etcd(directory)
        async with etcd:
            # Every accepted id is in etcd (hot table or, ended and retired, the history).
            found = []
            for job_id in ids:
                found.append(job_id if (await etcd.get(keys.job(job_id)) or await etcd.get(keys.past(job_id))) else -job_id)
            assert found == ids
            # A history of several listing pages, with ids below and above the submitted ones.
            counter = int((await etcd.get(keys.ids)).value)
            extra = list(range(counter + 1, counter + 1201))
            for start in range(0, len(extra), 100):
                ops = []
                for job_id in extra[start:start + 100]:
                    record = build(job_id)
                    record.update(state=jobs.DONE, placement=["n1"], ranks=[{"code": 0}], started=time.time() - 60, ended=time.time() - 30)
                    ops.append(Op.put(keys.past(job_id), pack(record)))
                await etcd.txn([], ops)
            await etcd.put(keys.ids, str(extra[-1]))
            return [], extra[-1]

    _, last = trio.run(seed_and_check)

    async def listing() -> list[int]:
        async with connect(directory) as gang:
            return [r["id"] for r in await gang.jobs(all=True)]

    listed = trio.run(listing)
    assert listed == sorted(set(listed)), "ps --all lists a job twice or out of order"
    assert set(ids) <= set(listed) and listed[-1] == last and len(listed) == last


async def test_history_pages_cross_gaps_wider_than_a_read_and_list_each_job_once(etcd_endpoints, keys):
    """History ids with a gap far wider than one read's span (jobs still hot,
    or never retired), ids past the counter (set back by hand): every page
    in both directions still lists each job once, in order."""
    ended = [*range(1, 301), *range(5000, 5301), *range(9000, 9011)]
    async with Etcd(etcd_endpoints) as etcd:
        for start in range(0, len(ended), 100):
            ops = []
            for job_id in ended[start:start + 100]:
                record = build(job_id)
                record.update(state=jobs.DONE, ended=time.time())
                ops.append(Op.put(keys.past(job_id), pack(record)))
            await etcd.txn([], ops)
        await etcd.put(keys.ids, "8000")  # 9000.. lie above the counter
        table = JobTable(etcd, keys)
        assert [r["id"] for r in await table.history(0, 10_000)] == ended
        assert [r["id"] for r in await table.history_before(None, 10_000)] == ended[::-1]
        forward, after = [], 0
        while page := await table.history(after, 97):
            forward += [r["id"] for r in page]
            after = page[-1]["id"]
        assert forward == ended
        backward: list[int] = []
        before: int | None = None
        while page := await table.history_before(before, 97):
            backward += [r["id"] for r in page]
            before = page[-1]["id"]
        assert backward == ended[::-1]
        assert await table.history(-5, 3) == (await table.history(0, 3))
        assert await table.history_before(1, 10) == []


def test_a_node_cut_off_from_etcd_says_its_listings_may_be_out_of_date(make_cluster):
    from test_control_plane import CuttableProxy, gang_on, json_on, submit_on

    cluster = make_cluster(2, cores=2, lease_ttl=3, grace=120, own_etcd=True)  # (the test cuts it off)
    endpoint = LocalEtcd.load(cluster.dir / "etcd").endpoints[0]
    host, port = re.match(r"https?://([^:/]+):(\d+)", endpoint).groups()
    proxy = CuttableProxy((host, int(port)))
    try:
        # n2 reaches etcd only through the proxy.
        nf = cluster.files["n2"]
        os.kill(cluster.daemon_pid("n2"), signal.SIGTERM)
        wait_for(lambda: nf.pid() is None, 30, "n2 to stop")
        nf.config.write_text(re.sub(r"endpoints = \[[^\]]*\]", f'endpoints = ["http://127.0.0.1:{proxy.port}"]', nf.config.read_text(), count=1))
        cluster.start_daemon("n2")
        wait_for(lambda: all(r["state"] == "up" for r in json_on(cluster, "n1", "nodes")["nodes"]), 30, "n2 back")
        job = submit_on(cluster, "n1", "-n", 1, "-w", "n2", "--", "sleep", 300)  # (n2 caches the jobs placed on it)
        cluster.wait_state(job, "RUNNING")
        wait_for(lambda: any(r["id"] == job for r in json_on(cluster, "n2", "ps")), 30, "n2 to see the job")
        # Connected: no warning anywhere.
        fresh = gang_on(cluster, "n2", "ps")
        assert fresh.returncode == 0 and "out of date" not in fresh.stderr, fresh.stderr
        assert "stale" not in json_on(cluster, "n2", "job", job)

        proxy.cut()
        wait_for(lambda: "cannot reach etcd" in next(r for r in json_on(cluster, "n2", "nodes")["nodes"] if r["name"] == "n2")["why"], 30,
                 "n2 to know it is cut off")
        # n2 still answers from its cache (the jobs placed on it), and says the answer may be old (stderr), and how long it has been.
        listed = gang_on(cluster, "n2", "ps")
        assert listed.returncode == 0, listed.stderr
        assert str(job) in listed.stdout
        assert re.search(r"node n2 has not reached etcd for \d+ s .*this list may be out of date", listed.stderr), listed.stderr
        as_json = gang_on(cluster, "n2", "ps", "--json")
        records = json.loads(as_json.stdout)
        assert records and all(r["stale"]["node"] == "n2" and r["stale"]["seconds"] >= 0 for r in records)
        shown = gang_on(cluster, "n2", "job", job)
        assert shown.returncode == 0 and "RUNNING" in shown.stdout, shown.stderr
        assert "node n2 has not reached etcd" in shown.stderr and "out of date" in shown.stderr
        assert json_on(cluster, "n2", "job", job)["stale"]["node"] == "n2"
        # The node that still has etcd says nothing of the kind.
        other = gang_on(cluster, "n1", "ps")
        assert other.returncode == 0 and "out of date" not in other.stderr
        gang_on(cluster, "n1", "kill", job)
    finally:
        proxy.cut()


def test_a_checkpointed_job_moves_to_the_history_and_still_restarts_from_there(make_cluster):
    cluster = make_cluster(1, cores=2, job_retention=1)
    from ckpthelpers import hold, wait_holding

    # ckptjob idles after 20 steps until released (taking checkpoints): it is still there to be
    # checkpointed and killed however loaded the machine (ring.py, 4 s long, sometimes ended first).
    options, release = hold(cluster, 20)
    job = int(cluster.gang("submit", "-n", 2, "--", sys.executable, Path(__file__).resolve().parent / "jobs" / "ckptjob.py",
                           "--steps", "40", *options, check=True).stdout)
    wait_holding(cluster, job)
    taken = cluster.gang("checkpoint", job, "--json", timeout=90, check=True)
    gen = json.loads(taken.stdout)
    assert gen["state"] == "complete", gen
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, "KILLED")
    # Retired like any other job: out of the hot table, into the history.
    wait_for(lambda: job not in [r["id"] for r in cluster.ps()], 30, "the checkpointed job to leave the hot table")
    assert job in [r["id"] for r in cluster.gang_json("history")]
    # Its generations are still found, and a restart from them works.
    listed = cluster.gang_json("ckpt", "ls", job)
    assert [(g["gen"], g["state"], g["job"]) for g in listed["generations"]] == [(gen["gen"], "complete", job)]
    release.touch()  # (the restart, in the hold too, runs to its end)
    restarted = json.loads(cluster.gang("restart", job, "--json", check=True).stdout)
    new = restarted["record"]["id"]
    record = cluster.wait_state(new, ("DONE", "FAILED", "KILLED"), timeout=120)
    assert record["state"] == "DONE", record
    assert record["restart_of"] == {"job": job, "gen": gen["gen"], "iteration": gen["iteration"]}
    # The restart retires too; the lineage (both jobs) is found from either, in the history.
    wait_for(lambda: new not in [r["id"] for r in cluster.ps()], 30, "the restart to leave the hot table")
    assert [g["gen"] for g in cluster.gang_json("ckpt", "ls", new)["generations"]] == [gen["gen"]]
    again = cluster.gang("restart", new, "--json")
    assert again.returncode == 0, again.stderr
