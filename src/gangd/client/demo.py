"""`gang demo`: the whole story on a local cluster, narrated.

For now: bring up a 4-node cluster of real daemons, run a 16-rank job across
it with live rank-prefixed output, check the result, show `gang ps` and
`gang nodes`, and take the cluster down.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from . import cluster as local


def _step(text: str) -> None:
    click.secho(f"\n==> {text}", fg="cyan", bold=True)


def _gang(directory: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), *args]
    click.secho("$ gang " + " ".join(args), fg="yellow")
    return subprocess.run(cmd, text=True, capture_output=capture)


def run_demo(nodes: int = 4, keep: bool = False) -> int:
    directory = Path(tempfile.mkdtemp(prefix="gangd-demo-"))
    _step(f"Starting a {nodes}-node cluster: {nodes} gangd daemons on 127.0.0.1..{nodes}, each with its own state dir")
    try:
        local.up(directory, nodes, progress=lambda m: click.echo("  " + m))
    except local.ClusterError as exc:
        click.secho(f"demo failed: {exc}", fg="red", err=True)
        return 1
    ok = False
    try:
        _gang(directory, "nodes")
        nranks = 4 * nodes
        _step(f"Running a {nranks}-rank job across the cluster: each rank integrates a slice of 4/(1+x^2) on [0,1]")
        started = time.perf_counter()
        result = _gang(directory, "run", "-n", str(nranks), "--", sys.executable, "-m", "gangd.client.demojob", capture=True)
        took = time.perf_counter() - started
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        partials = [float(m) for m in re.findall(r"partial=([0-9.e+-]+)", result.stdout)]
        where = sorted(set(re.findall(r"on (n\d+)", result.stdout)))
        pi = math.fsum(partials)
        _step("Result")
        click.echo(f"  {len(partials)} of {nranks} ranks reported, from nodes {', '.join(where)}; job took {took:.2f} s end to end")
        click.echo(f"  pi ~= {pi!r} (error {abs(pi - math.pi):.2e}); gang run exit code {result.returncode}")
        ok = result.returncode == 0 and len(partials) == nranks and abs(pi - math.pi) < 1e-9 and len(where) == nodes
        _gang(directory, "ps")
    finally:
        if keep:
            _step(f"Leaving the cluster running: export GANGD_CLUSTER={directory}; gang cluster down when done")
        else:
            _step("Stopping the cluster")
            stopped = local.down(directory)
            click.echo(f"  stopped {', '.join(stopped)}")
    click.secho("\ndemo " + ("succeeded" if ok else "FAILED"), fg="green" if ok else "red", bold=True)
    return 0 if ok else 1
