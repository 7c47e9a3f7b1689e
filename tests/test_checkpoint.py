"""Consistent checkpoints and restarts on a real cluster (paper 000's Fig. 1 and 2).

Real daemons on 127.0.0.x, real ranks exchanging real messages, real
SIGQUIT handlers, real files fsynced on each node's disk. The contract a user
relies on: a job checkpointed, killed and restarted prints exactly what an
uninterrupted run prints — also with messages in flight across the cut, also
when the checkpoint was taken while the job was gang-suspended — whatever
triggered the checkpoint; and when anything goes wrong (a rank or a daemon
dying mid-checkpoint, a damaged file, a full disk, a stranger) the error
says what and where, and the previous checkpoint stays usable.

One 2-node cluster with 2 cores per node is shared: a 4-rank job fills it,
so two such jobs are gang-scheduled in two slots (0.1 s slices).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from ckpthelpers import (
    TERMINAL,
    USABLE,
    checkpoint,
    gen_dir,
    generations,
    hold,
    kill_and_restart,
    kill_what_is_left,
    reference,
    result_of,
    settled,
    submit,
    wait_generations,
    wait_holding,
    wait_running_a_bit,
)
from conftest import as_uid, shared_cluster, tmpfs, wait_for

from gangd import ckptstore
from gangd.client.api import connect
from gangd.rpc import RemoteError

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
EXAMPLES = ROOT / "examples"
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second uid, mounting a tmpfs)")


@pytest.fixture(scope="module")
def gc():
    with shared_cluster(2, cores=2, time_slice=0.1, max_slots=2) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _leave_it_empty(gc):
    yield
    kill_what_is_left(gc)


# ---------------------------------------------------------------- bit-identical restarts

APPS = {
    "ring": [str(EXAMPLES / "ring.py"), "--steps", "300", "--size", "2048"],
    "heat": [str(EXAMPLES / "heat.py"), "--steps", "300", "--n", "128"],
    "alltoall": [str(EXAMPLES / "alltoall.py"), "--steps", "200"],
}


@pytest.mark.parametrize("app", sorted(APPS))
def test_checkpoint_kill_restart_is_bit_identical(gc, app):
    argv = APPS[app]
    expected = reference(gc, argv)
    # 200 steps of 30 ms: room for the checkpoint to land mid-run on a loaded machine, where starting the CLI alone takes a second
    job = submit(gc, [*argv, "--sleep", "0.03"])
    wait_running_a_bit(gc, job)
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    assert 0 < gen["iteration"] < 300
    assert set(gen["nodes"]) == {"n1", "n2"}
    settled(gc, job)  # (the partner copy is written behind the job: its temporary files come and go until then)
    for node, stats in gen["nodes"].items():
        assert stats["bytes"] > 0 and stats["ranks"] == 2
        directory = gen_dir(gc, node, job, gen["gen"])
        assert ckptstore.verify(directory) == []
        for path in directory.rglob("*"):  # files: the owner's alone; directories: not listable by others
            assert path.stat().st_mode & (0o077 if path.is_file() else 0o066) == 0, f"{path} is open to others"
    restarted = kill_and_restart(gc, job)
    assert result_of(gc, restarted) == expected
    record = gc.job(restarted)
    assert record["restart_of"] == {"job": job, "gen": gen["gen"], "iteration": gen["iteration"]}


def test_messages_in_flight_across_the_cut_are_delivered_after_restart(gc):
    """ckptjob receives in iteration k what its neighbour sent in k-1: at the
    cut every rank has one message in the network, saved by the daemons."""
    expected = reference(gc, [JOB, "--steps", "600"])
    held, release = hold(gc, 300)  # (the cut lands mid-run, however loaded the machine)
    job = submit(gc, [JOB, "--steps", "600", *held])
    wait_holding(gc, job)
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    contexts = [p for node in ("n1", "n2") for p in gen_dir(gc, node, job, gen["gen"]).glob("net-*.ctx")]
    assert len(contexts) == 4
    release.touch()
    restarted = kill_and_restart(gc, job)
    assert result_of(gc, restarted) == expected
    starts = [line for line in gc.gang("logs", restarted).stdout.splitlines() if "ran from iteration" in line]
    assert len(starts) == 4 and all(line.endswith(f"ran from iteration {gen['iteration']}") for line in starts), starts


def test_checkpoint_of_a_suspended_job_while_the_other_runs(gc):
    expected = reference(gc, [JOB, "--steps", "150"])
    held, release = hold(gc, 75)
    job = submit(gc, [JOB, "--steps", "150", *held])
    other = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01"])
    wait_holding(gc, job)
    gc.gang("suspend", job, check=True)
    assert gc.job(job)["state"] == "SUSPENDED"
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    # Still held afterwards; the other job was never stopped for it.
    assert gc.job(job)["state"] == "SUSPENDED" and gc.job(job)["held"]
    assert gc.job(other)["state"] in ("RUNNING", "SUSPENDED")
    release.touch()
    restarted = kill_and_restart(gc, job)
    assert result_of(gc, restarted, timeout=90) == expected
    gc.gang("kill", other)


def test_restart_continues_the_lineage_and_keeps_two_generations(gc):
    expected = reference(gc, [JOB, "--steps", "300"])
    held, release = hold(gc, 150)  # (three checkpoints and two restarts before its end, however loaded the machine)
    # Whole files: two generations kept is retention without chains (with them: tests/test_delta_cluster.py).
    job = submit(gc, [JOB, "--steps", "300", *held], 4, "--ckpt-mode", "full")
    wait_holding(gc, job)
    first = checkpoint(gc, job)
    restarted = kill_and_restart(gc, job)
    wait_holding(gc, restarted)  # (restarted in the hold, it holds again: past its first iteration now)
    second = checkpoint(gc, restarted)
    third = checkpoint(gc, restarted)
    assert [first["gen"], second["gen"], third["gen"]] == [1, 2, 3]
    assert first["iteration"] < second["iteration"] < third["iteration"]
    states = {g["gen"]: g["state"] for g in settled(gc, job)}
    assert states == {1: "removed", 2: "protected", 3: "protected"}  # the lineage, seen from the first job too (2 nodes: partner)
    assert not gen_dir(gc, "n1", job, 1).exists() and gen_dir(gc, "n1", job, 2).exists()
    release.touch()
    again = kill_and_restart(gc, restarted)
    assert result_of(gc, again) == expected


def test_a_checkpoint_right_after_a_restart_cuts_where_the_ranks_resume(gc):
    """Restarted ranks not yet back in their loop report the iteration they
    will resume at, not 0: the cut is the restart's own iteration."""
    argv = [JOB, "--steps", "100000", "--sleep", "0.01", "--pre-sleep", "2"]
    job = submit(gc, argv)
    wait_running_a_bit(gc, job, 3.0)
    first = checkpoint(gc, job)
    deadline = time.monotonic() + 60
    while first["state"] == "complete" and first["iteration"] == 0 and time.monotonic() < deadline:
        # (a loaded machine: the ranks are still before their loop -- a generation past its start is what this needs)
        time.sleep(0.5)
        first = checkpoint(gc, job)
    assert first["state"] == "complete" and first["iteration"] > 0, first
    restarted = kill_and_restart(gc, job)
    gc.wait_state(restarted, ("RUNNING", "SUSPENDED"))
    time.sleep(1.0)  # state loaded, still sleeping before the loop
    again = checkpoint(gc, restarted)
    assert again["state"] == "complete" and again["iteration"] == first["iteration"], again


