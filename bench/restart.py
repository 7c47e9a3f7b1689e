"""Restart speed against DMTCP: the ../shared/peers ring workload, both in the same run.

Issue 16's target: a gangd restart to the first progress line in at most
half the time DMTCP takes, on the peers' workload — ``--ranks`` (4) ranks x
``--mib`` (64) MiB of float64 state in a ring, one small message per
iteration (bench/ringjob.py, one program for both). Per repeat, alternating:

  gangd    a local cluster of ``--ranks`` nodes (started here, one rank and
           one core each): ``gang submit``, wait for the ring to run,
           ``gang checkpoint`` (returns once the generation is complete, on
           disk), ``gang kill``, then ``gang restart -q`` run as a user runs
           it — the time from starting that command to the restarted rank
           0's first progress line. Once per ``--idioms``: ``factory``
           (``ckpt.protect("u", lambda: build())``, the documented idiom)
           and ``build`` (the state built and then replaced, the older idiom);
           ``factory/api`` restarts through the Python API
           (``gangd.client.api``) instead: the same request without a
           command to start, what the command itself costs. The cluster
           runs warm rank servers (``--rank-server on``, the default here:
           a Python rank forked by a server that has numpy and gangd
           imported, src/gangd/daemon/rankserver.py); ``IDIOM/exec`` runs
           the job as ``python -B ...``, which no server forks (an
           interpreter option), so the same run shows the exec'd restart
           beside the served one. Each row says how many of its ranks were
           served; ``--phases`` adds the daemons' side of the breakdown
           (from their debug logs): the restarted job submitted — the
           coordinator's checks done —, its launch asked on the nodes, its
           ranks started (forked or exec'd).
  DMTCP    ``dmtcp_launch --no-gzip`` (its fastest restart; ``--dmtcp-gzip``
           adds its default, gzip), ``dmtcp_command -bc``, quit, a new
           coordinator, ``dmtcp_restart`` on the images — the time from
           starting that command to the first progress line.

Both are timed to the progress line's own timestamp (the rank prints the
time with the line), so the figure has no polling delay in it. Rank 0 prints
every ``--every`` (200) iterations, as in the peers' scripts: the line comes
0-200 iterations (0-0.3 s) after the restarted ring resumes, a delay both
pay alike; medians over ``--repeats`` even it out. So the run also prints
the time to the first iteration after the restart, from rank 0's
"resumed" line (bench/ringjob.py: its first iteration after a pause of over
0.3 s, for both), which has no such delay. Also printed: the
checkpoint time (command to generation complete) and the image size against
the state, for both; and where gangd's restart went, from rank 0's own
marks (seconds after the command started: its script started — the command,
the coordinator's checks, the launch and Python's start —, imported numpy
and gangd, restored its state in ``ckpt.init()``, joined the job's network
in ``comm.world()``, all ranks being there); and what the ``gang`` command
alone costs (its start and one answered request: ``gang restart`` of a job
that does not exist).

Python's own start is part of a gangd restart (a new process imports numpy
and gangd) and not of DMTCP's (it restores the old processes' memory).
gangd's modules are byte-compiled first (as ``pip install`` does), because an
editable install under ``PYTHONDONTWRITEBYTECODE`` would otherwise compile
them again in every rank (``--no-compile`` to measure that).

    python bench/restart.py [--repeats 3] [--ranks 4] [--mib 64] [--data random] [--idioms factory,factory/exec,factory/api]
                            [--rank-server on|off] [--phases]
                            [--dmtcp /tmp/peers/dmtcp-inst] [--dmtcp-gzip] [--every 200] [--json]

No DMTCP (``--dmtcp`` DIR/bin/dmtcp_launch missing): gangd's figures only,
and a line saying how to build it. The machine's other load shares the
cores: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

import gangd
from gangd.client import cluster as local
from gangd.client.api import connect

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "ringjob.py")
DMTCP_DEFAULT = "/tmp/peers/dmtcp-inst"  # noqa: S108 -- where ../shared/peers/dmtcp_bench.sh installs it
LINE = re.compile(rb"^it (\d+) acc \S+ at (\d+\.\d+)$", re.MULTILINE)
RESUMED = re.compile(rb"^resumed it (\d+) at (\d+\.\d+)$", re.MULTILINE)  # (the first iteration after a restart)
MiB = 1 << 20

out = sys.stdout


def say(*parts) -> None:
    print(*parts, file=out, flush=True)


class BenchError(Exception):
    pass


def job_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("GANGD_CKPT_BACKGROUND", "GANGD_RESTART", "GANGD_CKPT_DIR", "GANGD_CKPT_SPC")}


def gang_cli(directory: Path, *argv: str, timeout: float = 300) -> str:
    """Run ``gang`` as a user does (a new process); its stdout."""
    env = {**os.environ, "GANGD_CLUSTER": str(directory)}
    script = Path(sys.executable).parent / "gang"  # (the command a user runs, next to this Python)
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gangd.client.cli"]
    done = subprocess.run([*command, *argv], env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise BenchError(f"gang {' '.join(argv)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def command_cost(directory: Path, repeats: int = 5) -> list[float]:
    """Seconds for ``gang restart`` of a job that does not exist, start to exit:
    the command's own start and one answered request, without the restart."""
    env = {**os.environ, "GANGD_CLUSTER": str(directory)}
    script = Path(sys.executable).parent / "gang"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gangd.client.cli"]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        done = subprocess.run([*command, "restart", "999999"], env=env, capture_output=True, text=True, timeout=60, check=False)
        times.append(time.perf_counter() - t0)
        if done.returncode != 5:  # (5: no such job)
            raise BenchError(f"gang restart 999999: exit {done.returncode}: {done.stderr.strip()}")
    return times


