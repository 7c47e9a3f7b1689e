"""Checkpoints of real MPI programs at a collective call (paper 001's user-level model).

mpi4py over MPICH, gangd as the process manager, ranks on two "nodes" that
talk TCP. What a user relies on: a job checkpointed at ``checkpoint(comm)``,
killed and restarted (fresh MPI, each rank loading its own file) prints what
an uninterrupted run prints, whatever triggered the checkpoint; a program
that keeps a message in flight across the call is refused with that
message's source and tag and the rule it breaks; the calls are checked to be
collective.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpthelpers import (
    TERMINAL,
    USABLE,
    checkpoint,
    generations,
    kill_and_restart,
    kill_what_is_left,
    reference,
    result_of,
    submit,
    wait_generations,
)
from conftest import shared_cluster

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
HEAT = str(ROOT / "examples" / "mpi_heat.py")
ACROSS_THE_CALL = str(ROOT / "tests" / "jobs" / "mpi_across_the_call.py")
OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
ACROSS = ("--mpi", "-N", "2")  # 4 ranks, 2 per node: MPI's messages cross "nodes" over TCP
STENCIL = [HEAT, "--steps", "200", "--n", "96"]


@pytest.fixture(scope="module")
def mc():
    with shared_cluster(2, cores=2, time_slice=0.1, max_slots=2) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _leave_it_empty(mc):
    yield
    kill_what_is_left(mc)


def tcp():
    return dict(os.environ, **OVER_TCP)


def expected(mc) -> str:
    return reference(mc, STENCIL, 4, *ACROSS, env=tcp())


def output(mc, job: int) -> str:
    printed = mc.gang("logs", job, check=True)
    return printed.stdout + printed.stderr


QUIT_BIT = 1 << (signal.SIGQUIT - 1)


def wait_step(mc, job: int, seconds: float = 1.0, nranks: int = 4) -> None:
    """Until every rank has called ckpt.init() (its SIGQUIT handler is in:
    before it, SIGQUIT kills and `gang checkpoint` is refused), then ``seconds`` more."""
    mc.wait_state(job, ("RUNNING", "SUSPENDED"), timeout=30)
    deadline = time.monotonic() + 60
    while len([p for p in ranks_of(mc, job) if _catches_sigquit(p.pid)]) < nranks:
        assert time.monotonic() < deadline, f"job {job}: not every rank called ckpt.init() within 60 s"
        time.sleep(0.05)
    time.sleep(seconds)


def ranks_of(mc, job: int):
    """The ranks' Python processes (not the shells or forks around them)."""
    return [p for p in mc.rank_processes(job) if any(part.endswith(".py") for part in p.cmdline()[1:2])]


