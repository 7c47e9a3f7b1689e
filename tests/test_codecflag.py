"""A job's checkpoint codec (issue 18's plumbing): ``--ckpt-codec`` on
``gang run/submit``, ``[checkpoint] codec`` in the config, and
``GANGD_CKPT_CODEC`` in every rank's environment.

The spec is text from a user (the command line, the wire, a config file):
it is checked at each edge and kept canonical, so what a rank is told is
always a spec ``CodecSpec.parse`` accepts. The cluster test runs real
daemons: what a user relies on is the variable each rank actually sees,
with and without the option, after a restart, and over a value their own
environment happened to hold.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from gangd import jobs
from gangd.codecs.spec import ACCEPTED
from gangd.daemon import config as cfg

JOB = Path(__file__).parent / "jobs" / "codecjob.py"
SPEC = {"argv": ["x"], "nranks": 1}


# ------------------------------------------------------------------ the job spec


@pytest.mark.parametrize(("given", "kept"), [
    ("none", "none"), ("lz4", "lz4"), ("zstd", "zstd:3"), ("zstd:9", "zstd:9"), ("zstd:05", "zstd:5"),
    ("blosc2", "blosc2:zstd:1:shuffle"), ("blosc2:lz4:bytedelta", "blosc2:lz4:1:bytedelta"),
    ("blosc2:bitshuffle:9:zlib", "blosc2:zlib:9:bitshuffle"), ("auto", "auto"),
    ("nvcomp:lz4", "nvcomp:lz4"),  # (a plug-in this node lacks: the ranks may run where it is installed)
])
def test_a_good_codec_is_kept_in_its_canonical_form(given, kept):
    checked = jobs.JobSpec.from_wire({**SPEC, "ckpt_codec": given}, ["n1"])
    assert checked.ckpt_codec == kept and checked.as_spec()["ckpt_codec"] == kept
    record = jobs.new_record(job_id=1, spec=checked.as_spec(), owner_uid=0, owner_name="root", owner_gid=0)
    assert record["ckpt_codec"] == kept


def test_a_job_without_a_codec_follows_the_cluster():
    checked = jobs.JobSpec.from_wire(SPEC, ["n1"])
    assert checked.ckpt_codec is None and checked.as_spec()["ckpt_codec"] is None


@pytest.mark.parametrize("hostile", [
    "bogus:", "zstd:99", "zstd:0", "zstd:3:4", "lz4:1", "auto:fast", "blosc2:foo", "blosc2:zstd:zstd", "", "Zstd", "9zstd",
    "x" * 129, "z" * (1 << 20), "zstd:\x00", "\x1b]0;pwned\x07zstd", "nvcomp:" + ":".join(["a"] * 9), "zstd:\uff11",  # (a fullwidth 1)
    12, 1.5, True, b"zstd", ["zstd"], {"name": "zstd"},
])
def test_a_hostile_codec_is_refused_saying_what_is_accepted(hostile):
    with pytest.raises(jobs.BadSpec) as caught:
        jobs.JobSpec.from_wire({**SPEC, "ckpt_codec": hostile}, ["n1"])
    message = caught.value.message
    assert caught.value.code == "bad_request"
    assert message.startswith("the checkpoint codec ") and message.endswith(f"accepted: {ACCEPTED}")
    assert len(message) < 600 and "\x1b" not in message and "\x00" not in message and "\x07" not in message


# ------------------------------------------------------------------ the config


def _config(tmp_path: Path, section: str) -> Path:
    path = tmp_path / "gangd.toml"
    path.write_text(f'[node]\nname = "n1"\n\n[[nodes]]\nname = "n1"\naddress = "127.0.0.1"\n\n[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n\n{section}')
    return path


def test_the_clusters_codec_is_none_unless_set_and_kept_canonical(tmp_path):
    assert cfg.load(_config(tmp_path, "")).checkpoint_codec == "none"
    config = cfg.load(_config(tmp_path, '[checkpoint]\ncodec = "blosc2:lz4"\n'))
    assert config.checkpoint_codec == "blosc2:lz4:1:shuffle"
    assert 'codec = "blosc2:lz4:1:shuffle"' in cfg.render(config)  # (gang cluster up writes it for the daemons)
    assert cfg.load(_config(tmp_path, '[checkpoint]\ncodec = "nvcomp:lz4"\n')).checkpoint_codec == "nvcomp:lz4"


@pytest.mark.parametrize("bad", ['"zstd:30"', '"gzip -1"', '""', "3", "true", '["zstd"]', f'"{"a" * 200}"'])
def test_a_bad_clusters_codec_is_refused_at_load_naming_the_file_and_the_key(tmp_path, bad):
    path = _config(tmp_path, f"[checkpoint]\ncodec = {bad}\n")
    with pytest.raises(cfg.ConfigError) as caught:
        cfg.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: [checkpoint] codec ") and f"accepted: {ACCEPTED}" in message, message


def test_the_clusters_settings_are_the_defaults_unless_set_and_a_bad_value_names_the_file(tmp_path):
    assert cfg.load(_config(tmp_path, "")).checkpoint_pipeline == ""
    config = cfg.load(_config(tmp_path, '[checkpoint]\npipeline = "workers = 1, buffer_size = 512k"\n'))
    assert config.checkpoint_pipeline == "buffer_size=512KiB,workers=1"
    assert 'pipeline = "buffer_size=512KiB,workers=1"' in cfg.render(config)  # (gang cluster up writes it for the daemons)
    for bad in ('"workers=0"', '"fast"', "3"):
        path = _config(tmp_path, f"[checkpoint]\npipeline = {bad}\n")
        with pytest.raises(cfg.ConfigError, match=rf"^{path}: \[checkpoint\] pipeline: "):
            cfg.load(path)


# ------------------------------------------------------------------ the command line


def _gang(*args: str) -> subprocess.CompletedProcess:
    """`gang ARGS` asked in this process of the group the gang script runs (gangd.client.cli:main),
    with its exit code, stdout and stderr: a Python started for each took seconds on a loaded machine.
    An exception out of the command (a traceback) fails the test (catch_exceptions=False)."""
    from click.testing import CliRunner

    from gangd.client.cli import main as cli_main

    result = CliRunner().invoke(cli_main, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def test_gang_run_and_submit_offer_ckpt_codec_and_say_what_a_job_without_it_gets():
    for command in ("run", "submit"):
        shown = " ".join(_gang(command, "--help").stdout.split())
        assert "--ckpt-codec CODEC" in shown and "--ckpt-codec zstd:9" in shown
        assert "Default: the cluster's [checkpoint] codec (none unless set); a restart keeps its lineage's codec" in shown
        assert "GANGD_CKPT_CODEC" in shown


@pytest.mark.parametrize("bad", ["bogus", "zstd:99", "lz4:fast", "x" * 300])
def test_gang_submit_refuses_a_bad_codec_before_sending_it(tmp_path, bad):
    # (--cluster names a directory with no cluster: a spec that went through would fail to connect, not as a usage error)
    result = _gang("--cluster", str(tmp_path), "submit", "-n", "1", "--ckpt-codec", bad, "--", "true")
    assert result.returncode == 2, result
    assert "--ckpt-codec" in result.stderr and f"accepted: {ACCEPTED}" in " ".join(result.stderr.split()), result.stderr


# ------------------------------------------------------------------ a cluster


def _codecs_printed(gc, job: int, nranks: int, timeout: float = 60, what: str = "codec") -> dict[int, str]:
    """rank -> the GANGD_CKPT_CODEC (``what="pipeline"``: GANGD_CKPT_PIPELINE) it printed, once every rank has."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line.split() for line in gc.logs(job).splitlines()]  # (`gang logs`'s stdout, read in this process: polled)
        seen = {int(words[-3]): words[-1] for words in lines if len(words) >= 4 and words[-4:-2] == ["rank", words[-3]] and words[-2] == what}
        if len(seen) == nranks:
            return seen
        assert time.monotonic() < deadline, f"job {job}'s ranks did not print their {what}: {seen}\n{gc.gang('logs', job).stdout[-2000:]}"
        time.sleep(0.2)