# ---------------------------------------------------------------- gangd


TIMELINE = re.compile(rb"^timeline (.*)$", re.MULTILINE)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+ \S+: (.*)$")


def daemon_phases(directory: Path, job: int, t0: float, old: int | None = None) -> dict[str, float]:
    """With ``--phases`` (daemons logging at debug): when the restarted job
    was submitted (the coordinator's checks done), its launch asked on the
    first and last node, and its first and last rank started, in seconds after
    t0; and how long the coordinator took to choose the generation of ``old``
    (``choose``) and to verify its files on their nodes (``verify``)."""
    import datetime

    found: dict[str, list[float]] = {"submitted": [], "launch": [], "rank": []}
    for node in local.node_files(directory):
        try:
            text = node.log.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            match = STAMP.match(line)
            if not match:
                continue
            when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0
            message = match.group(2)
            if when < -0.01:
                continue
            if message.startswith(f"job {job} (") and "submitted" in message:
                found["submitted"].append(when)
            elif message.startswith(f"job {job}: launching"):
                found["launch"].append(when)
            elif re.match(rf"job {job} rank \d+: (forked|exec)", message):
                found["rank"].append(when)
            elif old is not None and (took := re.match(rf"job {old}: generation \d+ (chosen|verified) .* in (\d+\.\d+) s$", message)):
                found.setdefault({"chosen": "choose", "verified": "verify"}[took.group(1)], []).append(float(took.group(2)))
    phases = {k: max(found[k]) for k in ("choose", "verify") if found.get(k)}
    if found["submitted"]:
        phases["submitted"] = min(found["submitted"])
    for key in ("launch", "rank"):
        if found[key]:
            phases[f"{key} first"], phases[f"{key} last"] = min(found[key]), max(found[key])
    return phases


async def first_line(gang, job: int, timeout: float = 120) -> tuple[int, float, dict[str, float]]:
    """(iteration, unix time) of rank 0's first progress line of ``job``, and
    the times rank 0 printed before it (started, imported, init, world, protected)."""
    buffer = bytearray()
    with trio.move_on_after(timeout):
        async with gang.output(job, follow=True, ranks=[0]) as chunks:
            async for chunk in chunks:
                buffer += chunk["data"]
                found = LINE.search(buffer)
                if found:
                    marks = TIMELINE.search(buffer)
                    words = marks.group(1).decode().split() if marks else []
                    timeline = {k: float(v) for k, v in zip(words[::2], words[1::2], strict=False)}
                    resumed = RESUMED.search(buffer)
                    if resumed:
                        timeline["resumed"] = float(resumed.group(2))
                    return int(found.group(1)), float(found.group(2)), timeline
    record = await gang.job(job)
    said = bytes(buffer[-600:]).decode(errors="replace")
    raise BenchError(f"job {job} printed no progress line ({record['state']}: {record.get('reason') or '-'}); its rank 0 said: {said}")


