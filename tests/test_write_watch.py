"""The kernel's record of written pages stands in for hashing unchanged blocks (issue 17, gangd.ckptlib.dirty).

A checkpoint that trusts "not written since the base's cut" and copies the
base's hashes must never miss a write: a missed one would leave a changed
block out of the delta and restore the old bytes. So every test here writes
real memory (numpy stores, the kernel copying into an array through
``readinto``, a forked child writing its own copy, huge pages) and checks
the watch's answer against the writes made, and the generations written
with it against generations written by hashing every block: the same
signature, the same restore.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from conftest import kernel_watch
from deltahelpers import Generations, assert_same_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd.ckptlib import blocks, dirty

B = 16 << 10


def written_blocks(arr: np.ndarray, flat_indices) -> np.ndarray:
    out = np.zeros(-(-arr.nbytes // B), dtype=bool)
    out[(np.asarray(flat_indices, dtype=np.int64) * arr.itemsize) // B] = True
    return out


def assert_covers(watch, name, gen, arr, must) -> np.ndarray:
    """The watch's answer since ``gen``: every block in ``must`` is reported written."""
    keep = watch.unchanged(name, gen, arr.ctypes.data, arr.nbytes, B)
    assert keep is not None, f"the watch does not know {name} since generation {gen}"
    missed = np.flatnonzero(must & keep)
    assert not missed.size, f"blocks {missed[:10].tolist()} were written and reported unchanged"
    return keep


