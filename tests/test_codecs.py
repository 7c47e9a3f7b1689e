"""The checkpoint codecs (gangd.codecs) on their own: what a restart relies on when blocks come back compressed.

Every value's bytes must come back bit-identical under every codec; data
that does not shrink is stored raw; compressed bytes from a file the job's
owner can write are hostile, so a corrupt, truncated or oversized block is
a CodecError naming the codec (never a crash, never an allocation the data
claims, never silently wrong bytes when the block's checksum is given);
and a codec that is not installed here is named with how to install it.
Plug-ins are found through real entry points (a dist-info written into a
directory on sys.path, read by importlib.metadata), not by patching the
registry; the start-up and missing-library cases run in real subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import xxhash
from codechelpers import ZLIB_PLUGIN, dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd import codecs
from gangd.codecs import CodecError, CodecId, CodecMissing, CodecSpec, registry

# Every built-in and every level/filter/inner family each has.
CODECS = [
    "none", "lz4", "zstd:1", "zstd:19", "blosc2", "blosc2:lz4:bytedelta", "blosc2:lz4hc:9:bitshuffle", "blosc2:blosclz:5:nofilter",
    "blosc2:zlib:shuffle", "blosc2:zstd:9:bytedelta",
]
DTYPES = [
    np.dtype("?"), np.dtype("i1"), np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"),
    np.dtype("<u8"), np.dtype("<f2"), np.dtype("<f4"), np.dtype("<f8"), np.dtype("<c8"), np.dtype("<c16"), np.dtype("<M8[s]"),
    np.dtype("<m8[ms]"), np.dtype("S7"), np.dtype("<U5"), np.dtype(">f8"), np.dtype(">i4"), np.dtype(">c16"), np.dtype(">M8[ns]"),
    np.dtype([("a", "u1"), ("b", "<f8"), ("c", ">i2", (3,))]), np.dtype([("x", "<f4", (2, 3)), ("s", "S5"), ("u", "<U3")], align=True),
    np.dtype([("big", "V300")]),  # a record wider than blosc2's 255-byte item limit
]
SHAPES = [(), (0,), (0, 3), (1,), (1000,), (37, 11), (4, 5, 6)]


def _array(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """An array whose bytes are partly random and partly regular, so codecs both compress and copy."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    rng = np.random.default_rng(seed)
    third = n // 3
    raw = np.concatenate([
        np.frombuffer(rng.bytes(third), np.uint8), np.zeros(third, np.uint8), (np.arange(n - 2 * third) % 251).astype(np.uint8),
    ])
    return raw.view(dtype).reshape(shape)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """The memory of a C-contiguous array as a flat uint8 array (datetimes and records have no buffer format)."""
    return a.reshape(-1).view(np.uint8)


def _roundtrip(spec: str, a: np.ndarray) -> tuple[CodecId, np.ndarray]:
    ident, payload = codecs.encode(spec, _bytes_of(a), a.dtype.itemsize)
    stored = bytes(payload)  # what a file would hold: nothing of the source array is shared
    out = np.empty(a.shape, a.dtype)
    digest = xxhash.xxh3_128_digest(_bytes_of(a))
    assert codecs.decode(str(ident), stored, memoryview(_bytes_of(out)), digest) == a.nbytes
    return ident, out


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_comes_back_bit_identical_under_every_codec(spec, dtype):
    for shape in SHAPES:
        a = _array(dtype, shape)
        ident, out = _roundtrip(spec, a)
        assert out.tobytes() == a.tobytes(), (shape, ident)
        assert ident.spec.name in (CodecSpec.parse(spec).name, "none")


@pytest.mark.parametrize("spec", CODECS[1:])
def test_compressible_blocks_are_compressed_and_incompressible_ones_stored_raw(spec):
    smooth = np.sin(np.linspace(0, 40, 1 << 16))
    ident, packed = codecs.encode(spec, smooth.view(np.uint8), 8)
    if ident.spec.name != "none":  # lz4 and zstd do not shrink smooth floats (their low bytes look random): raw then
        assert ident == codecs.identity(spec) and len(packed) < smooth.nbytes
    zeros = np.zeros(1 << 16)
    ident, packed = codecs.encode(spec, zeros.view(np.uint8), 8)
    assert str(ident) == str(codecs.identity(spec)) and len(packed) < zeros.nbytes // 20
    noise = np.frombuffer(np.random.default_rng(1).bytes(1 << 18), np.uint8)
    ident, packed = codecs.encode(spec, noise, 8)
    assert str(ident) == "none@1" and bytes(packed) == noise.tobytes()


