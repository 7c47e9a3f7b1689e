"""Gang scheduling on a real cluster: real daemons, real processes, real signals.

One 4-node cluster is shared by the whole module: one core per node (so two
jobs on the same node overlap and need different time slots), a 0.1 s time
slice and a multiprogramming degree of 2. Every test leaves it empty: the
autouse fixture kills what is left and checks that the slot table empties.

Whether a process runs is read from /proc/<pid>/status: stopped ('T'), or
about to stop (SIGSTOP pending: sent, but the process has not been on a CPU
since to act on it — it cannot run user code before it stops), or running.
Samples of two jobs are taken "sandwiched" (X, Y, X again, Y again) so a
switch that happens between two reads is never mistaken for an overlap.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest
import trio
from click.testing import CliRunner
from conftest import as_uid, shared_cluster

from gangd.client import cli
from gangd.client.api import connect
from gangd.rpc import RemoteError

PY = sys.executable
BUSY = ["sh", "-c", "while :; do :; done"]
NOBODY = 65534
TIME_SLICE = 0.1
TERMINAL = ("DONE", "FAILED", "KILLED")
LAUNCHED = ("RUNNING", "SUSPENDED")  # what `gang ps` shows for a launched job (live state)
STOP_BIT = 1 << (signal.SIGSTOP - 1)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")


# ---------------------------------------------------------------- the shared cluster


@pytest.fixture(scope="module")
def gc():
    with shared_cluster(4, cores=1, time_slice=TIME_SLICE, max_slots=2) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def _leave_it_empty(gc):
    yield

    async def kill_the_rest(g):
        for record in await g.jobs():
            if record["state"] not in TERMINAL:
                await g.kill(record["id"])

    api(gc, kill_the_rest)
    gc.wait_no_rank_processes(timeout=15)
    deadline = time.monotonic() + 10
    while (slots := schedule(gc)["slots"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slots == [], f"the slot table did not empty after the test: {slots}"


# ---------------------------------------------------------------- helpers


def submit(cluster, *args) -> int:
    return int(cluster.gang("submit", *args, check=True).stdout)


def api(cluster, fn):
    """Run ``await fn(client)`` against the cluster through the Python API."""

    async def main():
        async with connect(cluster.dir) as gang:
            return await fn(gang)

    return trio.run(main)


def schedule(cluster) -> dict:
    """The slot table (what `gang nodes --json` shows under "schedule")."""
    return api(cluster, lambda g: g.schedule())


def ps(cluster) -> dict[int, dict]:
    """Every job by id (what `gang ps --all --json` shows)."""
    return {r["id"]: r for r in api(cluster, lambda g: g.jobs(all=True))}


def gang_schedule(cluster) -> dict:
    return cluster.gang_json("nodes")["schedule"]


def gang_ps(cluster) -> dict[int, dict]:
    """The same through the `gang` command."""
    return {r["id"]: r for r in cluster.gang_json("ps", "--all")}


def wait_state(cluster, job: int, states, timeout: float = 30) -> dict:
    states = {states} if isinstance(states, str) else set(states)
    deadline = time.monotonic() + timeout
    while (record := ps(cluster)[job])["state"] not in states:
        assert time.monotonic() < deadline, f"job {job} is {record['state']}, not {states}, after {timeout} s: {record}"
        time.sleep(0.05)
    return record


def processes(cluster, job: int, count: int, timeout: float = 20) -> list[tuple[str, psutil.Process]]:
    """The job's live processes as (node, process), once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for proc in cluster.rank_processes(job):
            try:
                found.append((proc.environ()["GANGD_NODE"], proc))
            except (psutil.Error, KeyError):
                pass
        if len(found) == count:
            return sorted(found, key=lambda np: (np[0], np[1].pid))
        assert time.monotonic() < deadline, f"job {job} has {len(found)} processes, expected {count}: {[(n, p.pid) for n, p in found]}"
        time.sleep(0.05)


