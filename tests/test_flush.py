"""The third level: generations flushed to a shared directory (issue 16).

Real daemons, real ranks; the "parallel file system" is a directory every
node of the local cluster sees. What a user relies on: a flushed generation
is laid out there as each node held it, root's alone, and recorded
*flushed* only once every node's copy is whole; when more nodes are lost
than the redundancy covers (here both nodes of a partner pair, disks
included), a restart takes the ranks' files from the flush directory and
the job ends bit-identical to an uninterrupted run; a flushed file damaged
on the shared file system is refused naming it.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
from ckpthelpers import TERMINAL, checkpoint, gen_dir, generations, reference, result_of, submit, wait_running_a_bit
from conftest import wait_for

from gangd import ckptstore
from gangd.daemon import config as cfg
from gangd.daemon.flush import Cancelled, FlushRequest, Throttle, UnflushRequest
from gangd.rpc import RemoteError

JOB = str(Path(__file__).resolve().parent / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "250", "--mb", "0.5"]


def _entry(cluster, job: int, gen: int) -> dict:
    return next(g for g in generations(cluster, job) if g["gen"] == gen)


def _wait_node(cluster, node: str, state: str) -> None:
    wait_for(lambda: {r["name"]: r["state"] for r in cluster.gang_json("nodes")["nodes"]}.get(node) == state, 60, f"{node} {state}")


def test_with_both_nodes_of_a_partner_pair_lost_the_restart_takes_the_flushed_generation(make_cluster, tmp_path):
    shared = tmp_path / "shared"
    cluster = make_cluster(4, cores=2, time_slice=0.1, lease_ttl=5, flush_dir=shared)
    expected = reference(cluster, ARGV, 4)
    job = submit(cluster, [*ARGV, "--sleep", "0.01"], 4, "-w", "n2,n3", "--ckpt-redundancy", "partner")
    wait_running_a_bit(cluster, job)
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    entry = wait_for(lambda: (lambda e: e if e.get("flushed") or e.get("flush") else None)(_entry(cluster, job, gen["gen"])), 60, "the flush")
    assert entry["state"] == "protected" and entry["flushed"]["bytes"] > 0, entry
    assert "partner+flushed" in cluster.gang("ckpt", "ls", job, check=True).stdout
    # Laid out as each node held it, root's alone, nothing half-written left.
    flushed = shared / f"job-{job}" / f"gen-{gen['gen']}"
    assert sorted(p.name for p in flushed.iterdir()) == ["n2", "n3"]
    for node in ("n2", "n3"):
        theirs = ckptstore.read_manifest(gen_dir(cluster, node, job, gen["gen"]))
        assert ckptstore.read_manifest(flushed / node) == theirs
        assert ckptstore.verify(flushed / node) == []
        for path in [flushed / node, *(flushed / node / name for name in theirs.files)]:
            info = path.lstat()
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o700 if path.is_dir() else 0o600), path
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, TERMINAL)

    # Both nodes lost with their disks: partner redundancy cannot bring them back, the flush can.
    for node in ("n2", "n3"):
        os.kill(cluster.daemon_pid(node), signal.SIGKILL)
        shutil.rmtree(gen_dir(cluster, node, job, gen["gen"]).parent)
    for node in ("n2", "n3"):
        _wait_node(cluster, node, "down")
    answer = cluster.gang_json("restart", job, timeout=120)
    assert set(answer["placement"]) == {"n1", "n4"} and answer["gen"] == gen["gen"], answer
    assert result_of(cluster, answer["record"]["id"], timeout=120) == expected
    for node in ("n1", "n4"):
        directory = gen_dir(cluster, node, job, gen["gen"])
        assert ckptstore.verify(directory) == []
        ranks = [r for r, n in enumerate(answer["placement"]) if n == node]
        assert ckptstore.read_manifest(directory).ranks == ranks


def test_a_flushed_file_damaged_on_the_shared_file_system_is_refused_naming_it(make_cluster, tmp_path):
    shared = tmp_path / "shared"
    cluster = make_cluster(3, cores=2, time_slice=0.1, lease_ttl=5, flush_dir=shared)
    job = submit(cluster, [*ARGV, "--sleep", "0.01"], 2, "-w", "n2", "--ckpt-redundancy", "local")
    wait_running_a_bit(cluster, job)
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    wait_for(lambda: _entry(cluster, job, gen["gen"]).get("flushed"), 60, "the flush")
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, TERMINAL)
    state = shared / f"job-{job}" / f"gen-{gen['gen']}" / "n2" / ckptstore.cluster_rank_file(1)
    with open(state, "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.kill(cluster.daemon_pid("n2"), signal.SIGKILL)
    shutil.rmtree(gen_dir(cluster, "n2", job, gen["gen"]).parent)
    _wait_node(cluster, "n2", "down")
    refused = cluster.gang("restart", job, timeout=120)
    assert refused.returncode != 0, refused.stdout
    assert "rank-1.state does not match its flushed MANIFEST" in refused.stderr, refused.stderr
    # Nothing restored is listed where the restart would have run.
    for node in ("n1", "n3"):
        directory = gen_dir(cluster, node, job, gen["gen"])
        assert not (directory / ckptstore.MANIFEST).exists() or ckptstore.verify(directory) == []


# ---------------------------------------------------------------- the edges, without a cluster


def test_flush_requests_from_a_peer_are_checked():
    ok = FlushRequest.from_args({"lineage": 3, "gen": 2, "rate": 0, "timeout": 60})
    assert (ok.lineage, ok.gen, ok.rate) == (3, 2, 0)
    for bad in ({"lineage": "3", "gen": 2, "timeout": 60}, {"lineage": 3, "gen": 0, "timeout": 60}, {"lineage": 3, "gen": 2, "rate": -1, "timeout": 60},
                {"lineage": 3, "gen": 2, "timeout": 0}, {"lineage": 3, "gen": 2, "timeout": True}):
        with pytest.raises(RemoteError) as info:
            FlushRequest.from_args(bad)
        assert info.value.code == "bad_request"
    nodes = ["n1", "n2"]
    base = {"lineage": 3, "gen": 2, "owner": [1000, 1000], "timeout": 60}
    assert UnflushRequest.from_args({**base, "pulls": {"n1": [0, 1]}}, nodes).pulls == {"n1": (0, 1)}
    for pulls in ({"../n1": [0]}, {"n9": [0]}, {"n1": [0], "n2": [0]}, {"n1": []}, {"n1": [-1]}, {}, [("n1", [0])]):
        with pytest.raises(RemoteError):
            UnflushRequest.from_args({**base, "pulls": pulls}, nodes)


def test_the_throttle_keeps_to_its_rate_and_stops_when_told():
    stop = threading.Event()
    throttle = Throttle(10 << 20, stop)
    started = time.monotonic()
    for _ in range(5):
        throttle.spend(1 << 20)
    assert time.monotonic() - started >= 0.4  # 5 MiB at 10 MiB/s (a lower bound: the rate is a ceiling)
    slow = Throttle(1, stop)
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(Cancelled):
        slow.spend(1 << 20)  # would wait 12 days


def test_flush_settings_are_checked(tmp_path):
    base = '[node]\nname = "n1"\n[[nodes]]\nname = "n1"\naddress = "127.0.0.1"\nport = 7450\ncores = 2\n[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n'
    path = tmp_path / "gangd.toml"
    path.write_text(base + '[checkpoint]\nflush_dir = "/srv/shared"\nflush_every = 5\nflush_mib_per_s = 100\n')
    config = cfg.load(path)
    assert (config.checkpoint_flush_dir, config.checkpoint_flush_every, config.checkpoint_flush_mib_per_s) == (Path("/srv/shared"), 5, 100)
    assert cfg.load(_write(tmp_path, cfg.render(config))) == config
    for section, message in (('flush_dir = "shared"', "flush_dir must be an absolute path"), ("flush_every = 0", "flush_every must be"),
                             ('flush_mib_per_s = "fast"', "flush_mib_per_s must be")):
        path.write_text(base + "[checkpoint]\n" + section + "\n")
        with pytest.raises(cfg.ConfigError, match=message):
            cfg.load(path)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rendered.toml"
    path.write_text(text)
    return path
