"""Findings of the security review of the merged issue-14 hardening.

Real daemons, real files (a sparse rank state the size a lying rank reports,
a real small tmpfs as the checkpoint disk, real hard links and symlinks),
the real second uid ``nobody``. What a user relies on: a rank cannot make
every restart read terabytes, nor commit a checkpoint with garbage in its
report; two restarts of one job never run it twice; ``gang net`` shows
nothing but the rank's own counters; the output directory cannot be
redirected from above; a nearly full checkpoint disk refuses the round
with the reason instead of filling up the job table's disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import trio
from ckpthelpers import checkpoint, generations, kill_what_is_left, wait_running_a_bit
from conftest import LocalCluster, _remove_cgroups, _world_traversable_tmpdir, shared_cluster, up

from gangd.client import cluster as local
from gangd.client.api import connect
from gangd.rpc import RemoteError

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
CKPTJOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
NOBODY = 65534
MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root and a second uid")

# A checkpointed program whose ranks lie in their write report: after
# writing their state they set one field of the report to what argv says
# (the size: the state file is also truncated to it, sparse, so the
# daemon's fstat agrees).
LIAR = textwrap.dedent("""
    import json, os, sys, time
    from gangd import ckptlib as ckpt
    from gangd.ckptlib import writer

    field, value = sys.argv[1], json.loads(sys.argv[2])
    honest = writer._write_now

    def lying(path, values, iteration, then, spc, *plan, **how):
        result = honest(path, values, iteration, then, spc, *plan, **how)
        if "size" in result:
            if field == "size" and value >= 0:
                os.truncate(path, value)
            result[field] = value
        return result

    writer._write_now = lying
    ckpt.init()
    state = ckpt.protect("state", {"i": 0})
    for it in ckpt.loop(range(100000)):
        state["i"] = it
        time.sleep(0.02)
