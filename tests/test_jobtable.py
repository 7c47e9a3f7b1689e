"""The job table on a real etcd: ids, fenced writes, the watch-fed cache, the history.

These are the guarantees the control plane stands on: a job id is never
handed out twice, a deposed coordinator cannot write, no update is lost or
applied to a record it was not computed from, and every node's cache ends
up with what etcd holds, whatever it missed.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest
import trio

from gangd import jobs
from gangd.daemon.handlers.jobs import Listing
from gangd.daemon.store import Deposed, Fence, JobTable, Keys, jobtable
from gangd.etcd.client import Etcd
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease
from gangd.rpc import RemoteError


def build(job_id: int, nranks: int = 1) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["app"], "nranks": nranks}, owner_uid=0, owner_name="root", owner_gid=0)


async def leader(etcd: Etcd, keys: Keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


async def test_ids_are_never_handed_out_twice_even_by_concurrent_coordinators(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        tables = [JobTable(etcd, keys) for _ in range(3)]  # three writers, each with its own idea of the counter
        created: list[int] = []

        async def submit(table: JobTable) -> None:
            for _ in range(10):
                created.append((await table.create(fence, build, {"HOME": "/root"}))["id"])

        async with trio.open_nursery() as nursery:
            for table in tables:
                nursery.start_soon(submit, table)
        assert sorted(created) == list(range(1, 31))
        # The environment is a key of its own, not in the record.
        reader = JobTable(etcd, keys)
        await reader.load()
        assert sorted(reader.records) == list(range(1, 31))
        assert all("env" not in r for r in reader.records.values())
        assert await reader.env(5) == {"HOME": "/root"}


async def test_a_deposed_coordinator_cannot_write(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd:
        async with open_lease(etcd, 10) as first_lease:
            old = await leader(etcd, keys, first_lease)
            table = JobTable(etcd, keys)
            record = await table.create(old, build, {})
            await etcd.lease_revoke(first_lease.id)  # its lease gone: its election key with it
            async with open_lease(etcd, 10) as second_lease:
                new = await leader(etcd, keys, second_lease)
                assert new.term > old.term
                with pytest.raises(Deposed):
                    await table.update(old, record["id"], lambda r: r.update(state=jobs.FAILED))
                with pytest.raises(Deposed):
                    await table.create(old, build, {})
                fresh = JobTable(etcd, keys)
                await fresh.load()
                assert fresh.get(record["id"])["state"] == jobs.QUEUED and sorted(fresh.records) == [record["id"]]
                # The new term writes, and its ids go on after the old one's.
                updated = await fresh.update(new, record["id"], lambda r: r.update(state=jobs.RUNNING))
                assert updated["state"] == jobs.RUNNING
                assert (await fresh.create(new, build, {}))["id"] == record["id"] + 1


async def test_an_update_computed_from_a_stale_record_is_computed_again(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer, stale = JobTable(etcd, keys), JobTable(etcd, keys)
        job_id = (await writer.create(fence, lambda i: build(i, nranks=2), {}))["id"]
        await stale.load()
        await writer.update(fence, job_id, lambda r: r["ranks"].__setitem__(0, {"code": 0}))
        seen = []

        def second_exit(r):
            seen.append(list(r["ranks"]))
            r["ranks"][1] = {"code": 3}

        result = await stale.update(fence, job_id, second_exit)
        # The first attempt saw the stale record; the change was computed again from etcd's.
        assert seen == [[None, None], [{"code": 0}, None]]
        assert result["ranks"] == [{"code": 0}, {"code": 3}]


async def test_every_cache_follows_etcd_and_a_compacted_one_reads_the_table_again(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        writer, follower = JobTable(etcd, keys), JobTable(etcd, keys)
        first = await writer.create(fence, build, {})
        await follower.load()
        async with trio.open_nursery() as nursery:
            await nursery.start(follower.follow)
            done = await writer.update(fence, first["id"], lambda r: r.update(state=jobs.DONE))
            second = await writer.create(fence, build, {})
            with trio.fail_after(10):
                while follower.get(second["id"]) is None or follower.get(first["id"])["state"] != jobs.DONE:
                    await follower.wait_changed()
            assert follower.get(first["id"])["seq"] == done["seq"]
            nursery.cancel_scope.cancel()
        # A cache that was away while the revisions it needs were compacted:
        # following it from where it was cannot work; it reads the table anew.
        behind = JobTable(etcd, keys)
        await behind.load()
        for _ in range(5):
            await writer.update(fence, second["id"], lambda r: r.update(name=r["name"] + "x"))
        await etcd.compact((await etcd.range(keys.ids)).revision)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(behind.follow)
            with trio.fail_after(10):
                while behind.get(second["id"])["name"] != writer.get(second["id"])["name"]:
                    await behind.wait_changed()
            nursery.cancel_scope.cancel()


async def test_ended_jobs_move_to_the_history_and_stay_readable(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        ids = [(await table.create(fence, build, {"SECRET": "x"}))["id"] for _ in range(5)]
        for job_id in ids[:3]:
            await table.update(fence, job_id, lambda r: r.update(state=jobs.DONE))
        assert await table.retire(fence, [table.get(j) for j in ids]) == 3  # only the ended ones
        assert sorted(table.records) == ids[3:]
        assert [r["id"] for r in await table.history(0, 10)] == ids[:3]
        assert [r["id"] for r in await table.history(ids[0], 1)] == [ids[1]]
        assert (await table.fetch(ids[0]))["state"] == jobs.DONE  # from the history
        assert await table.env(ids[0]) == {}  # an ended job's environment is kept nowhere
        fresh = JobTable(etcd, keys)
        await fresh.load()
        assert sorted(fresh.records) == ids[3:]
        # Many at once go in several transactions (etcd takes at most 128 operations in one).
        many = [(await table.create(fence, build, {}))["id"] for _ in range(100)]
        for job_id in many:
            await table.update(fence, job_id, lambda r: r.update(state=jobs.FAILED))
        assert await table.retire(fence, [table.get(j) for j in many]) == 100
        assert sorted(table.records) == ids[3:5]
        # The counter never goes back, history or not.
        assert (await table.create(fence, build, {}))["id"] == many[-1] + 1


async def test_a_checkpoint_lineage_is_found_in_the_history_and_its_records_still_learn(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        entry = {"gen": 1, "state": "complete", "placement": ["n1"]}
        root = (await table.create(fence, build, {}))["id"]
        unrelated = (await table.create(fence, build, {}))["id"]
        await table.update(fence, root, lambda r: r.update(state=jobs.KILLED, checkpoints=[dict(entry)]))
        restart = (await table.create(fence, lambda i: dict(build(i), lineage=root), {}))["id"]
        await table.update(fence, unrelated, lambda r: r.update(state=jobs.DONE))
        await table.update(fence, restart, lambda r: r.update(state=jobs.DONE, checkpoints=[dict(entry, gen=2)]))
        assert await table.retire(fence, [table.get(j) for j in (root, unrelated, restart)]) == 3
        assert table.records == {}
        # Another node (nothing cached) finds the whole lineage, and only it, in the history.
        reader = JobTable(etcd, keys)
        await reader.read_lineage(root)
        assert [r["id"] for r in reader.lineage(root)] == [root, restart]
        # An ended record there still learns what happens to its generations (fenced, compared)...
        marked = await table.update(fence, root, lambda r: r["checkpoints"][0].update(state="removed"))
        assert marked["checkpoints"][0]["state"] == "removed"
        await reader.read_lineage(root)
        assert reader.lineage(root)[0]["checkpoints"][0]["state"] == "removed"
        # ...but never becomes a live job again.
        with pytest.raises(RemoteError) as raised:
            await table.update(fence, root, lambda r: r.update(state=jobs.RUNNING))
        assert raised.value.code == "bad_state"
        assert (await table.fetch(root))["state"] == jobs.KILLED


async def test_a_record_damaged_in_etcd_costs_that_record_only(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        good = await table.create(fence, build, {})
        for junk in (b"\xc1", b"\x92\x01\x02", b"\x81\xa2id\xa1x"):
            await etcd.put(keys.job(good["id"] + 100 + len(junk)), junk)
        fresh = JobTable(etcd, keys)
        await fresh.load()
        assert sorted(fresh.records) == [good["id"]]
        with pytest.raises(RemoteError):
            await fresh.update(fence, 424242, lambda r: None)


class AnswerDroppingProxy:
    """A TCP forwarder to etcd that can lose one request, or the answer to
    one (forwarded, applied, its answer never delivered), and then refuse
    every connection (etcd unreachable) until mended."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.drop: str | None = None  # "request" or "answer": the next one is lost (and the connection closed)
        self.cut_after_drop = False
        self.cut = False
        self.dropped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "answer"), daemon=True).start()

    def _pump(self, source, sink, what):
        try:
            while data := source.recv(65536):
                with self.lock:
                    lose = self.drop == what
                    if lose:
                        self.drop = None
                        self.cut = self.cut_after_drop
                if lose:
                    self.dropped.set()
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@pytest.fixture
def lossy(etcd_endpoints):
    host, port = etcd_endpoints[0].rsplit("/", 1)[-1].rsplit(":", 1)
    proxy = AnswerDroppingProxy((host, int(port)))
    yield proxy
    proxy.listener.close()


