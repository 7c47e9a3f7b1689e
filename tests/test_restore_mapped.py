"""A restore maps large arrays' files instead of copying them (gangd.ckptlib.mapped), and a user can rely on it.

What the program sees is what a read restore gave it: bit-identical,
writable, aligned arrays whose writes stay in the process (the file and any
later restore of it unchanged), also once retention has deleted the file.
What is mapped, and what is read: an array of at least a MiB all of whose
blocks one file stores raw, at an offset its dtype allows; the base of a
delta chain with the newer blocks read over it; never a compressed value,
a small one or a pickle. Damage is still caught by the manifest's checksum
or the signature, naming the file. A forked snapshot of a mapped array that
the program changed writes the program's values. ``GANGD_CKPT_RESTORE=read``
turns it off; any other value is refused at ``ckpt.init()``.

Real files, real mappings (read back from ``/proc/self/maps``), a real fork.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deltahelpers import Generations, assert_same_values

from gangd import ckptstore
from gangd.ckptlib import blocks, image, mapped, writer
from gangd.ckptlib.core import CheckpointError, DeltaSettings
from gangd.ckptstore import StoreError
from gangd.codecs import CodecSpec

MiB = 1 << 20


def mapping_of(arr: np.ndarray) -> str | None:
    """The file ``arr``'s memory is a mapping of (as /proc/self/maps names it), or None: anonymous memory."""
    address = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                name = fields[5].strip() if len(fields) > 5 else ""
                return name.removesuffix(" (deleted)") if name.startswith("/") else None
    raise AssertionError("the array's address is in no mapping")


def restored_mapped(path: Path, u: np.ndarray) -> tuple[np.ndarray, tuple[int, str]]:
    """``u`` saved alone in ``path`` and restored: the restored array (checked to be a mapping of ``path``)
    and the file's (size, checksum)."""
    size, digest = image.save(path, {"u": u}, 1)
    values, _, _ = image.load(path, (size, digest))
    assert mapping_of(values["u"]) == str(path)
    return values["u"], (size, digest)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_large_array_is_a_private_mapping_of_its_file_and_the_programs_writes_stay_in_the_process(tmp_path):
    path = tmp_path / "rank-0.state"
    big = np.random.default_rng(1).random((512, 1024))  # 4 MiB
    small = np.arange(1000, dtype=np.float64)  # 8 KB: read
    size, digest = image.save(path, {"small": small, "big": big, "d": {"k": 1}}, 3)
    fds = open_fds()
    values, iteration, _ = image.load(path, (size, digest))
    assert iteration == 3 and values["d"] == {"k": 1}
    assert mapping_of(values["big"]) == str(path)
    assert mapping_of(values["small"]) is None
    assert open_fds() == fds  # (a mapping needs no descriptor kept open)
    arr = values["big"]
    assert arr.tobytes() == big.tobytes() and arr.shape == big.shape and arr.dtype == big.dtype
    assert arr.flags.writeable and arr.flags.aligned and arr.flags.c_contiguous

    arr *= 2.0  # every page copied on write: the file keeps the checkpoint
    arr[7, 9] = -1.0
    assert ckptstore.checksum_file(path) == (size, digest)
    again, _, _ = image.load(path, (size, digest))
    assert again["big"].tobytes() == big.tobytes()
    assert arr[7, 9] == -1.0 and arr[0, 0] == big[0, 0] * 2.0