def test_non_contiguous_input_is_compressed_as_its_c_order_bytes():
    grid = np.arange(60 * 40, dtype="<f8").reshape(60, 40)
    for view in (grid[::3, ::2], grid.T, np.asfortranarray(grid), grid[:, 5]):
        for spec in CODECS:
            ident, payload = codecs.encode(spec, memoryview(view), 8)
            out = np.empty(view.shape, view.dtype)
            codecs.decode(ident, bytes(payload), memoryview(_bytes_of(out)))
            assert out.tobytes() == np.ascontiguousarray(view).tobytes()


def test_auto_stores_random_data_raw_and_picks_a_filter_fitting_the_dtype():
    rng = np.random.default_rng(2)
    n = 1 << 20
    smooth = np.sin(np.linspace(0, 40, n)) + 0.01 * rng.standard_normal(n)
    cases = [
        (np.frombuffer(rng.bytes(8 * n), "<f8"), "none"),  # random float64 bits
        # (Uniform floats in [0, 1) are not random bytes: their exponents are alike, and shuffled they shrink ~1.19x.)
        (rng.random(n), "blosc2:zstd:1:bytedelta"),
        (np.frombuffer(rng.bytes(n), np.uint8), "none"),
        (smooth, "blosc2:zstd:1:bytedelta"),
        (np.arange(n, dtype=np.int32), "blosc2:zstd:1:shuffle"),
        (np.arange(n).astype("<M8[s]"), "blosc2:zstd:1:shuffle"),
        (np.frombuffer(b"a checkpoint's pickled dict, keys and text repeat " * 3000, np.uint8), "zstd:1"),
        (np.zeros(n, "?"), "zstd:1"),
        (np.zeros(0), "none"),
    ]
    for value, expected in cases:
        spec = codecs.choose(_bytes_of(value), value.dtype)
        assert str(spec) == expected, (value.dtype, expected)
        ident, payload = codecs.encode(spec, _bytes_of(value), value.dtype.itemsize)
        out = np.empty_like(value)
        codecs.decode(ident, bytes(payload), memoryview(_bytes_of(out)))
        assert out.tobytes() == value.tobytes()
    assert str(codecs.choose(b"x" * 1000)) == "zstd:1"  # plain bytes, no dtype


def test_auto_samples_the_whole_value_not_just_its_start():
    rng = np.random.default_rng(3)
    noise = np.frombuffer(rng.bytes(8 << 20), "<f8")
    head_random = np.concatenate([noise[: 1 << 14], np.zeros(1 << 20)])  # 128 KiB of noise (a header), then 8 MiB of zeros
    assert str(codecs.choose(_bytes_of(head_random), head_random.dtype)) != "none"
    tail_random = np.concatenate([np.zeros(1 << 14), noise])
    assert str(codecs.choose(_bytes_of(tail_random), tail_random.dtype)) == "none"


@pytest.mark.parametrize("spec", CODECS)
def test_a_block_decoded_into_the_wrong_size_is_refused(spec):
    a = np.sin(np.linspace(0, 4, 5000))
    for block in (a, np.zeros(5000)):
        ident, payload = codecs.encode(spec, _bytes_of(block), 8)
        for size in (0, block.nbytes - 1, block.nbytes + 1, 2 * block.nbytes):
            with pytest.raises(CodecError) as e:
                codecs.decode(ident, bytes(payload), memoryview(bytearray(size)))
            assert e.value.codec == ident.spec.name