def test_before_the_loop_a_rank_reports_its_first_iteration(gc):
    job = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01", "--pre-sleep", "3"])
    gc.wait_state(job, ("RUNNING", "SUSPENDED"))
    time.sleep(1.0)  # ckpt.init() done, the loop not started
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete" and gen["iteration"] == 0, gen


def test_ranks_in_a_long_c_call_still_agree_at_once(gc):
    """A long C call (here BLAS, which releases the GIL) keeps the Python
    SIGQUIT handler from running; the daemon's note reaches the rank's thread anyway:
    the ranks agree on the cut (every rank reported) while a rank is still inside the
    call it was in when the checkpoint began. Were the note left to the handler, each
    rank would report only after its call returned, and no call could span the agreement.
    (An order of events, with the job's own clock readings: a bound in seconds failed under load.)"""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    argv = [PY, JOB, "--steps", "100000", "--c-call", "3000", "--c-call-times"]  # >= 1.5 s per product
    job = int(gc.gang("submit", "-n", 4, "--", *argv, env=env, check=True).stdout)
    # Every rank inside a product (it printed the product's start): the checkpoint begins while they compute.
    wait_for(lambda: {int(r) for r in re.findall(r"c-call-begin (\d+) ", gc.logs(job))} == set(range(4)) or None, 60,
             "every rank inside a product")
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    start, agreed = gen["marks"]["start"], gen["marks"]["agreed"]  # (the coordinator's time.time(), on this machine)

    def calls():
        """Each rank's products as (rank, start, end), once every rank has printed one that ended after the agreement."""
        found = [(int(r), float(t0), float(t1)) for r, t0, t1 in re.findall(r"c-call (\d+) (\S+) (\S+)\n", gc.logs(job))]
        return found if {r for r, _, t1 in found if t1 >= agreed} == set(range(4)) else None

    found = wait_for(calls, 60, "every rank's product after the agreement")
    spanning = [(r, t0, t1) for r, t0, t1 in found if t0 <= start and agreed <= t1]
    assert spanning, f"no rank was inside one product from the checkpoint's start ({start}) to the agreement ({agreed}): {found[-12:]}"