async def until_ended(gang, job: int) -> None:
    with trio.fail_after(60):
        await gang.wait_done(job)


def served_ranks(directory: Path, job: int) -> tuple[int, int]:
    """(ranks of ``job`` forked by a rank server, ranks found): its parent tells."""
    served = found = 0
    for proc in psutil.process_iter(["environ", "ppid"]):
        env = proc.info["environ"] or {}
        if env.get("GANGD_JOB") != str(job) or not env.get("GANGD_SOCKET", "").startswith(str(directory)):
            continue
        found += 1
        try:
            served += any(part.endswith("rankserver_main.py") for part in psutil.Process(proc.info["ppid"]).cmdline())
        except psutil.Error:
            pass
    return served, found


async def gangd_trial(directory: Path, args, idiom: str, via_api: bool = False, exec_only: bool = False,
                      codec: str | None = None, restart: bool = True) -> dict:
    """One repeat: submit, checkpoint, kill, restart. ``codec``: the job's ``--ckpt-codec`` (None: the cluster's);
    ``restart=False`` stops after the checkpoint (bench/peers_gzip.py): no restart keys in the result then."""
    argv = [sys.executable, *(["-B"] if exec_only else []), JOB, "--mib", str(args.mib), "--data", args.data, "--idiom", idiom, "--every", str(args.every)]
    async with connect(directory) as gang:
        record = await gang.submit(argv, args.ranks, per_node=1, env=job_env(), cwd=str(HERE), name=f"ring-{idiom}", ckpt_codec=codec)
        job = record["id"]
        await first_line(gang, job, timeout=300)
        await trio.sleep(0.5)
        started = time.time()
        entry = await gang.checkpoint(job)
        checkpoint_s = time.time() - started
        if entry.get("state") not in ("complete", "protected"):
            raise BenchError(f"checkpoint of job {job}: {entry.get('state')}: {entry.get('reason')}")
        await trio.sleep(0.5)  # (the redundancy write, behind the job)
        await gang.kill(job)
        await until_ended(gang, job)
        if not restart:
            return {"idiom": idiom, "codec": codec, "job": job, "checkpoint_s": checkpoint_s, "cut": entry.get("iteration"),
                    "image_bytes": sum(node.get("bytes", 0) for node in (entry.get("nodes") or {}).values()),
                    "state_bytes": args.ranks * args.mib * MiB}
        await trio.sleep(1.0)  # as the peers' scripts do
        t0 = time.time()
        if via_api:  # (the same request from a running Python program: no command to start)
            new = (await gang.restart(job))["record"]["id"]
        else:
            new = int(await trio.to_thread.run_sync(lambda: gang_cli(directory, "restart", "-q", str(job)).strip()))
        returned = time.time() - t0
        iteration, printed, marks = await first_line(gang, new)
        served = await trio.to_thread.run_sync(served_ranks, directory, new)
        phases = daemon_phases(directory, new, t0, job) if args.phases else {}
        await gang.kill(new)
        await until_ended(gang, new)
    image = sum(node.get("bytes", 0) for node in (entry.get("nodes") or {}).values())  # (each node's own files; redundancy comes on top)
    return {
        "idiom": idiom, "job": job, "restarted_as": new, "checkpoint_s": checkpoint_s, "cut": entry.get("iteration"),
        "first_iteration_line": iteration, "restart_s": printed - t0, "restart_command_s": returned,
        "resume_s": marks["resumed"] - t0 if "resumed" in marks else None,
        "image_bytes": image, "state_bytes": args.ranks * args.mib * MiB,
        "rank0": {k: v - t0 for k, v in marks.items()},  # its script started, imported, init (restored), world, protected
        "served": served,  # (ranks a rank server forked, ranks found)
        "daemons": phases,  # (--phases: submitted, launch first/last, rank first/last)
    }


# ---------------------------------------------------------------- DMTCP


def dmtcp_bin(root: str) -> Path | None:
    binary = Path(root) / "bin"
    return binary if (binary / "dmtcp_launch").exists() and (binary / "dmtcp_restart").exists() else None