def test_the_file_deleted_after_the_restore_leaves_the_arrays_whole_and_writable(tmp_path):
    """Retention deletes old generations while a restarted rank runs on the mapping of one."""
    path = tmp_path / "rank-0.state"
    big = np.random.default_rng(2).random(3 * MiB // 8)
    u, _ = restored_mapped(path, big)
    path.unlink()
    assert u.tobytes() == big.tobytes()
    u[::512] += 1.0
    assert np.array_equal(u[1::512], big[1::512]) and np.array_equal(u[::512], big[::512] + 1.0)


def test_a_delta_chain_maps_its_base_and_reads_the_newer_blocks_over_it_leaving_the_base_file_as_it_was(tmp_path):
    gens = Generations(tmp_path)
    rng = np.random.default_rng(3)
    first = {"u": rng.random(2 * MiB // 8), "log": [1, 2]}
    gens.write(1, first, None, mode="incremental")
    second = {"u": first["u"].copy(), "log": [1, 2, 3]}
    second["u"][5000:5100] = -7.0  # a few blocks
    second["u"][-1] = 42.0  # and the last, short one
    result = gens.write(2, second, 1, mode="incremental")
    assert result["role"] == "incr" and result["links"] == [1]
    base_bytes = gens.path(1).read_bytes()

    stats: dict = {}
    values, _, _ = gens.restore(2, stats)
    assert_same_values(values, second)
    assert mapping_of(values["u"]) == str(gens.path(1))
    assert stats["files"] == 2
    assert gens.path(1).read_bytes() == base_bytes  # the newer blocks went into this process's pages only
    older, _, _ = gens.restore(1)
    assert_same_values(older, first)


@pytest.mark.parametrize(("pad", "is_mapped"), [(8, True), (3, False)])
def test_an_array_is_mapped_only_where_its_file_keeps_it_aligned_for_its_dtype(tmp_path, pad, is_mapped):
    """The values are packed one after the other: a 3-byte value ahead puts a float64 array at an offset it
    cannot be mapped at (it is read into aligned memory instead)."""
    path = tmp_path / "rank-0.state"
    big = np.random.default_rng(4).random(MiB // 8 + 5)
    size, digest = image.save(path, {"pad": np.zeros(pad, dtype=np.uint8), "big": big}, 1)
    values, _, _ = image.load(path, (size, digest))
    assert (mapping_of(values["big"]) == str(path)) is is_mapped
    assert values["big"].flags.aligned and values["big"].tobytes() == big.tobytes()


def test_record_arrays_are_mapped_and_small_compressed_or_pickled_values_are_read(tmp_path):
    records = np.zeros(MiB // 12 + 1, dtype=[("x", "<f8"), ("n", "<i4")])
    records["x"] = np.arange(len(records)) / 3
    records["n"] = np.arange(len(records)) % 1000
    raw = tmp_path / "raw.state"
    size, digest = image.save(raw, {"r": records, "tiny": np.ones(10), "obj": np.array([{"a": 1}], dtype=object)}, 1)
    values, _, _ = image.load(raw, (size, digest))
    assert mapping_of(values["r"]) == str(raw) and values["r"].tobytes() == records.tobytes()
    assert mapping_of(values["tiny"]) is None
    assert values["obj"][0] == {"a": 1}

    smooth = np.sin(np.linspace(0, 50, 2 * MiB // 8))
    packed = tmp_path / "lz4.state"
    result = blocks.save_generation(packed, {"s": smooth}, gen=1, mode="full", codec=CodecSpec.parse("lz4"))
    values, _, _ = blocks.read_chain(packed, (), (result["size"], result["digest"]))
    assert mapping_of(values["s"]) is None and values["s"].tobytes() == smooth.tobytes()


def test_reading_instead_of_mapping_gives_the_same_values_in_anonymous_memory(tmp_path, monkeypatch):
    path = tmp_path / "rank-0.state"
    big = np.random.default_rng(5).random(2 * MiB // 8)
    size, digest = image.save(path, {"u": big}, 1)
    values, _, _ = image.load(path, (size, digest), map_values=False)
    assert mapping_of(values["u"]) is None and values["u"].tobytes() == big.tobytes()

    monkeypatch.setenv(mapped.ENV, "read")
    assert DeltaSettings.from_options().map_restore is False
    values, _, _ = image.load(path, (size, digest))  # (None: as the environment says)
    assert mapping_of(values["u"]) is None
    monkeypatch.setenv(mapped.ENV, "map")
    assert DeltaSettings.from_options().map_restore is True
    monkeypatch.setenv(mapped.ENV, "mmap-please")
    with pytest.raises(CheckpointError, match="GANGD_CKPT_RESTORE must be map or read, not 'mmap-please'"):
        DeltaSettings.from_options()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x55]))


def test_damage_under_a_mapped_array_is_caught_by_the_checksum_or_the_signature_naming_the_file(tmp_path):
    gens = Generations(tmp_path)
    u = np.random.default_rng(6).random(2 * MiB // 8)
    gens.write(1, {"u": u}, None, mode="incremental")
    changed = u.copy()
    changed[:10] = 0.0
    gens.write(2, {"u": changed}, 1, mode="incremental")
    _flip(gens.path(1), len(blocks.MAGIC) + MiB + 3)  # inside the base's blocks, which the delta does not hold

    with pytest.raises(StoreError, match=r"gen-1\.state is corrupted: block 64 of value 'u' does not match generation 2's signature"):
        gens.restore(2)
    with pytest.raises(StoreError, match=r"gen-1\.state is corrupted: its checksum does not match the manifest"):
        gens.restore(1)
    with pytest.raises(StoreError, match=r"gen-1\.state is corrupted: block 64 of value 'u' does not match generation 1's signature"):
        blocks.read_chain(gens.path(1))  # (no manifest to check it against: the signature still catches it)


def test_a_forked_snapshot_of_a_mapped_array_the_program_changed_writes_the_programs_values(tmp_path):
    path = tmp_path / "g1.state"
    u, (size, digest) = restored_mapped(path, np.random.default_rng(7).random(4 * MiB // 8))
    u[: MiB // 8] += 1.0  # the first MiB copied on write, the rest still the file's pages
    values = {"u": u}
    expected = u.copy()

    written = writer.write(tmp_path / "g2.state", values, 2, background=True)
    assert written.pid is not None  # (a real fork)
    result = written.wait()
    assert "error" not in result, result
    writer.reap()
    again, iteration, _ = image.load(tmp_path / "g2.state", (result["size"], result["digest"]))
    assert iteration == 2 and again["u"].tobytes() == expected.tobytes()
    assert ckptstore.checksum_file(path) == (size, digest)


def test_a_chain_whose_newer_files_hold_most_of_a_value_reads_it_rather_than_mapping_the_base(tmp_path):
    """Mapping the base would read all of it and copy most of its pages again for the newer blocks."""
    gens = Generations(tmp_path)
    u = np.random.default_rng(8).random(2 * MiB // 8)
    gens.write(1, {"u": u}, None, mode="incremental")
    first_half = u.copy()
    first_half[: len(u) // 2 + 1000] += 1.0
    gens.write(2, {"u": first_half}, 1, mode="incremental")
    values, _, _ = gens.restore(2)
    assert mapping_of(values["u"]) is None and values["u"].tobytes() == first_half.tobytes()


def test_decompressed_blocks_are_checked_against_the_signature_even_when_the_file_matches_its_checksum(tmp_path, monkeypatch):
    """The manifest's checksum covers a compressed file's bytes, not what this node's decoder makes of them
    (another library version, a plug-in): a decoder that differs is caught, naming the file."""
    import gangd.codecs as codecs

    smooth = np.sin(np.linspace(0, 50, 2 * MiB // 8))
    path = tmp_path / "lz4.state"
    result = blocks.save_generation(path, {"s": smooth}, gen=1, mode="full", codec=CodecSpec.parse("lz4"))
    real = codecs.decode

    def another_decoder(ident, data, out, digest=None):
        n = real(ident, data, out, digest)
        out[100] ^= 1
        return n

    monkeypatch.setattr(codecs, "decode", another_decoder)
    with pytest.raises(StoreError, match=r"lz4\.state is corrupted: block 0 of value 's' does not match generation 1's signature"):
        blocks.read_chain(path, (), (result["size"], result["digest"]))


def test_a_top_level_subarray_dtype_is_read_not_mapped(tmp_path):
    """Only a crafted index names one (numpy expands it into the shape); the read path handles it."""
    path = tmp_path / "raw"
    path.write_bytes(bytes(3 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert mapped.array(fd, 0, 2 * MiB, np.dtype(("<f8", (4,))), [2 * MiB // 32]) is None
        plain = mapped.array(fd, 0, 2 * MiB, np.dtype("<f8"), [2 * MiB // 8])
        assert plain is not None and mapping_of(plain) == str(path)
    finally:
        os.close(fd)


@pytest.mark.parametrize("background", [True, False])
def test_the_next_checkpoint_settles_mapped_arrays_into_anonymous_memory_keeping_their_addresses_and_values(tmp_path, background):
    """At the next checkpoint's cut the mapping is copied into anonymous memory moved over it: the write
    watch can track it again, huge pages can back it, and the file is let go (its space freed once deleted)."""
    path = tmp_path / "g1.state"
    u, _ = restored_mapped(path, np.random.default_rng(9).random(4 * MiB // 8))
    address = u.__array_interface__["data"][0]
    u[: MiB // 8] *= 3.0  # some pages already copied on write, the rest still the file's
    expected = u.copy()
    assert mapped.unsettled() >= u.nbytes

    written = writer.write(tmp_path / "g2.state", {"u": u}, 2, background=background)
    result = written.wait()
    assert "error" not in result, result
    writer.reap()
    assert mapped.unsettled() == 0
    assert u.__array_interface__["data"][0] == address and mapping_of(u) is None  # same address, anonymous now
    assert u.tobytes() == expected.tobytes()
    again, _, _ = image.load(tmp_path / "g2.state", (result["size"], result["digest"]), map_values=False)
    assert again["u"].tobytes() == expected.tobytes()
    u[-1] = 5.0  # still the program's writable array
    assert u[-1] == 5.0
    path.unlink()
    held = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]
    assert not held  # (nothing maps the deleted file: its blocks are freed)


def test_restored_arrays_stay_usable_in_the_programs_exit_handlers(tmp_path):
    """A program's exit handlers (registered before its ckpt.init()) may still read its state: the
    mappings are not undone at the interpreter's exit."""
    path = tmp_path / "rank-0.state"
    u = np.arange(MiB // 8, dtype=np.float64)
    size, digest = image.save(path, {"u": u}, 1)
    program = (
        "import atexit, numpy as np\n"
        "from gangd.ckptlib import image\n"
        "state = {}\n"
        "atexit.register(lambda: print('at exit', float(state['u'].sum()), flush=True))\n"
        f"state['u'] = image.load({str(path)!r}, ({size}, {digest!r}))[0]['u']\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["at", "exit", str(float(u.sum()))]


def test_a_failed_move_of_a_settling_region_never_leaves_a_hole_under_the_arrays():
    """mremap onto an address can fail after the kernel unmapped it (ENOMEM in move_vma): the hole is
    refilled with the copy; if the old mapping is still there, it is kept as it was."""
    length = 4 * mapped._PAGE
    old = mapped._aligned(length, mapped._PROT_RW, 0)
    fresh = mapped._aligned(length, mapped._PROT_RW, 0)
    ctypes.memset(old, 0x11, length)
    ctypes.memset(fresh, 0x22, length)
    try:
        assert mapped._refill(old, fresh, length) is False  # (intact: nothing moved, the copy is the caller's to drop)
        assert ctypes.string_at(old, length) == b"\x11" * length
        mapped._unmap(old, length)  # (as the failed mremap would have)
        assert mapped._refill(old, fresh, length) is True  # (the hole refilled with the copy, which is let go)
        assert ctypes.string_at(old, length) == b"\x22" * length
    finally:
        mapped._unmap(old, length)