""")


def _tmpdir(owner: int = 0, mode: int = 0o755) -> Path:
    path = Path(tempfile.mkdtemp(prefix="gangd-review-"))
    os.chown(path, owner, owner)
    os.chmod(path, mode)
    return path


def _liar(cluster, field: str, value: str) -> int:
    script = cluster.dir.parent / "liar.py"
    script.write_text(LIAR)
    out = cluster.gang("submit", "-n", 1, "--", PY, script, field, value, check=True).stdout
    return int(out)


@pytest.fixture(scope="module")
def one_node():
    """One node (4 cores) for the tests that submit, checkpoint and restart jobs of their own there."""
    with shared_cluster(1, cores=4) as cluster:
        yield cluster


# ---------------------------------------------------------------- 1: what a rank reports about its state


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("size", str(1 << 40), "more than the 68719476736 bytes one rank may commit (checkpoint_max_rank_bytes)"),
    ("size", "-5", "a state size that is not a byte count"),
    ("seconds", '"soon"', "a write time that is not a number of seconds"),
    ("digest", '"' + "f" * 4096 + '"', "a malformed checksum"),
])
def test_a_rank_that_lies_in_its_write_report_gets_no_checkpoint_and_says_why(one_node, field, value, reason):
    cluster = one_node
    job = _liar(cluster, field, value)
    try:
        wait_running_a_bit(cluster, job, 0.5)
        gen = checkpoint(cluster, job)
        assert gen["state"] == "aborted", gen
        assert reason in gen["reason"], gen["reason"]
        listed = [g for g in generations(cluster, job) if g["gen"] == gen["gen"]]
        assert listed and listed[0]["state"] == "aborted" and reason in listed[0]["reason"], listed
        # The job runs on, and its next honest generation is taken normally
        # (the aborted one's files, the sparse 1 TiB among them, are gone).
        assert cluster.job(job)["state"] in ("RUNNING", "SUSPENDED")
        state_dir = cluster.dir / "n1" / "state" / "checkpoints" / "n1" / f"job-{job}"
        assert not (state_dir / f"gen-{gen['gen']}").exists()
    finally:
        kill_what_is_left(cluster)


def test_two_restarts_of_one_job_at_once_start_exactly_one_job(one_node):
    cluster = one_node
    # 48 MiB of state per rank: verifying it (before each restart starts its
    # job) takes long enough for the second request to arrive meanwhile.
    job = int(cluster.gang("submit", "-n", 2, "--", PY, CKPTJOB, "--steps", 100000, "--sleep", 0.02, "--mb", 48, check=True).stdout)
    try:
        wait_running_a_bit(cluster, job, 0.5)
        gen = checkpoint(cluster, job)
        assert gen["state"] == "complete", gen
        cluster.gang("kill", job, check=True)
        cluster.wait_state(job, "KILLED")

        async def both():
            outcomes: list = []

            async def one():
                async with connect(cluster.dir) as gang:
                    await gang.info()  # connected: the two requests leave together
                    await ready.wait()
                    try:
                        outcomes.append(await gang.restart(job))
                    except RemoteError as exc:
                        outcomes.append(exc)

            ready = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                nursery.start_soon(one)
                await trio.sleep(1.0)
                ready.set()
            return outcomes

        outcomes = trio.run(both)
        started = [o["record"]["id"] for o in outcomes if isinstance(o, dict)]
        refused = [o for o in outcomes if isinstance(o, RemoteError)]
        lineage = [r for r in cluster.gang_json("ps", "--all") if r.get("lineage") == job and r["id"] != job]
        assert len(started) == 1 and len(lineage) == 1, (outcomes, lineage)
        assert len(refused) == 1 and "one job of a lineage runs at a time" in refused[0].message, refused
    finally:
        kill_what_is_left(cluster)


def test_checkpoint_verification_runs_below_the_daemons_realtime_priority():
    """The thread that checksums a rank's state runs at SCHED_OTHER, nice
    10, and the worker thread gets its priority back afterwards."""
    from gangd.daemon import checkpoint as ckpt_mod

    def where() -> tuple[int, int]:
        tid = threading.get_native_id()
        return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    async def main():
        def raise_and_check():
            tid = threading.get_native_id()
            os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(10))
            os.setpriority(os.PRIO_PROCESS, tid, -10)
            inside = ckpt_mod._at_low_priority(where)
            after = where()
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0)
            return inside, after

        return await trio.to_thread.run_sync(raise_and_check)

    inside, after = trio.run(main)
    assert inside == (os.SCHED_OTHER, 10)
    assert after == (os.SCHED_RR, -10)


# ---------------------------------------------------------------- 2: the counters file `gang net` reads


def test_a_counters_file_that_is_a_hard_link_to_roots_file_is_refused():
    from gangd.daemon.jobnet import JobNet
    from gangd.daemon.tasks import Tasks

    base = _tmpdir()
    try:
        runtime = base / "runtime"
        secret = base / "secret-of-roots"
        secret.write_bytes(b"root's secret bytes " * 8)
        os.chmod(secret, 0o600)
        net = JobNet(node="n1", address="127.0.0.1", runtime_dir=runtime, table=None, ranks=None, tasks=Tasks(), call=None, on_job_gone=None)
        net.open_runtime()
        try:
            job_dir = runtime / "job-7"
            job_dir.mkdir(mode=0o700)
            os.chown(job_dir, NOBODY, NOBODY)
            record = {"id": 7, "owner_uid": NOBODY, "owner_gid": NOBODY, "nranks": 1}
            # Where fs.protected_hardlinks=0 the job's owner could make this link; root makes it here.
            os.link(secret, job_dir / "rank-0.counters")
            with pytest.raises(RemoteError) as refused:
                net._open_counters(record, 0)
            assert "is not a counters file of job 7" in refused.value.message
            # The owner's own file with no other name is what it takes.
            os.unlink(job_dir / "rank-0.counters")
            own = job_dir / "rank-0.counters"
            own.write_bytes(bytes(24))
            os.chown(own, NOBODY, NOBODY)
            os.close(net._open_counters(record, 0))
            # ...and the owner's file with a second name (in reach of others) is not.
            os.link(own, job_dir / "elsewhere")
            with pytest.raises(RemoteError):
                net._open_counters(record, 0)
        finally:
            net.close_runtime()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- 3: the output directory


@pytest.mark.parametrize("how", ["user-owned-parent", "symlinked-parent"])
def test_an_output_dir_below_a_directory_root_cannot_trust_is_refused_at_start(how):
    base = _tmpdir()
    if how == "user-owned-parent":
        theirs = base / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, NOBODY, NOBODY)
        output_dir, expected = theirs / "output", f"belongs to uid {NOBODY}"
    else:
        (base / "real").mkdir(mode=0o755)
        os.symlink(base / "real", base / "alias")
        output_dir, expected = base / "alias" / "output", "is a symbolic link"
    try:
        with pytest.raises(local.ClusterError) as refused:
            up(base / "cluster", 1, cores=2, output_dir=output_dir, timeout=15)
        message = str(refused.value)
        assert "refusing the output directory (output_dir)" in message and expected in message, message
    finally:
        local.down(base / "cluster")
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- 6: a nearly full checkpoint disk


def test_a_checkpoint_on_a_nearly_full_checkpoint_disk_is_refused_with_the_reason():
    directory = _world_traversable_tmpdir() / "cluster"
    disk = directory.parent / "ckpt"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs", str(disk)], check=True)
    try:
        up(directory, 1, cores=2, checkpoint_dir=disk)
        cluster = LocalCluster(directory, 1)
        try:
            job = int(cluster.gang("submit", "-n", 1, "--", PY, CKPTJOB, "--steps", 100000, "--sleep", 0.02, check=True).stdout)
            wait_running_a_bit(cluster, job, 0.5)
            filler = disk / "filler"
            with open(filler, "wb") as out:  # leaves ~3 MiB: below the reserve (a quarter of a small disk)
                out.write(b"\0" * (13 * MiB))
            gen = checkpoint(cluster, job)
            assert gen["state"] == "aborted", gen
            assert "the checkpoint disk" in gen["reason"] and "keeps free" in gen["reason"], gen["reason"]
            listed = [g for g in generations(cluster, job) if g["gen"] == gen["gen"]]
            assert listed and "keeps free" in listed[0]["reason"], listed
            filler.unlink()
            again = checkpoint(cluster, job)
            assert again["state"] == "complete", again
        finally:
            kill_what_is_left(cluster)
    finally:
        local.down(directory)
        if (directory / "n1").exists():
            _remove_cgroups(LocalCluster(directory, 1))
        subprocess.run(["umount", str(disk)], check=False)
        shutil.rmtree(directory.parent, ignore_errors=True)


# ---------------------------------------------------------------- 5: user lookups at launch


def test_the_owners_identity_is_looked_up_off_the_event_loop_and_cached():
    from gangd.daemon.ranks import Identities, LaunchError, _identity

    calls: list[int] = []

    def lookup(uid: int, gid: int):
        calls.append(threading.get_ident())
        return _identity(uid, gid)

    async def main():
        ids = Identities(lookup)
        first = await ids.get(NOBODY, NOBODY)
        again = await ids.get(NOBODY, NOBODY)
        hung = Identities(lambda uid, gid: time.sleep(3))
        hung.TIMEOUT = 0.2
        with pytest.raises(LaunchError, match=r"took over 0\.2 s"):
            await hung.get(NOBODY, NOBODY)
        return first, again

    first, again = trio.run(main)
    assert first == again and first[0]["USER"] == "nobody"
    assert len(calls) == 1 and calls[0] != threading.get_ident()  # once, in a worker thread
