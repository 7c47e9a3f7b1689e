"""Gang switch latency: from the switch's instant to the last node having resumed.

For each cluster size (default 2, 4 and 8 nodes) with 8 busy ranks per node,
two jobs that each fill every node are gang-scheduled against each other
with a short time slice, so the coordinator switches all the time. Each
size runs twice:

  announced    the default: the coordinator sends each rotation switch
               ``switch_lead`` (10 ms) before the slice ends, and every node
               makes it when its clock reaches the slice's end. The instant
               is the one the coordinator decided on.
  on decision  ``switch_lead = 0``: the coordinator sends the switch when
               the slice ends and the nodes make it on receipt. The instant
               is the coordinator's decision. (Unforeseeable switches, a
               job's end, ``gang suspend``, always go this way.)

Every switch is measured by the daemons themselves:

  * latency    the instant (coordinator clock) -> last node done resuming
               the incoming job (its SIGCONTs sent and gates opened)
  * skew       first node done -> last node done
  * round trip decision -> the coordinator has every node's answer

All nodes are daemons on this one machine (127.0.0.x), so their clocks are
the same clock (the daemons' offset estimates, printed by --timeline, are
exactly 0 then: see gangd/daemon/clock.py). Baseline, measured in the same
run: one process sending the same SIGSTOPs and SIGCONTs to the same
processes directly (no daemons, no network), a floor no switch can beat.

    python bench/switch.py [--nodes 2,4,8] [--per-node 8] [--slice 0.05] [--seconds 8] [--timeline]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import trio

from gangd.client import cluster as local
from gangd.client.api import connect

BUSY = ["/bin/sh", "-c", "while :; do :; done"]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def rank_pids(socket_prefix: str, job_id: int) -> list[int]:
    pids = []
    for proc in psutil.process_iter(["pid", "environ"]):
        env = proc.info.get("environ") or {}
        if env.get("GANGD_SOCKET", "").startswith(socket_prefix) and env.get("GANGD_JOB") == str(job_id):
            pids.append(proc.info["pid"])
    return pids


def direct_switch(stop: list[int], cont: list[int], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for pid in stop:
            os.kill(pid, signal.SIGSTOP)
        for pid in cont:
            os.kill(pid, signal.SIGCONT)
        times.append(time.perf_counter() - t0)
        stop, cont = cont, stop
    for pid in stop + cont:
        os.kill(pid, signal.SIGCONT)
    return times


async def measure(directory: Path, nodes: int, per_node: int, seconds: float, time_slice: float) -> dict:
    n = nodes * per_node
    async with connect(directory) as gang:
        a = await gang.submit(BUSY, n, per_node=per_node, name="busy-a", time_slice=time_slice)
        b = await gang.submit(BUSY, n, per_node=per_node, name="busy-b", time_slice=time_slice)
        while True:
            states = {r["id"]: r for r in await gang.jobs() if r["id"] in (a["id"], b["id"])}
            if any(r["state"] in ("DONE", "FAILED", "KILLED") for r in states.values()):
                raise SystemExit(f"a busy job ended: {[(r['id'], r['state'], r['reason']) for r in states.values()]}")
            if all(r["state"] in ("RUNNING", "SUSPENDED") for r in states.values()):
                break
            await trio.sleep(0.2)
        await trio.sleep(1.0)  # both launched and rotating
        before = len((await gang.schedule(switches=True))["switch_log"])
        await trio.sleep(seconds)
        log = (await gang.schedule(switches=True))["switch_log"][before:]
        # The baseline: the same signals from one process, while the daemons are idle.
        await gang.suspend(a["id"])
        await gang.suspend(b["id"])
        prefix = str(directory)
        pids_a, pids_b = rank_pids(prefix, a["id"]), rank_pids(prefix, b["id"])
        direct = direct_switch(pids_a, pids_b, 200)
        for job in (a, b):
            await gang.kill(job["id"])
    switches = [s for s in log if s["stop"] and s["cont"]]
    return {
        "switches": len(switches),
        "latency": [s["latency"] for s in switches],
        "skew": [s["skew"] for s in switches],
        "round_trip": [s["round_trip"] for s in switches],
        "direct": direct,
        "processes": len(pids_a) + len(pids_b),
        "per_node": [s["per_node"] for s in switches],
    }


def print_timeline(per_node: list[dict]) -> None:
    """Median per node, from the switch's instant (ms): when it got the
    request, began its part and was done; its CPU time; its clock offset."""
    nodes = sorted({n for entry in per_node for n in entry}, key=lambda n: (len(n), n))
    print("      per node, median: received / began / done (ms from the switch's instant), cpu, clock offset estimate")
    for n in nodes:
        cell = {k: pct([e[n][k] for e in per_node if n in e], 50) for k in ("received", "start", "done", "cpu", "offset")}
        print(
            f"      {n:>4} {cell['received'] * 1e3:7.2f} {cell['start'] * 1e3:6.2f} {cell['done'] * 1e3:6.2f}"
            f"  cpu {cell['cpu'] * 1e6:4.0f} us  offset {cell['offset'] * 1e6:+5.0f} us"
        )


MODES = {"announced": 0.01, "on decision": 0.0}  # switch_lead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,4,8", help="comma-separated cluster sizes")
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--slice", type=float, default=0.05, help="time slice (s): shorter = more switches")
    parser.add_argument("--seconds", type=float, default=8.0, help="measuring time per cluster size and mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--timeline", action="store_true", help="also print when each node received the switch, began and finished its part")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: choose among {', '.join(MODES)}")
    print(f"gang switch latency, {args.per_node} busy ranks per node x 2 jobs, slice {args.slice} s, {os.cpu_count()} cores")
    print(
        f"{'nodes':>5} {'mode':>11} {'switches':>8} {'lat p50':>8} {'lat p99':>8} {'skew p50':>9} {'skew p99':>9}"
        f" {'rtt p50':>8} {'direct p50':>10} {'p50/direct':>10}"
    )
    for nodes in [int(x) for x in args.nodes.split(",")]:
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="gangd-bench-") as tmp:
                directory = Path(tmp)
                local.up(directory, nodes, cores=args.per_node, time_slice=args.slice, switch_lead=MODES[mode], log_level="warning")
                try:
                    r = trio.run(measure, directory, nodes, args.per_node, args.seconds, args.slice)
                finally:
                    local.down(directory)
            ms = lambda values, p: pct(values, p) * 1e3  # noqa: E731 -- a one-line formatter for the row below
            print(
                f"{nodes:>5} {mode:>11} {r['switches']:>8} {ms(r['latency'], 50):>7.2f}ms {ms(r['latency'], 99):>7.2f}ms "
                f"{ms(r['skew'], 50):>8.3f}ms {ms(r['skew'], 99):>8.3f}ms {ms(r['round_trip'], 50):>7.2f}ms "
                f"{ms(r['direct'], 50):>9.3f}ms {pct(r['latency'], 50) / pct(r['direct'], 50):>9.1f}x"
            )
            if args.timeline:
                print_timeline(r["per_node"])
    print("targets (issue 3): p99 <= 4 ms at 8 nodes x 8 ranks, p50 <= 1 ms")


if __name__ == "__main__":
    main()
