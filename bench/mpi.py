"""MPI under gangd against MPICH's own mpiexec: `python -m mpi4py.bench pingpong`.

gangd only serves PMI at start-up; MPI's messages must go rank to rank as
under mpiexec (Hydra). Both launchers run the same pingpong, alternating,
in the same run; latency (8 B) and bandwidth (largest size) are compared:

* one node: both ranks on one gangd node (MPICH's shared memory);
* two nodes: one rank on each of two gangd nodes, MPICH forced onto TCP
  (MPIR_CVAR_NOLOCAL=1, ofi/tcp) for both launchers, as between two hosts.

Then spawn latency (issue 20): how long ``MPI.COMM_SELF.Spawn`` of 4
processes takes to return in a 1-rank job (the children start Python,
MPI_Init, connect to the parent), under each launcher, alternating.

    python bench/mpi.py [--repeats 3] [--max-size 4194304] [--json]
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
from pathlib import Path

from gangd.client import cluster as local

PY = sys.executable
MPIEXEC = shutil.which("mpiexec", path=str(Path(PY).parent)) or "mpiexec"
OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
SPAWNED = 4
#: A 1-rank program timing Spawn of SPAWNED copies of itself (which only disconnect).
#: (A file: PMI-1 is line-based, an argument holding newlines cannot be spawned, by Hydra either.)
SPAWN = f"""
import sys, time
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent != MPI.COMM_NULL:
    parent.Disconnect()
else:
    start = time.perf_counter()
    inter = MPI.COMM_SELF.Spawn(sys.executable, [sys.argv[0]], maxprocs={SPAWNED})
    print("spawn seconds", time.perf_counter() - start, flush=True)
    inter.Disconnect()
"""


def parse(text: str) -> dict[int, tuple[float, float]]:
    """{size: (bandwidth MB/s, mean seconds)} from pingpong's table."""
    rows = {}
    for raw in text.splitlines():
        line = raw.split(":", 1)[1] if raw[:1].isdigit() and ": " in raw[:6] else raw
        parts = line.replace("|", " ").replace("±", " ").split()
        if len(parts) >= 3 and parts[0].isdigit():
            rows[int(parts[0])] = (float(parts[1]), float(parts[2]))
    if not rows:
        raise RuntimeError(f"no pingpong table in:\n{text}")
    return rows


def run(cmd: list[str], env: dict) -> dict:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {result.returncode}: {result.stderr[-2000:]}")
    return parse(result.stdout)


def spawn_seconds(cmd: list[str], program: Path) -> float:
    result = subprocess.run([*cmd, PY, str(program)], capture_output=True, text=True, timeout=300, check=False)
    if result.returncode or "spawn seconds" not in result.stdout:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {result.returncode}: {result.stdout[-1000:]} {result.stderr[-2000:]}")
    return float(result.stdout.split("spawn seconds", 1)[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-size", type=int, default=4 << 20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bench = ["-m", "mpi4py.bench", "pingpong", "-n", str(args.max_size)]
    directory = Path(tempfile.mkdtemp(prefix="gangd-bench-mpi-")) / "cluster"
    local.up(directory, 2, cores=SPAWNED)  # (room for a parent and its SPAWNED children in one slot)
    gang = [PY, "-m", "gangd.client.cli", "--cluster", str(directory), "run", "--mpi", "-n", "2"]
    results = {}
    try:
        for name, nodes, extra in (("one node", "1", {}), ("two nodes (tcp)", "2", OVER_TCP)):
            env = dict(os.environ, **extra)
            samples = {"mpiexec": [], "gangd": []}
            for _ in range(args.repeats):
                samples["mpiexec"].append(run([MPIEXEC, "-n", "2", PY, *bench], env))
                samples["gangd"].append(run([*gang, "-N", nodes, "--", PY, *bench], env))
            small, large = 8, max(samples["gangd"][0])
            row = {}
            for launcher, runs in samples.items():
                row[launcher] = {
                    "latency_us": statistics.median(r[small][1] for r in runs) * 1e6,
                    "bandwidth_mb_s": statistics.median(r[large][0] for r in runs),
                }
            row["latency_ratio"] = row["gangd"]["latency_us"] / row["mpiexec"]["latency_us"]
            row["bandwidth_ratio"] = row["gangd"]["bandwidth_mb_s"] / row["mpiexec"]["bandwidth_mb_s"]
            row["large_size"] = large
            results[name] = row
        spawn: dict[str, list[float]] = {"mpiexec": [], "gangd": []}
        program = directory.parent / "spawn4.py"
        program.write_text(SPAWN)
        for _ in range(args.repeats):
            spawn["mpiexec"].append(spawn_seconds([MPIEXEC, "-n", "1"], program))
            spawn["gangd"].append(spawn_seconds([*gang[:-1], "1", "--"], program))
        results["spawn"] = {launcher: {"seconds": statistics.median(runs), "runs": runs} for launcher, runs in spawn.items()}
        results["spawn"]["ratio"] = results["spawn"]["gangd"]["seconds"] / results["spawn"]["mpiexec"]["seconds"]
    finally:
        local.down(directory)
        shutil.rmtree(directory.parent, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"mpi4py.bench pingpong, 2 ranks, median of {args.repeats} (alternating launchers)")
    print(f"{'':18} {'8 B latency us':>28} {'bandwidth MB/s (largest)':>34}")
    print(f"{'':18} {'mpiexec':>9} {'gangd':>9} {'ratio':>8} {'mpiexec':>11} {'gangd':>11} {'ratio':>8}")
    spawn = results.pop("spawn")
    for name, row in results.items():
        m, g = row["mpiexec"], row["gangd"]
        print(f"{name:18} {m['latency_us']:9.2f} {g['latency_us']:9.2f} {row['latency_ratio']:8.3f} "
              f"{m['bandwidth_mb_s']:11.1f} {g['bandwidth_mb_s']:11.1f} {row['bandwidth_ratio']:8.3f}")
    worst = max(max(abs(r["latency_ratio"] - 1), abs(r["bandwidth_ratio"] - 1)) for r in results.values())
    print(f"target: within 5 % of mpiexec -> {'ok' if worst <= 0.05 else 'MISS'} (worst {worst * 100:.1f} %)")
    print(f"Spawn of {SPAWNED} processes from 1 rank, median of {args.repeats} (alternating): "
          f"mpiexec {spawn['mpiexec']['seconds']:.3f} s, gangd {spawn['gangd']['seconds']:.3f} s, ratio {spawn['ratio']:.2f}")


if __name__ == "__main__":
    main()
