"""Ways memory changes that a write watch could miss (a review of gangd.ckptlib.dirty).

A delta that trusts "not written since the reference's cut" restores stale
bytes if the watch misses one change, so each test changes real memory the
way a program or the kernel can -- the same array protected under two names,
memory shared with another process or a file, pages the kernel dropped,
a huge page collapsed, more written regions than one PAGEMAP_SCAN call
returns, arrays starting anywhere with any block size -- and checks that
every changed block is reported written (or that the array is not tracked
at all: then every block is hashed).
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
from deltahelpers import Generations, assert_same_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd.ckptlib import dirty

B = 16 << 10
PAGE = mmap.PAGESIZE
MADV_FREE, MADV_DONTNEED, MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_PAGEOUT, MADV_COLLAPSE = 8, 4, 14, 15, 21, 25

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.process_vm_writev.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
_libc.process_vm_writev.restype = ctypes.c_ssize_t


def madvise(addr: int, length: int, advice: int) -> int:
    return 0 if _libc.madvise(ctypes.c_void_p(addr), length, advice) == 0 else ctypes.get_errno()




def missed(watch, name, gen, arr, block_numbers, block=B) -> list[int] | None:
    """The blocks among ``block_numbers`` reported unchanged since ``gen`` (None: the array is not tracked)."""
    keep = watch.unchanged(name, gen, arr.ctypes.data, arr.nbytes, block)
    return None if keep is None else [b for b in block_numbers if keep[b]]


def aligned(nbytes: int, align: int = 2 << 20) -> np.ndarray:
    """float64s starting on a huge page boundary (the buffer stays alive through the view's base)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(np.float64)


def test_one_array_under_two_names_or_a_view_of_another_is_never_reported_unchanged(watch, tmp_path):
    """Each name's scan protects the pages again: the first name's scan must not hide the writes from the second's."""
    grid = np.ones((4 << 20) // 8)
    other = np.ones((4 << 20) // 8)
    values = {"grid": grid, "again": grid, "inner": grid[1024:-1024], "other": other}
    watch.cut(1, values, B)
    grid[(B * 10) // 8] = 5.0
    other[(B * 3) // 8] = 5.0
    watch.cut(2, values, B)
    assert missed(watch, "other", 1, other, [3]) == []  # (an array sharing no memory stays tracked)
    assert missed(watch, "grid", 1, grid, [10]) in (None, [])
    assert missed(watch, "again", 1, grid, [10]) in (None, []), "a write reported to 'grid' was hidden from 'again'"
    inner = values["inner"]
    assert missed(watch, "inner", 1, inner, [(B * 10 - 1024 * 8) // B]) in (None, [])
    # Written as generations: the restore is the memory, under every name.
    gens = Generations(tmp_path)
    gens.write(1, values, None, mode="incremental", block=B)
    grid[(B * 20) // 8] = 7.0
    watch.cut(2, values, B)
    gens.write(2, values, 1, mode="incremental", block=B, watch=watch)
    assert_same_values(gens.restore(2)[0], values)


def _shared_anonymous_written_by_a_child(arr_of):
    m = mmap.mmap(-1, 4 << 20)  # (MAP_SHARED | MAP_ANONYMOUS: what multiprocessing's fork workers write into)
    a = arr_of(m)

    def change():
        pid = os.fork()
        if pid == 0:
            a[(B * 10) // 8] = 9.0
            os._exit(0)
        os.waitpid(pid, 0)

    return a, change, [m]


def _memfd_written_by_pwrite(arr_of):
    fd = os.memfd_create("gangd-review")
    os.ftruncate(fd, 4 << 20)
    m = mmap.mmap(fd, 4 << 20)
    return arr_of(m), lambda: os.pwrite(fd, b"\x07" * 8, B * 10), [m, fd]


def _private_file_changed_underneath(arr_of, tmp_path):
    path = tmp_path / "state.bin"
    path.write_bytes(b"\x01" * (4 << 20))
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 4 << 20, flags=mmap.MAP_PRIVATE)  # (a page not written here shows the file's bytes)
    return arr_of(m), lambda: os.pwrite(fd, b"\x07" * 8, B * 10), [m, fd]


@pytest.mark.parametrize("how", ["shared anonymous, a forked child writes", "memfd, pwrite", "private file mapping, the file changes"])
def test_memory_another_mapping_or_the_file_changes_is_not_trusted(watch, tmp_path, how):
    """Asynchronous write protection registers any memory; only this mapping's writes fault, so only
    private anonymous memory can be tracked."""

    def arr_of(m):
        a = np.frombuffer(m, dtype=np.float64)
        if not how.startswith("private"):  # (a private mapping's written page is its own copy: the file's changes stop showing)
            a[:] = 1.0
        return a

    if how.startswith("shared"):
        a, change, held = _shared_anonymous_written_by_a_child(arr_of)
    elif how.startswith("memfd"):
        a, change, held = _memfd_written_by_pwrite(arr_of)
    else:
        a, change, held = _private_file_changed_underneath(arr_of, tmp_path)
    watch.cut(1, {"a": a}, B)
    before = a[(B * 10) // 8]
    change()
    assert a[(B * 10) // 8] != before  # (this process sees the change)
    watch.cut(2, {"a": a}, B)
    try:
        assert missed(watch, "a", 1, a, [10]) in (None, []), f"{how}: a changed block was reported unchanged"
    finally:
        watch._drop("a")
        del a, change
        for thing in held:
            thing.close() if isinstance(thing, mmap.mmap) else os.close(thing)


@pytest.mark.parametrize("advice, length, huge", [(MADV_DONTNEED, 2 * PAGE, False), (MADV_DONTNEED, 2 << 20, False),
                                                  (MADV_DONTNEED, 2 << 20, True), (MADV_FREE, 2 * PAGE, False)])
def test_pages_the_kernel_dropped_read_as_written(watch, advice, length, huge):
    """An allocator returning memory (MADV_DONTNEED, or MADV_FREE then reclaimed) zeroes it without
    a write; a later calloc at the same address relies on those zeros."""
    a = aligned(8 << 20)
    madvise(a.ctypes.data, a.nbytes, MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    a[:] = 1.0
    watch.cut(1, {"a": a}, B)
    at = 2 << 20
    assert madvise(a.ctypes.data + at, length, advice) == 0
    if advice == MADV_FREE:
        madvise(a.ctypes.data + at, length, MADV_PAGEOUT)  # (reclaim now: the lazily freed pages are dropped)
    watch.cut(2, {"a": a}, B)
    if advice == MADV_DONTNEED:
        assert a[at // 8] == 0.0
    assert missed(watch, "a", 1, a, list(range(at // B, (at + length - 1) // B + 1)) if a[at // 8] == 0.0 else []) in (None, [])


def test_a_huge_page_is_not_collapsed_over_protected_pages_and_a_collapsed_one_is_watched(watch):
    a = aligned(8 << 20)
    assert madvise(a.ctypes.data, a.nbytes, MADV_NOHUGEPAGE) == 0
    a[:] = 1.0  # (small pages)
    assert madvise(a.ctypes.data, a.nbytes, MADV_HUGEPAGE) == 0
    watch.cut(1, {"a": a}, B)
    a[(B * 3) // 8] = 2.0
    madvise(a.ctypes.data, 2 << 20, MADV_COLLAPSE)  # (refused or not: the write stays seen)
    a[(4 << 20) // 8 :][: (2 << 20) // 8] = 3.0  # (a whole 2 MiB written: collapsible)
    madvise(a.ctypes.data + (4 << 20), 2 << 20, MADV_COLLAPSE)
    watch.cut(2, {"a": a}, B)
    assert missed(watch, "a", 1, a, [3, *range((4 << 20) // B, (6 << 20) // B)]) == []
    a[(4 << 20) // 8 + 5] = 4.0  # (into the collapsed huge page, protected again at the cut)
    watch.cut(3, {"a": a}, B)
    assert missed(watch, "a", 2, a, [(4 << 20) // B]) == []


def test_more_written_regions_than_one_scan_returns(watch):
    a = aligned(64 << 20)
    a[:] = 1.0
    watch.cut(1, {"a": a}, B)
    idx = np.arange(0, a.size, 3 * PAGE // 8)  # (every third page: more separate regions than dirty.VEC)
    assert len(idx) > dirty.VEC
    a[idx] = 2.0
    watch.cut(2, {"a": a}, B)
    assert missed(watch, "a", 1, a, sorted(set((idx * 8 // B).tolist()))) == []


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2 * PAGE - 1), st.integers(1, 20), st.lists(st.integers(0, (1 << 20) - 1), min_size=1, max_size=30))
def test_any_start_any_block_size_every_written_byte_s_block_is_reported(watch, offset, block_kib, writes):
    block = block_kib << 10
    raw = np.zeros((1 << 20) + 2 * PAGE, dtype=np.uint8)
    a = raw[offset : offset + (1 << 20) + 1 - (offset % 3)]  # (ends anywhere in a page too)
    writes = [w % a.size for w in writes]
    watch.cut(1, {"a": a}, block)
    a[writes] += 1
    watch.cut(2, {"a": a}, block)
    assert missed(watch, "a", 1, a, sorted({w // block for w in writes}), block) == []
    watch._drop("a")


def test_a_generation_number_cut_twice_keeps_the_writes_since_its_first_cut(watch):
    """Generation 2 cut, written between, cut again under the same number (a retried generation whose
    first file may be the one kept): since 2, the writes after either cut."""
    a = np.ones((2 << 20) // 8)
    watch.cut(1, {"a": a}, B)
    watch.cut(2, {"a": a}, B)
    a[(B * 4) // 8] = 2.0
    watch.cut(2, {"a": a}, B)
    a[(B * 9) // 8] = 3.0
    watch.cut(3, {"a": a}, B)
    assert missed(watch, "a", 2, a, [4, 9]) == []
    assert missed(watch, "a", 1, a, [4, 9]) == []


def test_kernels_whose_scan_misreads_swapped_pages_are_not_used():
    """6.7 to 6.8.9 read a swapped-out or migrating page's write-protect bit where a present page keeps it."""
    assert [dirty._scan_reads_swapped_pages(r) for r in ("6.7.12", "6.8.0-45-generic", "6.8.9", "6.8.10", "6.9", "6.18.44-fc-v595", "7.0.1", "x")] == [
        False, False, False, True, True, True, True, False]


def test_writes_through_the_kernel_s_other_paths_are_seen(watch, tmp_path):
    """process_vm_writev (MPI's single-copy transfers), /proc/self/mem (a debugger), an O_DIRECT read (DMA
    into pages pinned for the call): each writes the array's pages through the kernel, and faults first."""

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    a = np.ones((4 << 20) // 8)
    base = a.ctypes.data + (-a.ctypes.data) % PAGE  # (O_DIRECT wants an aligned buffer)
    watch.cut(1, {"a": a}, B)
    source = ctypes.create_string_buffer(b"\x09" * 64)
    local, remote = Iovec(ctypes.cast(source, ctypes.c_void_p), 64), Iovec(base + B * 10, 64)
    assert _libc.process_vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 64
    fd = os.open("/proc/self/mem", os.O_RDWR)
    try:
        assert os.pwrite(fd, b"\x08" * 64, base + B * 20) == 64
    finally:
        os.close(fd)
    written = [(base - a.ctypes.data + B * 10) // B, (base - a.ctypes.data + B * 20) // B]
    (tmp_path / "direct").write_bytes(b"\x05" * PAGE)
    try:
        fd = os.open(tmp_path / "direct", os.O_RDONLY | os.O_DIRECT)
    except OSError:  # (a file system without O_DIRECT: tmpfs)
        fd = None
    if fd is not None:
        try:
            at = base - a.ctypes.data + B * 30
            if os.preadv(fd, [memoryview(a).cast("B")[at : at + PAGE]], 0) == PAGE:
                written.append(at // B)
        except OSError:
            pass
        finally:
            os.close(fd)
    watch.cut(2, {"a": a}, B)
    assert missed(watch, "a", 1, a, written) == []
