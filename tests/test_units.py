"""Unit tests of gangd's pure pieces: config, the job model, placement,
rank output logs, the job table, atomic files and the CLI's output printer."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import msgpack
import pytest
import trio
import trio.lowlevel
import trio.testing

from gangd import jobs
from gangd.client.cli import OutputPrinter
from gangd.daemon import config as cfg
from gangd.daemon import outputlog
from gangd.daemon.coordinator import place
from gangd.daemon.outputlog import STDERR, STDOUT, OutputStore, read_records

# ====================================================================== config

VALID_TOML = """\
[node]
name = "n2"
state_dir = "/srv/gangd/state"
socket = "/srv/gangd/gangd.sock"
log_level = "debug"
nice = -5

[cluster]
secret_file = "/srv/gangd/secret"
master = "n1"
heartbeat_interval = 0.5
heartbeat_timeout = 3.0

[[nodes]]
name = "n1"
address = "10.0.0.1"
port = 7451
cores = 16

[[nodes]]
name = "n2"
address = "10.0.0.2"
cores = 4

[etcd]
endpoints = ["http://10.0.0.9:2379"]
"""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gangd.toml"
    path.write_text(text)
    return path


def nodes_toml(*names: str) -> str:
    """[[nodes]] tables for ``names`` (and the [etcd] section a daemon's config needs)."""
    nodes = "".join(f'\n[[nodes]]\nname = "{n}"\naddress = "127.0.0.{i + 1}"\ncores = 2\n' for i, n in enumerate(names))
    return nodes + '\n[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n'


def test_config_load_reads_every_section(tmp_path):
    config = cfg.load(write_config(tmp_path, VALID_TOML))
    assert config.node_name == "n2"
    assert config.state_dir == Path("/srv/gangd/state")
    assert config.socket == Path("/srv/gangd/gangd.sock")
    assert config.secret_file == Path("/srv/gangd/secret")
    assert config.log_level == "debug"
    assert config.nice == -5
    assert config.master == "n1"
    assert config.heartbeat_interval == 0.5
    assert config.heartbeat_timeout == 3.0
    assert config.nodes == (
        cfg.NodeSpec("n1", "10.0.0.1", 7451, 16),
        cfg.NodeSpec("n2", "10.0.0.2", cfg.DEFAULT_PORT, 4),
    )
    assert config.node == cfg.NodeSpec("n2", "10.0.0.2", cfg.DEFAULT_PORT, 4)
    assert config.node.endpoint == f"10.0.0.2:{cfg.DEFAULT_PORT}"
    assert [p.name for p in config.peers] == ["n1"]
    assert config.spec("n1").endpoint == "10.0.0.1:7451"


def test_config_defaults_when_sections_are_minimal(tmp_path):
    config = cfg.load(write_config(tmp_path, '[node]\nname = "a"\n' + nodes_toml("a")))
    assert config.state_dir == Path(cfg.DEFAULT_STATE_DIR)
    assert config.socket == Path(cfg.DEFAULT_SOCKET)
    assert config.master is None
    assert config.log_level == "info"
    assert (config.heartbeat_interval, config.heartbeat_timeout) == (1.0, 5.0)
    assert config.node.port == cfg.DEFAULT_PORT


def test_config_every_override_wins_over_the_file(tmp_path):
    config = cfg.load(
        write_config(tmp_path, VALID_TOML),
        node_name="n1",
        state_dir=str(tmp_path / "state"),
        socket=str(tmp_path / "s.sock"),
        secret_file=str(tmp_path / "secret"),
        master="n2",
        log_level="warning",
        heartbeat_interval=2.0,
        heartbeat_timeout=9.0,
    )
    assert config.node_name == "n1"
    assert config.node.address == "10.0.0.1"
    # path overrides become Paths even when given as strings
    assert config.state_dir == tmp_path / "state" and isinstance(config.state_dir, Path)
    assert config.socket == tmp_path / "s.sock" and isinstance(config.socket, Path)
    assert config.secret_file == tmp_path / "secret" and isinstance(config.secret_file, Path)
    assert config.master == "n2"
    assert config.log_level == "warning"
    assert config.heartbeat_interval == 2.0
    assert config.heartbeat_timeout == 9.0


def test_config_none_overrides_keep_the_file_values(tmp_path):
    config = cfg.load(write_config(tmp_path, VALID_TOML), node_name=None, master=None, state_dir=None)
    assert config.node_name == "n2"
    assert config.master == "n1"
    assert config.state_dir == Path("/srv/gangd/state")


def test_config_overridden_heartbeats_are_still_validated(tmp_path):
    with pytest.raises(cfg.ConfigError, match="heartbeat_timeout must be larger"):
        cfg.load(write_config(tmp_path, VALID_TOML), heartbeat_timeout=0.5)


def test_config_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(cfg.ConfigError, match="does not exist") as info:
        cfg.load(missing)
    assert str(missing) in str(info.value)


def test_config_invalid_toml(tmp_path):
    path = write_config(tmp_path, "[node\nname = ")
    with pytest.raises(cfg.ConfigError, match="is not valid TOML") as info:
        cfg.load(path)
    assert str(path) in str(info.value)


def test_config_without_nodes(tmp_path):
    with pytest.raises(cfg.ConfigError, match=r"no \[\[nodes\]\] configured"):
        cfg.load(write_config(tmp_path, '[node]\nname = "n1"\n'))


def test_config_without_node_name(tmp_path):
    with pytest.raises(cfg.ConfigError, match="this node has no name"):
        cfg.load(write_config(tmp_path, nodes_toml("n1")))


def test_config_node_name_not_among_nodes(tmp_path):
    with pytest.raises(cfg.ConfigError, match="node 'n9' is not among the configured nodes"):
        cfg.load(write_config(tmp_path, '[node]\nname = "n9"\n' + nodes_toml("n1", "n2")))


def test_config_node_name_override_not_among_nodes(tmp_path):
    with pytest.raises(cfg.ConfigError, match="node 'zz' is not among"):
        cfg.load(write_config(tmp_path, VALID_TOML), node_name="zz")


def test_config_duplicate_node_names(tmp_path):
    with pytest.raises(cfg.ConfigError, match="duplicate node names") as info:
        cfg.load(write_config(tmp_path, '[node]\nname = "n1"\n' + nodes_toml("n1", "n2", "n1")))
    assert "'n1', 'n2', 'n1'" in str(info.value)


def test_config_master_not_among_nodes(tmp_path):
    text = '[node]\nname = "n1"\n[cluster]\nmaster = "boss"\n' + nodes_toml("n1", "n2")
    with pytest.raises(cfg.ConfigError, match="master 'boss' is not among the configured nodes"):
        cfg.load(write_config(tmp_path, text))


@pytest.mark.parametrize("timeout", [1.0, 0.5])
def test_config_heartbeat_timeout_not_above_interval(tmp_path, timeout):
    text = f'[node]\nname = "n1"\n[cluster]\nheartbeat_interval = 1.0\nheartbeat_timeout = {timeout}\n' + nodes_toml("n1")
    with pytest.raises(cfg.ConfigError, match="heartbeat_timeout must be larger than heartbeat_interval"):
        cfg.load(write_config(tmp_path, text))


def test_config_node_entry_without_address(tmp_path):
    path = write_config(tmp_path, '[node]\nname = "n1"\n' + nodes_toml("n1") + '\n[[nodes]]\nname = "n2"\n')
    with pytest.raises(cfg.ConfigError, match=r"\[\[nodes\]\] entry 2 .*'address'") as info:
        cfg.load(path)
    assert str(path) in str(info.value)


def test_config_node_entry_with_bad_port(tmp_path):
    path = write_config(tmp_path, '[node]\nname = "n1"\n[[nodes]]\nname = "n1"\naddress = "h"\nport = "http"\n')
    with pytest.raises(cfg.ConfigError, match=r"\[\[nodes\]\] entry 1"):
        cfg.load(path)


def test_config_render_loads_back_equal(tmp_path):
    original = cfg.load(write_config(tmp_path, VALID_TOML))
    again = cfg.load(write_config(tmp_path, cfg.render(original)))
    assert again == original


def test_config_render_without_master_loads_back_equal(tmp_path):
    original = cfg.load(
        write_config(tmp_path, '[node]\nname = "b"\n' + nodes_toml("a", "b", "c")),
        state_dir=str(tmp_path / "st"),
        socket=str(tmp_path / "sock"),
        secret_file=str(tmp_path / "sec"),
    )
    assert original.master is None
    text = cfg.render(original)
    assert "master" not in text
    assert cfg.load(write_config(tmp_path, text)) == original


def test_read_secret_missing_file(tmp_path):
    config = cfg.load(write_config(tmp_path, VALID_TOML), secret_file=str(tmp_path / "secret"))
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        config.read_secret()


def test_read_secret_too_short(tmp_path):
    (tmp_path / "secret").write_bytes(b"short-secret\n")
    (tmp_path / "secret").chmod(0o600)
    config = cfg.load(write_config(tmp_path, VALID_TOML), secret_file=str(tmp_path / "secret"))
    with pytest.raises(cfg.ConfigError, match="too short"):
        config.read_secret()


def test_read_secret_hex(tmp_path):
    secret = os.urandom(32).hex()
    assert len(secret) == 64
    (tmp_path / "secret").write_text(secret + "\n")
    (tmp_path / "secret").chmod(0o600)
    config = cfg.load(write_config(tmp_path, VALID_TOML), secret_file=str(tmp_path / "secret"))
    assert config.read_secret() == secret.encode()


# ====================================================================== jobs


def record(nranks=4, state=jobs.FAILED, ranks=None, **spec):
    rec = jobs.new_record(
        job_id=7,
        spec={"argv": ["/usr/bin/solver", "--steps", "3"], "nranks": nranks, **spec},
        owner_uid=1000,
        owner_name="alice",
        owner_gid=1000,
    )
    rec["state"] = state
    if ranks is not None:
        rec["ranks"] = ranks
    return rec


def test_exit_code_done_is_zero():
    assert jobs.exit_code(record(state=jobs.DONE, ranks=[{"code": 0}] * 4)) == 0


def test_exit_code_worst_rank_code():
    ranks = [{"code": 0}, {"code": 3}, {"code": 42}, {"code": 1}]
    assert jobs.exit_code(record(ranks=ranks)) == 42


def test_exit_code_signal_beats_codes():
    ranks = [{"code": 100}, {"signal": signal.SIGSEGV}, {"code": 0}, {"code": 2}]
    assert jobs.exit_code(record(ranks=ranks)) == 128 + signal.SIGSEGV


def test_exit_code_ignores_ranks_gangd_killed_or_lost():
    ranks = [
        {"code": 5},
        {"signal": signal.SIGKILL, "killed": True},
        {"lost": True, "node": "n3", "why": "down"},
        {"code": 77, "lost": True},
    ]
    assert jobs.exit_code(record(ranks=ranks)) == 5


def test_exit_code_killed_without_failing_rank_is_137():
    ranks = [{"signal": signal.SIGKILL, "killed": True}, {"code": 0}, None, {"signal": signal.SIGTERM, "killed": True}]
    assert jobs.exit_code(record(state=jobs.KILLED, ranks=ranks)) == 137 == jobs.EXIT_KILLED


def test_exit_code_killed_with_a_failing_rank_uses_the_rank():
    ranks = [{"code": 9}, {"signal": signal.SIGKILL, "killed": True}]
    assert jobs.exit_code(record(nranks=2, state=jobs.KILLED, ranks=ranks)) == 9


def test_exit_code_failed_with_only_lost_ranks_is_1():
    ranks = [{"lost": True, "why": "node n2 down"}, {"code": 0}, {"signal": signal.SIGKILL, "killed": True}, None]
    assert jobs.exit_code(record(ranks=ranks)) == 1 == jobs.EXIT_FAILED_NO_RANK


def test_describe_status():
    assert jobs.describe_status(None) == "running"
    assert jobs.describe_status({"code": 0}) == "exit 0"
    assert jobs.describe_status({}) == "exit 0"
    assert jobs.describe_status({"code": 3}) == "exit 3"
    # Why, when the node knows (a rank that could not start; one that ended after its ckpt.init() refused), escaped and bounded.
    assert jobs.describe_status({"code": 127, "why": "No such file or directory"}) == "exit 127 (No such file or directory)"
    assert jobs.describe_status({"code": 1, "why": "a\x1b[2Jb" + "x" * 5000}) == f"exit 1 (ab{'x' * (jobs.MAX_EXIT_WHY - 2)})"
    assert jobs.describe_status({"code": 1, "why": ["not", "text"]}) == "exit 1"
    assert jobs.describe_status({"signal": signal.SIGSEGV}) == "killed by SIGSEGV"
    assert jobs.describe_status({"signal": signal.SIGKILL, "killed": True}) == "killed by SIGKILL by gangd"
    assert jobs.describe_status({"signal": 99}) == "killed by signal 99"
    assert jobs.describe_status({"lost": True, "why": "node n2 went down"}) == "lost (node n2 went down)"
    assert jobs.describe_status({"lost": True}) == "lost (node down)"


def test_a_records_exit_statuses_keep_bounded_reasons():
    """What a job record keeps of its ranks' exits (jobs.record_exits): each reason cut, and reasons kept
    for the first MAX_EXIT_WHYS ranks only: thousands of ranks each failing with a sentence (a rank's
    ckpt.init() refusal, a launch failure naming a long directory) must not grow the record past etcd's limit.
    One exit at a time and a node's batch at once keep the same ones."""
    for batch in (1, 7, 40):
        ranks: list = [None] * 40
        exits = [(rank, {"code": 1, "node": "n1", "why": f"rank {rank} " + "x" * 5000}) for rank in range(40)]
        for start in range(0, 40, batch):
            jobs.record_exits(ranks, exits[start : start + batch])
        kept = [s for s in ranks if "why" in s]
        assert len(kept) == jobs.MAX_EXIT_WHYS and all(len(s["why"]) == jobs.MAX_EXIT_WHY for s in kept)
        assert [s["why"].split()[1] for s in kept] == [str(r) for r in range(jobs.MAX_EXIT_WHYS)]  # (the first ones)
        assert all(s == {"code": 1, "node": "n1"} for s in ranks[jobs.MAX_EXIT_WHYS:])
    one: list = [None]
    jobs.record_exits(one, [(0, {"code": 1, "why": ["not", "text"]})])
    assert one == [{"code": 1}]
    plain = {"code": 0, "node": "n2"}
    two: list = [None, {"code": 0}]
    jobs.record_exits(two, [(0, plain), (1, {"code": 9}), (0, {"code": 5})])  # (a rank's first exit stays)
    assert two[0] is plain and two[1] == {"code": 0}


def test_printable_scans_only_what_it_can_show():
    """Text a user or a rank chose (a job name, a rank's reason) is escaped on the daemon's event loop: a
    16 MiB one with terminal escapes is cut to the limit and escaped without being scanned whole (the
    memory its escaping takes is the measure, no clock), and what is shown is as before."""
    import tracemalloc

    from gangd import text

    hostile = "\x1b]0;owned\x07" + "y" * (16 << 20)
    tracemalloc.start()
    try:
        shown = text.printable(hostile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"escaping one reason allocated {peak >> 20} MiB"
    assert shown == "y" * text.MAX_REASON + "..."
    assert text.printable("a\x1b[31mred\x1b[0m\tb\rc", 100) == "ared b?c"
    assert text.printable("x" * 10, 4) == "xxxx..."


@pytest.mark.parametrize(
    "names, expected",
    [
        (["n1", "n2", "n3", "n5"], "n[1-3,5]"),
        (["n4"], "n4"),
        (["login", "gpu"], "login,gpu"),
        (["n8", "n9", "n10"], "n[8-10]"),
        (["n10", "n9"], "n[9-10]"),
        (["n3", "n1", "n2", "n2"], "n[1-3]"),
        (["n1", "n3", "n5"], "n[1,3,5]"),
        (["a1", "b1", "a2"], "a[1-2],b1"),
        (["n01", "n02"], "n01,n02"),
        ([], ""),
    ],
)
def test_compress_nodes(names, expected):
    assert jobs.compress_nodes(names) == expected


@pytest.mark.parametrize(
    "seconds, expected",
    [(0, "0:00"), (5.9, "0:05"), (59, "0:59"), (61, "1:01"), (600, "10:00"), (3599, "59:59"),
     (3600, "1:00:00"), (3725, "1:02:05"), (90061, "25:01:01")],
)
def test_format_duration(seconds, expected):
    assert jobs.format_duration(seconds) == expected


def test_nodes_of_and_ranks_on():
    rec = record(nranks=5)
    rec["placement"] = ["n2", "n2", "n10", "n1", "n2"]
    assert jobs.nodes_of(rec) == ["n2", "n10", "n1"]
    assert jobs.ranks_on(rec, "n2") == [0, 1, 4]
    assert jobs.ranks_on(rec, "n1") == [3]
    assert jobs.ranks_on(rec, "n7") == []
    assert jobs.nodes_of(record(nranks=2)) == []


def test_new_record_defaults():
    before = time.time()
    spec = {"argv": ["/usr/bin/solver", "--steps", "3"], "nranks": 3}
    rec = jobs.new_record(job_id=12, spec=spec, owner_uid=1000, owner_name="alice", owner_gid=100)
    assert rec["id"] == 12
    assert rec["name"] == "solver"
    assert (rec["owner_uid"], rec["owner_gid"], rec["owner"]) == (1000, 100, "alice")
    assert rec["argv"] == ["/usr/bin/solver", "--steps", "3"]
    assert rec["argv"] is not spec["argv"]
    assert rec["cwd"] == "/"
    assert rec["env"] == {}
    assert rec["nranks"] == 3
    assert rec["per_node"] is None and rec["nodes_wanted"] is None and rec["nodelist"] is None
    assert rec["kill_on_bad_exit"] is True
    assert rec["placement"] == []
    assert rec["state"] == jobs.QUEUED and not jobs.is_terminal(rec)
    assert rec["reason"] == ""
    assert before <= rec["submitted"] <= time.time()
    assert rec["started"] is None and rec["ended"] is None
    assert rec["ranks"] == [None, None, None]
    assert rec["kill_requested"] is None
    assert rec["seq"] == 0
    # it must travel over msgpack as is
    assert msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False, strict_map_key=False) == rec


def test_new_record_takes_spec_values():
    spec = {"argv": ["a.out"], "nranks": 2, "name": "sweep", "cwd": "/home/a", "env": {"X": "1"},
            "per_node": 1, "nodes": 2, "nodelist": ["n1", "n2"], "kill_on_bad_exit": False}
    rec = jobs.new_record(job_id=1, spec=spec, owner_uid=0, owner_name="root", owner_gid=0)
    assert rec["name"] == "sweep"
    assert rec["cwd"] == "/home/a"
    assert rec["env"] == {"X": "1"}
    assert (rec["per_node"], rec["nodes_wanted"], rec["nodelist"]) == (1, 2, ["n1", "n2"])
    assert rec["kill_on_bad_exit"] is False
    assert jobs.new_record(job_id=2, spec={"argv": ["hostname"], "nranks": 1}, owner_uid=0,
                           owner_name="root", owner_gid=0)["name"] == "hostname"


def test_elapsed():
    rec = record()
    assert jobs.elapsed(rec) == 0.0
    rec["started"] = 100.0
    assert jobs.elapsed(rec, now=130.5) == 30.5
    rec["ended"] = 110.0
    assert jobs.elapsed(rec, now=500.0) == 10.0


# ====================================================================== placement


def job(nranks, per_node=None, nodes=None, nodelist=None):
    return jobs.new_record(
        job_id=1,
        spec={"argv": ["x"], "nranks": nranks, "per_node": per_node, "nodes": nodes, "nodelist": nodelist},
        owner_uid=0,
        owner_name="root",
        owner_gid=0,
    )


def free_nodes(count=4, cores=8):
    return {f"n{i}": cores for i in range(1, count + 1)}


def test_place_spreads_evenly_in_blocks():
    assert place(job(8), free_nodes()) == ["n1", "n1", "n2", "n2", "n3", "n3", "n4", "n4"]


def test_place_does_not_modify_free():
    free = free_nodes()
    place(job(8), free)
    assert free == free_nodes()


def test_place_per_node():
    assert place(job(8, per_node=3), free_nodes()) == ["n1"] * 3 + ["n2"] * 3 + ["n3"] * 2


def test_place_per_node_caps_even_when_it_does_not_fit():
    assert place(job(8, per_node=1), free_nodes()) is None
    assert place(job(4, per_node=1), free_nodes()) == ["n1", "n2", "n3", "n4"]


def test_place_nodes_wanted():
    assert place(job(8, nodes=2), free_nodes()) == ["n1"] * 4 + ["n2"] * 4
    assert place(job(3, nodes=2), free_nodes()) == ["n1", "n1", "n2"]


def test_place_nodes_wanted_skips_nodes_without_room_for_the_share():
    free = {"n1": 2, "n2": 8, "n3": 8}
    assert place(job(8, nodes=2), free) == ["n2"] * 4 + ["n3"] * 4


def test_place_nodes_wanted_more_than_free_nodes():
    assert place(job(4, nodes=3), {"n1": 8, "n2": 8, "n3": 0}) is None


def test_place_nodelist_restricts():
    placement = place(job(4, nodelist=["n2", "n4"]), free_nodes())
    assert placement == ["n2", "n2", "n4", "n4"]
    assert place(job(20, nodelist=["n2", "n4"]), free_nodes()) is None


def test_place_not_enough_free_cores():
    assert place(job(33), free_nodes()) is None
    assert place(job(3), {"n1": 1, "n2": 1}) is None
    assert place(job(1), {"n1": 0, "n2": 0}) is None
    assert place(job(1), {}) is None


def test_place_fills_exactly_all_free_cores():
    assert place(job(32), free_nodes()) == [f"n{i}" for i in range(1, 5) for _ in range(8)]


def test_place_uneven_free_cores_spill_over():
    free = {"n1": 1, "n2": 8, "n3": 8, "n4": 8}
    placement = place(job(8), free)
    assert placement == ["n1", "n2", "n2", "n2", "n3", "n3", "n4", "n4"]
    assert all(placement.count(n) <= free[n] for n in free)


def test_place_uneven_free_cores_skips_full_nodes():
    assert place(job(4), {"n1": 0, "n2": 3, "n3": 1}) == ["n2", "n2", "n2", "n3"]


def test_place_natural_order():
    assert place(job(3), {"n10": 1, "n2": 1, "n1": 1}) == ["n1", "n2", "n10"]
    assert place(job(4), {"n10": 8, "n9": 8}) == ["n9", "n9", "n10", "n10"]


def test_place_nodes_wanted_on_unequal_nodes_fits():
    # 5 ranks on exactly 2 nodes: n1 can hold 2 and n2 the other 3; submit
    # accepts this job (capacity 2 + 8 >= 5), so place() must find a placement.
    placement = place(job(5, nodes=2), {"n1": 2, "n2": 8})
    assert placement is not None and sorted(set(placement)) == ["n1", "n2"]


# ====================================================================== output logs


async def collect(agen):
    return [item async for item in agen]


async def open_log(tmp_path, job=1, rank=0):
    store = OutputStore(tmp_path / "out", "n1")
    store.prepare()
    return await store.open(job, rank)


async def read_path(path, start=0, end=None):
    fd = os.open(path, os.O_RDONLY)
    try:
        return await collect(read_records(fd, start, end))
    finally:
        os.close(fd)


async def test_outputlog_records_come_back_in_order(tmp_path):
    log = await open_log(tmp_path)
    log.append(STDOUT, b"one\n")
    log.append(STDERR, b"warning\n")
    log.append(STDOUT, b"two\n")
    log.close()
    with trio.fail_after(5):
        items = await collect(log.follow())
    assert items == [(STDOUT, b"one\n"), (STDERR, b"warning\n"), (STDOUT, b"two\n")]
    assert log.size == os.path.getsize(log.path) == 3 * 5 + 4 + 8 + 4  # noqa: ASYNC240 -- a small local file, after the test


async def test_outputlog_file_mode(tmp_path):
    log = await open_log(tmp_path)
    log.close()
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600


async def test_outputlog_follower_sees_later_appends_and_ends_on_close(tmp_path):
    log = await open_log(tmp_path)
    seen = []
    got_first = trio.Event()
    done = trio.Event()

    async def follower():
        async for item in log.follow():
            seen.append(item)
            got_first.set()
        done.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []
            log.append(STDOUT, b"a")
            await got_first.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()
            log.append(STDERR, b"b")
            log.append(STDOUT, b"c")
            await trio.sleep(0.05)
            assert not done.is_set()  # still following: not closed yet
            log.close()
            await done.wait()
    assert seen == [(STDOUT, b"a"), (STDERR, b"b"), (STDOUT, b"c")]


async def test_outputlog_follower_of_empty_log_ends_on_close(tmp_path):
    log = await open_log(tmp_path)
    result = []

    async def follower():
        result.extend(await collect(log.follow()))
        result.append("end")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower)
            await trio.testing.wait_all_tasks_blocked()
            assert result == []
            log.close()
    assert result == ["end"]