def test_ckpt_request_in_a_rank_checkpoints_the_whole_job(gc):
    job = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01", "--request-at", "30"])
    gen = wait_generations(gc, job, 1)[0]
    assert "rank 0" in gen["trigger"] and gen["iteration"] > 30


# ---------------------------------------------------------------- triggers


def test_ctrl_backslash_on_gang_run_checkpoints_the_job(gc):
    import pty

    master, slave = pty.openpty()
    held, release = hold(gc, 150)
    cmd = [PY, "-m", "gangd.client.cli", "--cluster", str(gc.dir), "run", "-n", "4", "--", PY, JOB, "--steps", "300", *held]
    # The pty must become gang run's controlling terminal, which only the child can do (no Popen option for it).
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, preexec_fn=lambda: os.login_tty(slave), close_fds=True)  # noqa: PLW1509 -- see above
    os.close(slave)
    output = b""
    try:
        deadline = time.monotonic() + 30
        job = None
        while job is None and time.monotonic() < deadline:
            running = [r for r in gc.gang_json("ps") if r["state"] in ("RUNNING", "SUSPENDED")]
            job = running[0]["id"] if running else None
            time.sleep(0.1)
        assert job is not None, "gang run's job did not start"
        wait_holding(gc, job)  # (every rank takes checkpoints now)
        os.write(master, b"\x1c")  # Ctrl-\ : the terminal sends SIGQUIT to gang run
        while b"complete" not in output and time.monotonic() < deadline:
            try:
                output += os.read(master, 4096)
            except OSError:
                break
        assert b"checkpoint generation 1 complete" in output, output.decode(errors="replace")
        release.touch()
        assert proc.wait(timeout=60) == 0  # gang run survived its SIGQUIT, the job finished
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    gen = generations(gc, job)
    assert gen[0]["state"] in USABLE and "Ctrl-\\" in gen[0]["trigger"]


def test_sigusr1_to_any_daemon_checkpoints_every_running_job(gc):
    # A job whose ranks take no checkpoints comes first: the others are
    # checkpointed all the same. Each checkpointing job holds once its ranks
    # have called ckpt.init() (a fixed wait after RUNNING was not always
    # enough in CI, and such a checkpoint is refused, leaving no generation).
    plain = int(gc.gang("submit", "-n", 1, "--", "sleep", "300", check=True).stdout)
    held, release = hold(gc, 50)
    first = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01", *held], 2)
    second = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01", *held], 2)
    wait_running_a_bit(gc, plain, 0)
    wait_holding(gc, first)
    wait_holding(gc, second)
    try:
        os.kill(gc.daemon_pid("n2"), signal.SIGUSR1)
        for job in (first, second):
            gen = wait_generations(gc, job, 1)[0]
            assert "SIGUSR1" in gen["trigger"] and "n2" in gen["trigger"]
    finally:
        release.touch()
        gc.gang("kill", plain)


