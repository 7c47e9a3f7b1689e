"""`gang demo`: the whole story on a local cluster, narrated.

Brings up a 4-node cluster of real daemons, submits two jobs that each fill
the cluster and talk through gangd.comm, shows the coordinator's slot table
and the two jobs alternating (RUNNING / SUSPENDED) as they are
gang-scheduled, checks both results and takes the cluster down.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import trio

from . import cluster as local
from .api import connect


def _step(text: str) -> None:
    click.secho(f"\n==> {text}", fg="cyan", bold=True)


def _gang(directory: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), *args]
    click.secho("$ gang " + " ".join(args), fg="yellow")
    return subprocess.run(cmd, text=True, capture_output=capture)


def _watch(directory: Path, ids: list[int], seconds: float) -> dict[int, set[str]]:
    """Print the jobs' states as the gang scheduler switches them; returns the states seen."""

    async def watch() -> dict[int, set[str]]:
        seen: dict[int, set[str]] = {i: set() for i in ids}
        t0 = trio.current_time()
        last = None
        async with connect(directory) as gang:
            while trio.current_time() - t0 < seconds:
                records = {r["id"]: r for r in await gang.jobs()}
                for i in ids:
                    seen[i].add(records[i]["state"])
                line = "   ".join(f"job {i} {records[i]['name']:<4} {records[i]['state']:<9}" for i in ids)
                if line != last:
                    click.echo(f"  t={trio.current_time() - t0:5.2f}s   {line}")
                    last = line
                if all(records[i]["state"] in ("DONE", "FAILED", "KILLED") for i in ids):
                    break
                await trio.sleep(0.05)
        return seen

    return trio.run(watch)


def run_demo(nodes: int = 4, keep: bool = False) -> int:
    directory = Path(tempfile.mkdtemp(prefix="gangd-demo-"))
    cores = 4
    _step(f"Starting a {nodes}-node cluster: {nodes} gangd daemons on 127.0.0.1..{nodes}, {cores} cores each, 0.5 s gang time slice")
    try:
        local.up(directory, nodes, cores=cores, time_slice=0.5, progress=lambda m: click.echo("  " + m))
    except local.ClusterError as exc:
        click.secho(f"demo failed: {exc}", fg="red", err=True)
        return 1
    ok = False
    try:
        _gang(directory, "nodes")
        nranks = cores * nodes
        job = [sys.executable, "-m", "gangd.client.demojob"]
        _step(f"Submitting two {nranks}-rank jobs that each fill the whole cluster (they talk through gangd.comm)")
        click.echo("  job 'pi':   every rank integrates a share of 4/(1+x^2) on [0,1]; allreduce adds them up")
        click.echo("  job 'ring': a 512 KiB array travels around the ring of ranks, each adding its rank number")
        pi_id = int(_gang(directory, "submit", "-n", str(nranks), "--name", "pi", "--", *job, "pi", "60000000", capture=True).stdout)
        ring_id = int(_gang(directory, "submit", "-n", str(nranks), "--name", "ring", "--", *job, "ring", "60", capture=True).stdout)
        _step("They cannot run side by side, so the coordinator put them in two time slots of its matrix")
        _gang(directory, "nodes")
        _step("Gang scheduling: every 0.5 s all ranks of one job stop on every node and the other's resume")
        seen = _watch(directory, [pi_id, ring_id], seconds=120)
        switched = all({"RUNNING", "SUSPENDED"} <= seen[i] for i in (pi_id, ring_id))
        _step("Both jobs ended")
        _gang(directory, "ps")
        pi_out = _gang(directory, "logs", "--no-label", str(pi_id), capture=True).stdout
        sys.stdout.write("".join(line + "\n" for line in pi_out.splitlines()[:4]) + "  ...\n")
        ring_out = _gang(directory, "logs", "--no-label", str(ring_id), capture=True).stdout
        sys.stdout.write(ring_out)
        match = re.search(r"pi=([0-9.e+-]+)", pi_out)
        pi = float(match.group(1)) if match else float("nan")
        where = sorted(set(re.findall(r"on (n\d+)", pi_out)))
        ring_ok = "ring OK" in ring_out
        _step("Result")
        click.echo(f"  pi ~= {pi!r} (error {abs(pi - math.pi):.2e}), partial sums from nodes {', '.join(where)}")
        click.echo("  " + (ring_out.strip().splitlines() or ["ring: no output"])[-1])
        click.echo(f"  both jobs were seen RUNNING and SUSPENDED in turn: {'yes' if switched else 'no'}")
        ok = abs(pi - math.pi) < 1e-9 and len(where) == nodes and ring_ok and switched
    finally:
        if keep:
            _step(f"Leaving the cluster running: export GANGD_CLUSTER={directory}; gang cluster down when done")
        else:
            _step("Stopping the cluster")
            stopped = local.down(directory)
            click.echo(f"  stopped {', '.join(stopped)}")
    click.secho("\ndemo " + ("succeeded" if ok else "FAILED"), fg="green" if ok else "red", bold=True)
    return 0 if ok else 1
