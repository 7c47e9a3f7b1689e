"""Checkpoint files written around the page cache (gangd.directio, issue 18).

What a user relies on:

* every byte lands where it belongs, whatever the sizes of the pieces and
  wherever the file's position was (an unaligned start writes through the
  cache instead), and the fd is left at the end with O_DIRECT off for the
  index and footer written after;
* a checkpoint written this way is not in the page cache afterwards (it does
  not push the job's cached files out; that is the point), and one written
  with ``GANGD_CKPT_DIRECT=0`` is;
* a full disk is the OSError of the write (ENOSPC), not a hang or a torn
  file under the final name, and a failed write stops the appender's thread.

Real files on the disk under the test's temporary directory (/var/tmp if
that is a tmpfs, where every file is "cached"), and a real, small tmpfs for
the full disk.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tmpfs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd import ckptstore, directio
from gangd.ckptlib import blocks

TMPFS_MAGIC = 0x01021994


@pytest.fixture
def disk(tmp_path: Path):
    """A directory on a disk file system: ``tmp_path``, or one under /var/tmp (removed after) if that is a tmpfs."""
    libc = ctypes.CDLL(None, use_errno=True)

    class StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 256)]

    buf = StatFs()
    if libc.statfs(str(tmp_path).encode(), ctypes.byref(buf)) == 0 and buf.f_type != TMPFS_MAGIC:
        yield tmp_path
        return
    where = Path(tempfile.mkdtemp(prefix="gangd-test-directio-", dir="/var/tmp"))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``): mincore(2) over a mapping of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def append(path: Path, pieces: list[bytes], *, lead: bytes = b"", size: int = 16384, count: int = 2) -> tuple[int, bool, int]:
    """Write ``lead`` (plainly) then ``pieces`` through an appender; (its end, whether it went direct, the fd's position after)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, lead)
        out = directio.Appender(fd, size=size, count=count)
        try:
            for piece in pieces:
                out.write(memoryview(piece))
            direct = out.direct
            end = out.close()
        finally:
            out.abort()
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # (what is written after goes through the cache)
        return end, direct, os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


SIZES = [0, 1, 4095, 4096, 4097, 16383, 16384, 16385, 3 * 16384 + 123, 200_000]


@pytest.mark.parametrize("total", SIZES)
def test_every_byte_lands_in_order_at_any_size(disk: Path, total: int) -> None:
    where = disk
    data = np.random.default_rng(total).bytes(total)
    cuts = sorted({0, total, *np.random.default_rng(total + 1).integers(0, total + 1, 7).tolist()})
    pieces = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    end, direct, position = append(where / "f", pieces)
    assert direct  # (a disk file system, the file at offset 0)
    assert (end, position) == (total, total)
    assert (where / "f").read_bytes() == data


NAMES = itertools.count()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=40_000), max_size=12), st.integers(min_value=0, max_value=5000))
def test_any_pieces_after_any_lead_come_back_exactly(disk: Path, lengths: list[int], lead_len: int) -> None:
    where = disk / f"example-{next(NAMES)}"
    where.mkdir()
    rng = np.random.default_rng(sum(lengths) + lead_len)
    pieces = [rng.bytes(n) for n in lengths]
    lead = rng.bytes(lead_len)
    end, direct, position = append(where / "f", pieces, lead=lead, size=8192, count=2)
    total = lead_len + sum(lengths)
    assert (end, position) == (total, total)
    assert direct == (lead_len % directio.ALIGN == 0)  # an unaligned start cannot go direct: through the cache instead
    assert (where / "f").read_bytes() == lead + b"".join(pieces)


def test_a_checkpoint_file_stays_out_of_the_page_cache_unless_the_program_says_otherwise(disk: Path, monkeypatch) -> None:
    where = disk
    values = {"u": np.arange(4 << 20, dtype=np.float64), "small": np.arange(10)}  # 32 MiB
    blocks.save_generation(where / "direct.state", values, gen=1, mode="full")
    cached, pages = cached_pages(where / "direct.state")
    assert pages > 8000
    assert cached <= 2, f"{cached} of {pages} pages of a direct checkpoint file are cached"  # (the last partial page, the index's)
    monkeypatch.setenv(directio.ENV, "0")
    blocks.save_generation(where / "cached.state", values, gen=1, mode="full")
    cached, pages = cached_pages(where / "cached.state")
    assert cached > pages // 2
    for name in ("direct.state", "cached.state"):  # both restore bit for bit
        restored = blocks.read_chain(where / name, (), None, map_values=False)[0]
        assert all(restored[k].tobytes() == v.tobytes() for k, v in values.items())


def test_the_switch_reads_like_the_other_ckpt_switches() -> None:
    assert directio.wanted({}) is True
    for off in ("0", "no", "false", "OFF", " 0 "):
        assert directio.wanted({directio.ENV: off}) is False
    assert directio.wanted({directio.ENV: "1"}) is True


def test_a_full_disk_is_the_write_error_and_leaves_no_file_and_no_thread(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    before = threading.active_count()
    with tmpfs(mnt, "1m"):
        fd = os.open(mnt / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        out = directio.Appender(fd, size=65536, count=2)
        with pytest.raises(OSError) as caught:
            try:
                for _ in range(64):  # 4 MiB into 1 MiB
                    out.write(memoryview(b"x" * 65536))
                out.close()
            finally:
                out.abort()
                os.close(fd)
        assert caught.value.errno == errno.ENOSPC
        assert threading.active_count() == before
        # Through write_atomic: the error names the path, and nothing is left under either name.
        with pytest.raises(ckptstore.StoreError, match="no space left on device"):
            ckptstore.write_atomic(mnt / "g.state", [b"y" * (3 << 20)], direct=True)
        assert sorted(p.name for p in mnt.iterdir()) == ["f"]
        assert threading.active_count() == before


def test_an_appender_refuses_buffers_it_could_not_write_direct() -> None:
    with pytest.raises(ValueError):
        directio.Appender(0, size=5000)
    with pytest.raises(ValueError):
        directio.Appender(0, count=1)


def test_a_slow_producers_pieces_reach_the_disk_as_they_come_not_a_buffer_later(disk: Path) -> None:
    """A compress stage slower than the disk: each piece of a MiB or more is written while the next is
    made, so what is left at the end is the last piece (paper 004's drain), and every byte lands."""
    rng = np.random.default_rng(7)
    pieces = [rng.bytes((1 << 20) + 4096 * k + 123) for k in range(5)]  # (unaligned lengths: the tails carry over)
    fd = os.open(disk / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        out = directio.Appender(fd)  # (8 MiB buffers: none of these pieces fills one)
        try:
            written = 0
            for piece in pieces:
                deadline = time.monotonic() + 10
                while not out.idle:  # (the piece before is written, and the thread is done with it)
                    assert time.monotonic() < deadline, "the appender's thread never went idle"
                    time.sleep(0.001)
                out.write(memoryview(piece))
                written += len(piece)
                deadline = time.monotonic() + 10
                while os.fstat(fd).st_size < written - directio.ALIGN:  # (all but the unaligned tail kept back)
                    assert time.monotonic() < deadline, f"{os.fstat(fd).st_size} of {written} bytes on disk after 10 s"
                    time.sleep(0.001)
            assert out.direct
            end = out.close()
        finally:
            out.abort()
    finally:
        os.close(fd)
    assert end == written
    assert (disk / "f").read_bytes() == b"".join(pieces)