async def test_outputlog_follow_false_returns_what_is_there(tmp_path):
    log = await open_log(tmp_path)
    with trio.fail_after(5):
        assert await collect(log.follow(follow=False)) == []
        log.append(STDOUT, b"x")
        log.append(STDERR, b"y")
        assert await collect(log.follow(follow=False)) == [(STDOUT, b"x"), (STDERR, b"y")]
    log.close()


async def test_outputlog_many_followers_see_the_same(tmp_path):
    log = await open_log(tmp_path)
    results = {}

    async def follower(i):
        results[i] = await collect(log.follow())

    expected = [(STDOUT if i % 3 else STDERR, f"line {i}\n".encode()) for i in range(50)]
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(follower, i)
            for n, (stream, data) in enumerate(expected):
                log.append(stream, data)
                if n % 7 == 0:
                    await trio.lowlevel.checkpoint()
            log.close()
    assert results == {0: expected, 1: expected, 2: expected}


async def test_read_records_over_a_finished_file(tmp_path):
    log = await open_log(tmp_path)
    path = log.path
    expected = [(STDOUT, b"hello\n"), (STDERR, b"oops\n"), (STDOUT, b""), (STDERR, bytes(range(256)) * 3)]
    for stream, data in expected:
        log.append(stream, data)
    log.close()
    with trio.fail_after(5):
        assert await read_path(path) == expected
        # from a record boundary
        offset = 5 + len(b"hello\n")
        assert await read_path(path, start=offset) == expected[1:]
        # up to a record boundary
        assert await read_path(path, end=offset) == expected[:1]
        # a missing file has no records
        assert await collect(log.store.read(1, 7)) == []


