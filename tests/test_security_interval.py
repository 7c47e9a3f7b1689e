"""Findings of the security review of issue 19 (``--ckpt-every auto``).

Real daemons and real hostile ranks: a rank is the user's own process, so
whatever it tells its node daemon -- the iteration its checkpoint should be
cut at, its pace -- is chosen by the user. What another user relies on: a
job cannot keep itself running through other jobs' time slices by making
its own checkpoint wait for an iteration it never reaches; what the job's
owner relies on: a rank's absurd pace does not stop the job's planning.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from ckpthelpers import TERMINAL, generations, kill_what_is_left

PY = sys.executable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

# A rank that lies about the iteration it can stop at. "report": in its
# answer to a generation's begin (the path that predates issue 19); "at": in
# the planned checkpoint it asks for itself under --ckpt-every auto (the
# generation's ``at``, which every rank is then held to). Either way the cut
# is 2**62 and the round waits for the ranks to reach it while they compute.
LIAR = textwrap.dedent("""
    import sys, time
    from gangd import ckptlib as ckpt
    from gangd.checkpoint import messages

    how = sys.argv[1]
    honest = messages.RankReport.to_wire

    def lying(self):
        out = honest(self)
        if out.get("iteration") is not None and (out.get("gen") is None) == (how == "at"):
            out["iteration"] = 2**62
        return out

    messages.RankReport.to_wire = lying
    ckpt.init()
    state = ckpt.protect("state", {"i": 0})
    for i in ckpt.loop(range(10**9)):
        state["i"] = i
        if how == "report" and i == 20:
            ckpt.request()
        time.sleep(0.005)
""")

SLEEPER = [PY, "-c", "import time; time.sleep(600)"]


def _under_way(cluster, job: int) -> dict | None:
    """The job's checkpoint under way (`gang ckpt ls`), or None."""
    return cluster.ask(lambda gang: gang.checkpoints(job), f"ckpt ls {job}")["under_way"]


def _mounts() -> dict[str, Path]:
    """The cgroup v2 mount ("") and the v1 freezer's ("freezer"), where mounted."""
    out = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            out.setdefault("", Path(fields[1]))
        elif fields[2] == "cgroup" and "freezer" in fields[3].split(","):
            out.setdefault("freezer", Path(fields[1]))
    return out