def state(pid: int) -> str:
    """'running', 'stopping' (SIGSTOP pending, or freezing), 'stopped' (or frozen) or 'gone'."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            text = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    letter = fields["State"].split()[0]
    if letter in ("T", "t"):
        return "stopped"
    if letter in ("Z", "X"):
        return "gone"
    if (int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & STOP_BIT:
        return "stopping"
    return _freezer_state(pid)  # gangd stops a rank by freezing its cgroup where it can


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mounts") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return fields[1]
    return None


def _freezer1_mount() -> str | None:
    with open("/proc/self/mounts") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup" and "freezer" in fields[3].split(","):
                return fields[1]
    return None


CGROUP2_MOUNT = _cgroup2_mount()
FREEZER1_MOUNT = _freezer1_mount()


def _freezer_state(pid: int) -> str:
    """A process not stopped by signal: 'stopped' if its v2 cgroup is frozen
    (every task in it is), or its v1 freezer cgroup reads FROZEN; 'stopping'
    while freezing, else 'running'."""
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        _, controllers, cgroup = line.split(":", 2)
        if controllers == "" and CGROUP2_MOUNT is not None:
            path = f"{CGROUP2_MOUNT}{cgroup}"
            if _read(f"{path}/cgroup.freeze") == "1":
                return "stopped" if "frozen 1" in _read(f"{path}/cgroup.events") else "stopping"
        if "freezer" in controllers.split(",") and FREEZER1_MOUNT is not None and cgroup != "/":
            v1 = _read(f"{FREEZER1_MOUNT}{cgroup}/freezer.state")
            if v1 in ("FROZEN", "FREEZING"):
                return "stopped" if v1 == "FROZEN" else "stopping"
    return "running"


def by_node(procs: list[tuple[str, psutil.Process]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for node, proc in procs:
        out.setdefault(node, []).append(proc.pid)
    return out


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


def all_in(pids, wanted: str) -> bool:
    return all(state(p) == wanted for p in pids)


class Exclusion:
    """Sandwiched samples of two jobs X and Y that share nodes."""

    def __init__(self, x: dict[str, list[int]], y: dict[str, list[int]]):
        self.nodes = sorted(set(x) & set(y))
        assert self.nodes, "the two jobs share no node"
        self.x, self.y = x, y
        self.samples = 0
        self.discarded = 0  # samples too slow to prove anything
        self.overlaps: list[tuple] = []
        self.x_only = dict.fromkeys(self.nodes, 0)  # X ran, Y stopped
        self.y_only = dict.fromkeys(self.nodes, 0)

    def _read(self, job):
        return {n: {p: state(p) for p in job[n]} for n in self.nodes}

    def sample(self) -> None:
        began = time.monotonic()
        x1, y1, x2, y2 = self._read(self.x), self._read(self.y), self._read(self.x), self._read(self.y)
        if time.monotonic() - began > TIME_SLICE / 2:
            # This process was descheduled mid-sample (busy ranks and other
            # load share the cores): two switches may fit between its reads.
            self.discarded += 1
            return
        self.samples += 1
        for n in self.nodes:
            # the same process of one job running before and after a process of
            # the other did: they ran at the same time (no switch fits in between)
            for first, between, second, who in ((x1, y1, x2, "X"), (y1, x2, y2, "Y")):
                both_ends = [p for p, s in first[n].items() if s == "running" and second[n][p] == "running"]
                middle = [p for p, s in between[n].items() if s == "running"]
                if both_ends and middle:
                    self.overlaps.append((n, who, first[n], between[n], second[n]))
            if all(s == "running" for s in x1[n].values()) and all(s == "stopped" for s in y1[n].values()):
                self.x_only[n] += 1
            if all(s == "running" for s in y1[n].values()) and all(s == "stopped" for s in x2[n].values()):
                self.y_only[n] += 1

    def run(self, seconds: float) -> Exclusion:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(0.002)
        return self

    def check(self) -> None:
        assert self.samples > 10 * self.discarded, f"{self.discarded} samples too slow, {self.samples} usable: the machine is too loaded to tell"
        assert not self.overlaps, f"{len(self.overlaps)} of {self.samples} samples caught both jobs running on one node: {self.overlaps[:5]}"
        for n in self.nodes:
            assert self.x_only[n] > 0 and self.y_only[n] > 0, (
                f"on {n} never saw one job run while the other was stopped ({self.samples} samples: "
                f"X alone {self.x_only[n]}, Y alone {self.y_only[n]})"
            )


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def cli_as(uid: int, cluster, *args) -> dict:
    """`gang ARGS` as another uid, in-process (the venv's python is not reachable by other uids)."""

    def invoke():
        result = CliRunner().invoke(cli.main, ["--cluster", str(cluster.dir), *map(str, args)])
        return {"code": result.exit_code, "output": result.output}

    return as_uid(uid, invoke)


# ---------------------------------------------------------------- rotation


def test_overlapping_jobs_alternate_and_never_run_together_on_a_node(gc):
    a = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "alt-a", "--", *BUSY)
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "alt-b", "--", *BUSY)
    wait_state(gc, a, LAUNCHED)
    wait_state(gc, b, LAUNCHED)

    sched = gang_schedule(gc)
    assert sched["max_slots"] == 2 and sched["time_slice"] == TIME_SLICE
    assert sched["slots"] == [
        {"n1": [a], "n2": [a], "n3": [], "n4": []},
        {"n1": [b], "n2": [b], "n3": [], "n4": []},
    ]

    # `gang ps` shows each job both RUNNING and SUSPENDED, never both RUNNING at once
    seen: dict[int, set[str]] = {a: set(), b: set()}
    deadline = time.monotonic() + 30
    while not all(s >= {"RUNNING", "SUSPENDED"} for s in seen.values()):
        assert time.monotonic() < deadline, f"states seen in 30 s: {seen}"
        rows = gang_ps(gc)
        assert not (rows[a]["state"] == rows[b]["state"] == "RUNNING"), (rows[a], rows[b])
        for job in (a, b):
            seen[job].add(rows[job]["state"])
            assert rows[job]["held"] is None

    # the processes: on each node one job runs while the other is stopped, in turn
    pa, pb = processes(gc, a, 2), processes(gc, b, 2)
    assert [n for n, _ in pa] == [n for n, _ in pb] == ["n1", "n2"]
    Exclusion(by_node(pa), by_node(pb)).run(2.0).check()