async def test_read_records_across_small_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(outputlog, "READ_CHUNK", 3)
    log = await open_log(tmp_path)
    path = log.path
    expected = [(STDOUT, b"abcdefgh"), (STDERR, b"i"), (STDOUT, b""), (STDOUT, b"jklmnopqrstuvwxyz\n")]
    for stream, data in expected:
        log.append(stream, data)
    log.close()
    with trio.fail_after(5):
        assert await read_path(path) == expected
        reopened = await open_log(tmp_path)
        reopened.close()
        assert await collect(reopened.follow()) == expected


async def test_outputlog_interleaving_is_preserved(tmp_path):
    log = await open_log(tmp_path)
    expected = []
    for i in range(20):
        stream = STDERR if i % 2 else STDOUT
        expected.append((stream, f"{i}".encode()))
        log.append(stream, f"{i}".encode())
    log.close()
    with trio.fail_after(5):
        items = await collect(log.follow())
    assert items == expected
    assert [d for s, d in items if s == STDOUT] == [str(i).encode() for i in range(0, 20, 2)]
    assert [d for s, d in items if s == STDERR] == [str(i).encode() for i in range(1, 20, 2)]


async def test_outputlog_empty_chunk(tmp_path):
    log = await open_log(tmp_path)
    log.append(STDOUT, b"")
    log.append(STDERR, b"after")
    log.close()
    with trio.fail_after(5):
        assert await collect(log.follow()) == [(STDOUT, b""), (STDERR, b"after")]