def test_periodic_checkpoints_with_ckpt_every(gc):
    # (whole files: two kept on disk is retention without chains, tests/test_delta_cluster.py has them)
    job = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01"], 4, "--ckpt-every", "1s", "--ckpt-mode", "full")
    deadline = time.monotonic() + 40
    while len(taken := [g for g in generations(gc, job) if g["state"] in (*USABLE, "removed")]) < 3:
        assert time.monotonic() < deadline, generations(gc, job)
        time.sleep(0.2)
    gc.gang("kill", job, check=True)
    taken = [g for g in settled(gc, job) if g["state"] in (*USABLE, "removed")]
    assert all("every 1 s" in g["trigger"] for g in taken)
    iterations = [g["iteration"] for g in taken]
    assert iterations == sorted(iterations) and len(set(iterations)) == len(iterations)
    # Older generations are removed once a newer one is complete: two are kept, on disk too.
    complete = [g["gen"] for g in taken if g["state"] in USABLE]
    assert complete == [taken[-2]["gen"], taken[-1]["gen"]]
    for node in ("n1", "n2"):
        assert ckptstore.generations(gc.dir / node / "state" / "checkpoints" / node, job) == complete


# ---------------------------------------------------------------- failures


def test_a_rank_killed_mid_checkpoint_aborts_that_generation_only(gc):
    # Rank 3 becomes slow after iteration 150: the checkpoint waits for it to
    # reach the cut, and it is killed meanwhile.
    # The good checkpoint is taken while the job idles at step 100 (however
    # loaded the machine), so it lands before rank 3 turns slow.
    held, release = hold(gc, 100)
    argv = [JOB, "--steps", "100000", "--sleep", "0.01", "--slow-rank", "3", "--slow-from", "150", "--slow-sleep", "5", *held]
    job = submit(gc, argv)
    wait_holding(gc, job)
    good = checkpoint(gc, job)  # (at step 100; its iteration counts the hold's idle iterations too)
    assert good["state"] == "complete", good
    release.touch()

    async def start_checkpoint():
        async with connect(gc.dir) as gang:
            return await gang.checkpoint(job, wait=False)

    deadline = time.monotonic() + 30
    while "slow from now on" not in gc.logs(job):  # rank 3 sleeps 5 s per iteration now
        assert time.monotonic() < deadline
        time.sleep(0.1)
    started = trio.run(start_checkpoint)
    time.sleep(0.5)
    victim = [p for p in gc.rank_processes(job) if p.environ().get("GANGD_RANK") == "3"]
    victim[0].kill()
    deadline = time.monotonic() + 20
    while (entry := next((g for g in generations(gc, job) if g["gen"] == started["gen"]), None)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert entry["state"] == "aborted" and "rank 3" in entry["reason"], entry
    assert gc.wait_state(job, TERMINAL)["state"] == "FAILED"
    for node in ("n1", "n2"):  # (a rank still writing when the abort came may finish first: its files go with the abort)
        wait_for(lambda node=node: not gen_dir(gc, node, job, started["gen"]).exists(), 30, f"the aborted generation's files on {node} to go")
        assert ckptstore.verify(gen_dir(gc, node, job, good["gen"])) == []
    assert "aborted" in gc.log("n1") + gc.log("n2")


def test_corrupted_or_truncated_files_fall_back_to_an_older_generation(gc):
    expected = reference(gc, [JOB, "--steps", "300"])
    held, release = hold(gc, 150)
    job = submit(gc, [JOB, "--steps", "300", *held])
    wait_holding(gc, job)
    older = checkpoint(gc, job)
    newer = checkpoint(gc, job)
    assert older["state"] == newer["state"] == "complete"
    gc.gang("kill", job, check=True)
    release.touch()
    victim = gen_dir(gc, "n2", job, newer["gen"]) / ckptstore.cluster_rank_file(3)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(data)
    # The default: the newest intact one, saying what was skipped, by node and path.
    result = gc.gang("restart", job, "--json", check=True)
    answer = json.loads(result.stdout)
    assert answer["gen"] == older["gen"]
    assert any(str(victim) in s and "n2" in s and "corrupted" in s for s in answer["skipped"]), answer["skipped"]
    assert result_of(gc, answer["record"]["id"]) == expected
    # Asking for the damaged one explicitly: refused, with the reason.
    refused = gc.gang("restart", job, "-g", newer["gen"])
    assert refused.returncode != 0 and "damaged" in refused.stderr and str(victim) in refused.stderr
    # Truncated: same story.
    job2 = answer["record"]["id"]
    assert ckptstore.verify(gen_dir(gc, "n1", job, older["gen"])) == []
    victim = gen_dir(gc, "n1", job, older["gen"]) / ckptstore.cluster_rank_file(0)
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1)
    refused = gc.gang("restart", job2, "-g", older["gen"])
    assert refused.returncode != 0 and "truncated" in refused.stderr and str(victim) in refused.stderr