def test_jobs_on_disjoint_nodes_share_a_slot_and_run_all_the_time(gc):
    c = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "left", "--", "sleep", "300")
    d = submit(gc, "-n", 2, "-w", "n3,n4", "--name", "right", "--", "sleep", "300")
    wait_state(gc, c, LAUNCHED)
    wait_state(gc, d, LAUNCHED)
    assert schedule(gc)["slots"] == [{"n1": [c], "n2": [c], "n3": [d], "n4": [d]}]
    text = gc.gang("nodes", check=True).stdout
    assert ">0" in text and "1 of 2 slots used" in text, text
    pids = [p.pid for _, p in processes(gc, c, 2) + processes(gc, d, 2)]
    deadline = time.monotonic() + 2
    rounds = 0
    while time.monotonic() < deadline or rounds < 3:
        rows = gang_ps(gc) if rounds == 0 else ps(gc)
        assert rows[c]["state"] == rows[d]["state"] == "RUNNING", (rows[c], rows[d])
        assert rows[c]["suspended_seconds"] == rows[d]["suspended_seconds"] == 0, (rows[c], rows[d])
        assert rows[c]["run_seconds"] > 0 and rows[d]["run_seconds"] > 0
        states = {p: state(p) for p in pids}
        assert all(s == "running" for s in states.values()), states
        rounds += 1
    sched = api(gc, lambda g: g.schedule(switches=True))
    assert not any(set(s["stop"]) & {c, d} for s in sched["switch_log"]), "a job that shares the only slot was stopped"


