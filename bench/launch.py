"""Job launch latency: `gang run` of a trivial 4 nodes x 4 ranks job vs plain subprocess.

Measures, over repeated runs in the same session:
  * started: from the request to the moment the last rank began executing
    (each rank prints its own start time, CLOCK_REALTIME, same machine)
  * done:    from the request to the job reported finished with all output in
for three ways of running the same 16 processes:
  * subprocess — the baseline: 16 Popen calls from one Python process, wait all
  * gangd API  — gangd.client.api from an already-running Python process
  * gang CLI   — the `gang run` command, interpreter start-up included

``--rank python``: each rank is a Python script that imports numpy,
gangd.comm and gangd.ckptlib and prints the time once they are imported (a
real Python rank's start); with ``--rank-server on`` the cluster runs warm rank
servers (config ``rank_server``: those ranks forked by a server that has the
imports done, src/gangd/daemon/rankserver.py) — compare with ``off``.

    python bench/launch.py [--runs 20] [--nodes 4] [--per-node 4] [--rank sh|python] [--rank-server on|off]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from gangd.client import cluster as local
from gangd.client.api import connect

RANK_CMD = ["/bin/sh", "-c", "date +%s.%N"]
PYTHON_RANK = "import numpy, gangd.comm, gangd.ckptlib, time\nprint(f'{time.time():.6f}')\n"


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def baseline(n: int) -> tuple[float, float]:
    t0 = time.time()
    procs = [subprocess.Popen(RANK_CMD, stdout=subprocess.PIPE) for _ in range(n)]
    outs = [p.communicate()[0] for p in procs]
    done = time.time() - t0
    started = max(float(o) for o in outs) - t0
    return started, done


async def via_api(directory: Path, n: int, per_node: int) -> tuple[float, float]:
    async with connect(directory) as gang:
        t0 = time.time()
        record = await gang.submit(RANK_CMD, n, per_node=per_node)
        said: dict[int, bytes] = {}
        async with gang.output(record["id"]) as chunks:
            async for item in chunks:
                said[item["rank"]] = said.get(item["rank"], b"") + item["data"]
        stamps = [float(data) for data in said.values()]
        final = await gang.wait_done(record["id"])
        done = time.time() - t0
        assert final["state"] == "DONE" and len(stamps) == n, (final["state"], len(stamps))
        return max(stamps) - t0, done


def via_cli(directory: Path, n: int, per_node: int) -> tuple[float, float]:
    t0 = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), "run", "-n", str(n), "--per-node", str(per_node), "--no-label", "--",
         *RANK_CMD],
        capture_output=True,
        text=True,
        check=True,
    )
    done = time.time() - t0
    stamps = [float(line) for line in result.stdout.split()]
    assert len(stamps) == n
    return max(stamps) - t0, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--rank", choices=["sh", "python"], default="sh", help="what each rank runs (python: imports numpy and gangd)")
    parser.add_argument("--rank-server", choices=["on", "off"], default="off", help="warm rank servers (config rank_server)")
    args = parser.parse_args()
    n = args.nodes * args.per_node
    directory = Path(tempfile.mkdtemp(prefix="gangd-bench-")) / "cluster"
    if args.rank == "python":
        script = directory.parent / "rank.py"
        script.write_text(PYTHON_RANK)
        RANK_CMD[:] = [sys.executable, str(script)]
    local.up(directory, args.nodes, rank_server=args.rank_server == "on")
    try:
        results = {"subprocess": [], "gangd API": [], "gang CLI": []}
        for _ in range(2):  # warm-up: page cache, first connections
            baseline(n)
            trio.run(via_api, directory, n, args.per_node)
        for _ in range(args.runs):  # interleaved, so load drifts hit every method alike
            results["subprocess"].append(baseline(n))
            results["gangd API"].append(trio.run(via_api, directory, n, args.per_node))
            results["gang CLI"].append(via_cli(directory, n, args.per_node))
    finally:
        local.down(directory)
    base_started = statistics.median(s for s, _ in results["subprocess"])
    base_done = statistics.median(d for _, d in results["subprocess"])
    what = "a trivial job" if args.rank == "sh" else f"a Python job (numpy and gangd imported), rank servers {args.rank_server}"
    print(f"launch of {what}, {args.nodes} nodes x {args.per_node} ranks = {n} ranks, {args.runs} runs (times in ms)")
    print(f"{'method':<12} {'started p50':>12} {'p90':>8} {'x base':>8} {'done p50':>10} {'p90':>8} {'x base':>8}")
    for name, rows in results.items():
        started = [s * 1000 for s, _ in rows]
        done = [d * 1000 for _, d in rows]
        print(
            f"{name:<12} {statistics.median(started):12.1f} {pct(started, 90):8.1f} {statistics.median(started) / 1000 / base_started:8.2f}"
            f" {statistics.median(done):10.1f} {pct(done, 90):8.1f} {statistics.median(done) / 1000 / base_done:8.2f}"
        )


if __name__ == "__main__":
    main()
