"""Issue 14, findings 6, 5 (output limit) and 3 (rank logs, job table): a
full state disk must not strand jobs, rank output has its own limits and
says what it dropped, and the files root writes and reads back are root's,
opened without following links and parsed defensively.

Real daemons, a real (small) tmpfs as a node's state directory, the real
second uid ``nobody``, real symlinks.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest
import trio
from conftest import LocalCluster, _remove_cgroups, _world_traversable_tmpdir, as_uid, shared_cluster, up

from gangd.client import cluster as local
from gangd.client.api import connect

NOBODY = 65534
MiB = 1024 * 1024


@pytest.fixture
def tmpfs_cluster():
    """A cluster (2 cores a node, one gang slot: a job that is never freed
    blocks every later one) whose node ``on``'s state directory is a real 8 MiB tmpfs."""
    started = []

    def make(nodes: int = 1, on: str = "n1", **options) -> LocalCluster:
        directory = _world_traversable_tmpdir() / "cluster"
        state = directory / on / "state"
        state.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(state)], check=True)
        started.append((directory, state, nodes))
        up(directory, nodes, cores=2, max_slots=1, **options)
        return LocalCluster(directory, nodes)

    yield make
    for directory, state, nodes in started:
        local.down(directory)
        cluster = LocalCluster(directory, nodes)
        try:
            cluster.wait_no_rank_processes(timeout=5)
        finally:
            _remove_cgroups(cluster)
            subprocess.run(["umount", str(state)], check=False)
            shutil.rmtree(directory.parent, ignore_errors=True)


def _nobody(cluster: LocalCluster, action: str, job: int | None = None, argv: list[str] | None = None, nranks: int = 1):
    """As the real uid nobody, through the client API (the uid cannot run
    this venv's interpreter): ``submit`` (the job id), ``run`` (submit, wait,
    then its output) or ``logs`` (a job's output). Output: all text, in order."""

    def act():
        async def main():
            async with connect(cluster.dir) as gang:
                job_id = job
                if action in ("submit", "run"):
                    record = await gang.submit(argv, nranks, cwd="/", env={"PATH": "/usr/bin:/bin"})
                    job_id = record["id"]
                    if action == "submit":
                        return job_id
                    await gang.wait_done(job_id)
                text = b""
                async with gang.output(job_id, follow=False) as chunks:
                    async for item in chunks:
                        text += item["data"]
                return text.decode(errors="replace")

        return trio.run(main)

    result = as_uid(NOBODY, act)
    assert not (isinstance(result, dict) and "exception" in result), result
    return result


