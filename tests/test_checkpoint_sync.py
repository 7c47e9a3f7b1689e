"""A node whose fsync of a generation's own files fails in a way nobody foresaw.

The daemon's files of a generation (the network contexts, the job record)
are fsynced behind the capture, while the ranks write, and the commit waits
for that before it writes the MANIFEST. Whatever that fsync raises, the
files are not known durable: the generation must abort with the reason, never
be committed without them, and the job must run on and checkpoint again.
"""

from __future__ import annotations

from pathlib import Path

from ckpthelpers import checkpoint, hold, kill_what_is_left, reference, result_of, submit, wait_holding

from gangd.daemon.checkpoint import SYNC_FAILS

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "300", "--mb", "0.25"]


def test_an_unforeseen_fsync_failure_aborts_the_generation_and_the_job_runs_on(make_cluster, points):
    cluster = make_cluster(2, cores=2)
    try:
        expected = reference(cluster, ARGV, 2, "--per-node", "1")
        options, release = hold(cluster, 100)
        job = submit(cluster, [*ARGV, *options], 2, "--per-node", "1", "--ckpt-redundancy", "local")
        wait_holding(cluster, job)
        (points / SYNC_FAILS).touch()
        failed = checkpoint(cluster, job)
        assert not (points / SYNC_FAILS).exists()  # (claimed by one node's daemon)
        assert failed["state"] == "aborted", failed
        assert "could not fsync the generation's files" in failed["reason"], failed["reason"]
        again = checkpoint(cluster, job)
        assert again["state"] == "complete", again
        release.touch()
        assert result_of(cluster, job) == expected
    finally:
        kill_what_is_left(cluster)
