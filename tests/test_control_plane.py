"""The control plane on etcd, tried as a cluster's users and operators would break it.

Real daemons, a real etcd, real signals: a coordinator stopped for less and
for more than its lease, a coordinator killed right after its commit, an
etcd member killed, a node cut off from etcd. What must hold: one
coordinator at a time, one state per job on every node, no id handed out
twice, no rank left running without a job, and clear words to the user.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import trio
from click.testing import CliRunner
from conftest import as_uid, gang_here, wait_for

from gangd.client import cluster as local
from gangd.client.api import connect
from gangd.client.cli import main as cli_main
from gangd.daemon import config as cfg
from gangd.etcd.server import LocalEtcd
from gangd.rpc import RemoteError, dial_tcp

PY = sys.executable


def gang_on(cluster, node: str, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    """The gang command talking to one node's daemon (not the first that answers): in this
    process where it can be (conftest.gang_here), else as a process."""
    socket_path = str(cluster.files[node].socket)
    found = gang_here([str(a) for a in args], timeout, env={"GANGD_CLUSTER": None, "GANGD_SOCKET": socket_path})
    if found is not None:
        return found
    env = {k: v for k, v in os.environ.items() if k != "GANGD_CLUSTER"}
    env["GANGD_SOCKET"] = socket_path
    cmd = [PY, "-m", "gangd.client.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def json_on(cluster, node: str, *args):
    result = gang_on(cluster, node, *args, "--json")
    assert result.returncode == 0, f"gang {args} on {node}: {result.stderr}"
    return json.loads(result.stdout)


def coordinator_seen_by(cluster, node: str) -> str | None:
    rows = json_on(cluster, node, "nodes")["nodes"]
    leaders = [r["name"] for r in rows if r["coordinator"]]
    return leaders[0] if leaders else None


def states_seen_by(cluster, node: str) -> dict[int, str]:
    return {r["id"]: r["state"] for r in json_on(cluster, node, "ps", "--all")}


def submit_on(cluster, node: str, *args) -> int:
    result = gang_on(cluster, node, "submit", *args)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def others(cluster, node: str) -> list[str]:
    return [n for n in sorted(cluster.files) if n != node]


def ranks_on_node(cluster, job_id: int, node: str) -> list[psutil.Process]:
    found = []
    for proc in cluster.rank_processes(job_id):
        try:
            if proc.environ().get("GANGD_NODE") == node:
                found.append(proc)
        except psutil.Error:
            continue
    return found


# ---------------------------------------------------------------- a stalled coordinator


def test_a_coordinator_stopped_for_less_than_its_lease_changes_nothing(make_cluster):
    cluster = make_cluster(3, lease_ttl=8)
    leader = coordinator_seen_by(cluster, "n1")
    assert leader is not None
    jobs_ = [submit_on(cluster, "n1", "-n", 3, "--", "sleep", 300) for _ in range(2)]
    for job in jobs_:
        cluster.wait_state(job, "RUNNING")
    os.kill(cluster.daemon_pid(leader), signal.SIGSTOP)
    try:
        time.sleep(2.5)
    finally:
        os.kill(cluster.daemon_pid(leader), signal.SIGCONT)
    time.sleep(3)  # (past when a lease of a stall this long would have been judged)
    for node in cluster.files:
        assert coordinator_seen_by(cluster, node) == leader
        assert all(state in ("RUNNING", "SUSPENDED") for job, state in states_seen_by(cluster, node).items() if job in jobs_)
    for node in cluster.files:
        log = cluster.log(node)
        assert "is down: its lease" not in log, log[-2000:]
        assert "as coordinator ended" not in log, log[-2000:]
    for job in jobs_:
        cluster.gang("kill", job, check=True)
    cluster.wait_no_rank_processes(timeout=20)


def test_a_coordinator_stopped_past_its_lease_is_replaced_once_and_leaves_no_orphans(make_cluster):
    cluster = make_cluster(3, lease_ttl=3)
    stalled = coordinator_seen_by(cluster, "n1")
    rest = others(cluster, stalled)
    witness = rest[0]
    spanning = submit_on(cluster, witness, "-n", 3, "-w", ",".join(sorted(cluster.files)), "--", "sleep", 300)
    elsewhere = submit_on(cluster, witness, "-n", 2, "-w", ",".join(rest), "--", "sleep", 300)
    for job in (spanning, elsewhere):
        cluster.wait_state(job, "RUNNING")
    assert ranks_on_node(cluster, spanning, stalled)
    os.kill(cluster.daemon_pid(stalled), signal.SIGSTOP)
    try:
        # Another node takes over, and fails (once) the job that had a rank on the stalled node.
        wait_for(lambda: coordinator_seen_by(cluster, witness) not in (None, stalled), 30, "a new coordinator")
        successor = coordinator_seen_by(cluster, witness)
        wait_for(lambda: states_seen_by(cluster, witness)[spanning] == "FAILED", 30, "the spanning job to fail")
        reason = next(r for r in json_on(cluster, witness, "ps", "--all") if r["id"] == spanning)["reason"]
        assert f"node {stalled}" in reason and "lease" in reason, reason
        assert states_seen_by(cluster, witness)[elsewhere] == "RUNNING"
        # Ids go on from where the stalled coordinator left them.
        later = submit_on(cluster, witness, "-n", 1, "-w", witness, "--", "true")
        assert later > elsewhere
    finally:
        os.kill(cluster.daemon_pid(stalled), signal.SIGCONT)
    # The stalled node learns its term is over and rejoins as an ordinary node.
    wait_for(lambda: "as coordinator ended" in cluster.log(stalled), 30, "the stalled coordinator to step down")
    wait_for(lambda: all(coordinator_seen_by(cluster, n) == successor for n in cluster.files), 30, "every node to agree on the coordinator")
    # No rank of the failed job lives anywhere, the stalled node included.
    cluster.wait_no_rank_processes(spanning, timeout=30)
    # One state per job, whichever node is asked.
    cluster.wait_state(later, "DONE")
    seen = {node: states_seen_by(cluster, node) for node in cluster.files}
    assert all(s == seen[witness] for s in seen.values()), seen
    assert seen[witness][spanning] == "FAILED" and seen[witness][elsewhere] == "RUNNING"
    time.sleep(2)  # the role does not flip back to the returning node
    assert all(coordinator_seen_by(cluster, n) == successor for n in cluster.files)
    cluster.gang("kill", elsewhere, check=True)
    cluster.wait_no_rank_processes(timeout=20)


def test_a_node_refuses_and_logs_a_command_from_an_older_term(make_cluster):
    cluster = make_cluster(2)
    job = submit_on(cluster, "n1", "-n", 2, "--", "sleep", 300)
    cluster.wait_state(job, "RUNNING")
    config = cfg.load(cluster.files["n2"].config)
    secret = config.read_secret()
    spec = config.spec("n2")

    async def as_a_deposed_coordinator(args: dict):
        channel = await dial_tcp(spec.address, spec.port, node="n1", secret=secret, label="n2", timeout=5)
        answer = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.run, lambda *_: None)
                try:
                    answer = await channel.request("kill_ranks", job=job, **args)
                except RemoteError as exc:
                    answer = exc
                nursery.cancel_scope.cancel()
        finally:
            await channel.aclose()
        return answer

    for args, words in (({"term": 1}, "coordinator term 1 is over"), ({}, "needs the coordinator's term")):
        refused = trio.run(as_a_deposed_coordinator, args)
        assert isinstance(refused, RemoteError), refused
        assert refused.code == "stale_term" and words in refused.message, refused
    assert "refused 'kill_ranks' from n1: its coordinator term 1 is older than term" in cluster.log("n2")
    assert len(ranks_on_node(cluster, job, "n2")) == 1  # not killed
    assert cluster.job(job)["state"] == "RUNNING"
    cluster.gang("kill", job, check=True)


# ---------------------------------------------------------------- a crash right after a commit


def test_a_coordinator_killed_right_after_its_commit_loses_nothing_and_duplicates_nothing(make_cluster, tmp_path, monkeypatch):
    points = tmp_path / "failpoints"
    points.mkdir()
    monkeypatch.setenv("GANGD_FAILPOINTS", str(points))
    cluster = make_cluster(3, lease_ttl=3)
    first = submit_on(cluster, "n1", "-n", 1, "--", "true")
    cluster.wait_state(first, "DONE")
    crashed = coordinator_seen_by(cluster, "n1")
    witness = others(cluster, crashed)[0]
    (points / "jobtable.created").touch()  # the coordinator dies right after etcd committed the next job
    submitted = gang_on(cluster, witness, "submit", "-n", 1, "-w", witness, "--", "echo", "survived", timeout=120)
    wait_for(lambda: cluster.files[crashed].pid() is None, 30, "the coordinator's crash")
    assert not (points / "jobtable.created").exists()
    assert "failpoint jobtable.created reached" in cluster.log(crashed)
    # The client's node retried against the new coordinator, which had the
    # commit: the same job, not a second one.
    assert submitted.returncode == 0, submitted.stderr
    job = int(submitted.stdout)
    assert job == first + 1
    assert cluster_ids(cluster, witness) == [first, job]
    assert cluster_wait_on(cluster, witness, job, "DONE")
    output = gang_on(cluster, witness, "logs", job)
    assert "survived" in output.stdout, output
    # And the counter went on from there.
    assert submit_on(cluster, witness, "-n", 1, "-w", witness, "--", "true") == job + 1


def cluster_ids(cluster, node: str) -> list[int]:
    return sorted(states_seen_by(cluster, node))


def cluster_wait_on(cluster, node: str, job: int, state: str, timeout: float = 60) -> bool:
    wait_for(lambda: states_seen_by(cluster, node).get(job) == state, timeout, f"job {job} {state}")
    return True


# ---------------------------------------------------------------- etcd trouble


def test_the_cluster_keeps_working_when_an_etcd_member_of_three_dies(make_cluster):
    # (a lease longer than etcd's own election: losing its raft leader must not cost a node its lease)
    cluster = make_cluster(2, etcd_members=3, lease_ttl=8)
    busy = cluster.gang("submit", "-n", 2, "--", "sleep", 300, check=True)
    job = int(busy.stdout)
    cluster.wait_state(job, "RUNNING")
    store = LocalEtcd.load(cluster.dir / "etcd")
    store.kill_member(0)
    time.sleep(9)  # longer than a lease: every keep-alive went through the other members
    result = cluster.gang("run", "-n", 2, "--", "echo", "still here", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("still here") == 2
    rows = cluster.gang_json("nodes")["nodes"]
    assert [r["state"] for r in rows] == ["up", "up"]
    assert "is down: its lease" not in cluster.log("n1") + cluster.log("n2")
    assert cluster.job(job)["state"] == "RUNNING"  # nothing failed
    cluster.gang("kill", job, check=True)


class CuttableProxy:
    """A TCP forwarder between one daemon and etcd that the test can cut (and mend)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        self.listener.close()
        with self.lock:
            for s in self.connections:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self.connections.clear()

    def mend(self):
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()