def test_cpu_is_shared_between_overlapping_jobs_and_accounting_is_honest(gc):
    a = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "share-a", "--", *BUSY)
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "share-b", "--", *BUSY)
    procs = {a: processes(gc, a, 2), b: processes(gc, b, 2)}
    before = {job: [cpu(p) for _, p in plist] for job, plist in procs.items()}
    ps_before = ps(gc)

    # both make progress: every rank of both jobs gets CPU time (the machine
    # may be shared, so wait for it rather than expect it within a fixed time)
    def grown():
        return {job: [cpu(p) - x for (_, p), x in zip(plist, before[job], strict=True)] for job, plist in procs.items()}

    deadline = time.monotonic() + 60
    while min(min(deltas) for deltas in grown().values()) < 0.4:
        assert time.monotonic() < deadline, f"CPU seconds each rank got in 60 s: {grown()}"
        time.sleep(0.1)
    used = grown()
    # ...in fair shares: with equal slices neither job gets most of it
    share_a, share_b = sum(used[a]), sum(used[b])
    assert min(share_a, share_b) > 0.3 * max(share_a, share_b), f"unfair share: {used}"
    t0 = time.time()
    rows = gang_ps(gc)
    t1 = time.time()
    for job in (a, b):
        assert rows[job]["cpu_seconds"] >= ps_before[job]["cpu_seconds"] + 0.5, (ps_before[job], rows[job])

    # live accounting: running + suspended is the time since the start, both parts real
    for job in (a, b):
        r = rows[job]
        total = r["run_seconds"] + r["suspended_seconds"]
        assert t0 - r["started"] - 0.5 <= total <= t1 - r["started"] + 0.05, (r, t0, t1)
        assert r["run_seconds"] > 0.15 * total and r["suspended_seconds"] > 0.15 * total, r

    # and the final record keeps the same account
    assert gc.gang("kill", a, b).returncode == 0
    for job in (a, b):
        r = wait_state(gc, job, "KILLED")
        total = r["run_seconds"] + r["suspended_seconds"]
        assert abs(total - (r["ended"] - r["started"])) < 0.5, r
        assert r["suspended_seconds"] > 0 and r["run_seconds"] > 0, r


FORK_SH = ["sh", "-c", 'sh -c "while :; do :; done" & wait']
# Forks only once it has been stopped and resumed (it notices a gap of a
# slice in the clock; no SIGCONT comes where gangd freezes cgroups): the child
# is none of the processes the daemon knew when it switched the job first.
FORK_LATE = [
    PY,
    "-c",
    (
        "import os, time\n"
        "last = time.monotonic()\n"
        "while (now := time.monotonic()) - last < 0.08: last = now\n"
        "os.fork()\n"
        "while True: pass\n"
    ),
]


def test_forked_processes_are_stopped_with_their_job(gc):
    f1 = submit(gc, "-n", 1, "-w", "n1", "--name", "fork-sh", "--", *FORK_SH)
    f2 = submit(gc, "-n", 1, "-w", "n2", "--name", "fork-late", "--", *FORK_LATE)
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "other", "--", *BUSY)
    forks = processes(gc, f1, 2) + processes(gc, f2, 2)
    other = processes(gc, b, 2)
    slots = schedule(gc)["slots"]
    assert slots[0] == {"n1": [f1], "n2": [f2], "n3": [], "n4": []} and slots[1]["n1"] == [b], slots
    # every process of the forking jobs, the late child included, gets stopped
    for _, proc in forks:
        wait_for(lambda proc=proc: state(proc.pid) == "stopped", 20, f"process {proc.pid} ({proc.cmdline()}) to be stopped")
    check = Exclusion(by_node(forks), by_node(other)).run(2.0)
    check.check()


# ---------------------------------------------------------------- suspend / resume

# Forks a `sleep` every 0.1 s (new processes the daemon has never seen) until
# the go file appears, then counts ten more and says so.
COUNTER = 'while [ ! -e "$0" ]; do sleep 0.1; done; i=0; while [ $i -lt 10 ]; do sleep 0.1; i=$((i+1)); done; echo "counted $i on $GANGD_NODE"'