async def created_jobs(etcd: Etcd, keys: Keys) -> list[int]:
    found = await etcd.range(keys.jobs, prefix=True)
    return sorted(Keys.job_id(kv.key, keys.jobs) for kv in found.kvs)


@pytest.mark.parametrize("lost", ["answer", "request"])
async def test_a_creation_whose_answer_was_lost_is_settled_and_reported_once(etcd_endpoints, keys, lossy, lost):
    # The coordinator's table reaches etcd through the proxy; its term and the checks go straight.
    async with Etcd(etcd_endpoints) as direct, open_lease(direct, 10) as lease, Etcd([f"http://127.0.0.1:{lossy.port}"]) as etcd:
        fence = await leader(direct, keys, lease)
        table = JobTable(etcd, keys)
        first = await table.create_many(fence, [(build, {})])
        lossy.drop = lost
        # Lost after etcd applied it ("answer"), or before it got there ("request"): either way
        # the submitter is told of exactly one job, which exists, with the id it was told.
        created = await table.create_many(fence, [(build, {}), (build, {})])
        assert lossy.dropped.is_set()
        assert [r["id"] for r in created] == [first[0]["id"] + 1, first[0]["id"] + 2]
        assert await created_jobs(direct, keys) == [first[0]["id"], *(r["id"] for r in created)]
        # And the table goes on: the next job gets the next id.
        assert (await table.create(fence, build, {}))["id"] == first[0]["id"] + 3


