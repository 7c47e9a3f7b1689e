"""A job that loses a node comes back by itself (issue 16, "Recovery").

The policy (recover or fail, and why) is pure and checked first, with
hypothesis against a plain statement of the rule. Then real daemons on
127.0.0.x, real ranks, real files: a node's daemon SIGKILLed with its ranks
and its state and checkpoint directories deleted (the disk is lost). What a
user relies on: a 3-node job with a protected generation comes back by
itself on the live nodes and the spare and ends bit-identical to an
uninterrupted run (``partner`` and ``xor``); `gang wait` on the first id
follows it to its end; `gang ps` and `gang ckpt ls` say what happened; a job
submitted with ``--no-requeue``, without a protected generation, or past
``max_recoveries`` fails with a reason saying why it was not recovered; a
node lost during a checkpoint, or during its redundancy write, leaves the
previous protected generation as the one the job comes back from.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from ckpthelpers import checkpoint, generations, hold, kill_what_is_left, reference, result_line, result_of, submit, wait_holding
from conftest import wait_for
from hypothesis import given
from hypothesis import strategies as st

from gangd import jobs
from gangd.daemon import config as cfg
from gangd.daemon.coordinator import place, without
from gangd.daemon.recover import decide, recoveries, usable_generation, wants_requeue

PY = sys.executable
ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "ckptjob.py")
ARGV = [JOB, "--steps", "400", "--mb", "0.25"]
ENDED = ("DONE", "FAILED", "KILLED", "REQUEUED")


# ---------------------------------------------------------------- the policy, pure


def gen(number: int, state: str, placement=("n1", "n2", "n3"), **extra) -> dict:
    return {"gen": number, "state": state, "placement": list(placement), "job": 1, **extra}


def record(**fields) -> dict:
    base = {"id": 1, "lineage": 1, "state": "RUNNING", "kill_requested": None, "requeue": None}
    return {**base, **fields}


def test_a_job_with_a_protected_generation_is_requeued_from_the_newest_usable_one():
    gens = [gen(1, "protected"), gen(2, "complete"), gen(3, "aborted")]
    decision = decide(record(), [record()], gens, {"n3"}, 3)
    assert decision.requeue and decision.gen == 1, decision
    # A complete generation none of whose files were on the lost node needs no rebuild.
    decision = decide(record(), [record()], [gen(1, "protected"), gen(2, "complete", ("n1", "n2"))], {"n3"}, 3)
    assert decision.requeue and decision.gen == 2
    # ... nor one whose lost ranks have a copy (a restart staged) on a live node.
    copied = gen(2, "complete", ("n1", "n3"), copies={"n2": [1]})
    assert decide(record(), [record()], [copied], {"n3"}, 3).gen == 2


def test_each_refusal_says_why():
    protected = [gen(1, "protected")]
    no = decide(record(requeue=False), [record(requeue=False)], protected, {"n3"}, 3)
    assert not no.requeue and no.reason == "it was submitted with --no-requeue"
    none = decide(record(), [record()], [], {"n3"}, 3)
    assert not none.requeue and none.reason == "it has no checkpoint"
    aborted = decide(record(), [record()], [gen(1, "aborted")], {"n3"}, 3)
    assert "none of its checkpoints completed" in aborted.reason
    local = decide(record(), [record()], [gen(1, "complete", level="local")], {"n3"}, 3)
    assert not local.requeue
    assert local.reason == "it has no protected checkpoint: generation 1 is only complete (it has no redundancy (level local)) and its files on n3 are lost"
    failed = decide(record(), [record()], [gen(2, "complete", level="xor", redundancy="failed: node n3 was lost")], {"n3"}, 3)
    assert "its xor redundancy was not written (failed: node n3 was lost)" in failed.reason
    killed = decide(record(kill_requested="alice"), [record()], protected, {"n3"}, 3)
    assert not killed.requeue and "being killed by alice" in killed.reason
    lineage = [record(id=1, state="REQUEUED", requeued_as=2), record(id=2, state="REQUEUED", requeued_as=3), record(id=3)]
    limit = decide(lineage[2], lineage, protected, {"n3"}, 2)
    assert not limit.requeue and limit.reason == "it was recovered 2 times already, the most [checkpoint] max_recoveries = 2 allows"
    assert "max_recoveries = 0" in decide(record(), [record()], protected, {"n3"}, 0).reason


def test_a_restarted_job_inherits_its_lineage_s_requeue_choice():
    first = record(id=1, requeue=False, state="KILLED")
    assert wants_requeue(record(id=5, requeue=None), [first, record(id=5)]) is False
    assert wants_requeue(record(id=5, requeue=True), [first, record(id=5)]) is True
    assert wants_requeue(record(id=5), [record(id=1), record(id=5)]) is None


STATES = ("complete", "protected", "aborted", "damaged", "removed")


@given(
    entries=st.lists(st.tuples(st.sampled_from(STATES), st.sets(st.sampled_from(["n1", "n2", "n3", "n4"]), min_size=1)), max_size=6),
    lost=st.sets(st.sampled_from(["n1", "n2", "n3", "n4"]), min_size=1, max_size=2),
    choice=st.sampled_from([None, True, False]),
    done=st.integers(0, 4),
    limit=st.integers(0, 4),
    killing=st.booleans(),
)
def test_the_decision_follows_the_rule(entries, lost, choice, done, limit, killing):
    gens = [gen(i + 1, state, sorted(nodes)) for i, (state, nodes) in enumerate(entries)]
    lineage = [record(id=i + 1, state="REQUEUED", requeued_as=i + 2) for i in range(done)]
    me = record(id=done + 1, lineage=1, requeue=choice, kill_requested="root" if killing else None)
    decision = decide(me, [*lineage, me], gens, lost, limit)
    usable = [g for g in gens if g["state"] == "protected" or (g["state"] == "complete" and not set(g["placement"]) & lost)]
    expected = not killing and choice is not False and done < limit and bool(usable)
    assert decision.requeue == expected, (decision, gens, lost)
    assert decision.reason  # a sentence either way
    if expected:
        assert decision.gen == max(g["gen"] for g in usable)
    assert len(recoveries([*lineage, me])) == done


def test_usable_generation_prefers_the_newest():
    entry, why = usable_generation([gen(1, "protected"), gen(3, "protected"), gen(2, "protected")], {"n1"})
    assert entry is not None and entry["gen"] == 3 and why == ""


def test_spares_take_a_job_only_when_it_fits_nowhere_else():
    record_ = {"id": 1, "nranks": 4, "per_node": None, "nodelist": None, "nodes_wanted": None, "pinned": None}
    free = {"n1": 2, "n2": 2, "n3": 2}
    assert without({"n3"})(record_, free) == ["n1", "n1", "n2", "n2"]
    assert without({"n3"})({**record_, "nranks": 6}, free) is None
    assert place({**record_, "nranks": 6}, free) is not None  # (the coordinator's second try, spares included)


def test_the_spare_flag_and_max_recoveries_are_checked_in_the_config(tmp_path):
    base = """