def test_suspend_stops_every_process_until_resume_and_the_job_then_completes(gc, tmp_path):
    go = tmp_path / "go"
    job = submit(gc, "-n", 2, "-w", "n3,n4", "--name", "counter", "--", "sh", "-c", COUNTER, go)
    wait_state(gc, job, LAUNCHED)
    processes(gc, job, 4)  # each rank: the shell and its current `sleep`
    result = gc.gang("suspend", job)
    assert result.returncode == 0 and result.stdout.strip() == f"job {job}: SUSPENDED", result

    def frozen():
        procs = gc.rank_processes(job)
        return procs if procs and all(state(p.pid) == "stopped" for p in procs) else None

    procs = wait_for(frozen, 10, "every process of the suspended job to stop")
    assert {p.environ()["GANGD_NODE"] for p in procs} == {"n3", "n4"}
    pids = {p.pid for p in procs}
    used = sum(cpu(p) for p in procs)
    # stays stopped, everywhere, for a long time: no process runs, none is forked
    end = time.monotonic() + 5
    while time.monotonic() < end:
        assert {p.pid for p in gc.rank_processes(job)} == pids
        states = {pid: state(pid) for pid in pids}
        assert all(s == "stopped" for s in states.values()), states
        row = ps(gc)[job]
        assert row["state"] == "SUSPENDED" and row["held"] == "root", row
        time.sleep(0.2)
    assert sum(cpu(p) for p in procs) == pytest.approx(used, abs=0.02)
    go.touch()  # seen only once the job runs again
    time.sleep(0.3)
    assert all(state(pid) == "stopped" for pid in pids)

    again = gc.gang("suspend", job)
    assert again.returncode == 1 and "only a running job can be suspended" in again.stderr, again

    result = gc.gang("resume", job)
    assert result.returncode == 0 and result.stdout.strip() == f"job {job}: RUNNING", result
    waited = gc.gang("wait", job, timeout=60)
    assert waited.returncode == 0, waited
    logs = gc.gang("logs", job, check=True).stdout.splitlines()
    assert sorted(logs) == ["0: counted 10 on n3", "1: counted 10 on n4"]
    again = gc.gang("resume", job)
    assert again.returncode == 1 and f"job {job} is DONE" in again.stderr, again
    final = gang_ps(gc)[job]
    assert final["state"] == "DONE" and final["held"] is None
    assert final["suspended_seconds"] >= 4.5, final
    assert final["run_seconds"] >= 1.0, final
    assert abs(final["run_seconds"] + final["suspended_seconds"] - (final["ended"] - final["started"])) < 0.5, final


@root_only
def test_another_user_cannot_suspend_or_resume_your_job(gc):
    job = submit(gc, "-n", 1, "-w", "n4", "--name", "roots", "--", "sleep", "300")
    wait_state(gc, job, LAUNCHED)
    (_, proc), = processes(gc, job, 1)
    outcome = cli_as(NOBODY, gc, "suspend", job)
    assert outcome.get("code") == 4 and "belongs to root" in outcome["output"], outcome
    assert state(proc.pid) == "running" and ps(gc)[job]["state"] == "RUNNING"
    assert gc.gang("suspend", job).returncode == 0
    wait_for(lambda: state(proc.pid) == "stopped", 10, "the job to stop")
    outcome = cli_as(NOBODY, gc, "resume", job)
    assert outcome.get("code") == 4 and "belongs to root" in outcome["output"], outcome
    time.sleep(0.3)
    assert state(proc.pid) == "stopped" and ps(gc)[job]["state"] == "SUSPENDED"


def test_suspend_and_resume_of_ended_or_unknown_jobs_are_clear_errors(gc):
    job = submit(gc, "-n", 1, "--", "true")
    wait_state(gc, job, "DONE")
    for action in ("suspend", "resume"):
        result = gc.gang(action, job)
        assert result.returncode == 1, result
        assert result.stderr.strip() == f"gang: job {job} is DONE", result
        missing = gc.gang(action, 99999)
        assert missing.returncode == 5 and "no job 99999" in missing.stderr, missing


