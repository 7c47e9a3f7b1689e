"""`gang restart -w/-N`: a job restarted on other nodes than those of its checkpoint (issue 16).

The rules (where a restart runs, where each rank's files come from, and
the recovery planner of a lost node's jobs) are pure and checked with
hypothesis first; then real daemons on a 4-node cluster (2 cores each), real ranks, real files
streamed between the daemons. What a user relies on: a job checkpointed on
two nodes and restarted on two entirely different ones (or packed onto one)
prints exactly what an uninterrupted run prints; the files that moved are
laid out as a checkpoint lays them out (the state files the job owner's,
the rest root's, a MANIFEST listing them); a restart whose checkpoint node
is down runs on live nodes when another node holds a copy of its files, and
is refused naming the node when none does; a damaged source file is refused
naming the node and the path, with nothing half-copied left looking complete.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest
import trio
from ckpthelpers import (
    TERMINAL,
    checkpoint,
    flip_byte,
    gen_dir,
    generations,
    hold,
    reference,
    result_of,
    submit,
    wait_holding,
)
from hypothesis import given
from hypothesis import strategies as st

from gangd import ckptstore
from gangd.checkpoint import recovery, relocate
from gangd.client.api import connect
from gangd.daemon.coordinator import place
from gangd.redundancy.plan import make_plan
from gangd.rpc import RemoteError

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "250", "--mb", "0.5"]


@pytest.fixture
def gc(restart_gc):
    """The module's cluster (conftest's ``restart_cluster``), with no job and every node up after each test."""
    return restart_gc


# ---------------------------------------------------------------- the rules, pure

NAMES = [f"n{i}" for i in range(1, 9)]


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 8))
    names = NAMES[:count]
    cores = {n: draw(st.integers(1, 4)) for n in names}
    up = [n for n in names if draw(st.booleans())] or [names[0]]
    nranks = draw(st.integers(1, sum(cores.values())))
    old = place({"nranks": nranks}, cores)
    assert old is not None
    return names, cores, up, nranks, old


@given(clusters(), st.data())
def test_a_restart_is_placed_on_live_nodes_within_their_cores(setup, data):
    names, cores, up, nranks, old = setup
    how = data.draw(st.sampled_from(["default", "nodelist", "nodes"]))
    nodelist = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True)) if how == "nodelist" else None
    nodes = data.draw(st.integers(1, len(names) + 1)) if how == "nodes" else None
    try:
        new = relocate.choose_placement(nranks=nranks, old=old, up=up, cores=cores, place=place, nodelist=nodelist, nodes=nodes)
    except relocate.Unplaceable as exc:
        message = str(exc)
        if nodelist is not None and any(n not in up for n in nodelist):
            assert "down" in message and all(n in message for n in nodelist if n not in up)
        elif nodes is not None and nodes > len(up):
            assert f"only {len(up)}" in message
        else:
            assert "do not fit" in message
            allowed = [n for n in up if nodelist is None or n in nodelist]
            assert sum(cores[n] for n in allowed) < nranks or nodes is not None
        return
    assert len(new) == nranks and set(new) <= set(up)
    assert all(new.count(n) <= cores[n] for n in set(new))
    if nodelist is not None:
        assert set(new) <= set(nodelist)
    if nodes is not None:
        assert len(set(new)) <= nodes
    if how == "default" and set(old) <= set(up):
        assert new == old


@given(clusters(), st.data())
def test_each_moved_rank_pulls_from_a_live_holder_and_the_others_stay(setup, data):
    names, _, up, nranks, old = setup
    new = data.draw(st.lists(st.sampled_from(up), min_size=nranks, max_size=nranks))
    copies = data.draw(st.dictionaries(st.sampled_from(names), st.lists(st.integers(0, nranks - 1), unique=True)))
    sources = relocate.plan_sources(new, old, copies, up)
    holders = relocate.holders(old, copies)
    pulled = {}
    for target, per in sources.pulls.items():
        for source, ranks in per.items():
            assert source in up and source != target
            for rank in ranks:
                assert rank not in pulled and new[rank] == target and source in holders[rank]
                pulled[rank] = source
    for rank in range(nranks):
        if new[rank] in holders[rank]:
            assert rank not in pulled and rank not in sources.missing
        elif any(h in up for h in holders[rank]):
            assert rank in pulled
        else:
            assert sources.missing[rank] == holders[rank]
            assert all(h in relocate.describe_missing(sources.missing) for h in holders[rank])


@given(st.integers(2, 8), st.sampled_from(["partner", "xor"]), st.integers(1, 3), st.data())
def test_recovery_keeps_survivors_puts_each_lost_node_on_one_replacement_spares_first(count, level, per_node, data):
    job_nodes = NAMES[:count]
    placement = [n for n in job_nodes for _ in range(per_node)]
    plan = make_plan(job_nodes, level, data.draw(st.integers(2, 4)))
    cluster = NAMES[: data.draw(st.integers(count, 8))]
    lost = data.draw(st.lists(st.sampled_from(job_nodes), min_size=1, unique=True))
    free = {n: data.draw(st.integers(0, 4)) for n in cluster if n not in lost}
    spares = data.draw(st.lists(st.sampled_from(cluster), unique=True))
    try:
        result = recovery.plan_recovery(placement, plan, lost, free, spares)
    except recovery.CannotRecover as exc:
        if plan.recovery(lost).ok:
            assert "no live node has" in str(exc)
            assert all(free[n] < per_node for n in free) or len(lost) > 1  # (room for one lost node, not for all)
        else:
            assert str(exc) == plan.recovery(lost).message
        return
    assert plan.recovery(lost).ok
    assert len(result.placement) == len(placement) and not set(result.placement) & set(lost)
    used = dict.fromkeys(free, 0)
    for new in result.replacements.values():
        used[new] += per_node
    assert all(used[n] <= free[n] for n in free)
    for rank, (was, now) in enumerate(zip(placement, result.placement, strict=True)):
        source = result.ranks[rank]
        assert source.node == now
        if was in lost:
            assert now == result.replacements[was] and source.lost == was
            rebuild = next(r for r in plan.recovery(lost).rebuilds if r.node == was)
            assert (source.method, source.sources) == (rebuild.method, rebuild.sources)
        else:
            assert now == was and source.method == "local"
    # Spares first: no replacement is a non-spare while a spare outside the job had room for it.
    if len(lost) == 1:
        (chosen,) = result.replacements.values()
        spare_room = [n for n in spares if n in free and n not in job_nodes and free[n] >= per_node]
        if spare_room:
            assert chosen == min(spare_room, key=lambda n: int(n[1:]))


# ---------------------------------------------------------------- real daemons


def placement(gc, job: int) -> list[str]:
    return gc.job(job)["placement"]


def restart(gc, job: int, *options, check: bool = True) -> dict:
    result = gc.gang("restart", job, "--json", *options, timeout=120)
    if check:
        assert result.returncode == 0, f"gang restart {job} {' '.join(map(str, options))}: {result.stderr}"
        return json.loads(result.stdout)
    return {"returncode": result.returncode, "stderr": result.stderr}


def checkpointed_and_killed(gc, n: int, *options) -> tuple[int, dict]:
    held, release = hold(gc, 125)  # (a checkpoint lands mid-run however loaded the machine; a restart runs at full speed)
    job = submit(gc, [*ARGV, *held], n, *options)
    wait_holding(gc, job)
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete", gen
    gc.gang("kill", job, check=True)
    gc.wait_state(job, TERMINAL)
    release.touch()
    return job, gen


def wait_node(gc, node: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while gc.node_states().get(node) != state:
        assert time.monotonic() < deadline, f"node {node} is not {state} after {timeout} s"
        time.sleep(0.2)


# ---------------------------------------------------------------- bit-identical on other nodes


def test_a_two_node_job_restarted_on_two_other_nodes_is_bit_identical_and_its_files_laid_out_as_a_checkpoint(gc):
    expected = reference(gc, ARGV, 4)
    held, release = hold(gc, 125)
    job = submit(gc, [*ARGV, *held], 4, "-w", "n1,n2")
    wait_holding(gc, job)
    gen = checkpoint(gc, job)
    assert gen["state"] == "complete" and set(gen["nodes"]) == {"n1", "n2"}, gen
    gc.gang("kill", job, check=True)
    gc.wait_state(job, TERMINAL)
    release.touch()
    answer = restart(gc, job, "-w", "n3,n4")
    restarted = answer["record"]["id"]
    assert answer["placement"] == ["n3", "n3", "n4", "n4"] and answer["gen"] == gen["gen"]
    assert result_of(gc, restarted, timeout=120) == expected
    assert placement(gc, restarted) == ["n3", "n3", "n4", "n4"]
    for node, ranks in (("n3", [0, 1]), ("n4", [2, 3])):
        directory = gen_dir(gc, node, job, gen["gen"])
        assert ckptstore.verify(directory) == []
        manifest = ckptstore.read_manifest(directory)
        assert manifest.node == node and manifest.ranks == ranks and manifest.iteration == gen["iteration"]
        assert {ckptstore.cluster_rank_file(r) for r in ranks} | {"job.msgpack"} <= set(manifest.files)
        for name in manifest.files:
            info = (directory / name).lstat()
            assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, (name, oct(info.st_mode))
            assert info.st_uid == os.geteuid(), (name, info.st_uid)  # (the job's owner: ranks cannot run as a second uid here)
        ranks_dir = (directory / ckptstore.RANKS_DIR).lstat()
        assert ranks_dir.st_uid == os.geteuid() and stat.S_IMODE(ranks_dir.st_mode) == 0o700
        assert stat.S_IMODE(directory.lstat().st_mode) == 0o711 and directory.lstat().st_uid == 0
    # The checkpoint's own nodes still hold theirs, unchanged.
    for node in ("n1", "n2"):
        assert ckptstore.verify(gen_dir(gc, node, job, gen["gen"])) == []
    entry = next(g for g in generations(gc, job) if g["gen"] == gen["gen"])
    assert entry["copies"] == {"n3": [0, 1], "n4": [2, 3]}


def test_restart_with_N_1_packs_every_rank_on_one_node(gc):
    expected = reference(gc, ARGV, 2)
    job, gen = checkpointed_and_killed(gc, 2, "-w", "n1,n2")
    answer = restart(gc, job, "-N", 1)
    where = answer["placement"]
    assert len(where) == 2 and len(set(where)) == 1, where
    assert result_of(gc, answer["record"]["id"], timeout=120) == expected
    node = where[0]
    manifest = ckptstore.read_manifest(gen_dir(gc, node, job, gen["gen"]))
    assert manifest.ranks == [0, 1]


def test_restart_refusals_name_the_nodes(gc):
    job, _ = checkpointed_and_killed(gc, 2, "-w", "n1,n2")
    refused = restart(gc, job, "-w", "n1,n9", check=False)
    assert refused["returncode"] == 2 and "unknown node n9" in refused["stderr"]  # (exit 2: a bad request)
    refused = restart(gc, job, "-N", 5, check=False)
    assert refused["returncode"] != 0 and "5 nodes asked for, but only 4 are up" in refused["stderr"]
    both = gc.gang("restart", job, "-w", "n3", "-N", 1)
    assert both.returncode != 0 and "not both" in both.stderr
    # 2 ranks on one 2-core node fit; 4 ranks do not.
    job4, _ = checkpointed_and_killed(gc, 4, "-w", "n1,n2")
    refused = restart(gc, job4, "-w", "n3", check=False)
    assert refused["returncode"] != 0 and "do not fit" in refused["stderr"] and "n3" in refused["stderr"], refused


# ---------------------------------------------------------------- a node of the checkpoint down


def test_with_a_checkpoint_node_down_the_restart_runs_where_copies_are_or_names_the_node(gc):
    expected = reference(gc, ARGV, 4)
    # A: checkpointed on n1+n2, restarted once on n3+n4 (its files copied
    # there), killed at once. B: checkpointed on n1+n2 only.
    a, a_gen = checkpointed_and_killed(gc, 4, "-w", "n1,n2")
    first = restart(gc, a, "-w", "n3,n4")["record"]["id"]
    gc.gang("kill", first, check=True)
    gc.wait_state(first, TERMINAL)
    b, _ = checkpointed_and_killed(gc, 4, "-w", "n1,n2", "--ckpt-redundancy", "local")  # (no partner copy to rebuild from: test_rebuild.py)
    gc.kill_node("n1")
    try:
        wait_node(gc, "n1", "down")
        refused = restart(gc, b, check=False)
        assert refused["returncode"] != 0, refused
        assert "the files of ranks 0, 1 are only on node n1, which is down" in refused["stderr"], refused["stderr"]
        answer = restart(gc, a)
        where = answer["placement"]
        # The job keeps its live node n2 and takes n3 for the lost n1: ranks 0, 1
        # on n2 (pulled from their copy on n3), ranks 2, 3 on n3 (pulled from
        # n2); each node extends the MANIFEST it had.
        assert where == ["n2", "n2", "n3", "n3"] and answer["gen"] == a_gen["gen"], answer
        for node in ("n2", "n3"):
            assert ckptstore.read_manifest(gen_dir(gc, node, a, a_gen["gen"])).ranks == [0, 1, 2, 3]
        assert result_of(gc, answer["record"]["id"], timeout=120) == expected
    finally:
        gc.start_daemon("n1")
        wait_node(gc, "n1", "up")


# ---------------------------------------------------------------- a damaged source


def test_a_damaged_source_file_is_refused_naming_node_and_path_and_nothing_is_left_looking_staged(gc):
    job, gen = checkpointed_and_killed(gc, 4, "-w", "n1,n2")
    source = gen_dir(gc, "n1", job, gen["gen"]) / ckptstore.cluster_rank_file(0)
    flip_byte(source, 100)
    refused = restart(gc, job, "-w", "n3,n4", check=False)
    assert refused["returncode"] != 0, refused
    assert "n1" in refused["stderr"] and str(source) in refused["stderr"] and "corrupted" in refused["stderr"], refused["stderr"]
    target = gen_dir(gc, "n3", job, gen["gen"])
    # n3 pulled nothing it lists, and kept nothing of rank 0.
    listed = set(ckptstore.read_manifest(target).files) if (target / ckptstore.MANIFEST).exists() else set()
    assert ckptstore.cluster_rank_file(0) not in listed
    assert not (target / ckptstore.cluster_rank_file(0)).exists()
    if (target / ckptstore.RANKS_DIR).exists():
        assert [name for name in os.listdir(target / ckptstore.RANKS_DIR) if "rank-0" in name] == []
    entry = next(g for g in generations(gc, job) if g["gen"] == gen["gen"])
    assert entry["state"] == "damaged" and str(source) in entry["reason"], entry


def test_a_client_can_neither_read_checkpoint_files_nor_stage_them(gc):
    """The files hold the job's network contexts and token: only daemons move them."""
    async def attempt(op: str, **args) -> str:
        async with connect(gc.dir) as gang:
            try:
                await gang.request(op, **args)
            except RemoteError as exc:
                return exc.code
        return "allowed"

    assert trio.run(lambda: attempt("ckpt_file_read", lineage=1, gen=1, name="net-0.ctx")) == "permission_denied"
    assert trio.run(lambda: attempt("ckpt_stage", lineage=1, gen=1, owner=[0, 0], pulls={"n1": [0]}, timeout=5)) == "permission_denied"
