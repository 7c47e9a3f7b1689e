"""Bad things happen: nodes die, strangers connect, garbage arrives, other users meddle.

Every test runs against a real cluster and checks both the refusal and that
the daemons keep serving everybody else with nothing lost.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time

import msgpack
import pytest
import trio
from conftest import as_uid, tried_on

from gangd.client import cluster as local
from gangd.client.api import connect
from gangd.protocol import Connection, ProtocolError, Role
from gangd.rpc import RemoteError, dial_tcp


def _wait_node_state(cluster, node: str, state: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rows = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}
        if rows[node]["state"] == state:
            return rows[node]
        assert time.monotonic() < deadline, f"{node} still {rows[node]['state']}"
        time.sleep(0.1)


def test_killed_node_is_detected_and_its_jobs_fail_while_others_keep_working(make_cluster):
    cluster = make_cluster(4)
    job = int(cluster.gang("submit", "-n", 8, "--", "sleep", "300", check=True).stdout)
    cluster.wait_state(job, "RUNNING")
    cluster.kill_node("n3")
    record = cluster.wait_state(job, "FAILED", timeout=15)
    assert "node n3" in record["reason"] and "down" in record["reason"], record["reason"]
    assert record["ranks"][4]["lost"] and record["ranks"][5]["lost"]  # n3's ranks
    row = _wait_node_state(cluster, "n3", "down")
    assert row["why"]
    # n3's ranks die with their daemon; the others were killed by the coordinator
    cluster.wait_no_rank_processes(job)
    # the rest of the cluster keeps working, without n3
    result = cluster.gang("run", "-n", 6, "--", "sh", "-c", "echo $GANGD_NODE")
    assert result.returncode == 0, result.stderr
    assert sorted({line.split(": ")[1] for line in result.stdout.splitlines()}) == ["n1", "n2", "n4"], cluster.log("n1")
    assert "n3" in cluster.log("n1") and "is down" in cluster.log("n1")


def test_coordinator_loss_hands_over_to_the_next_node(make_cluster):
    cluster = make_cluster(3)
    leader = next(r["name"] for r in cluster.gang_json("nodes")["nodes"] if r["coordinator"])
    rest = sorted(set(cluster.files) - {leader})
    done = int(cluster.gang("submit", "-n", 3, "--name", "before", "--", "true", check=True).stdout)
    cluster.wait_state(done, "DONE")
    survivor = int(cluster.gang("submit", "-n", 2, "-w", ",".join(rest), "--name", "survivor", "--", "sleep", "300", check=True).stdout)
    victim = int(cluster.gang("submit", "-n", 3, "--name", "victim", "--", "sleep", "300", check=True).stdout)
    cluster.wait_state(victim, "RUNNING")
    cluster.wait_state(survivor, "RUNNING")
    cluster.kill_node(leader)
    record = cluster.wait_state(victim, "FAILED", timeout=20)
    assert f"node {leader}" in record["reason"]
    rows = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}
    assert rows[leader]["state"] == "down" and not rows[leader]["coordinator"]
    assert [n for n in rest if rows[n]["coordinator"]], rows
    # history and the untouched job survive the takeover
    assert cluster.job(done)["state"] == "DONE"
    assert cluster.job(survivor)["state"] == "RUNNING"
    # new jobs get fresh ids and run on the survivors
    result = cluster.gang("run", "-n", 2, "--", "sh", "-c", "echo $GANGD_JOB")
    assert result.returncode == 0, result.stderr
    new_id = int(result.stdout.split(": ")[1].split()[0])
    assert new_id > victim
    assert cluster.gang("kill", survivor).returncode == 0
    cluster.wait_no_rank_processes()


def test_restarted_cluster_remembers_job_history(make_cluster):
    cluster = make_cluster(2, own_etcd=True)  # (its etcd goes down and up with it)
    job = int(cluster.gang("submit", "-n", 2, "--name", "remember-me", "--", "echo", "hi", check=True).stdout)
    cluster.wait_state(job, "DONE")
    local.down(cluster.dir)
    local.up(cluster.dir, 2)
    record = cluster.job(job)
    assert record["name"] == "remember-me" and record["state"] == "DONE"
    assert sorted(cluster.gang("logs", job).stdout.splitlines()) == ["0: hi", "1: hi"]
    # and numbering continues
    assert int(cluster.gang("submit", "-n", 1, "--", "true", check=True).stdout) == job + 1


def _endpoint(cluster, node: str) -> tuple[str, int]:
    rows = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}
    host, port = rows[node]["address"].split(":")
    return host, int(port)


def test_wrong_secret_is_refused_on_both_sides(cluster4):
    host, port = _endpoint(cluster4, "n2")

    async def dial_with_wrong_secret():
        with pytest.raises(ProtocolError) as info:
            await dial_tcp(host, port, node="n1", secret=b"not-the-cluster-secret-at-all", label="n2")
        return info.value

    error = trio.run(dial_with_wrong_secret)
    assert error.code == "auth_failed" and "wrong cluster secret" in error.message

    # An impostor that skips verifying the daemon and sends a forged proof:
    # the daemon itself must refuse it and say why in its log.
    with socket.create_connection((host, port), timeout=5) as sock:
        conn = Connection(dialer=True, node="n1", role=Role.PEER, secret=b"forged-secret-forged-secret")
        sock.sendall(conn.data_to_send())
        reply = _read_frame(sock)
        assert reply["t"] == "hello" and "proof" in reply
        forged = {"t": "auth", "proof": b"\0" * 32}
        payload = msgpack.packb(forged)
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        bye = _read_frame(sock)
        assert bye == {"t": "bye", "code": "auth_failed", "message": bye["message"]}
        assert sock.recv(1) == b""  # and it hung up
    _eventually(lambda: "failed authentication: wrong cluster secret" in cluster4.log("n2"))
    assert all(r["state"] == "up" for r in cluster4.gang_json("nodes")["nodes"])


def test_old_protocol_version_is_refused(cluster4):
    host, port = _endpoint(cluster4, "n3")
    with socket.create_connection((host, port), timeout=5) as sock:
        payload = msgpack.packb({"t": "hello", "v": 0, "role": "peer", "node": "n1", "nonce": os.urandom(16)})
        sock.sendall(struct.pack(">I", len(payload)) + payload)
        bye = _read_frame(sock)
        assert bye["code"] == "version_mismatch" and "version 0" in bye["message"]
    _eventually(lambda: "speaks gangd protocol version 0" in cluster4.log("n3"))


@pytest.mark.parametrize(
    "garbage",
    [
        os.urandom(4096),
        b"\xff\xff\xff\xff" + b"x" * 100,  # a 4 GiB length prefix
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # msgpack's reserved byte
        struct.pack(">I", 1000) + b"truncated",  # then hang up mid-frame
        struct.pack(">I", 1) + b"\x05",  # a frame that is not a map
    ],
    ids=["random", "huge-length", "undecodable", "truncated", "not-a-map"],
)
def test_garbage_on_both_sockets_is_refused_without_harm(cluster4, garbage):
    host, port = _endpoint(cluster4, "n2")
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
        _drain_until_closed(sock)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(cluster4.files["n2"].socket))
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
        _drain_until_closed(sock)
    # n2 still serves clients and peers, and nobody noticed anything
    rows = cluster4.gang_json("nodes")["nodes"]
    assert all(r["state"] == "up" for r in rows)
    result = cluster4.gang("run", "-n", 4, "-w", "n2", "--", "echo", "ok")
    assert result.returncode == 0 and result.stdout.count("ok") == 4


def test_garbage_after_a_good_handshake_closes_only_that_connection(cluster4):
    async def main():
        async with connect(cluster4.dir) as good:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(cluster4.files["n1"].socket))
                conn = Connection(dialer=True, node="me")
                sock.sendall(conn.data_to_send())
                sock.sendall(b"\x00\x00\x00\x02\x93\x01")  # a 2-byte frame holding a cut-short list
                assert _read_frame(sock)["t"] == "hello"
                bye = _read_frame(sock)
                assert bye["t"] == "bye" and bye["code"] == "malformed", bye
                _drain_until_closed(sock)
            assert len(await good.nodes()) == 4  # the other client is unaffected

    trio.run(main)


def test_client_cannot_call_daemon_operations(cluster4):
    async def main():
        async with connect(cluster4.dir) as gang:
            with pytest.raises(RemoteError) as info:
                await gang.request("kill_ranks", job=1)
            assert info.value.code == "permission_denied"
            with pytest.raises(RemoteError) as info:
                await gang.request("frobnicate")
            assert info.value.code == "unknown_op"
            with pytest.raises(RemoteError) as info:
                await gang.request("kill", job="1; rm -rf /")
            assert info.value.code == "bad_request"

    trio.run(main)


# ---------------------------------------------------------------- a second uid

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
def test_another_user_cannot_touch_your_job_and_runs_as_themselves(cluster4):
    job = int(cluster4.gang("submit", "-n", 2, "--name", "roots-job", "--", "sleep", "300", check=True).stdout)
    cluster4.wait_state(job, "RUNNING")

    def meddle():
        async def main():
            outcome = {}
            async with connect(cluster4.dir) as gang:
                me = await gang.info()
                outcome["uid"] = me["uid"]
                outcome |= await tried_on(gang, job, ("kill", "job", "wait"))
                # their own job runs as them, not as root
                record = await gang.submit(["/bin/sh", "-c", "id -u; id -g"], 2, cwd="/", env={"PATH": "/usr/bin:/bin"})
                final = await gang.wait_done(record["id"])
                text = b""
                async with gang.output(record["id"], follow=False) as chunks:
                    async for item in chunks:
                        text += item["data"]
                outcome["own"] = [final["state"], final["owner"], text.decode()]
                # and they may kill their own job
                record = await gang.submit(["/bin/sleep", "300"], 1, cwd="/", env={"PATH": "/usr/bin:/bin"})
                killed = await gang.kill(record["id"])
                outcome["own_kill"] = killed["state"]
            return outcome

        return trio.run(main)

    outcome = as_uid(NOBODY, meddle)
    assert "exception" not in outcome, outcome
    assert outcome["uid"] == NOBODY
    for action in ("kill", "job", "wait", "output"):
        code, message = outcome[action]
        assert code == "permission_denied", (action, outcome[action])
        assert "belongs to root" in message
    state, owner, text = outcome["own"]
    assert state == "DONE" and owner == "nobody"
    assert text.split() == [str(NOBODY), str(NOBODY)] * 2
    assert outcome["own_kill"] == "KILLED"
    # root's job is untouched by all this, and root may kill anyone's job
    assert cluster4.job(job)["state"] == "RUNNING"
    assert cluster4.gang("kill", job).returncode == 0
    cluster4.wait_no_rank_processes()


# ---------------------------------------------------------------- helpers


def _read_frame(sock: socket.socket) -> dict:
    header = _recv_exactly(sock, 4)
    (length,) = struct.unpack(">I", header)
    return msgpack.unpackb(_recv_exactly(sock, length), raw=False)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def _drain_until_closed(sock: socket.socket) -> None:
    sock.settimeout(10)
    while sock.recv(65536):
        pass


def _eventually(predicate, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_garbage_from_an_authenticated_peer_closes_only_that_link(cluster4):
    host, port = _endpoint(cluster4, "n4")
    secret = (cluster4.dir / "secret").read_bytes().strip()
    with socket.create_connection((host, port), timeout=5) as sock:
        conn = Connection(dialer=True, node="n1", role=Role.PEER, secret=secret)
        sock.sendall(conn.data_to_send())
        conn.receive_data(_recv_exactly(sock, 4 + struct.unpack(">I", sock.recv(4, socket.MSG_PEEK))[0]))
        assert conn.next_event() is not None  # authenticated as n1
        sock.sendall(conn.data_to_send())  # our proof
        sock.sendall(struct.pack(">I", 5) + b"\xde\xad\xbe\xef\x00")
        bye = _read_frame(sock)
        assert bye["t"] == "bye" and bye["code"] == "malformed"
        _drain_until_closed(sock)
    # the real n1 <-> n4 link never noticed
    rows = cluster4.gang_json("nodes")["nodes"]
    assert all(r["state"] == "up" for r in rows)
    assert cluster4.gang("run", "-n", 2, "-w", "n4", "--", "true").returncode == 0


def test_daemon_speaks_sd_notify_to_a_real_socket(tmp_path):
    """The daemon as systemd runs it: READY=1 once it serves, watchdog pings, STOPPING=1 on SIGTERM."""
    import subprocess
    import sys

    from gangd.daemon.config import Config, EtcdSettings, NodeSpec, render

    notify_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(10)
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(16).hex())
    secret.chmod(0o600)  # a secret others can read is refused
    port = local.pick_port(["127.0.0.1"])
    config = Config(
        node_name="solo",
        nodes=(NodeSpec("solo", "127.0.0.1", port, 2),),
        state_dir=tmp_path / "state",
        socket=tmp_path / "gangd.sock",
        secret_file=secret,
        etcd=EtcdSettings(endpoints=("http://127.0.0.1:9",)),  # (unreachable: READY and the watchdog do not wait for etcd)
    )
    (tmp_path / "gangd.toml").write_text(render(config))
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}
    daemon = subprocess.Popen([sys.executable, "-m", "gangd.daemon.main", "--config", str(tmp_path / "gangd.toml")], env=env, stderr=subprocess.PIPE)
    try:
        messages = []
        while not any(b"READY=1" in m for m in messages):
            messages.append(listener.recv(4096))
        ready = next(m for m in messages if b"READY=1" in m).decode()
        assert f"MAINPID={daemon.pid}" in ready and "STATUS=" in ready
        assert tmp_path.joinpath("gangd.sock").exists()  # READY only once it serves
        watchdogs = 0
        while watchdogs < 3:
            watchdogs += listener.recv(4096).count(b"WATCHDOG=1")
        daemon.send_signal(signal.SIGTERM)
        while b"STOPPING=1" not in listener.recv(4096):
            pass
        assert daemon.wait(timeout=10) == 0
    finally:
        daemon.kill()
        daemon.wait()
        listener.close()


def test_malformed_job_specs_are_refused_and_the_queue_keeps_moving(cluster4):
    async def main():
        async with connect(cluster4.dir) as gang:
            bad_specs = [
                {"argv": ["true"], "nranks": 1, "per_node": 0.5},
                {"argv": ["true"], "nranks": 1, "nodes": True},
                {"argv": ["true"], "nranks": 1, "env": {"X": 1}},
                {"argv": ["true"], "nranks": 1, "name": 42},
                {"argv": ["true"], "nranks": 1, "nodelist": "n1"},
                {"argv": [], "nranks": 1},
                {"argv": ["true"], "nranks": True},
            ]
            for spec in bad_specs:
                with pytest.raises(RemoteError) as info:
                    await gang.request("submit", spec=spec)
                assert info.value.code == "bad_request", spec
            # a NUL byte could never reach exec: refused at submit, saying why
            with pytest.raises(RemoteError) as info:
                await gang.submit(["/bin/echo", "a\0b"], 1)
            assert info.value.code == "bad_request" and "NUL" in info.value.message
            # and the cluster still schedules
            record = await gang.submit(["/bin/true"], 4)
            assert (await gang.wait_done(record["id"]))["state"] == "DONE"

    trio.run(main)


def test_kill_right_after_submit_leaves_nothing_running(cluster4):
    """The kill may overtake the launch on its way to the nodes."""

    async def main():
        async with connect(cluster4.dir) as gang:
            for _ in range(5):
                record = await gang.submit(["/bin/sleep", "300"], 8)
                killed = await gang.kill(record["id"])
                assert killed["state"] == "KILLED"

    trio.run(main)
    cluster4.wait_no_rank_processes()


def test_a_peers_restore_report_is_checked_against_the_job(cluster4):
    """``coord_ckpt_restored`` comes from a peer (any holder of the cluster
    secret): a report that a restore failed must come from a node of a job
    that is being restored, or it is ignored; a malformed one is refused. A
    running job that was never restarted is not failed by it, and the
    coordinator serves on."""
    from test_control_plane import coordinator_seen_by

    leader = coordinator_seen_by(cluster4, "n1")
    assert leader is not None
    job = int(cluster4.gang("submit", "-n", 2, "-w", "n3", "--", "sleep", "300", check=True).stdout)
    cluster4.wait_state(job, "RUNNING")
    host, port = _endpoint(cluster4, leader)
    secret = (cluster4.dir / "secret").read_bytes().strip()
    reporter = "n3" if leader != "n3" else "n2"

    reports = ({"job": job, "error": "\x1b[2Jrank 0: cannot restore" * 5000},  # a job never restarted, from a node not its own
               {"job": job},  # "restored", for it
               {"job": "12; rm -rf /"}, {"job": -5}, {},  # malformed
               {"job": job, "error": {"nested": [1] * 100}})

    async def report():
        answers: list = []
        channel = await dial_tcp(host, port, node=reporter, secret=secret, label=leader)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.run)
            for args in reports:
                try:
                    with trio.fail_after(30):
                        answers.append(("ok", await channel.request("coord_ckpt_restored", **args)))
                except RemoteError as exc:
                    answers.append((exc.code, exc.message))
            nursery.cancel_scope.cancel()
        await channel.aclose()
        return answers

    try:
        answers = trio.run(report)
        assert [a[0] for a in answers] == ["ok", "ok", "bad_request", "ok", "bad_request", "ok"], answers  # (-5: no such job, ignored)
        record = cluster4.gang_json("job", job)
        assert record["state"] == "RUNNING", record
        assert "restore" not in (record.get("reason") or ""), record
        assert cluster4.log(leader).count("for a job that is not being restored there; ignored") >= 3
        assert all(r["state"] == "up" for r in cluster4.gang_json("nodes")["nodes"])
    finally:
        cluster4.gang("kill", job)