# ---------------------------------------------------------------- kills and compaction

FORK_BUSY = ["sh", "-c", 'sh -c "while :; do :; done" & while :; do :; done']


def test_a_suspended_job_is_killed_at_once_and_the_other_runs_all_the_time(gc):
    a = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "held", "--", *FORK_BUSY)
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "free", "--", *BUSY)
    pa = processes(gc, a, 4)
    pb = processes(gc, b, 2)
    assert gc.gang("suspend", a).returncode == 0
    for _, proc in pa:
        wait_for(lambda proc=proc: state(proc.pid) == "stopped", 10, f"process {proc.pid} of the suspended job to stop")
    # a held job's slot is skipped: the other job runs without a break
    wait_for(lambda: all_in([p.pid for _, p in pb], "running"), 10, "the other job to run")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        states = {p.pid: state(p.pid) for _, p in pa + pb}
        assert [states[p.pid] for _, p in pa] == ["stopped"] * 4 and [states[p.pid] for _, p in pb] == ["running"] * 2, states
        time.sleep(0.005)
    assert ps(gc)[b]["state"] == "RUNNING"

    result = gc.gang("kill", a, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == f"job {a}: KILLED", result
    gc.wait_no_rank_processes(a, timeout=10)
    assert schedule(gc)["slots"] == [{"n1": [b], "n2": [b], "n3": [], "n4": []}]
    assert gang_ps(gc)[a]["state"] == "KILLED"


def test_a_descheduled_job_is_killed_at_once_and_the_matrix_compacts(gc):
    async def two(g):
        # the victim's slot runs 0.1 s, the other's 1.5 s: the victim is
        # descheduled almost all the time, long enough to kill it stopped
        victim = await g.submit(FORK_BUSY, 2, nodelist=["n1", "n2"], name="victim", time_slice=0.1)
        other = await g.submit(BUSY, 2, nodelist=["n1", "n2"], name="other", time_slice=1.5)
        return victim["id"], other["id"]

    victim, other = api(gc, two)
    pv = processes(gc, victim, 4)
    po = processes(gc, other, 2)
    assert [s["n1"] for s in schedule(gc)["slots"]] == [[victim], [other]]
    pids = [p.pid for _, p in pv]

    async def kill_when_stopped(g):
        with trio.fail_after(30):
            while not all_in(pids, "stopped"):  # noqa: ASYNC110 -- polls other processes' states in /proc: nothing to wait on
                await trio.sleep(0.005)
        return await g.kill(victim)

    record = api(gc, kill_when_stopped)
    assert record["state"] == "KILLED", record
    assert record["suspended_seconds"] > 0, record
    gc.wait_no_rank_processes(victim, timeout=10)
    # its slot is gone at once, the other job moved up into slot 0
    sched = gang_schedule(gc)
    assert sched["slots"] == [{"n1": [other], "n2": [other], "n3": [], "n4": []}] and sched["active_slot"] == 0, sched
    # and it runs all the time now (longer than its own 1.5 s slice would have lasted in rotation)
    wait_for(lambda: all_in([p.pid for _, p in po], "running"), 10, "the remaining job to run")
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        states = [state(p.pid) for _, p in po]
        assert states == ["running", "running"], states
        time.sleep(0.01)
    assert ps(gc)[other]["state"] == "RUNNING"


def test_a_finished_job_frees_its_slot_at_once_and_the_other_runs_all_the_time(gc, tmp_path):
    go = tmp_path / "go"
    waiter = 'while [ ! -e "$0" ]; do sleep 0.05; done; echo bye'
    a = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "short", "--", "sh", "-c", waiter, go)
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "long", "--", *BUSY)
    pb = processes(gc, b, 2)
    assert [s["n1"] for s in schedule(gc)["slots"]] == [[a], [b]]
    go.touch()
    assert gc.gang("wait", a, timeout=60).returncode == 0
    assert sorted(gc.gang("logs", a, check=True).stdout.splitlines()) == ["0: bye", "1: bye"]
    sched = schedule(gc)
    assert sched["slots"] == [{"n1": [b], "n2": [b], "n3": [], "n4": []}], sched
    wait_for(lambda: all_in([p.pid for _, p in pb], "running"), 10, "the remaining job to run")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert [state(p.pid) for _, p in pb] == ["running", "running"]
        assert ps(gc)[b]["state"] == "RUNNING"


