"""Checkpoint storage and the standalone checkpoint library, on real files, real forks and real signals.

What is tested (no mocks anywhere):

* :mod:`gangd.ckptlib.image` -- a rank's state file comes back bit for bit
  (numpy arrays of many dtypes and layouts, structured and big-endian dtypes,
  pickled objects including a ``np.random.Generator``), and truncated,
  corrupted or foreign files are refused with a :class:`StoreError` that says so.
* :mod:`gangd.ckptstore` -- ``write_atomic`` (no temporary left, checksum equal
  to ``checksum_file``, a full tmpfs reported as "no space left on device"
  with the path), manifests, ``verify`` and ``generations``.
* :mod:`gangd.ckptlib` run alone (no ``GANGD_*`` environment): a small program
  written into ``tmp_path`` and run with ``sys.executable`` checkpoints on
  ``ckpt.request()``, on SIGQUIT and every ``every`` seconds, is SIGKILLed and
  restarted with ``GANGD_RESTART``, and must end with the same digest as an
  uninterrupted run; background (forked) and inline writes; ``keep``;
  falling back from a corrupted generation; ``latest``/``auto`` without any
  checkpoint; a program that never enters ``ckpt.loop``.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from ckpthelpers import flip_byte
from conftest import tmpfs
from deltahelpers import footer, save_v1

from gangd import ckptstore
from gangd.ckptlib import image
from gangd.ckptstore import MANIFEST, Manifest, StoreError

# ====================================================================== helpers


def assert_same_array(restored, original: np.ndarray) -> None:
    assert isinstance(restored, np.ndarray)
    assert restored.dtype == original.dtype
    assert restored.shape == original.shape
    if original.dtype.names is None:
        assert np.array_equal(restored, original, equal_nan=original.dtype.kind in "fc")
    else:
        assert np.array_equal(restored, original)
    assert restored.tobytes() == original.tobytes()


def round_trip(tmp_path: Path, values: dict, iteration: int = 3):
    path = tmp_path / "rank-0.state"
    size, digest = image.save(path, values, iteration)
    assert (size, digest) == ckptstore.checksum_file(path)
    restored, it, extra = image.load(path, expect=(size, digest))
    assert it == iteration and extra == {}
    assert list(restored) == list(values)
    return restored


def saved(tmp_path: Path, version: int = 2) -> tuple[Path, int, str, int, int]:
    """A state file with an array and a pickled dict: (path, size, digest, where its header starts, its length).

    Version 2 (written today): the header is the index at the end (``GANGDCK2`` | blocks | index | footer, whose
    first two u64 are the index's offset and length). Version 1 (old generations, still read):
    ``GANGDCK1`` | u64 header length | header | payloads."""
    path = tmp_path / "rank-0.state"
    values = {"a": np.arange(1000, dtype=np.float64), "d": {"x": [1, 2, 3]}}
    if version == 1:
        size, digest = save_v1(path, values, 7)
        (header_len,) = struct.unpack_from("<Q", path.read_bytes(), len(image.MAGIC))
        return path, size, digest, len(image.MAGIC) + 8, header_len
    size, digest = image.save(path, values, 7)
    offset, length = footer(path)
    assert path.read_bytes()[: len(image.MAGIC2)] == image.MAGIC2
    return path, size, digest, offset, length


# ====================================================================== image: round trips

ARRAYS = {
    "float64": np.linspace(-1.0, 1.0, 37).reshape(37) * np.pi,
    "float64-special": np.array([np.nan, np.inf, -np.inf, -0.0, 5e-324, 1.7976931348623157e308]),
    "float32": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
    "int8": np.array([-128, -1, 0, 1, 127], dtype=np.int8),
    "complex128": (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex128).reshape(3, 2),
    "bool": np.array([[True, False, True], [False, False, True]]),
    "empty-0x3": np.zeros((0, 3)),
    "big-endian": np.arange(10, dtype=">f8") * 1.5,
    "big-endian-int": np.arange(-5, 5, dtype=">i4"),
    "structured": np.array([(1, 2.5, b"ab"), (-3, 4.25, b"xyz")], dtype=[("i", "<i4"), ("f", "<f8"), ("s", "S3")]),
    "structured-subarray": np.array([(1, [2.0, 3.0])], dtype=[("a", "<i4"), ("b", "<f8", (2,))]),
    "datetime": np.arange(3).astype("M8[s]"),
    "unicode": np.array(["ab", "c", ""]),
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_image_round_trip_arrays(tmp_path, name):
    original = ARRAYS[name]
    restored = round_trip(tmp_path, {name: original})
    assert_same_array(restored[name], original)


def test_image_round_trip_zero_dimensional_array(tmp_path):
    # Exposes a bug: image._plan's np.ascontiguousarray() turns a 0-d array into shape (1,).
    original = np.array(3.25)
    restored = round_trip(tmp_path, {"scalar": original})["scalar"]
    assert_same_array(restored, original)  # shape () must stay (), not become (1,)


def test_image_round_trip_nested_structured_dtype(tmp_path):
    # Exposes a bug: load() rebuilds dtype.descr one level deep only; a nested
    # field's descr comes back as lists and np.dtype() raises TypeError (not even StoreError).
    original = np.array([((1.5, -2.0), 7), ((0.25, 3.0), 255)], dtype=[("p", [("x", "<f4"), ("y", "<f4")]), ("q", "u1")])
    restored = round_trip(tmp_path, {"points": original})["points"]
    assert_same_array(restored, original)


def test_image_round_trip_aligned_structured_dtype(tmp_path):
    # Exposes a bug: dtype.descr names the padding ('', '|V7'), which comes
    # back as a real field 'f1': the restored dtype is not the saved one.
    dtype = np.dtype([("a", "u1"), ("b", "<f8")], align=True)  # 7 bytes of padding between the fields
    original = np.array([(1, 2.5), (3, -4.0)], dtype=dtype)
    restored = round_trip(tmp_path, {"rec": original})["rec"]
    assert_same_array(restored, original)


def test_image_round_trip_fortran_and_non_contiguous(tmp_path):
    fortran = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) ** 1.5)
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    strided = base[::2, 1::3]
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    assert not strided.flags.c_contiguous and not strided.flags.f_contiguous
    restored = round_trip(tmp_path, {"F": fortran, "S": strided})
    for name, original in (("F", fortran), ("S", strided)):
        got = restored[name]
        assert got.dtype == original.dtype and got.shape == original.shape
        assert np.array_equal(got, original)
        assert got.tobytes() == original.tobytes()  # tobytes() is C order for both
    assert base.sum() == np.arange(60).sum()  # saving did not touch the original


def test_image_round_trip_objects_and_generator(tmp_path):
    obj = {"residual": 1e-9, "nested": [[1, 2, [3, "four"]], (5.0, None)], "bytes": b"\x00\xff", "n": 2**70}
    rng = np.random.default_rng(12345)
    rng.random(17)  # move it away from its seed
    arr = np.arange(5.0)
    restored = round_trip(tmp_path, {"obj": obj, "rng": rng, "arr": arr})
    assert restored["obj"] == obj
    assert pickle.dumps(restored["obj"]) == pickle.dumps(obj)
    assert isinstance(restored["rng"], np.random.Generator)
    expected = rng.random(100)
    got = restored["rng"].random(100)
    assert got.tobytes() == expected.tobytes()
    assert restored["rng"].integers(0, 2**62, 10).tolist() == rng.integers(0, 2**62, 10).tolist()
    assert_same_array(restored["arr"], arr)


def test_image_restored_arrays_are_writable_and_independent(tmp_path):
    original = np.arange(8, dtype=np.float64)
    restored = round_trip(tmp_path, {"u": original})["u"]
    restored += 1  # a program updates what protect() returned in place
    assert restored.flags.writeable and restored.flags.owndata
    assert np.array_equal(original, np.arange(8, dtype=np.float64))


# ====================================================================== image: damaged files


VERSIONS = pytest.mark.parametrize("version", [1, 2])


@VERSIONS
def test_image_load_detects_cut_by_one_byte(tmp_path, version):
    path, size, digest, _, _ = saved(tmp_path, version)
    os.truncate(path, size - 1)
    with pytest.raises(StoreError, match="truncated") as info:
        image.load(path)
    assert str(path) in str(info.value)
    with pytest.raises(StoreError, match="truncated") as info:
        image.load(path, expect=(size, digest))
    assert str(path) in str(info.value)


@VERSIONS
@pytest.mark.parametrize("where", ["in-magic", "middle-of-header", "late-in-header"])
def test_image_load_detects_cut_in_header(tmp_path, where, version):
    path, _, _, start, header_len = saved(tmp_path, version)
    cut = {
        "in-magic": 5,
        "middle-of-header": start + header_len // 2,
        "late-in-header": start + header_len - 1,
    }[where]
    os.truncate(path, cut)
    # A cut in the first part of the header is reported as "corrupted: header
    # length N beyond the file's M bytes" (image.load's `length > size` check,
    # which also ignores the 16-byte prefix), though the length is right and
    # the file is short.
    with pytest.raises(StoreError) as info:
        image.load(path)
    message = str(info.value)
    assert str(path) in message
    assert "truncated" in message, message


@VERSIONS
def test_image_load_detects_flipped_payload_byte(tmp_path, version):
    path, size, digest, start, header_len = saved(tmp_path, version)
    payload = 3000 if version == 2 else start + header_len + 3000  # inside the array's bytes
    flip_byte(path, payload)
    with pytest.raises(StoreError, match="corrupted") as info:
        image.load(path, expect=(size, digest))
    assert str(path) in str(info.value)


@VERSIONS
def test_image_load_detects_flipped_header_byte(tmp_path, version):
    path, size, digest, start, header_len = saved(tmp_path, version)
    flip_byte(path, start + header_len // 2)
    with pytest.raises(StoreError) as info:
        image.load(path, expect=(size, digest))
    assert str(path) in str(info.value)
    if version == 2:  # version 2's index has its own checksum: caught without the manifest too
        with pytest.raises(StoreError, match="index does not match its checksum") as info:
            image.load(path)
        assert str(path) in str(info.value)


@VERSIONS
def test_image_load_rejects_bad_magic(tmp_path, version):
    path, _, _, _, _ = saved(tmp_path, version)
    flip_byte(path, 0)
    with pytest.raises(StoreError, match="bad magic") as info:
        image.load(path)
    assert str(path) in str(info.value)
    other = tmp_path / "notes.txt"
    other.write_bytes(b"just some text, long enough to have a header")
    with pytest.raises(StoreError, match="bad magic"):
        image.load(other)


@VERSIONS
def test_image_load_rejects_wrong_expected_size(tmp_path, version):
    path, size, digest, _, _ = saved(tmp_path, version)
    for wrong in (size + 1, size - 1, 0):
        with pytest.raises(StoreError, match="truncated or grew") as info:
            image.load(path, expect=(wrong, digest))
        assert str(path) in str(info.value)
    with pytest.raises(StoreError, match="corrupted"):
        image.load(path, expect=(size, "0" * 32))


@VERSIONS
def test_image_load_rejects_trailing_bytes_and_missing_file(tmp_path, version):
    path, _, _, _, _ = saved(tmp_path, version)
    with open(path, "ab") as fh:
        fh.write(b"x")
    with pytest.raises(StoreError, match="trailing bytes"):
        image.load(path)
    with pytest.raises(StoreError, match="cannot open"):
        image.load(tmp_path / "absent.state")


def test_image_unpicklable_value_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="'lock'"):
        image.save(tmp_path / "s.state", {"lock": __import__("threading").Lock()}, 0)


# ====================================================================== ckptstore


def temporaries(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def test_write_atomic_no_temporary_and_checksum(tmp_path):
    path = tmp_path / "data.bin"
    chunks = [b"head", bytearray(b"\x01" * 1000), memoryview(np.arange(300, dtype=np.float64)), b""]
    size, digest = ckptstore.write_atomic(path, chunks)
    assert size == 4 + 1000 + 300 * 8 == path.stat().st_size
    assert (size, digest) == ckptstore.checksum_file(path)
    assert len(digest) == 32 and int(digest, 16) >= 0  # xxh3-128 hex
    assert temporaries(tmp_path) == []
    assert path.read_bytes() == b"head" + b"\x01" * 1000 + np.arange(300, dtype=np.float64).tobytes()
    assert path.stat().st_mode & 0o777 == 0o600
    # a second write replaces the first whole
    size2, digest2 = ckptstore.write_atomic(path, [b"short"])
    assert path.read_bytes() == b"short" and (size2, digest2) == ckptstore.checksum_file(path)
    assert digest2 != digest and temporaries(tmp_path) == []


def test_write_atomic_error_names_path(tmp_path):
    path = tmp_path / "no-such-dir" / "data.bin"
    with pytest.raises(StoreError) as info:
        ckptstore.write_atomic(path, [b"x"])
    assert str(path) in str(info.value)


@pytest.mark.root
def test_write_atomic_full_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    with tmpfs(mnt, "256k"):
        path = mnt / "rank-0.state"
        with pytest.raises(StoreError) as info:
            ckptstore.write_atomic(path, [np.zeros(1 << 20, dtype=np.uint8)])
        message = str(info.value)
        assert "no space left on device" in message
        assert str(path) in message
        assert os.listdir(mnt) == []  # neither the file nor its temporary
        # the same through image.save, and a small file still fits afterwards
        with pytest.raises(StoreError, match="no space left on device"):
            image.save(path, {"u": np.ones(1 << 17)}, 0)
        assert os.listdir(mnt) == []
        size, digest = ckptstore.write_atomic(path, [b"fits"])
        assert (size, digest) == ckptstore.checksum_file(path)


def make_generation(root: Path, gen: int = 1) -> Path:
    directory = ckptstore.gen_dir(root, 0, gen)
    directory.mkdir(parents=True)
    files = {}
    for name, payload in ((ckptstore.rank_file(0), b"r0" * 5000), (ckptstore.net_file(0), b"net context")):
        files[name] = list(ckptstore.write_atomic(directory / name, [payload]))
    ckptstore.write_manifest(directory, Manifest(0, gen, "node-a", 42, files, [0], 1234.5))
    return directory


def test_manifest_round_trip(tmp_path):
    directory = make_generation(tmp_path, 3)
    manifest = ckptstore.read_manifest(directory)
    assert (manifest.lineage, manifest.gen, manifest.node, manifest.iteration) == (0, 3, "node-a", 42)
    assert manifest.ranks == [0] and manifest.committed == 1234.5
    assert manifest.files[ckptstore.rank_file(0)] == list(ckptstore.checksum_file(directory / "rank-0.state"))
    assert Manifest.unpack(manifest.pack(), directory / MANIFEST) == manifest
    assert temporaries(directory) == []


def test_verify_intact_generation(tmp_path):
    directory = make_generation(tmp_path)
    assert ckptstore.verify(directory) == []
    assert ckptstore.verify(directory, ["rank-0.state"]) == []


def test_verify_missing_file(tmp_path):
    directory = make_generation(tmp_path)
    (directory / "rank-0.state").unlink()
    problems = ckptstore.verify(directory)
    assert problems == [f"{directory / 'rank-0.state'} is missing"]
    assert ckptstore.verify(directory, ["net-0.ctx"]) == []


def test_verify_truncated_and_grown_file(tmp_path):
    directory = make_generation(tmp_path)
    path = directory / "rank-0.state"
    os.truncate(path, 9999)
    [problem] = ckptstore.verify(directory)
    assert str(path) in problem and "is truncated or grew" in problem
    os.truncate(path, 10001)
    [problem] = ckptstore.verify(directory)
    assert str(path) in problem and "is truncated or grew" in problem


def test_verify_corrupted_file(tmp_path):
    directory = make_generation(tmp_path)
    flip_byte(directory / "net-0.ctx", 3)
    [problem] = ckptstore.verify(directory)
    assert str(directory / "net-0.ctx") in problem and "is corrupted" in problem


def test_verify_name_not_in_manifest(tmp_path):
    directory = make_generation(tmp_path)
    [problem] = ckptstore.verify(directory, ["rank-7.state"])
    assert str(directory / "rank-7.state") in problem and "not in the manifest" in problem


def test_verify_missing_manifest(tmp_path):
    directory = make_generation(tmp_path)
    (directory / MANIFEST).unlink()
    [problem] = ckptstore.verify(directory)
    assert str(directory / MANIFEST) in problem and "missing" in problem
    with pytest.raises(StoreError, match="missing"):
        ckptstore.read_manifest(directory)


@pytest.mark.parametrize(
    "content",
    [b"", b"\xc1 not msgpack", msgpack.packb([1, 2, 3]), msgpack.packb({"format": 1, "lineage": 0}),
     msgpack.packb({"gen": 1})],
    ids=["empty", "garbage", "a-list", "missing-keys", "no-format"],
)
def test_garbage_manifest(tmp_path, content):
    directory = make_generation(tmp_path)
    (directory / MANIFEST).write_bytes(content)
    with pytest.raises(StoreError, match="unreadable manifest") as info:
        ckptstore.read_manifest(directory)
    assert str(directory / MANIFEST) in str(info.value)
    [problem] = ckptstore.verify(directory)
    assert "unreadable manifest" in problem


def test_manifest_of_another_format(tmp_path):
    directory = make_generation(tmp_path)
    raw = msgpack.unpackb((directory / MANIFEST).read_bytes())
    raw["format"] = 99
    (directory / MANIFEST).write_bytes(msgpack.packb(raw))
    with pytest.raises(StoreError, match="not supported"):
        ckptstore.read_manifest(directory)


def test_generations_listing(tmp_path):
    assert ckptstore.generations(tmp_path, 0) == []  # no job directory at all
    for gen in (10, 2, 1):
        ckptstore.gen_dir(tmp_path, 0, gen).mkdir(parents=True)
    for junk in ("gen-", "gen-x", "gen-3.tmp", "other"):
        (ckptstore.job_dir(tmp_path, 0) / junk).mkdir()
    ckptstore.gen_dir(tmp_path, 5, 4).mkdir(parents=True)
    assert ckptstore.generations(tmp_path, 0) == [1, 2, 10]
    assert ckptstore.generations(tmp_path, 5) == [4]
    assert ckptstore.gen_dir(tmp_path, 0, 2) == tmp_path / "job-0" / "gen-2"


# ====================================================================== standalone programs

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, signal, sys, time
    import numpy as np
    from gangd import ckptlib as ckpt

    def ints(name):
        return {int(x) for x in os.environ.get(name, "").split(",") if x}

    N = int(os.environ.get("T_N", "30"))
    REQUEST_AT, QUIT_AT, KILL_AT = ints("T_REQUEST"), ints("T_QUIT"), ints("T_KILL")
    SLOW_AT = ints("T_SLOW")  # iterations whose checkpoint is slow to write (see Slow)
    SLEEP = float(os.environ.get("T_SLEEP", "0"))
    EVERY = os.environ.get("T_EVERY", "0")
    EVERY = "auto" if EVERY == "auto" else (float(EVERY) or None)

    class Slow:
        # Pickled in the writer (the forked snapshot, for background writes):
        # takes a while when the snapshot was cut with .slow set.
        def __init__(self):
            self.slow = False
        def __getstate__(self):
            if self.slow:
                time.sleep(0.6)
            return {"slow": False}

    ckpt.init(every=EVERY)
    u = ckpt.protect("u", np.zeros(64))
    state = ckpt.protect("state", {"total": 0, "history": [], "rng": np.random.default_rng(7)})
    slow = ckpt.protect("slow", Slow())
    print("restarted", ckpt.restarted(), ckpt.generation(), flush=True)
    first = None
    for it in ckpt.loop(range(N)):
        if first is None:
            first = it
            print("first", it, flush=True)
        slow.slow = it in SLOW_AT
        u += np.sin(np.arange(64) * (it + 1)) + state["rng"].random(64)
        u *= 0.999
        state["total"] += it * it
        state["history"].append(it % 7)
        if it in REQUEST_AT:
            ckpt.request()
        if it in QUIT_AT:
            os.kill(os.getpid(), signal.SIGQUIT)
        if it in KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        if SLEEP:
            time.sleep(SLEEP)
    print("generation", ckpt.generation(), flush=True)
    ckpt.fini()
    h = hashlib.sha256(u.tobytes())
    h.update(repr((state["total"], state["history"])).encode())
    h.update(state["rng"].random(4).tobytes())
    print("digest", h.hexdigest(), flush=True)
    """
)


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def write_program(directory: Path) -> Path:
    script = directory / "prog.py"
    script.write_text(PROGRAM)
    return script


