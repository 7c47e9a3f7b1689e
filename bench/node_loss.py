"""From a node's loss to its job computing again, broken down (issue 16).

On a local cluster it starts itself (``--nodes`` nodes, the last one marked
``spare = true``), a job of three ranks, one per node on n1..n3, each rank
with ``--mib`` MiB of state (bench/loss_app.py), is checkpointed until the
generation is *protected* (``--level xor`` or ``partner``, or ``both`` one
after the other). Then a node of the job that is not the coordinator is
lost with its disk: its daemon and its rank SIGKILLed, its state and
checkpoint directories deleted. Nobody intervenes; the job comes back by
itself. The phases, from the daemons' own logs (their clocks are this
machine's) and rank 0's ``ITER`` lines:

  detection   SIGKILL -> the coordinator sees the node's lease expire
              (bounded by ``--lease-ttl``: the cost of not declaring a
              stalled node dead too early)
  decision    -> the job is RECOVERING (survivors killed, the recovery decided)
  rebuild     the lost node's files rebuilt on the spare from the partner
              copy or the XOR set (the replacement node's own figure)
  requeue     RECOVERING -> the new job of the lineage submitted (kill,
              rebuild, verify, staging)
  restart     -> the new job's first iteration printed (placement, launch,
              state read back, network context restored, gates opened)
  total       SIGKILL -> computing again

HONEST CAVEAT: every node is a directory on this one machine's disk and the
links are loopback; the rebuild's reads come from the page cache.

    python bench/node_loss.py [--mib 64] [--level xor|partner|both] [--lease-ttl 5] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from gangd.client import cluster as local

HERE = Path(__file__).resolve().parent
PY = sys.executable
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) \w+ \S+: (.*)$")


def gang(directory: Path, *args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([PY, "-m", "gangd.client.cli", "--cluster", str(directory), *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise SystemExit(f"gang {' '.join(map(str, args))}: {result.stderr.strip()}")
    return result


def gang_json(directory: Path, *args):
    return json.loads(gang(directory, *args, "--json").stdout)


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _files(directory: Path) -> dict[str, local.NodeFiles]:
    return {n.name: n for n in local.node_files(directory)}


def log_lines(directory: Path, node: str) -> list[tuple[float, str]]:
    """(wall-clock time, message) of every line of the node's daemon log."""
    out = []
    for line in _files(directory)[node].log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m:
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((at, m.group(3)))
    return out


def first(directory: Path, nodes: list[str], pattern: str, after: float) -> tuple[float, str] | None:
    found = [(at, text) for node in nodes for at, text in log_lines(directory, node) if at >= after - 0.01 and re.search(pattern, text)]
    return min(found) if found else None


def iters(directory: Path, job: int) -> list[tuple[int, float]]:
    text = gang(directory, "logs", job, check=False).stdout
    return [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"ITER (\d+) ([\d.]+)", text)]


def lose(directory: Path, node: str) -> float:
    """SIGKILL the node's daemon and its ranks, delete its disk; the time of the kill."""
    files = _files(directory)[node]
    pid = files.pid()
    if pid is None:
        raise SystemExit(f"gangd {node} is not running")
    ranks = []
    for proc in psutil.process_iter():
        try:
            if f"/{node}/" in proc.environ().get("GANGD_SOCKET", "") and proc.pid != pid:
                ranks.append(proc)
        except psutil.Error:
            continue
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    for proc in ranks:
        try:
            proc.kill()
        except psutil.Error:
            pass
    wait(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, f"gangd {node} to die")
    shutil.rmtree(files.state, ignore_errors=True)
    return at