async def test_outputlog_reopened_after_restart_keeps_old_output(tmp_path):
    first = await open_log(tmp_path)
    first.append(STDOUT, b"before restart\n")
    first.close()
    second = await open_log(tmp_path)
    assert second.size == first.size
    second.append(STDERR, b"after restart\n")
    second.close()
    with trio.fail_after(5):
        assert await collect(second.follow()) == [(STDOUT, b"before restart\n"), (STDERR, b"after restart\n")]


# ====================================================================== output printer


def test_printer_joins_partial_lines_across_chunks(capsysbinary):
    printer = OutputPrinter(4)
    printer.feed({"rank": 1, "stream": 1, "data": b"hel"})
    assert capsysbinary.readouterr().out == b""
    printer.feed({"rank": 1, "stream": 1, "data": b"lo\nwor"})
    assert capsysbinary.readouterr().out == b"1: hello\n"
    printer.feed({"rank": 1, "stream": 1, "data": b"ld\n"})
    assert capsysbinary.readouterr().out == b"1: world\n"


def test_printer_several_lines_in_one_chunk(capsysbinary):
    printer = OutputPrinter(2)
    printer.feed({"rank": 0, "stream": 1, "data": b"a\nb\n\nc\n"})
    assert capsysbinary.readouterr().out == b"0: a\n0: b\n0: \n0: c\n"


