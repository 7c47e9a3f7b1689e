"""The cost of time sharing: two compute-bound jobs gang-scheduled vs run one after the other.

Both jobs fill every core the cluster offers (one rank per physical core,
spread over the nodes), and each rank does a fixed amount of CPU work. The
same two jobs are run

  * directly   — the ranks as plain processes, job A then job B (no gangd)
  * one by one — through gangd, A then B (each alone on the cluster)
  * gang       — through gangd, submitted together: they share the cores
                 by gang scheduling, switching every time slice

and the makespan (first submit to last end) is compared. Throughput of
time sharing = makespan one-by-one / makespan gang-scheduled (target >= 95 %).

    python bench/timeshare.py [--work 3.0] [--slices 0.3,0.05] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from gangd.client import cluster as local
from gangd.client.api import connect

# A fixed amount of pure-Python work, calibrated once to take about --work seconds.
WORK = "import sys\nn = int(sys.argv[1])\nx = 0\nfor i in range(n):\n    x += i * i % 7\nprint(x)\n"


def calibrate(seconds: float) -> int:
    n = 2_000_000
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", WORK, str(n)], check=True, capture_output=True)
    per = (time.perf_counter() - t0) / n
    return int(seconds / per)


def direct(ranks: int, n: int) -> float:
    t0 = time.perf_counter()
    for _job in range(2):
        procs = [subprocess.Popen([sys.executable, "-c", WORK, str(n)], stdout=subprocess.DEVNULL) for _ in range(ranks)]
        for p in procs:
            p.wait()
    return time.perf_counter() - t0


async def through_gangd(directory: Path, ranks: int, per_node: int, n: int, together: bool, time_slice: float) -> float:
    argv = [sys.executable, "-c", WORK, str(n)]
    async with connect(directory) as gang:
        t0 = time.perf_counter()
        if together:
            a = await gang.submit(argv, ranks, per_node=per_node, time_slice=time_slice, name="A")
            b = await gang.submit(argv, ranks, per_node=per_node, time_slice=time_slice, name="B")
            for job in (a, b):
                assert (await gang.wait_done(job["id"]))["state"] == "DONE"
        else:
            for name in ("A", "B"):
                job = await gang.submit(argv, ranks, per_node=per_node, name=name)
                assert (await gang.wait_done(job["id"]))["state"] == "DONE"
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=float, default=3.0, help="CPU seconds of work per rank")
    parser.add_argument("--slices", default="0.3,0.05", help="time slices to try (s)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    nodes = min(cores, 2)
    per_node = max(1, cores // nodes)
    ranks = nodes * per_node
    n = calibrate(args.work)
    print(f"two jobs x {ranks} ranks ({nodes} nodes x {per_node}) on {cores} cores, ~{args.work:.1f} s of CPU work per rank")
    with tempfile.TemporaryDirectory(prefix="gangd-bench-") as tmp:
        directory = Path(tmp)
        for time_slice in [float(s) for s in args.slices.split(",")]:
            local.up(directory, nodes, cores=per_node, time_slice=time_slice, log_level="warning")
            try:
                for _ in range(args.repeats):
                    base = direct(ranks, n)
                    serial = trio.run(through_gangd, directory, ranks, per_node, n, False, time_slice)
                    gang = trio.run(through_gangd, directory, ranks, per_node, n, True, time_slice)
                    print(
                        f"slice {time_slice:>5.2f} s: direct {base:6.2f} s  one-by-one {serial:6.2f} s  gang {gang:6.2f} s  "
                        f"throughput gang/one-by-one {serial / gang:6.1%}  gang/direct {base / gang:6.1%}"
                    )
            finally:
                local.down(directory)
    print("target (issue 3): gang-scheduled throughput >= 95 % of one-by-one")


if __name__ == "__main__":
    main()
