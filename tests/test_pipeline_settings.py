"""A job's pipeline settings (issue 18: "per-job pipeline settings"), and a codec checked where the
ranks start rather than at their first checkpoint.

The settings are text from a user -- ``gang run --ckpt-pipeline``, ``[checkpoint] pipeline``,
``GANGD_CKPT_PIPELINE``, ``ckptlib.init(pipeline=...)`` -- that ends up sizing the buffers and
threads a rank allocates. Each edge checks it against the same bounds and keeps one spelling;
the writer and the restore then use what the job asked for. The cluster end of it (each rank
sees its job's settings, the compress stage runs with the job's workers, a restart keeps them)
is test_codecflag's cluster test; ``[checkpoint] pipeline`` in the config is tested there too, beside
``[checkpoint] codec``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gangd import jobs
from gangd.ckptlib import blocks, writer
from gangd.ckptlib.core import CheckpointError, DeltaSettings, checked_codec, checked_pipeline
from gangd.codecs import CodecMissing, registry
from gangd.pipeline import settings as ps

SPEC = {"argv": ["x"], "nranks": 1}
KNOWN = ("buffer_count", "buffer_size", "aggregate_bytes", "workers")


# ------------------------------------------------------------------ the text

_valid = st.fixed_dictionaries({}, optional={
    "buffer_count": st.integers(ps.MIN_BUFFERS, 16),
    "buffer_size": st.integers(ps.MIN_SIZE, 8 * ps.MIB),
    "aggregate_bytes": st.integers(ps.MIN_SIZE, 8 * ps.MIB),
    "workers": st.integers(ps.MIN_WORKERS, 8),
})


@given(_valid)
def test_any_valid_settings_survive_their_canonical_spelling_and_only_those_named_travel(values):
    text = ps.canonical(values)
    assert ps.parse(text) == values
    assert ps.canonical(ps.parse(text)) == text  # (one spelling: a record compares equal to a re-check of it)
    assert set(text.replace("=", ",").split(",")[::2]) <= set(KNOWN) | {""}
    settings = ps.from_text(text)
    for key in KNOWN:
        assert getattr(settings, key) == values.get(key, getattr(ps.Settings(), key))


@pytest.mark.parametrize(("given_", "kept"), [
    ("buffer_size=256KiB,workers=2", "buffer_size=256KiB,workers=2"),
    (" workers = 2 , buffer_size = 262144 ", "buffer_size=256KiB,workers=2"),  # (spaces, bytes, any order)
    ("aggregate_bytes=4m,buffer_count=8", "buffer_count=8,aggregate_bytes=4MiB"),
    ("buffer_size=1536k", "buffer_size=1536KiB"), ("buffer_size=5000", "buffer_size=5000"), ("", ""), (",", ""),
])
def test_settings_text_is_kept_in_one_spelling(given_, kept):
    assert ps.canonical(ps.parse(given_)) == kept


@pytest.mark.parametrize(("hostile", "said"), [
    ("workers=0", "outside 1..64"), ("workers=65", "outside 1..64"), ("buffer_size=1", "outside 4096.."),
    ("buffer_size=1GiB", "outside"), ("buffer_count=1", "outside 2..256"), ("buffer_count=100000", "outside"),
    ("buffer_count=256,buffer_size=256MiB", "exceed"),  # (the pool allocated up front: 64 GiB)
    ("workers=2k", "not a number (a whole number)"), ("buffer_size=4TiB", "not a number (a size"),
    ("buffer_size=-4096", "not a number"), ("buffer_size=1e6", "not a number"), ("workers=\uff11", "not a number"),
    ("threads=2", "key=value with a key of: buffer_count, buffer_size, aggregate_bytes, workers"),
    ("workers", "key=value"), ("workers=1,workers=2", "given twice"), ("x" * 201, "longer than 200"),
    ("workers=" + "9" * 40, "not a number"), (7, "not int"), (None, "not NoneType"), (["workers=1"], "not list"),
])
def test_hostile_settings_are_refused_saying_what_is_wrong(hostile, said):
    with pytest.raises(ps.SettingsError, match=None) as caught:
        ps.parse(hostile)
    assert said in str(caught.value) and len(str(caught.value)) < 300


def test_settings_accepted_at_submit_are_accepted_on_a_node_of_any_size():
    """workers left out is each node's cores (at most 4): a job submitted from a
    1-core node must not be refused at a rank's init on a 4-core one."""
    with pytest.raises(ps.SettingsError) as caught:
        ps.parse("buffer_size=256MiB")  # (4 buffers of 256 MiB, but 6 in front of 4 workers)
    assert "exceed" in str(caught.value)
    assert ps.parse("buffer_size=256MiB,workers=2") == {"buffer_size": 256 << 20, "workers": 2}
    for cores in range(1, ps.DEFAULT_WORKERS_MAX + 1):
        accepted = ps.parse("buffer_size=128MiB")
        ps.Settings.from_mapping({"workers": cores, **accepted})  # (as a rank on a node of that many cores builds them)