@root_only
def test_a_full_disk_fails_the_checkpoint_and_the_job_runs_on(gc):
    directory = gc.dir / "n2" / "state" / "checkpoints" / "n2"  # (each node its own, see checkpoint_dir)
    with tmpfs(directory, "1m", "0711"):
        expected = reference(gc, [JOB, "--steps", "250", "--mb", "2"])
        held, release = hold(gc, 125)
        job = submit(gc, [JOB, "--steps", "250", "--mb", "2", *held])
        wait_holding(gc, job)
        gen = checkpoint(gc, job)
        assert gen["state"] == "aborted", gen
        assert "no space left on device" in gen["reason"] and "n2" in gen["reason"], gen["reason"]
        release.touch()
        assert result_of(gc, job) == expected
        assert list(directory.iterdir()) == [] or all(not any(p.iterdir()) for p in directory.iterdir())


@root_only
def test_strangers_can_neither_checkpoint_nor_restart_a_job(gc):
    held, _release = hold(gc, 200)  # (never released: the test kills it)
    job = submit(gc, [JOB, "--steps", "400", *held])
    wait_holding(gc, job)

    def attempt(op):
        def go():
            async def main():
                async with connect(gc.dir) as gang:
                    try:
                        await getattr(gang, op)(job)
                    except RemoteError as exc:
                        return {"code": exc.code, "message": exc.message}
                    return {"code": None}

            return trio.run(main)

        return go

    assert as_uid(NOBODY, attempt("checkpoint"))["code"] == "permission_denied"
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete"
    gc.gang("kill", job, check=True)
    answer = as_uid(NOBODY, attempt("restart"))
    assert answer["code"] == "permission_denied" and "root" in answer["message"]


def test_checkpoint_of_a_job_without_ckptlib_is_refused_and_harmless(gc):
    job = int(gc.gang("submit", "-n", 2, "--", "sleep", "30", check=True).stdout)
    gc.wait_state(job, ("RUNNING", "SUSPENDED"))
    result = gc.gang("checkpoint", job)
    assert result.returncode != 0 and "ckptlib" in result.stderr
    assert gc.job(job)["state"] in ("RUNNING", "SUSPENDED")  # no SIGQUIT reached it
    assert generations(gc, job) == []


def test_restart_refusals_are_specific(gc):
    running = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01"])
    gc.wait_state(running, ("RUNNING", "SUSPENDED"))
    result = gc.gang("restart", running)
    assert result.returncode != 0 and "kill it first" in result.stderr
    gc.gang("kill", running, check=True)
    result = gc.gang("restart", running)
    assert result.returncode != 0 and "no complete checkpoint" in result.stderr
    result = gc.gang("restart", 9999)
    assert result.returncode == 5
    # One job of a lineage at a time.
    job = submit(gc, [JOB, "--steps", "100000", "--sleep", "0.01"])
    wait_running_a_bit(gc, job, 0.3)
    assert checkpoint(gc, job)["state"] == "complete"
    gc.gang("kill", job, check=True)
    first = json.loads(gc.gang("restart", job, "--json", check=True).stdout)["record"]["id"]
    second = gc.gang("restart", job)
    assert second.returncode != 0 and f"job {first}" in second.stderr and "one job of a lineage" in second.stderr


