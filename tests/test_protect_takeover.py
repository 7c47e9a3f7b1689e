"""A redundancy write cut short by a change of coordinator is finished by the next one (issue 16).

The coordinator asks the job's nodes to write a complete generation's
redundancy behind the job; if it dies meanwhile, nobody would ever record
the outcome and the generation would stay *complete* for good, so a node
loss could not be survived even though every byte needed was on disk. What
a user relies on: the new coordinator sees the generation complete with no
redundancy outcome, writes it again, and it becomes *protected*.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ckpthelpers import TERMINAL
from conftest import wait_for
from test_control_plane import coordinator_seen_by, gang_on, json_on

PY = sys.executable
JOB = str(Path(__file__).resolve().parent / "jobs" / "ckptjob.py")
LONG = [JOB, "--steps", "100000", "--mb", "1", "--sleep", "0.02"]


def _generation(cluster, node: str, job: int, gen: int) -> dict:
    return next(g for g in json_on(cluster, node, "ckpt", "ls", job)["generations"] if g["gen"] == gen)


def test_a_new_coordinator_finishes_the_redundancy_write_its_predecessor_left(make_cluster, points):
    cluster = make_cluster(3, cores=2, time_slice=0.1, lease_ttl=5)
    leader = coordinator_seen_by(cluster, "n1")
    pair = [n for n in sorted(cluster.files) if n != leader]
    ask = pair[0]
    try:
        submitted = gang_on(cluster, ask, "submit", "-n", 2, "-w", ",".join(pair), "--ckpt-redundancy", "partner", "--", PY, *LONG)
        assert submitted.returncode == 0, submitted.stderr
        job = int(submitted.stdout)
        wait_for(lambda: json_on(cluster, ask, "job", job)["state"] == "RUNNING", 60, "the job to run")
        time.sleep(1)
        (points / "protect.hold").touch()  # the redundancy write waits before it starts
        done = gang_on(cluster, ask, "checkpoint", job, "--json", timeout=90)
        assert '"complete"' in done.stdout, (done.stdout, done.stderr)
        assert "redundancy" not in _generation(cluster, ask, job, 1)
        # The coordinator dies with the write under way; a job node takes over.
        cluster.kill_node(leader)
        wait_for(lambda: coordinator_seen_by(cluster, ask) in pair, 60, "a new coordinator")
        (points / "protect.hold").unlink()
        entry = wait_for(lambda: (lambda g: g if g["state"] != "complete" or g.get("redundancy") else None)(_generation(cluster, ask, job, 1)),
                         60, "the generation's redundancy outcome")
        assert entry["state"] == "protected", entry
        new_leader = coordinator_seen_by(cluster, ask)
        assert "resumed after the coordinator changed" in cluster.log(new_leader)
        assert json_on(cluster, ask, "job", job)["state"] == "RUNNING"  # (it ran on throughout)
    finally:
        (points / "protect.hold").unlink(missing_ok=True)
        for record in json_on(cluster, ask, "ps"):
            if record["state"] not in TERMINAL:
                gang_on(cluster, ask, "kill", record["id"])
