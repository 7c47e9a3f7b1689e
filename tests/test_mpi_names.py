"""MPI programs under gangd that use what PMI-1 has beyond start-up (issue 20, first part).

Real MPICH through mpi4py, as in test_mpi.py. A spawn gangd refuses
(here: a program that does not exist; test_mpi_spawn.py has the rest)
must be an MPI error the program sees, never a crash of the rank; MPI's name service works between jobs of one user on
any nodes, and is invisible to another user.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import SYSTEM_PY, as_uid, mpi_job_through_api, shared_cluster

PY = sys.executable
NAMES = Path(__file__).resolve().parent / "jobs" / "mpi_names.py"
NOBODY = 65534


@pytest.fixture(scope="module")
def mc():
    with shared_cluster(2, cores=2, time_slice=0.05, max_slots=4) as cluster:
        yield cluster


def names(mc, *args, nodelist="n2"):
    """Run mpi_names.py as a one-rank job on ``nodelist``: (exit code, rank 0's output)."""
    run = mc.gang("run", "--mpi", "-n", 1, "-w", nodelist, "--", PY, NAMES, *args, cwd="/")
    return run.returncode, run.stdout.strip().removeprefix("0: "), run.stderr


def names_through_api(mc, *args):
    """:func:`names` for a second uid (in :func:`conftest.as_uid`'s child): (final state, rank 0's output)."""
    state, text = mpi_job_through_api(mc, [NAMES, *args], nodelist=["n2"])
    return [state, text.strip()]


def publishing(mc, service, port, hold: Path, nodelist="n1"):
    """Submit a job that publishes ``service`` and stays until ``hold`` exists; its id once published."""
    job = int(mc.gang("submit", "--mpi", "-n", 2, "-w", nodelist, "--", PY, NAMES, "publish", service, port, hold, check=True).stdout)
    mc.wait_state(job, "RUNNING", timeout=60)
    _wait_output(mc, job, ("published", "refused"))
    return job


def _wait_output(mc, job, words):
    from conftest import wait_for

    wait_for(lambda: any(map(mc.logs(job).__contains__, words)), 60, f"job {job} to say one of {words}")  # (polled in this process)
    return mc.gang("logs", job).stdout


def test_spawn_is_an_mpi_error_on_every_rank_never_a_crash(mc):
    run = mc.gang("run", "--mpi", "-n", 2, "-N", 2, "--", PY, NAMES, "spawn")
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    said = sorted(line.split(": ", 1)[1] for line in run.stdout.splitlines() if " spawn " in line)
    # (MPICH's class for a refused spawn; its error stack names PMI_Spawn_multiple)
    assert said == ["0: spawn failed MPI_ERR_OTHER: Other MPI error, error stack:", "1: spawn failed MPI_ERR_OTHER: Other MPI error, error stack:"], run.stdout
    assert run.stdout.count("PMI_Spawn_multiple returned -1") == 2


def test_published_name_is_found_by_another_job_of_the_user_on_another_node(mc, tmp_path):
    hold = tmp_path / "hold"
    job = publishing(mc, "ocean", "tag#0$port-of-ocean$", hold, nodelist="n1")
    try:
        code, out, err = names(mc, "lookup", "ocean", nodelist="n2")
        assert code == 0, err
        assert out == "found tag#0$port-of-ocean$"
        # publishing it again, while it is published, is refused as MPICH reports it
        code, out, err = names(mc, "publish", "ocean", "elsewhere")
        assert out == "refused MPI_ERR_NAME", (out, err)  # (MPICH: a refused publish is MPI_ERR_NAME, a refused unpublish MPI_ERR_SERVICE)
    finally:
        hold.touch()
    mc.wait_state(job, ("DONE",), timeout=60)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PY, os.X_OK), reason="needs root to switch to a second uid, and a system Python 3.11")
def test_two_jobs_of_the_user_connect_through_a_published_port(mc):
    # MPI_Open_port / Publish_name / Comm_accept in one job (2 ranks on n1), Lookup_name /
    # Comm_connect in another (2 ranks on n2): the two merge into one communicator of 4 ranks.
    server = int(mc.gang("submit", "--mpi", "-n", 2, "-w", "n1", "--", PY, NAMES, "serve", "rendezvous", check=True).stdout)
    _wait_output(mc, server, ("serving",))
    client = mc.gang("run", "--mpi", "-n", 2, "-w", "n2", "--", PY, NAMES, "connect", "rendezvous", cwd="/")
    assert client.returncode == 0, (client.stdout, client.stderr)
    assert "0: connected 10 over 4 ranks" in client.stdout, client.stdout
    assert mc.wait_state(server, ("DONE", "FAILED"), timeout=60)["state"] == "DONE"
    assert "served 10 over 4 ranks" in mc.gang("logs", server).stdout
    code, out, err = names(mc, "lookup", "rendezvous")  # (the server unpublished it)
    assert code == 0 and out == "absent MPI_ERR_NAME", (out, err)