def test_a_daemon_killed_mid_write_leaves_nothing_that_looks_complete(make_cluster):
    cluster = make_cluster(2, cores=2)
    env = dict(os.environ, GANGD_CKPT_BACKGROUND="0")  # ranks write while the checkpoint is under way
    argv = [JOB, "--steps", "100000", "--sleep", "0.02", "--mb", "48"]
    job = int(cluster.gang("submit", "-n", 4, "--", PY, *argv, env=env, check=True).stdout)
    wait_running_a_bit(cluster, job, 0.5)
    first = checkpoint(cluster, job)
    assert first["state"] == "complete", first

    async def start_checkpoint():
        async with connect(cluster.dir) as gang:
            return await gang.checkpoint(job, wait=False)

    second = trio.run(start_checkpoint)["gen"]
    # Kill n2's daemon as soon as its ranks are writing their state.
    writing = gen_dir(cluster, "n2", job, second) / ckptstore.RANKS_DIR
    deadline = time.monotonic() + 20
    while not (writing.is_dir() and any(name.endswith(".tmp") for name in os.listdir(writing))):
        assert time.monotonic() < deadline, "the ranks on n2 never started writing"
        time.sleep(0.001)
    cluster.kill_node("n2")
    record = cluster.wait_state(job, TERMINAL, timeout=30)
    assert record["state"] == "FAILED"
    deadline = time.monotonic() + 20
    while not [g for g in generations(cluster, job) if g["gen"] == second]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    entry = next(g for g in generations(cluster, job) if g["gen"] == second)
    assert entry["state"] == "aborted" and "n2" in entry["reason"], entry
    # Whatever n2 left of generation 2 was never committed.
    assert not (gen_dir(cluster, "n2", job, second) / ckptstore.MANIFEST).exists()
    cluster.start_daemon("n2")
    deadline = time.monotonic() + 30
    while cluster.node_states().get("n2") != "up":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    answer = json.loads(cluster.gang("restart", job, "--json", check=True).stdout)
    assert answer["gen"] == first["gen"] and answer["skipped"] == []
    restarted = answer["record"]["id"]
    wait_running_a_bit(cluster, restarted, 0.5)
    # Taken again while it cuts where the ranks resume (48 MiB each to load: not back in their loop yet).
    deadline = time.monotonic() + 60
    while (third := checkpoint(cluster, restarted))["state"] == "complete" and third["iteration"] == first["iteration"]:
        assert time.monotonic() < deadline, third
        time.sleep(0.2)
    assert third["state"] == "complete" and third["iteration"] > first["iteration"], third
    cluster.gang("kill", restarted, check=True)


def test_a_restart_whose_ranks_never_load_their_state_fails_instead_of_hanging(make_cluster):
    cluster = make_cluster(2, cores=2, checkpoint_timeout=3.0)
    script = cluster.dir.parent / "switch.py"
    # The first run checkpoints; the restarted run (same command) finds the
    # flag file and skips ckpt.init(): its gates would stay closed forever.
    script.write_text(
        "import os, sys, time\n"
        "flag = sys.argv[1]\n"
        "if os.path.exists(flag):\n"
        "    time.sleep(60)\n"
        "    sys.exit(0)\n"
        "from gangd import ckptlib as ckpt\n"
        "ckpt.init()\n"
        "for it in ckpt.loop(range(100000)):\n"
        "    time.sleep(0.01)\n"
    )
    flag = cluster.dir.parent / "restarted"
    job = int(cluster.gang("submit", "-n", 2, "--", PY, script, flag, check=True).stdout)
    wait_running_a_bit(cluster, job, 1.0)
    assert checkpoint(cluster, job)["state"] == "complete"
    cluster.gang("kill", job, check=True)
    flag.write_text("")
    restarted = json.loads(cluster.gang("restart", job, "--json", check=True).stdout)["record"]["id"]
    record = cluster.wait_state(restarted, TERMINAL, timeout=30)
    assert record["state"] == "FAILED" and "did not load their checkpoint" in record["reason"] and "ckptlib.init()" in record["reason"]