# ---------------------------------------------------------------- admission


def test_max_slots_queues_the_third_overlapping_job_and_priority_overtakes(gc):
    sleeper = ["sleep", "300"]
    a = submit(gc, "-n", 1, "-w", "n1", "--name", "first", "--", *sleeper)
    b = submit(gc, "-n", 1, "-w", "n1", "--name", "second", "--", *sleeper)
    wait_state(gc, a, LAUNCHED)
    wait_state(gc, b, LAUNCHED)
    c = submit(gc, "-n", 1, "-w", "n1", "--name", "third", "--", *sleeper)

    async def more(g):
        d = await g.submit(sleeper, 1, nodelist=["n1"], name="urgent", priority=5)
        e = await g.submit(sleeper, 1, nodelist=["n1"], name="last", priority=-1)
        return d["id"], e["id"]

    d, e = api(gc, more)
    # two slots hold n1's one core twice; nobody else gets in
    for _ in range(3):
        rows = ps(gc)
        assert [rows[j]["state"] for j in (c, d, e)] == ["QUEUED"] * 3, [rows[j] for j in (c, d, e)]
        assert [s["n1"] for s in schedule(gc)["slots"]] == [[a], [b]]
        time.sleep(0.1)
    assert rows[d]["priority"] == 5 and rows[e]["priority"] == -1
    assert not gc.rank_processes(c) and not gc.rank_processes(d)

    # a slot frees: the priority job overtakes the older one
    assert gc.gang("kill", a).returncode == 0
    wait_state(gc, d, LAUNCHED)
    assert [ps(gc)[j]["state"] for j in (c, e)] == ["QUEUED", "QUEUED"]
    # then first come, first served
    assert gc.gang("kill", d).returncode == 0
    wait_state(gc, c, LAUNCHED)
    assert ps(gc)[e]["state"] == "QUEUED"
    assert gc.gang("kill", b).returncode == 0
    wait_state(gc, e, LAUNCHED)
    assert [s["n1"] for s in schedule(gc)["slots"]] == [[c], [e]]


@root_only
def test_only_root_may_raise_a_jobs_priority(gc):
    def attempt():
        async def main():
            async with connect(gc.dir) as g:
                try:
                    record = await g.submit(["true"], 1, cwd="/", env={"PATH": "/usr/bin:/bin"}, priority=1)
                    return {"api": "allowed", "id": record["id"]}
                except RemoteError as exc:
                    return {"api": [exc.code, exc.message]}

        return trio.run(main)

    outcome = as_uid(NOBODY, attempt)
    assert outcome["api"][0] == "permission_denied" and "only root" in outcome["api"][1], outcome
    # a negative priority (go last) is fine for anybody
    ok = as_uid(NOBODY, lambda: trio.run(_submit_low, str(gc.dir)))
    assert ok.get("final") == "DONE" and ok.get("priority") == -3, ok


async def _submit_low(directory):
    async with connect(directory) as g:
        record = await g.submit(["true"], 1, cwd="/", env={"PATH": "/usr/bin:/bin"}, priority=-3)
        final = await g.wait_done(record["id"])
        return {"state": record["state"], "final": final["state"], "priority": final["priority"]}


def test_gang_submit_passes_priority_and_time_slice_on(gc):
    record = json.loads(gc.gang("submit", "--json", "-n", 1, "-w", "n1", "--priority", 5, "--slice", 0.5, "--", "true", check=True).stdout)
    assert record["priority"] == 5 and record["slice"] == 0.5, {k: record[k] for k in ("id", "priority", "slice")}