def test_another_user_cannot_see_overwrite_or_unpublish_a_name(mc, tmp_path):
    hold = tmp_path / "hold"
    job = publishing(mc, "secret", "port-of-root", hold)
    try:
        def stranger():
            return {
                "lookup": names_through_api(mc, "lookup", "secret"),
                "unpublish": names_through_api(mc, "unpublish", "secret"),
                # the same service name, their own: published beside root's, not over it
                "own": names_through_api(mc, "publish", "secret", "port-of-nobody"),
            }

        seen = as_uid(NOBODY, stranger)
        assert "exception" not in seen, seen
        assert seen["lookup"] == ["DONE", "absent MPI_ERR_NAME"], seen
        assert seen["unpublish"] == ["DONE", "refused MPI_ERR_SERVICE"], seen
        assert seen["own"] == ["DONE", "published"], seen
        # root's name is untouched
        _, out, _ = names(mc, "lookup", "secret")
        assert out == "found port-of-root"
    finally:
        hold.touch()
    mc.wait_state(job, ("DONE",), timeout=60)


def test_unpublish_removes_the_name_and_a_job_that_ends_takes_its_names(mc, tmp_path):
    hold = tmp_path / "hold"
    job = publishing(mc, "river", "port-r", hold)
    try:
        assert names(mc, "unpublish", "river")[1] == "unpublished"
        assert names(mc, "lookup", "river")[1] == "absent MPI_ERR_NAME"
        assert names(mc, "unpublish", "river")[1] == "refused MPI_ERR_SERVICE"
    finally:
        hold.touch()
    mc.wait_state(job, ("DONE",), timeout=60)
    # a job's names go when it ends, unpublished or not
    hold2 = tmp_path / "hold2"
    job = publishing(mc, "lake", "port-l", hold2)
    try:
        assert names(mc, "lookup", "lake")[1] == "found port-l"
    finally:
        hold2.touch()
    mc.wait_state(job, ("DONE",), timeout=60)
    assert names(mc, "lookup", "lake")[1] == "absent MPI_ERR_NAME"
    assert names(mc, "publish", "lake", "port-l2")[1] == "published"  # free again


def test_names_per_user_are_bounded_and_hostile_names_refused(mc):
    from gangd.daemon.names import NAMES_PER_USER
    from gangd.protocol.pmi import SERVICE_MAX

    code, out, err = names(mc, "publish-many", "many", NAMES_PER_USER + 5)
    assert code == 0, err
    assert out == f"refused at {NAMES_PER_USER} MPI_ERR_NAME", out
    # (that job ended: its names went with it)
    code, out, err = names(mc, "publish-many", "x" * (SERVICE_MAX + 1), 1)
    assert code == 0, err
    assert out.startswith("refused at 0 MPI_ERR_NAME"), out
    # the daemons are unharmed
    run = mc.gang("run", "--mpi", "-n", 2, "-N", 2, "--", PY, "-m", "mpi4py.bench", "helloworld")
    assert run.returncode == 0, run.stderr


RAW_PMI = r"""
import json, os, socket
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
f = s.makefile("rb")
def ask(text):
    s.sendall(text.encode() + b"\n")
    return f.readline().decode().strip()
out = {"init": ask("cmd=init pmi_version=1 pmi_subversion=1")}
for cmd in ("singinit", "initack", "create_kvs", "destroy_kvs", "getbyidx", "no_such_command"):
    out[cmd] = ask(f"cmd={cmd} pmiid=1")
out["spawn"] = ask("mcmd=spawn\nnprocs=1\nexecname=/nonexistent/x\ntotspawns=1\nspawnssofar=1\nargcnt=1\narg1=a b c\n"
                   "preput_num=0\ninfo_num=0\nendcmd")
out["long_service"] = ask("cmd=publish_name service=" + "s" * 257 + " port=p")
out["long_port"] = ask("cmd=publish_name service=s port=" + "p" * 1024)
out["widest"] = ask("cmd=publish_name service=" + "w" * 256 + " port=" + "p" * 1023)
out["found"] = ask("cmd=lookup_name service=" + "w" * 256)
out["maxes"] = ask("cmd=get_maxes")
out["finalize"] = ask("cmd=finalize")
print("PMI " + json.dumps(out), flush=True)
"""


def test_every_pmi1_query_is_answered_on_the_wire_and_the_connection_goes_on(mc):
    run = mc.gang("run", "--mpi", "-n", 1, "--no-label", "--", PY, "-c", RAW_PMI, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.split("PMI ", 1)[1])
    assert out["init"] == "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
    for cmd, reply in [("singinit", "singinit_info"), ("initack", "initack"), ("create_kvs", "newkvs"),
                       ("destroy_kvs", "kvs_destroyed"), ("getbyidx", "getbyidx_results"),
                       ("no_such_command", "no_such_command")]:
        assert out[cmd] == f"cmd={reply} rc=-1 msg={cmd}_is_not_supported_by_gangd", out
    assert out["spawn"] == "cmd=spawn_result rc=-1 msg=/nonexistent/x:_command_not_found", out
    assert out["long_service"] == "cmd=publish_result rc=-1 msg=service_longer_than_256_bytes"
    assert out["long_port"] == "cmd=publish_result rc=-1 msg=port_longer_than_1023_bytes"
    assert out["widest"] == "cmd=publish_result rc=0"
    assert out["found"] == "cmd=lookup_result rc=0 port=" + "p" * 1023
    assert out["maxes"] == "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024 rc=0"
    assert out["finalize"] == "cmd=finalize_ack rc=0"