def one(directory: Path, level: str, mib: float) -> dict:
    # Whole files (--ckpt-mode full): the rebuild moves the state, not a delta of it.
    job = int(gang(directory, "submit", "-n", 3, "-w", "n1,n2,n3", "--ckpt-redundancy", level, "--ckpt-mode", "full", "--",
                   PY, str(HERE / "loss_app.py"), "--mib", mib).stdout)
    wait(lambda: len(iters(directory, job)) >= 5, 120, "the job to compute")
    result = gang_json(directory, "checkpoint", job)
    if result.get("state") != "complete":
        raise SystemExit(f"checkpoint of job {job}: {result}")

    def protected():
        gens = gang_json(directory, "ckpt", "ls", job)["generations"]
        entry = next(g for g in gens if g["gen"] == result["gen"])
        return entry if entry["state"] == "protected" or entry.get("redundancy") else None

    entry = wait(protected, 120, "the generation to be protected")
    if entry["state"] != "protected":
        raise SystemExit(f"generation {entry['gen']} was not protected: {entry.get('redundancy')}")
    coordinator = next(r["name"] for r in gang_json(directory, "nodes")["nodes"] if r["coordinator"])
    victim = next(n for n in ("n3", "n2", "n1") if n != coordinator)
    killed = lose(directory, victim)
    old = wait(lambda: (lambda r: r if r.get("requeued_as") or r["state"] in ("FAILED", "DONE", "KILLED") else None)(
        gang_json(directory, "job", job)), 300, "the job's recovery")
    if not old.get("requeued_as"):
        raise SystemExit(f"job {job} was not recovered: {old['state']}: {old.get('reason')}")
    new = old["requeued_as"]
    computing = wait(lambda: iters(directory, new), 300, "the restarted job to compute")[0][1]
    live = [n.name for n in local.node_files(directory) if n.name != victim]
    detected = first(directory, live, rf"node {victim} is down", killed)
    recovering = first(directory, live, rf"job {job}: .*recovery 1 of at most", killed)
    requeued = first(directory, live, rf"job {job} recovered as job {new}", killed)
    rebuilt = first(directory, live, rf"rebuilt node {victim}'s", killed)
    rebuild_s = float(re.search(r"in ([\d.]+) s", rebuilt[1]).group(1)) if rebuilt else None
    gang(directory, "kill", new, check=False)
    phases = {
        "detection": detected[0] - killed if detected else None,
        "decision": recovering[0] - detected[0] if recovering and detected else None,
        "rebuild": rebuild_s,
        "requeue": requeued[0] - recovering[0] if requeued and recovering else None,
        "restart": computing - requeued[0] if requeued else None,
        "total": computing - killed,
    }
    return {"level": level, "job": job, "new_job": new, "victim": victim, "mib_per_rank": mib, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="state per rank (MiB)")
    parser.add_argument("--level", choices=["xor", "partner", "both"], default="both")
    parser.add_argument("--nodes", type=int, default=4, help="nodes of the cluster; the last is the spare (at least 4)")
    parser.add_argument("--lease-ttl", type=int, default=5, help="seconds a node's etcd lease lives: the detection time's bound")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.nodes < 4:
        parser.error("--nodes must be at least 4 (three for the job, one spare)")
    results = []
    for level in (["xor", "partner"] if args.level == "both" else [args.level]):
        base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gangd-loss-"))
        directory = base / f"cluster-{level}"
        print(f"# {level}: a {args.nodes}-node cluster in {directory} (lease TTL {args.lease_ttl} s, spare n{args.nodes})", file=sys.stderr)
        local.up(directory, args.nodes, cores=2, lease_ttl=args.lease_ttl, spares=(f"n{args.nodes}",), time_slice=0.2)
        try:
            results.append(one(directory, level, args.mib))
        finally:
            local.down(directory)
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"node loss -> computing again, 3 ranks x {args.mib:g} MiB, lease TTL {args.lease_ttl} s "
          "(every node on this one machine's disk; loopback links)")
    print(f"{'level':8} {'detection':>10} {'decision':>9} {'rebuild':>8} {'requeue':>8} {'restart':>8} {'total':>7}   (seconds)")
    for r in results:
        p = r["phases"]

        def f(key, p=p):
            return f"{p[key]:.2f}" if p[key] is not None else "-"

        print(f"{r['level']:8} {f('detection'):>10} {f('decision'):>9} {f('rebuild'):>8} {f('requeue'):>8} {f('restart'):>8} {f('total'):>7}")


if __name__ == "__main__":
    main()
