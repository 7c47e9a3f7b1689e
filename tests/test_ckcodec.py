"""Compressed checkpoints (issue 18): what a user relies on when a job runs with ``--ckpt-codec``.

* every dtype and shape comes back bit-identical under every codec, in full
  files and in incremental, differential and adaptive chains over several
  generations (also chains whose generations were written with different codecs);
* a compressed generation is written through the pipeline and records, per
  unit, the codec it used; incompressible data is stored raw;
* a corrupted or truncated compressed unit is caught (by the signature over
  the raw blocks when the codec decodes garbage silently) and named by path;
* a generation written with a codec this machine lacks fails saying which
  codec and how to install it, and is not marked damaged;
* a disk that fills up mid-write (a real tmpfs) aborts the generation and
  leaves nothing behind;
* real standalone programs (background and inline) killed and restarted
  with ``GANGD_CKPT_CODEC`` end bit-identical to an uninterrupted run, and
  fall back to an older generation when the newest is damaged.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from codechelpers import ZLIB_PLUGIN, dist
from conftest import tmpfs

from gangd import ckptstore
from gangd.checkpoint import delta
from gangd.ckptlib import blocks, units
from gangd.ckptlib.core import CheckpointError, DeltaSettings, checked_codec
from gangd.ckptstore import StoreError
from gangd.codecs import CodecMissing, CodecSpec, registry

CODECS = ["none", "lz4", "zstd:3", "blosc2:zstd:1:shuffle", "blosc2:lz4:1:bytedelta", "auto"]
DTYPES = [np.dtype(t) for t in ("bool", "u1", "i2", "<i4", ">i8", "f2", "<f4", ">f8", "c8", "c16", "M8[ns]", "m8[s]", "U3", "S5")] + [
    np.dtype([("a", "<i4"), ("b", ">f8", (2,))]),
    np.dtype([("big", "V300")]),  # wider than blosc2's 255-byte item limit: compressed as bytes
]
SHAPES = [(), (0,), (0, 3), (1,), (777,), (37, 11), (4, 5, 6)]


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    """Units of 8 KiB (8 blocks of 1 KiB in most tests): many units, and units a newer delta covers only in part;
    a restore reads more than 16 KiB of units through its read/decompress pipeline (else in the caller's thread)."""
    monkeypatch.setattr(units, "UNIT", 8192)
    monkeypatch.setattr(units, "PIPELINED", 16384)


def _array(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Bytes partly random, partly zero, partly a ramp: codecs both compress and copy."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    rng = np.random.default_rng(seed)
    third = n // 3
    raw = np.concatenate([np.frombuffer(rng.bytes(third), np.uint8), np.zeros(third, np.uint8),
                          (np.arange(n - 2 * third) % 251).astype(np.uint8)])
    return raw.view(dtype).reshape(shape)


def _smooth(n: int, seed: int = 0) -> np.ndarray:
    """Like the peers' ring job's state: a sine plus 1 % noise (blosc2's filters shrink it)."""
    x = np.linspace(0, 40 * np.pi, n)
    return np.sin(x) + 0.01 * np.random.default_rng(seed).standard_normal(n)


def _same(restored: dict, original: dict) -> None:
    assert set(restored) == set(original)
    for name, value in original.items():
        got = restored[name]
        if isinstance(value, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == value.dtype and got.shape == value.shape, name
            assert got.tobytes() == value.tobytes(), name  # bit-identical (NaNs, -0.0 and padding included)
        else:
            assert got == value, name


def _save(path: Path, values: dict, codec: str, **kw) -> dict:
    return blocks.save_generation(path, values, codec=CodecSpec.parse(codec), **kw)


def _load(path: Path, result: dict | None = None, chain=()) -> dict:
    expect = None if result is None else (result["size"], result["digest"])
    return blocks.read_chain(path, chain, expect)[0]


# ====================================================================== settings


def test_the_codec_is_none_unless_asked_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("GANGD_CKPT_CODEC", raising=False)
    assert DeltaSettings.from_options().codec == "none"
    assert DeltaSettings.from_options(codec="zstd").codec == "zstd:3"  # canonical: what the writer gets
    monkeypatch.setenv("GANGD_CKPT_CODEC", "blosc2:lz4:bytedelta")
    assert DeltaSettings.from_options().codec == "blosc2:lz4:1:bytedelta"
    assert DeltaSettings.from_options(codec="lz4").codec == "lz4"  # init's argument wins over the environment
    assert DeltaSettings.from_options().plan(1, [])["codec"] == "blosc2:lz4:1:bytedelta"
    with pytest.raises(CheckpointError, match=r"init\(codec=\.\.\.\).*'zstd:99'.*level"):
        checked_codec("zstd:99")
    monkeypatch.setenv("GANGD_CKPT_CODEC", "gzip -1")
    with pytest.raises(CheckpointError, match=r"GANGD_CKPT_CODEC.*'gzip -1'.*accepted"):
        DeltaSettings.from_options()


def test_with_codec_none_the_file_is_the_uncompressed_format_byte_for_byte(tmp_path):
    values = {"u": _smooth(50_000), "meta": {"step": 3}}
    plain = blocks.save_generation(tmp_path / "plain", values, gen=1)
    none = _save(tmp_path / "none", values, "none", gen=1)
    assert (tmp_path / "plain").read_bytes() == (tmp_path / "none").read_bytes()
    assert (plain["size"], plain["digest"]) == (none["size"], none["digest"])
    assert (tmp_path / "none").read_bytes()[:8] == blocks.MAGIC


# ====================================================================== round trips


@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_and_shape_round_trips_bit_identical(tmp_path, codec):
    values: dict = {f"{dt.str}{shape}": _array(dt, shape, seed=i) for i, (dt, shape) in
                    enumerate((dt, shape) for dt in DTYPES for shape in SHAPES)}
    values["non-contiguous"] = _smooth(40_000)[::3]
    values["fortran"] = np.asfortranarray(_array(np.dtype("<f8"), (60, 70)))
    values["a pickle"] = {"list": list(range(1000)), "text": "x" * 5000}
    path = tmp_path / "gen"
    result = _save(path, values, codec, gen=1, block=1024)
    _same(_load(path, result), values)
    _same(_load(path), values)  # (without the manifest's checksum: each unit checked against the signature alone)
    index = blocks.read_index(path)
    assert index.version == (2 if codec == "none" else 3)
    if codec != "none":
        assert index.signed and result["pipeline"]["in"] == index.state and result["stored"] < index.state


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_the_writer_compresses_inline_and_in_the_forked_snapshot(tmp_path, background):
    from gangd.ckptlib import writer

    values = {"u": _smooth(300_000), "n": np.arange(100_000, dtype=np.int64)}
    plan = DeltaSettings.from_options(codec="auto", block_kib=4).plan(1, [])
    written = writer.write(tmp_path / "gen", values, 5, background=background, delta=plan)
    result = written.wait()
    assert "error" not in result, result
    assert result["stored"] < 0.9 * result["state"]
    restored, iteration, _ = blocks.read_chain(tmp_path / "gen", (), (result["size"], result["digest"]))
    _same(restored, values)
    assert iteration == 5


def _chain_of(results: dict[int, dict], paths: dict[int, Path], gen: int) -> list:
    return [(g, paths[g], (results[g]["size"], results[g]["digest"])) for g in results[gen]["links"]]


@pytest.mark.parametrize("mode", list(delta.MODES))
@pytest.mark.parametrize("codec", ["lz4", "zstd:1", "blosc2:zstd:1:bytedelta", "auto", "mixed"])
def test_chains_over_several_generations_restore_bit_identical(tmp_path, mode, codec):
    """Generations 1..6 of a state that changes a little each time (and once a lot), each restored from its chain."""
    order = ["none", "zstd:1", "blosc2:zstd:1:shuffle", "lz4", "auto", "none"]  # "mixed": every generation another codec
    rng = np.random.default_rng(1)
    u, n = _smooth(100_000), np.arange(30_000, dtype=np.int32)
    results: dict[int, dict] = {}
    paths: dict[int, Path] = {}
    states: dict[int, dict] = {}
    for gen in range(1, 7):
        if gen > 1:
            u[rng.integers(0, len(u), 20)] += 1.0  # a few blocks change (inside units: partly covered units)
            n[:: 997 * gen] += 1
        if gen == 4:
            u[:] = _smooth(len(u), seed=gen)  # nearly everything changes
        states[gen] = {"u": u.copy(), "n": n.copy(), "step": {"gen": gen}}
        paths[gen] = tmp_path / f"gen-{gen}"
        offered = [] if gen == 1 else [(gen - 1, paths[gen - 1], (results[gen - 1]["size"], results[gen - 1]["digest"])),
                                       *_chain_of(results, paths, gen - 1)]
        results[gen] = _save(paths[gen], states[gen], order[gen - 1] if codec == "mixed" else codec, gen=gen, mode=mode,
                             offered=offered, block=1024, chain_max=4)
    roles = {results[g]["role"] for g in results}
    if mode != "full":
        assert roles - {"full"}, roles  # (the chains were deltas, not only fulls)
    for gen in results:
        _same(_load(paths[gen], results[gen], _chain_of(results, paths, gen)), states[gen])


@pytest.mark.parametrize("mode", ["incremental", "differential", "adaptive"])
def test_a_delta_in_which_nothing_changed_writes_no_unit_and_restores(tmp_path, mode):
    values = {"u": _smooth(20_000), "empty": np.zeros(0)}
    first = _save(tmp_path / "1", values, "auto", gen=1, mode=mode, block=1024)
    offered = [(1, tmp_path / "1", (first["size"], first["digest"]))]
    second = _save(tmp_path / "2", values, "auto", gen=2, mode=mode, offered=offered, block=1024)
    assert second["role"] != "full" and second["stored"] == 0 and blocks.read_index(tmp_path / "2").codecs == ()
    _same(_load(tmp_path / "2", second, offered), values)


def test_incompressible_data_is_stored_raw_and_compressible_data_shrinks(tmp_path):
    noise = np.frombuffer(np.random.default_rng(3).bytes(1 << 20), dtype=np.uint8)
    for codec in ("zstd:3", "blosc2:zstd:1:shuffle", "auto"):
        path = tmp_path / codec
        result = _save(path, {"noise": noise}, codec, gen=1, block=4096)
        index = blocks.read_index(path)
        if codec == "auto":  # auto stores nothing compressed: the raw format (2), written as without a codec
            assert index.codecs == () and "stored" not in result and "codecs" not in result
        else:
            assert index.codecs == ("none@1",), codec  # every unit stored raw
            assert result["stored"] == noise.nbytes
        _same(_load(path, result), {"noise": noise})
    smooth = {"u": _smooth(1 << 17)}
    result = _save(tmp_path / "smooth", smooth, "auto", gen=1, block=4096)
    index = blocks.read_index(tmp_path / "smooth")
    assert index.entries[0].codec == "blosc2:zstd:1:bytedelta" and "blosc2:zstd:1:bytedelta@1" in index.codecs
    assert result["stored"] < 0.9 * smooth["u"].nbytes


@pytest.mark.parametrize("codec", ["blosc2:lz4:1:bytedelta", "zstd:1", "auto"])
def test_any_number_of_compress_workers_writes_the_same_file_and_restores_it_bit_identical(tmp_path, codec):
    """Issue 18: the compress stage runs in Settings.workers threads; the units still reach the file in order,
    each with its codec, so 1 and 4 workers write byte for byte the same generation (the same checksum the
    manifest records), and a restore (its decompress stage parallel too) gives back every value bit-identical."""
    from gangd.pipeline import Settings

    values = {"u": _smooth(1_500_000), "k": np.arange(700_000, dtype=np.int64) // 3, "noise": np.frombuffer(
        np.random.default_rng(5).bytes(3 << 20), dtype=np.uint8), "small": {"step": 7}}
    results = {}
    for workers in (1, 4):
        path = tmp_path / f"w{workers}"
        results[workers] = _save(path, values, codec, gen=1, pipeline=Settings(workers=workers, buffer_count=2))
        assert results[workers]["pipeline"]["stages"]["compress"]["workers"] == workers
    assert (tmp_path / "w1").read_bytes() == (tmp_path / "w4").read_bytes()
    assert results[1]["digest"] == results[4]["digest"] and results[1]["codecs"] == results[4]["codecs"]
    restored, *_ = blocks.read_chain(tmp_path / "w4", (), (results[4]["size"], results[4]["digest"]))  # (default workers)
    _same(restored, values)


# ====================================================================== damage


def _unit_offsets(path: Path) -> list[tuple[int, int, str]]:
    """(offset, stored length, codec identity) of each unit of the file's first value."""
    index = blocks.read_index(path)
    entry = index.entries[0]
    assert entry.unit_len is not None and entry.unit_codec is not None
    at, out = entry.offset, []
    for length, number in zip(entry.unit_len.tolist(), entry.unit_codec.tolist(), strict=True):
        out.append((at, length, index.codecs[number]))
        at += length
    return out


@pytest.mark.parametrize("codec", ["lz4", "zstd:3", "blosc2:zstd:1:shuffle", "blosc2:lz4:1:bytedelta"])
def test_a_corrupted_compressed_unit_is_caught_and_named_by_path(tmp_path, codec):
    values = {"u": np.repeat(_smooth(12_500), 4)}  # (runs of equal values: lz4 shrinks them too)
    path = tmp_path / "gen"
    result = _save(path, values, codec, gen=1, block=1024)
    compressed = [(at, n) for at, n, ident in _unit_offsets(path) if not ident.startswith("none")]
    assert compressed
    data = bytearray(path.read_bytes())
    for at, n in compressed[len(compressed) // 2 : len(compressed) // 2 + 1]:
        for k in range(at + 40, at + n, max(1, n // 5)):  # a few bytes inside one unit, past its header
            data[k] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"{path}.*corrupted"):
        _load(path)  # decoded garbage (blosc2, silently) fails the signature; lz4/zstd fail to decode
    with pytest.raises(StoreError, match=rf"{path}.*corrupted"):
        _load(path, result)


def test_a_truncated_or_lying_compressed_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "gen"
    _save(path, {"u": _smooth(50_000)}, "zstd:3", gen=1, block=1024)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(StoreError, match=rf"{path}"):
        _load(path)
    # a unit whose recorded length is longer than its raw bytes, in an index whose checksum was made to match
    path.write_bytes(whole)
    assert _unit_offsets(path)
    index = blocks.read_index(path)
    entry = index.entries[0]
    tail = bytearray(index.tail)
    lengths_at = tail.find(entry.unit_len.tobytes())
    assert lengths_at > 0
    tail[lengths_at : lengths_at + 8] = (10 << 20).to_bytes(8, "little")
    body = bytes(tail[: len(tail) - blocks.FOOTER.size])
    footer = blocks.FOOTER.pack(index.index_offset, len(body), blocks._hash(body), blocks.END)
    path.write_bytes(whole[: index.index_offset] + body + footer)
    with pytest.raises(StoreError, match=rf"{path} is corrupted.*stored length"):
        _load(path)


def _plugin(directory: Path) -> Path:
    """A real installed distribution providing the codec ``zlibtest`` (format version 2) through an entry point."""
    directory.mkdir()
    dist(directory, "gangd-zlibtest", "zlibtest = gangd_zlibtest:make", {"gangd_zlibtest": ZLIB_PLUGIN})
    return directory


@pytest.fixture
def fresh_registry():
    registry.forget()
    yield
    registry.forget()


def test_a_generation_written_with_a_codec_this_machine_lacks_says_which_and_how_to_install(tmp_path, monkeypatch, fresh_registry):
    plugin = _plugin(tmp_path / "plugin")
    values = {"u": _smooth(30_000)}
    with monkeypatch.context() as m:
        m.syspath_prepend(str(plugin))
        path = tmp_path / "gen"
        result = _save(path, values, "zlibtest:6", gen=1, block=1024)
        assert "zlibtest:6@2" in blocks.read_index(path).codecs
        _same(_load(path, result), values)
    registry.forget()
    sys.modules.pop("gangd_zlibtest", None)
    with pytest.raises(CodecMissing) as info:
        _load(path, result)
    assert info.value.codec == "zlibtest" and "pip install" in str(info.value)


# ====================================================================== a full disk


@pytest.mark.root
@pytest.mark.parametrize("codec", ["lz4", "auto"])
def test_a_disk_filling_up_mid_write_aborts_the_generation_cleanly(tmp_path, codec):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    with tmpfs(mnt, "1m"):
        path = mnt / "rank-0.state"
        noise = {"noise": np.frombuffer(np.random.default_rng(0).bytes(3 << 20), dtype=np.uint8)}  # stored raw: 3 MiB
        with pytest.raises(StoreError) as info:
            _save(path, noise, codec, gen=1, block=4096)
        assert "no space left on device" in str(info.value) and str(path) in str(info.value)
        assert os.listdir(mnt) == []  # neither the file nor its temporary
        small = {"u": _smooth(20_000)}
        result = _save(path, small, codec, gen=1, block=4096)  # the pipeline left nothing behind: a small one fits
        _same(_load(path, result), small)


# ====================================================================== standalone programs

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, signal
    import numpy as np
    from gangd import ckptlib as ckpt

    def ints(name):
        return {int(x) for x in os.environ.get(name, "").split(",") if x}

    REQUEST_AT, KILL_AT = ints("T_REQUEST"), ints("T_KILL")
    ckpt.init()
    n = 200_000
    u = ckpt.protect("u", lambda: np.sin(np.linspace(0, 40 * np.pi, n)))
    k = ckpt.protect("k", lambda: np.arange(n // 4, dtype=np.int64))
    state = ckpt.protect("state", {"total": 0, "rng": np.random.default_rng(7)})
    print("restarted", ckpt.restarted(), ckpt.generation(), flush=True)
    for it in ckpt.loop(range(30)):
        idx = state["rng"].integers(0, n, 50)
        u[idx] += 0.01 * state["rng"].standard_normal(50)
        k[it * 97 % len(k)] += it
        state["total"] += it * it
        if it in REQUEST_AT:
            ckpt.request()
        if it in KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.fini()
    h = hashlib.sha256(u.tobytes() + k.tobytes() + repr(state["total"]).encode() + state["rng"].random(4).tobytes())
    print("digest", h.hexdigest(), flush=True)
    """
)


def _run(directory: Path, **env) -> subprocess.CompletedProcess:
    script = directory / "prog.py"
    if not script.exists():
        script.write_text(PROGRAM)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    clean.update({k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, str(script)], cwd=directory, env=clean, check=False, capture_output=True, text=True,
                          timeout=120)


def _field(result: subprocess.CompletedProcess, key: str) -> list[str]:
    for line in result.stdout.splitlines():
        if line.split()[:1] == [key]:
            return line.split()[1:]
    raise AssertionError(f"no {key!r} line:\n{result.stdout}\n--- stderr:\n{result.stderr}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    done = _run(tmp_path_factory.mktemp("reference"))
    assert done.returncode == 0, done.stderr
    return _field(done, "digest")[0]


def _gen_file(directory: Path, gen: int) -> Path:
    return ckptstore.gen_dir(directory / "prog.ckpt", 0, gen) / ckptstore.rank_file(0)


@pytest.mark.parametrize("background", ["1", "0"], ids=["background", "inline"])
@pytest.mark.parametrize(("codec", "mode"), [("auto", "adaptive"), ("blosc2:zstd:1:bytedelta", "incremental"),
                                             ("zstd:1", "differential"), ("lz4", "full")])
def test_a_program_killed_and_restarted_ends_bit_identical(tmp_path, reference, background, codec, mode):
    env = {"GANGD_CKPT_CODEC": codec, "GANGD_CKPT_MODE": mode, "GANGD_CKPT_BACKGROUND": background, "GANGD_CKPT_BLOCK_KIB": 4}
    killed = _run(tmp_path, T_REQUEST="5,10,15", T_KILL=20, **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    newest = max(ckptstore.generations(tmp_path / "prog.ckpt", 0))
    assert _gen_file(tmp_path, newest).read_bytes()[:8] == blocks.MAGIC3
    restarted = _run(tmp_path, GANGD_RESTART="latest", **env)
    assert restarted.returncode == 0, restarted.stderr
    assert _field(restarted, "restarted") == ["True", str(newest)]
    assert _field(restarted, "digest") == [reference]


def test_a_damaged_compressed_generation_falls_back_to_an_older_one(tmp_path, reference):
    env = {"GANGD_CKPT_CODEC": "blosc2:zstd:1:shuffle", "GANGD_CKPT_MODE": "full", "GANGD_CKPT_BLOCK_KIB": 4}
    killed = _run(tmp_path, T_REQUEST="5,10", T_KILL=20, **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    gens = sorted(ckptstore.generations(tmp_path / "prog.ckpt", 0))
    newest = _gen_file(tmp_path, gens[-1])
    data = bytearray(newest.read_bytes())
    data[len(data) // 3] ^= 0xFF
    newest.write_bytes(bytes(data))
    restarted = _run(tmp_path, GANGD_RESTART="latest", **env)
    assert restarted.returncode == 0, restarted.stderr
    assert f"generation {gens[-1]} is unusable" in restarted.stderr
    assert f"{newest.relative_to(tmp_path)} is corrupted" in restarted.stderr
    assert _field(restarted, "restarted") == ["True", str(gens[-2])]
    assert _field(restarted, "digest") == [reference]


def test_a_program_restarted_where_its_codec_is_missing_says_which_and_how_to_install(tmp_path, reference):
    plugin = _plugin(tmp_path / "plugin")
    work = tmp_path / "work"
    work.mkdir()
    env = {"GANGD_CKPT_CODEC": "zlibtest:3", "GANGD_CKPT_MODE": "full"}
    killed = _run(work, T_REQUEST="5", T_KILL=20, PYTHONPATH=plugin, **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    gens = ckptstore.generations(work / "prog.ckpt", 0)
    assert gens == [1] and "zlibtest:3@2" in blocks.read_index(_gen_file(work, 1)).codecs
    # Asked to write with it where it is not installed (no PYTHONPATH): refused at init, before anything runs.
    refused = _run(work, GANGD_RESTART="latest", **env)
    assert refused.returncode != 0
    assert "GANGD_CKPT_CODEC: checkpoint codec 'zlibtest:3' is refused" in refused.stderr and "pip install" in refused.stderr
    # Writing without it, but restarting from a generation that used it: the restore says which codec and how to install it.
    lacking = _run(work, GANGD_RESTART="latest", **{**env, "GANGD_CKPT_CODEC": "none"})
    assert lacking.returncode != 0
    assert "cannot restart from generation 1" in lacking.stderr and "codec 'zlibtest'" in lacking.stderr
    assert "pip install" in lacking.stderr
    assert not (ckptstore.gen_dir(work / "prog.ckpt", 0, 1) / "DAMAGED").exists()  # not damaged: installing the codec restores it
    again = _run(work, GANGD_RESTART="latest", PYTHONPATH=plugin, **env)
    assert again.returncode == 0, again.stderr
    assert _field(again, "digest") == [reference]


# ====================================================================== under the daemons


@pytest.mark.parametrize(("codec", "mode", "inline"), [("auto", "incremental", False), ("blosc2:lz4:1:bytedelta", "adaptive", True)])
def test_a_job_run_with_a_codec_is_checkpointed_compressed_and_restarted_bit_identical(make_cluster, tmp_path, codec, mode, inline):
    """``gang submit --ckpt-codec``: every rank writes compressed generations (format 3, smaller than
    its state), a delta chain among them; killed and restarted from the newest, twice, the job ends
    as an uninterrupted raw run did."""
    from ckpthelpers import generations, kill_and_restart, kill_what_is_left, result_of
    from test_delta_cluster import Steered, rank_file, reference_of, take

    gc = make_cluster(2)
    try:
        options = ("--inline",) if inline else ()
        expected = reference_of(gc, tmp_path / "ref", options)
        job = Steered(gc, tmp_path / "run", *options)
        current = first = job.submit("--ckpt-mode", mode, "--ckpt-codec", codec, "--ckpt-redundancy", "local")
        step = 0
        for n in range(1, 7):
            step += 2
            job.go(step)
            taken = take(gc, current)
            assert taken["state"] == "complete", taken
            if n in (3, 5):
                current = kill_and_restart(gc, current)
        entries = {e["gen"]: e for e in generations(gc, current)}
        newest = max(g for g, e in entries.items() if e["state"] in ("complete", "protected"))
        record = gc.job(current)
        for rank in (0, 1):
            path = rank_file(gc, record, first, newest, rank)
            index = blocks.read_index(path)
            assert path.read_bytes()[:8] == blocks.MAGIC3 and index.version == 3
            assert path.stat().st_size < 0.9 * index.state, (rank, path.stat().st_size, index.state)
        assert any(entries[g].get("needs") for g in entries), entries  # (the chain had deltas)
        job.go(Steered.STEPS)
        assert result_of(gc, current, timeout=120) == expected
    finally:
        kill_what_is_left(gc)