def test_printer_keeps_ranks_and_streams_apart(capsysbinary):
    printer = OutputPrinter(2)
    printer.feed({"rank": 0, "stream": 1, "data": b"out-0 "})
    printer.feed({"rank": 1, "stream": 1, "data": b"out-1 "})
    printer.feed({"rank": 0, "stream": 2, "data": b"err-0 "})
    printer.feed({"rank": 1, "stream": 1, "data": b"done\n"})
    printer.feed({"rank": 0, "stream": 2, "data": b"done\n"})
    printer.feed({"rank": 0, "stream": 1, "data": b"done\n"})
    captured = capsysbinary.readouterr()
    assert captured.out == b"1: out-1 done\n0: out-0 done\n"
    assert captured.err == b"0: err-0 done\n"


@pytest.mark.parametrize("nranks, rank, prefix", [(1, 0, b"0: "), (10, 9, b"9: "), (10, 3, b"3: "),
                                                  (11, 3, b" 3: "), (11, 10, b"10: "), (120, 7, b"  7: ")])
def test_printer_labels_are_right_aligned(capsysbinary, nranks, rank, prefix):
    printer = OutputPrinter(nranks)
    printer.feed({"rank": rank, "stream": 1, "data": b"x\n"})
    assert capsysbinary.readouterr().out == prefix + b"x\n"


