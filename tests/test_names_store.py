"""MPI's name service against a real etcd: its writes are fenced by the coordinator's term.

A coordinator that lost its term may not know it yet, and its job table
no longer follows the cluster: the jobs the new coordinator started are
unknown to it, so their names look like an ended job's leftovers. It must
not delete them, nor publish beside the new coordinator (whose lock is
the only thing that holds a user to the per-user bound).
"""

from __future__ import annotations

import pytest

from gangd import jobs
from gangd.daemon.names import NameService
from gangd.daemon.store import Deposed, Fence, JobTable
from gangd.etcd.client import Etcd
from gangd.etcd.election import Election
from gangd.etcd.lease import open_lease
from gangd.rpc import RemoteError


def build(job_id: int) -> dict:
    return jobs.new_record(job_id=job_id, spec={"argv": ["app"], "nranks": 1}, owner_uid=1000, owner_name="u", owner_gid=1000)


async def leader(etcd: Etcd, keys, lease) -> Fence:
    won = await Election(etcd, keys.leader).campaign(lease, b"test")
    return Fence(won.key, won.term)


def service(etcd, keys, table: JobTable, fence: Fence) -> NameService:
    def no_tasks(*_):
        raise AssertionError("no job ends in this test")

    return NameService(etcd=etcd, keys=keys, table=table, spawn=no_tasks, fence=lambda: fence)


async def test_a_deposed_coordinator_neither_publishes_nor_removes_the_new_terms_names(etcd_endpoints, keys):
    async with Etcd(etcd_endpoints) as etcd:
        async with open_lease(etcd, 10) as first_lease:
            old = await leader(etcd, keys, first_lease)
            old_table = JobTable(etcd, keys)
            first = await old_table.create(old, build, {})
            old_names = service(etcd, keys, old_table, old)
            await old_names.publish(first["id"], "kept", "port-1")  # (in its term: written)
            await etcd.lease_revoke(first_lease.id)  # its election key goes with its lease
            async with open_lease(etcd, 10) as second_lease:
                new = await leader(etcd, keys, second_lease)
                new_table = JobTable(etcd, keys)
                await new_table.load()
                second = await new_table.create(new, build, {})  # a job the old coordinator never heard of
                new_names = service(etcd, keys, new_table, new)
                await new_names.publish(second["id"], "fresh", "port-2")

                # The old one still believes it leads: its table says job `first` runs,
                # and the name of job `second` (unknown to it) looks stale.
                with pytest.raises(Deposed):
                    await old_names.publish(first["id"], "extra", "port-3")
                with pytest.raises(Deposed):
                    await old_names.unpublish(first["id"], "kept")

                stored = await etcd.range(keys.names_of(1000), prefix=True)
                assert sorted(bytes.fromhex(kv.key.decode().rsplit("/", 1)[1]).decode() for kv in stored.kvs) == ["fresh", "kept"]
                assert await new_names.lookup(second["id"], "fresh") == "port-2"
                assert await new_names.lookup(first["id"], "kept") == "port-1"
                # The new term writes.
                await new_names.unpublish(first["id"], "kept")
                with pytest.raises(RemoteError, match="not published"):
                    await new_names.lookup(second["id"], "kept")