async def test_a_creation_whose_answer_was_lost_and_etcd_stays_away_says_the_job_may_exist(etcd_endpoints, keys, lossy, monkeypatch):
    monkeypatch.setattr(jobtable, "INDETERMINATE_PATIENCE", 1.0)
    async with Etcd(etcd_endpoints) as direct, open_lease(direct, 10) as lease, Etcd([f"http://127.0.0.1:{lossy.port}"]) as etcd:
        fence = await leader(direct, keys, lease)
        table = JobTable(etcd, keys)
        await table.create_many(fence, [(build, {})])
        lossy.drop, lossy.cut_after_drop = "answer", True
        with pytest.raises(RemoteError) as raised:
            await table.create(fence, build, {})
        assert raised.value.code == "indeterminate"
        assert "may or may not exist" in raised.value.message and "gang ps" in raised.value.message
        # (it did: the answer only was lost)
        assert len(await created_jobs(direct, keys)) == 2
        lossy.cut = False
        assert (await table.create(fence, build, {}))["id"] == 3


async def test_etcds_old_revisions_are_compacted_one_interval_behind(etcd_endpoints, keys):
    """Without compactions etcd keeps every value every job key ever had
    (and each retired job's tombstones): it grows with the cluster's past
    until its quota refuses every write. The coordinator's compactor forgets
    revisions older than one interval, never newer ones (a watcher one
    interval behind still resumes)."""
    from gangd.daemon.store.compaction import Compactor
    from gangd.etcd.client import EtcdError

    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        table = JobTable(etcd, keys)
        record = await table.create(fence, build, {})
        old = record["seq"]
        await table.update(fence, record["id"], lambda r: r.update(name="renamed"))
        compactor = Compactor(etcd, keys.ids, interval=60)
        seen = await compactor.step(0)  # the first tick only looks
        assert compactor.compacted == 0
        assert (await etcd.range(keys.job(record["id"]), revision=old)).kvs  # still there
        for _ in range(3):
            await table.update(fence, record["id"], lambda r: r.update(name=r["name"] + "x"))
        await compactor.step(seen)  # one interval later: up to what the first tick saw
        assert compactor.compacted == seen
        with pytest.raises(EtcdError, match="compacted"):
            await etcd.range(keys.job(record["id"]), revision=old)
        # What was seen one interval ago is still readable and watchable from.
        assert (await etcd.range(keys.job(record["id"]), revision=seen)).kvs
        follower = JobTable(etcd, keys)
        follower.revision = seen - 1
        async with trio.open_nursery() as nursery:
            await nursery.start(follower.follow)
            with trio.fail_after(10):
                while (follower.get(record["id"]) or {}).get("name") != table.get(record["id"])["name"]:
                    await follower.wait_changed()
            nursery.cancel_scope.cancel()


