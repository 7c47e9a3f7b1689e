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

import json
import os
import re
import subprocess
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
    image = tmp_path / "disk.img"
    with open(image, "wb") as fh:
        fh.truncate(96 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(image)], check=True)
    directory = gc.dir / "n2" / "state" / "checkpoints" / "n2"  # (n2's checkpoint root)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(directory)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")
    try:
        directory.chmod(0o711)
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
        kill_what_is_left(gc)
        if subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


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
