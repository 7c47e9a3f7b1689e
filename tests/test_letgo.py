"""A forked snapshot lets go of the job's pages once it has copied them (gangd.ckptlib.letgo, issue 18).

Real forks: the snapshot's view of the pages is dropped (its copy reads
zeros), the job's own stays as it was and is the job's alone again (the
kernel's pagemap says "exclusively mapped", so its next write copies
nothing), and a background generation whose signature is hashed after its
blocks are written still hashes the state at the fork, not zeros.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable

import numpy as np
import pytest

from gangd.ckptlib import blocks, letgo, writer
from gangd.ckptlib.core import DeltaSettings

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_DONTNEED and /proc/self/pagemap are Linux's")

PAGE = os.sysconf("SC_PAGE_SIZE")
EXCLUSIVE = 1 << 56  # /proc/PID/pagemap: the page is mapped by this process only (Linux 4.2)


def exclusive_pages(array: np.ndarray) -> tuple[int, int]:
    """(pages of ``array``'s interior this process maps exclusively, pages in all)."""
    low = array.__array_interface__["data"][0]
    first, last = -(-low // PAGE), (low + array.nbytes) // PAGE
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        raw = fh.read((last - first) * 8)
    entries = struct.unpack(f"<{last - first}Q", raw)
    return sum(1 for e in entries if e & EXCLUSIVE), last - first


def huge_aligned(nbytes: int) -> np.ndarray:
    """float64 values 0, 1, ... in ``nbytes`` starting and ending on a huge page boundary (2 MiB): a
    transparent huge page half inside an array stays shared with the snapshot, which keeps the half
    outside (the job's other memory), so only an array of whole huge pages is wholly the job's again."""
    huge = 2 << 20
    room = np.empty(nbytes + huge, dtype=np.uint8)
    skip = -room.__array_interface__["data"][0] % huge
    array = room[skip : skip + nbytes].view(np.float64)
    array[:] = np.arange(nbytes // 8)
    return array


def in_snapshot(work: Callable[[], tuple[int, ...]], meanwhile: Callable[[], object] = lambda: None) -> tuple[tuple[int, ...], object]:
    """Run ``work`` in a fork of this process (a snapshot), and ``meanwhile`` here once it has reported
    and while it still lives; returns (what ``work`` reported, what ``meanwhile`` returned)."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(said_r)
            os.close(go_w)
            report = work()
            os.write(said_w, struct.pack(f"<{len(report)}q", *report))
            os.close(said_w)
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(said_w)
    os.close(go_r)
    try:
        raw = b""
        while chunk := os.read(said_r, 4096):
            raw += chunk
        seen = meanwhile()
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(said_r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return struct.unpack(f"<{len(raw) // 8}q", raw), seen


def test_let_go_drops_only_the_snapshots_view_and_leaves_the_job_its_pages_alone():
    job = huge_aligned(8 << 20)  # every page written (resident)
    small = np.arange(1000.0)  # under letgo.MIN_BYTES: kept
    objects = np.array([object()] * ((2 << 20) // 8), dtype=object)  # Python objects: kept

    def snapshot() -> tuple[int, ...]:
        dropped = letgo.let_go({"u": job, "small": small, "objects": objects})
        interior = job[PAGE // 8 : -PAGE // 8]
        return dropped, int(not interior.any()), int(np.array_equal(small, np.arange(1000.0))), int(objects[0] is objects[-1])

    (dropped, zeros, small_kept, objects_kept), (exclusive, pages) = in_snapshot(snapshot, lambda: exclusive_pages(job))
    assert dropped == 8 << 20  # the whole pages inside the array, nothing else
    assert zeros and small_kept and objects_kept  # the snapshot's view of the array is gone, the rest is not
    assert exclusive == pages  # every page is the job's alone while the snapshot still lives: no copy on write
    assert np.array_equal(job, np.arange(8 << 17, dtype=np.float64))  # and the job's state is what it was


def test_let_go_leaves_strided_and_broadcast_arrays_whose_span_holds_other_bytes():
    """A column of a 2-column array spans the other column, and a broadcast array's size counts bytes it
    does not have: dropping their spans would drop bytes they do not cover (helper-26's review)."""
    pairs = np.arange(2 << 17, dtype=np.float64).reshape(-1, 2)  # 2 MiB; a column is 1 MiB, strided over both
    row = np.arange(1024.0)  # 8 KiB, broadcast to 2 MiB
    broadcast = np.broadcast_to(row, (256, 1024))

    def snapshot() -> tuple[int, ...]:
        dropped = letgo.let_go({"column": pairs[:, 0], "broadcast": broadcast, "not an array": b"x" * (2 << 20)})
        intact = np.array_equal(pairs, np.arange(2 << 17, dtype=np.float64).reshape(-1, 2)) and np.array_equal(row, np.arange(1024.0))
        return dropped, int(intact)

    (dropped, intact), _ = in_snapshot(snapshot)
    assert dropped == 0 and intact


def test_a_plugin_snapshot_lets_go_of_the_buffers_it_wrote_not_of_the_values_it_did_not(tmp_path):
    """A checkpointer plug-in that hands its state over as buffers (SPC ``buffers``): the snapshot wrote
    those, so those are what it lets go of; a registered value the plug-in did not hand over was not
    written and is left. Seen from the snapshot itself, after the write (``then`` runs there)."""
    from gangd.ckptlib import spc as spc_mod

    class Grid(spc_mod.SPC):
        name = "grid"

        def __init__(self) -> None:
            self.cells = np.arange(2 << 17, dtype=np.float64)  # 2 MiB

        def buffers(self, values: dict) -> dict:
            return {"cells": self.cells}

    grid = Grid()
    registered = np.arange(2 << 17, dtype=np.float64)
    seen = tmp_path / "seen"

    def look(result: dict) -> None:  # (in the snapshot, after its write)
        interior = slice(PAGE // 8, -PAGE // 8)
        seen.write_text(f"{int(not grid.cells[interior].any())} {int(registered[interior].all())}")

    written = writer.write(tmp_path / "state", {"u": registered}, 3, background=True, then=look, spc=grid)
    result = written.wait()
    assert "error" not in result, result
    cells_dropped, registered_kept = seen.read_text().split()
    assert cells_dropped == "1" and registered_kept == "1"
    assert np.array_equal(grid.cells, np.arange(2 << 17, dtype=np.float64))


def test_without_let_go_the_pages_stay_shared_while_the_snapshot_lives():
    """The control for the test above: a fork shares every page until it exits or lets go."""
    job = huge_aligned(4 << 20)
    _, (exclusive, pages) = in_snapshot(lambda: (), lambda: exclusive_pages(job))
    assert pages > 0 and exclusive == 0


@pytest.mark.parametrize("mode", ["full", "adaptive"])
def test_a_background_generation_is_the_state_at_its_fork_and_so_is_its_signature(tmp_path, mode):
    """The snapshot lets go only after everything that reads the state: in mode adaptive the first
    generation is a full whose signature is hashed after its blocks are written (blocks.encode's late
    signature), and it must be the signature of the state at the fork, not of the zeros the snapshot sees
    after letting go, nor of what the job wrote since."""
    at_fork = np.random.default_rng(5).random(3 << 17)  # 3 MiB
    values = {"u": at_fork.copy(), "n": 7}
    plan = DeltaSettings.from_options(mode=mode).plan(1, [])
    path = tmp_path / "state"
    written = writer.write(path, values, 3, background=True, delta=plan, hold=True)
    values["u"][:] = -1.0  # the job runs on
    written.release()
    result = written.wait()
    assert "error" not in result, result
    loaded, iteration, _ = blocks.read_chain(path, (), (result["size"], result["digest"]), map_values=False)
    assert iteration == 3 and loaded["n"] == 7 and np.array_equal(loaded["u"], at_fork)
    index = blocks.read_index(path)
    if mode == "adaptive":
        entry = index.entry("u")
        assert index.signed and entry is not None and entry.signature is not None
        expected = blocks.signature({"u": at_fork}, index.block).values[0].sig
        assert np.array_equal(entry.signature, expected)
    assert np.all(values["u"] == -1.0)  # the job's own state is what the job made it


def test_a_raw_snapshot_lets_go_of_an_array_as_it_is_written_and_only_of_what_is_written():
    """The raw file's writer lets go of each array's pages as they are written (letgo.AsCopied, in the
    order written, releases ending on huge page boundaries): after the first half of an array, the job
    owns that half again and still shares the other."""
    job = huge_aligned(8 << 20)
    view = memoryview(job).cast("B")

    def snapshot() -> tuple[int, ...]:
        letgo.AsCopied({"u": job})(view[: 4 << 20])
        return (int(not job[: (4 << 20) // 8].any()), int(job[(4 << 20) // 8 :].all()))

    (first_half_dropped, second_half_kept), (exclusive, pages) = in_snapshot(snapshot, lambda: exclusive_pages(job))
    assert first_half_dropped and second_half_kept
    assert pages == (8 << 20) // PAGE and exclusive == pages // 2


@pytest.mark.parametrize("plan", [None, "full"])
def test_a_snapshot_of_arrays_under_two_names_writes_both_whole(tmp_path, plan):
    """One array under two names, and a view overlapping it: written one after the other, the second
    must not be read from pages the snapshot let go of after writing the first (such an array is let go
    of only once the whole file is written)."""
    base = np.arange(3 << 17, dtype=np.float64)  # 3 MiB
    values = {"a": base, "b": base, "tail": base[1000:], "other": np.arange(2 << 17, dtype=np.float64)}
    delta = None if plan is None else DeltaSettings.from_options(mode=plan).plan(1, [])
    path = tmp_path / "state"
    written = writer.write(path, values, 3, background=True, delta=delta, hold=True)
    base[:] = -1.0  # the job runs on
    written.release()
    result = written.wait()
    assert "error" not in result, result
    loaded, iteration, _ = blocks.read_chain(path, (), (result["size"], result["digest"]), map_values=False)
    expected = np.arange(3 << 17, dtype=np.float64)
    assert iteration == 3
    assert np.array_equal(loaded["a"], expected) and np.array_equal(loaded["b"], expected)
    assert np.array_equal(loaded["tail"], expected[1000:]) and np.array_equal(loaded["other"], np.arange(2 << 17, dtype=np.float64))


def test_chunks_that_read_what_came_before_are_refused_with_a_release_as_copied(tmp_path):
    """A late signature (a callable chunk) or a pipeline (a Streamed one) may read the buffers written
    before it: write_chunks refuses one when it lets go of buffers as they are written."""
    from gangd import ckptstore

    with open(tmp_path / "f", "wb") as fh:
        with pytest.raises(ValueError):
            ckptstore.write_chunks(fh.fileno(), [b"abc", lambda fd: [b"def"]], copied=lambda part: None)
