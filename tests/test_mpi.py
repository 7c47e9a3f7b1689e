"""MPI programs under gangd, which serves MPICH's PMI-1 as its process manager.

Real MPICH (the ``mpich`` wheel) through mpi4py; no mpiexec, no ssh. The
ranks' key-value exchange spans every node of the job; MPI's own messages
go rank to rank (shared memory on one host, or TCP with the ``ofi`` netmod
forced, to cross "nodes" that share this machine).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import shared_cluster

PY = sys.executable
ALLREDUCE = Path(__file__).resolve().parent / "jobs" / "mpi_allreduce.py"
OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


@pytest.fixture(scope="module")
def mc():
    with shared_cluster(4, cores=2, time_slice=0.05, max_slots=2) as cluster:
        yield cluster


def test_mpi4py_helloworld_across_two_nodes(mc):
    run = mc.gang("run", "--mpi", "-n", 4, "-N", 2, "--", PY, "-m", "mpi4py.bench", "helloworld")
    assert run.returncode == 0, run.stderr
    lines = sorted(run.stdout.splitlines())
    assert lines == [f"{r}: Hello, World! I am process {r} of 4 on {os.uname().nodename}." for r in range(4)]


def test_mpi4py_ringtest_over_tcp_across_two_nodes(mc):
    run = mc.gang("run", "--mpi", "-n", 4, "-N", 2, "--", PY, "-m", "mpi4py.bench", "ringtest", "-l", "50", "-n", "4096",
                  env=dict(os.environ, **OVER_TCP))
    assert run.returncode == 0, run.stderr
    assert "time for 50 loops" in run.stdout and "(4 processes, 4096 bytes)" in run.stdout


@pytest.mark.parametrize("env", [{}, OVER_TCP], ids=["shm", "tcp"])
def test_allreduce_across_four_nodes(mc, env):
    run = mc.gang("run", "--mpi", "-n", 8, "--", PY, ALLREDUCE, "100", env=dict(os.environ, **env))
    assert run.returncode == 0, run.stderr
    assert "0: allreduce OK over 8 ranks on 4 nodes" in run.stdout


def test_two_mpi_jobs_gang_scheduled_on_the_same_nodes(mc):
    # 1000 allreduces each: seconds of running, dozens of 0.05 s slices taken in turns (3000 took over a minute on a loaded machine)
    jobs = [int(mc.gang("submit", "--mpi", "-n", 8, "--", PY, ALLREDUCE, "1000", check=True).stdout) for _ in range(2)]
    for job in jobs:
        record = mc.wait_state(job, ("DONE", "FAILED", "KILLED"), timeout=120)
        assert record["state"] == "DONE", record
        assert record["suspended_seconds"] > 0  # they really took turns
        assert "allreduce OK over 8 ranks" in mc.gang("logs", job).stdout


def test_mpi_abort_fails_the_job_with_its_message_and_code(mc):
    program = "from mpi4py import MPI\nc = MPI.COMM_WORLD\nif c.rank == 2:\n    c.Abort(7)\nc.Barrier()\n"
    run = mc.gang("run", "--mpi", "-n", 4, "-N", 2, "--", PY, "-c", program)
    assert run.returncode == 7, (run.returncode, run.stderr)
    assert "rank 2 on n2 called MPI_Abort (exit code 7)" in run.stderr