def test_printer_without_label_or_rank(capsysbinary):
    OutputPrinter(4, label=False).feed({"rank": 3, "stream": 2, "data": b"plain\n"})
    OutputPrinter(4).feed({"rank": None, "stream": 1, "data": b"no rank\n"})
    captured = capsysbinary.readouterr()
    assert captured.err == b"plain\n"
    assert captured.out == b"no rank\n"


def test_printer_flush_terminates_partial_lines(capsysbinary):
    printer = OutputPrinter(12)
    printer.feed({"rank": 11, "stream": 1, "data": b"no newline"})
    printer.feed({"rank": 2, "stream": 2, "data": b"half"})
    printer.feed({"rank": 3, "stream": 1, "data": b"full\n"})
    assert capsysbinary.readouterr().out == b" 3: full\n"
    printer.flush()
    captured = capsysbinary.readouterr()
    assert captured.out == b"11: no newline\n"
    assert captured.err == b" 2: half\n"
    printer.flush()  # nothing left: prints nothing
    assert capsysbinary.readouterr() == (b"", b"")


def test_printer_binary_data_passes_through(capsysbinary):
    printer = OutputPrinter(1, label=False)
    printer.feed({"rank": 0, "stream": 1, "data": b"\xff\x00\xfe\n"})
    assert capsysbinary.readouterr().out == b"\xff\x00\xfe\n"