def _stopped(proc: psutil.Process) -> bool:
    """Whether gang scheduling has the process stopped now: its cgroup frozen (v2 or the v1 freezer), or SIGSTOPped."""
    mounts = _mounts()
    try:
        if proc.status() == psutil.STATUS_STOPPED:
            return True
        for line in Path(f"/proc/{proc.pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" and "" in mounts and (events := mounts[""] / path.lstrip("/") / "cgroup.events").exists():
                if "frozen 1" in events.read_text().splitlines():
                    return True
            if "freezer" in controllers.split(",") and "freezer" in mounts:
                state = mounts["freezer"] / path.lstrip("/") / "freezer.state"
                if state.exists() and state.read_text().strip() == "FROZEN":
                    return True
    except (psutil.Error, OSError):
        pass
    return False


@pytest.mark.parametrize("how", ["report", "at"])
def test_a_checkpoint_that_waits_for_an_absurd_iteration_does_not_keep_its_job_running_through_other_slots(make_cluster, how):
    # One core: the other job and the liar take turns (two slots). While the
    # liar's checkpoint waits for iteration 2**62 its job was pinned (run
    # whatever the slot) for the whole checkpoint_timeout, and a rank can ask
    # again at once: the other job shared its core with it for good.
    cluster = make_cluster(1, cores=1, time_slice=0.1, checkpoint_timeout=30.0, mtbf=60.0)
    try:
        other = int(cluster.gang("submit", "-n", 1, "--", *SLEEPER, check=True).stdout)
        script = cluster.dir.parent / "liar.py"
        script.write_text(LIAR)
        options = ["--ckpt-every", "auto"] if how == "at" else []
        liar = int(cluster.gang("submit", "-n", 1, *options, "--", PY, script, how, check=True).stdout)
        deadline = time.monotonic() + 60
        while (under_way := _under_way(cluster, liar)) is None or under_way["phase"] != "cut":  # (pinned, and thawed, before it began)
            assert cluster.job(liar)["state"] not in TERMINAL, cluster.logs(liar)
            assert time.monotonic() < deadline, f"job {liar}'s checkpoint did not begin: {generations(cluster, liar)}"
            time.sleep(0.05)
        if how == "at":
            assert under_way["trigger"] == f"planned interval (iteration {2**62})"
        procs = cluster.rank_processes(liar)
        assert procs, "the liar's rank is not running"
        # The liar is stopped in the other job's slots again while its checkpoint still waits (the round
        # under way before and after the look: not between two rounds).
        deadline = time.monotonic() + 60
        while True:
            stopped = any(_stopped(p) for p in procs)
            now = _under_way(cluster, liar)
            assert now is not None and now["gen"] == under_way["gen"], \
                f"job {liar} ran through every slot for its whole checkpoint: {generations(cluster, liar)[-1:]}"
            if stopped:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert cluster.job(other)["state"] not in TERMINAL
    finally:
        kill_what_is_left(cluster)


# A rank under --ckpt-every auto that lies in its progress notes: a pace of
# 5e-324 s per iteration (the smallest float above 0, which the note's check
# let through) for its first three notes, then its true one; or, in every
# note, that it is at iteration 2**62 - 1.
PACE_LIAR = textwrap.dedent("""
    import sys, time
    from gangd import ckptlib as ckpt
    from gangd.ckptlib import agent

    what = sys.argv[1]
    honest = agent.DaemonAgent._note
    lies = [0]

    def note(self, op, args):
        if op == "ckpt_progress" and args.get("t_iter") is not None:
            if what == "t_iter" and lies[0] < 3:
                args, lies[0] = {**args, "t_iter": 5e-324}, lies[0] + 1
            elif what == "iteration":
                args = {**args, "iteration": 2**62 - 1}
        return honest(self, op, args)

    agent.DaemonAgent._note = note
    ckpt.init()
    state = ckpt.protect("state", {"i": 0})
    for i in ckpt.loop(range(10**9)):
        state["i"] = i
        time.sleep(0.01)
""")


@pytest.mark.parametrize("what", ["t_iter", "iteration"])
def test_a_rank_that_lies_about_its_pace_does_not_stop_its_jobs_plan_from_being_made_and_sent(make_cluster, what):
    # Before: a pace of 5e-324 s killed the job's planner (math.ceil(inf)),
    # so the job was never planned again; an iteration near 2**62 made a
    # plan past the wire's bound that every node refused, and the planner
    # made and sent it again every second for as long as the job ran.
    cluster = make_cluster(1, cores=2, mtbf=60.0)
    try:
        script = cluster.dir.parent / "pace_liar.py"
        script.write_text(PACE_LIAR)
        job = int(cluster.gang("submit", "-n", 1, "--ckpt-every", "auto", "--", PY, script, what, check=True).stdout)
        deadline = time.monotonic() + 60
        while not (plan := cluster.ask(lambda gang: gang.interval_plan(job), f"ckpt plan {job}")).get("sent"):
            assert cluster.job(job)["state"] not in TERMINAL, cluster.logs(job)
            assert time.monotonic() < deadline, f"job {job}'s plan was not sent: {plan}\n{cluster.log('n1')[-3000:]}"
            time.sleep(0.2)
        assert plan["inputs"]["t_iter"] >= 1e-9
        if what == "iteration":
            assert plan["next"] == 2**62
        assert "task IntervalPlanner._run failed" not in cluster.log("n1")
    finally:
        kill_what_is_left(cluster)


# ---------------------------------------------------------------- the config's failure rates (the admin's, but a clear error)


@pytest.mark.parametrize("value", ["1e-310", "1" + "0" * 400, "0.0000001"])
def test_an_absurd_mtbf_in_the_config_is_a_clear_error_not_a_crash(tmp_path, value):
    # Before: 1e-310 s loaded, and every `gang nodes` and every planned job's
    # planner then raised (a failure rate of 1e310/s is inf); a 400-digit
    # integer raised OverflowError out of the loader.
    from gangd.daemon.config import ConfigError, load

    for text in (f"[failure]\nmtbf = {value}\n", f"[[nodes]]\nname = \"n1\"\naddress = \"127.0.0.1\"\nmtbf = {value}\n"):
        path = tmp_path / "gangd.toml"
        path.write_text("[node]\nname = \"n1\"\n" + text)
        with pytest.raises(ConfigError, match="mtbf must be a positive duration"):
            load(path)
