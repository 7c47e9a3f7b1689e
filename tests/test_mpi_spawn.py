"""MPI_Comm_spawn under `gang run --mpi` (issue 20, second part): the spawned
processes are a child job of the spawning one (gangd.daemon.spawns).

Real MPICH through mpi4py across 2 nodes, as in test_mpi.py: the children
find their parent through the key-value space gangd seeds, talk to it over
the intercommunicator, merge it and run a collective on the merged
communicator; killing the parent kills every spawned process; a crashing
child fails its parent with its message; hostile spawns are refused with a
reason, never a hang; a parent that fills its slot spawns onto its own
nodes, within a bound; MPI's host info key places the children.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest
from conftest import as_uid, mpi_job_through_api, shared_cluster, wait_for

from gangd.protocol.pmi import SPAWN_NPROCS_MAX

PY = sys.executable
SPAWN = Path(__file__).resolve().parent / "jobs" / "mpi_spawn.py"
FUTURES = Path(__file__).resolve().parent / "jobs" / "mpi_futures.py"
ENDED = ("DONE", "FAILED", "KILLED")
NOBODY = 65534


@pytest.fixture(scope="module")
def mc():
    # 2 cores a node: a 1-rank parent on n1 leaves 1 core there, so its children spread over both nodes.
    with shared_cluster(2, cores=2, time_slice=0.05, max_slots=4) as cluster:
        yield cluster


def submit(mc, *args, nranks=1, per_node=None):
    extra = ["-N", 2] if per_node else []
    return int(mc.gang("submit", "--mpi", "-n", nranks, *extra, "--", PY, SPAWN, *args, check=True).stdout)


def finished(mc, job):
    """(the job's final record, its output lines sorted, its children's final records)."""
    record = mc.wait_state(job, ENDED, timeout=120)
    lines = sorted(mc.gang("logs", job).stdout.splitlines())
    children = [mc.wait_state(child, ENDED, timeout=60) for child in record.get("children") or []]
    return record, lines, children


def test_one_rank_spawns_children_that_talk_to_it_merge_and_reduce(mc):
    job = submit(mc, "self", 2)
    record, lines, children = finished(mc, job)
    assert record["state"] == "DONE", (record, lines)
    assert lines == [
        "0: child says hello-0 rank 0 of 2 appnum 0 args 0",
        "0: child says hello-1 rank 1 of 2 appnum 0 args 0",
        "0: merged size 3 sum 3 ok True",
    ], lines
    # The children are a job of their own, linked to the parent, with their exit codes, across both nodes.
    [child] = children
    assert child["spawned_by"] == job and child["state"] == "DONE" and child["nranks"] == 2
    assert [s["code"] for s in child["ranks"]] == [0, 0]
    assert set(record["placement"] + child["placement"]) == {"n1", "n2"}
    assert "rank 0 of 2" in mc.gang("logs", job).stdout  # (the parent's output; the child's has its own)


def test_gang_run_returns_once_parent_and_children_are_done(mc):
    run = mc.gang("run", "--mpi", "-n", 1, "--", PY, SPAWN, "self", 1, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "0: merged size 2 sum 1 ok True" in run.stdout


def test_two_ranks_spawn_together_over_their_world(mc):
    job = submit(mc, "world", 2, nranks=2, per_node=True)
    record, lines, children = finished(mc, job)
    assert record["state"] == "DONE", (record, lines)
    assert "0: child says hello-0 rank 0 of 2 appnum 0 args w" in lines
    assert "0: child says hello-1 rank 1 of 2 appnum 0 args w" in lines
    # both parent ranks are in the merged communicator of 4
    assert [line for line in lines if "merged" in line] == ["0: merged size 4 sum 6 ok True", "1: merged size 4 sum 6 ok True"]
    assert len(children) == 1 and children[0]["state"] == "DONE"


def test_spawn_multiple_runs_each_command_with_its_arguments_and_appnum(mc):
    job = submit(mc, "multiple")
    record, lines, children = finished(mc, job)
    assert record["state"] == "DONE", (record, lines)
    assert lines == [
        "0: child says hello-0 rank 0 of 3 appnum 0 args a 1",
        "0: child says hello-1 rank 1 of 3 appnum 1 args b 2 3",
        "0: child says hello-2 rank 2 of 3 appnum 1 args b 2 3",
        "0: merged size 4 sum 6 ok True",
    ], lines
    assert [child["nranks"] for child in children] == [3]


def test_each_of_two_ranks_spawns_its_own_children_at_once(mc):
    run = mc.gang("run", "--mpi", "-n", 2, "-N", 2, "--", PY, SPAWN, "self", 1, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert sorted(run.stdout.splitlines()) == [
        "0: child says hello-0 rank 0 of 1 appnum 0 args 0", "0: merged size 2 sum 1 ok True",
        "1: child says hello-0 rank 0 of 1 appnum 0 args 1", "1: merged size 2 sum 1 ok True",
    ]


def test_mpi4py_futures_pool_spawns_its_workers_and_maps_100_tasks(mc):
    run = mc.gang("run", "--mpi", "-n", 1, "--", PY, FUTURES, 100, 2, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stdout.splitlines() == ["0: results 100 sum 328350 in order True", "0: workers 2"]


def test_mpi4py_futures_with_workers_from_the_job_itself(mc):
    run = mc.gang("run", "--mpi", "-n", 3, "--", PY, "-m", "mpi4py.futures", FUTURES, 100, 2, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "0: results 100 sum 328350 in order True" in run.stdout.splitlines()


def _children_pids(mc, job):
    text = mc.gang("logs", job).stdout
    return [int(p) for line in text.splitlines() if "children " in line for p in line.split("children ", 1)[1].split()]


def test_killing_the_parent_kills_every_spawned_process(mc):
    job = submit(mc, "hold", 2)
    pids = wait_for(lambda: _children_pids(mc, job), 60, "the children's pids")
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    mc.gang("kill", job, check=True)
    record, _, children = finished(mc, job)
    assert record["state"] == "KILLED"
    assert [c["state"] for c in children] == ["KILLED"]
    assert "its parent job" in children[0]["reason"]
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids), 30, "the children gone")


def test_children_share_their_parents_time_slot_and_take_turns_with_other_jobs(mc):
    sleep = [PY, "-c", "import time; time.sleep(600)"]
    fillers = [int(mc.gang("submit", "-n", 4, "--", *sleep, check=True).stdout) for _ in range(3)]  # slots 0-2, full
    job = submit(mc, "hold", 2)  # slot 3, one core of four
    for other in fillers + [job]:
        mc.wait_state(other, "RUNNING", timeout=60)
    waiting = int(mc.gang("submit", "-n", 4, "--", *sleep, check=True).stdout)  # no slot left: the head of the queue
    try:
        pids = wait_for(lambda: _children_pids(mc, job), 90, "the children's pids")  # (placed past the head of the queue)
        assert len(pids) == 2
        [child] = mc.job(job)["children"]
        slots = mc.ask(lambda gang: gang.schedule())["slots"]
        slot_of = {j: i for i, row in enumerate(slots) for ids in row.values() for j in ids}
        assert slot_of[child] == slot_of[job] and len(slots) == 4, slots
        assert mc.job(waiting)["state"] == "QUEUED"
    finally:
        for other in [job, waiting, *fillers]:
            mc.gang("kill", other)
    parent, child_record = mc.wait_state(job, ENDED, timeout=60), mc.wait_state(child, ENDED, timeout=60)
    assert parent["suspended_seconds"] > 0 and child_record["suspended_seconds"] > 0  # they took turns with the others


def test_a_checkpoint_of_a_job_with_spawned_processes_is_refused_with_the_reason(mc):
    job = submit(mc, "hold", 1)
    try:
        wait_for(lambda: _children_pids(mc, job), 60, "the children's pids")
        [child] = mc.job(job)["children"]
        refused = mc.gang("checkpoint", job)
        assert refused.returncode != 0
        assert f"job {job} has spawned processes (MPI_Comm_spawn): gangd does not checkpoint jobs with dynamic processes" in refused.stderr
        refused = mc.gang("checkpoint", child)
        assert refused.returncode != 0 and f"was spawned by job {job}" in refused.stderr, refused.stderr
    finally:
        mc.gang("kill", job, check=True)
    assert mc.wait_state(child, ENDED, timeout=60)["state"] == "KILLED"


def test_a_crashing_child_fails_the_parent_with_its_message(mc):
    run = mc.gang("run", "--mpi", "-n", 1, "--", PY, SPAWN, "crash", timeout=120)
    assert run.returncode != 0, (run.stdout, run.stderr)
    assert "spawned job" in run.stderr and "failed: rank 1 on" in run.stderr and "SIGSEGV" in run.stderr, run.stderr


def test_a_job_filling_its_slot_spawns_onto_its_own_nodes_sharing_their_cores(mc):
    job = submit(mc, "world", 2, nranks=4, per_node=True)  # every core of the cluster in its slot
    record, lines, children = finished(mc, job)
    assert record["state"] == "DONE", (record, lines)
    assert "0: child says hello-1 rank 1 of 2 appnum 0 args w" in lines, lines
    assert [line for line in lines if "merged" in line] == [f"{r}: merged size 6 sum 15 ok True" for r in range(4)], lines
    [child] = children
    assert child["state"] == "DONE" and sorted(child["placement"]) == ["n1", "n2"], child  # (one past the cores on each)


def test_sharing_the_parents_cores_is_bounded_by_its_ranks_on_the_node_and_refused_past_it(mc):
    sleep = [PY, "-c", "import time; time.sleep(600)"]
    filler = int(mc.gang("submit", "-n", 3, "--", *sleep, check=True).stdout)  # n1 n1 n2
    try:
        mc.wait_state(filler, "RUNNING", timeout=60)
        job = submit(mc, "refused", PY, 2)  # its one rank takes the last core of the slot, on n2
        record, lines, children = finished(mc, job)
    finally:
        mc.gang("kill", filler)
    assert record["state"] == "DONE" and record["placement"] == ["n2"], (record, lines)
    assert "0: spawn failed: Other MPI error, error stack:" in lines, lines
    [said] = [line for line in mc.gang("logs", job).stderr.splitlines() if "MPI_Comm_spawn refused" in line]
    assert (
        f"no room for 2 spawned processes beside job {job}: 0 cores free in its time slot, and 1 more processes its own nodes "
        "may run on its cores (a node takes at most as many spawned processes past its cores as the job has ranks there)"
    ) in said, said
    assert len(children) == 1 and children[0]["state"] == "FAILED" and not children[0]["started"], children


def spawn_on(mc, key, hosts, nprocs):
    """A one-rank parent on n1 spawning with MPI's ``key`` info key: (its record, output lines, gangd's stderr notes, children)."""
    job = int(mc.gang("submit", "--mpi", "-n", 1, "-w", "n1", "--", PY, SPAWN, "on", key, hosts, nprocs, check=True).stdout)
    record, lines, children = finished(mc, job)
    notes = [line for line in mc.gang("logs", job).stderr.splitlines() if "MPI_Comm_spawn refused" in line]
    return record, lines, notes, children


@pytest.mark.parametrize(("key", "hosts"), [("host", "n2"), ("hosts", "127.0.0.2")], ids=["name", "address"])
def test_the_host_info_key_puts_the_children_on_the_node_it_names(mc, key, hosts):
    record, lines, notes, children = spawn_on(mc, key, hosts, 2)
    assert record["state"] == "DONE" and not notes, (record, lines, notes)
    assert lines == ["0: child rank 0 on n2", "0: child rank 1 on n2"], lines  # (GANGD_NODE, as each child's daemon set it)
    [child] = children
    assert child["placement"] == ["n2", "n2"], child


@pytest.mark.parametrize(
    ("key", "hosts", "why"),
    [
        ("host", "n9", "host 'n9' (the spawn's host info key) is not a node of this cluster (nodes: n1, n2)"),
        ("host", "n2,nowhere:2", "host 'nowhere' (the spawn's host info key) is not a node of this cluster (nodes: n1, n2)"),
        ("hostfile", "/etc/hosts", "the hostfile info key is not served by gangd: name the nodes with the host info key"),
        ("host", "n1", "no room for 3 spawned processes beside job"),  # (1 core free on n1, 1 more sharing the parent's)
    ],
    ids=["unknown", "one-unknown", "hostfile", "no-room-there"],
)
def test_a_host_info_key_gangd_cannot_follow_is_an_mpi_error_naming_it(mc, key, hosts, why):
    record, lines, notes, children = spawn_on(mc, key, hosts, 3)
    assert record["state"] == "DONE", (record, lines)
    assert any(line.startswith("0: spawn failed: ") for line in lines), lines
    assert not [line for line in lines if "child rank" in line], lines
    assert len(notes) == 1 and why in notes[0], notes
    assert all(not c["started"] for c in children)


@pytest.mark.parametrize(
    ("command", "nprocs", "why"),
    [
        ("/nonexistent/program", 1, "/nonexistent/program: command not found"),
        ("/etc/passwd", 1, "/etc/passwd: permission denied"),
        (PY, SPAWN_NPROCS_MAX + 1, f"nprocs={SPAWN_NPROCS_MAX + 1} is not a number from 1 to {SPAWN_NPROCS_MAX}"),
        (PY, 64, "no room for 64 spawned processes beside job"),
        (PY, 5, "no room for 5 spawned processes beside job"),  # (3 cores free in the parent's slot, 1 sharing its own)
    ],
    ids=["missing", "not-executable", "absurd-nprocs", "beyond-the-cluster", "no-room-in-the-slot"],
)
def test_a_spawn_gangd_refuses_is_an_mpi_error_with_the_reason_and_the_job_goes_on(mc, command, nprocs, why):
    job = submit(mc, "refused", command, nprocs)
    record, lines, children = finished(mc, job)
    assert record["state"] == "DONE", (record, lines)
    assert "0: spawn failed: Other MPI error, error stack:" in lines, lines  # (MPICH's error: no reason in it)
    said = [line for line in mc.gang("logs", job).stderr.splitlines() if "MPI_Comm_spawn refused" in line]
    assert len(said) == 1 and why in said[0], said  # gangd's reason, in the rank's stderr
    assert all(c["state"] == "FAILED" and not c["started"] for c in children)  # (no room: placed nowhere, never started)
    assert len(children) == (nprocs in (5, 64))  # (refused by the placement: after the child job was made)


def test_a_program_only_root_may_run_cannot_be_spawned_by_another_user(mc, tmp_path):
    secret = tmp_path / "root-only"
    secret.write_text("#!/bin/sh\necho ran\n")
    secret.chmod(0o700)  # (root's; tmp_path's directories let anyone reach it)
    os.chmod(tmp_path, 0o755)
    state, text = as_uid(NOBODY, lambda: mpi_job_through_api(mc, [SPAWN, "refused", secret, "1"]))  # (as test_mpi_names.py)
    assert state == "DONE", text
    assert f"gangd: MPI_Comm_spawn refused: {secret}: permission denied" in text and "spawn failed" in text, text
    assert "ran" not in text.split()


def test_a_spawn_whose_coordinator_dies_right_after_making_the_child_job_makes_one_child_not_two(make_cluster, tmp_path, monkeypatch):
    points = tmp_path / "failpoints"
    points.mkdir()
    monkeypatch.setenv("GANGD_FAILPOINTS", str(points))
    cluster = make_cluster(3, lease_ttl=3, cores=2)
    [leader] = [row["name"] for row in cluster.gang_json("nodes")["nodes"] if row["coordinator"]]
    parent_node, child_node = [n for n in ("n1", "n2", "n3") if n != leader]
    go = tmp_path / "go"
    job = int(cluster.gang("submit", "--mpi", "-n", 1, "-w", parent_node, "--", PY, SPAWN, "after", go, child_node, check=True).stdout)
    cluster.wait_state(job, "RUNNING", timeout=60)
    (points / "jobtable.created").touch()  # the coordinator dies right after etcd committed the child job
    go.touch()
    wait_for(lambda: cluster.files[leader].pid() is None, 60, "the coordinator's crash")
    assert "failpoint jobtable.created reached" in cluster.log(leader)
    # The rank's node asked the next coordinator again, which found the child the first one made.
    record = cluster.wait_state(job, ENDED, timeout=120)
    lines = sorted(cluster.gang("logs", job).stdout.splitlines())
    assert record["state"] == "DONE", (record, lines, cluster.gang("logs", job).stderr)
    spawned = [r for r in cluster.gang_json("ps", "--all") if r.get("spawned_by") == job]
    assert [r["id"] for r in spawned] == record["children"] and len(spawned) == 1, spawned  # (without the spawn's token: 2)
    assert lines == ["0: child says hello-0 rank 0 of 1 appnum 0 args after", "0: merged size 2 sum 1 ok True"], lines
    assert cluster.wait_state(spawned[0]["id"], ENDED, timeout=60)["state"] == "DONE"