# ====================================================================== config: [etcd]

MINIMAL = '[node]\nname = "n1"\n[[nodes]]\nname = "n1"\naddress = "127.0.0.1"\n'


def etcd_config(tmp_path: Path, section: str, **overrides) -> cfg.Config:
    return cfg.load(write_config(tmp_path, MINIMAL + "[etcd]\n" + section), **overrides)


def test_etcd_section_defaults(tmp_path):
    etcd = etcd_config(tmp_path, 'endpoints = ["http://127.0.0.1:2379"]\n').etcd
    assert etcd == cfg.EtcdSettings(endpoints=("http://127.0.0.1:2379",))
    assert (etcd.prefix, etcd.lease_ttl, etcd.grace, etcd.local, etcd.tls) == ("/gangd", 10, 60.0, False, False)
    assert etcd.key("jobs", "7") == "/gangd/jobs/7"
    assert etcd.read_password() is None


def test_etcd_section_every_key_renders_and_loads_back_equal(tmp_path):
    text = """\
endpoints = ["https://etcd1:2379", "https://etcd2:2379"]
prefix = "/site/cluster-a"
lease_ttl = 4
grace = 12.5
ca_file = "/etc/gangd/ca.pem"
cert_file = "/etc/gangd/client.pem"
key_file = "/etc/gangd/client.key"
user = "gangd"
password_file = "/etc/gangd/etcd-password"
binary = "/opt/etcd/bin/etcd"
local = true
"""
    config = etcd_config(tmp_path, text)
    assert config.etcd == cfg.EtcdSettings(
        endpoints=("https://etcd1:2379", "https://etcd2:2379"), prefix="/site/cluster-a", lease_ttl=4, grace=12.5,
        ca_file=Path("/etc/gangd/ca.pem"), cert_file=Path("/etc/gangd/client.pem"), key_file=Path("/etc/gangd/client.key"),
        user="gangd", password_file=Path("/etc/gangd/etcd-password"), binary=Path("/opt/etcd/bin/etcd"), local=True,
    )
    assert config.etcd.tls
    assert cfg.load(write_config(tmp_path, cfg.render(config))) == config