def test_a_node_cut_off_from_etcd_refuses_new_work_and_keeps_its_ranks_for_the_grace_period(make_cluster):
    # (a grace well past the lease, so the others fail the job before n3's grace ends: 5 s apart, not 7, and 4 s sooner)
    grace = 8
    cluster = make_cluster(3, lease_ttl=3, grace=grace, own_etcd=True)  # (the test cuts it off)
    endpoint = LocalEtcd.load(cluster.dir / "etcd").endpoints[0]
    host, port = re.match(r"https?://([^:/]+):(\d+)", endpoint).groups()
    proxy = CuttableProxy((host, int(port)))
    try:
        # n3 reaches etcd only through the proxy.
        nf = cluster.files["n3"]
        os.kill(cluster.daemon_pid("n3"), signal.SIGTERM)
        wait_for(lambda: nf.pid() is None, 30, "n3 to stop")
        text = nf.config.read_text()
        text = re.sub(r"endpoints = \[[^\]]*\]", f'endpoints = ["http://127.0.0.1:{proxy.port}"]', text, count=1)
        nf.config.write_text(text)
        cluster.start_daemon("n3")
        wait_for(lambda: all(r["state"] == "up" for r in json_on(cluster, "n1", "nodes")["nodes"]), 60, "n3 back")
        job = submit_on(cluster, "n1", "-n", 2, "-w", "n1,n3", "--", "sleep", 300)
        cluster.wait_state(job, "RUNNING")
        assert ranks_on_node(cluster, job, "n3")
        cut_at = time.monotonic()
        proxy.cut()
        # n3 notices (its lease cannot be renewed) and says so to its users.
        wait_for(lambda: "cannot reach etcd" in next(r for r in json_on(cluster, "n3", "nodes")["nodes"] if r["name"] == "n3")["why"], 30,
                 "n3 to know it is cut off")
        refused = gang_on(cluster, "n3", "submit", "-n", 1, "--", "true")
        assert refused.returncode != 0
        assert "cannot reach the cluster's etcd" in refused.stderr and f"keep running for up to {grace:g} s" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        # The others see n3 down and fail its job; n3's own rank keeps running for the grace period...
        wait_for(lambda: cluster.job(job)["state"] == "FAILED", 30, "the job to fail")
        assert not ranks_on_node(cluster, job, "n1")
        if time.monotonic() - cut_at < grace:
            assert ranks_on_node(cluster, job, "n3"), "n3 killed its ranks before the grace period was over"
        # ...and no longer.
        wait_for(lambda: not ranks_on_node(cluster, job, "n3"), grace + 40, "n3 to kill its ranks after the grace period")
        assert time.monotonic() - cut_at >= grace
        assert f"could not reach etcd for {grace:g} s" in cluster.log("n3")
        # Mended: n3 joins again and takes work.
        proxy.mend()
        wait_for(lambda: gang_on(cluster, "n3", "run", "-n", 1, "-w", "n3", "--", "true").returncode == 0, 60, "n3 to take work again")
    finally:
        proxy.cut()
        local.down(cluster.dir)