def _free(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


# ---------------------------------------------------------------- finding 6: a full state disk


def test_a_rank_writing_yes_cannot_fill_the_state_disk_and_strand_the_cluster(tmpfs_cluster):
    cluster = tmpfs_cluster()  # output keeps 64 MiB free, at most a quarter of the disk: 2 MiB here
    state = cluster.files["n1"].state
    # One user's two ranks write 24 MB each into a node whose state disk holds 8.
    job = _nobody(cluster, "submit", argv=["sh", "-c", "yes | head -c 24000000; echo finished >&2"], nranks=2)
    record = cluster.wait_state(job, ("DONE", "FAILED", "KILLED"), timeout=120)
    assert record["state"] == "DONE", record
    # The disk kept room for the table: output never took the reserve.
    assert _free(state) >= 1 * MiB
    # Its cores are free (one slot only: a stranded job would block this forever).
    after = cluster.gang("run", "-n", 2, "--", "echo", "later job", timeout=60)
    assert after.returncode == 0, after.stderr
    # Job 1's output left the output disk at its reserve, so each rank's line
    # is either shown or dropped with the notice that says so, never lost silently.
    shown = after.stdout + after.stderr
    assert shown.count("later job") + shown.count("output is cut here") >= 2, shown
    # The owner is told what was lost, rank by rank, in the log itself.
    text = _nobody(cluster, "logs", job)
    for rank in (0, 1):
        assert f"rank {rank}'s output is cut here: the output disk of n1 is nearly full" in text, text[-2000:]
        assert f"of rank {rank}'s output on n1 were dropped" in text, text[-2000:]
    assert "finished" not in text  # (it was among the dropped bytes)
    assert "y\ny\n" in text  # what fitted was kept


# ---------------------------------------------------------------- finding 5: the per-job output limit


def test_output_past_the_jobs_limit_is_cut_with_a_notice_and_the_job_goes_on(make_cluster):
    cluster = make_cluster(1, cores=2, output_limit=1 * MiB)
    script = "head -c 3000000 /dev/zero | tr '\\0' a; echo; echo still-running >&2; exit 0"
    result = cluster.gang("run", "-n", 1, "--no-label", "--", "sh", "-c", script, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout + result.stderr
    assert "rank 0's output is cut here: the job's output limit on n1 (1.0 MiB) is reached" in text, text[-2000:]
    written = 3000000 + len("\n") + len("still-running\n")
    assert f"{written - MiB} bytes (1.9 MiB) of rank 0's output on n1 were dropped" in text, text[-2000:]
    assert result.stdout.count("a") == MiB
    # `gang logs` shows the same afterwards
    logs = cluster.gang("logs", "1", timeout=60)
    assert f"{written - MiB} bytes" in logs.stdout + logs.stderr


# ---------------------------------------------------------------- finding 3: rank logs and the job table


def _rank_log(cluster: LocalCluster, job: int, rank: int) -> Path:
    found = [p for p in cluster.files["n1"].state.rglob(f"rank-{rank}.log") if p.parent.name == str(job)]
    assert len(found) == 1, found
    return found[0]


def _record(stream: int, data: bytes) -> bytes:
    return struct.pack(">BI", stream, len(data)) + data


@pytest.fixture(scope="module")
def logs_cluster():
    """One node for the rank-log tests: each spoils only its own job's log."""
    with shared_cluster(1, cores=2) as cluster:
        yield cluster


def _nobody_runs(cluster: LocalCluster, argv: list[str]) -> tuple[int, str]:
    """Its job's id and output, once done."""
    job = _nobody(cluster, "submit", argv=argv)
    assert cluster.wait_state(job, ("DONE", "FAILED", "KILLED"))["state"] == "DONE"
    return job, _nobody(cluster, "logs", job)


def test_rank_logs_are_roots_and_the_owner_reads_them_only_through_gang(logs_cluster):
    cluster = logs_cluster
    job, text = _nobody_runs(cluster, ["echo", "hello from nobody"])
    assert "hello from nobody" in text
    path = _rank_log(cluster, job, 0)
    st = os.lstat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    # The owner can neither rewrite what root will parse nor plant a link beside it.
    outcome = as_uid(NOBODY, lambda: _try_to_tamper(str(path)))
    assert outcome == {"open": "PermissionError", "symlink": "PermissionError"}, outcome
    assert "hello from nobody" in _nobody(cluster, "logs", job)


def _try_to_tamper(path: str) -> dict:
    outcome = {}
    try:
        os.open(path, os.O_WRONLY)
        outcome["open"] = "allowed"
    except OSError as exc:
        outcome["open"] = type(exc).__name__
    try:
        os.symlink("/etc/shadow", os.path.join(os.path.dirname(path), "rank-9.log"))
        outcome["symlink"] = "allowed"
    except OSError as exc:
        outcome["symlink"] = type(exc).__name__
    return outcome


def test_a_rank_log_replaced_by_a_symlink_is_refused(logs_cluster):
    cluster = logs_cluster
    job, text = _nobody_runs(cluster, ["echo", "mine"])
    assert "mine" in text
    secret = cluster.dir.parent / "root-only"
    secret.write_bytes(_record(1, b"TOPSECRET of root\n"))
    os.chmod(secret, 0o600)
    path = _rank_log(cluster, job, 0)
    path.unlink()
    path.symlink_to(secret)
    text = _nobody(cluster, "logs", job)
    assert "TOPSECRET" not in text
    assert "cannot read rank 0's output" in text, text
    assert cluster.gang("ps", "--all").returncode == 0  # the daemon is fine


def test_a_damaged_rank_log_is_reported_not_buffered(logs_cluster):
    cluster = logs_cluster
    job, text = _nobody_runs(cluster, ["echo", "first line"])
    assert "first line" in text
    path = _rank_log(cluster, job, 0)
    with open(path, "r+b") as fh:  # its first record now claims 4 GiB
        fh.write(struct.pack(">BI", 1, 0xFFFFFFFF))
    text = _nobody(cluster, "logs", job)
    assert "rank 0's output log on n1 is damaged at byte" in text, text
    assert cluster.gang("ps", "--all").returncode == 0
