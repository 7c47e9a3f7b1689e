"""A restart from a *protected* generation rebuilds a lost node's files (issue 16).

When a node of a checkpoint is gone with its disk, the ranks it held have
no file anywhere but in the generation's redundancy: its ring partner's
copy (``partner``) or its XOR set's parity (``xor``). ``gang restart`` (and
the coordinator's :meth:`Restarts.recover`) then rebuilds the
lost node's files on the node that replaces it (``ckpt_rebuild``) and
restarts there. What a user relies on, with real daemons on a 4-node
cluster, a daemon SIGKILLed and its checkpoint directory deleted: the job
comes back on live nodes and ends bit-identical to an uninterrupted run,
the rebuilt files laid out as a checkpoint lays them out; a loss the
redundancy cannot cover (two nodes of one XOR set) is refused naming them;
a damaged parity is refused naming the file, with nothing left listed.
The rules (which node rebuilds what) are pure and checked with hypothesis;
the op's argument checks without a cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from ckpthelpers import TERMINAL, checkpoint, flip_byte, gen_dir, generations, hold, kill_what_is_left, reference, result_of, settled, submit, wait_holding
from hypothesis import given
from hypothesis import strategies as st
from test_control_plane import coordinator_seen_by
from test_restart_anywhere import restart, wait_node

from gangd import ckptstore
from gangd.checkpoint import relocate
from gangd.daemon.rebuild import RebuildRequest
from gangd.redundancy.plan import make_plan
from gangd.rpc import RemoteError

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "300", "--mb", "0.5"]
NRANKS = 6  # two per node of a 3-node job


@pytest.fixture
def gc(restart_gc):
    """The module's cluster (conftest's ``restart_cluster``), with no job and every node up after each test."""
    return restart_gc


# ---------------------------------------------------------------- the rules, pure

NAMES = [f"n{i}" for i in range(1, 9)]


@given(st.integers(2, 6), st.sampled_from(["partner", "xor"]), st.integers(1, 3), st.data())
def test_each_lost_node_is_rebuilt_once_on_the_new_node_of_its_first_rank_or_the_plan_says_why_not(count, level, per_node, data):
    job_nodes = NAMES[:count]
    placement = [n for n in job_nodes for _ in range(per_node)]
    plan = make_plan(job_nodes, level, data.draw(st.integers(2, 4)))
    cluster = NAMES[: data.draw(st.integers(count, 8))]
    down = data.draw(st.lists(st.sampled_from(job_nodes), min_size=1, unique=True))
    up = [n for n in cluster if n not in down]
    if not up:
        return
    new = data.draw(st.lists(st.sampled_from(up), min_size=len(placement), max_size=len(placement)))
    copies = data.draw(st.dictionaries(st.sampled_from(up), st.lists(st.integers(0, len(placement) - 1), unique=True), max_size=2))
    missing = relocate.plan_sources(new, placement, copies, up).missing
    if not missing:
        return
    needed = {placement[r] for r in missing}
    recovery = plan.recovery(down)
    rebuildable = {r.node for r in recovery.rebuilds}
    try:
        steps = relocate.plan_rebuilds(new, placement, missing, plan, up)
    except relocate.CannotRebuild as exc:
        assert not needed <= rebuildable
        for node in needed - rebuildable:
            assert f"node {node}'s checkpoint files cannot be rebuilt" in str(exc)
        return
    assert needed <= rebuildable
    assert [s.lost for s in steps] == sorted(needed, key=placement.index)
    for step in steps:
        assert step.target in up and step.target == new[min(r for r in missing if placement[r] == step.lost)]
        assert step.ranks == tuple(r for r, n in enumerate(placement) if n == step.lost)
        assert all(source in up for source in step.sources)
        if step.method == "partner":
            assert step.sources == (plan.partner_of(step.lost),)
        else:
            assert set(step.sources) == set(plan.set_of(step.lost)) - {step.lost}
    # Once the rebuilt files count as copies, nothing is missing any more.
    for step in steps:
        copies = relocate.with_copies(copies, step.target, step.ranks)
    assert relocate.plan_sources(new, placement, copies, up).missing == {}


NODES = ["n1", "n2", "n3", "n4"]
GOOD = {"lineage": 3, "gen": 2, "owner": [0, 0], "lost": "n2", "method": "xor", "sources": ["n1", "n3"], "timeout": 30}


@pytest.mark.parametrize(("change", "words"), [
    ({"lineage": 0}, "lineage must be"),
    ({"gen": "2"}, "gen must be"),
    ({"owner": [0]}, "'owner' must be"),
    ({"owner": [-1, 0]}, "the owner's uid"),
    ({"lost": "n9"}, "'lost' must name a node"),
    ({"lost": "../n1"}, "'lost' must name a node"),
    ({"method": "local"}, "'method' must be"),
    ({"sources": []}, "'sources' must list"),
    ({"sources": ["n1", "n1"]}, "'sources' must list"),
    ({"sources": ["n1", "n7"]}, "'sources' must list"),
    ({"sources": "n1"}, "'sources' must list"),
    ({"sources": ["n1", "n2"]}, "cannot be a source of its own rebuild"),
    ({"method": "partner"}, "a partner rebuild has one source"),
    ({"timeout": 0}, "'timeout' must be"),
    ({"timeout": True}, "'timeout' must be"),
])
def test_a_rebuild_request_from_a_peer_is_checked_before_anything_is_done(change, words):
    with pytest.raises(RemoteError) as refused:
        RebuildRequest.from_args({**GOOD, **change}, NODES, "n4")
    assert refused.value.code == "bad_request" and words in refused.value.message, refused.value.message
    ok = RebuildRequest.from_args({**GOOD, "timeout": 1e9}, NODES, "n4")
    assert (ok.lost, ok.method, ok.sources, ok.owner) == ("n2", "xor", ("n1", "n3"), (0, 0)) and ok.timeout <= 3600
    assert RebuildRequest.from_args({**GOOD, "method": "partner", "sources": ["n4"]}, NODES, "n4").sources == ("n4",)


# ---------------------------------------------------------------- real daemons


def job_nodes_and_victims(gc, count: int) -> tuple[list[str], list[str]]:
    """The 3 nodes of the job (n1-n3) and ``count`` of them to lose, never the coordinator (its loss is a takeover, tested elsewhere)."""
    leader = coordinator_seen_by(gc, "n1")
    nodes = ["n1", "n2", "n3"]
    return nodes, [n for n in reversed(nodes) if n != leader][:count]


def protected_and_killed(gc, level: str) -> tuple[int, dict]:
    """A 6-rank job on n1-n3 with a generation written at ``level`` (protected,
    or complete for ``local``), then killed: (its id, the generation)."""
    held, release = hold(gc, 150)  # (mid-run at the checkpoint however loaded the machine; a restart runs at full speed)
    job = submit(gc, [*ARGV, *held], NRANKS, "-w", "n1,n2,n3", "--ckpt-redundancy", level)
    wait_holding(gc, job)
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    entry = next(g for g in settled(gc, job) if g["gen"] == gen["gen"])
    assert entry["state"] == ("protected" if level != "local" else "complete") and entry["level"] == level, entry
    gc.gang("kill", job, check=True)
    gc.wait_state(job, TERMINAL)
    release.touch()
    return job, entry


def lose(gc, node: str) -> None:
    """The node's daemon SIGKILLed and its disk gone: its checkpoint directory
    deleted; then its lease ended, as its expiry would a TTL later."""
    os.kill(gc.daemon_pid(node), signal.SIGKILL)
    shutil.rmtree(gc.dir / node / "state" / "checkpoints" / node)
    gc.end_lease(node)
    wait_node(gc, node, "down")


def assert_laid_out_as_a_checkpoint(directory: Path, node: str, ranks: list[int], iteration: int) -> None:
    assert ckptstore.verify(directory) == []
    manifest = ckptstore.read_manifest(directory)
    assert manifest.node == node and manifest.ranks == ranks and manifest.iteration == iteration
    assert {ckptstore.cluster_rank_file(r) for r in ranks} | {"job.msgpack"} <= set(manifest.files)
    for name in manifest.files:
        info = (directory / name).lstat()
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, (name, oct(info.st_mode))
        assert info.st_uid == os.geteuid(), (name, info.st_uid)  # (the job's owner for ranks/: ranks run as root here)
    ranks_dir = (directory / ckptstore.RANKS_DIR).lstat()
    assert ranks_dir.st_uid == os.geteuid() and stat.S_IMODE(ranks_dir.st_mode) == 0o700
    assert stat.S_IMODE(directory.lstat().st_mode) == 0o711 and directory.lstat().st_uid == 0
    leftovers = os.listdir(directory / "redundancy") if (directory / "redundancy").exists() else []
    assert not [n for n in leftovers if "rebuilt" in n], leftovers


@pytest.mark.parametrize("level", ["partner", "xor"])
def test_a_lost_node_with_its_disk_is_rebuilt_on_a_live_node_and_the_restart_is_bit_identical(gc, level):
    expected = reference(gc, ARGV, NRANKS)
    job, entry = protected_and_killed(gc, level)
    nodes, (victim,) = job_nodes_and_victims(gc, 1)
    if level == "xor":
        # A survivor's MANIFEST listing more since its parity was computed
        # (as after a restart staged files there): its data for the rebuild is still what its parity covers.
        survivor = gen_dir(gc, next(n for n in nodes if n != victim), job, entry["gen"])
        (survivor / "extra.bin").write_bytes(os.urandom(5000))
        manifest = ckptstore.read_manifest(survivor)
        manifest.files["extra.bin"] = list(ckptstore.checksum_file(survivor / "extra.bin"))
        ckptstore.write_manifest(survivor, manifest)
    lose(gc, victim)
    answer = restart(gc, job)
    lost_ranks = [r for r, n in enumerate(entry["placement"]) if n == victim]
    # The survivors keep their ranks; the lost node's go to the one node outside the job, which rebuilt its files.
    assert answer["gen"] == entry["gen"] and answer["rebuilt"] == {victim: "n4"}, answer
    assert answer["placement"] == ["n4" if n == victim else n for n in entry["placement"]], answer
    assert result_of(gc, answer["record"]["id"], timeout=180) == expected
    assert_laid_out_as_a_checkpoint(gen_dir(gc, "n4", job, entry["gen"]), "n4", lost_ranks, entry["iteration"])
    recorded = next(g for g in generations(gc, job) if g["gen"] == entry["gen"])
    assert recorded["copies"].get("n4") == lost_ranks, recorded
    for node in nodes:
        if node != victim:
            assert ckptstore.verify(gen_dir(gc, node, job, entry["gen"])) == []


def test_two_lost_nodes_of_one_xor_set_are_refused_naming_them(gc):
    job, entry = protected_and_killed(gc, "xor")
    _, victims = job_nodes_and_victims(gc, 2)
    for victim in victims:
        lose(gc, victim)
    refused = restart(gc, job, check=False)
    assert refused["returncode"] != 0, refused
    a, b = sorted(victims)
    assert f"node {a}'s checkpoint files cannot be rebuilt: {b} of its XOR set" in refused["stderr"], refused["stderr"]
    assert f"node {b}'s checkpoint files cannot be rebuilt: {a} of its XOR set" in refused["stderr"], refused["stderr"]
    assert f"generation {entry['gen']}" in refused["stderr"]
    assert not (gen_dir(gc, "n4", job, entry["gen"]) / ckptstore.MANIFEST).exists()  # (nothing was tried)


def test_a_damaged_parity_is_refused_naming_the_file_and_nothing_is_left_listed(gc):
    job, entry = protected_and_killed(gc, "xor")
    nodes, (victim,) = job_nodes_and_victims(gc, 1)
    holder = next(n for n in nodes if n != victim)
    parity = gen_dir(gc, holder, job, entry["gen"]) / "redundancy" / "xor.parity"
    flip_byte(parity, 1000)
    lose(gc, victim)
    refused = restart(gc, job, check=False)
    assert refused["returncode"] != 0, refused
    assert "n4" in refused["stderr"] and victim in refused["stderr"], refused["stderr"]
    assert "redundancy/xor.parity" in refused["stderr"] and f"node {holder}" in refused["stderr"], refused["stderr"]
    assert "does not match" in refused["stderr"] and refused["stderr"].count("job-") <= 3, refused["stderr"]
    target = gen_dir(gc, "n4", job, entry["gen"])
    listed = set(ckptstore.read_manifest(target).files) if (target / ckptstore.MANIFEST).exists() else set()
    lost_ranks = [r for r, n in enumerate(entry["placement"]) if n == victim]
    assert not listed & {ckptstore.cluster_rank_file(r) for r in lost_ranks}, listed
    if (target / ckptstore.RANKS_DIR).exists():
        assert os.listdir(target / ckptstore.RANKS_DIR) == []
    if (target / "redundancy").exists():
        assert os.listdir(target / "redundancy") == []
    recorded = next(g for g in generations(gc, job) if g["gen"] == entry["gen"])
    assert "n4" not in (recorded.get("copies") or {}), recorded
    # Recorded in etcd: no longer protected, saying why (its files on live nodes stay usable);
    # the next restart does not try the damaged parity again: it names the lost files.
    assert recorded["state"] == "complete", recorded
    assert recorded["redundancy"].startswith("damaged: ") and "redundancy/xor.parity" in recorded["redundancy"], recorded
    again = restart(gc, job, check=False)
    assert again["returncode"] != 0 and "xor.parity" not in again["stderr"], again["stderr"]
    assert f"only on node {victim}, which is down" in again["stderr"], again["stderr"]


def test_restarted_with_w_on_the_partner_of_the_lost_node_its_files_come_from_the_copy_there(gc):
    """The node that takes the lost node's ranks holds its partner copy: the files are copied on its own disk, checked as they are."""
    expected = reference(gc, ARGV, 2)
    leader = coordinator_seen_by(gc, "n1")
    victim, holder = ("n3", "n2") if leader == "n2" else ("n2", "n1")  # (a ring of two: each holds the other's copy)
    held, release = hold(gc, 150)
    job = submit(gc, [*ARGV, *held], 2, "-w", f"{holder},{victim}", "--ckpt-redundancy", "partner")
    wait_holding(gc, job)
    gen = checkpoint(gc, job)
    entry = next(g for g in settled(gc, job) if g["gen"] == gen["gen"])
    assert entry["state"] == "protected" and entry["level"] == "partner", entry
    gc.gang("kill", job, check=True)
    gc.wait_state(job, TERMINAL)
    release.touch()
    lose(gc, victim)
    answer = restart(gc, job, "-w", holder)
    assert answer["placement"] == [holder, holder] and answer["rebuilt"] == {victim: holder}, answer
    assert result_of(gc, answer["record"]["id"], timeout=180) == expected
    assert_laid_out_as_a_checkpoint(gen_dir(gc, holder, job, entry["gen"]), holder, [0, 1], entry["iteration"])
    # Its partner copy stays as it was.
    assert ckptstore.verify(gen_dir(gc, holder, job, entry["gen"]) / "redundancy" / f"partner-{victim}") == []