@root_only
def test_gang_submit_refuses_a_raised_priority_for_a_user(gc):
    outcome = cli_as(NOBODY, gc, "submit", "-n", 1, "--priority", 1, "--", "true")
    assert outcome.get("code") == 4 and "only root may raise" in outcome["output"], outcome


def test_a_job_that_can_never_fit_is_refused_at_submit(gc):
    known = {r["id"] for r in gc.gang_json("ps", "--all")}
    result = gc.gang("submit", "-n", 5, "--", "true")
    assert result.returncode == 2, result
    assert "job asks for 5 ranks but the cluster can hold at most 4 (4 node(s) x their cores)" in result.stderr, result.stderr
    result = gc.gang("run", "-n", 3, "-w", "n1,n2", "--", "true")
    assert result.returncode == 2 and "at most 2" in result.stderr, result
    assert {r["id"] for r in gc.gang_json("ps", "--all")} == known
    assert schedule(gc)["slots"] == []


# ---------------------------------------------------------------- measurements


def test_switch_log_records_every_switch_with_its_latency_and_skew(gc):
    a = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "log-a", "--", "sleep", "300")
    b = submit(gc, "-n", 2, "-w", "n1,n2", "--name", "log-b", "--", "sleep", "300")
    wait_state(gc, a, LAUNCHED)
    wait_state(gc, b, LAUNCHED)

    def both_ways():
        log = api(gc, lambda g: g.schedule(switches=True))["switch_log"]
        ours = [s for s in log if set(s["stop"] + s["cont"]) == {a, b}]
        ways = {(tuple(s["stop"]), tuple(s["cont"])) for s in ours}
        return ours if {((a,), (b,)), ((b,), (a,))} <= ways and len(ours) >= 4 else None

    entries = wait_for(both_ways, 20, "switches from each job to the other", interval=0.2)
    # The rotation is announced ahead (switch_lead, 10 ms by default) and
    # every node acts at the announced instant, not on receipt: all the
    # nodes here share one clock, so none may begin before it. (A switch
    # decided late, or the one that brought a job in, is made on decision:
    # announced 0. How far ahead the message left depends on how late the
    # coordinator woke to send it, so only the bounds are the contract: ahead
    # of the instant, and never by more than half the slice.)
    assert [s for s in entries if s["announced"] > 0], entries
    for s in entries:
        assert s["nodes"] == len(s["per_node"]) == 2 and set(s["per_node"]) == {"n1", "n2"}, s
        assert s["latency"] >= 0 and s["skew"] >= 0 and s["round_trip"] >= 0, s
        assert s["skew"] <= s["latency"] <= s["round_trip"], s
        assert 0 <= s["announced"] <= TIME_SLICE / 2, s
        for node in s["per_node"].values():
            assert node["received"] <= node["start"] <= node["done"] <= s["latency"] + 1e-6, s
            assert node["start"] >= -50e-6 and node["cpu"] >= 0 and node["offset"] == 0.0, s

    # A switch nobody could foresee (a suspend) is made on decision.
    gc.gang("kill", b, check=True)
    wait_state(gc, b, TERMINAL)
    wait_state(gc, a, "RUNNING")  # alone now: it runs until suspended
    before = len(api(gc, lambda g: g.schedule(switches=True))["switch_log"])
    gc.gang("suspend", a, check=True)
    suspends = wait_for(
        lambda: [s for s in api(gc, lambda g: g.schedule(switches=True))["switch_log"][before:] if a in s["stop"] and s["announced"] == 0],
        10,
        "the suspend's switch",
    )
    for node in suspends[0]["per_node"].values():
        assert 0 <= node["received"] <= node["start"] <= node["done"], suspends[0]
    without = api(gc, lambda g: g.schedule())
    assert "switch_log" not in without and without["switches"] >= len(entries)
