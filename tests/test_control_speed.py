"""What a job costs the control plane: a change that comes while the job's previous change waits for its group commit joins that write.

On a real etcd. A one-rank job that exits at once used to cost three fenced
writes after its creation (placed, running, ended), each a transaction and
a watch event on its node; when its exit is reported while its start still
waits for the group commit, the end now joins that write. Each change is
still applied exactly once, computed from the record written before it,
and a write that fails its comparison is computed again with all of them.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from gangd import jobs
from gangd.daemon.store import Fence, JobTable, Keys, jobtable
from gangd.etcd.client import Etcd
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease


def build(job_id: int) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["true"], "nranks": 1}, owner_uid=0, owner_name="root", owner_gid=0)


async def leader(etcd: Etcd, keys: Keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


@pytest.fixture
def slow_commits(monkeypatch):
    """Group commits that linger a whole second once the table is busy: a
    change started meanwhile finds the previous one still waiting (no race)."""
    monkeypatch.setattr(jobtable, "UPDATE_LINGER", 1.0)


async def queued(table: JobTable, job_id: int) -> None:
    """Once every task is blocked: the job's write is waiting for the group commit."""
    await trio.testing.wait_all_tasks_blocked()
    assert table.waiting_write(job_id)


async def version(etcd: Etcd, key: str) -> int:
    kv = await etcd.get(key)
    return kv.version if kv is not None else 0


def running(r):
    if r["state"] != jobs.QUEUED:
        return False
    r["state"] = jobs.RUNNING
    r["started"] = 1.0


def exited(r):
    if jobs.is_terminal(r):
        return False
    r["ranks"][0] = {"code": 0, "node": "n1"}
    r["state"] = jobs.DONE
    r["ended"] = 2.0


async def test_an_end_that_comes_while_the_start_waits_joins_its_write(etcd_endpoints, keys, slow_commits):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys, node="n1")
        await table.widen()
        job = (await table.create(fence, build, {}))["id"]
        await table.update(fence, job, lambda r: r.update(placement=["n1"]))
        before = await version(etcd, keys.job(job))
        copy_before = await version(etcd, keys.copy("n1", job))
        answers: dict[str, dict] = {}

        async def change(name, fn):
            answers[name] = await table.update(fence, job, fn)

        table.pacer.sent()  # (busy: the next commit lingers)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(change, "start", running)
            await queued(table, job)
            nursery.start_soon(change, "end", exited)
        # One write for both, each applied once, in order; both callers got it.
        assert await version(etcd, keys.job(job)) == before + 1
        assert await version(etcd, keys.copy("n1", job)) == copy_before + 1  # (one event for its node)
        written = await JobTable(etcd, keys).fetch(job)
        assert written is not None and written["state"] == jobs.DONE and written["started"] == 1.0 and written["ended"] == 2.0
        assert answers["start"] is answers["end"] and answers["end"]["state"] == jobs.DONE
        assert table.get(job)["state"] == jobs.DONE and not table.waiting_write(job)
        # A change with nothing to do given the waiting write (False) waits for it and answers what it wrote.
        table.pacer.sent()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(change, "reason", lambda r: r.update(reason="why"))
            await queued(table, job)
            nursery.start_soon(change, "late start", running)
        assert answers["late start"]["reason"] == "why" and await version(etcd, keys.job(job)) == before + 2


async def test_a_joined_write_that_fails_its_comparison_applies_each_change_once(etcd_endpoints, keys, slow_commits):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        other = JobTable(etcd, keys)  # another writer of the same term: its change lands first
        job = (await table.create(fence, build, {}))["id"]
        await other.load()
        calls: list[str] = []

        def append(tag):
            def change(r):
                calls.append(tag)
                r["name"] = r["name"] + tag
            return change

        table.pacer.sent()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(table.update, fence, job, append("a"))
            await queued(table, job)
            nursery.start_soon(table.update, fence, job, append("b"))
            await trio.sleep(0.05)
            await other.update(fence, job, append("x"))  # committed while a and b wait: their write fails
        name = (await JobTable(etcd, keys).fetch(job))["name"]
        assert sorted(name[-3:]) == ["a", "b", "x"] and name.count("a") == 1 and name.count("b") == 1 and name[-3] == "x"
        assert calls.count("a") == 2 and calls.count("b") == 2  # (computed again from the newer record)


async def test_a_waiting_write_whose_first_caller_is_cancelled_still_goes_for_the_one_that_joined(etcd_endpoints, keys, slow_commits):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        lead, alone, joined = [(await table.create(fence, build, {}))["id"] for _ in range(3)]
        before = await version(etcd, keys.job(alone))

        async def cancellable(scope: trio.CancelScope, job: int, fn) -> None:
            with scope:
                await table.update(fence, job, fn)

        table.pacer.sent()
        async with trio.open_nursery() as nursery:
            # The group commit's writer (lingering, shielded) holds the others queued behind it.
            nursery.start_soon(table.update, fence, lead, lambda r: r.update(reason="lead"))
            await queued(table, lead)
            gone, first = trio.CancelScope(), trio.CancelScope()
            nursery.start_soon(cancellable, gone, alone, lambda r: r.update(reason="cancelled"))
            nursery.start_soon(cancellable, first, joined, lambda r: r.update(reason="first"))
            await queued(table, alone)
            await queued(table, joined)
            done = trio.Event()

            async def second():
                await table.update(fence, joined, lambda r: r.update(name="second"))
                done.set()

            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert table._queued[joined].waiters == 2
            gone.cancel()  # alone: its write is never sent
            first.cancel()  # joined: it still goes, for the second caller
            with trio.fail_after(10):
                await done.wait()
        reader = JobTable(etcd, keys)
        assert await version(etcd, keys.job(alone)) == before and (await reader.fetch(alone))["reason"] != "cancelled"
        written = await reader.fetch(joined)
        assert written is not None and written["name"] == "second" and written["reason"] == "first"
        assert not table.waiting_write(alone) and not table.waiting_write(joined)
