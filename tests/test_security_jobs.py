"""Issue 14, the job-submission review: what a user submits is bounded where it comes in.

A job record is kept by every node, on disk and in memory, for as long as the
cluster keeps the job, and replicated whole: its size must not be the
submitter's choice, and however long the history, a node that was away must
catch up (in batches, never one frame larger than the wire allows). A user's
queued jobs, and the network contexts held for them, are bounded too. And a
job root suspended stays suspended until root resumes it.

Real daemons on 127.0.0.x, a real second uid (nobody), daemons killed with
SIGKILL and started again as `gang cluster up` starts them.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import trio
from conftest import as_uid, shared_cluster

from gangd.client.api import ClusterNotFound, connect
from gangd.rpc import RemoteError

PY = sys.executable
NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin"}
MiB = 1024 * 1024
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a second uid)")


@pytest.fixture(scope="module")
def cluster2():
    with shared_cluster(2) as cluster:
        yield cluster


def _as_nobody(cluster, body) -> dict:
    """``await body(gang)`` as nobody, connected to the cluster; RemoteErrors come back as [code, message]."""

    def run():
        async def main():
            async with connect(cluster.dir) as gang:
                return await body(gang)

        return trio.run(main)

    result = as_uid(NOBODY, run)
    assert not (isinstance(result, dict) and "exception" in result), result
    return result


async def _outcome(call) -> object:
    try:
        return await call
    except RemoteError as exc:
        return [exc.code, exc.message]


def _refused(outcome: object, code: str) -> bool:
    """``outcome`` (see _outcome) is a refusal with ``code``, not an answer."""
    return isinstance(outcome, list) and outcome[0] == code


def _as_root(cluster, body, socket: str | None = None):
    async def main():
        async with connect(sockets=[socket]) if socket else connect(cluster.dir) as gang:
            return await body(gang)

    return trio.run(main)


def _wait_node_state(cluster, node: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}
        if rows[node]["state"] == state:
            return
        assert time.monotonic() < deadline, f"{node} still {rows[node]['state']}, not {state}"
        time.sleep(0.2)


# ---------------------------------------------------------------- 1. the spec is bounded


@root_only
def test_an_oversized_job_spec_is_refused_with_a_clear_message(cluster2):
    def submit(argv, nranks=1, **kwargs):
        return lambda gang: _outcome(gang.submit(argv, nranks, cwd="/", **kwargs))

    def big_argv(gang):
        return _outcome(gang.submit(["true"] + ["A" * 65536] * 48, 1, cwd="/", env=ENV))  # 3 MiB of arguments

    def big_env(gang):
        return _outcome(gang.submit(["true"], 1, cwd="/", env=dict(ENV, BLOB="x" * (3 * MiB))))

    def long_cwd(gang):
        return _outcome(gang.submit(["true"], 1, cwd="/" + "d" * 10000, env=ENV))

    def long_name(gang):
        return _outcome(gang.submit(["true"], 1, cwd="/", env=ENV, name="n" * 100000))

    def repeated_nodes(gang):
        return _outcome(gang.submit(["true"], 1, cwd="/", env=ENV, nodelist=["n1"] * 1000))

    def too_many_ranks(gang):
        return _outcome(gang.submit(["true"], 10**9, cwd="/", env=ENV))

    outcomes = {
        name: _as_nobody(cluster2, body)
        for name, body in (
            ("argv", big_argv), ("env", big_env), ("cwd", long_cwd), ("name", long_name),
            ("nodelist", repeated_nodes), ("nranks", too_many_ranks),
        )
    }
    for name, outcome in outcomes.items():
        assert _refused(outcome, "bad_request"), (name, outcome)
    assert "command line and environment take" in outcomes["argv"][1] and "at most 1048576" in outcomes["argv"][1], outcomes["argv"]
    assert "command line and environment take" in outcomes["env"][1], outcomes["env"]
    assert "cwd is longer than 4096" in outcomes["cwd"][1], outcomes["cwd"]
    assert "name is longer than 1024" in outcomes["name"][1], outcomes["name"]
    assert "--nodelist names 1000 nodes" in outcomes["nodelist"][1], outcomes["nodelist"]
    assert "number of ranks" in outcomes["nranks"][1], outcomes["nranks"]
    # Nothing of them was kept: the table holds no job of nobody's.
    assert not [r for r in cluster2.gang_json("ps", "--all") if r["owner_uid"] == NOBODY]
    # The command line says so too, with exit code 2 (a bad request).
    result = cluster2.gang("submit", "-n", 1, "-w", ",".join(["n1"] * 3), "--", "true")
    assert result.returncode == 2 and "--nodelist" in result.stderr, (result.returncode, result.stderr)
    # A job within the bounds (nearly a megabyte of arguments) runs.
    argv = ["/bin/sh", "-c", 'echo "$#"', "sh"] + ["A" * 65536] * 15
    record = _as_root(cluster2, lambda gang: gang.submit(argv, 1, cwd="/", env=ENV))
    done = _as_root(cluster2, lambda gang: gang.wait_done(record["id"]))
    assert done["state"] == "DONE", done


@root_only
def test_a_node_restarted_after_a_long_history_catches_up_and_can_take_over(make_cluster):
    cluster = make_cluster(3, cores=2)
    cluster.kill_node("n3")
    _wait_node_state(cluster, "n3", "down")
    # 12 jobs of nearly a megabyte of arguments each (within the bounds):
    # 11 MiB of history, more than one frame or etcd request may hold.
    argv = ["true"] + ["A" * 65536] * 15
    ids = [_as_root(cluster, lambda gang: gang.submit(argv, 1, cwd="/", env=ENV, nodelist=["n1"]))["id"] for _ in range(12)]
    for job in ids:
        cluster.wait_state(job, "DONE", timeout=60)
    cluster.start_daemon("n3")
    n3 = str(cluster.files["n3"].socket)
    deadline = time.monotonic() + 120
    while True:
        try:
            seen = {r["id"]: r["state"] for r in _as_root(cluster, lambda gang: gang.jobs(all=True), socket=n3)}
        except (OSError, RemoteError, ClusterNotFound):
            seen = {}  # (still starting)
        if all(seen.get(job) == "DONE" for job in ids):
            break
        assert time.monotonic() < deadline, f"n3's replica never caught up: it has {seen}; n1's log:\n{cluster.log('n1')[-3000:]}"
        time.sleep(0.5)
    assert "refusing to send" not in cluster.log("n1")
    # The coordinator dies: another takes over, reading the table from etcd (page by page), and carries on.
    leader = next(r["name"] for r in _as_root(cluster, lambda gang: gang.nodes(), socket=n3) if r["coordinator"])
    survivor = "n2" if leader != "n2" else "n1"
    cluster.kill_node(leader)
    n2 = str(cluster.files[survivor].socket)
    deadline = time.monotonic() + 60
    while True:
        rows = {r["name"]: r for r in _as_root(cluster, lambda gang: gang.nodes(), socket=n2)}
        if any(r["coordinator"] for r in rows.values()) and rows[leader]["state"] == "down" and not rows[leader]["coordinator"]:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.3)
    record = _as_root(cluster, lambda gang: gang.submit(["true"], 2, cwd="/", env=ENV), socket=n2)
    assert record["id"] > max(ids)
    assert _as_root(cluster, lambda gang: gang.wait_done(record["id"]), socket=n2)["state"] == "DONE"
    for node in sorted({"n1", "n2", "n3"} - {leader}):
        log = cluster.log(node)
        assert "could not pull the job table" not in log and "refusing to send" not in log, log[-3000:]
    seen = {r["id"]: r["state"] for r in _as_root(cluster, lambda gang: gang.jobs(all=True), socket=n3)}
    assert all(seen.get(job) == "DONE" for job in [*ids, record["id"]]), seen


# ---------------------------------------------------------------- 2. queued work per user is bounded


@root_only
def test_queued_jobs_and_their_network_contexts_are_bounded_per_user(make_cluster):
    cluster = make_cluster(1, cores=2, max_slots=1, max_queued_per_user=12)

    async def body(gang):
        out: dict = {}
        filler = await gang.submit(["sleep", "300"], 2, cwd="/", env=ENV)  # takes the one slot: the rest queue
        out["filler"] = filler["id"]
        # One rank's context over 3.5 MiB: refused outright.
        out["rank_too_big"] = await _outcome(gang.submit(["true"], 2, cwd="/", env=ENV, network_context={0: b"x" * (3840 * 1024)}))
        # 3.5 MiB per job is allowed, 16 MiB held for one user's queued jobs: with 2 MiB each, the ninth is refused.
        with_context = []
        for _ in range(9):
            got = await _outcome(gang.submit(["true"], 2, cwd="/", env=ENV, network_context={0: b"x" * MiB, 1: b"y" * MiB}))
            with_context.append(got if isinstance(got, list) else got["state"])
        out["with_context"] = with_context
        # Up to 12 queued jobs (8 so far): 4 more, then refused.
        plain = []
        for _ in range(5):
            got = await _outcome(gang.submit(["true"], 2, cwd="/", env=ENV))
            plain.append(got if isinstance(got, list) else got["state"])
        out["plain"] = plain
        return out

    out = _as_nobody(cluster, body)
    assert _refused(out["rank_too_big"], "bad_request") and "at most 3670016 bytes" in out["rank_too_big"][1], out
    assert out["with_context"][:8] == ["QUEUED"] * 8, out
    assert _refused(out["with_context"][8], "too_many_jobs") and "network context" in out["with_context"][8][1], out
    assert out["plain"][:4] == ["QUEUED"] * 4, out
    assert _refused(out["plain"][4], "too_many_jobs") and "max_queued_per_user = 12" in out["plain"][4][1], out
    # Root is not limited, and the user may submit again once their jobs start.
    extra = _as_root(cluster, lambda gang: gang.submit(["true"], 2, cwd="/", env=ENV))
    assert extra["state"] == "QUEUED"
    result = cluster.gang("kill", out["filler"])
    assert result.returncode == 0, result.stderr
    for record in cluster.gang_json("ps", "--all"):
        if record["state"] == "QUEUED":
            cluster.wait_state(record["id"], ("DONE", "FAILED"), timeout=120)
    again = _as_nobody(cluster, lambda gang: _outcome(gang.submit(["true"], 2, cwd="/", env=ENV)))
    assert isinstance(again, dict) and again["state"] in ("QUEUED", "RUNNING", "DONE"), again


# ---------------------------------------------------------------- 3. root's suspend holds


@root_only
def test_a_job_root_suspended_is_resumed_by_root_only(cluster2):
    job = _as_nobody(cluster2, lambda gang: gang.submit(["sleep", "300"], 2, cwd="/", env=ENV))["id"]
    try:
        cluster2.wait_state(job, "RUNNING")
        # The owner suspends and resumes their own job as before.
        own = _as_nobody(cluster2, lambda gang: _outcome(gang.suspend(job)))
        assert own["state"] == "SUSPENDED", own
        own = _as_nobody(cluster2, lambda gang: _outcome(gang.resume(job)))
        assert own["state"] == "RUNNING", own
        # Root suspends it: the owner cannot undo that.
        held = _as_root(cluster2, lambda gang: gang.suspend(job))
        assert held["state"] == "SUSPENDED" and held["held"] == "root", held
        refused = _as_nobody(cluster2, lambda gang: _outcome(gang.resume(job)))
        assert _refused(refused, "permission_denied") and "suspended by root" in refused[1] and "only root may resume" in refused[1], refused
        assert cluster2.job(job)["state"] == "SUSPENDED"
        # Root resumes it.
        resumed = _as_root(cluster2, lambda gang: gang.resume(job))
        assert resumed["state"] == "RUNNING" and not resumed["held"], resumed
    finally:
        cluster2.gang("kill", job)
    cluster2.wait_state(job, "KILLED")


@root_only
def test_a_jobs_checkpoint_plan_is_its_owners_and_roots_to_read(cluster2):
    """`gang ckpt plan` (issue 19) shows a job's figures to its owner and root only, and a job number that is
    not one is a bad request, not a crash."""
    job = int(cluster2.gang("submit", "-n", 1, "--", "sleep", "300", check=True).stdout)  # (root's)
    try:
        cluster2.wait_state(job, "RUNNING")
        assert _as_root(cluster2, lambda gang: gang.interval_plan(job))["job"] == job
        refused = _as_nobody(cluster2, lambda gang: _outcome(gang.interval_plan(job)))
        assert _refused(refused, "permission_denied"), refused
        for hostile in ("1", -1, 2**63, None, [job]):
            bad = _as_nobody(cluster2, lambda gang, hostile=hostile: _outcome(gang.request("ckpt_interval", job=hostile)))
            assert isinstance(bad, list) and bad[0] in ("bad_request", "no_such_job"), (hostile, bad)
        own = _as_nobody(cluster2, lambda gang: gang.submit(["sleep", "300"], 1, cwd="/", env=ENV))["id"]
        cluster2.wait_state(own, "RUNNING")
        assert _as_nobody(cluster2, lambda gang: gang.interval_plan(own))["job"] == own
        cluster2.gang("kill", own)
    finally:
        cluster2.gang("kill", job)
    cluster2.wait_state(job, "KILLED")


# ---------------------------------------------------------------- the replica's catch-up, record by record


