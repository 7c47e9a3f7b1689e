"""Incremental checkpoints of a real MPI program at ``gangd.ckptlib.mpi.checkpoint(comm)`` (issue 17).

mpi4py over MPICH, 2 ranks on two "nodes" talking TCP, a job in adaptive
mode forcing a checkpoint every few calls while each step changes a few
blocks of each rank's state. What a user relies on: every generation is one
cut of the whole job (both ranks' files of it hold the same call), later
generations write only the changed blocks (small files), and `gang restart`
from the newest or from an older kept generation restores every rank of
that generation from its chain and ends bit-identical to an uninterrupted
run -- for protected values and for a checkpointer plug-in that hands its
state over as buffers (:meth:`gangd.ckptlib.spc.SPC.buffers`).
"""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest
from ckpthelpers import USABLE, gen_dir, generations, kill_what_is_left, reference, result_of, submit
from conftest import shared_cluster

from gangd import ckptstore
from gangd.checkpoint import delta
from gangd.ckptlib import blocks

OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
ACROSS = ("--mpi", "-N", "2")  # 2 ranks, one per node: MPI's messages cross "nodes" over TCP
KIB = 2048  # per rank: 128 blocks of 16 KiB
BLOCK = 16 << 10
STEPS, EVERY = 18, 3  # generations at calls 2, 5, ..., 17

JOB = textwrap.dedent(
    '''
    """A sparse-update MPI job: each step changes three elements of each rank's
    array, agrees on a sum over MPI, and calls checkpoint(comm) (forced every
    --every steps). Rank 0 prints a digest of every rank's final state."""
    import argparse, hashlib
    import numpy as np
    from mpi4py import MPI
    from gangd import ckptlib as ckpt
    from gangd.ckptlib import mpi as ckpt_mpi, spc

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--every", type=int, default=0)
    parser.add_argument("--kib", type=int, default=2048)
    parser.add_argument("--plugin", action="store_true", help="the state held by a plug-in that hands it over as buffers")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    n = args.kib * 1024 // 8

    class Holder(spc.SPC):
        name = "holder"
        state = info = None

        def buffers(self, values):
            return {"state": self.state, "info": self.info}

        def restore_buffers(self, buffers):
            self.state, self.info = buffers["state"], buffers["info"]
            return {}

    if args.plugin:
        holder = Holder()
        ckpt.init(spc=holder)  # a restart fills the holder
        if holder.state is None:
            holder.state, holder.info = np.arange(n, dtype=np.float64) + rank, {"step": 0, "sums": []}
        state, info = holder.state, holder.info
    else:
        ckpt.init()
        state = ckpt.protect("state", lambda: np.arange(n, dtype=np.float64) + rank)
        info = ckpt.protect("info", lambda: {"step": 0, "sums": []})
    while info["step"] < args.steps:
        step = info["step"]
        for j in range(3):
            state[(step * 7919 + j * 104729 + rank * 31) % n] += step + 1
        info["sums"].append(comm.allreduce(float(state[(step * 4099) % n]), op=MPI.SUM))
        info["step"] = step + 1
        ckpt_mpi.checkpoint(comm, force=bool(args.every) and info["step"] % args.every == 0)
    ckpt.fini()
    mine = hashlib.sha256(state.tobytes() + repr(info).encode()).hexdigest()
    every = comm.gather(mine, root=0)
    if rank == 0:
        print("RESULT", hashlib.sha256("".join(every).encode()).hexdigest(), flush=True)
    '''
)


@pytest.fixture(scope="module")
def mc():
    with shared_cluster(2, cores=2, time_slice=0.1, max_slots=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mpidelta")
    os.chmod(directory, 0o755)
    path = directory / "mpi_delta_job.py"
    path.write_text(JOB)
    os.chmod(path, 0o644)
    return str(path)


@pytest.fixture(autouse=True)
def _leave_it_empty(mc):
    yield
    kill_what_is_left(mc)


def tcp() -> dict:
    return dict(os.environ, **OVER_TCP)


def settled_gens(mc, job: int, newest_call: int, timeout: float = 60) -> dict[int, dict]:
    """The job's generations once the one saved at ``newest_call`` is usable (its commit may end just after the job)
    and retention has caught up with it: the newest two usable and what they need are kept, nothing else."""
    deadline = time.monotonic() + timeout
    while True:
        entries = {e["gen"]: e for e in generations(mc, job)}
        kept = sorted(g for g, e in entries.items() if e["state"] in USABLE)
        needs = {g: e.get("needs") or [] for g, e in entries.items()}
        if any(entries[g]["iteration"] == newest_call for g in kept) and kept == sorted(delta.needed(needs, kept[-2:])):
            return entries
        assert time.monotonic() < deadline, entries
        time.sleep(0.2)


def restart_from(mc, job: int, gen: int) -> int:
    out = json.loads(mc.gang("restart", job, "-g", gen, "--json", check=True).stdout)
    assert out["record"]["restart_of"]["gen"] == gen, out
    return out["record"]["id"]


@pytest.mark.parametrize("plugin", [False, True], ids=["protected", "plugin"])
def test_an_mpi_job_s_adaptive_generations_are_small_consistent_cuts_and_restore_bit_identical(mc, job_file, plugin):
    plain = [job_file, "--steps", str(STEPS), "--kib", str(KIB)]
    expected = reference(mc, plain, 2, *ACROSS, "--ckpt-mode", "full", env=tcp())  # (the same with --plugin: one run for both)
    argv = [*plain, *(["--plugin"] if plugin else [])]
    job = submit(mc, [*argv, "--every", str(EVERY)], 2, *ACROSS, "--ckpt-mode", "adaptive", "--ckpt-redundancy", "local", env=tcp())
    assert result_of(mc, job, timeout=180) == expected  # (checkpoints do not disturb the run)
    entries = settled_gens(mc, job, STEPS - 1)
    kept = sorted(g for g, e in entries.items() if e["state"] in USABLE)
    needs = {g: e.get("needs") or [] for g, e in entries.items()}
    record = mc.job(job)
    state_bytes = KIB * 1024
    deltas = 0
    for g in kept:
        # One cut: both ranks' files of generation g hold the same call, each restorable from the links g needs.
        call = entries[g]["iteration"]
        for rank in (0, 1):
            path = gen_dir(mc, record["placement"][rank], job, g) / ckptstore.cluster_rank_file(rank)
            index = blocks.read_index(path)
            assert (index.gen, index.iteration) == (g, call + 1), (rank, g, index)  # (a restart goes on after the call)
            assert set(index.links) <= set(needs[g]) <= set(kept), (rank, g, index.links, needs[g])
            if index.role != "full":
                deltas += 1
                # Three elements changed per step since the generation it is a delta of (a forced checkpoint
                # refused while the previous one commits lands at a later call): those blocks, the pickle, the index.
                steps = call - entries[index.parent]["iteration"]
                size = path.stat().st_size
                assert size <= (3 * steps + 1) * BLOCK + 8 * 1024 and size < 0.5 * state_bytes, (rank, g, index.role, steps, size)
            else:
                assert path.stat().st_size > state_bytes
    assert deltas >= 2, {g: entries[g] for g in kept}
    newest, older = kept[-1], kept[-2]
    assert needs[newest], entries[newest]  # the newest is a delta, restored through its chain
    assert result_of(mc, restart_from(mc, job, newest), timeout=180) == expected
    assert result_of(mc, restart_from(mc, job, older), timeout=180) == expected  # (re-runs the steps after it)