# ------------------------------------------------------------------ the edges: job spec, config, command line


def test_a_jobs_settings_are_checked_at_submit_and_kept_canonical():
    checked = jobs.JobSpec.from_wire({**SPEC, "ckpt_pipeline": "workers=1,buffer_size=262144"}, ["n1"])
    assert checked.ckpt_pipeline == "buffer_size=256KiB,workers=1" == checked.as_spec()["ckpt_pipeline"]
    record = jobs.new_record(job_id=1, spec=checked.as_spec(), owner_uid=0, owner_name="root", owner_gid=0)
    assert record["ckpt_pipeline"] == "buffer_size=256KiB,workers=1"
    assert jobs.JobSpec.from_wire(SPEC, ["n1"]).ckpt_pipeline is None  # (the cluster's)
    assert jobs.JobSpec.from_wire({**SPEC, "ckpt_pipeline": ""}, ["n1"]).ckpt_pipeline is None
    for hostile in ("workers=0", "\x1b]0;x\x07", "z" * (1 << 20), 12, {"workers": 1}):
        with pytest.raises(jobs.BadSpec) as caught:
            jobs.JobSpec.from_wire({**SPEC, "ckpt_pipeline": hostile}, ["n1"])
        assert caught.value.code == "bad_request" and caught.value.message.startswith("--ckpt-pipeline: ")
        assert "\x1b" not in caught.value.message and len(caught.value.message) < 400


def test_gang_run_and_submit_teach_ckpt_pipeline_and_refuse_a_bad_one_before_sending_it(tmp_path):
    from click.testing import CliRunner

    from gangd.client.cli import main

    for command in ("run", "submit"):
        shown = " ".join(CliRunner().invoke(main, [command, "--help"]).stdout.split())
        assert "--ckpt-pipeline KEY=VALUE,..." in shown and "--ckpt-pipeline buffer_size=256KiB,workers=1" in shown
        assert "GANGD_CKPT_PIPELINE" in shown and "Default: the cluster's [checkpoint] pipeline" in shown
    # (--cluster names a directory with no cluster: a spec that went through would fail to connect, not as a usage error)
    refused = CliRunner().invoke(main, ["--cluster", str(tmp_path), "submit", "-n", "1", "--ckpt-pipeline", "workers=99", "--", "true"])
    assert refused.exit_code == 2 and "--ckpt-pipeline" in refused.stderr and "workers=99 is outside 1..64" in refused.stderr


# ------------------------------------------------------------------ the rank: ckptlib


def test_init_takes_the_settings_from_its_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv("GANGD_CKPT_PIPELINE", raising=False)
    assert DeltaSettings.from_options().pipeline == "" and DeltaSettings.from_options().pipeline_settings() is None
    monkeypatch.setenv("GANGD_CKPT_PIPELINE", "workers=3")
    assert DeltaSettings.from_options().pipeline == "workers=3"
    assert DeltaSettings.from_options(pipeline={"workers": 1, "buffer_size": "64KiB"}).pipeline == "buffer_size=64KiB,workers=1"
    assert DeltaSettings.from_options(pipeline="workers=2").plan(1, [])["pipeline"] == "workers=2"
    assert DeltaSettings.from_options().pipeline_settings().workers == 3
    with pytest.raises(CheckpointError, match=r"^init\(pipeline=\.\.\.\): pipeline setting workers=0 is outside"):
        checked_pipeline("workers=0")
    monkeypatch.setenv("GANGD_CKPT_PIPELINE", "buffer_size=big")
    with pytest.raises(CheckpointError, match=r"^GANGD_CKPT_PIPELINE: pipeline setting buffer_size='big' is not a number"):
        DeltaSettings.from_options()


