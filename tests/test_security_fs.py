"""Paths root touches cannot be redirected by a user (issue 14, findings 1, 3 and 11).

Real daemons, a real second uid (nobody) planting real symlinks where an
attacker would plant them, a real sparse 64 GB manifest. What a user relies
on: no job of theirs makes root chown, write, read or remove a file they
chose; a damaged or oversized checkpoint file is an error that names node
and path, never a dead daemon; each node keeps its checkpoints apart, also
in a shared ``checkpoint_dir``; a daemon refuses to start on a directory it
cannot trust, and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
import trio
from ckpthelpers import checkpoint, gen_dir, kill_what_is_left, result_of
from conftest import as_uid, up

from gangd import ckptstore
from gangd.client import cluster as local
from gangd.client.api import connect

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root and a second uid")

# Jobs of nobody need a Python nobody may execute (this one may live under
# /root): the system's, of the same version, with this tree's packages.
_SYSTEM_PY = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
NOBODY_PY = _SYSTEM_PY if os.access(_SYSTEM_PY, os.X_OK) else PY
NOBODY_ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT / 'src'}:{sysconfig.get_paths()['purelib']}"}


def _tmpdir(owner: int = 0, mode: int = 0o755) -> Path:
    path = Path(tempfile.mkdtemp(prefix="gangd-secfs-"))
    os.chown(path, owner, owner)
    os.chmod(path, mode)
    return path


def _submit_as_nobody(cluster, argv: list[str], n: int) -> int:
    def go():
        async def main():
            async with connect(cluster.dir) as gang:
                record = await gang.submit(argv, n, cwd="/", env=NOBODY_ENV)
                return record["id"]

        return trio.run(main)

    job = as_uid(NOBODY, go)
    assert isinstance(job, int), job
    return job


def _alive(cluster) -> None:
    for node in cluster.files:
        os.kill(cluster.daemon_pid(node), 0)
    rows = cluster.gang_json("nodes")["nodes"]
    assert all(r["state"] == "up" for r in rows), rows


# ---------------------------------------------------------------- finding 1: the runtime directory


def test_a_link_planted_where_rank_sockets_live_never_makes_root_chown_a_file(make_cluster):
    cluster = make_cluster(1, cores=2, own_etcd=True)  # (its etcd goes down and up with it)
    shown = cluster.gang("run", "-n", 1, "--", "/bin/sh", "-c", "echo COMM=$GANGD_COMM_DIR", check=True).stdout
    runtime = Path(shown.split("COMM=", 1)[1].split()[0]).parent  # where this node keeps every job's directory
    victim = _tmpdir()  # stands for /etc: root's
    lair = _tmpdir(owner=NOBODY, mode=0o700)  # the attacker's own directory
    local.down(cluster.dir)  # the daemon is down (a reboot, an upgrade)...

    def plant():
        # ...and the user puts a link to their own directory where the runtime
        # directory will be, with job-N -> the victim inside for the next jobs.
        for job in range(1, 40):
            os.symlink(victim, lair / f"job-{job}")
        try:
            if os.path.lexists(runtime):
                for job in range(1, 40):
                    os.symlink(victim, runtime / f"job-{job}")
            else:
                os.symlink(lair, runtime)
        except OSError as exc:
            return {"planted": False, "why": exc.strerror}
        return {"planted": True}

    try:
        planted = as_uid(NOBODY, plant)
        local.up(cluster.dir, 1, cores=2)
        # A job of the user starts: root prepares its directory. The job
        # leaves links to the victim in it for root to remove at its end.
        (victim / "keep").write_text("root's")
        script = (f"echo hello from $(id -u) in $GANGD_COMM_DIR; ln -s {victim} $GANGD_COMM_DIR/escape; "
                  f"mkdir $GANGD_COMM_DIR/d; ln -s {victim} $GANGD_COMM_DIR/d/x")
        job = _submit_as_nobody(cluster, ["/bin/sh", "-c", script], 1)
        record = cluster.wait_state(job, ("DONE", "FAILED", "KILLED"), timeout=30)
        info = os.stat(victim)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o755), f"root chowned the victim to uid {info.st_uid} ({planted})"
        assert record["state"] == "DONE", record
        logs = cluster.gang("logs", job, check=True).stdout
        assert f"hello from {NOBODY}" in logs
        comm = Path(logs.split(" in ", 1)[1].split()[0])
        deadline = time.monotonic() + 20
        while os.path.lexists(comm):
            assert time.monotonic() < deadline, f"{comm} was not removed after the job ended"
            time.sleep(0.1)
        assert (victim / "keep").read_text() == "root's"  # the removal did not follow the links
        # Nothing of the user's made it into the runtime directory.
        assert not os.path.islink(runtime) and os.stat(runtime).st_uid == 0
        assert not planted["planted"], planted
    finally:
        if os.path.islink(runtime):
            os.unlink(runtime)
        shutil.rmtree(victim, ignore_errors=True)
        shutil.rmtree(lair, ignore_errors=True)


def test_a_runtime_directory_that_is_a_link_or_not_roots_stops_the_daemon_with_the_reason(make_cluster):
    cluster = make_cluster(1, cores=2, own_etcd=True)  # (its etcd goes down and up with it)
    runtime = cluster.files["n1"].dir / "jobs"
    lair = _tmpdir(owner=NOBODY, mode=0o755)
    try:
        for spoil, expected in (
            (lambda: (shutil.rmtree(runtime, ignore_errors=True), os.symlink(lair, runtime)), "is a symbolic link"),
            (lambda: (os.unlink(runtime), os.mkdir(runtime), os.chown(runtime, NOBODY, NOBODY)), f"belongs to uid {NOBODY}"),
            (lambda: (os.chown(runtime, 0, 0), os.chmod(runtime, 0o777)), "writable by other users"),
        ):
            local.down(cluster.dir)
            spoil()
            with pytest.raises(local.ClusterError) as refused:
                local.up(cluster.dir, 1, cores=2, timeout=15)
            assert "refusing the runtime directory" in str(refused.value) and expected in str(refused.value), str(refused.value)
            assert str(runtime) in str(refused.value)
    finally:
        shutil.rmtree(lair, ignore_errors=True)


# ---------------------------------------------------------------- finding 3: files root parses


def test_checkpoint_files_root_parses_are_roots_and_an_oversized_manifest_is_a_clear_error(make_cluster):
    cluster = make_cluster(2, cores=2)
    job = _submit_as_nobody(cluster, [NOBODY_PY, JOB, "--steps", "400", "--sleep", "0.01"], 4)
    cluster.wait_state(job, "RUNNING")
    older = checkpoint(cluster, job)
    time.sleep(0.3)
    newer = checkpoint(cluster, job)
    assert older["state"] == newer["state"] == "complete", (older.get("reason"), newer.get("reason"))
    newest = gen_dir(cluster, "n1", job, newer["gen"])
    # What the daemon wrote is root's and private; ranks/ is the owner's.
    for node in ("n1", "n2"):
        directory = gen_dir(cluster, node, job, newer["gen"])
        for entry in os.scandir(directory):
            info = entry.stat(follow_symlinks=False)
            if entry.name == ckptstore.RANKS_DIR:
                assert info.st_uid == NOBODY and stat.S_IMODE(info.st_mode) == 0o700
            elif entry.name == "redundancy":  # (a partner's copy: root's alone, its ranks' files too)
                assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o700), (entry.path, info.st_uid, oct(info.st_mode))
            else:
                assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600), (entry.path, info.st_uid, oct(info.st_mode))

    # The job's owner cannot blow up what root reads back.
    def blow_up():
        try:
            os.truncate(newest / ckptstore.MANIFEST, 64 << 30)
        except OSError as exc:
            return {"done": False, "why": exc.strerror}
        return {"done": True}

    assert as_uid(NOBODY, blow_up) == {"done": False, "why": "Permission denied"}
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, ("KILLED", "FAILED", "DONE"))
    # A manifest that is far too large (a sparse 64 GB file: what a rewrite
    # by its owner did before, or a damaged disk) is refused unread.
    os.truncate(newest / ckptstore.MANIFEST, 64 << 30)
    answer = json.loads(cluster.gang("restart", job, "--json", check=True, timeout=120).stdout)
    assert answer["gen"] == older["gen"], answer
    manifest = str(newest / ckptstore.MANIFEST)
    assert any("n1" in s and manifest in s and "bytes" in s for s in answer["skipped"]), answer["skipped"]
    _alive(cluster)
    restarted = answer["record"]["id"]
    assert cluster.wait_state(restarted, ("RUNNING", "DONE"), timeout=60)["owner"] == "nobody"
    cluster.gang("kill", restarted)
    asked = cluster.gang("restart", job, "-g", newer["gen"], timeout=120)
    assert asked.returncode != 0 and manifest in asked.stderr and "n1" in asked.stderr, asked.stderr
    _alive(cluster)
    kill_what_is_left(cluster)


def test_a_link_the_owner_puts_among_the_rank_states_is_not_followed(make_cluster):
    cluster = make_cluster(1, cores=2)
    job = _submit_as_nobody(cluster, [NOBODY_PY, JOB, "--steps", "400", "--sleep", "0.01"], 2)
    cluster.wait_state(job, "RUNNING")
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    cluster.gang("kill", job, check=True)
    state = gen_dir(cluster, "n1", job, gen["gen"]) / ckptstore.cluster_rank_file(1)
    secret = _tmpdir(mode=0o700) / "secret"
    secret.write_bytes(os.urandom(int(state.stat().st_size)))  # the same size: only a followed link tells

    def swap():
        os.unlink(state)
        os.symlink(secret, state)
        return True

    try:
        assert as_uid(NOBODY, swap) is True
        refused = cluster.gang("restart", job, timeout=120)
        assert refused.returncode != 0 and str(state) in refused.stderr and "symbolic link" in refused.stderr, refused.stderr
        _alive(cluster)
    finally:
        shutil.rmtree(secret.parent, ignore_errors=True)


# ---------------------------------------------------------------- finding 11: checkpoint_dir


def test_nodes_sharing_a_checkpoint_dir_keep_their_generations_apart_and_restart(make_cluster):
    shared = _tmpdir()  # stands for /scratch/gangd on a shared file system
    try:
        cluster = make_cluster(2, cores=2, checkpoint_dir=shared)
        argv = [JOB, "--steps", "300", "--sleep", "0.01"]
        job = int(cluster.gang("submit", "-n", 4, "--", PY, *argv, check=True).stdout)
        cluster.wait_state(job, "RUNNING")
        gen = checkpoint(cluster, job)  # (asked again while a rank has not reached ckpt.init())
        assert gen["state"] == "complete", gen
        ranks: set[int] = set()
        for node in ("n1", "n2"):
            directory = ckptstore.gen_dir(shared / node, job, gen["gen"])
            manifest = ckptstore.read_manifest(directory)
            assert manifest.node == node and manifest.ranks, manifest
            ranks.update(manifest.ranks)
            assert ckptstore.verify(directory) == []
        assert ranks == {0, 1, 2, 3}
        cluster.gang("kill", job, check=True)
        answer = json.loads(cluster.gang("restart", job, "--json", check=True, timeout=120).stdout)
        assert answer["gen"] == gen["gen"] and answer["skipped"] == [], answer
        plain = int(cluster.gang("submit", "-n", 4, "--", PY, JOB, "--steps", "300", check=True).stdout)
        assert result_of(cluster, answer["record"]["id"], timeout=120) == result_of(cluster, plain, timeout=120)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize("how", ["link", "group-writable", "not-roots", "link-below"])
def test_a_checkpoint_dir_root_cannot_trust_is_refused_at_start(how):
    base = _tmpdir()
    real = base / "real"
    real.mkdir(mode=0o755)
    checkpoint_dir, expected = real, ""
    if how == "link":
        checkpoint_dir, expected = base / "ckpt", "is a symbolic link"
        os.symlink(real, checkpoint_dir)
    elif how == "group-writable":
        os.chmod(real, 0o775)
        expected = "writable by its group"
    elif how == "not-roots":
        os.chown(real, NOBODY, NOBODY)
        expected = f"belongs to uid {NOBODY}"
    else:  # the node's own directory in it, planted as a link
        os.symlink(base, real / "n1")
        expected = "is a symbolic link"
    try:
        with pytest.raises(local.ClusterError) as refused:
            up(base / "cluster", 1, cores=2, checkpoint_dir=checkpoint_dir, timeout=15)
        message = str(refused.value)
        assert "refusing the checkpoint directory" in message and expected in message, message
    finally:
        local.down(base / "cluster")
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- the helpers themselves


def test_safefs_refuses_links_anywhere_on_the_path_and_files_past_their_limit():
    from gangd import safefs

    base = _tmpdir()
    try:
        (base / "real" / "deeper").mkdir(parents=True, mode=0o755)
        os.symlink(base / "real", base / "alias")
        with pytest.raises(safefs.UnsafePath, match="alias is a symbolic link"):
            safefs.open_trusted_dir(base / "alias" / "deeper")
        with pytest.raises(safefs.UnsafePath, match="alias is a symbolic link"):
            safefs.open_trusted_dir(base / "alias" / "new", create_mode=0o711)
        assert not (base / "real" / "new").exists()
        fd = safefs.open_trusted_dir(base / "real" / "made" / "here", create_mode=0o711)
        try:
            assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o711 and os.fstat(fd).st_uid == 0
            # A sparse 64 GB file is refused unread; a link to a file is not followed.
            with open(base / "real" / "made" / "here" / "big", "wb") as fh:
                fh.truncate(64 << 30)
            with pytest.raises(safefs.UnsafePath, match="68719476736 bytes, more than the 1024"):
                safefs.read_bounded_at(fd, "big", 1024, base)
            os.symlink("/etc/hostname", base / "real" / "made" / "here" / "link")
            with pytest.raises(safefs.UnsafePath, match="is a symbolic link"):
                safefs.read_bounded_at(fd, "link", 1024, base)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_safefs_rmtree_removes_the_links_a_user_left_not_what_they_point_to():
    from gangd import safefs

    base = _tmpdir()
    try:
        victim = base / "victim"
        victim.mkdir()
        (victim / "keep").write_text("root's")
        owned = base / "runtime" / "job-1"
        owned.mkdir(parents=True)
        os.chown(owned, NOBODY, NOBODY)

        def litter():
            os.symlink(victim, owned / "escape")
            (owned / "d").mkdir()
            os.symlink(victim, owned / "d" / "x")
            os.symlink(victim / "keep", owned / "file")
            return True

        assert as_uid(NOBODY, litter) is True
        fd = safefs.open_trusted_dir(base / "runtime")
        try:
            safefs.rmtree_at(fd, "job-1")
            assert os.listdir(fd) == []
            os.symlink(victim, base / "runtime" / "job-2")  # the entry itself a link
            safefs.rmtree_at(fd, "job-2")
            assert os.listdir(fd) == []
        finally:
            os.close(fd)
        assert (victim / "keep").read_text() == "root's"
    finally:
        shutil.rmtree(base, ignore_errors=True)
