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

import dataclasses
import os
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
import trio
from ckpthelpers import TERMINAL, USABLE, checkpoint, gen_dir, generations, reference, result_of, submit, wait_running_a_bit
from conftest import wait_for

from gangd import ckptstore
from gangd.daemon import config as cfg
from gangd.daemon.flush import Cancelled, Flusher, FlushRequest, Throttle, UnflushRequest
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


# ---------------------------------------------------------------- the throttle is per node, not per flush


def _generation(root: Path, lineage: int, gen: int, size: int) -> None:
    """A committed generation on a node's disk: one root-owned file of ``size`` bytes and its MANIFEST."""
    directory = ckptstore.gen_dir(root, lineage, gen)
    directory.mkdir(parents=True, mode=0o711)
    size_, checksum = ckptstore.write_atomic(directory / "job.msgpack", [os.urandom(size)])
    manifest = ckptstore.Manifest(lineage, gen, "n1", 1, {"job.msgpack": [size_, checksum]}, [], time.time())
    ckptstore.write_manifest(directory, manifest)


def test_two_flushes_on_one_node_keep_together_to_flush_mib_per_s(tmp_path):
    """README: 'at most flush_mib_per_s per node'. Two generations (or two
    jobs) flushing at once on a node must share the rate, not get it each."""
    root, shared = tmp_path / "ckpt", tmp_path / "shared"
    root.mkdir(mode=0o700)
    shared.mkdir(mode=0o700)
    size, rate = 2 << 20, 1 << 20  # 2 MiB per generation at 1 MiB/s per node
    for gen in (1, 2):
        _generation(root, 1, gen, size)
    flusher = Flusher(node="n1", root=root, flush_dir=shared, max_file=1 << 30)

    async def main() -> float:
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for gen in (1, 2):
                nursery.start_soon(flusher.flush, FlushRequest(lineage=1, gen=gen, rate=rate, timeout=120))
        return time.monotonic() - started

    elapsed = trio.run(main)
    # 4 MiB at 1 MiB/s takes at least ~4 s (a lower bound: the machine can only be slower).
    assert elapsed >= 0.9 * 2 * size / rate, f"4 MiB flushed by one node in {elapsed:.1f} s at a 1 MiB/s limit"


# ---------------------------------------------------------------- retention and a flush under way: nothing left unrecorded


def _restart_all_with(cluster, **changes) -> None:
    for node in cluster.files:
        os.kill(cluster.daemon_pid(node), signal.SIGKILL)
    for node in cluster.files:
        path = cluster.files[node].config
        path.write_text(cfg.render(dataclasses.replace(cfg.load(path), **changes)))
        cluster.start_daemon(node)
    wait_for(lambda: cluster.gang("nodes").returncode == 0 and
             all(n["state"] == "up" for n in cluster.gang_json("nodes")["nodes"]), 60, "the daemons up again")


def test_the_flush_directory_holds_only_generations_recorded_flushed(make_cluster, tmp_path):
    """A throttled flush of generation 1 is still under way when generations 2
    and 3 complete (keep = 2): retention removes generation 1's local files
    under the flush, and the flush's outcome is then never recorded, so
    whatever it left in the flush directory (a whole node copy or a .part) is
    never removed by retention: root-owned bytes on the shared file system,
    outside every user's quota, forever."""
    shared = tmp_path / "shared"
    cluster = make_cluster(2, cores=2, time_slice=0.1, lease_ttl=5, flush_dir=shared)
    _restart_all_with(cluster, checkpoint_flush_mib_per_s=1.0)
    job = submit(cluster, [JOB, "--steps", "1000000", "--mb", "4", "--sleep", "0.01"], 4, "-w", "n1,n2", "--ckpt-redundancy", "local")
    wait_running_a_bit(cluster, job)
    for _ in range(3):
        assert checkpoint(cluster, job)["state"] == "complete"

    def flush_of_gen1_over() -> bool:
        logs = cluster.log("n1") + cluster.log("n2")
        return f"job {job}: checkpoint 1 was not flushed" in logs or f"job {job}: checkpoint 1 flushed to" in logs

    wait_for(flush_of_gen1_over, 120, "the flush of generation 1 to end")
    # The generations completed during that flush waited; the newest of them is flushed next.
    wait_for(lambda: (lambda u: u[-1].get("flushed") or u[-1].get("flush"))([g for g in generations(cluster, job) if g["state"] in USABLE]),
             120, "the newest generation's flush")
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, TERMINAL)
    gens = generations(cluster, job)
    recorded = sorted(f"gen-{g['gen']}" for g in gens if g["state"] in USABLE and g.get("flushed"))
    on_disk = sorted(p.name for p in (shared / f"job-{job}").iterdir())
    assert on_disk == recorded, f"flush directory holds {on_disk}; recorded flushed: {recorded}; generations: " + \
        str([(g["gen"], g["state"], bool(g.get("flushed")), g.get("flush")) for g in gens])


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


def test_a_flushed_generation_is_one_a_recovery_can_start_from_whatever_was_lost():
    from gangd.daemon.recover import usable_generation

    complete = {"gen": 2, "state": "complete", "placement": ["n1", "n2"], "level": "local"}
    assert usable_generation([complete], {"n1", "n2"})[0] is None
    flushed = {**complete, "flushed": {"at": 1.0, "bytes": 10, "seconds": 0.1}}
    assert usable_generation([flushed], {"n1", "n2"}) == (flushed, "")


def test_two_nodes_of_an_xor_set_lost_the_job_comes_back_by_itself_from_an_older_flushed_generation(make_cluster, tmp_path):
    from test_recovery import ENDED, lose

    shared = tmp_path / "shared"
    cluster = make_cluster(4, cores=2, time_slice=0.1, lease_ttl=5, flush_dir=shared, spares=("n4",))
    _restart_all_with(cluster, checkpoint_flush_every=2)  # generation 2 flushed, generation 3 only protected
    argv = [JOB, "--steps", "400", "--mb", "0.25"]
    expected = reference(cluster, argv, 3, "--per-node", "1")
    job = submit(cluster, [*argv, "--sleep", "0.05"], 3, "--per-node", "1", "--ckpt-redundancy", "xor")
    wait_running_a_bit(cluster, job)
    for _ in range(3):
        assert checkpoint(cluster, job)["state"] == "complete"
    wait_for(lambda: _entry(cluster, job, 2).get("flushed") and _entry(cluster, job, 3)["state"] == "protected", 60,
             "generation 2 flushed and generation 3 protected")
    assert not _entry(cluster, job, 3).get("flushed")
    lead = next(r["name"] for r in cluster.gang_json("nodes")["nodes"] if r["coordinator"])
    victims = [n for n in dict.fromkeys(cluster.job(job)["placement"]) if n != lead][:2]
    for node in victims:
        lose(cluster, node)
    old = cluster.wait_state(job, ENDED, timeout=180)
    assert old["state"] == "REQUEUED", old
    again = cluster.job(old["requeued_as"])
    assert again["restart_of"]["gen"] == 2, again["restart_of"]  # (generation 3's XOR set lost two members: not rebuildable)
    assert result_of(cluster, again["id"], timeout=180) == expected
    logs = "".join(cluster.log(n) for n in cluster.files if n not in victims)
    assert "generation 3 cannot be rebuilt" in logs and f"ranks {sorted(r for r, n in enumerate(old['placement']) if n in victims)}" in logs