# ---------------------------------------------------------------- the history


def test_ended_jobs_move_to_the_history_and_every_command_still_finds_them(make_cluster):
    cluster = make_cluster(1, cores=2, job_retention=1)
    ok = [int(cluster.gang("submit", "-n", 1, "--", "echo", f"job {i}", check=True).stdout) for i in range(3)]
    bad = int(cluster.gang("submit", "-n", 1, "--", "sh", "-c", "exit 3", check=True).stdout)
    for job in ok:
        cluster.wait_state(job, "DONE")
    cluster.wait_state(bad, "FAILED")
    # Retired from the hot table: `ps` no longer lists them, the history does.
    wait_for(lambda: not cluster.ps(), 30, "the ended jobs to leave the hot table")
    history = cluster.gang_json("history")
    assert [r["id"] for r in history] == [bad, *reversed(ok)]
    assert history[0]["state"] == "FAILED" and "exit 3" in history[0]["reason"]
    assert [r["id"] for r in cluster.gang_json("history", "-n", 2)] == [bad, ok[2]]
    assert [r["id"] for r in cluster.gang_json("history", "--before", ok[2])] == [ok[1], ok[0]]
    assert cluster.gang_json("history", "--user", "nobody") == []
    assert [r["id"] for r in cluster.gang_json("ps", "--all")] == [*ok, bad]
    text = cluster.gang("history", check=True).stdout
    assert "ENDED" in text and "FAILED" in text
    # A retired job's output and record are still there for its owner.
    assert cluster.gang("logs", ok[1], check=True).stdout.strip().endswith("job 1")
    waited = cluster.gang("wait", bad)
    assert waited.returncode == 3, (waited.returncode, waited.stderr)
    # And ids go on after them.
    assert int(cluster.gang("submit", "-n", 1, "--", "true", check=True).stdout) == bad + 1