def test_every_rank_gets_its_jobs_codec_and_pipeline_else_the_clusters_and_a_restart_keeps_them(make_cluster, tmp_path):
    import os

    from ckpthelpers import PY, checkpoint, kill_and_restart, kill_what_is_left

    gc = make_cluster(2, checkpoint_codec="lz4")  # ([checkpoint] codec: not the default, so that it shows)
    release = tmp_path / "release"
    tmp_path.chmod(0o755)
    # The submitter's own GANGD_CKPT_CODEC travels in the job's environment: the daemons' value replaces it.
    env = {**os.environ, "GANGD_CKPT_CODEC": "zstd:1", "GANGD_CKPT_PIPELINE": "workers=3"}

    def submit(*options: str) -> int:
        out = gc.gang("submit", "-n", "2", "-N", "2", "--ckpt-redundancy", "local", *options, "--", PY, str(JOB), str(release), check=True, env=env)
        return int(out.stdout)

    try:
        # (--ckpt-pipeline in another spelling: the job record and the ranks get the canonical one; --ckpt-mode full,
        # whose whole files were written raw whatever the codec until bench/ckpt.py's Fig. 4 showed it)
        asked = submit("--ckpt-codec", "zstd:5", "--ckpt-pipeline", "workers=1, buffer_size=262144", "--ckpt-mode", "full")
        default = submit()
        one = "buffer_size=256KiB,workers=1"
        assert _codecs_printed(gc, asked, 2) == {0: "zstd:5", 1: "zstd:5"}
        assert _codecs_printed(gc, asked, 2, what="pipeline") == {0: one, 1: one}
        assert _codecs_printed(gc, default, 2) == {0: "lz4", 1: "lz4"}
        assert _codecs_printed(gc, default, 2, what="pipeline") == {0: "<defaults>", 1: "<defaults>"}
        assert gc.gang_json("job", asked)["ckpt_codec"] == "zstd:5" and gc.gang_json("job", asked)["ckpt_pipeline"] == one
        assert gc.gang_json("job", default)["ckpt_codec"] is None  # (null: the cluster's)
        assert gc.gang_json("job", default)["ckpt_pipeline"] is None
        shown = gc.gang("job", asked, check=True).stdout
        assert any(line.split() == ["CKPT", "CODEC", "zstd:5"] for line in shown.splitlines()), shown
        assert any(line.split() == ["CKPT", "PIPELINE", one] for line in shown.splitlines()), shown

        assert checkpoint(gc, asked)["state"] == "complete"
        listing = gc.gang("ckpt", "ls", asked, check=True).stdout
        assert "codec: zstd:5 " in listing, listing
        # What each generation recorded (CODEC), what a restore reads (RESTORE: the compressed bytes on disk, not
        # the state's), and per node the codec's bytes in and out and each stage's busy time (gang ckpt stats).
        assert "CODEC" in listing and "zstd:5@1" in listing, listing
        (gen,) = [g for g in gc.gang_json("ckpt", "ls", asked)["generations"] if g["state"] == "complete"]
        assert "zstd:5@1" in gen["codecs"] and gen["restore_bytes"] == gen["written"], gen  # (none@1: a unit zstd could not shrink)
        for node, figures in gen["nodes"].items():
            pipeline = figures["pipeline"]
            assert pipeline["in"] > 1 << 20 > 10 * pipeline["out"] > 0, (node, pipeline)  # (1 MiB of zeros per rank)
            assert {"compress", "write"} <= set(pipeline["stages"]) and figures["blocked"] >= 0 and figures["disk"] > 0, figures
            assert pipeline["stages"]["compress"]["workers"] == 1, pipeline  # (the job's --ckpt-pipeline workers=1, not this node's 2+)
        stats = gc.gang("ckpt", "stats", asked, check=True).stdout
        assert all(word in stats for word in ("IN", "OUT", "RATIO", "BLOCKED", "DISK", "compress", "write")), stats
        restarted = kill_and_restart(gc, asked)
        assert _codecs_printed(gc, restarted, 2) == {0: "zstd:5", 1: "zstd:5"}
        assert _codecs_printed(gc, restarted, 2, what="pipeline") == {0: one, 1: one}
        assert gc.gang_json("job", restarted)["ckpt_codec"] == "zstd:5"  # (the restart's record carries its lineage's)
        assert gc.gang_json("job", restarted)["ckpt_pipeline"] == one
        assert gc.ask(lambda gang: gang.checkpoints(restarted), "ckpt ls")["codec"] == "zstd:5"
        release.touch()
        assert gc.wait_state(restarted, ("DONE",), timeout=60)["state"] == "DONE"

        # A codec the ranks' nodes lack (a plug-in installed only where the job was submitted; the API takes it, as
        # the coordinator must): the job fails as its ranks start, each saying which codec, on which node and how to
        # install it -- not at its first checkpoint, hours later.
        lacking = gc.ask(lambda gang: gang.submit([PY, str(JOB), str(release)], 2, nodes=2, ckpt_redundancy="local", ckpt_codec="nosuchcodec:fast",
                                                  env=env, cwd=str(tmp_path), kill_on_bad_exit=False), "submit")["id"]
        # (kill_on_bad_exit off: the first rank to fail does not get the other killed before it says why)
        assert gc.wait_state(lacking, ("FAILED",), timeout=60)["state"] == "FAILED"
        said = " ".join(gc.gang("logs", lacking).stderr.split())
        for node in ("n1", "n2"):
            assert f"checkpoint codec 'nosuchcodec:fast' is refused on node {node}" in said, said
        assert "install the package that provides the 'nosuchcodec' codec" in said, said
        # Each rank's exit says it too (it said "exit 1"): the ranks told their nodes before they exited. With
        # kill_on_bad_exit (the default), the job's reason is the first failing rank's exit, and says it.
        record = gc.job(lacking)
        for status in record["ranks"]:
            said = jobs.describe_status(status)
            assert "ckpt.init() refused its settings; the rank said: GANGD_CKPT_CODEC: checkpoint codec 'nosuchcodec:fast' is refused" in said
        killed = gc.ask(lambda gang: gang.submit([PY, str(JOB), str(release)], 2, nodes=2, ckpt_redundancy="local", ckpt_codec="nosuchcodec:fast",
                                                 env=env, cwd=str(tmp_path)), "submit")["id"]
        failed = gc.wait_state(killed, ("FAILED",), timeout=60)
        assert re.fullmatch(r"rank [01] on n[12] exit 1 \(ckpt\.init\(\) refused its settings; the rank said: "
                            r"GANGD_CKPT_CODEC: checkpoint codec 'nosuchcodec:fast' is refused on node n[12]: "
                            r".*install the package that provides the 'nosuchcodec' codec.*", failed["reason"]), failed["reason"]
        shown = gc.gang("ps", "--all", check=True).stdout + gc.gang("job", killed, check=True).stdout
        assert "nosuchcodec" in shown, shown
        # Last words only from an attached rank (the attach checks the caller is that rank, by its pid): a process
        # that is none, saying a megabyte, is refused, and the daemon serves on.
        from gangd.comm.control import DaemonLink
        from gangd.comm.errors import CommError

        stranger = DaemonLink(str(gc.files["n1"].socket), "not-a-rank")
        try:
            with pytest.raises(CommError, match="ckpt_refused before ckpt_attach"):
                stranger.request("ckpt_refused", {"error": "x" * (1 << 20)})
        finally:
            stranger.sock.close()
        assert "n1" in gc.gang("nodes", check=True).stdout
    finally:
        kill_what_is_left(gc)
