"""A restart's verification without reading every byte again, and what it still catches (issue 16's restart speed).

Before a restart every node checks its files of the generation against the
manifest, so that a damaged generation is skipped for an older one before
any rank starts. A node now reads only the files that changed since they were
last found intact (gangd.daemon.verified: their identity and times at commit
or at the last whole-file check): a file written, truncated or replaced
through the file system is still read whole and the generation skipped
(tests/test_checkpoint.py's test_corrupted_or_truncated_files_fall_back_to_an_older_generation).

Damage below the file system does not change a file's times: a real ext4
on a real loop device, a byte flipped in its backing image. The ranks' own
checks find it as they restore; the restarted job fails naming the file, the
generation is checked whole and marked damaged, and the next restart starts
from the older generation, bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from ckpthelpers import TERMINAL, checkpoint, gen_dir, generations, hold, kill_what_is_left, reference, result_of, settled, submit, wait_holding
from conftest import shared_cluster, wait_for

from gangd import ckptstore
from gangd.daemon.verified import Verified

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounting a loop device)")


@pytest.fixture(scope="module")
def gc():
    with shared_cluster(2, cores=2) as cluster:
        yield cluster


def rot(image: Path, path: Path, offset: int) -> None:
    """Flip the byte at ``offset`` of ``path`` (on the ext4 in ``image``) in
    the image itself, beneath the file system — as a failing disk would —,
    and drop the file's cached pages so that the next read sees it."""
    found = subprocess.run(["filefrag", "-v", "-b4096", str(path)], capture_output=True, text=True, check=True).stdout
    extents = [tuple(map(int, m.groups())) for m in re.finditer(r"^\s*\d+:\s+(\d+)\.\.\s*(\d+):\s+(\d+)\.\.", found, re.MULTILINE)]
    block = offset // 4096
    start = next(p + block - lo for lo, hi, p in extents if lo <= block <= hi)
    with open(image, "r+b") as disk:
        disk.seek(start * 4096 + offset % 4096)
        byte = disk.read(1)
        disk.seek(start * 4096 + offset % 4096)
        disk.write(bytes([byte[0] ^ 0xFF]))
        disk.flush()
        os.fsync(disk.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@root_only
def test_damage_below_the_file_system_fails_the_restore_naming_the_file_and_the_next_restart_uses_the_older_generation(gc, tmp_path):
    with ext4_at(gc.dir / "n2" / "state" / "checkpoints" / "n2", tmp_path) as image:  # (n2's checkpoint root)
        try:
            argv = [JOB, "--steps", "300", "--mb", "1"]
            expected = reference(gc, argv)
            held, release = hold(gc, 150)
            job = submit(gc, [*argv, *held])
            wait_holding(gc, job)
            older = checkpoint(gc, job)
            newer = checkpoint(gc, job)
            assert older["state"] in ("complete", "protected") and newer["state"] in ("complete", "protected"), (older, newer)
            settled(gc, job)  # (the partner copies are written behind the job: nothing reads the files after this)
            gc.gang("kill", job, check=True)
            gc.wait_state(job, TERMINAL, timeout=60)
            release.touch()
            victim = gen_dir(gc, "n2", job, newer["gen"]) / ckptstore.cluster_rank_file(3)
            stamp = victim.stat()
            rot(image, victim, stamp.st_size // 2)
            now = victim.stat()
            assert (now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (stamp.st_ino, stamp.st_size, stamp.st_mtime_ns, stamp.st_ctime_ns)
            assert any("corrupted" in p for p in ckptstore.verify(victim.parent if victim.parent.name != "ranks" else victim.parent.parent))

            # The file looks untouched: the restart does not read it again, and the rank's own check finds the damage.
            first = json.loads(gc.gang("restart", job, "--json", check=True).stdout)
            assert first["gen"] == newer["gen"], first
            failed = gc.wait_state(first["record"]["id"], TERMINAL, timeout=90)
            assert failed["state"] == "FAILED" and victim.name in (failed["reason"] or "") and "rank 3" in failed["reason"], failed
            # ... and has the generation checked whole, and marked damaged, naming node and file.
            entry = wait_for(lambda: next((g for g in generations(gc, job) if g["gen"] == newer["gen"] and g["state"] == "damaged"), None),
                             60, "the generation to be marked damaged")
            assert "n2" in entry["reason"] and str(victim) in entry["reason"], entry

            # The next restart starts from the older generation, and the job ends as an uninterrupted run does.
            second = json.loads(gc.gang("restart", first["record"]["id"], "--json", check=True).stdout)
            assert second["gen"] == older["gen"], second
            assert result_of(gc, second["record"]["id"], timeout=120) == expected
        finally:
            kill_what_is_left(gc)  # (before the unmount: no rank holds a file there)


@contextlib.contextmanager
def ext4_at(directory: Path, tmp: Path):
    """A fresh ext4 on a loop device mounted at ``directory`` (a node's
    checkpoint root): yields its backing image, for :func:`rot`."""
    image = tmp / "disk.img"
    with open(image, "wb") as fh:
        fh.truncate(96 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(image)], check=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(directory)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")
    try:
        directory.chmod(0o711)
        yield image
    finally:
        if subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


@root_only
@pytest.mark.parametrize("report", ["prompt", "slow"])
def test_a_recovered_job_whose_generation_is_damaged_below_the_file_system_comes_back_from_the_older_one_by_itself(
        make_cluster, points, tmp_path, report):
    """A 3-node partner job with two protected generations; the newer one's
    file on a surviving node rotted beneath its ext4 (its times unchanged,
    so the recovery's verification trusts it); a third node lost with its
    disk. The recovery restarts the job from the newer generation, a rank's
    own check finds the damage, and nobody is there to run `gang restart`
    again: the recovered job is recovered once more, from the older
    generation (its lost node's files rebuilt again), the damage marked,
    named and shown, and the computation ends bit-identical, `gang wait` on
    the first id following it. ``slow``: the coordinator is held before it
    handles the node's report that the restore failed; the failing rank has
    exited, and its exit must not end the job FAILED before the report is
    heard (the node reports such exits after it)."""
    from test_recovery import ARGV, ENDED, coordinator, held, lose, running, wait_protected

    gc = make_cluster(3, cores=2, time_slice=0.1)
    try:
        lead = coordinator(gc)
        rotted = next(n for n in ("n1", "n2", "n3") if n != lead)
        victim = next(n for n in ("n1", "n2", "n3") if n not in (lead, rotted))
        with ext4_at(gc.dir / rotted / "state" / "checkpoints" / rotted, tmp_path) as image:
            expected = reference(gc, ARGV, 3, "--per-node", "1")
            argv, release = held(gc)
            job = submit(gc, argv, 3, "--per-node", "1", "--ckpt-redundancy", "partner")
            record = running(gc, job)
            older = checkpoint(gc, job)
            newer = checkpoint(gc, job)
            for taken in (older, newer):
                wait_protected(gc, job, taken["gen"])
            rank = record["placement"].index(rotted)
            bad = gen_dir(gc, rotted, job, newer["gen"]) / ckptstore.cluster_rank_file(rank)
            before = bad.stat()
            rot(image, bad, before.st_size // 2)
            assert bad.stat().st_ctime_ns == before.st_ctime_ns
            waiter = gc.popen_gang("wait", job, "--json")
            if report == "slow":
                (points / "restore.reported").touch()
            lose(gc, victim)
            release.touch()

            first = gc.wait_state(job, ENDED, timeout=120)
            assert first["state"] == "REQUEUED", first
            if report == "slow":
                said = f"job {first['requeued_as']}: node {rotted} says its ranks could not restore their state"
                wait_for(lambda: said in gc.log(lead), 120, "the coordinator to hold the report")
                time.sleep(3)  # (unheld, the failing rank's exit and its peers' would end the job well within this)
                assert gc.job(first["requeued_as"])["state"] == "RUNNING", gc.job(first["requeued_as"])
                (points / "restore.reported").unlink()
            second = gc.wait_state(first["requeued_as"], ENDED, timeout=180)
            assert second["state"] == "REQUEUED", second
            assert second["restart_of"]["gen"] == newer["gen"], second["restart_of"]
            third = second["requeued_as"]
            assert second["reason"].startswith(f"generation {newer['gen']} could not be restored on {rotted}; requeued as job {third} "
                                               f"from generation {older['gen']}"), second["reason"]
            assert f"rank {rank}" in second["recovery"]["why"] and bad.name in second["recovery"]["why"], second["recovery"]
            recovered = gc.job(third)
            assert recovered["restart_of"]["gen"] == older["gen"] and recovered["recoveries"] == 2, recovered
            assert victim not in recovered["placement"], recovered["placement"]
            damaged = next(g for g in generations(gc, third) if g["gen"] == newer["gen"])
            assert damaged["state"] == "damaged" and rotted in damaged["reason"] and str(bad) in damaged["reason"], damaged
            assert result_of(gc, third, timeout=240) == expected
            out, err = waiter.communicate(timeout=120)
            assert waiter.returncode == 0, err
            assert json.loads(out)["id"] == third  # (followed through both recoveries)
            ls = gc.gang("ckpt", "ls", third, check=True).stdout
            assert f"recovery: job {job} lost {victim}; requeued as job {second['id']}" in ls, ls
            assert f"recovery: job {second['id']} stopped: generation {newer['gen']} could not be restored on {rotted}; requeued as job {third}" in ls, ls
    finally:
        kill_what_is_left(gc)


@pytest.mark.parametrize("codec", ["downgraded", "removed"])
def test_a_recovered_job_whose_ranks_cannot_restore_intact_files_fails_saying_why(make_cluster, tmp_path, codec):
    """The other outcome of a recovered job's failed restore: its files read
    whole and found intact. The generation was compressed with a plug-in
    codec (a real installed distribution on the job's PYTHONPATH) whose
    package is then downgraded on every machine to a version that cannot
    read it; a node is lost. Every rank of the recovered job says the block
    was written in a newer version of the codec. An older generation would
    not help (the machines lack the codec, not the files their bytes), so
    the job fails with the ranks' sentence, which names the codec and what
    to do; the generation is not marked damaged and stays usable once the
    codec is upgraded again. ``removed``: the package is gone altogether,
    and the ranks' ``ckpt.init()`` refuses the job's codec before anything
    is restored; they tell their node so all the same (not just "exit 1")."""
    from codechelpers import ZLIB_PLUGIN, dist
    from test_recovery import ENDED, coordinator, held, lose, running, wait_protected

    plugin = tmp_path / "plugin"
    plugin.mkdir()
    dist(plugin, "gangd-zlibtest", "zlibtest = gangd_zlibtest:make", {"gangd_zlibtest": ZLIB_PLUGIN})
    os.chmod(tmp_path, 0o755)
    gc = make_cluster(3, cores=2, time_slice=0.1)
    try:
        lead = coordinator(gc)
        victim = next(n for n in ("n1", "n2", "n3") if n != lead)
        argv, release = held(gc)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")]))}
        job = submit(gc, argv, 3, "--per-node", "1", "--ckpt-redundancy", "partner", "--ckpt-codec", "zlibtest:1", env=env)
        running(gc, job)
        taken = checkpoint(gc, job)
        wait_protected(gc, job, taken["gen"])
        module = plugin / "gangd_zlibtest.py"
        if codec == "downgraded":
            module.write_text(module.read_text().replace("version = 2", "version = 1"))  # (on every machine)
        else:
            plugin.rename(tmp_path / "uninstalled")
        lose(gc, victim)
        release.touch()

        first = gc.wait_state(job, ENDED, timeout=120)
        assert first["state"] == "REQUEUED", first
        second = gc.wait_state(first["requeued_as"], ENDED, timeout=180)
        assert second["state"] == "FAILED", second
        assert second["restart_of"]["gen"] == taken["gen"] and second["recoveries"] == 1, second
        assert "zlibtest" in second["reason"], second["reason"]
        assert ("upgrade the package" if codec == "downgraded" else "pip install") in second["reason"], second["reason"]
        entry = next(g for g in generations(gc, second["id"]) if g["gen"] == taken["gen"])
        assert entry["state"] == "protected", entry  # (intact: not marked damaged)
        assert "the generation's files are intact (read whole on every node)" in second["reason"], second["reason"]
    finally:
        kill_what_is_left(gc)


# ---------------------------------------------------------------- the node's memory of intact files


def test_a_file_is_taken_as_intact_only_while_it_is_the_same_file_with_the_same_checksum(tmp_path):
    path = tmp_path / "rank-0.ckpt"
    path.write_bytes(b"x" * 4096)
    known = Verified()
    assert not known.intact(tmp_path, path.name, path.stat(), "d1")  # (never checked)
    known.record(tmp_path, path.name, path.stat(), "d1")
    assert known.intact(tmp_path, path.name, path.stat(), "d1")
    assert not known.intact(tmp_path, path.name, path.stat(), "d2")  # (a manifest rewritten since: another checksum)
    assert not known.intact(tmp_path / "other", path.name, path.stat(), "d1")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 1_000_000_000))  # (a touch changes the times)
    assert not known.intact(tmp_path, path.name, path.stat(), "d1")
    known.record(tmp_path, path.name, path.stat(), "d1")
    replacement = tmp_path / "new"
    replacement.write_bytes(path.read_bytes())
    os.utime(replacement, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    replacement.rename(path)  # (the same bytes and times in another file: not the file that was checked)
    assert not known.intact(tmp_path, path.name, path.stat(), "d1")
    known.record(tmp_path, path.name, path.stat(), "d1")
    known.forget(tmp_path)
    assert not known.intact(tmp_path, path.name, path.stat(), "d1")


def test_the_memory_of_intact_files_is_bounded_oldest_forgotten_first(tmp_path):
    known = Verified(max_files=3)
    st = tmp_path.stat()
    for n in range(5):
        known.record(tmp_path, f"f{n}", st, "d")
    assert [known.intact(tmp_path, f"f{n}", st, "d") for n in range(5)] == [False, False, True, True, True]
