"""Issue 14, findings 4 and 9: values from jobs are checked, secrets stay secret.

Real daemons, real MPICH ranks, a raw PMI_FD client speaking PMI-1 by hand,
a real second uid (nobody) reading the job table, real TCP connections to a
rank's gangd.comm listener.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import trio
from ckpthelpers import checkpoint, gen_dir, kill_what_is_left, wait_running_a_bit
from click.testing import CliRunner
from conftest import _world_traversable_tmpdir, as_uid, shared_cluster, up

from gangd.client import cluster as local
from gangd.client.cli import main as cli_main
from gangd.daemon.config import Config, EtcdSettings, NodeSpec, render

PY = sys.executable
NOBODY = 65534
TERMINAL = ("DONE", "FAILED", "KILLED")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second uid)")


@pytest.fixture(scope="module")
def vc():
    with shared_cluster(2, cores=2, time_slice=0.05, max_slots=2) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _leave_it_empty(request):
    yield
    if "vc" in request.fixturenames:
        kill_what_is_left(request.getfixturevalue("vc"))


def in_etcd(cluster, job: int) -> tuple[bytes, bool]:
    """The job's record as etcd holds it (raw, hot table or history), and whether its environment key exists."""
    from gangd.daemon.store import Keys
    from gangd.etcd.client import Etcd

    settings = cluster.etcd_settings
    keys = Keys(settings.prefix)

    async def read():
        async with Etcd(list(settings.endpoints), user=settings.user, password=settings.read_password()) as etcd:
            kv = await etcd.get(keys.job(job)) or await etcd.get(keys.past(job))
            return (kv.value if kv else b""), (await etcd.get(keys.env(job))) is not None

    return trio.run(read)


def gang_as_this_user(cluster, *args):
    """The real `gang` command run in this process (as_uid's child: nobody cannot execute the venv's python)."""
    return CliRunner().invoke(cli_main, ["--cluster", str(cluster.dir), *args], catch_exceptions=False)


def wait_on_every_node(cluster, job: int, timeout: float = 30) -> dict[str, dict]:
    """The job's record in etcd (the one every node follows), once it is terminal there."""
    deadline = time.monotonic() + timeout
    while True:
        raw, _ = in_etcd(cluster, job)
        if raw:
            record = msgpack.unpackb(raw, strict_map_key=False)
            if record["state"] in TERMINAL:
                return {"etcd": record}
        assert time.monotonic() < deadline, f"job {job} did not end in etcd"
        time.sleep(0.1)


# ---------------------------------------------------------------- exit codes (finding 4)