def run(directory: Path, *, timeout: float = 30, **env) -> subprocess.CompletedProcess:
    """Run prog.py (written into ``directory`` if needed) there, with T_*/GANGD_* settings from ``env``."""
    script = directory / "prog.py"
    if not script.exists():
        write_program(directory)
    return subprocess.run([sys.executable, str(script)], cwd=directory, env=clean_env(**env), check=False,
                          capture_output=True, text=True, timeout=timeout)


def field(result: subprocess.CompletedProcess, key: str) -> list[str]:
    for line in result.stdout.splitlines():
        words = line.split()
        if words and words[0] == key:
            return words[1:]
    raise AssertionError(f"no {key!r} line in the output:\n{result.stdout}\n--- stderr:\n{result.stderr}")


def digest(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n--- stderr:\n{result.stderr}"
    return field(result, "digest")[0]


def ckpt_root(directory: Path) -> Path:
    return directory / "prog.ckpt"  # the default: <script stem>.ckpt in the working directory


def complete_generations(directory: Path) -> list[int]:
    root = ckpt_root(directory)
    return [g for g in ckptstore.generations(root, 0) if (ckptstore.gen_dir(root, 0, g) / MANIFEST).exists()]


def manifest_of(directory: Path, gen: int) -> Manifest:
    return ckptstore.read_manifest(ckptstore.gen_dir(ckpt_root(directory), 0, gen))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """D: the digest of an uninterrupted run (which takes no checkpoint)."""
    directory = tmp_path_factory.mktemp("reference")
    result = run(directory)
    assert field(result, "restarted") == ["False", "None"]
    assert field(result, "first") == ["0"]
    assert not ckpt_root(directory).exists()
    return digest(result)


def test_uninterrupted_run_is_deterministic(tmp_path, reference):
    assert digest(run(tmp_path)) == reference
    assert not ckpt_root(tmp_path).exists()


@pytest.mark.parametrize("background", ["1", "0"], ids=["background", "inline"])
def test_request_sigkill_restart(tmp_path, reference, background):
    killed = run(tmp_path, T_REQUEST=10, T_KILL=20, GANGD_CKPT_BACKGROUND=background)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "digest" not in killed.stdout
    assert complete_generations(tmp_path) == [1]
    directory = ckptstore.gen_dir(ckpt_root(tmp_path), 0, 1)
    assert sorted(os.listdir(directory)) == [MANIFEST, "rank-0.state"]  # no temporaries
    assert ckptstore.verify(directory) == []
    manifest = manifest_of(tmp_path, 1)
    assert manifest.iteration == 11 and manifest.ranks == [0] and list(manifest.files) == ["rank-0.state"]

    resumed = run(tmp_path, GANGD_RESTART="latest", GANGD_CKPT_BACKGROUND=background)
    assert digest(resumed) == reference
    assert field(resumed, "restarted") == ["True", "1"]
    assert field(resumed, "first") == ["11"]
    assert "gangd.ckptlib" not in resumed.stderr, resumed.stderr  # no warnings


def test_sigquit_checkpoints_without_killing(tmp_path, reference):
    result = run(tmp_path, T_QUIT=5)
    assert digest(result) == reference  # SIGQUIT did not kill (nor dump) the process
    assert field(result, "generation") == ["1"]
    assert complete_generations(tmp_path) == [1]
    assert manifest_of(tmp_path, 1).iteration == 6
    assert ckptstore.verify(ckptstore.gen_dir(ckpt_root(tmp_path), 0, 1)) == []
    # and the generation it wrote restarts to the same result
    resumed = run(tmp_path, GANGD_RESTART="latest")
    assert digest(resumed) == reference and field(resumed, "first") == ["6"]


def test_every_auto_alone_checkpoints_at_once_then_at_the_planned_interval_and_restarts_bit_identical(tmp_path):
    """init(every="auto") in a process alone (issue 19): the first checkpoint at
    once (to measure its cost), then every m iterations, m the optimal interval
    (1 s at the least: with GANGD_MTBF=20s the optimum is below it) over the
    measured pace (20 ms): about 50 on a quiet machine."""
    settings = {"T_N": 140, "T_SLEEP": 0.02, "T_EVERY": "auto", "GANGD_MTBF": "20s", "GANGD_CKPT_BACKGROUND": "0"}
    elsewhere = tmp_path / "ref"
    elsewhere.mkdir()
    reference = digest(run(elsewhere, T_N=140))
    killed = run(tmp_path, T_KILL=130, **settings)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # Generations 1 (iteration 0), 2 (m) and 3 (2m); the newest two kept. (m is 1 s over the measured
    # pace: ~50 iterations on a quiet machine, fewer when load stretches them; more when load makes the
    # first checkpoint slow, for the optimum grows with its cost C: then 3 is not reached by the kill.
    # Made again when the pace moves, so the two gaps need not be equal.)
    gens = complete_generations(tmp_path)
    assert gens in ([1, 2], [2, 3]), gens
    its = [manifest_of(tmp_path, g).iteration for g in gens]
    if gens == [1, 2]:
        assert its[0] == 0, its  # (the first at once, to measure its cost)
        gaps = [its[1]]
    else:
        gaps = [its[0], its[1] - its[0]]  # (generation 1, removed, was at iteration 0)
    assert all(8 <= gap <= 129 for gap in gaps), its
    second = its[1]
    resumed = run(tmp_path, GANGD_RESTART="latest", **{k: v for k, v in settings.items() if k != "T_N"}, T_N=140)
    assert digest(resumed) == reference and field(resumed, "first") == [str(second)]
    bad = run(elsewhere, T_EVERY="auto", GANGD_MTBF="often")
    assert bad.returncode != 0 and "GANGD_MTBF='often' is not a duration" in bad.stderr


def test_every_creates_generations_and_keeps_two(tmp_path):
    result = run(tmp_path, T_N=40, T_SLEEP=0.025, T_EVERY=0.1)
    digest(result)  # ran to the end (a longer run than the reference: another digest)
    last = int(field(result, "generation")[0])
    assert last >= 4, f"only {last} checkpoints in a ~1 s run with every=0.1"
    # Normally [last - 1, last]; if two background writes ever finished out of
    # order the older one is lost (see the out-of-order test below), so only
    # the count and the newest are asserted here.
    kept = complete_generations(tmp_path)
    assert len(kept) == 2 and kept[-1] == last, kept
    assert ckptstore.generations(ckpt_root(tmp_path), 0) == kept  # no leftovers besides them
    for gen in kept:
        assert ckptstore.verify(ckptstore.gen_dir(ckpt_root(tmp_path), 0, gen)) == []
    assert manifest_of(tmp_path, kept[0]).iteration < manifest_of(tmp_path, last).iteration


def two_generations_then_kill(directory: Path) -> None:
    """Generations 1 (iteration 6) and 2 (iteration 11), then SIGKILL at 20.

    Inline writes: both generations are on disk, committed, before the kill.
    """
    killed = run(directory, T_REQUEST="5,10", T_KILL=20, GANGD_CKPT_BACKGROUND=0)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert complete_generations(directory) == [1, 2]
    assert [manifest_of(directory, g).iteration for g in (1, 2)] == [6, 11]


@pytest.mark.parametrize("gen,first", [(2, 11), (1, 6)])
def test_restart_from_a_numbered_generation(tmp_path, reference, gen, first):
    two_generations_then_kill(tmp_path)
    # Documented: GANGD_RESTART=latest|auto|<generation>. "1" is also taken as
    # "yes" (= latest) by ckptlib.init, so generation 1 cannot be asked for.
    resumed = run(tmp_path, GANGD_RESTART=gen)
    assert digest(resumed) == reference
    assert field(resumed, "restarted") == ["True", str(gen)]
    assert field(resumed, "first") == [str(first)]


def test_corrupted_newest_generation_falls_back(tmp_path, reference):
    two_generations_then_kill(tmp_path)
    newest = ckptstore.gen_dir(ckpt_root(tmp_path), 0, 2) / "rank-0.state"
    flip_byte(newest, -10)
    named = "prog.ckpt/job-0/gen-2/rank-0.state"  # the library names it as the program does: relative to its cwd

    resumed = run(tmp_path, GANGD_RESTART="latest")
    assert digest(resumed) == reference
    assert field(resumed, "restarted") == ["True", "1"]
    assert field(resumed, "first") == ["6"]
    assert "generation 2 is unusable" in resumed.stderr and named in resumed.stderr, resumed.stderr

    # asking for the corrupted generation by number does not fall back
    failed = run(tmp_path, GANGD_RESTART="2")
    assert failed.returncode != 0
    assert "CheckpointError" in failed.stderr and named in failed.stderr and "corrupted" in failed.stderr


def test_background_writes_keep_two_generations_when_they_finish_out_of_order(tmp_path, reference):
    # The checkpoint at boundary 6 is slow to write (its snapshot pickles a
    # Slow object cut with .slow set); the one at boundary 11 finishes first.
    # With keep=2 both must survive, and no write may fail. Exposes a bug:
    # Standalone.prune, run by the generation-2 writer, deletes generation 1
    # (no MANIFEST yet: taken for a leftover) while its writer is still at work.
    result = run(tmp_path, T_REQUEST="5,10", T_SLOW=5)
    assert digest(result) == reference
    assert "checkpoint failed" not in result.stderr, result.stderr
    assert complete_generations(tmp_path) == [1, 2]


def test_restart_latest_without_checkpoint_fails_clearly(tmp_path):
    result = run(tmp_path, GANGD_RESTART="latest")
    assert result.returncode != 0
    assert "CheckpointError" in result.stderr
    assert "CheckpointError: no complete checkpoint in prog.ckpt/job-0 to restart from" in result.stderr
    assert "digest" not in result.stdout


def test_restart_auto_without_checkpoint_starts_fresh(tmp_path, reference):
    result = run(tmp_path, GANGD_RESTART="auto")
    assert digest(result) == reference
    assert field(result, "restarted") == ["False", "None"]
    assert field(result, "first") == ["0"]


def test_program_without_loop(tmp_path):
    script = tmp_path / "noloop.py"
    script.write_text(textwrap.dedent(
        """
        import numpy as np
        from gangd import ckptlib as ckpt
        ckpt.init()
        u = ckpt.protect("u", np.arange(4.0))
        ckpt.request()  # no loop: no boundary, so nothing is written
        print("restarted", ckpt.restarted(), "sum", u.sum(), flush=True)
        ckpt.fini()
        ckpt.fini()  # twice is harmless
        print("done", flush=True)
        """
    ))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(), check=False,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["restarted", "False", "sum", "6.0", "done"]
    assert result.stderr == ""
    assert not (tmp_path / "noloop.ckpt").exists()


def catches_sigquit(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGQUIT - 1)))