def _smooth(n: int) -> np.ndarray:
    x = np.linspace(0, 40 * np.pi, n)
    return np.sin(x) + 0.01 * np.random.default_rng(1).standard_normal(n)


@pytest.mark.parametrize("asked", ["workers=1", "workers=3,buffer_size=4KiB,aggregate_bytes=4KiB,buffer_count=2", ""])
def test_a_compressed_generation_is_written_with_the_jobs_settings_and_read_back_with_them(tmp_path, asked, monkeypatch):
    from gangd.ckptlib import units

    monkeypatch.setattr(units, "PIPELINED", 16384)  # (a restore of more than 16 KiB goes through its read/decompress pipeline)
    values = {"u": _smooth(400_000), "n": np.arange(200_000, dtype=np.int64), "meta": {"step": 3}}
    settings = DeltaSettings.from_options(codec="zstd:1", block_kib=4, pipeline=asked)
    result = writer.write(tmp_path / "gen", values, 5, background=False, delta=settings.plan(1, [])).wait()
    assert "error" not in result, result
    workers = ps.from_text(asked).workers
    assert result["pipeline"]["stages"]["compress"]["workers"] == workers  # (the default: this machine's cores, at most 4)
    restored, iteration, _ = blocks.read_chain(tmp_path / "gen", (), (result["size"], result["digest"]), pipeline=settings.pipeline_settings())
    assert iteration == 5 and restored["meta"] == values["meta"]
    for name in ("u", "n"):
        assert restored[name].tobytes() == values[name].tobytes()


# ------------------------------------------------------------------ a codec missing where the ranks run


@pytest.fixture
def fresh_registry():
    registry.forget()
    yield
    registry.forget()


def test_a_codec_whose_package_is_missing_is_refused_at_init_naming_the_node_and_how_to_install(monkeypatch, fresh_registry):
    monkeypatch.setenv("GANGD_NODE", "n7")
    monkeypatch.setitem(sys.modules, "blosc2", None)  # (as if blosc2 were not installed: find_spec finds nothing)
    for asked in ("blosc2:lz4", "auto"):  # (auto may pick blosc2 for a numeric array)
        with pytest.raises(CheckpointError) as caught:
            checked_codec(asked)
        said = str(caught.value)
        assert f"init(codec=...): checkpoint codec {asked!r} is refused on node n7" in said and "pip install blosc2" in said
    assert checked_codec("zstd") == "zstd:3" and checked_codec("lz4") == "lz4"  # (installed: taken)
    assert registry.get("zstd:3") is registry.get("zstd:3")  # (and loaded: the first checkpoint does not import it)
    with pytest.raises(CodecMissing, match="cannot be imported here"):
        registry.load("blosc2")
    with pytest.raises(CodecMissing, match="install the package that provides the 'nvcomp' codec"):
        registry.load("nvcomp:lz4")


def test_the_default_workers_leave_one_of_the_processs_cores_to_the_write_stage():
    """Compress workers beside the writer thread: the cores this process may use less one (at least 1, at
    most 4), counted from its CPU affinity (a rank confined to one core gets one worker, not the machine's)."""
    program = (
        "import os, sys\n"
        "from gangd.pipeline import settings\n"
        "cpus = sorted(os.sched_getaffinity(0))\n"
        "said = [settings.default_workers(), settings.Settings().workers]\n"
        "os.sched_setaffinity(0, cpus[:1])\n"
        "said += [settings.default_workers(), settings.Settings().workers]\n"
        "print(len(cpus), *said)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    cpus, all_default, all_settings, one_default, one_settings = map(int, out)
    assert all_default == all_settings == max(1, min(cpus - 1, ps.DEFAULT_WORKERS_MAX))
    assert one_default == one_settings == 1
