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
from ckpthelpers import TERMINAL, USABLE, checkpoint, flip_byte, gen_dir, generations, hold, reference, result_of, submit, wait_holding, wait_running_a_bit
from conftest import as_uid, wait_for

from gangd import ckptstore
from gangd.daemon import config as cfg
from gangd.daemon.flush import Cancelled, Flusher, FlushRequest, Throttle, UnflushRequest
from gangd.rpc import RemoteError

JOB = str(Path(__file__).resolve().parent / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "250", "--mb", "0.5"]


def _entry(cluster, job: int, gen: int) -> dict:
    return next(g for g in generations(cluster, job) if g["gen"] == gen)


def _wait_node(cluster, node: str, state: str) -> None:
    wait_for(lambda: cluster.node_states().get(node) == state, 60, f"{node} {state}")


def test_with_both_nodes_of_a_partner_pair_lost_the_restart_takes_the_flushed_generation(make_cluster, tmp_path):
    shared = tmp_path / "shared"
    cluster = make_cluster(4, cores=2, time_slice=0.1, lease_ttl=5, flush_dir=shared)
    expected = reference(cluster, ARGV, 4)
    held, release = hold(cluster, 125)  # (mid-run at the checkpoint however loaded the machine; the restart runs at full speed)
    job = submit(cluster, [*ARGV, *held], 4, "-w", "n2,n3", "--ckpt-redundancy", "partner")
    wait_holding(cluster, job)
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
        cluster.end_lease(node)  # (as its expiry would, a lease TTL later)
        _wait_node(cluster, node, "down")
    release.touch()
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
    held, _release = hold(cluster, 125)  # (never released: the test kills it)
    job = submit(cluster, [*ARGV, *held], 2, "-w", "n2", "--ckpt-redundancy", "local")
    wait_holding(cluster, job)
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    wait_for(lambda: _entry(cluster, job, gen["gen"]).get("flushed"), 60, "the flush")
    cluster.gang("kill", job, check=True)
    cluster.wait_state(job, TERMINAL)
    state = shared / f"job-{job}" / f"gen-{gen['gen']}" / "n2" / ckptstore.cluster_rank_file(1)
    flip_byte(state, 100)
    os.kill(cluster.daemon_pid("n2"), signal.SIGKILL)
    shutil.rmtree(gen_dir(cluster, "n2", job, gen["gen"]).parent)
    cluster.end_lease("n2")  # (as its expiry would, a lease TTL later)
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
        cluster.end_lease(node)  # (their old leases, ended rather than waited out)
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
    taken = [checkpoint(cluster, job) for _ in range(3)]
    assert [g["state"] for g in taken] == ["complete"] * 3, taken
    first = taken[0]["gen"]  # (1, unless a request came before the ranks' ckpt.init(): a refused one uses its number)

    def flush_of_first_over() -> bool:
        logs = cluster.log("n1") + cluster.log("n2")
        return f"job {job}: checkpoint {first} was not flushed" in logs or f"job {job}: checkpoint {first} flushed to" in logs

    wait_for(flush_of_first_over, 120, f"the flush of generation {first} to end")
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
    held, release = hold(cluster, 200)  # (the job holds mid-run until the nodes are lost, then runs at full speed)
    job = submit(cluster, [*argv, *held], 3, "--per-node", "1", "--ckpt-redundancy", "xor")
    wait_holding(cluster, job)
    for _ in range(3):
        assert checkpoint(cluster, job)["state"] == "complete"
    wait_for(lambda: _entry(cluster, job, 2).get("flushed") and _entry(cluster, job, 3)["state"] == "protected", 60,
             "generation 2 flushed and generation 3 protected")
    assert not _entry(cluster, job, 3).get("flushed")
    lead = next(r["name"] for r in cluster.gang_json("nodes")["nodes"] if r["coordinator"])
    victims = [n for n in dict.fromkeys(cluster.job(job)["placement"]) if n != lead][:2]
    lose(cluster, *victims)
    release.touch()
    old = cluster.wait_state(job, ENDED, timeout=180)
    assert old["state"] == "REQUEUED", old
    again = cluster.job(old["requeued_as"])
    assert again["restart_of"]["gen"] == 2, again["restart_of"]  # (generation 3's XOR set lost two members: not rebuildable)
    assert result_of(cluster, again["id"], timeout=180) == expected
    logs = "".join(cluster.log(n) for n in cluster.files if n not in victims)
    assert "generation 3 cannot be rebuilt" in logs and f"ranks {sorted(r for r, n in enumerate(old['placement']) if n in victims)}" in logs


