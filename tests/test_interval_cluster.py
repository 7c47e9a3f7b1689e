"""``--ckpt-every auto`` on a real cluster (issue 19): the daemons measure the
job, plan the interval (paper 002's "checkpoint at iteration n, then every
m"), and every rank checkpoints at the iterations the plan names — with
iterations of irregular length and one longer than the whole interval — and
the plan moves when checkpoints get cheaper or a node's failure rate rises.

The clusters are given a short MTBF prior (a minute) so that the optimal
interval is seconds, not the hours a real cluster's would be."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from ckpthelpers import PY, TERMINAL, generations, kill_what_is_left

from gangd.interval.planner import Measured, make_plan

APP = str(Path(__file__).parent / "interval_app.py")
MTBF = 60.0


def plan_of(cluster, job: int) -> dict:
    """What `gang ckpt plan JOB --json` prints (asked in this process: the tests poll it)."""
    return cluster.ask(lambda gang: gang.interval_plan(job), f"ckpt plan {job}")


def saved_lines(cluster, job: int) -> dict[int, set[int]]:
    """iteration -> the ranks that printed they saved there."""
    out: dict[int, set[int]] = {}
    for rank, _gen, iteration in re.findall(r"SAVED rank (\d+) gen (\d+) iteration (\d+)", cluster.logs(job)):
        out.setdefault(int(iteration), set()).add(int(rank))
    return out


def test_every_rank_checkpoints_at_the_planned_iterations_with_irregular_and_overlong_iterations(make_cluster):
    cluster = make_cluster(2, cores=2, time_slice=0.1, mtbf=MTBF)
    try:
        job = int(cluster.gang("submit", "-n", 2, "--per-node", 1, "--ckpt-every", "auto", "--",
                               PY, APP, "--steps", 400, "--sleep", 0.02, "--jitter", 0.5, "--long-at", 150, "--long", 4, check=True).stdout)
        seen = []
        deadline = time.monotonic() + 120
        while (state := cluster.job(job)["state"]) not in TERMINAL:
            plan = plan_of(cluster, job)
            if plan.get("next") is not None:
                seen.append(plan)
            assert time.monotonic() < deadline, "the job did not end in 120 s"
            time.sleep(0.3)
        assert state == "DONE", cluster.job(job)
        assert seen, "no plan was shown while the job ran"
        # The plan is Vaidya's optimum of what was measured, in iterations of the measured pace.
        last = seen[-1]
        m = last["inputs"]
        assert last["auto"] is True and m["lam"] == pytest.approx(2 / MTBF, rel=0.5)  # (two nodes: their rates summed)
        assert last["every_s"] > m["C"] and last["every"] == max(1, round(last["every_s"] / m["t_iter"]))
        # A longer interval than the plan's, or a shorter one, would lose more time (the model's optimum).
        assert last["young_s"] is not None and last["daly_s"] is not None

        # (a round planned past the loop's end is aborted when the ranks leave it: not a checkpoint taken)
        taken = [g for g in generations(cluster, job) if g["trigger"].startswith("planned interval") and g["state"] != "aborted"]
        assert len(taken) >= 3, [(g["gen"], g["iteration"], g["trigger"]) for g in generations(cluster, job)]
        saved = saved_lines(cluster, job)
        for g in taken:
            # The cut is the iteration the plan named, and every rank saved its state there.
            assert g["iteration"] == g["planned_at"], g
            assert saved.get(g["iteration"]) == {0, 1}, (g["iteration"], saved)
        # The iteration four seconds long (longer than the whole interval) did not make it skip:
        # the next planned checkpoint after it was taken at its planned iteration, and so on to the end.
        after = [g["iteration"] for g in taken if g["iteration"] > 150]
        assert after, [g["iteration"] for g in taken]
        cuts = [g["iteration"] for g in taken]
        gaps = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
        # (a plan made again names its iteration no sooner than ``reach`` ahead of the ranks: the plan's trip to them)
        assert max(gaps) <= max(p["every"] for p in seen) + max(p["reach"] for p in seen) + 1, (cuts, [(p["every"], p["reach"]) for p in seen])
        # What a user reads.
        shown = cluster.gang("ckpt", "plan", job, check=True).stdout
        for words in ("planned (--ckpt-every auto)", "checkpoint cost C", "failure rate λ", "optimal interval", "Young", "Daly",
                      "predicted overhead", "then every"):
            assert words in shown, shown
    finally:
        kill_what_is_left(cluster)


def test_the_plan_shortens_when_incremental_checkpoints_make_them_cheaper(make_cluster):
    cluster = make_cluster(2, cores=2, time_slice=0.1, mtbf=MTBF)
    try:
        # 32 MiB of state, a few blocks of it changed per iteration, written inline (the ranks are blocked
        # for the write): the first generation writes it all, the ones after only what changed.
        env = dict(os.environ, GANGD_CKPT_BACKGROUND="0")
        job = int(cluster.gang("submit", "-n", 2, "--per-node", 1, "--ckpt-every", "auto", "--ckpt-mode", "adaptive", "--ckpt-redundancy", "local",
                               "--", PY, APP, "--steps", 100000, "--sleep", 0.02, "--jitter", 0.2, "--mib", 32, env=env, check=True).stdout)
        plans: list[dict] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            plan = plan_of(cluster, job)
            m = plan["inputs"]
            if plan.get("next") is not None and (not plans or plans[-1]["inputs"]["C"] != m["C"]):
                plans.append(plan)
            done = [g for g in generations(cluster, job) if g["state"] in ("complete", "protected")]
            if len(done) >= 4 and "last 3" in m["basis"]["C"]:
                break
            time.sleep(0.3)
        modes = [g.get("mode") for g in generations(cluster, job)]
        assert modes[0] == "full" and set(modes[1:4]) & {"differential", "incremental"}, modes
        after_full = next(p for p in plans if "last 1 " in p["inputs"]["basis"]["C"])
        latest = plans[-1]
        assert "last 3" in latest["inputs"]["basis"]["C"], [p["inputs"]["basis"]["C"] for p in plans]
        # Cheaper checkpoints: a lower C, and Vaidya's optimum ~ sqrt(2C/λ) a shorter interval.
        assert latest["inputs"]["C"] < after_full["inputs"]["C"] / 1.25, [(p["inputs"]["C"], p["every_s"]) for p in plans]
        assert latest["every_s"] < after_full["every_s"], [(p["inputs"]["C"], p["every_s"]) for p in plans]

        # R: estimated until the lineage is restarted, then the restart as measured (submitted -> every rank restored).
        assert latest["inputs"]["basis"]["R"].startswith("estimated"), latest["inputs"]["basis"]
        cluster.gang("kill", job, check=True)
        restarted = int(cluster.gang("restart", job, "-q", env=env, check=True).stdout)
        deadline = time.monotonic() + 60
        while not (plan := plan_of(cluster, restarted))["inputs"]["basis"]["R"].startswith("measured"):
            assert time.monotonic() < deadline, plan
            time.sleep(0.3)
        record = cluster.job(restarted)
        assert plan["inputs"]["R"] == pytest.approx(record["restart_seconds"]) and 0 < record["restart_seconds"] < 60, record
    finally:
        kill_what_is_left(cluster)


def test_a_node_loss_raises_its_failure_rate_and_shortens_the_plan_of_jobs_on_it(make_cluster):
    cluster = make_cluster(3, cores=2, time_slice=0.1, mtbf=MTBF)
    try:
        argv = ["--", PY, APP, "--steps", 100000, "--sleep", 0.02]

        def planned(job: int) -> dict:
            deadline = time.monotonic() + 90
            while (plan := plan_of(cluster, job)).get("next") is None or not plan["inputs"]["basis"]["C"].startswith("measured"):
                assert time.monotonic() < deadline, plan
                time.sleep(0.3)
            return plan

        before = planned(int(cluster.gang("submit", "-n", 2, "-w", "n1,n2", "--ckpt-every", "auto", *argv, check=True).stdout))
        kill_what_is_left(cluster)
        # A job without --ckpt-every auto is shown the interval it would get (in seconds); no job: exit code 5.
        plain = int(cluster.gang("submit", "-n", 1, "--", "sleep", "30", check=True).stdout)
        shown = cluster.gang("ckpt", "plan", plain, check=True).stdout
        assert "not planned (--ckpt-every not set)" in shown and "optimal interval" in shown and "then every" not in shown, shown
        missing = cluster.gang("ckpt", "plan", 9999)
        assert missing.returncode == 5 and "no job 9999" in missing.stderr, (missing.returncode, missing.stderr)
        kill_what_is_left(cluster)
        nodes = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}
        assert nodes["n2"]["failure"]["basis"].startswith("history: 0 losses")

        cluster.kill_node("n2")  # (its lease ends: the coordinator records the loss in n2's history in etcd)
        cluster.start_daemon("n2")
        deadline = time.monotonic() + 30
        while (n2 := {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}["n2"])["state"] != "up" or n2["history"]["losses"] < 1:
            assert time.monotonic() < deadline, n2
            time.sleep(0.3)
        n1 = {r["name"]: r for r in cluster.gang_json("nodes")["nodes"]}["n1"]
        table = cluster.gang("nodes", check=True).stdout.splitlines()
        assert "MTBF" in table[0] and "(history)" in next(line for line in table if line.startswith("n2")), table
        assert n2["failure"]["lam"] > 1.5 * n1["failure"]["lam"] and n2["failure"]["basis"].startswith("history: 1 loss"), (n1, n2)

        after = planned(int(cluster.gang("submit", "-n", 2, "-w", "n1,n2", "--ckpt-every", "auto", *argv, check=True).stdout))
        # The job's rate is its nodes' rates summed, as `gang nodes` shows them, now with n2's loss in it.
        assert after["inputs"]["lam"] == pytest.approx(n1["failure"]["lam"] + n2["failure"]["lam"], rel=0.1)
        # (n2 has one loss over its prior's weight of one: its rate about doubles; both nodes' exposure grew meanwhile)
        assert after["inputs"]["lam"] > 1.1 * before["inputs"]["lam"], (before["inputs"], after["inputs"])
        # Each plan is the model's optimum for what it shows; at the same checkpoint cost the higher
        # rate gives the shorter interval (the measured costs of two runs differ; the rate is the point). Compared
        # without the cluster's 1 s floor: a machine that checkpoints in milliseconds puts both optima under it.
        for plan in (before, after):
            assert plan["every_s"] == pytest.approx(replanned(plan["inputs"]), rel=1e-9)
        same_cost = {**after["inputs"], "C": before["inputs"]["C"], "L": before["inputs"]["L"]}
        assert replanned(same_cost, min_s=0.0) < replanned(before["inputs"], min_s=0.0), (before["inputs"], same_cost)
    finally:
        kill_what_is_left(cluster)


def replanned(inputs: dict, **bounds: float) -> float:
    """The interval (s) make_plan gives for the inputs a plan shows (the cluster's default bounds unless given)."""
    m = Measured(**{k: inputs[k] for k in ("C", "L", "R", "lam", "t_iter")}, node_loss_survivable=inputs["node_loss_survivable"])
    return make_plan(m, **bounds).every_s