def test_a_written_block_is_never_reported_unchanged_and_an_unwritten_one_is(watch):
    a = np.arange((8 << 20) // 8, dtype=np.float64)
    watch.cut(1, {"a": a}, B)
    rng = np.random.default_rng(1)
    idx = rng.choice(a.size, 40, replace=False)
    a[idx] += 1
    watch.cut(2, {"a": a}, B)
    keep = assert_covers(watch, "a", 1, a, written_blocks(a, idx))
    # Page granularity: a page straddling two blocks marks both; nothing else is reported.
    neighbours = written_blocks(a, idx)
    neighbours[1:] |= neighbours[:-1]
    neighbours[:-1] |= written_blocks(a, idx)[1:]
    assert not np.flatnonzero(~keep & ~neighbours & ~watch.tracked["a"].edges).size
    assert keep.sum() > 0.8 * keep.size  # (40 writes in 512 blocks: most stay unchanged)
    since_2 = watch.unchanged("a", 2, a.ctypes.data, a.nbytes, B)
    assert since_2 is not None and np.array_equal(~since_2, watch.tracked["a"].edges)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, (2 << 20) // 8 - 1), max_size=40), min_size=1, max_size=6), st.integers(0, 7))
def test_written_since_each_recent_cut_is_the_union_of_the_writes_after_it(watch, rounds, shift):
    """Any writes between any cuts: since each cut, at least every block written after it."""
    base = np.zeros((2 << 20) // 8 + 8, dtype=np.float64)
    a = base[shift : shift + (2 << 20) // 8]  # (an array starting anywhere in a page: the edge blocks)
    made: dict[int, np.ndarray] = {}
    gen = 100
    watch.cut(gen, {"a": a}, B)
    made[gen] = np.zeros(-(-a.nbytes // B), dtype=bool)
    for writes in rounds:
        a[writes] += 1.0
        for g in made:
            made[g] |= written_blocks(a, writes)
        gen += 1
        watch.cut(gen, {"a": a}, B)
        made[gen] = np.zeros_like(made[gen - 1])
        for g, must in made.items():
            assert_covers(watch, "a", g, a, must)
    watch._drop("a")


def test_writes_by_the_kernel_and_after_a_fork_are_seen_and_a_child_s_are_not(watch, tmp_path):
    a = np.zeros((4 << 20) // 8, dtype=np.float64)
    watch.cut(1, {"a": a}, B)
    source = tmp_path / "bytes"
    source.write_bytes(b"\x01" * 8192)
    with open(source, "rb") as fh:
        fh.readinto(memoryview(a).cast("B")[B * 50 : B * 50 + 8192])  # (the kernel's copy_to_user into the array)
    pid = os.fork()
    if pid == 0:  # (the child's copy: its writes are its own)
        a[(B * 100) // 8] = 7.0
        os._exit(0)
    a[(B * 150) // 8] = 5.0  # (after the fork: a copy-on-write fault, and a written page)
    os.waitpid(pid, 0)
    watch.cut(2, {"a": a}, B)
    keep = assert_covers(watch, "a", 1, a, written_blocks(a, [(B * 50) // 8, (B * 150) // 8]))
    assert keep[100], "the child's write to its own copy was reported as the parent's"


def test_huge_pages_are_tracked_page_by_page(watch):
    a = np.zeros((64 << 20) // 8, dtype=np.float64)  # (numpy asks for transparent huge pages at this size)
    a[:] = 1.0
    watch.cut(1, {"a": a}, B)
    idx = np.arange(0, a.size, (4 << 20) // 8) + 3  # (one element in every other 2 MiB page)
    a[idx] = 2.0
    watch.cut(2, {"a": a}, B)
    keep = assert_covers(watch, "a", 1, a, written_blocks(a, idx))
    assert (~keep).sum() <= 3 * len(idx) + 2, f"{(~keep).sum()} blocks reported for {len(idx)} writes"


def test_an_array_written_all_over_rests_untracked_then_is_tried_again(watch):
    a = np.zeros((1 << 20) // 8, dtype=np.float64)
    watch.cut(1, {"a": a}, B)
    a += 1.0
    watch.cut(2, {"a": a}, B)  # (written all over since 1: tracking it costs more than hashing it)
    assert "a" not in watch.tracked and watch.unchanged("a", 1, a.ctypes.data, a.nbytes, B) is None
    for gen in range(3, 2 + dirty.RETRY_AFTER):
        a[0] += 1.0
        watch.cut(gen, {"a": a}, B)
        assert "a" not in watch.tracked
    watch.cut(2 + dirty.RETRY_AFTER, {"a": a}, B)
    assert "a" in watch.tracked
    a[5] += 1.0
    watch.cut(3 + dirty.RETRY_AFTER, {"a": a}, B)  # (sparse now: it stays)
    assert_covers(watch, "a", 2 + dirty.RETRY_AFTER, a, written_blocks(a, [5]))
    a += 1.0
    watch.cut(4 + dirty.RETRY_AFTER, {"a": a}, B)  # (dense again: it rests twice as long)
    assert "a" not in watch.tracked and watch.resting["a"] == 4 + 3 * dirty.RETRY_AFTER


def test_another_array_under_the_same_name_or_an_unknown_generation_is_not_known(watch):
    a = np.zeros((1 << 20) // 8, dtype=np.float64)
    watch.cut(1, {"a": a, "small": np.zeros(10)}, B)
    assert watch.unchanged("small", 1, 0, 80, B) is None  # (small values are hashed: microseconds)
    assert watch.unchanged("a", 0, a.ctypes.data, a.nbytes, B) is None  # (not cut by this process: after a restart)
    assert watch.unchanged("a", 1, a.ctypes.data, a.nbytes, 2 * B) is None  # (another block size)
    b = a.copy()
    watch.cut(2, {"a": b}, B)
    assert watch.unchanged("a", 1, b.ctypes.data, b.nbytes, B) is None
    assert watch.unchanged("a", 2, b.ctypes.data, b.nbytes, B) is not None
    watch.cut(3, {}, B)
    assert not watch.tracked


def test_generations_written_with_the_watch_are_those_hashing_every_block_writes(watch, tmp_path, monkeypatch):
    """Incremental and differential chains of a sparse app, each generation
    written twice (once with the watch, once without): the same role,
    signature and stored blocks, restored bit-identical; and the watch
    hashed a fraction of the blocks."""
    hashed = {"n": 0}
    real = blocks._hash

    def counting(data):
        hashed["n"] += 1
        return real(data)

    monkeypatch.setattr(blocks, "_hash", counting)
    rng = np.random.default_rng(5)
    values = {"u": rng.random((16 << 20) // 8), "meta": {"step": 0}, "small": np.arange(10)}
    for mode in ("incremental", "differential", "adaptive"):
        tracked, plain = Generations(tmp_path / mode / "w"), Generations(tmp_path / mode / "p")
        tracked.directory.mkdir(parents=True)
        plain.directory.mkdir(parents=True)
        counts = []
        for gen in range(1, 7):
            if gen > 1:
                u = values["u"]
                assert isinstance(u, np.ndarray)
                u[rng.choice(u.size, 40, replace=False)] += 1.0
                values["meta"] = {"step": gen}
            watch.cut(gen, values, B)
            parent = gen - 1 if gen > 1 else None
            before = hashed["n"]
            w = tracked.write(gen, values, parent, mode=mode, block=B, watch=watch)
            counts.append(hashed["n"] - before)
            p = plain.write(gen, values, parent, mode=mode, block=B)
            assert (w["role"], w["links"]) == (p["role"], p["links"]), (mode, gen, w, p)
            iw, ip = blocks.read_index(tracked.path(gen)), blocks.read_index(plain.path(gen))
            for ew, ep in zip(iw.entries, ip.entries, strict=True):
                assert ew.name == ep.name and np.array_equal(ew.present, ep.present), (mode, gen, ew.name)
                assert (ew.signature is None) == (ep.signature is None) and (ew.signature is None or np.array_equal(ew.signature, ep.signature))
            assert_same_values(tracked.restore(gen)[0], values)
        nblocks = (16 << 20) // B
        assert max(counts[2:]) < nblocks // 4, (mode, counts)  # (a delta hashes the written blocks, not 1024)
        watch._drop("u")


def test_off_in_the_environment_means_every_block_is_hashed():
    code = "from gangd.ckptlib import dirty; print(dirty.watch())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GANGD_CKPT_WRITE_WATCH": "off"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None"
    kernel_watch().close()  # (this kernel can: the default is on)
    out = subprocess.run([sys.executable, "-c", code], env={k: v for k, v in os.environ.items() if k != "GANGD_CKPT_WRITE_WATCH"},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("<gangd.ckptlib.dirty.WriteWatch"), out


def test_a_job_s_user_without_privileges_has_it_too():
    """Ranks run as the job's owner: user-mode-only faults need no privilege
    (vm.unprivileged_userfaultfd stays 0). In a forked child that dropped to uid 65534."""
    from conftest import as_uid

    kernel_watch().close()

    def probe():
        import ctypes

        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # (PR_SET_DUMPABLE: as a rank exec'd after the drop is; this fork is not)
        w = dirty.WriteWatch(dirty._Kernel())
        a = np.zeros((1 << 20) // 8)
        w.cut(1, {"a": a}, B)
        a[1000] = 1.0
        w.cut(2, {"a": a}, B)
        keep = w.unchanged("a", 1, a.ctypes.data, a.nbytes, B)
        return {"uid": os.getuid(), "written": None if keep is None else np.flatnonzero(~keep).tolist()}

    got = as_uid(65534, probe)
    assert got.get("uid") == 65534, got
    assert got["written"] is not None and (1000 * 8) // B in got["written"] and len(got["written"]) <= 4, got