def wait_line(path: Path, timeout: float, proc: subprocess.Popen) -> tuple[int, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = LINE.search(path.read_bytes())
        except FileNotFoundError:
            found = None
        if found:
            return int(found.group(1)), float(found.group(2))
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    tail = path.read_bytes()[-600:].decode(errors="replace") if path.exists() else ""
    raise BenchError(f"no progress line in {path} ({'exit ' + str(proc.returncode) if proc.poll() is not None else 'timeout'}): {tail}")


def stop_group(proc: subprocess.Popen) -> None:
    """The launched program and whatever it forked (its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def dmtcp_trial(binary: Path, args, gzip: bool, restart: bool = True) -> dict:
    """One repeat: launch, ``dmtcp_command -bc``, quit, restart. ``restart=False`` stops after the checkpoint
    (bench/peers_gzip.py): no restart keys in the result then."""
    port = random.randint(7800, 8799)
    ring = random.randint(20000, 40000)
    work = Path(tempfile.mkdtemp(prefix="gangd-bench-dmtcp-"))
    coordinator = [str(binary / "dmtcp_coordinator"), "--daemon", "--exit-on-last", "-p", str(port)]
    command = [str(binary / "dmtcp_command"), "-p", str(port)]
    launched = restarted = None
    try:
        subprocess.run([*coordinator, "--ckptdir", str(work)], check=True, capture_output=True, timeout=30)
        argv = [sys.executable, JOB, "--under", "tcp", "--ranks", str(args.ranks), "--mib", str(args.mib), "--data", args.data,
                "--every", str(args.every), "--port", str(ring)]
        with open(work / "out", "wb") as output:
            launched = subprocess.Popen([str(binary / "dmtcp_launch"), "-p", str(port), "--ckptdir", str(work), *([] if gzip else ["--no-gzip"]), *argv],
                                        cwd=work, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        wait_line(work / "out", 300, launched)
        time.sleep(0.5)
        started = time.time()
        subprocess.run([*command, "-bc"], check=True, capture_output=True, timeout=600)
        checkpoint_s = time.time() - started
        images = sorted(work.glob("ckpt_*.dmtcp"))
        if not images:
            raise BenchError(f"dmtcp_command -bc left no image in {work}")
        size = sum(p.stat().st_size for p in images)
        if not restart:
            return {"gzip": gzip, "checkpoint_s": checkpoint_s, "image_bytes": size, "images": len(images),
                    "state_bytes": args.ranks * args.mib * MiB}
        subprocess.run([*command, "-q"], capture_output=True, timeout=60, check=False)
        stop_group(launched)
        time.sleep(1.0)  # as the peers' scripts do
        subprocess.run(coordinator, check=True, capture_output=True, timeout=30)
        with open(work / "rout", "wb") as output:
            t0 = time.time()
            restarted = subprocess.Popen([str(binary / "dmtcp_restart"), "-p", str(port), *map(str, images)],
                                         cwd=work, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        iteration, printed = wait_line(work / "rout", 120, restarted)
        resumed = RESUMED.search((work / "rout").read_bytes())
        return {"gzip": gzip, "checkpoint_s": checkpoint_s, "first_iteration_line": iteration, "restart_s": printed - t0,
                "resume_s": float(resumed.group(2)) - t0 if resumed else None,
                "image_bytes": size, "state_bytes": args.ranks * args.mib * MiB}
    finally:
        subprocess.run([*command, "-q"], capture_output=True, timeout=60, check=False)
        for proc in (launched, restarted):
            if proc is not None:
                stop_group(proc)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- report


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s (range {min(values):.2f}-{max(values):.2f})"


def report(rows: dict[str, list[dict]], args) -> dict:
    say(f"\nrestart to the first progress line, {args.ranks} ranks x {args.mib} MiB ({args.data}), {args.repeats} repeat(s), "
        f"line every {args.every} iterations:")
    summary: dict = {}
    for kind, trials in rows.items():
        if not trials:
            continue
        restart = [t["restart_s"] for t in trials]
        ckpt = [t["checkpoint_s"] for t in trials]
        ratio = statistics.median(t["image_bytes"] / t["state_bytes"] for t in trials if t["state_bytes"])
        extra = ""
        if kind.startswith("gangd"):
            served, found = sum(t["served"][0] for t in trials), sum(t["served"][1] for t in trials)
            extra = f"  (command returned after {spread([t['restart_command_s'] for t in trials])}; {served} of {found} ranks served)"
        say(f"  {kind:<22} restart {spread(restart)}   checkpoint {spread(ckpt)}   image {ratio:.2f}x state{extra}")
        phases = [k for k in ("started", "imported", "init", "world", "protected", "resumed") if all(k in t.get("rank0", {}) for t in trials)]
        daemon = [k for k in ("choose", "verify", "submitted", "launch first", "launch last", "rank first", "rank last")
                  if all(k in t.get("daemons", {}) for t in trials)]
        if daemon:
            say(f"  {'':<22} daemons (median s after the command; choose and verify: durations): " + ", ".join(
                f"{k} {statistics.median(t['daemons'][k] for t in trials):.3f}" for k in daemon))
        if phases:
            say(f"  {'':<22} rank 0 (median s after the command): " + ", ".join(
                f"{k} {statistics.median(t['rank0'][k] for t in trials):.2f}" for k in phases))
        summary[kind] = {"restart_s": statistics.median(restart), "restart_range": [min(restart), max(restart)],
                         "checkpoint_s": statistics.median(ckpt), "image_ratio": ratio}
    dmtcp = next((k for k in ("dmtcp --no-gzip", "dmtcp gzip") if summary.get(k)), None)
    if dmtcp:
        say(f"\ngangd / DMTCP ({dmtcp}), per repeat (same run) and of the medians (target: <= 0.50):")
        for kind in [k for k in rows if k.startswith("gangd")]:
            if not rows[kind]:
                continue
            pairs = [g["restart_s"] / d["restart_s"] for g, d in zip(rows[kind], rows[dmtcp], strict=False)]
            ckpt_pairs = [g["checkpoint_s"] / d["checkpoint_s"] for g, d in zip(rows[kind], rows[dmtcp], strict=False)]
            of_medians = summary[kind]["restart_s"] / summary[dmtcp]["restart_s"]
            say(f"  {kind:<22} restart {of_medians:.2f}x  (per repeat {', '.join(f'{p:.2f}' for p in pairs)})   "
                f"checkpoint {statistics.median(ckpt_pairs):.2f}x   image {summary[kind]['image_ratio'] / summary[dmtcp]['image_ratio']:.2f}x")
            summary[kind]["restart_ratio"] = of_medians
            summary[kind]["restart_ratio_per_repeat"] = pairs
        resumed = {kind: [t["resume_s"] for t in rows[kind] if t.get("resume_s") is not None] for kind in rows}
        if resumed[dmtcp]:
            say(f"\nto the first iteration after the restart (no progress-line delay; rank 0's 'resumed' line), "
                f"median, and gangd / {dmtcp} of the medians:")
            for kind in rows:
                if resumed[kind]:
                    ratio = statistics.median(resumed[kind]) / statistics.median(resumed[dmtcp])
                    say(f"  {kind:<22} {spread(resumed[kind])}" + (f"   {ratio:.2f}x" if kind.startswith("gangd") else ""))
                    summary.setdefault(kind, {})["resume_s"] = statistics.median(resumed[kind])
                    if kind.startswith("gangd"):
                        summary[kind]["resume_ratio"] = ratio
    return summary


def kill_strays(directory: Path) -> None:
    """Whatever a cluster in ``directory`` left running (its processes name the directory)."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(str(directory) in part for part in cmdline):
            say(f"(killing stray process {proc.pid}: {' '.join(cmdline[:4])})")
            proc.send_signal(signal.SIGKILL)


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for exc in group.exceptions for leaf in _leaves(exc)]
    return [group]