def test_a_node_lost_during_a_redundancy_write_restarts_from_the_previous_protected_generation(make_cluster, points):
    cluster = make_cluster(4, cores=2, time_slice=0.1)
    try:
        expected = reference(cluster, ARGV, NRANKS)
        held, release = hold(cluster, 150)
        job = submit(cluster, [*ARGV, *held], NRANKS, "-w", "n1,n2,n3", "--ckpt-redundancy", "xor")
        wait_holding(cluster, job)
        first = checkpoint(cluster, job)
        g1 = next(g for g in settled(cluster, job) if g["gen"] == first["gen"])
        assert g1["state"] == "protected", g1
        (points / "protect.hold").touch()  # generation 2's redundancy write waits: it is lost with the node
        second = checkpoint(cluster, job)
        assert second["state"] == "complete" and second["iteration"] > g1["iteration"], second
        cluster.gang("kill", job, check=True)
        cluster.wait_state(job, TERMINAL)
        release.touch()
        _, (victim,) = job_nodes_and_victims(cluster, 1)
        lose(cluster, victim)
        answer = restart(cluster, job)
        assert answer["gen"] == g1["gen"] and answer["rebuilt"] == {victim: "n4"}, answer
        assert any(s.startswith(f"generation {second['gen']}: ") and victim in s for s in answer["skipped"]), answer["skipped"]
        assert result_of(cluster, answer["record"]["id"], timeout=180) == expected
    finally:
        (points / "protect.hold").unlink(missing_ok=True)
        kill_what_is_left(cluster)