def test_the_queue_is_kept_in_admission_order_as_records_change():
    """A scheduling pass reads the queue in order without sorting it (one
    pass per submit and per end: sorting a queue of thousands each time was
    a measurable share of the coordinator's time per submit)."""
    table = JobTable(None, Keys("/q"))  # (the cache only: no etcd)
    revision = iter(range(1, 1000))
    for job_id, priority in [(1, 0), (2, 5), (3, 0), (4, -1), (5, 5)]:
        table.take(dict(build(job_id), priority=priority), next(revision))
    assert [r["id"] for r in table.unplaced()] == [2, 5, 1, 3, 4]
    table.take(dict(table.get(3), priority=9), next(revision))  # raised
    table.take(dict(table.get(2), placement=["n1"]), next(revision))  # placed
    table.take(dict(table.get(1), state=jobs.KILLED), next(revision))  # ended
    assert [r["id"] for r in table.unplaced()] == [3, 5, 4]
    # Changing the table while a pass walks it: what left meanwhile is skipped.
    walk = table.unplaced()
    assert next(walk)["id"] == 3
    table.take(dict(table.get(5), placement=["n2"]), next(revision))
    assert [r["id"] for r in walk] == [4]
    # Each user's queued jobs (placed or not), as a submit checks the user's room.
    assert table.queued_of(0) == {2, 3, 4, 5}
    table.take(dict(table.get(2), state=jobs.RUNNING), next(revision))
    table.take(dict(build(6), owner_uid=1000), next(revision))
    assert table.queued_of(0) == {3, 4, 5} and table.queued_of(1000) == {6}
    table._forget(6)
    assert table.queued_of(1000) == set()


def test_spawned_jobs_wait_apart_from_the_queue_until_placed_or_ended():
    """A spawned job (MPI_Comm_spawn) goes in its parent's slot before the
    queue, or fails: the scheduling pass reads it from its own list, so it is
    never met twice nor behind the head of the queue; the list is kept from
    the records, so a new coordinator's table has it too."""
    table = JobTable(None, Keys("/s"))  # (the cache only: no etcd)
    revision = iter(range(1, 1000))
    table.take(dict(build(1), priority=-5), next(revision))
    for job_id in (3, 2):
        table.take(dict(build(job_id), spawned_by=1), next(revision))
    assert [r["id"] for r in table.unplaced()] == [1]
    assert [r["id"] for r in table.unplaced_spawned()] == [2, 3]
    table.take(dict(table.get(2), placement=["n1"]), next(revision))  # placed
    table.take(dict(table.get(3), state=jobs.FAILED), next(revision))  # could not be
    assert table.unplaced_spawned() == [] and [r["id"] for r in table.unplaced()] == [1]
    table.take(dict(build(4), spawned_by=1), next(revision))
    table._forget(4)
    assert table.unplaced_spawned() == []


