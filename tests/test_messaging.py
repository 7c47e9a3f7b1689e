"""Job messaging (gangd.comm) on real clusters, with jobs gang-scheduled against each other.

Every message is checked by the jobs themselves (tests/jobs/*.py): contents,
size, per-pair order, no loss, no duplicate. Here the jobs run time-sliced
with short slices so that switches — gates closing, every process stopped,
resumed — land everywhere, including in the middle of large transfers.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import trio
from conftest import as_uid, shared_cluster

from gangd.client.api import connect
from gangd.rpc import RemoteError

JOBS = Path(__file__).parent / "jobs"
PY = sys.executable


def stopped(proc: psutil.Process) -> bool:
    """Stopped by signal, or in a frozen cgroup (how gangd stops ranks where it can)."""
    if proc.status() == psutil.STATUS_STOPPED:
        return True
    mount = next((line.split()[1] for line in open("/proc/self/mounts") if line.split()[2:3] == ["cgroup2"]), None)
    group = next((line[3:].strip() for line in open(f"/proc/{proc.pid}/cgroup") if line.startswith("0::")), None)
    return mount is not None and group is not None and "frozen 1" in Path(f"{mount}{group}/cgroup.events").read_text()


def job_cmd(script: str, *args) -> list[str]:
    return [PY, str(JOBS / script), *map(str, args)]


@pytest.fixture(scope="module")
def sliced():
    """3 nodes x 2 cores, 50 ms time slices: jobs of 6 ranks each fill the cluster."""
    with shared_cluster(3, cores=2, time_slice=0.05) as cluster:
        yield cluster


def switches_of(cluster, job_id: int) -> list[dict]:
    async def go():
        async with connect(cluster.dir) as gang:
            return (await gang.schedule(switches=True))["switch_log"]

    return [s for s in trio.run(go) if job_id in s["stop"] or job_id in s["cont"]]


def submit(cluster, nranks: int, argv: list[str], *extra) -> int:
    return int(cluster.gang("submit", "-n", nranks, *extra, "--", *argv, check=True).stdout)


def finished(cluster, job_id: int, timeout: float = 120) -> dict:
    return cluster.wait_state(job_id, ("DONE", "FAILED", "KILLED"), timeout=timeout)


def output(cluster, job_id: int) -> str:
    return cluster.gang("logs", "--no-label", job_id, check=True).stdout


def test_random_messages_three_jobs_time_sliced(sliced):
    ids = [submit(sliced, 6, job_cmd("msgstorm.py", "--rounds", 20, "--max-size", 4 << 20, "--seed", seed)) for seed in (1, 2, 3)]
    for job_id in ids:
        record = finished(sliced, job_id, timeout=240)
        text = output(sliced, job_id)
        assert record["state"] == "DONE", f"job {job_id}: {record['reason']}\n{text[-3000:]}"
        assert "msgstorm OK" in text
    # They really were time-sliced against each other while talking.
    for job_id in ids:
        assert len(switches_of(sliced, job_id)) >= 4


def test_switches_land_in_the_middle_of_large_transfers(sliced):
    busy = submit(sliced, 6, ["/bin/sh", "-c", "while :; do :; done"], "--slice", "0.02")
    swap = submit(sliced, 2, job_cmd("bigswap.py", "--mib", 32, "--times", 8), "--per-node", "1", "--slice", "0.02")
    record = finished(sliced, swap, timeout=180)
    sliced.gang("kill", busy)
    assert record["state"] == "DONE", output(sliced, swap)[-3000:]
    assert "bigswap OK" in output(sliced, swap)
    # 512 MiB moved each way over TCP with 20 ms slices: many switches hit transfers.
    assert len([s for s in switches_of(sliced, swap) if swap in s["stop"]]) >= 5


def test_long_suspension_with_messages_in_flight(sliced, tmp_path):
    gate = tmp_path / "go"
    job_id = submit(sliced, 2, job_cmd("netctx.py", "send", gate), "--per-node", "1")
    deadline = time.monotonic() + 60
    while "sent" not in output(sliced, job_id):
        assert time.monotonic() < deadline, "rank 0 never finished sending"
        time.sleep(0.2)
    sliced.gang("suspend", job_id, check=True)
    net = sliced.gang_json("net", job_id)
    channel = next(c for c in net["channels"] if c["src"] == 0 and c["dst"] == 1)
    assert channel["sent"] >= 5 and channel["in_flight"] >= 5  # counters readable while stopped
    procs = sliced.rank_processes(job_id)
    deadline = time.monotonic() + 10
    while not (procs and all(stopped(p) for p in procs)):
        assert time.monotonic() < deadline, [(p.pid, p.status()) for p in procs]
        time.sleep(0.05)
    gate.touch()
    time.sleep(5)  # a long suspension: nothing may move
    assert all(stopped(p) for p in procs)
    assert "received OK" not in output(sliced, job_id)
    sliced.gang("resume", job_id, check=True)
    record = finished(sliced, job_id)
    assert record["state"] == "DONE", output(sliced, job_id)
    assert "received OK" in output(sliced, job_id)


def test_rank_that_exited_gives_a_clear_error_not_a_hang(sliced):
    job_id = submit(sliced, 2, job_cmd("netctx.py", "exit-early"), "--per-node", "1")
    record = finished(sliced, job_id, timeout=60)
    text = output(sliced, job_id)
    assert record["state"] == "FAILED" and record["ranks"][0]["code"] == 3, text
    assert "PeerExited" in text and "rank 1" in text


def test_network_context_is_captured_and_restored(sliced, tmp_path):
    gate = tmp_path / "go"
    job_id = submit(sliced, 2, job_cmd("netctx.py", "send", gate), "--per-node", "1")
    deadline = time.monotonic() + 60
    while "sent" not in output(sliced, job_id):
        assert time.monotonic() < deadline
        time.sleep(0.2)

    async def capture():
        async with connect(sliced.dir) as gang:
            return await gang.capture_network(job_id)

    contexts = trio.run(capture)
    assert set(contexts) == {"0", "1"}
    ctx1 = msgpack.unpackb(contexts["1"], raw=False, strict_map_key=False)
    # The five messages rank 0 sent and rank 1 has not received are in rank 1's
    # context, in order (after them rank 0's first barrier message, tag < 0).
    user = [m for m in ctx1["messages"] if m[1] >= 0]
    assert [(m[0], m[1]) for m in user] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert [len(m[5]) for m in user][-1] == 3 << 20
    assert ctx1["received"][0] == len(ctx1["messages"]) and ctx1["delivered"][0] == 0
    ctx0 = msgpack.unpackb(contexts["0"], raw=False, strict_map_key=False)
    assert ctx0["sent"][1] == len(ctx1["messages"])  # what one sent is what the other holds

    # Capturing is not destructive: the job still gets every message.
    gate.touch()
    record = finished(sliced, job_id)
    assert record["state"] == "DONE" and "received OK" in output(sliced, job_id)

    # A new job started from that context receives them, though nobody sends.
    async def restart():
        async with connect(sliced.dir) as gang:
            record = await gang.submit(job_cmd("netctx.py", "restored"), 2, per_node=1, network_context={0: contexts["0"], 1: contexts["1"]})
            return await gang.wait_done(record["id"])

    record = trio.run(restart)
    assert record["state"] == "DONE", record["reason"]
    assert "restored OK" in output(sliced, record["id"])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
def test_another_user_cannot_read_capture_or_suspend_a_jobs_network(sliced, tmp_path):
    job_id = submit(sliced, 2, job_cmd("netctx.py", "send", tmp_path / "never"), "--per-node", "1")

    def meddle():
        async def main():
            outcome = {}
            async with connect(sliced.dir) as gang:
                for action, call in (
                    ("net", lambda: gang.net(job_id)),
                    ("capture", lambda: gang.capture_network(job_id)),
                    ("suspend", lambda: gang.suspend(job_id)),
                ):
                    try:
                        await call()
                        outcome[action] = "allowed"
                    except RemoteError as exc:
                        outcome[action] = exc.code
            return outcome

        return trio.run(main)

    try:
        sliced.wait_state(job_id, "RUNNING")
        assert as_uid(65534, meddle) == {"net": "permission_denied", "capture": "permission_denied", "suspend": "permission_denied"}
    finally:
        sliced.gang("kill", job_id)


def test_a_stranger_cannot_inject_messages_into_a_job(sliced, tmp_path):
    """A rank's TCP listener is reachable by anyone on the network: without
    the job's token a connection is dropped and nothing reaches the rank."""
    job_id = submit(sliced, 2, job_cmd("netctx.py", "send", tmp_path / "go"), "--per-node", "1")
    try:
        deadline = time.monotonic() + 60
        while "sent" not in output(sliced, job_id):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        rank1 = next(p for p in sliced.rank_processes(job_id) if p.environ().get("GANGD_RANK") == "1")
        ports = [c.laddr for c in rank1.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert ports, "rank 1 has no TCP listener"
        import socket

        strangers = []
        for attempt in (b"\x00" * 64, os.urandom(4096)):
            s = socket.create_connection((ports[0].ip, ports[0].port), timeout=5)
            s.sendall(attempt)
            strangers.append(s)
        (tmp_path / "go").touch()  # rank 1 starts receiving: it meets the strangers
        for s in strangers:
            with s:
                s.settimeout(30)
                try:
                    assert s.recv(1) == b""  # dropped
                except ConnectionResetError:
                    pass  # dropped at its first bytes, the rest unread
        record = finished(sliced, job_id)
        assert record["state"] == "DONE" and "received OK" in output(sliced, job_id)
    finally:
        sliced.gang("kill", job_id)


def test_a_rank_that_truncates_its_counters_file_cannot_hurt_its_daemon(sliced):
    """The daemon reads each rank's counters from a file the job's owner
    controls: a truncated file must give a short answer, not a crashed
    daemon (a live mmap would die of SIGBUS)."""
    script = (
        "import os, time\n"
        "from gangd import comm\n"
        "w = comm.world()\n"
        "if w.rank == 1:\n"
        "    os.truncate(os.path.join(os.environ['GANGD_COMM_DIR'], 'rank-1.counters'), 0)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    job_id = submit(sliced, 2, [PY, "-c", script], "--per-node", "1")
    try:
        deadline = time.monotonic() + 60
        while output(sliced, job_id).count("ready") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pids = {n: sliced.daemon_pid(n) for n in ("n1", "n2")}
        net = sliced.gang_json("net", job_id)
        assert net["attached"] == [0]  # rank 1's counters are unreadable, and left out
        assert {n: sliced.daemon_pid(n) for n in ("n1", "n2")} == pids
        assert all(r["state"] == "up" for r in sliced.gang_json("nodes")["nodes"])
    finally:
        sliced.gang("kill", job_id)
