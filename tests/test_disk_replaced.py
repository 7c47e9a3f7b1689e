"""A node whose checkpoint disk was replaced under its running daemon.

The disk goes and takes the checkpoint root with it: the daemon keeps
running, and nothing of the old directory is there any more (not even the
empty root, which a wipe of the files alone would leave). The node must go
on taking checkpoints and receiving other nodes' files (a restart staged
onto it, a rebuild) as a fresh node would: the root is made again, root's
and traversable, and nothing else about the node changes.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from ckpthelpers import checkpoint, gen_dir, hold, kill_and_restart, kill_what_is_left, reference, result_of, submit, wait_holding

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "300", "--mb", "0.25"]


def checkpoint_root(cluster, node: str) -> Path:
    return cluster.dir / node / "state" / "checkpoints" / node


def replace_disk(cluster, node: str) -> None:
    shutil.rmtree(checkpoint_root(cluster, node))
    assert not checkpoint_root(cluster, node).exists()


def assert_root_made_again(cluster, node: str) -> None:
    info = os.lstat(checkpoint_root(cluster, node))
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o711, oct(info.st_mode)


def checkpointed(cluster, *placement: str) -> tuple[int, dict, Path]:
    """A 2-rank job holding mid-run, checkpointed: (its id, the generation, the file that releases it)."""
    options, release = hold(cluster, 100)
    job = submit(cluster, [*ARGV, *options], 2, *placement, "--per-node", "1", "--ckpt-redundancy", "local")
    wait_holding(cluster, job)
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    return job, gen, release


def test_a_node_whose_checkpoint_root_is_gone_checkpoints_and_restarts_as_before(make_cluster):
    cluster = make_cluster(2, cores=2)
    try:
        expected = reference(cluster, ARGV, 2, "--per-node", "1")
        replace_disk(cluster, "n2")
        job, gen, release = checkpointed(cluster)
        assert_root_made_again(cluster, "n2")
        assert (gen_dir(cluster, "n2", job, gen["gen"]) / "MANIFEST").is_file()
        release.touch()
        again = kill_and_restart(cluster, job)
        assert result_of(cluster, again, timeout=120) == expected
    finally:
        kill_what_is_left(cluster)


def test_a_restart_staged_onto_a_node_whose_checkpoint_root_is_gone_lands_there(make_cluster):
    cluster = make_cluster(3, cores=2)
    try:
        expected = reference(cluster, ARGV, 2, "--per-node", "1")
        job, _, release = checkpointed(cluster, "-w", "n1,n2")
        release.touch()
        cluster.gang("kill", job, check=True)
        replace_disk(cluster, "n3")
        out = cluster.gang("restart", job, "--json", "-w", "n1,n3", check=True).stdout
        answer = json.loads(out)
        assert sorted(set(answer["placement"])) == ["n1", "n3"], answer["placement"]
        assert_root_made_again(cluster, "n3")
        assert result_of(cluster, answer["record"]["id"], timeout=120) == expected
    finally:
        kill_what_is_left(cluster)
