"""``gang checkpoint``, ``gang restart`` and ``gang ckpt ls|stats``."""

from __future__ import annotations

import sys
import time

import click

from .. import text
from .cli import EXIT_ERROR, _cluster, _size, ask, describe_generation, emit_json, main, run_sync, table


@main.command(epilog="""\b
Examples:
  gang checkpoint 12            # wait until generation is complete (or aborted)
  gang checkpoint 12 --no-wait  # start it and return
  kill -USR1 $(pidof gangd)     # every running job of the cluster
  Ctrl-\\\\ on `gang run`         # the job in the foreground

The job's ranks must use gangd.ckptlib. Every rank saves at the same
iteration; messages in flight are saved by the daemons. Exit code 1 if the
checkpoint was aborted (the previous complete one stays usable).
""")
@click.argument("job", type=int)
@click.option("--wait/--no-wait", default=True, help="Wait for the checkpoint to complete (default) or return once it started.")
@click.option("--json", "as_json", is_flag=True, help="Print the generation as JSON.")
@click.pass_context
def checkpoint(ctx, job, wait, as_json):
    """Take a consistent checkpoint of a running or suspended job."""

    result = ask(_cluster(ctx), lambda gang: gang.checkpoint(job, wait=wait))
    if as_json:
        emit_json(result)
    elif not wait:
        click.echo(f"job {job}: checkpoint generation {result['gen']} started")
    else:
        click.echo(describe_generation(job, result))
    if wait and result["state"] != "complete":
        sys.exit(EXIT_ERROR)