def test_etcd_settings_are_overridable_like_the_others(tmp_path):
    etcd = etcd_config(
        tmp_path, 'endpoints = ["http://127.0.0.1:2379"]\nlease_ttl = 10\n', etcd_endpoints="http://10.0.0.1:2379, http://10.0.0.2:2379", etcd_lease_ttl=3
    ).etcd
    assert etcd.endpoints == ("http://10.0.0.1:2379", "http://10.0.0.2:2379")
    assert etcd.lease_ttl == 3
    with pytest.raises(cfg.ConfigError, match="lease_ttl"):
        etcd_config(tmp_path, 'endpoints = ["http://127.0.0.1:2379"]\n', etcd_lease_ttl=1)


def test_a_daemon_config_without_etcd_endpoints_names_the_section(tmp_path):
    path = write_config(tmp_path, MINIMAL)
    for text in (MINIMAL, MINIMAL + "[etcd]\nprefix = \"/gangd\"\n", MINIMAL + "[etcd]\nendpoints = []\n"):
        path.write_text(text)
        with pytest.raises(cfg.ConfigError, match=r"no \[etcd\] endpoints in .*gangd\.toml: gangd keeps the cluster's state in etcd"):
            cfg.load(path)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ('endpoints = ["127.0.0.1:2379"]', "is not an etcd client URL: write http://HOST:PORT"),
        ('endpoints = ["ftp://127.0.0.1:2379"]', "is not an etcd client URL"),
        ('endpoints = ["http://127.0.0.1"]', "has no port"),
        ('endpoints = ["http://127.0.0.1:99999"]', "is not a valid URL"),
        ('endpoints = ["http://root:pw@127.0.0.1:2379"]', "carries credentials: set \\[etcd\\] user and password_file"),
        ('endpoints = ["http://127.0.0.1:2379/v3"]', "has a path or query"),
        ('endpoints = ["http://a:2379", "https://b:2379"]', "mix http:// and https://"),
        ('endpoints = "http://a:2379"\nlease_ttl = 1', "lease_ttl must be a whole number of seconds from 2 to 3600, not 1"),
        ('endpoints = "http://a:2379"\nlease_ttl = 2.5', "lease_ttl must be a whole number"),
        ('endpoints = "http://a:2379"\ngrace = -1', "grace must be seconds from 0"),
        ('endpoints = "http://a:2379"\nprefix = "gangd"', "prefix must be a key path"),
        ('endpoints = "http://a:2379"\nprefix = "/gangd/"', "prefix must be a key path"),
        ('endpoints = "http://a:2379"\nprefix = "/"', "prefix must be a key path"),
        ('endpoints = "http://a:2379"\nlocal = "yes"', "local must be true or false"),
        ('endpoints = "http://a:2379"\nttl = 5', "unknown setting \\[etcd\\] ttl"),
        ('endpoints = "http://a:2379"\nca_file = "/ca.pem"', "TLS settings, but the endpoints are http://"),
        ('endpoints = "https://a:2379"\nkey_file = "/k.pem"', "key_file is set without cert_file"),
        ('endpoints = "https://a:2379"\nuser = "gangd"', "user and password_file go together"),
        ('endpoints = "http://etcd1:2379"\nuser = "gangd"\npassword_file = "/p"', "password would cross the network in clear text"),
        ('endpoints = 2379', "endpoints must be a list of URLs"),
    ],
)
def test_a_bad_etcd_section_is_refused_with_what_is_wrong(tmp_path, section, message):
    with pytest.raises(cfg.ConfigError, match=r"\[etcd\]") as info:
        etcd_config(tmp_path, section + "\n")
    assert info.match(message)


def etcd_with_password(password_file: Path) -> cfg.EtcdSettings:
    return cfg.EtcdSettings(endpoints=("https://a:2379",), user="gangd", password_file=password_file)


def test_etcd_password_is_read_from_a_private_file(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret pass\n")
    secret.chmod(0o600)
    etcd = etcd_with_password(secret)
    assert etcd.read_password() == "s3cret pass"
    assert "s3cret" not in repr(etcd)  # only the file's name is in the settings


@pytest.mark.parametrize("problem", ["world-readable", "a symlink", "missing", "empty"])
def test_an_etcd_password_file_others_can_read_is_refused(tmp_path, problem):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    if problem == "world-readable":
        secret.chmod(0o644)
        expect = "etcd password file .* has mode 0644: other users can read or change it; refusing it"
    elif problem == "a symlink":
        link = tmp_path / "link"
        link.symlink_to(secret)
        secret, expect = link, "is a symbolic link; refusing it: point password_file at the file itself"
    elif problem == "missing":
        secret, expect = tmp_path / "nope", "etcd password file .* does not exist"
    else:
        secret.write_text("\n")
        expect = "is empty"
    with pytest.raises(cfg.ConfigError, match=expect):
        etcd_with_password(secret).read_password()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another uid")
def test_an_etcd_password_file_of_another_user_is_refused(tmp_path):
    secret = tmp_path / "etcd-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    os.chown(secret, 65534, 65534)
    with pytest.raises(cfg.ConfigError, match="is owned by uid 65534, not root: its owner could read or replace gangd's etcd password"):
        etcd_with_password(secret).read_password()