[node]
name = "n1"
[checkpoint]
max_recoveries = {limit}
[etcd]
endpoints = ["http://127.0.0.1:1"]
[[nodes]]
name = "n1"
address = "127.0.0.1"
spare = {spare1}
[[nodes]]
name = "n2"
address = "127.0.0.2"
spare = {spare2}
"""
    path = tmp_path / "gangd.toml"

    def load(**values):
        path.write_text(base.format(**{"limit": 3, "spare1": "false", "spare2": "true", **values}))
        return cfg.load(path)

    config = load()
    assert [n.spare for n in config.nodes] == [False, True] and config.max_recoveries == 3
    assert "spare = true" in cfg.render(config) and "max_recoveries" not in cfg.render(config)
    assert "max_recoveries = 0" in cfg.render(load(limit=0))
    with pytest.raises(cfg.ConfigError, match="spare must be true or false"):
        load(spare2='"yes"')
    with pytest.raises(cfg.ConfigError, match=r"every node .* is marked spare"):
        load(spare1="true")
    with pytest.raises(cfg.ConfigError, match="max_recoveries must be a whole number"):
        load(limit=-1)
    with pytest.raises(cfg.ConfigError, match="max_recoveries must be a whole number"):
        load(limit='"many"')


def test_requeue_in_the_job_spec_is_checked_at_the_edge():
    spec = {"argv": ["x"], "nranks": 1}
    assert jobs.JobSpec.from_wire(spec, ["n1"]).requeue is None
    assert jobs.JobSpec.from_wire({**spec, "requeue": False}, ["n1"]).as_spec()["requeue"] is False
    with pytest.raises(jobs.BadSpec, match="'requeue' must be true or false"):
        jobs.JobSpec.from_wire({**spec, "requeue": "no"}, ["n1"])
    assert jobs.successor({"id": 3, "state": "REQUEUED", "requeued_as": 4}) == 4
    assert jobs.successor({"id": 3, "state": "REQUEUED", "requeued_as": 3}) is None  # (never back, never a loop)
    assert jobs.successor({"id": 3, "state": "FAILED", "requeued_as": 4}) is None


# ---------------------------------------------------------------- real daemons


def coordinator(cluster) -> str:
    return next(r["name"] for r in cluster.gang_json("nodes")["nodes"] if r["coordinator"])


def lose(cluster, *nodes: str, wait_out_lease: bool = False) -> None:
    """The nodes are lost with their disks: their daemons and ranks SIGKILLed, their state and checkpoints deleted.

    Their leases in etcd are then revoked, as their expiry would a lease TTL
    later (etcd deletes a node's key either way, and that deletion is what
    every daemon watches); ``wait_out_lease`` lets them expire instead."""
    for node in nodes:
        pid = cluster.daemon_pid(node)
        ranks = cluster.rank_processes(node=node)
        os.kill(pid, signal.SIGKILL)
        for proc in ranks:
            try:
                proc.kill()
            except psutil.Error:
                pass
        wait_for(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, f"gangd {node} gone")
        shutil.rmtree(cluster.dir / node / "state", ignore_errors=True)
    if not wait_out_lease:
        for node in nodes:
            cluster.end_lease(node)


def victim_of(cluster, job: int) -> str:
    """A node of the job that is not the coordinator (whose loss is another test's subject)."""
    nodes = jobs.nodes_of(cluster.job(job))
    lead = coordinator(cluster)
    return [n for n in nodes if n != lead][-1]


def wait_protected(cluster, job: int, number: int, timeout: float = 60) -> dict:
    return wait_for(lambda: next((g for g in generations(cluster, job) if g["gen"] == number and g["state"] == "protected"), None),
                    timeout, f"generation {number} of job {job} protected")


def held(cluster) -> tuple[list[str], Path]:
    """ckptjob's arguments for a job that holds mid-run (checkpoints taken, a
    node lost, long before its end however loaded the machine) until the test
    touches the file returned; after it, and once recovered, it runs at full speed."""
    options, release = hold(cluster, 200)
    return [*ARGV, *options], release


def running(cluster, job: int) -> dict:
    """The job's record once every rank idles in its hold."""
    wait_holding(cluster, job)
    return cluster.job(job)


def protected_held_job(cluster, nranks: int, level: str) -> tuple[int, Path, dict, dict]:
    """A ``level`` job of ``nranks`` ranks, one per node, holding (``held``),
    with a protected generation: (its id, the file that releases it, its record, the generation)."""
    argv, release = held(cluster)
    job = submit(cluster, argv, nranks, "--per-node", "1", "--ckpt-redundancy", level)
    record = running(cluster, job)
    taken = checkpoint(cluster, job)
    wait_protected(cluster, job, taken["gen"])
    return job, release, record, taken


def protected_partner_job(cluster, *options: str) -> tuple[str, str, list[str], int, dict, Path]:
    """A 3-rank ``partner`` job on three nodes of n1-n4 that are not the
    coordinator, holding (``held``), with a protected generation: (its uninterrupted
    result, the coordinator, its nodes, its id, the generation, the file that releases it)."""
    expected = reference(cluster, ARGV, 3, "--per-node", "1")
    lead = coordinator(cluster)
    nodes = [n for n in ("n1", "n2", "n3", "n4") if n != lead][:3]
    argv, release = held(cluster)
    job = submit(cluster, argv, 3, "--per-node", "1", "-w", ",".join(nodes), "--ckpt-redundancy", "partner", *options)
    running(cluster, job)
    taken = checkpoint(cluster, job)
    wait_protected(cluster, job, taken["gen"])
    return expected, lead, nodes, job, taken, release


@pytest.fixture
def spare_cluster(make_cluster, points):
    """4 nodes of 2 cores, n4 a spare (jobs of 3 ranks, one per node, run on n1-n3); failpoints armed by ``points``."""
    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",))
    yield cluster
    kill_what_is_left(cluster)


@pytest.mark.parametrize("level", ["partner", "xor"])
def test_a_job_whose_node_and_disk_are_lost_comes_back_by_itself_bit_identical(spare_cluster, points, level):
    cluster = spare_cluster
    expected = reference(cluster, ARGV, 3, "--per-node", "1")
    argv, release = held(cluster)
    runner = None
    if level == "xor":  # `gang run` in the foreground follows the recovery too, output and exit code
        runner = cluster.popen_gang("run", "-n", 3, "--per-node", 1, "--ckpt-redundancy", level, "--", PY, *argv)
        job = wait_for(lambda: next((r["id"] for r in cluster.ps() if r["state"] not in ENDED), None), 60, "the job of gang run")
    else:
        job = submit(cluster, argv, 3, "--per-node", "1", "--ckpt-redundancy", level)
    first = running(cluster, job)
    assert "n4" not in first["placement"], first["placement"]  # (the spare is held back)
    nodes = cluster.gang("nodes", check=True).stdout
    assert "up SPARE" in nodes, nodes
    taken = checkpoint(cluster, job)
    assert taken["state"] == "complete", taken
    wait_protected(cluster, job, taken["gen"])
    waiter = cluster.popen_gang("wait", job, "--json")
    victim = victim_of(cluster, job)
    if level == "partner":  # etcd refuses, once, the write that ends the lost job: the recovery takes the step again
        (points / "recover.end").touch()
    lose(cluster, victim, wait_out_lease=True)  # (a real expiry, end to end; the other tests revoke the lease)
    release.touch()

    old = cluster.wait_state(job, ENDED, timeout=120)
    assert old["state"] == "REQUEUED", old
    if level == "partner":
        assert f"job {job}: its recovery stopped (etcd refused the change: failpoint recover.end); trying again" in cluster.log(coordinator(cluster))
    new = old["requeued_as"]
    assert old["reason"].startswith(f"node {victim} lost; requeued as job {new} from generation {taken['gen']}"), old["reason"]
    assert old["recovery"]["lost"] == [victim]
    again = cluster.job(new)
    assert again["recovery_of"]["job"] == job and again["recovery_of"]["lost"] == [victim] and again["recoveries"] == 1
    assert again["lineage"] == job and again["restart_of"]["gen"] == taken["gen"]
    assert victim not in again["placement"] and "n4" in again["placement"], again["placement"]  # the spare replaced the lost node
    assert result_of(cluster, new, timeout=240) == expected
    if runner is not None:
        out, err = runner.communicate(timeout=120)
        assert runner.returncode == 0, err
        assert result_line(out) == expected
        assert f"following job {new}" in err, err

    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err
    assert json.loads(out)["id"] == new  # `gang wait` on the first id followed the computation to its end
    ps = cluster.gang("ps", check=True).stdout
    assert f"requeued as job {new}" in ps and "REQUEUED" in ps, ps
    ls = cluster.gang("ckpt", "ls", new, check=True).stdout
    assert f"recovery: job {job} lost {victim}; requeued as job {new} from generation {taken['gen']}" in ls, ls


def test_no_requeue_no_protected_generation_and_the_limit_fail_the_job_saying_why(make_cluster):
    cluster = make_cluster(4, cores=2, time_slice=0.1)
    try:
        argv, _release = held(cluster)  # (never released: the jobs fail)
        refused = submit(cluster, argv, 3, "--per-node", "1", "--ckpt-redundancy", "partner", "--no-requeue")
        local = submit(cluster, argv, 3, "--per-node", "1", "--ckpt-redundancy", "local")
        bare = submit(cluster, argv, 2, "--per-node", "1")  # no checkpoint at all
        for job in (refused, local, bare):
            running(cluster, job)
        for job in (refused, local):
            taken = checkpoint(cluster, job)
            assert taken["state"] == "complete", taken
        wait_protected(cluster, refused, 1)
        lead = coordinator(cluster)
        # A node every one of the three jobs has ranks on.
        shared = set(cluster.job(refused)["placement"]) & set(cluster.job(local)["placement"]) & set(cluster.job(bare)["placement"]) - {lead}
        assert shared, [cluster.job(j)["placement"] for j in (refused, local, bare)]
        victim = sorted(shared)[0]
        lose(cluster, victim)
        why = {job: cluster.wait_state(job, ENDED, timeout=120) for job in (refused, local, bare)}
        for record_ in why.values():
            assert record_["state"] == "FAILED", record_
            assert record_["reason"].startswith(f"node {victim} ("), record_["reason"]
        assert why[refused]["reason"].endswith("; not recovered: it was submitted with --no-requeue"), why[refused]["reason"]
        assert why[local]["reason"].endswith(
            "; not recovered: it has no protected checkpoint: generation 1 is only complete "
            f"(it has no redundancy (level local)) and its files on {victim} are lost"
        ), why[local]["reason"]
        assert why[bare]["reason"].endswith("; not recovered: it has no checkpoint"), why[bare]["reason"]
        waited = cluster.gang("wait", refused)
        assert waited.returncode != 0 and "--no-requeue" in waited.stderr
    finally:
        kill_what_is_left(cluster)


def test_max_recoveries_is_honoured(make_cluster):
    cluster = make_cluster(4, cores=2, time_slice=0.1, max_recoveries=0)
    try:
        argv, _release = held(cluster)  # (never released: the job fails)
        job = submit(cluster, argv, 3, "--per-node", "1", "--ckpt-redundancy", "partner")
        running(cluster, job)
        assert checkpoint(cluster, job)["state"] == "complete"
        wait_protected(cluster, job, 1)
        lose(cluster, victim_of(cluster, job))
        record_ = cluster.wait_state(job, ENDED, timeout=120)
        assert record_["state"] == "FAILED" and record_["reason"].endswith(
            "; not recovered: this cluster does not recover jobs ([checkpoint] max_recoveries = 0)"), record_
    finally:
        kill_what_is_left(cluster)


def test_a_node_lost_during_a_checkpoint_leaves_the_previous_protected_generation_to_recover_from(make_cluster):
    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",))
    try:
        short = [JOB, "--steps", "160", "--mb", "0.25"]
        expected = reference(cluster, short, 3, "--per-node", "1")
        # The rank on the node to be lost is slow to reach the next cut from
        # iteration 150 on (4 s an iteration): a round started then waits for it.
        # (One rank per node, in name order, the spare n4 left out: rank i on n{i+1}.)
        # Only while the file is there: the job that comes back runs at full speed.
        victim = [n for n in ("n1", "n2", "n3") if n != coordinator(cluster)][-1]
        slow = int(victim[1:]) - 1
        slowing = cluster.dir.parent / "slow"
        slowing.touch()
        job = submit(cluster, [*short, "--sleep", "0.03", "--slow-rank", str(slow), "--slow-from", "150", "--slow-sleep", "4", "--slow-while", slowing], 3,
                     "--per-node", "1", "--ckpt-redundancy", "partner")
        record_ = cluster.wait_state(job, ("RUNNING", "SUSPENDED"), timeout=60)
        time.sleep(1)
        assert record_["placement"][slow] == victim, record_["placement"]
        taken = checkpoint(cluster, job)
        assert taken["state"] == "complete" and taken["iteration"] < 150, taken  # (before the rank is slow)
        wait_protected(cluster, job, taken["gen"])
        wait_for(lambda: f"rank {slow} is slow from now on" in cluster.logs(job), 60, f"rank {slow} slow")
        cluster.gang("checkpoint", job, "--no-wait", check=True)
        time.sleep(1)  # (the round waits for the slow rank, 4 s an iteration)
        lose(cluster, victim)
        slowing.unlink()
        old = cluster.wait_state(job, ENDED, timeout=120)
        assert old["state"] == "REQUEUED", old
        states = {g["gen"]: g for g in generations(cluster, job)}
        second = states[taken["gen"] + 1]
        assert second["state"] == "aborted" and victim in second["reason"], second
        new = cluster.job(old["requeued_as"])
        assert new["restart_of"]["gen"] == taken["gen"], new
        assert result_of(cluster, new["id"], timeout=300) == expected
    finally:
        kill_what_is_left(cluster)


def test_a_node_lost_during_the_redundancy_write_leaves_the_previous_protected_generation(make_cluster, points):
    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",))
    try:
        expected = reference(cluster, ARGV, 3, "--per-node", "1")
        job, release, _, first = protected_held_job(cluster, 3, "xor")
        (points / "protect.hold").touch()  # the next generation's redundancy write waits before it starts
        second = checkpoint(cluster, job)
        assert second["state"] == "complete", second
        lose(cluster, victim_of(cluster, job))
        release.touch()
        os.unlink(points / "protect.hold")
        old = cluster.wait_state(job, ENDED, timeout=120)
        assert old["state"] == "REQUEUED", old
        entry = next(g for g in generations(cluster, job) if g["gen"] == second["gen"])
        assert entry["state"] in ("complete", "removed"), entry  # never protected: its write lost a node
        new = cluster.job(old["requeued_as"])
        assert new["restart_of"]["gen"] == first["gen"], new
        assert result_of(cluster, new["id"], timeout=300) == expected
    finally:
        kill_what_is_left(cluster)


def test_a_new_coordinator_finds_the_job_recovering_and_finishes_it_with_one_restart(make_cluster, points):
    cluster = make_cluster(5, cores=2, time_slice=0.1, spares=("n5",))
    try:
        expected, lead, nodes, job, taken, release = protected_partner_job(cluster)
        (points / "recover.hold").touch()  # the recovery stops after killing the survivors, before the restart
        lose(cluster, nodes[-1])
        release.touch()
        held = cluster.wait_state(job, "RECOVERING", timeout=60)
        assert held["reason"] == f"node {nodes[-1]} lost; recovering from generation {taken['gen']}", held["reason"]
        assert cluster.gang_json("ps")  # (visible in gang ps)
        cluster.kill_node(lead)  # the coordinator dies mid-recovery (its lease ended, as its expiry would a TTL later)
        wait_for(lambda: coordinator(cluster) != lead, 60, "a new coordinator")
        os.unlink(points / "recover.hold")
        old = cluster.wait_state(job, ENDED, timeout=120)
        assert old["state"] == "REQUEUED", old
        lineage = [r for r in cluster.gang_json("ps", "--all") if r.get("lineage") == job and r["id"] != job]
        assert [r["id"] for r in lineage] == [old["requeued_as"]], lineage  # one restart, never two
        assert f"job {job}: resuming its recovery, left by the previous coordinator" in cluster.log(coordinator(cluster))
        assert result_of(cluster, old["requeued_as"], timeout=240) == expected
    finally:
        kill_what_is_left(cluster)


@pytest.mark.parametrize("together", [True, False], ids=["together", "one-during-the-recovery"])
def test_two_nodes_of_one_xor_set_lost_fail_the_job_naming_what_cannot_be_rebuilt(make_cluster, points, together):
    cluster = make_cluster(4, cores=2, time_slice=0.1, spares=("n4",))
    try:
        argv, _release = held(cluster)  # (never released: the job fails)
        job = submit(cluster, argv, 3, "--per-node", "1", "--ckpt-redundancy", "xor")
        running(cluster, job)
        taken = checkpoint(cluster, job)
        wait_protected(cluster, job, taken["gen"])
        lead = coordinator(cluster)
        doomed = [n for n in jobs.nodes_of(cluster.job(job)) if n != lead][-2:]  # (two of its three nodes, not the coordinator)
        if together:
            lose(cluster, *doomed)
        else:  # the second fails while the recovery of the first runs (held after killing the survivors, before
            # its rebuild: else, on a loaded machine, the rebuild could be done before the second loss): it goes on knowing
            (points / "recover.hold").touch()
            lose(cluster, doomed[0])
            cluster.wait_state(job, "RECOVERING", timeout=60)
            lose(cluster, doomed[1])
            wait_for(lambda: cluster.node_states().get(doomed[1]) != "up", 60, f"{doomed[1]} down")
            os.unlink(points / "recover.hold")
        record_ = cluster.wait_state(job, ENDED, timeout=120)
        assert record_["state"] == "FAILED", record_
        reason = record_["reason"]
        # Whichever lease expired first, both nodes are counted lost, and the reason is the rebuild's sentence.
        assert reason.startswith(f"nodes {', '.join(doomed)} lost; not recovered: "), reason
        assert any(f"node {n}'s" in reason for n in doomed), reason
        assert [r for r in cluster.gang_json("ps", "--all") if r.get("lineage") == job and r["id"] != job] == []  # no restart left behind
    finally:
        kill_what_is_left(cluster)


def test_a_coordinator_that_dies_right_after_submitting_the_restart_leaves_only_the_link_to_make(make_cluster, points):
    cluster = make_cluster(5, cores=2, time_slice=0.1, spares=("n5",))
    try:
        expected, lead, nodes, job, _taken, release = protected_partner_job(cluster)
        (points / "recover.hold").touch()
        lose(cluster, nodes[-1])
        release.touch()
        cluster.wait_state(job, "RECOVERING", timeout=60)
        (points / "jobtable.created").touch()  # the coordinator crashes once the restart's job is in etcd
        os.unlink(points / "recover.hold")
        wait_for(lambda: not cluster.files[lead].pid(), 60, "the coordinator's crash")
        cluster.end_lease(lead)  # (its lease ended, as its expiry would a TTL later)
        wait_for(lambda: coordinator(cluster) != lead, 60, "a new coordinator")
        assert "failpoint jobtable.created reached" in cluster.log(lead)
        old = cluster.wait_state(job, ENDED, timeout=120)
        assert old["state"] == "REQUEUED", old
        lineage = [r for r in cluster.gang_json("ps", "--all") if r.get("lineage") == job and r["id"] != job]
        assert [r["id"] for r in lineage] == [old["requeued_as"]], lineage
        link = f"job {job}: its recovery (left by the previous coordinator, or stopped by etcd) had started job {old['requeued_as']}"
        assert link in cluster.log(coordinator(cluster))
        assert cluster.job(old["requeued_as"])["recovery_of"]["job"] == job
        assert result_of(cluster, old["requeued_as"], timeout=240) == expected
    finally:
        kill_what_is_left(cluster)


def test_a_restart_whose_node_is_lost_before_it_starts_starts_elsewhere_from_the_rebuilt_files(make_cluster, points):
    # The restart is pinned to the nodes holding its generation's files; one
    # of them is lost while the restart waits in the queue (here: held before
    # placement). Its files are rebuilt from the partner copy on the spare,
    # and the same job starts there, not waiting forever for a dead node.
    cluster = make_cluster(5, cores=2, time_slice=0.1, spares=("n5",))
    try:
        expected, _lead, nodes, job, taken, release = protected_partner_job(cluster, "--no-requeue")
        assert cluster.gang("kill", job).returncode == 0
        cluster.wait_state(job, ENDED, timeout=60)
        release.touch()
        (points / "schedule.hold").touch()
        restarted = cluster.gang("restart", job, "--json")
        assert restarted.returncode == 0, restarted.stderr
        new = json.loads(restarted.stdout)["record"]["id"]
        assert json.loads(restarted.stdout)["placement"] == nodes
        lose(cluster, nodes[-1])
        said = f"job {new}: {nodes[-1]} went down before it started; it restarts from generation {taken['gen']} on"
        wait_for(lambda: said in cluster.log(coordinator(cluster)), 60, "the restart's nodes chosen again")
        assert cluster.job(new)["state"] == "QUEUED"
        os.unlink(points / "schedule.hold")
        assert result_of(cluster, new, timeout=240) == expected
        assert cluster.job(new)["placement"] == [*nodes[:2], "n5"]
    finally:
        kill_what_is_left(cluster)