async def test_lineages_an_older_gangd_moved_to_the_history_unindexed_are_indexed_once(etcd_endpoints, keys):
    """Jobs moved to the history before the lineage index existed have no
    index key: a restart of their lineage found none of their generations.
    The first coordinator indexes them, once (a marker says so)."""
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        entry = {"gen": 1, "state": "complete", "placement": ["n1"]}
        old = [
            dict(build(1), state=jobs.KILLED, checkpoints=[entry]),  # a lineage's root
            dict(build(2), state=jobs.DONE),  # not in any lineage
            dict(build(3), state=jobs.DONE, lineage=1, checkpoints=[dict(entry, gen=2)]),  # its restart
        ]
        for record in old:  # (as an older gangd's retire wrote them: the record only)
            await etcd.put(keys.past(record["id"]), jobtable.pack(record))
        table = JobTable(etcd, keys)
        await table.read_lineage(1)
        assert table.lineage(1) == []  # what a restart found before
        assert await table.backfill_lineages(fence) == 2
        await table.read_lineage(1)
        assert [r["id"] for r in table.lineage(1)] == [1, 3]
        # Once: the marker stops the next coordinator from reading the whole history again.
        await etcd.delete(keys.lineage(1), prefix=True)
        assert await table.backfill_lineages(fence) == 0


async def test_a_quiet_watch_resumes_past_a_compaction(etcd_endpoints, keys):
    """A watch of a key that does not change (the leader's key a node
    watches for its term's end) must survive a reconnect after the
    compactor ran: etcd's progress notifications move where it resumes
    from, else it resumed from its start revision, compacted away."""
    async with Etcd(etcd_endpoints) as etcd:
        quiet, busy = keys.prefix + "/quiet", keys.prefix + "/busy"
        start = await etcd.put(quiet, b"0")
        async with etcd.watch(quiet, start_revision=start + 1, progress_timeout=10) as watch:  # (as the election's)
            for i in range(5):
                await etcd.put(busy, str(i))
            now = (await etcd.range(busy)).revision
            with trio.fail_after(30):  # (the local etcd sends a progress notification every 2 s)
                while watch._next <= now:  # (where a reconnect resumes)
                    with trio.move_on_after(5):  # (longer than etcd's 2 s: cut short, the watch reconnects)
                        await anext(watch)
            await etcd.compact(now)
            await watch._drop()  # the connection lost (an etcd member restarted, a stall)
            await etcd.put(quiet, b"1")
            with trio.fail_after(30):
                batch = await anext(watch)
            assert batch.events[0].kv.value == b"1"


async def test_a_listing_waits_for_the_tables_first_load_instead_of_answering_no_jobs(etcd_endpoints, keys):
    # A daemon serves its socket before it has read the table from etcd: `gang
    # ps` then must not say "no jobs" (seen as a job missing from `ps --all`
    # right after the daemons restarted).
    async with Etcd(etcd_endpoints) as etcd, open_lease(etcd, 10) as lease:
        fence = await leader(etcd, keys, lease)
        created = await JobTable(etcd, keys).create(fence, build, {})
        fresh = JobTable(etcd, keys)
        with pytest.raises(RemoteError) as refused:
            await fresh.wait_loaded(timeout=0.1)
        assert refused.value.code == "etcd_unavailable" and "has not read the cluster's job table" in refused.value.message
        listing = Listing(table=fresh, calls=None, membership=None)
        found: list = []

        async def ps() -> None:
            found.extend(await listing.list_jobs({"uid": 0, "gid": 0, "user": "root"}, {"all": True}, None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ps)
            await trio.sleep(0.2)
            assert not found  # (still waiting: nothing read yet)
            await fresh.load()
        assert [r["id"] for r in found] == [created["id"]]
