"""Requests about checkpoints: from users (``gang checkpoint/restart/ckpt``), from
ranks (:mod:`gangd.ckptlib`), and between daemons (the rounds of
:mod:`gangd.daemon.ckptcoord`, served by :mod:`gangd.daemon.checkpoint`)."""

from __future__ import annotations

import trio

from ... import text
from ...checkpoint.messages import MAX_ITERATION, BadMessage, PlanNote
from ...failpoint import failpoint, refuse
from ...redundancy import transfer
from ...redundancy.plan import NODE_NAME
from ...rpc import RemoteError
from ..access import integer, job_for
from ..recover import recoveries
from .coord import coordinator
from .registry import CLIENT, PEER, Call, op

# ------------------------------------------------------------ users


@op("checkpoint", audience=CLIENT)
async def checkpoint(s, call: Call):
    """Checkpoint a job now; with ``wait`` (default) answer when the generation is complete or aborted."""
    cred, args = call.user, call.args
    job_id = integer(args, "job")
    return await s.calls.to_coordinator(
        "coord_checkpoint", job=job_id, cred=cred, wait=bool(args.get("wait", True)),
        trigger=str(args.get("trigger") or f"requested by {cred['user']}"),
    )


@op("restart", audience=CLIENT)
async def restart(s, call: Call):
    gen = call.args.get("gen")
    if gen is not None and (not isinstance(gen, int) or isinstance(gen, bool)):
        raise RemoteError("bad_request", f"'gen' must be a generation number, not {gen!r}")
    nodelist, nodes = call.args.get("nodelist"), call.args.get("nodes")
    if nodelist is not None and (not isinstance(nodelist, list) or not 0 < len(nodelist) <= len(s.config.nodes)
                                 or not all(isinstance(n, str) and NODE_NAME.match(n) for n in nodelist) or len(set(nodelist)) != len(nodelist)):
        raise RemoteError("bad_request", f"'nodelist' must name distinct nodes of the cluster (at most {len(s.config.nodes)})")
    if nodes is not None and (type(nodes) is not int or nodes < 1):
        raise RemoteError("bad_request", f"'nodes' must be a positive number of nodes, not {nodes!r}")
    if nodelist is not None and nodes is not None:
        raise RemoteError("bad_request", "give the nodes (-w) or their number (-N), not both")
    return await s.calls.to_coordinator("coord_restart", job=integer(call.args, "job"), cred=call.user, gen=gen, nodelist=nodelist, nodes=nodes)


@op("ckpt_list", audience=CLIENT)
async def ckpt_list(s, call: Call):
    """The generations of a job's lineage (every job restarted from it), oldest first."""
    record = await job_for(s.table, call.args, call.user, "inspect")
    co = s.coordinator
    await s.table.read_lineage(record.get("lineage") or record["id"])  # (jobs of the lineage in the history too)
    generations = co.ckpt.generations(record)
    live = None
    if co.active and record["id"] in co.ckpt.live:
        entry = co.ckpt.live[record["id"]]
        live = {"gen": entry["gen"], "phase": entry["phase"], "trigger": entry["trigger"], "started": entry["started"]}
    return {"job": record["id"], "lineage": record.get("lineage") or record["id"], "generations": generations, "under_way": live,
            "recoveries": recoveries(co.ckpt.lineage_records(record)),
            "codec": s.checkpoints.job_codec(record)}  # (what its ranks are told to write new generations with: issue 18)


# ------------------------------------------------------------ ranks


@op("ckpt_attach", audience=CLIENT)
async def ckpt_attach(s, call: Call):
    return await s.checkpoints.attach(call.user, call.channel.context.get("pid"), call.args, call.channel)


@op("ckpt_refused", audience=CLIENT)
async def ckpt_refused(s, call: Call):
    return s.checkpoints.refused(call.channel, call.args)


@op("ckpt_start", audience=CLIENT)
async def ckpt_start(s, call: Call):
    return await s.checkpoints.rank_start(call.channel, call.args)


@op("ckpt_end", audience=CLIENT)
async def ckpt_end(s, call: Call):
    return await s.checkpoints.rank_end(call.channel, call.args)


# ------------------------------------------------------------ the coordinator


@op("coord_checkpoint", audience=PEER)
async def coord_checkpoint(s, call: Call):
    args = call.args
    at = args.get("at")  # (a rank's planned iteration: issue 19)
    if at is not None and (type(at) is not int or not 0 <= at <= MAX_ITERATION):
        raise RemoteError("bad_request", "'at' must be an iteration number")
    return await coordinator(s).ckpt.request(integer(args, "job"), args["cred"], str(args.get("trigger")), bool(args.get("wait", True)), at=at)