def test_mpi_abort_256_never_exits_zero(vc):
    """MPI_Abort(comm, 256): MPICH exits with 256 & 255 = 0; `gang run` must still fail."""
    program = "from mpi4py import MPI\nc = MPI.COMM_WORLD\nif c.rank == 0:\n    c.Abort(256)\nc.Barrier()\n"
    run = vc.gang("run", "--mpi", "-n", 2, "--", PY, "-c", program, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "MPI_Abort with exit code 256, not 1..255: the job exits with 1" in run.stderr


PMI_ABORT = r"""
import os, socket, sys, time
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
def ask(line):
    s.sendall(line.encode() + b"\n")
if int(os.environ["PMI_RANK"]) == 0:
    ask("cmd=init pmi_version=1 pmi_subversion=1")
    s.recv(4096)
    ask("cmd=abort exitcode=" + sys.argv[1])
time.sleep(600)  # linger: the daemon has to kill us
"""


@pytest.mark.parametrize("code", ["99999999999999999999999", "-5", "0"])
def test_abort_code_out_of_range_is_clamped_and_the_job_ends(vc, code):
    run = vc.gang("run", "--mpi", "-n", 2, "--", PY, "-c", PMI_ABORT, code, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "called MPI_Abort with exit code" in run.stderr and "not 1..255: the job exits with 1" in run.stderr
    job = int(run.stderr.split("gang: job ", 1)[1].split()[0])
    records = wait_on_every_node(vc, job)  # replicated and written everywhere: the record still encodes
    for node, record in records.items():
        assert record["state"] == "FAILED" and record["abort_code"] == 1, (node, record)
    vc.wait_no_rank_processes(job)
    # the cluster works on: a new job runs and is replicated, and a job can be killed
    assert vc.gang("run", "-n", 2, "--", "true", timeout=60).returncode == 0
    sleeper = int(vc.gang("submit", "-n", 2, "--", "sleep", "300", check=True).stdout)
    vc.wait_state(sleeper, ("RUNNING", "SUSPENDED"))
    assert vc.gang("kill", sleeper).returncode == 0
    assert vc.wait_state(sleeper, TERMINAL)["state"] == "KILLED"


# ---------------------------------------------------------------- PMI limits (finding 4)


PMI_PUTS = r"""
import json, os, socket
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
f = s.makefile("rb")
def ask(line):
    s.sendall(line.encode() + b"\n")
    return f.readline().decode().strip()
out = {"init": ask("cmd=init pmi_version=1 pmi_subversion=1"), "maxes": ask("cmd=get_maxes")}
kvs = ask("cmd=get_my_kvsname").split("kvsname=")[1].split()[0]
out["long_key"] = ask(f"cmd=put kvsname={kvs} key={'k' * 65} value=v")
out["long_value"] = ask(f"cmd=put kvsname={kvs} key=k value={'v' * 1025}")
out["fits"] = ask(f"cmd=put kvsname={kvs} key={'k' * 64} value={'v' * 1024}")
out["long_line"] = None
answers = [ask(f"cmd=put kvsname={kvs} key=key{i} value={'v' * 1000}") for i in range(1200)]
out["first_refused"] = next((i for i, a in enumerate(answers) if "rc=0" not in a), None)
out["refusal"] = answers[out["first_refused"]] if out["first_refused"] is not None else None
out["still_there"] = ask(f"cmd=get kvsname={kvs} key=key0")[:40]
out["finalize"] = ask("cmd=finalize")
print("PMI " + json.dumps(out), flush=True)
"""


def test_oversized_pmi_puts_are_refused_with_a_pmi_error(vc):
    run = vc.gang("run", "--mpi", "-n", 1, "--no-label", "--", PY, "-c", PMI_PUTS, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.split("PMI ", 1)[1])
    assert out["maxes"] == "cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024 rc=0"
    assert out["long_key"].startswith("cmd=put_result rc=-1 msg=key_longer_than_64"), out
    assert out["long_value"].startswith("cmd=put_result rc=-1 msg=value_longer_than_1024"), out
    assert out["fits"] == "cmd=put_result rc=0"
    # the job's key-value space has a budget (1 MiB for a small job): the rank is told when it is full
    assert out["first_refused"] is not None and 900 < out["first_refused"] < 1100, out
    assert out["refusal"].startswith("cmd=put_result rc=-1 msg=the_job's_key-value_space_is_full"), out
    assert out["still_there"].startswith("cmd=get_result rc=0 value=vvv")
    assert out["finalize"] == "cmd=finalize_ack rc=0"


# ---------------------------------------------------------------- what other users see (finding 4)


EVIL_NAME = "\x1b]0;owned\x07evil\x1b[2J\x1b[31mname\r\nforged row\x9b1m"


@root_only
def test_a_job_name_with_terminal_escapes_is_shown_stripped_to_another_user(vc):
    job = int(vc.gang("submit", "-n", 1, "--name", EVIL_NAME, "--", "sleep", "300", check=True).stdout)
    vc.wait_state(job, ("RUNNING", "SUSPENDED"))

    def look():
        table, as_json = gang_as_this_user(vc, "ps"), gang_as_this_user(vc, "ps", "--json")
        return {"table": table.output, "code": table.exit_code, "json": json.loads(as_json.output)}

    seen = as_uid(NOBODY, look)
    assert "exception" not in seen, seen
    assert seen["code"] == 0
    row = next(line for line in seen["table"].splitlines() if line.startswith(str(job)))
    assert "evilname??forged row" in row
    assert not any(c in seen["table"] for c in "\x1b\x07\x9b\r"), repr(seen["table"])
    name = next(r["name"] for r in seen["json"] if r["id"] == job)
    assert name == "evilname??forged row"  # the daemon stored it clean: every client shows it so
    vc.gang("kill", job, check=True)


# ---------------------------------------------------------------- the cluster secret (finding 9)


def start_daemon(tmp_path: Path, secret: Path) -> subprocess.CompletedProcess:
    config = Config(
        node_name="solo",
        nodes=(NodeSpec("solo", "127.0.0.1", local.pick_port(["127.0.0.1"]), 1),),
        state_dir=tmp_path / "state",
        socket=tmp_path / "gangd.sock",
        secret_file=secret,
        etcd=EtcdSettings(endpoints=("http://127.0.0.1:9",)),  # never reached: the secret is refused first
    )
    (tmp_path / "gangd.toml").write_text(render(config))
    daemon = subprocess.Popen([PY, "-m", "gangd.daemon.main", "--config", str(tmp_path / "gangd.toml")], stderr=subprocess.PIPE, text=True)
    try:
        _, err = daemon.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.communicate()
        raise AssertionError("gangd started with a secret file it must refuse") from None
    return subprocess.CompletedProcess(daemon.args, daemon.returncode, "", err)


@root_only
@pytest.mark.parametrize("problem", ["mode 0644", "owned by nobody", "a symlink"])
def test_a_secret_file_others_can_read_or_own_is_refused_at_start(tmp_path, problem):
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    if problem == "mode 0644":
        secret.chmod(0o644)
        expect = "has mode 0644: other users can read or change it"
    elif problem == "owned by nobody":
        os.chown(secret, NOBODY, NOBODY)
        expect = "is owned by uid 65534, not root"
    else:
        real, secret = secret, tmp_path / "link"
        secret.symlink_to(real)
        expect = "is a symbolic link"
    started = start_daemon(tmp_path, secret)
    assert started.returncode == 1, started.stderr
    assert expect in started.stderr and "refusing it" in started.stderr


@root_only
def test_cluster_up_writes_a_conforming_secret_over_whatever_was_there(tmp_path):
    directory = _world_traversable_tmpdir() / "cluster"
    directory.mkdir()
    (directory / "secret").write_text("planted by someone else\n")
    os.chown(directory / "secret", NOBODY, NOBODY)
    os.chmod(directory / "secret", 0o644)
    try:
        up(directory, 1)
        info = (directory / "secret").stat()
        assert info.st_uid == 0 and info.st_mode & 0o777 == 0o600
        assert b"planted" not in (directory / "secret").read_bytes()
    finally:
        local.down(directory)
        shutil.rmtree(directory.parent, ignore_errors=True)


# ---------------------------------------------------------------- a job's environment (finding 9)


CKPT_ENV_JOB = r"""
import os, time
from gangd import ckptlib as ckpt
from gangd import comm
ckpt.init()
w = comm.world()
print("TOKEN=" + os.environ.get("SECRET_TOKEN", "<none>") + " restart=" + os.environ.get("GANGD_RESTART_GEN", "-"), flush=True)
for it in ckpt.loop(range(1000000)):
    time.sleep(0.01)
"""


@root_only
def test_a_jobs_environment_is_gone_from_every_replica_once_it_ends_and_restart_still_has_it(vc):
    token = "s3cr3t-" + os.urandom(8).hex()
    env = dict(os.environ, SECRET_TOKEN=token)
    job = int(vc.gang("submit", "-n", 2, "-N", 2, "--", PY, "-c", CKPT_ENV_JOB, env=env, check=True).stdout)
    wait_running_a_bit(vc, job, 1.5)
    gen = checkpoint(vc, job)
    assert gen["state"] == "complete", gen
    assert all(token.encode() in (gen_dir(vc, node, job, gen["gen"]) / "job.msgpack").read_bytes() for node in ("n1", "n2"))
    vc.gang("kill", job, check=True)
    wait_on_every_node(vc, job)
    raw, env_kept = in_etcd(vc, job)
    assert token.encode() not in raw and not env_kept, f"etcd keeps the environment of ended job {job}"

    def look():
        out = gang_as_this_user(vc, "ps", "--all", "--json")
        return {"out": out.output, "code": out.exit_code}

    seen = as_uid(NOBODY, look)
    assert seen.get("code") == 0 and str(job) in seen["out"] and token not in seen["out"], seen
    # a restart still gives the ranks the environment (from the checkpoint), though not from this user's shell
    restarted = json.loads(vc.gang("restart", job, "--json", env={"PATH": os.environ["PATH"]}, check=True).stdout)["record"]["id"]
    deadline = time.monotonic() + 60
    while (logs := vc.logs(restarted)).count("TOKEN=") < 2:  # (polled in this process; then read as the command prints it)
        assert time.monotonic() < deadline, logs
        time.sleep(0.2)
    logs = vc.gang("logs", restarted).stdout
    assert logs.count(f"TOKEN={token} restart={gen['gen']}") == 2, logs
    vc.gang("kill", restarted, check=True)
    wait_on_every_node(vc, restarted)
    raw, env_kept = in_etcd(vc, restarted)
    assert token.encode() not in raw and not env_kept
