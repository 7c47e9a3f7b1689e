"""What the checkpoint tests do again and again on a cluster: run, checkpoint, kill, restart, compare."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import trio

from gangd import ckptstore
from gangd.rpc import RemoteError

PY = sys.executable
TERMINAL = ("DONE", "FAILED", "KILLED")


def kill_what_is_left(cluster) -> None:
    """After a test: kill the jobs still alive, and wait until none of their processes is
    (as `gang ps` and `gang kill` would, from this process: no Python started per job)."""

    async def kill_alive(gang):
        for record in await gang.jobs():
            if record["state"] not in TERMINAL:
                with contextlib.suppress(RemoteError):  # (ended meanwhile)
                    await gang.kill(record["id"])

    cluster.ask(kill_alive, "kill")
    cluster.wait_no_rank_processes(timeout=10)


_references: dict[tuple, str] = {}


def reference(gc, argv: list[str], n: int = 4, *options, **kwargs) -> str:
    """RESULT of an uninterrupted run (cached per command)."""
    key = (tuple(argv), n, options)
    if key not in _references:
        try:
            run = gc.gang("run", "-n", n, *options, "--", PY, *argv, timeout=120, **kwargs)
        except subprocess.TimeoutExpired:
            alive = [r["id"] for r in gc.gang_json("ps") if r["state"] not in TERMINAL]
            raise AssertionError(f"gang run {argv} did not end in 120 s\n" + "\n".join(why_stuck(gc, j) for j in alive)) from None
        assert run.returncode == 0, run.stderr
        _references[key] = result_line(run.stdout)
    return _references[key]


def result_line(text: str) -> str:
    lines = [line.split("RESULT", 1)[1].strip() for line in text.splitlines() if "RESULT" in line]
    assert len(lines) == 1, f"expected one RESULT line in:\n{text}"
    return lines[0]


def submit(gc, argv: list[str], n: int = 4, *options, **kwargs) -> int:
    return int(gc.gang("submit", "-n", n, *options, "--", PY, *argv, check=True, **kwargs).stdout)


def result_of(gc, job: int, timeout: float = 60) -> str:
    """The result line of the computation ``job`` started: of its successor if
    it was requeued (a node lost, or a stall of the loaded machine taken for
    one, recovers it as a new job, as ``gang wait`` follows)."""
    for _ in range(5):
        try:
            record = gc.wait_state(job, (*TERMINAL, "REQUEUED"), timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{why_stuck(gc, job)}") from None
        if record["state"] != "REQUEUED":
            break
        job = record["requeued_as"]
    logs = gc.logs(job)  # (what `gang logs` prints, read in this process)
    assert record["state"] == "DONE", f"job {job} {record['state']}: {record['reason']}\n{logs}"
    return result_line(logs)


#: Why a checkpoint asked too early is refused: the job's ranks have not
#: reached ckpt.init() yet (or a restart just submitted is still QUEUED).
NOT_READY = ("has not called gangd.ckptlib.init()", "is QUEUED; only a running")


def checkpoint(gc, job: int, timeout: float = 90, *, ready: float = 60) -> dict:
    """The generation (complete or aborted), as `gang checkpoint JOB --json` prints it.

    Asked in this process, as the command asks (``gang.checkpoint(job, wait=True)``):
    the checkpoint tests take hundreds, and a `gang` for each was a Python
    start-up on a 2-core machine. The command itself is run by the tests of
    its output and exit code (test_checkpoint's refusals, test_submit_path's
    checkpointed job, test_protect_takeover's).

    One refused because the ranks do not take checkpoints *yet* (not in
    ckpt.init(), or the job still QUEUED) is asked again for up to ``ready``
    seconds, as a user's script would: a test cannot see the moment its ranks
    register, and a sleep before the first checkpoint was a race that a fast
    daemon lost (CI, 1 run in 2)."""

    async def take(gang):
        with trio.fail_after(timeout):  # (as the command's subprocess timeout was)
            return await gang.checkpoint(job, wait=True)

    deadline = time.monotonic() + ready
    while True:
        try:
            gen = gc.ask(take, f"checkpoint {job}")
        except AssertionError as exc:  # (refused as an error: the same wait)
            if not any(words in str(exc) for words in NOT_READY):
                raise
            gen = {"state": "refused", "reason": str(exc)}
        if gen["state"] != "refused" or not any(words in (gen.get("reason") or "") for words in NOT_READY):
            return gen
        assert time.monotonic() < deadline, f"job {job}'s ranks did not take checkpoints within {ready} s: {gen['reason']}"
        time.sleep(0.1)


def generations(gc, job: int) -> list[dict]:
    """What `gang ckpt ls JOB --json` lists (asked in this process: the tests poll it)."""
    return gc.ask(lambda gang: gang.checkpoints(job), f"ckpt ls {job}")["generations"]


#: Generation states a restart may use: complete, and protected (its redundancy written too).
USABLE = ("complete", "protected")


def settled(gc, job: int, timeout: float = 60) -> list[dict]:
    """The job's generations once no redundancy write is pending (every
    complete one above local is protected or failed to be)."""
    deadline = time.monotonic() + timeout
    while True:
        gens = generations(gc, job)
        if not [g for g in gens if g["state"] == "complete" and g.get("level", "local") != "local" and not g.get("redundancy")]:
            return gens
        assert time.monotonic() < deadline, f"job {job}: redundancy writes still pending after {timeout} s: {gens}"
        time.sleep(0.1)


def wait_generations(gc, job: int, count: int, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        complete = [g for g in generations(gc, job) if g["state"] in USABLE]
        if len(complete) >= count:
            return complete
        assert time.monotonic() < deadline, f"job {job}: {len(complete)} complete generations after {timeout} s: {generations(gc, job)}"
        time.sleep(0.1)


def kill_and_restart(gc, job: int, *extra) -> int:
    gc.ask(lambda gang: gang.kill(job), f"kill {job}")  # (as `gang kill` asks; `gang restart` is run as the user would)
    out = gc.gang("restart", job, "--json", *extra, check=True).stdout
    return json.loads(out)["record"]["id"]


def gen_dir(gc, node: str, lineage: int, gen: int) -> Path:
    return ckptstore.gen_dir(gc.dir / node / "state" / "checkpoints" / node, lineage, gen)


def wait_running_a_bit(gc, job: int, seconds: float = 1.0) -> None:
    """Until the job runs, then ``seconds`` more. Polled through `gang ps`, not
    in this process: the callers' seconds were set with a command's start-up
    in each poll, and a rank that has not called ckpt.init() yet fails the
    checkpoint that follows (no condition a test can see says it has)."""
    deadline = time.monotonic() + 20
    while (state := next((r["state"] for r in gc.gang_json("ps", "--all") if r["id"] == job), None)) not in ("RUNNING", "SUSPENDED"):
        assert time.monotonic() < deadline, f"job {job} is {state}, not running, after 20 s"
        time.sleep(0.1)
    time.sleep(seconds)


_holds = iter(range(1, 1 << 30))


def hold(gc, at: int) -> tuple[list[str], Path]:
    """ckptjob's options to idle after ``at`` steps until released, and the
    file whose creation releases it (``path.touch()``): a checkpoint, a
    suspension or a kill then lands mid-run however slow the machine is,
    and the job ends as soon as the test lets it (tests/jobs/ckptjob.py)."""
    release = gc.dir.parent / f"release-{os.getpid()}-{next(_holds)}"
    return ["--hold-at", str(at), "--release", str(release)], release


def wait_holding(gc, job: int, timeout: float = 60) -> None:
    """Until every rank of ``job`` (ckptjob with ``hold``) idles at its hold: each has called ckpt.init() and takes checkpoints."""
    deadline = time.monotonic() + timeout
    nranks = gc.job(job)["nranks"]
    while gc.logs(job).count(" holding at step ") < nranks:  # (read in this process: polled)
        assert time.monotonic() < deadline, f"job {job} did not reach its hold in {timeout} s\n{why_stuck(gc, job)}"
        time.sleep(0.1)


def why_stuck(gc, job: int) -> str:
    """What a job that does not end is doing: its channels, its output, what
    the daemons said of it, and (with py-spy installed) where each rank is."""
    parts = [f"--- gang net {job}", gc.gang("net", job).stdout, f"--- gang logs {job}", gc.gang("logs", job).stdout[-3000:]]
    for node in sorted(gc.files):
        lines = [line for line in gc.log(node).splitlines() if f"job {job}" in line]
        parts += [f"--- {node} log", "\n".join(lines[-15:])]
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy:
        for proc in gc.rank_processes(job):
            dump = subprocess.run([spy, "dump", "-p", str(proc.pid)], capture_output=True, text=True, check=False, timeout=30)
            parts += [f"--- rank {proc.environ().get('GANGD_RANK')} (pid {proc.pid})", dump.stdout[-2000:]]
    return "\n".join(parts)


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of ``path`` (negative: from the end), in place: a damaged file."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        where = f.tell()
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))