@op("ckpt_interval", audience=CLIENT)
async def ckpt_interval(s, call: Call):
    """A job's checkpoint interval plan (issue 19): C, R, L, λ, the optimal interval, the next planned iteration."""
    record = await job_for(s.table, call.args, call.user, "inspect")
    return await s.calls.to_coordinator("coord_ckpt_interval", job=record["id"])


@op("coord_ckpt_interval", audience=PEER)
async def coord_ckpt_interval(s, call: Call):
    planner = coordinator(s).ckpt.planner
    job_id = integer(call.args, "job")
    record = s.table.get(job_id)  # (the coordinator's table holds every job of the cluster)
    if record is None:
        raise RemoteError("no_such_job", f"no job {job_id} in the coordinator's table")
    return {"job": record["id"], "state": record["state"], "ckpt_every": record.get("ckpt_every"), **await planner.view(record)}


@op("coord_checkpoint_all", audience=PEER)
async def coord_checkpoint_all(s, call: Call):
    return await coordinator(s).ckpt.request_all(str(call.args.get("trigger") or "SIGUSR1"))


@op("coord_restart", audience=PEER)
async def coord_restart(s, call: Call):
    args = call.args
    restarts = coordinator(s).ckpt.restarts
    return await restarts.restart(integer(args, "job"), args["cred"], args.get("gen"), nodelist=args.get("nodelist"), nodes=args.get("nodes"))


@op("coord_ckpt_restored", audience=PEER)
async def coord_ckpt_restored(s, call: Call):
    args = call.args
    # The reporter is the node the call came from (authenticated), not what it says; its sentence goes
    # into the job's reason and `gang ckpt ls`: printable, bounded.
    reporter = call.from_node or text.printable(args.get("reporter"), 64)
    error = text.printable(args["error"], 1000) if args.get("error") else None
    await coordinator(s).restore_reported(integer(args, "job"), reporter, error)
    return True


# ------------------------------------------------------------ a node's part of a round (fenced: the coordinator's term)


def _node_op(name: str, method: str) -> None:
    async def handler(s, call: Call):
        return await getattr(s.checkpoints, method)(call.args)

    handler.__qualname__ = handler.__name__ = name
    op(name, audience=PEER, fenced=True)(handler)


for _name, _method in (
    ("ckpt_begin", "begin"), ("ckpt_cut", "cut"), ("ckpt_capture", "capture"), ("ckpt_resume", "resume"),
    ("ckpt_commit", "commit"), ("ckpt_abort", "abort"), ("ckpt_prune", "prune"), ("ckpt_verify", "verify"),
    ("ckpt_open", "open_restarted"), ("ckpt_abort_all", "abort_all"),
):
    _node_op(_name, _method)


@op("ckpt_pace", audience=PEER)
async def ckpt_pace(s, call: Call):
    """Where this node's ranks of an interval-planned job are, and their pace (issue 19)."""
    return s.checkpoints.pace(integer(call.args, "job"))


@op("ckpt_set_plan", audience=PEER, fenced=True)
async def ckpt_set_plan(s, call: Call):
    """The coordinator's interval plan for a job: told to its ranks here (issue 19)."""
    try:
        plan = PlanNote.from_wire(call.args.get("plan"))
    except BadMessage as exc:
        raise RemoteError("bad_request", f"a malformed plan: {exc}") from None
    return await s.checkpoints.set_plan(integer(call.args, "job"), plan)


@op("ckpt_job_env", audience=PEER)
async def ckpt_job_env(s, call: Call):
    """The environment a job had when a generation was taken, from this node's copy (see NodeJobs.saved_env)."""
    return await s.node_jobs.saved_env(integer(call.args, "lineage"), integer(call.args, "gen"))


# ------------------------------------------------------------ redundancy (behind the job: complete -> protected)


@op("ckpt_protect", audience=PEER, fenced=True)
async def ckpt_protect(s, call: Call):
    """Write this node's share of a complete generation's redundancy (see gangd.daemon.protect)."""
    return await s.checkpoints.protect(call.args)


# ------------------------------------------------------------ moving a generation's files between nodes
# (redundancy writes, and restart anywhere: a node pulls the files of the
# ranks it will restart from the nodes that hold them; see gangd.daemon.staging)