# ---------------------------------------------------------------- the flush directory checked at start-up


def _traversable_tmp() -> Path:
    """A directory under /tmp every uid may traverse (the second uid's files are made there)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="gangd-flush-", dir="/tmp"))
    base.chmod(0o755)
    return base


@pytest.fixture
def base():
    path = _traversable_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("make", "words"), [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("x"), "is not a directory"),
    (lambda p: (p.mkdir(), p.chmod(0o777)), "writable by other users"),
    (lambda p: (p.mkdir(), p.chmod(0o1777)), "writable by other users"),  # (sticky: users could still take job-L names first)
    (lambda p: (p.mkdir(), p.chmod(0o770)), "writable by its group"),
    (lambda p: (p.mkdir(mode=0o700), os.chown(p, 65534, 65534)), "belongs to uid 65534"),
    (lambda p: ((p.parent / "real").mkdir(mode=0o700), p.symlink_to(p.parent / "real")), "symbolic link"),
])
def test_an_unsafe_flush_dir_is_named_at_start_up_with_the_reason(base, make, words, caplog):
    flush_dir = base / "shared"
    make(flush_dir)
    flusher = Flusher(node="n1", root=base, flush_dir=flush_dir, max_file=1 << 30)
    problem = flusher.check()
    assert words in problem and str(flush_dir) in problem, problem
    with caplog.at_level("ERROR", logger="gangd.flush"):
        trio.run(flusher.check_at_start)
    assert "[checkpoint] flush_dir cannot be used" in caplog.text and words in caplog.text, caplog.text
    assert not flush_dir.exists() or flush_dir.is_symlink() or not flush_dir.is_dir() or not os.listdir(flush_dir)  # (nothing created)


def test_a_safe_flush_dir_passes_the_start_up_check_and_the_probe_leaves_nothing(base):
    flush_dir = base / "shared"
    flush_dir.mkdir(mode=0o700)
    flusher = Flusher(node="n1", root=base, flush_dir=flush_dir, max_file=1 << 30)
    assert flusher.check() == ""
    assert os.listdir(flush_dir) == []


def test_a_daemon_with_an_unsafe_flush_dir_says_so_in_its_log_and_serves_on(make_cluster, tmp_path):
    shared = tmp_path / "shared"
    cluster = make_cluster(2, cores=2, flush_dir=shared)
    shared.chmod(0o777)
    os.kill(cluster.daemon_pid("n2"), signal.SIGKILL)
    cluster.start_daemon("n2")
    wait_for(lambda: "[checkpoint] flush_dir cannot be used" in cluster.log("n2"), 60, "the start-up check's sentence")
    log = cluster.log("n2")
    assert f"{shared} is writable by other users" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    _wait_node(cluster, "n2", "up")


# ---------------------------------------------------------------- hostile flushed files: a second uid, links


def _flushed(base: Path, node: str = "n2") -> tuple[Path, Path, bytes]:
    """A real generation of ``node`` (rank 0) flushed by its Flusher: (flush_dir, the node's flushed directory, the state's bytes)."""
    root, shared = base / f"ckpt-{node}", base / "shared"
    root.mkdir(mode=0o711)
    shared.mkdir(mode=0o700)
    directory = ckptstore.gen_dir(root, 5, 2)
    (directory / ckptstore.RANKS_DIR).mkdir(parents=True, mode=0o700)
    for path in (directory.parent, directory):
        path.chmod(0o711)
    data = os.urandom(70000)
    files = {
        ckptstore.cluster_rank_file(0): list(ckptstore.write_atomic(directory / ckptstore.cluster_rank_file(0), [data])),
        "job.msgpack": list(ckptstore.write_atomic(directory / "job.msgpack", [b"job"])),
    }
    ckptstore.write_manifest(directory, ckptstore.Manifest(5, 2, node, 9, files, [0], time.time()))
    flusher = Flusher(node=node, root=root, flush_dir=shared, max_file=1 << 30)
    trio.run(flusher.flush, FlushRequest(lineage=5, gen=2, rate=0, timeout=60))
    return shared, shared / "job-5" / "gen-2" / node, data


def _unflush(base: Path, shared: Path) -> dict:
    """Node n1 restores rank 0 from n2's flushed copy: its answer, or the refusal's message."""
    from gangd.daemon.staging import TargetGeneration

    root = base / "ckpt-n1"
    root.mkdir(mode=0o711, exist_ok=True)
    flusher = Flusher(node="n1", root=root, flush_dir=shared, max_file=1 << 30)
    request = UnflushRequest(lineage=5, gen=2, owner=(0, 0), pulls={"n2": (0,)}, timeout=60)
    try:
        return trio.run(flusher.unflush, request, TargetGeneration(root, 0))
    except RemoteError as exc:
        listed = ckptstore.gen_dir(root, 5, 2) / ckptstore.MANIFEST
        return {"refused": exc.message, "listed": listed.exists() and ckptstore.cluster_rank_file(0) in ckptstore.read_manifest(listed.parent).files}


def _planted_by_nobody(base: Path, data: bytes) -> Path:
    """A file with ``data`` written by the second uid (nobody) itself, in a directory it may write."""
    drop = base / "drop"
    drop.mkdir(exist_ok=True)
    drop.chmod(0o777)
    target = drop / "planted"

    def plant():
        target.write_bytes(data)
        return {"uid": os.getuid()}

    assert as_uid(65534, plant) == {"uid": 65534}
    assert target.stat().st_uid == 65534
    return target


def test_an_intact_flushed_copy_is_restored(base):
    shared, _, data = _flushed(base)
    answer = _unflush(base, shared)
    assert "refused" not in answer, answer
    assert (ckptstore.gen_dir(base / "ckpt-n1", 5, 2) / ckptstore.cluster_rank_file(0)).read_bytes() == data


def test_a_flushed_state_file_replaced_by_another_uid_is_refused_even_with_the_right_bytes(base):
    shared, node_dir, data = _flushed(base)
    planted = _planted_by_nobody(base, data)  # (the right bytes: only the owner tells it is not the daemon's)
    os.rename(planted, node_dir / ckptstore.cluster_rank_file(0))
    answer = _unflush(base, shared)
    assert "belongs to uid 65534" in answer.get("refused", ""), answer
    assert "rank-0.state" in answer["refused"] and not answer["listed"], answer


def test_a_flushed_ranks_directory_another_uid_can_write_is_refused(base):
    """The second uid owns the flushed ranks/ directory and replaces the state file in it itself."""
    shared, node_dir, data = _flushed(base)
    for path in (shared, shared / "job-5", shared / "job-5" / "gen-2", node_dir):
        path.chmod(0o711)  # (traversable: the second uid reaches ranks/)
    ranks = node_dir / ckptstore.RANKS_DIR
    os.chown(ranks, 65534, 65534)
    state = ranks / "rank-0.state"

    def replace():
        state.unlink()
        state.write_bytes(data)
        return {"uid": state.stat().st_uid}

    assert as_uid(65534, replace) == {"uid": 65534}
    answer = _unflush(base, shared)
    assert "refused" in answer and "65534" in answer["refused"] and "ranks" in answer["refused"], answer
    assert not answer["listed"], answer


def test_a_flushed_manifest_replaced_by_another_uid_is_refused(base):
    shared, node_dir, _ = _flushed(base)
    planted = _planted_by_nobody(base, (node_dir / ckptstore.MANIFEST).read_bytes())
    os.rename(planted, node_dir / ckptstore.MANIFEST)
    answer = _unflush(base, shared)
    assert "MANIFEST belongs to uid 65534" in answer.get("refused", ""), answer


def test_a_flushed_state_file_hard_linked_from_elsewhere_is_refused(base):
    shared, node_dir, data = _flushed(base)
    elsewhere = base / "elsewhere"
    elsewhere.write_bytes(data)
    elsewhere.chmod(0o600)
    state = node_dir / ckptstore.cluster_rank_file(0)
    state.unlink()
    os.link(elsewhere, state)
    answer = _unflush(base, shared)
    assert "has 2 names" in answer.get("refused", ""), answer


@pytest.mark.parametrize("what", ["state", "node", "ranks"])
def test_a_symlink_planted_in_the_flush_directory_is_never_followed(base, what):
    shared, node_dir, _ = _flushed(base)
    copy = base / "copy"
    shutil.copytree(node_dir, copy)  # (the same bytes: only the link tells)
    if what == "state":
        victim = node_dir / ckptstore.cluster_rank_file(0)
        victim.unlink()
        victim.symlink_to(copy / ckptstore.cluster_rank_file(0))
    elif what == "ranks":
        shutil.rmtree(node_dir / ckptstore.RANKS_DIR)
        (node_dir / ckptstore.RANKS_DIR).symlink_to(copy / ckptstore.RANKS_DIR)
    else:
        shutil.rmtree(node_dir)
        node_dir.symlink_to(copy)
    answer = _unflush(base, shared)
    assert "symbolic link" in answer.get("refused", ""), answer
    assert not answer["listed"], answer


# ---------------------------------------------------------------- orphans of a coordinator change are swept


def test_a_sweep_removes_only_the_lineages_unrecorded_generations_never_through_a_link(base):
    from gangd.daemon.flush import keep_of

    shared = base / "shared"
    shared.mkdir(mode=0o700)
    job = shared / "job-5"
    for name in ("gen-1/n1", "gen-2/n1.part/ranks", "gen-3/n2", "gen-4/n1"):
        (job / name).mkdir(parents=True, mode=0o700)
    (job / "gen-2" / "n1.part" / "ranks" / "rank-0.state").write_bytes(b"half")
    outside = base / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (job / "gen-9").symlink_to(outside)  # (a link is removed, never followed)
    (job / "notes").write_text("not the daemon's name: left alone")
    flusher = Flusher(node="n1", root=base, flush_dir=shared, max_file=1 << 30)
    swept = trio.run(flusher.sweep, 5, keep_of({"keep": [1, 3]}))
    assert swept == [2, 4, 9]
    assert sorted(os.listdir(job)) == ["gen-1", "gen-3", "notes"]
    assert (outside / "precious").read_text() == "x"
    assert trio.run(flusher.sweep, 6, frozenset()) == []  # (no such lineage: nothing to do)
    for bad in ({"keep": "1"}, {"keep": [0]}, {"keep": [True]}, {"keep": list(range(1, 5000))}, {}):
        with pytest.raises(RemoteError):
            keep_of(bad)


def test_a_copy_a_coordinator_change_left_half_written_is_swept_by_the_lineages_next_flush(make_cluster, tmp_path):
    """A flush of generation G cut short when its coordinator stepped down
    leaves ``job-L/gen-G/<node>.part`` that nothing records; the new
    coordinator flushes another generation, so before, retention never
    removed it: root's bytes on the shared file system, forever."""
    shared = tmp_path / "shared"
    cluster = make_cluster(2, cores=2, time_slice=0.1, flush_dir=shared)
    job = submit(cluster, [*ARGV, "--sleep", "0.01"], 2, "-w", "n1,n2", "--ckpt-redundancy", "local")
    wait_running_a_bit(cluster, job)
    orphan = shared / f"job-{job}" / "gen-40" / "n1.part" / "ranks"  # (as the previous coordinator's flush left it)
    orphan.mkdir(parents=True, mode=0o700)
    (orphan / "rank-0.state").write_bytes(os.urandom(4096))
    gen = checkpoint(cluster, job)
    assert gen["state"] == "complete", gen
    wait_for(lambda: _entry(cluster, job, gen["gen"]).get("flushed"), 60, "the flush")
    wait_for(lambda: not (shared / f"job-{job}" / "gen-40").exists(), 30, "the orphan swept")
    assert sorted(os.listdir(shared / f"job-{job}")) == [f"gen-{gen['gen']}"]
    assert "a flush cut short by a coordinator change" in cluster.log("n1") + cluster.log("n2")
    cluster.gang("kill", job, check=True)