def test_a_history_request_with_hostile_arguments_is_refused_or_bounded(make_cluster):
    cluster = make_cluster(1, cores=2, job_retention=1)
    job = int(cluster.gang("submit", "-n", 1, "--", "true", check=True).stdout)
    cluster.wait_state(job, "DONE")

    async def ask(**args):
        async with connect(cluster.dir) as gang:
            try:
                return await gang.request("history", **args)
            except RemoteError as exc:
                return exc

    for args in ({"before": "7"}, {"uid": [0]}, {"limit": True}, {"before": 1.5}):
        answer = trio.run(lambda a=args: ask(**a))
        assert isinstance(answer, RemoteError) and answer.code == "bad_request", (args, answer)
    assert [r["id"] for r in trio.run(lambda: ask(limit=10**12, before=2**62))] == [job]  # bounded, not refused
    assert trio.run(lambda: ask(limit=-5, uid=-1)) == []
    # A stranger sees the history as `ps` shows it, never another user's environment.
    def look():
        out = CliRunner().invoke(cli_main, ["--cluster", str(cluster.dir), "history", "--json"], catch_exceptions=False)
        return {"code": out.exit_code, "out": out.output}

    seen = as_uid(65534, look)
    assert seen["code"] == 0 and [r["id"] for r in json.loads(seen["out"])] == [job]
    assert "env" not in json.loads(seen["out"])[0]
    assert cluster.gang("nodes", check=True).returncode == 0  # the daemon is unharmed