@op("ckpt_file_read", audience=PEER)
async def ckpt_file_read(s, call: Call):
    """Stream a file of one of this node's generations to a peer (never to a
    client: the files hold the job's network contexts and token)."""
    if call.args.get("name") != "MANIFEST":
        failpoint("ckpt_file_read")  # (a test's crash of the node being copied, halfway)
    return await transfer.handle_file_read(s.checkpoints.root, call.args)


@op("ckpt_data_read", audience=PEER)
async def ckpt_data_read(s, call: Call):
    """Stream a slice of this node's data of a generation to a peer (XOR parity, rebuilds)."""
    failpoint("ckpt_data_read")
    return await transfer.handle_data_read(s.checkpoints.root, call.args)


@op("ckpt_bulk_read", audience=PEER)
async def ckpt_bulk_read(s, call: Call):
    """A generation's file or data slice sent on a bulk connection (gangd.redundancy.bulk): the fast path of the two above."""
    if call.args.get("name") != "MANIFEST":
        failpoint("ckpt_file_read")
        if refuse("ckpt_bulk_read"):  # (a test's bulk path that fails: the transfer goes over the channel)
            raise RemoteError("transfer_failed", f"{s.node}: the bulk path is refused (failpoint)")
    return await transfer.handle_bulk_read(await s.checkpoints.bulk_server(), s.checkpoints.root, call.args)


@op("ckpt_stage", audience=PEER, fenced=True)
async def ckpt_stage(s, call: Call):
    """Pull the files of the ranks this node will restart from the nodes holding them (the coordinator's command)."""
    from ...redundancy.bulk import Bulk
    from ..staging import Stager, StageRequest

    request = StageRequest.from_args(call.args, [n.name for n in s.config.nodes], s.node)
    stager = Stager(node=s.node, root=s.checkpoints.root, channel=s.peers.channel, reserve=s.config.output_reserve,
                    max_file=s.config.checkpoint_max_rank_bytes, bulk=Bulk.from_secret(s.peers.secret))
    return await stager.stage(request)



@op("ckpt_rebuild", audience=PEER, fenced=True)
async def ckpt_rebuild(s, call: Call):
    """Rebuild a lost node's files of a protected generation here, from its partner's copy or its XOR set (see gangd.daemon.rebuild)."""
    from ...redundancy.bulk import Bulk
    from ..rebuild import Rebuilder, RebuildRequest

    request = RebuildRequest.from_args(call.args, [n.name for n in s.config.nodes], s.node)
    rebuilder = Rebuilder(node=s.node, root=s.checkpoints.root, channel=s.peers.channel, reserve=s.config.output_reserve,
                          max_file=s.config.checkpoint_max_rank_bytes, bulk=Bulk.from_secret(s.peers.secret))
    return await rebuilder.rebuild(request)


@op("ckpt_holds", audience=PEER)
async def ckpt_holds(s, call: Call):
    """Whether this node still holds its files of a generation ("" = yes; else what is gone: its disk was wiped)."""
    from ..rebuild import holds
    from ..staging import int_arg

    lineage, gen = int_arg(call.args.get("lineage"), "lineage", 1), int_arg(call.args.get("gen"), "gen", 1)
    return await trio.to_thread.run_sync(holds, s.checkpoints.root, lineage, gen)


# ------------------------------------------------------------ the flush directory (the third level; see gangd.daemon.flush)


@op("ckpt_flush", audience=PEER, fenced=True)
async def ckpt_flush(s, call: Call):
    """Copy this node's files of a complete generation to the shared flush directory, behind the job."""
    from ..flush import FlushRequest

    return await s.flusher.flush(FlushRequest.from_args(call.args))


@op("ckpt_unflush", audience=PEER, fenced=True)
async def ckpt_unflush(s, call: Call):
    """Copy the files of the ranks this node will restart from the flush directory (the coordinator's command)."""
    from ..flush import UnflushRequest
    from ..staging import TargetGeneration

    request = UnflushRequest.from_args(call.args, [n.name for n in s.config.nodes])
    return await s.flusher.unflush(request, TargetGeneration(s.checkpoints.root, s.config.output_reserve))


@op("ckpt_flush_remove", audience=PEER, fenced=True)
async def ckpt_flush_remove(s, call: Call):
    """Remove a generation's flushed copy (retention); with ``keep`` instead of
    ``gen``: every generation of the lineage but those (the orphans a flush cut
    short by a coordinator change left)."""
    if "keep" in call.args:
        from ..flush import keep_of

        return await s.flusher.sweep(integer(call.args, "lineage"), keep_of(call.args))
    await s.flusher.remove(integer(call.args, "lineage"), integer(call.args, "gen"))
    return None
