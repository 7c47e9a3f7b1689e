"""`gang demo`: the whole story on a local cluster, narrated.

Brings up a 4-node cluster of real daemons and submits two jobs that each
fill the cluster and talk through gangd.comm: a checkpointable heat stencil
and a ring. Shows the coordinator's slot table and the two jobs alternating
(RUNNING / SUSPENDED) as they are gang-scheduled; checkpoints every running
job with a signal to one daemon; kills the heat job, restarts it from its
checkpoint next to an uninterrupted run of the same job, and checks that both
end bit-identical; then takes the cluster down.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import trio

from .. import jobs
from . import cluster as local
from .api import connect


def _step(text: str) -> None:
    click.secho(f"\n==> {text}", fg="cyan", bold=True)


def _gang(directory: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gangd.client.cli", "--cluster", str(directory), *args]
    click.secho("$ gang " + " ".join(args), fg="yellow")
    # A failing step is shown, not raised.
    return subprocess.run(cmd, text=True, capture_output=capture, check=False)  # noqa: S603 -- argv is the gang CLI under this interpreter


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
                if all(records[i]["state"] in jobs.TERMINAL_STATES for i in ids):
                    break
                await trio.sleep(0.05)
        return seen

    return trio.run(watch)


def _wait(directory: Path, what: str, ready, timeout: float = 60.0):
    """Poll ``ready(gang)`` until it returns something true."""

    async def poll():
        async with connect(directory) as gang:
            with trio.fail_after(timeout):
                while not (found := await ready(gang)):  # noqa: ASYNC110 -- polls the daemons over RPC: no local event to wait on
                    await trio.sleep(0.1)
                return found

    try:
        return trio.run(poll)
    except trio.TooSlowError:
        raise click.ClickException(f"demo: {what} did not happen within {timeout:.0f} s") from None


def _result(directory: Path, job: int) -> str | None:
    out = _gang(directory, "logs", "--no-label", str(job), capture=True).stdout
    sys.stdout.write(out)
    found = re.findall(r"RESULT (\w+)", out)
    return found[0] if found else None


def run_demo(nodes: int = 4, keep: bool = False) -> int:
    directory = Path(tempfile.mkdtemp(prefix="gangd-demo-"))
    cores = 4
    steps = "2000"
    _step(f"Starting a {nodes}-node cluster: {nodes} gangd daemons on 127.0.0.1..{nodes}, {cores} cores each, 0.5 s gang time slice")
    try:
        local.up(directory, nodes, cores=cores, time_slice=0.5, progress=lambda m: click.echo("  " + m))
    except local.ClusterError as exc:
        click.secho(f"demo failed: {exc}", fg="red", err=True)
        return 1
    ok = False
    try:
        _gang(directory, "nodes")
        nranks = str(cores * nodes)
        job = [sys.executable, "-m", "gangd.client.demojob"]
        _step(f"Submitting two {nranks}-rank jobs that each fill the whole cluster (they talk through gangd.comm)")
        click.echo("  job 'heat': a 2-D heat stencil exchanging halo rows, checkpointable with gangd.ckptlib")
        click.echo("  job 'ring': a 512 KiB array travels around the ring of ranks, each adding its rank number")
        heat_id = int(_gang(directory, "submit", "-n", nranks, "--name", "heat", "--", *job, "heat", steps, capture=True).stdout)
        ring_id = int(_gang(directory, "submit", "-n", nranks, "--name", "ring", "--", *job, "ring", "90", capture=True).stdout)
        _step("They cannot run side by side, so the coordinator put them in two time slots of its matrix")
        _gang(directory, "nodes")
        _step("Gang scheduling: every 0.5 s all ranks of one job stop on every node and the other's resume")
        seen = _watch(directory, [heat_id, ring_id], seconds=3)
        switched = all({"RUNNING", "SUSPENDED"} <= seen[i] for i in (heat_id, ring_id))
        n3 = local.node_files(directory)[min(2, nodes - 1)]
        _step(f"A consistent checkpoint of every running job: SIGUSR1 to gangd on {n3.name} (pid {n3.pid()})")
        click.echo("  every rank saves at the same iteration; the daemons close the send gates and save the messages in flight")
        pid = n3.pid()
        if pid is None:
            raise click.ClickException(f"gangd on {n3.name} is not running")
        os.kill(pid, signal.SIGUSR1)

        async def generation_done(gang):
            gens = (await gang.checkpoints(heat_id))["generations"]
            return gens[-1] if gens else None

        gen = _wait(directory, "the checkpoint", generation_done)
        _gang(directory, "ckpt", "ls", str(heat_id))
        _gang(directory, "ckpt", "stats", str(heat_id))
        click.echo("  (the ring job does not use gangd.ckptlib: it was left alone)")
        _step("Disaster: the heat job is killed")
        _gang(directory, "kill", str(heat_id))
        _step(f"Restarting it from generation {gen['gen']} (iteration {gen['iteration']}), next to an uninterrupted run of the same job")
        restarted = _gang(directory, "restart", "-q", str(heat_id), capture=True).stdout.strip()
        click.echo(f"  restarted as job {restarted}")
        fresh = _gang(directory, "submit", "-n", nranks, "--name", "heat-ref", "--", *job, "heat", steps, capture=True).stdout.strip()
        ids = [int(restarted), int(fresh), ring_id]
        _gang(directory, "nodes")
        _watch(directory, ids, seconds=180)
        _step("Every job ended")
        _gang(directory, "ps", "--all")
        ring_out = _gang(directory, "logs", "--no-label", str(ring_id), capture=True).stdout
        sys.stdout.write(ring_out)
        after = _result(directory, int(restarted))
        reference = _result(directory, int(fresh))
        _step("Result")
        same = gen["state"] in ("complete", "protected") and after is not None and after == reference
        click.echo(f"  restarted heat job: {after}")
        click.echo(f"  uninterrupted run:  {reference}")
        click.echo(f"  bit-identical after checkpoint, kill and restart: {'yes' if same else 'NO'}")
        click.echo("  " + (ring_out.strip().splitlines() or ["ring: no output"])[-1])
        click.echo(f"  both jobs were seen RUNNING and SUSPENDED in turn: {'yes' if switched else 'no'}")
        ok = same and "ring OK" in ring_out and switched
    except click.ClickException as exc:
        click.secho(exc.format_message(), fg="red", err=True)
    finally:
        if keep:
            _step(f"Leaving the cluster running: export GANGD_CLUSTER={directory}; gang cluster down when done")
        else:
            _step("Stopping the cluster")
            stopped = local.down(directory)
            click.echo(f"  stopped {', '.join(stopped)}")
    click.secho("\ndemo " + ("succeeded" if ok else "FAILED"), fg="green" if ok else "red", bold=True)
    return 0 if ok else 1