def test_alone_messages_to_itself_in_flight_survive_a_restart(tmp_path):
    """examples/ring.py run alone is a one-rank ring: at every boundary a
    message it sent itself is still queued. Nobody but ckptlib can save it."""
    ring = Path(__file__).resolve().parent.parent / "examples" / "ring.py"
    argv = [sys.executable, str(ring), "--steps", "150"]
    expected = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=True).stdout
    proc = subprocess.Popen([*argv, "--sleep", "0.01"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not catches_sigquit(proc.pid):  # ckpt.init() has run
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    time.sleep(0.2)
    proc.send_signal(signal.SIGQUIT)
    deadline = time.monotonic() + 10
    while not list((tmp_path / "ring.ckpt").glob("job-0/gen-*/MANIFEST")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    restarted = subprocess.run(argv, cwd=tmp_path, env=clean_env(GANGD_RESTART="latest"), capture_output=True, text=True, timeout=60, check=False)
    assert restarted.returncode == 0, restarted.stderr
    assert restarted.stdout == expected and "RESULT" in expected


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix is discouraged, not gone
def test_image_round_trip_array_subclasses_keep_their_type(tmp_path):
    """np.matrix multiplies differently from an ndarray; a masked array has a mask: both must come back as they were."""
    m = np.matrix([[1, 2], [3, 4]])
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    restored = round_trip(tmp_path, {"m": m, "masked": masked})
    assert type(restored["m"]) is np.matrix and (restored["m"] * restored["m"] == m * m).all()
    assert type(restored["masked"]) is np.ma.MaskedArray
    assert restored["masked"].mask.tolist() == [False, True, False] and restored["masked"].sum() == 4.0


# ---------------------------------------------------------------- single-process checkpointer plug-ins

PLUGIN_PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys
    from gangd import ckptlib as ckpt
    from gangd.ckptlib import spc

    class JsonSPC(spc.SPC):          # a third-party plug-in: about ten lines
        name = "json"
        def do_ckpt(self, values, iteration):
            with open(self.path, "w") as f:
                json.dump({"iteration": iteration, "values": values}, f)
        def restart(self):
            with open(self.path) as f:
                saved = json.load(f)
            return saved["values"], saved["iteration"]

    spc.register("json", JsonSPC)
    state = {"total": 0}

    def save(f):
        f.write(json.dumps(state).encode())

    def load(f):
        state.update(json.loads(f.read()))

    chosen = spc.Callables(save=save, load=load) if os.environ["WHICH"] == "callables" else os.environ["WHICH"]
    ckpt.init(spc=chosen)
    acc = ckpt.protect("acc", {"total": 0})
    first = None
    for it in ckpt.loop(range(40)):
        first = it if first is None else first
        acc["total"] += it * it
        state["total"] += it
        if it == 10 and not ckpt.restarted():
            ckpt.request()
        if it == 20 and not ckpt.restarted():
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.fini()
    print("first", first, "acc", acc["total"], "state", state["total"])
    """
)


@pytest.mark.parametrize("which", ["json", "callables", "registered"])
def test_single_process_checkpointer_plugins(tmp_path, which):
    (tmp_path / "plug.py").write_text(PLUGIN_PROGRAM)

    def go(**env):
        env = clean_env(WHICH=which, **env)
        return subprocess.run([sys.executable, "plug.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)

    killed = go()
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    restarted = go(GANGD_RESTART="latest")
    assert restarted.returncode == 0, restarted.stderr
    total_sq, total = sum(i * i for i in range(40)), sum(range(40))
    if which == "callables":  # the program's own state travels; protect()ed values are not its business
        assert restarted.stdout.split()[:2] == ["first", "11"] and restarted.stdout.split()[-1] == str(total)
    else:
        assert restarted.stdout.split() == ["first", "11", "acc", str(total_sq), "state", str(sum(range(11, 40)))]
    manifest = next(tmp_path.glob("plug.ckpt/job-0/gen-*/MANIFEST"))
    assert ckptstore.verify(manifest.parent) == []


def test_unknown_checkpointer_names_the_known_ones(tmp_path):
    (tmp_path / "bad.py").write_text("from gangd import ckptlib as ckpt\nckpt.init(spc='nope')\n")
    result = subprocess.run([sys.executable, "bad.py"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "no single-process checkpointer named 'nope'" in result.stderr and "registered" in result.stderr