@pytest.mark.parametrize("spec", CODECS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_or_truncated_block_is_caught_never_silently_wrong(spec, data):
    block = np.sin(np.linspace(0, 30, 4096)) * 1000
    if data.draw(st.booleans()):
        block = np.round(block)  # (another shape of data: blosc2 and zstd take other paths through their formats)
    ident, payload = codecs.encode(spec, _bytes_of(block), 8)
    stored = bytearray(payload)
    how = data.draw(st.sampled_from(["flip", "truncate", "append", "zero"]))
    if how == "flip" and stored:
        for _ in range(data.draw(st.integers(1, 4))):
            stored[data.draw(st.integers(0, len(stored) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del stored[data.draw(st.integers(0, max(0, len(stored) - 1))):]
    elif how == "append":
        stored += data.draw(st.binary(min_size=1, max_size=64))
    elif stored:
        start = data.draw(st.integers(0, len(stored) - 1))
        stored[start : start + 16] = bytes(len(stored[start : start + 16]))
    out = np.empty_like(block)
    try:
        codecs.decode(ident, bytes(stored), memoryview(_bytes_of(out)), xxhash.xxh3_128_digest(_bytes_of(block)))
    except CodecError as e:
        assert e.codec == ident.spec.name
    else:  # a change the format ignores (a padding bit): the checksum vouches for every byte
        assert out.tobytes() == block.tobytes()


@pytest.mark.parametrize("name", ["none", "lz4", "zstd:3", "blosc2:zstd:1:shuffle", "blosc2:lz4:bytedelta"])
@settings(max_examples=300, deadline=None)
@given(junk=st.binary(max_size=512), size=st.integers(0, 1 << 20))
def test_any_bytes_handed_to_a_decoder_fill_exactly_the_stated_size_or_are_a_codec_error(name, junk, size):
    codec = codecs.get(name)
    out = bytearray(size)
    try:
        assert codec.decompress_into(junk, memoryview(out)) == size
    except CodecError as e:
        assert e.codec == codec.name


# A zstd frame declaring 1 TiB of content and holding none (single segment, 8-byte content size, one empty raw block),
# a blosc2 chunk whose header claims 2 GiB, and lz4 told to expect less than it would produce: each must be refused
# before anything near the claimed size is allocated. Run under an address-space limit, so an allocation the
# data claims fails the process instead of passing unnoticed on a machine with memory to spare.
_BOUNDED = textwrap.dedent("""
    import resource, struct, sys
    import numpy as np
    from gangd import codecs
    from gangd.codecs import CodecError
    smooth = np.sin(np.linspace(0, 9, 1 << 15)).view(np.uint8)
    cases = [("zstd:3", b"\\x28\\xb5\\x2f\\xfd\\xe0" + struct.pack("<Q", 1 << 40) + b"\\x01\\x00\\x00", 100)]
    for declared in (1 << 29, (1 << 31) - 1):
        chunk = bytearray(codecs.get("blosc2").compress(smooth, 8))
        chunk[4:8] = struct.pack("<i", declared)
        cases.append(("blosc2", bytes(chunk), smooth.nbytes))
        frame = bytearray(codecs.get("zstd:3").compress(smooth, 8))
        cases.append(("zstd:3", bytes(frame), declared))
    cases.append(("lz4", bytes(codecs.get("lz4").compress(np.zeros(1 << 20), 8)), 1000))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
    for spec, data, size in cases:
        out = bytearray(min(size, 1 << 20))
        try:
            codecs.get(spec).decompress_into(data, memoryview(out))
        except CodecError as e:
            print(spec, "refused:", e.message)
        else:
            sys.exit(f"{spec}: decoded a block claiming another size")
""")


def test_hostile_declared_sizes_are_refused_without_allocating_them():
    done = subprocess.run([sys.executable, "-c", _BOUNDED], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused") == 6, done.stdout


def test_importing_gangd_codecs_and_parsing_a_spec_loads_no_compression_library():
    probe = (
        "import sys, gangd.codecs as c; c.CodecSpec.parse('blosc2:lz4:bytedelta'); c.CodecId.parse('zstd:3@1'); c.get('none'); "
        "print(sorted(m for m in ('lz4', 'zstandard', 'blosc2', 'importlib.metadata') if m in sys.modules)); "
        "c.get('zstd'); print(sorted(m for m in ('lz4', 'zstandard', 'blosc2') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["[]", "['zstandard']"]


def test_the_blosc2_codec_lets_the_other_stages_run_while_it_compresses():
    """blosc2 holds the GIL while it compresses unless told otherwise (lz4 and zstd let it go): the
    pipeline's write and hash stages then waited on every unit compressed, and a pipelined checkpoint
    was barely faster than compressing first and writing after (bench/pipeline.py section 1: 10-21 %,
    34 % with this). Loading the codec turns the release on; what blosc2 reports is its state (no clock).
    In a new process: blosc2's setting is process-wide."""
    probe = (
        "import blosc2; print(blosc2.set_releasegil(False)); "  # (blosc2's own default)
        "from gangd import codecs; codecs.encode('blosc2:lz4:1:bytedelta', bytes(1 << 20), 8); print(blosc2.set_releasegil(True))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stdout


@pytest.mark.parametrize(("library", "spec"), [("blosc2", "blosc2:lz4:1:shuffle"), ("zstandard", "zstd:9"), ("lz4", "lz4")])
def test_a_builtin_whose_library_is_not_installed_names_the_package_to_install(library, spec):
    # sys.modules[name] = None is how Python itself marks a module that cannot be imported.
    probe = f"import sys; sys.modules[{library!r}] = None\nimport gangd.codecs as c\ntry:\n c.for_block('{spec}@1')\nexcept c.CodecMissing as e:\n print(e)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert f"codec '{spec.split(':')[0]}'" in done.stdout and f"pip install {library}" in done.stdout, done.stdout


@pytest.fixture
def fresh_registry():
    registry.forget()
    yield
    registry.forget()




def test_a_plugin_codec_registered_through_an_entry_point_is_found_and_used(tmp_path, monkeypatch, fresh_registry):
    dist(tmp_path, "gangd-zlibtest", "zlibtest = gangd_zlibtest:make\nmislabelled = gangd_zlibtest:wrong_name\nzstd = gangd_zlibtest:make",
          {"gangd_zlibtest": ZLIB_PLUGIN})
    with pytest.raises(CodecMissing):
        codecs.get("zlibtest")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "zlibtest" in codecs.plugins() and "zstd" not in codecs.plugins()  # a plug-in cannot take a built-in's name
    assert str(codecs.identity("zlibtest:9")) == "zlibtest:9@2"
    block = np.arange(20000, dtype="<i4")
    ident, payload = codecs.encode("zlibtest:9", _bytes_of(block), 4)
    assert str(ident) == "zlibtest:9@2" and len(payload) < block.nbytes // 2
    out = np.empty_like(block)
    codecs.decode("zlibtest:9@2", bytes(payload), memoryview(_bytes_of(out)), xxhash.xxh3_128_digest(_bytes_of(block)))
    assert np.array_equal(out, block)
    codecs.decode("zlibtest:9@1", bytes(payload), memoryview(_bytes_of(out)))  # an older version of its format: still read
    with pytest.raises(CodecError, match=r"zlibtest.*ValueError"):  # a plug-in's own error on corrupt data is a CodecError
        codecs.decode(ident, bytes(payload)[:-9], memoryview(_bytes_of(out)))
    with pytest.raises(CodecMissing, match=r"version 3 of its format.*reads up to 2"):
        codecs.for_block("zlibtest:9@3")
    with pytest.raises(CodecError, match=r"zlibtest.*the level is 0\.\.9"):
        codecs.get("zlibtest:12")
    with pytest.raises(CodecError, match=r"mislabelled.*named 'zstd'"):
        codecs.get("mislabelled")


def test_a_codec_no_installed_package_provides_is_named_with_how_to_get_it(fresh_registry):
    with pytest.raises(CodecMissing) as e:
        codecs.for_block("nvcomp:lz4@1")
    assert e.value.codec == "nvcomp" and "pip install" in str(e.value) and "gangd.codecs" in str(e.value)


def test_a_plugin_whose_module_cannot_be_imported_names_its_package(tmp_path, monkeypatch, fresh_registry):
    dist(tmp_path, "gangd-gpucodec", "gpucodec = gangd_gpucodec_missing_module:make\nbroken = gangd_broken:make",
          {"gangd_broken": "raise RuntimeError('no GPU found')\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CodecMissing) as e:
        codecs.decode("gpucodec@1", b"x", memoryview(bytearray(1)))
    assert e.value.codec == "gpucodec" and "pip install --force-reinstall gangd-gpucodec" in str(e.value)
    assert "gangd_gpucodec_missing_module" in str(e.value)
    with pytest.raises(CodecError, match=r"broken.*RuntimeError: no GPU found"):
        codecs.get("broken")


@pytest.mark.parametrize(("text", "canonical"), [
    ("none", "none"), ("lz4", "lz4"), ("zstd", "zstd:3"), ("zstd:9", "zstd:9"), ("zstd:022", "zstd:22"), ("blosc2", "blosc2:zstd:1:shuffle"),
    ("blosc2:zstd:5:shuffle", "blosc2:zstd:5:shuffle"), ("blosc2:lz4:bytedelta", "blosc2:lz4:1:bytedelta"),
    ("blosc2:bitshuffle:9", "blosc2:zstd:9:bitshuffle"), ("auto", "auto"), ("nvcomp:lz4:x.1", "nvcomp:lz4:x.1"),
])
def test_a_spec_is_parsed_into_its_one_canonical_form(text, canonical):
    spec = CodecSpec.parse(text)
    assert str(spec) == canonical and CodecSpec.parse(canonical) == spec
    if not spec.auto:
        assert CodecId.parse(f"{canonical}@7") == CodecId(spec, 7)


@pytest.mark.parametrize(("text", "says"), [
    ("", "accepted: none, lz4"), ("ZSTD", "accepted: none, lz4"), ("zstd:0", "1..22"), ("zstd:23", "1..22"), ("zstd:3:4", "one parameter"),
    ("zstd:", "parameters"), ("zstd:²", "parameters"), ("lz4:9", "no parameters"), ("auto:x", "no parameters"),
    ("blosc2:zstd:lz4", "at most one of each"), ("blosc2:10", "1..9"), ("blosc2:0", "1..9"),
    ("blosc2:delta", "at most one of each"), ("x" * 200, "1..128"), ("nvcomp:a b", "parameters"), ("a:" + ":".join("p" * 9), "8 or fewer"),
    (3, "a string"), (None, "a string"),
])
def test_a_spec_outside_the_grammar_is_refused_saying_what_is_accepted(text, says):
    with pytest.raises(CodecError, match=says.replace(".", r"\.")):
        CodecSpec.parse(text)


@pytest.mark.parametrize("text", ["auto@1", "zstd@1", "zstd:3@0", "zstd:3@x", "zstd:3@1@2", "zstd:3@01", "blosc2:lz4@1", "none@99999999", 5])
def test_a_block_identity_that_is_not_canonical_is_refused(text):
    with pytest.raises(CodecError):
        CodecId.parse(text)


@pytest.mark.parametrize("value", [b"x" * (8 << 20), list(range(1 << 20)), {i: i for i in range(1 << 18)}])
def test_a_hostile_identity_of_another_type_is_refused_without_being_turned_into_text(value):
    """A block's identity comes from an index a user can write (msgpack: bytes, lists, maps of any
    size); the refusal names its type, it does not build str() of the whole value to cut 40 characters."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="identity is a short string"):
            CodecId.parse(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak


def test_codecs_are_shared_by_threads_compressing_and_decompressing_at_once():
    # The pipeline runs its stages on threads over one codec object per spec (zstd keeps a compressor per thread).
    values = [np.sin(np.linspace(0, k, 1 << 13)) * 10**k for k in range(1, 9)]
    failures: list[str] = []

    def work(spec: str, value: np.ndarray) -> None:
        for _ in range(5):
            ident, payload = codecs.encode(spec, _bytes_of(value), 8)
            out = np.empty_like(value)
            codecs.decode(ident, bytes(payload), memoryview(_bytes_of(out)))
            if out.tobytes() != value.tobytes():
                failures.append(spec)

    for spec in CODECS:
        threads = [threading.Thread(target=work, args=(spec, v)) for v in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures


def test_a_bare_spec_is_version_one_so_blocks_written_before_codecs_read_as_raw():
    assert CodecId.parse("none") == CodecId(CodecSpec("none"), 1)
    assert codecs.for_block("none").name == "none"


def test_auto_compresses_nothing_itself_and_oversized_calls_are_refused():
    with pytest.raises(CodecError, match="auto"):
        codecs.get("auto")
    with pytest.raises(CodecError, match=r"1\.\.22"):  # a spec built by hand is checked as if parsed
        codecs.get(CodecSpec("zstd", ("99",)))
    with pytest.raises(CodecError, match="not canonical"):
        codecs.get(CodecSpec("zstd"))
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(codecs.MAX_BUFFER + 1,), strides=(0,))
    with pytest.raises(CodecError, match="cut the value into blocks"):
        codecs.get("lz4").compress(memoryview(huge), 1)
    with pytest.raises(CodecError, match="not a writable"):
        codecs.decode("none@1", b"ab", memoryview(b"xy"))