@main.command(epilog="""\b
Examples:
  gang restart 12               # newest usable (complete or protected), intact generation, on its nodes
  gang restart 12 -g 3          # that generation
  gang restart 12 -w n3,n4      # on n3 and n4 (the ranks spread over them)
  gang restart 12 -N 1          # every rank on one node
  JOB=$(gang restart 12 -q) && gang wait $JOB

The restarted job is a new job; it continues after the saved iteration with
the messages that were in flight. Without -w or -N it runs on the nodes of
its checkpoint, or, if one of them is down, on nodes that are up. A rank that
runs on another node than the one holding its files gets them copied there
first, from node to node, each file checked against its source's manifest.
When the node holding them is lost (down, or its disk gone), a protected
generation's files are rebuilt on a replacement node from the partner copy or
the XOR set, and a flushed one's are taken from the flush directory.
Every file is checked first; a damaged generation is reported by node and
path and the next older usable one is used.
""")
@click.argument("job", type=int)
@click.option("-g", "--generation", type=int, help="Restart from this generation (default: the newest intact one).")
@click.option("-w", "--nodelist", metavar="N1,N2", help="Restart on these nodes (every one must be up).")
@click.option("-N", "--nodes", type=click.IntRange(min=1), help="Restart on this many nodes that are up.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the new job id.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def restart(ctx, job, generation, nodelist, nodes, quiet, as_json):
    """Restart an ended job from its newest usable checkpoint, here or on other nodes."""
    if nodelist is not None and nodes is not None:
        raise click.UsageError("give the nodes (-w) or their number (-N), not both")
    names = [n.strip() for n in nodelist.split(",") if n.strip()] if nodelist is not None else None
    if names is not None and not names:
        raise click.UsageError("-w needs at least one node name")

    from . import oneshot  # (one request: no trio to import, see gangd.client.oneshot)

    result = run_sync(lambda: oneshot.request(_cluster(ctx), "restart", job=job, gen=generation, nodelist=names, nodes=nodes))
    if as_json:
        emit_json(result)
        return
    for problem in result["skipped"]:
        click.echo(f"gang: skipped {problem}", err=True)
    new = result["record"]["id"]
    if quiet:
        click.echo(new)
    else:
        where = result.get("placement") or result["record"].get("pinned") or []
        on = f" on {', '.join(dict.fromkeys(where))}" if where else ""
        click.echo(f"job {job} restarted as job {new} from generation {result['gen']} (iteration {result['iteration']}){on}")


@main.group()
def ckpt():
    """Inspect checkpoints: `gang ckpt ls JOB`, `gang ckpt stats JOB`."""


def _generations(ctx, job):
    return ask(_cluster(ctx), lambda gang: gang.checkpoints(job))


@ckpt.command("ls", epilog="""\b
Examples:
  gang ckpt ls 12
  gang ckpt ls 12 --json
""")
@click.argument("job", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def ckpt_ls(ctx, job, as_json):
    """List a job's checkpoint generations (its restarts' too): state, size per node, times.

    \b
    STATE       complete (every node's files on disk), protected (its
                redundancy written too: it survives a lost node), aborted,
                damaged (a restart skips it), removed (by retention); the
                one under way is "running (PHASE)".
    REDUNDANCY  local, partner or xor (and "(writing)" while it is written).
    MODE, BASE  full, incremental, differential, rebase or mixed; the oldest
                generation a restore of it reads.
    WRITTEN     the bytes of its rank files, on disk (compressed if a codec
                was used).
    RESTORE     the bytes a restore reads, each block once. For a compressed
                delta, the blocks it takes from older generations are
                counted at their raw size: an upper bound.
    ITER        the iteration a restart resumes at; TOOK: request to complete.
    """
    listing = _generations(ctx, job)
    if as_json:
        emit_json(listing)
        return
    rows = []
    for g in listing["generations"]:
        per_node = ", ".join(f"{n}:{_size(s['bytes'])}" for n, s in sorted(g["nodes"].items())) or "-"
        started = time.strftime("%H:%M:%S", time.localtime(g["started"]))
        took = f"{g['ended'] - g['started']:.2f}s" if g.get("ended") else "-"
        iteration = "-" if g["iteration"] is None else g["iteration"]
        why = g.get("reason") or (f"redundancy {g['redundancy']}" if g.get("redundancy") else "") or g["trigger"]
        rows.append([g["gen"], g["job"], g["state"], _level(g), *_delta_columns(g), _codecs(g), iteration, started, took, per_node, why])
    live = listing["under_way"]
    if live:
        started = time.strftime("%H:%M:%S", time.localtime(live["started"]))
        rows.append([live["gen"], job, f"running ({live['phase']})", "-", "-", "-", "-", "-", "-", "-", started, "-", "-", live["trigger"]])
    recovered = listing.get("recoveries") or []
    if not rows and not recovered:
        click.echo(f"job {job} has no checkpoints")
        return
    if rows:
        headers = ["GEN", "JOB", "STATE", "REDUNDANCY", "MODE", "BASE", "WRITTEN", "RESTORE", "CODEC", "ITER", "STARTED", "TOOK", "SIZE PER NODE"]
        click.echo(table(rows, [*headers, "TRIGGER / REASON"]))
    codec = listing.get("codec")
    if isinstance(codec, str) and rows:  # (a daemon from before issue 18 does not say)
        click.echo(f"codec: {text.printable(codec, 140)} (the job's ranks compress new generations with it; each block records its own)")
    for r in recovered:  # (a job restarted by itself: gangd.daemon.recover)
        lost = ", ".join(text.name(n) for n in r.get("lost") or [])
        cause = f"lost {lost}" if lost or not r.get("cause") else f"stopped: {text.printable(str(r['cause']), 200)}"
        click.echo(f"recovery: job {r['job']} {cause}; requeued as job {r.get('as')} from generation {r.get('gen')}")


def _delta_columns(g: dict) -> list[str]:
    """MODE (full, incremental, differential, rebase, mixed), BASE (the oldest
    generation a restore of it reads: "-" for whole files), WRITTEN (the
    bytes of its rank files) and RESTORE (the bytes a restore reads, each
    block once) of a generation; "-" for one that wrote nothing."""
    if not g.get("nodes"):
        return ["-", "-", "-", "-"]
    needs = [n for n in g.get("needs") or [] if type(n) is int]
    written = g.get("written")
    if type(written) is not int:  # (an entry from before incremental checkpoints: whole files)
        written = sum(s.get("bytes", 0) for s in g["nodes"].values() if isinstance(s, dict))
    restore = g.get("restore_bytes")
    return [str(g.get("mode") or "full"), str(min(needs)) if needs else "-", _size(written),
            _size(restore if type(restore) is int else written)]


def _codecs(g: dict) -> str:
    """CODEC: the codecs a generation's files record (issue 18), as recorded (``name:params@version``);
    ``none`` for raw files, ``-`` for one that wrote nothing."""
    if not g.get("nodes"):
        return "-"
    codecs = g.get("codecs")
    if not isinstance(codecs, list) or not codecs:
        return "none"
    return text.printable(",".join(str(c) for c in codecs[:4]) + (",..." if len(codecs) > 4 else ""), 80)


def _level(g: dict) -> str:
    """A generation's redundancy as ``ckpt ls`` shows it: the level, and for a
    complete one whose level is not local, whether its write failed, a
    rebuild found it damaged, or it may still be under way (``protected`` in STATE: it survives a lost node)."""
    level = g.get("level") or "local"
    flushed = "+flushed" if g.get("flushed") else " (flush failed)" if g.get("flush") else ""
    if g["state"] != "complete" or level == "local":
        return level + flushed
    redundancy = g.get("redundancy")
    if isinstance(redundancy, str) and redundancy.startswith("damaged"):  # (a rebuild found it wrong: gangd.daemon.rebuild)
        return f"{level} (damaged)" + flushed
    return (f"{level} (failed)" if redundancy else f"{level} (writing)") + flushed


@ckpt.command("stats", epilog="""\b
Examples:
  gang ckpt stats 12
  gang ckpt stats 12 --json

Columns (milliseconds; paper 000's Table 4): PREP start sync + network
context, WRITE ranks saving (or forking their snapshot), FINISH end sync
including the wait for the slowest node, BLOCKED how long the ranks were
stopped, DISK until the state was on disk (time to durable: a forked
snapshot's job is blocked for milliseconds of it), SYNC prep + finish minus
waiting. For compressed writes (issue 18): IN and OUT the node's bytes
into and out of the compression, RATIO IN/OUT, STAGES each stage's busy
milliseconds (the slowest rank's; xN: N threads) -- the largest is the
bottleneck (paper 004: total ~ the longest stage).
""")
@click.argument("job", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def ckpt_stats(ctx, job, as_json):
    """Per-node breakdown of each checkpoint: prep, write, finish, blocked, disk, bandwidth."""
    listing = _generations(ctx, job)
    generations = [g for g in listing["generations"] if g["nodes"]]
    if as_json:
        emit_json(generations)
        return
    if not generations:
        click.echo(f"job {job} has no completed checkpoints")
        sys.exit(EXIT_ERROR)
    rows = []
    for g in generations:
        for node, s in sorted(g["nodes"].items()):
            ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731 -- a one-line formatter for the row below
            bw = f"{s['bandwidth'] / 2**20:.0f} MiB/s" if s.get("bandwidth") else "-"
            times = [ms(s[k]) for k in ("prep", "write", "finish", "blocked", "disk", "sync_overhead")]
            rows.append([g["gen"], node, _size(s["bytes"]), *times, bw, *_pipeline_columns(s.get("pipeline"))])
    click.echo(table(rows, ["GEN", "NODE", "SIZE", "PREP", "WRITE", "FINISH", "BLOCKED", "DISK", "SYNC", "BANDWIDTH",
                            "IN", "OUT", "RATIO", "STAGES (busy ms)"]))


def _pipeline_columns(p: object) -> list[str]:
    """IN, OUT, RATIO and STAGES of a node's compressed writes; dashes for raw ones (or a daemon before issue 18)."""
    if not isinstance(p, dict) or type(p.get("in")) is not int or type(p.get("out")) is not int:
        return ["-", "-", "-", "-"]
    stages = p.get("stages")
    if not isinstance(stages, dict):
        stages = {}
    busy = []
    for name, f in list(stages.items())[:8]:
        if name != "submit" and isinstance(f, dict) and type(f.get("busy_s")) in (int, float):  # (submit: the rank handing units over)
            workers = f.get("workers")
            busy.append(f"{text.printable(str(name), 16)} {f['busy_s'] * 1000:.0f}" + (f" x{workers}" if type(workers) is int and workers > 1 else ""))
    ratio = f"{p['in'] / p['out']:.2f}" if p["out"] else "-"
    return [_size(p["in"]), _size(p["out"]), ratio, ", ".join(busy) or "-"]


@ckpt.command("plan", epilog="""\b
Examples:
  gang submit -n 8 --ckpt-every auto -- python sim.py   # then:
  gang ckpt plan 12
  gang ckpt plan 12 --json

What the plan is made of (paper 002; Vaidya's model): C the overhead one
checkpoint costs the job (the time its ranks are blocked), L the time until
a generation survives a node loss (protected; with --ckpt-redundancy local
only when the node comes back), R the restart cost, λ the summed failure
rate of the job's nodes (from their history in etcd, the configured MTBF as
the prior: see `gang nodes`), and the time per iteration. The interval is
Vaidya's optimum; Young's sqrt(2·C·MTBF) and Daly's refinement are shown
beside it. The ranks are told "checkpoint at iteration N, then every M";
the plan is made again when C, R, L, λ or the time per iteration move by
more than [checkpoint] replan (default 25 %). For a job without
--ckpt-every auto the interval it would get is shown, in seconds.
""")
@click.argument("job", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def ckpt_plan(ctx, job, as_json):
    """Show a job's checkpoint interval plan: C, R, λ, the optimal interval, the next checkpoint."""
    plan = ask(_cluster(ctx), lambda gang: gang.interval_plan(job))
    if as_json:
        emit_json(plan)
        return
    m = plan.get("inputs") or {}
    basis = m.get("basis") or {}
    lam = m.get("lam") or 0.0

    def line(label: str, value: str, why: str | None = None) -> None:
        click.echo(f"  {label:<22}{value}" + (f"   ({text.printable(str(why), 200)})" if why else ""))

    mode = "planned (--ckpt-every auto)" if plan.get("auto") else f"not planned (--ckpt-every {plan.get('ckpt_every') or 'not set'})"
    click.echo(f"job {job}: {plan.get('state', '?')}, {mode}")
    line("checkpoint cost C", _seconds(m.get("C")), basis.get("C"))
    line("latency L", _seconds(m.get("L")), basis.get("L"))
    line("restart cost R", _seconds(m.get("R")), basis.get("R"))
    line("failure rate λ", f"{lam:.3g}/s (MTBF {_seconds(1 / lam) if lam else 'infinite'})", basis.get("lam"))
    if plan.get("auto"):
        line("time per iteration", _seconds(m.get("t_iter")), basis.get("t_iter"))
    line("optimal interval", f"{_seconds(plan.get('every_s'))} of computation (Young {_seconds(plan.get('young_s'))}, Daly {_seconds(plan.get('daly_s'))})")
    overhead = plan.get("overhead")
    line("predicted overhead", "-" if overhead is None else f"{overhead * 100:.2f} % (time lost to checkpoints and failures)")
    if plan.get("auto"):
        every, nxt = plan.get("every"), plan.get("next")
        line("plan", f"checkpoint at iteration {nxt}, then every {every} iterations" if nxt is not None else "not made yet")
        at, t_iter = plan.get("iteration"), m.get("t_iter")
        if at is not None:
            soon = f", the next checkpoint in about {_seconds(max(0, nxt - at) * t_iter)}" if nxt is not None and isinstance(t_iter, int | float) else ""
            line("ranks are at", f"iteration {at}{soon}")
    if not m.get("node_loss_survivable", True):
        click.echo("  note: with --ckpt-redundancy local a lost node's checkpoint files are lost with it; "
                   "the interval assumes the node comes back")


def _seconds(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    if value >= 120:
        return f"{value:.0f} s ({value / 60:.1f} min)" if value < 7200 else f"{value / 3600:.2f} h"
    return f"{value:.3g} s"