def test_a_node_rebuilds_its_own_files_only_while_it_holds_no_manifest_of_them(tmp_path):
    """A node back with a wiped disk may take its own files back (ckpt_rebuild with lost = itself);
    one that still lists them must not have them rewritten under it."""
    import trio

    from gangd.daemon.rebuild import Rebuilder

    root = tmp_path / "ckpt"
    root.mkdir(mode=0o711)
    directory = ckptstore.gen_dir(root, 3, 2)
    (directory / ckptstore.RANKS_DIR).mkdir(parents=True, mode=0o700)
    for path in (directory.parent, directory):
        path.chmod(0o711)
    files = {"job.msgpack": list(ckptstore.write_atomic(directory / "job.msgpack", [b"job"]))}
    ckptstore.write_manifest(directory, ckptstore.Manifest(3, 2, "n2", 5, files, [0], time.time()))
    request = RebuildRequest.from_args({**GOOD, "lost": "n2", "method": "partner", "sources": ["n1"]}, NODES, "n2")
    rebuilder = Rebuilder(node="n2", root=root, channel=None, reserve=0, max_file=1 << 30)
    with pytest.raises(RemoteError) as refused:
        trio.run(rebuilder.rebuild, request)
    assert refused.value.code == "bad_request" and "still holds its manifest" in refused.value.message, refused.value.message
    assert ckptstore.verify(directory) == []