def main() -> None:
    global out
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64, help="state per rank")
    parser.add_argument("--data", choices=["smooth", "random"], default="random")
    parser.add_argument("--every", type=int, default=200, help="iterations between progress lines (the peers': 200)")
    parser.add_argument("--idioms", default="factory,factory/exec,build", help="gangd runs: factory, build, restarted (comma-separated); "
                        "IDIOM/api restarts through the Python API instead of the gang command; IDIOM/exec runs `python -B` (never served)")
    parser.add_argument("--rank-server", choices=["on", "off"], default="on", help="the cluster's warm rank servers (config rank_server)")
    parser.add_argument("--phases", action="store_true", help="daemons log at debug, and the breakdown has their phases: "
                        "the job submitted (the coordinator's checks), launched on the nodes, its ranks started")
    parser.add_argument("--dmtcp", default=DMTCP_DEFAULT, help="DMTCP's install prefix (bin/dmtcp_launch ...)")
    parser.add_argument("--dmtcp-gzip", action="store_true", help="also DMTCP with its default gzip compression")
    parser.add_argument("--no-compile", action="store_true", help="do not byte-compile gangd first")
    parser.add_argument("--json", action="store_true", help="every number as JSON on stdout (the text on stderr)")
    args = parser.parse_args()
    if args.json:
        out = sys.stderr
    idioms = [i for i in args.idioms.split(",") if i]
    binary = dmtcp_bin(args.dmtcp)
    if binary is None:
        say(f"DMTCP not found in {args.dmtcp} (no bin/dmtcp_launch): gangd only. Build it: git clone https://github.com/dmtcp/dmtcp && "
            f"./configure --prefix={DMTCP_DEFAULT} && make -j2 && make install, or give --dmtcp PREFIX.")
    if not args.no_compile:
        compileall.compile_dir(str(Path(gangd.__file__).parent), quiet=1)
    rows: dict[str, list[dict]] = {f"gangd {i}": [] for i in idioms}
    if binary is not None:
        rows["dmtcp --no-gzip"] = []
        if args.dmtcp_gzip:
            rows["dmtcp gzip"] = []
    result: dict = {"config": {**vars(args), "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}}
    say(f"restart bench: {args.ranks} ranks x {args.mib} MiB, gangd ({', '.join(idioms)}) and {'DMTCP' if binary else 'no DMTCP'}, "
        f"{args.repeats} repeat(s); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="gangd-bench-restart-") as tmp:
        directory = Path(tmp)
        local.up(directory, args.ranks, cores=1, log_level="debug" if args.phases else "warning", rank_server=args.rank_server == "on")
        try:
            try:
                result["command_s"] = command_cost(directory)
            except (BenchError, subprocess.SubprocessError) as exc:
                say(f"  the command's own cost: FAILED: {exc}")
            for repeat in range(args.repeats):
                for kind in rows:
                    try:
                        if kind.startswith("gangd"):
                            idiom, _, how = kind.split()[1].partition("/")
                            trial = trio.run(gangd_trial, directory, args, idiom, how == "api", how == "exec")
                        else:
                            assert binary is not None
                            trial = dmtcp_trial(binary, args, gzip=kind == "dmtcp gzip")
                    except (BenchError, subprocess.SubprocessError) as exc:
                        say(f"  [{repeat + 1}/{args.repeats}] {kind:<16} FAILED: {exc}")
                        continue
                    except BaseExceptionGroup as group:  # (trio's nurseries wrap a trial's BenchError)
                        failed, other = group.split((BenchError, subprocess.SubprocessError))
                        if failed is None or other is not None:
                            raise
                        say(f"  [{repeat + 1}/{args.repeats}] {kind:<16} FAILED: {'; '.join(map(str, _leaves(failed)))}")
                        continue
                    rows[kind].append(trial)
                    say(f"  [{repeat + 1}/{args.repeats}] {kind:<16} restart {trial['restart_s']:.2f} s (first line: iteration {trial['first_iteration_line']})"
                        f"   checkpoint {trial['checkpoint_s']:.2f} s, image {trial['image_bytes'] / MiB:.0f} MiB"
                        + (f", {trial['served'][0]}/{trial['served'][1]} ranks served" if "served" in trial else ""))
        finally:
            local.down(directory)
            kill_strays(directory)
    result["trials"] = rows
    result["summary"] = report(rows, args)
    if result.get("command_s"):
        say(f"\nthe gang command alone (its start and one answered request: `gang restart` of no job): {spread(result['command_s'])}")
    result["config"]["loadavg_end"] = os.getloadavg()
    say(f"(load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()


if __name__ == "__main__":
    main()
