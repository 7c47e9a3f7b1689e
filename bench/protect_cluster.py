"""Checkpoint redundancy end to end on a real local cluster: local vs partner vs xor.

Issue 16's bench, the cluster's side (``bench/recovery.py`` measures the
redundancy module's raw bandwidth between processes): a ``gang cluster up``
of ``--nodes`` daemons (default 3), one job per level, each ``--nodes``
ranks (one per node) holding ``--mib`` MiB of state, alternating levels
``--repeats`` times. For each checkpoint:

  complete   ``gang checkpoint`` until every node committed (the job
             blocked only for part of it; the rest written from a forked
             snapshot while it runs);
  protect    then the redundancy write behind the job (``protect_seconds``
             in the generation's entry: every node's share, over the bulk
             path), until the coordinator recorded it *protected*;
  bandwidth  checkpoint bytes / (complete + protect): what one generation
             that survives a lost node costs, against ``local``'s.

HONEST CAVEAT, printed with the figures: every node of a local cluster is a
directory on this machine's one disk and its links are loopback, so the
redundancy writes queue on the same disk as the local ones, and the shared
CPU runs every daemon and rank at once.

    python bench/protect_cluster.py [--mib 64] [--nodes 3] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gangd.client import cluster as local

PY = sys.executable
LEVELS = ("local", "partner", "xor")

JOB = """
import sys, time
import numpy as np
from gangd import ckptlib as ckpt
ckpt.init()
state = ckpt.protect("state", lambda: np.random.default_rng(1).random(int(float(sys.argv[1]) * 2**20 / 8)))
for it in ckpt.loop(range(10**9)):
    state[it % state.size] += 1.0
    time.sleep(0.01)
"""


def gang(directory: Path, *args, timeout: float = 600) -> str:
    cmd = [PY, "-m", "gangd.client.cli", "--cluster", str(directory), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise SystemExit(f"gang {' '.join(map(str, args))} failed: {result.stderr.strip()}")
    return result.stdout


def entry(directory: Path, job: int, gen: int) -> dict:
    listing = json.loads(gang(directory, "ckpt", "ls", job, "--json"))
    return next(g for g in listing["generations"] if g["gen"] == gen)


def measure(directory: Path, job: int, level: str) -> dict:
    result = json.loads(gang(directory, "checkpoint", job, "--json"))
    if result["state"] != "complete":
        raise SystemExit(f"checkpoint of job {job} ended {result['state']}: {result.get('reason')}")
    complete = result["ended"] - result["started"]
    size = sum(n["bytes"] for n in result["nodes"].values())
    protect = 0.0
    if level != "local":
        deadline = time.monotonic() + 600
        while (g := entry(directory, job, result["gen"]))["state"] == "complete" and not g.get("redundancy"):
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job}: generation {result['gen']} not protected after 600 s")
            time.sleep(0.05)
        if g["state"] != "protected":
            raise SystemExit(f"job {job}: generation {result['gen']} not protected: {g.get('redundancy')}")
        protect = g["protect_seconds"]
    return {"level": level, "bytes": size, "complete": complete, "protect": protect, "bandwidth": size / (complete + protect)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="state per rank (MiB), one rank per node")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.nodes < 3:
        raise SystemExit("xor needs 3 nodes here (on 2 it is a mirror): --nodes 3 or more")
    base = Path(tempfile.mkdtemp(prefix="gangd-bench-"))
    os.chmod(base, 0o755)  # noqa: S103 -- traversable: the job runs as its submitter
    directory = base / "cluster"
    program = base / "state_job.py"
    program.write_text(JOB)
    os.chmod(program, 0o644)
    local.up(directory, args.nodes, cores=len(LEVELS))  # every job in one slot: none waits for a switch
    runs: list[dict] = []
    jobs: dict[str, int] = {}
    try:
        for level in LEVELS:
            # Whole files (--ckpt-mode full): each repeat protects the whole state, not the few blocks changed since the last.
            out = gang(directory, "submit", "-n", args.nodes, "--per-node", 1, "--ckpt-redundancy", level, "--ckpt-mode", "full", "--",
                       PY, program, args.mib)
            jobs[level] = int(out)
        deadline = time.monotonic() + 120
        while {r["id"]: r["state"] for r in json.loads(gang(directory, "ps", "--json"))} != dict.fromkeys(jobs.values(), "RUNNING"):
            if time.monotonic() > deadline:
                raise SystemExit("the bench's jobs did not all start within 120 s")
            time.sleep(0.1)
        time.sleep(2)
        for _ in range(args.repeats):
            for level in LEVELS:
                os.sync()
                runs.append(measure(directory, jobs[level], level))
    finally:
        for job in jobs.values():
            subprocess.run([PY, "-m", "gangd.client.cli", "--cluster", str(directory), "kill", str(job)], capture_output=True, check=False)
        local.down(directory)
        shutil.rmtree(base, ignore_errors=True)
    summary = {}
    for level in LEVELS:
        mine = [r for r in runs if r["level"] == level]
        summary[level] = {k: statistics.median(r[k] for r in mine) for k in ("bytes", "complete", "protect", "bandwidth")}
    for level in LEVELS:
        summary[level]["ratio"] = summary[level]["bandwidth"] / summary["local"]["bandwidth"]
    if args.json:
        print(json.dumps({"nodes": args.nodes, "mib": args.mib, "runs": runs, "summary": summary}, indent=2))
        return
    print(f"{args.nodes} nodes x {args.mib:g} MiB, {args.repeats} run(s) per level, medians:")
    print(f"{'level':8} {'complete s':>11} {'protect s':>10} {'MiB/s':>8} {'x local':>8}")
    for level in LEVELS:
        s = summary[level]
        print(f"{level:8} {s['complete']:11.3f} {s['protect']:10.3f} {s['bandwidth'] / 2**20:8.1f} {s['ratio']:8.2f}")
    print("caveat: one machine, one disk, loopback links, a shared CPU; on a cluster each node writes its share to its own disk.")


if __name__ == "__main__":
    main()