def _catches_sigquit(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return False
    return bool(int(fields["SigCgt"], 16) & QUIT_BIT)


def test_mpi_stencil_checkpoint_kill_restart_is_bit_identical(mc):
    want = expected(mc)
    job = submit(mc, [*STENCIL, "--sleep", "0.02"], 4, *ACROSS, env=tcp())
    wait_step(mc, job)
    gen = checkpoint(mc, job)
    assert gen["state"] == "complete", gen
    assert 0 < gen["iteration"] < 199  # the checkpoint(comm) call it was saved at (counted from 0)
    assert {node: stats["ranks"] for node, stats in gen["nodes"].items()} == {"n1": 2, "n2": 2}
    restarted = kill_and_restart(mc, job)
    assert result_of(mc, restarted, timeout=120) == want
    record = mc.job(restarted)
    assert record["restart_of"]["iteration"] == gen["iteration"]  # (and its RESULT says ranks=4: one MPI world again)


def test_a_ranks_sigquit_is_honoured_at_the_next_call_by_every_rank(mc):
    want = expected(mc)
    job = submit(mc, [*STENCIL, "--sleep", "0.02"], 4, *ACROSS, env=tcp())
    wait_step(mc, job)
    rank2 = next(p for p in ranks_of(mc, job) if p.environ().get("GANGD_RANK") == "2")
    os.kill(rank2.pid, signal.SIGQUIT)
    [gen] = wait_generations(mc, job, 1)
    assert "SIGQUIT" in gen["trigger"] and "rank 2" in gen["trigger"]
    restarted = kill_and_restart(mc, job)
    assert result_of(mc, restarted, timeout=120) == want


def test_forced_checkpoints_land_on_the_same_call_and_a_restart_goes_on_after_it(mc):
    """``force=True`` every 50 steps: generations at calls 49, 99, ...; a
    restart from the call-99 one continues with step 100 and a checkpoint
    right after it cuts at a later call, never at one already done."""
    want = expected(mc)
    job = submit(mc, [*STENCIL, "--sleep", "0.03", "--every", "50"], 4, *ACROSS, env=tcp())
    complete = wait_generations(mc, job, 2, timeout=60)
    assert [g["iteration"] for g in complete[:2]] == [49, 99]
    restarted = kill_and_restart(mc, job, "-g", complete[1]["gen"])
    assert mc.job(restarted)["restart_of"]["iteration"] == 99
    wait_step(mc, restarted, 0.3)
    gen = checkpoint(mc, restarted)  # (100 steps of 30 ms left: it is still running)
    assert gen["state"] == "complete" and gen["iteration"] > 99, gen
    assert result_of(mc, restarted, timeout=120) == want


def test_back_to_back_forced_checkpoints_each_get_saved(mc):
    """force=True at every call: each request comes while the previous
    generation is still being committed, and must not be lost (the rank would wait forever)."""
    argv = [HEAT, "--steps", "12", "--n", "64"]
    want = reference(mc, argv, 4, *ACROSS, env=tcp())
    job = submit(mc, [*argv, "--every", "1"], 4, *ACROSS, env=tcp())
    assert result_of(mc, job, timeout=120) == want
    # The last one too: the ranks end right after it, while their snapshots
    # are written; their exit must not abort what they finished writing (its
    # commit, the daemons' part, may finish just after the job).
    deadline = time.monotonic() + 15
    while True:
        gens = generations(mc, job)
        if any(g["iteration"] == 11 and g["state"] in USABLE for g in gens):
            break
        assert time.monotonic() < deadline, [(g["gen"], g["state"], g["iteration"], g.get("reason")) for g in gens[-3:]]
        time.sleep(0.2)
    assert all(0 <= g["iteration"] <= 11 for g in gens if g["state"] in USABLE), gens


def test_a_refused_checkpoint_can_be_caught_and_the_next_one_works(mc):
    """The markers of a refused checkpoint are consumed and the early message stays queued."""
    run = mc.gang("run", "--mpi", "-n", 2, "-N", 2, "--", PY, ACROSS_THE_CALL, "catch", env=tcp(), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "1: refused: checkpoint(comm) call 0: a message from rank 0 (tag 44," in out, out
    assert "1: then received 'early'" in out
    saved = {line.split()[-1] for line in out.splitlines() if "saved generation" in line}
    assert len(saved) == 1 and saved != {"None"}, out  # both ranks saved the same generation


def test_a_message_in_flight_across_the_call_is_refused_with_its_source_tag_and_the_rule(mc):
    job = submit(mc, [*STENCIL, "--wrong", "--every", "5"], 4, *ACROSS, env=tcp())
    record = mc.wait_state(job, TERMINAL, timeout=60)
    logs = output(mc, job)
    assert record["state"] == "FAILED", record
    # Every rank has the message its left neighbour sent before the call (tag 7, a pickled int).
    assert "a message from rank 3 (tag 7," in logs and "is in flight to rank 0" in logs, logs
    assert "A send and its matching receive must both come before checkpoint() or both after it" in logs
    assert [g for g in generations(mc, job) if g["state"] in USABLE] == []


@pytest.mark.parametrize(("mode", "says"), [
    ("recv", "rank 0 has waited 1 s in checkpoint(comm) call 0 for the other ranks. A rank blocked"),
    ("big-send", "rank 1 has waited 1 s in checkpoint(comm) call 0 for the other ranks. A message from rank 0 (tag 42, 8388608 bytes) waits here"),
])
def test_a_deadlock_across_the_call_is_explained(mc, mode, says):
    """A receive before the call whose send comes after it (or the other way
    round) deadlocks the program in the call; the waiting rank says why."""
    env = dict(tcp(), GANGD_CKPT_MPI_WARN="1")
    job = submit(mc, [ACROSS_THE_CALL, mode], 2, *ACROSS, env=env)
    deadline = time.monotonic() + 30
    while says not in (text := output(mc, job)):
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert "a send and its matching receive must both come before checkpoint() or both after it" in text
    assert mc.job(job)["state"] == "RUNNING"  # (waiting: a slow rank is no error)


def test_checkpoint_comm_needs_every_rank_of_the_job(mc):
    """Without --mpi each rank is its own one-rank MPI world: refused, saying what to do."""
    job = submit(mc, [HEAT, "--steps", "5", "--every", "2"], 2)
    record = mc.wait_state(job, TERMINAL, timeout=60)
    logs = output(mc, job)
    assert record["state"] == "FAILED"
    assert "needs a communicator with every rank of the job (2), this one has 1: run the job with `gang run --mpi`" in logs, logs


def test_an_mpi_job_survives_a_long_suspension(mc):
    want = expected(mc)
    job = submit(mc, [*STENCIL, "--sleep", "0.01"], 4, *ACROSS, env=tcp())
    wait_step(mc, job, 0.5)
    mc.gang("suspend", job, check=True)
    time.sleep(12)  # TCP connections idle, every process stopped, longer than any of MPICH's short timers
    assert mc.job(job)["state"] == "SUSPENDED"
    mc.gang("resume", job, check=True)
    assert result_of(mc, job, timeout=120) == want
    assert mc.job(job)["suspended_seconds"] >= 12


# ---------------------------------------------------------------- without gangd

MPIEXEC = str(Path(PY).parent / "mpiexec")


def alone(tmp_path, *argv, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    return subprocess.run([PY, *argv], check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(environ, **env))


def test_alone_a_one_rank_mpi_program_checkpoints_and_restarts_after_the_call(tmp_path):
    argv = [HEAT, "--steps", "30", "--n", "64"]
    whole = alone(tmp_path, *argv)
    assert whole.returncode == 0, whole.stderr
    forced = alone(tmp_path, *argv, "--every", "10")  # saves at calls 9, 19 and 29 (generations 1-3)
    assert forced.returncode == 0, forced.stderr
    again = alone(tmp_path, *argv, GANGD_RESTART="2")  # after call 19: steps 20..29 again (1 is pruned: 2 kept)
    assert again.returncode == 0, again.stderr
    assert again.stdout == forced.stdout == whole.stdout


def test_a_program_checkpoints_in_a_loop_or_at_mpi_calls_not_both(tmp_path):
    program = ("from mpi4py import MPI\nfrom gangd import ckptlib as ckpt\nfrom gangd.ckptlib import mpi as ckpt_mpi\n"
               "ckpt.init()\nfor i in ckpt.loop(range(3)):\n    ckpt_mpi.checkpoint(MPI.COMM_WORLD)\n")
    run = alone(tmp_path, "-c", program)
    assert run.returncode != 0
    assert "a program checkpoints either in ckpt.loop() or at ckptlib.mpi.checkpoint(comm) calls, not both" in run.stderr


def test_under_mpiexec_a_multi_rank_checkpoint_is_refused_saying_to_use_gang(tmp_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    run = subprocess.run([MPIEXEC, "-n", "2", PY, HEAT, "--steps", "3", "--every", "1"], check=False, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=environ)
    assert run.returncode != 0
    assert "need gangd's daemons (they save it consistently): run it with `gang run --mpi`, not mpiexec" in run.stderr

