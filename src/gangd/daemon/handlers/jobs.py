"""Users' requests about jobs: submit, kill, list, inspect, wait, output, suspend.

Writes (submit, kill, suspend) are forwarded to the coordinator with the
caller's credentials (the kernel's word, SO_PEERCRED); reads are served
from etcd (a node caches only the jobs placed on it: listings read the hot
table and the history, a wait watches its job's key) or this node's cache.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import secrets
import time

import trio

from ... import jobs
from ...etcd.client import EtcdError
from ...rpc import RemoteError, Stream
from ..access import integer, job_for
from ..interval import node_rates
from ..limits import read_process_limits
from ..peers import natural_key
from .registry import CLIENT, Call, op

#: Most job summaries in one answer to ``jobs`` (the client pages through more).
LIST_PAGE = 500
#: A page of ``gang ps`` holds at most this many jobs and, summed, this many ranks
#: (a summary carries each rank's node and exit: bounded bytes per reply frame).
JOBS_PAGE = 2000
JOBS_PAGE_RANKS = 100_000

log = logging.getLogger("gangd.ops")


@op("info", audience=CLIENT)
async def info(s, call: Call):
    cred = call.user
    return {
        "node": s.node,
        "coordinator": s.membership.coordinator(),
        "nodes": [n.name for n in s.config.nodes],
        "uid": cred["uid"],
        "user": cred["user"],
    }


@op("submit", audience=CLIENT)
async def submit(s, call: Call):
    cred, args, channel = call.user, call.args, call.channel
    spec = args.get("spec")
    if not isinstance(spec, dict):
        raise RemoteError("bad_request", "submit needs a job spec")
    try:  # refused here, before it travels to the coordinator (which checks it again: it also takes restarts)
        jobs.JobSpec.from_wire(spec, [n.name for n in s.config.nodes])
    except jobs.BadSpec as exc:
        raise RemoteError(exc.code, exc.message) from None
    # The client's own rlimits, from the kernel (never the wire): its ranks get these, not the daemon's.
    # Read once per connection (the peer's pid is the connection's): a client
    # submitting many jobs costs one read of /proc, not one thread hop each.
    if "rlimits" not in channel.context:
        pid = channel.context.get("pid")
        channel.context["rlimits"] = (
            await trio.to_thread.run_sync(read_process_limits, pid, cred["uid"]) if isinstance(pid, int) and pid > 0 else None
        )
    rlimits = channel.context["rlimits"]
    # One token per submission: a retry after a lost answer gets the same job, not a second one.
    return await s.calls.to_coordinator("coord_submit", spec=spec, cred=dict(cred, rlimits=rlimits), token=secrets.token_hex(16))


@op("kill", audience=CLIENT)
async def kill(s, call: Call):
    return await s.calls.to_coordinator("coord_kill", job=integer(call.args, "job"), cred=call.user)


def staleness(membership, node: str) -> dict | None:
    """None while this node has its session with etcd; else how long it has
    been without one: what it serves from its cache may be out of date."""
    if membership.connected:
        return None
    since = membership.isolated_since
    seconds = time.monotonic() - since if since is not None else 0.0
    return {"node": node, "seconds": round(seconds, 1), "why": membership.why_isolated}


@op("jobs", audience=CLIENT)
async def list_jobs(s, call: Call):
    summaries = await s.listing.list_jobs(call.user, call.args, call.channel)
    if call.args.get("freshness"):  # (asked for by newer clients: older ones get the bare list)
        return {"jobs": summaries, "stale": staleness(s.membership, s.node)}
    return summaries


@op("history", audience=CLIENT)
async def history(s, call: Call):
    return await s.listing.history(call.user, call.args, call.channel)


@op("job", audience=CLIENT)
async def job(s, call: Call):
    record = await job_for(s.table, call.args, call.user, "inspect")
    stale = staleness(s.membership, s.node)
    return dict(record, stale=stale) if stale else record


@op("suspend", audience=CLIENT)
async def suspend(s, call: Call):
    return _summary(await s.calls.to_coordinator("coord_suspend", job=integer(call.args, "job"), cred=call.user, hold=True))


@op("resume", audience=CLIENT)
async def resume(s, call: Call):
    return _summary(await s.calls.to_coordinator("coord_suspend", job=integer(call.args, "job"), cred=call.user, hold=False))


@op("schedule", audience=CLIENT)
async def schedule(s, call: Call):
    return await s.calls.to_coordinator("coord_schedule", switches=bool(call.args.get("switches")))


@op("nodes", audience=CLIENT)
async def nodes(s, call: Call):
    peers = s.peers
    now = time.time()
    membership = s.membership
    coordinator = membership.coordinator()
    rows = []
    try:  # each node's lives in etcd: how often it was lost (an isolated node shows none)
        histories = await membership.nodelog.histories([n.name for n in s.config.nodes]) if membership.connected else {}
    except EtcdError:
        histories = {}
    # Each node's failure rate, its history with its prior: what --ckpt-every auto plans with (issue 19).
    rates = node_rates(histories, {n.name: s.config.prior_mtbf(n) for n in s.config.nodes}, s.config.failure_prior_weight)
    for spec in sorted(s.config.nodes, key=lambda n: natural_key(n.name)):
        heartbeat: float | None
        if spec.name == s.node:
            running, heartbeat = s.ranks.running(), 0.0
            why = "" if membership.connected else f"cannot reach etcd: {membership.why_isolated}"
            offset = {"offset": 0.0, "error": 0.0}
        else:
            link = peers.links[spec.name]
            running = link.info.get("running", 0) if link.up else 0
            heartbeat = now - link.last_ok_wall if link.last_ok_wall else None
            if not membership.is_up(spec.name):
                why = "no lease in etcd (stopped, stalled or cut off from etcd)"
            else:
                why = "" if link.up else f"up in etcd, but {s.node}'s link to it is down: {link.why_down}"
            offset = {"offset": link.clock.offset, "error": link.clock.error}
        rows.append(
            {
                "name": spec.name,
                "address": spec.endpoint,
                "state": "up" if membership.is_up(spec.name) else "down",
                "cores": spec.cores,
                "spare": spec.spare,  # held back for recoveries (see gangd.daemon.recover)
                "running": running,
                "heartbeat": heartbeat,
                "coordinator": spec.name == coordinator,
                "clock": offset,  # its wall clock minus this node's, as estimated here (s)
                "why": why,
                "history": histories[spec.name].to_wire() if spec.name in histories else None,
                "failure": {"lam": rates[spec.name].lam, "mtbf": rates[spec.name].mtbf, "basis": rates[spec.name].basis},
            }
        )
    return rows


@op("wait", audience=CLIENT)
async def wait(s, call: Call):
    """Stream the job's record on every change until it ends.

    With ``kill_on_disconnect`` (what ``gang run`` asks for) a client that
    vanishes — terminal closed, process killed — takes its job with it.
    """
    cred, args, channel = call.user, call.args, call.channel
    record = await job_for(s.table, args, cred, "wait for")
    job_id = record["id"]
    kill_on_disconnect = bool(args.get("kill_on_disconnect"))
    table = s.table

    async def produce(emit):
        last = record

        async def seen(current: dict) -> bool:
            nonlocal last
            last = current
            await emit(current)
            return False

        try:
            await table.watch_job(job_id, seen, record)  # (until it ends; from the history once retired)
        finally:
            current = table.get(job_id) or last
            if kill_on_disconnect and channel.closed and current is not None and not jobs.is_terminal(current):
                log.info("client of job %d went away; killing the job", job_id)
                s.spawn(_kill_quietly, s, job_id, cred)

    return Stream(produce)


async def _kill_quietly(s, job_id: int, cred: dict) -> None:
    try:
        await s.calls.to_coordinator("coord_kill", job=job_id, cred=cred)
    except RemoteError as exc:
        log.warning("could not kill job %d: %s", job_id, exc)


@op("output", audience=CLIENT)
async def output(s, call: Call):
    """Stream ``{"rank", "stream", "data"}`` items of the job's output from
    every node that runs its ranks, each rank in order."""
    args = call.args
    record = await job_for(s.table, args, call.user, "read the output of")
    job_id = record["id"]
    follow = bool(args.get("follow", True))
    wanted = args.get("ranks")
    table = s.table

    async def placed(current: dict) -> bool:
        return bool(current["placement"]) or not follow

    async def produce(emit):
        # Wait until the job is placed (or ended without ever running).
        current = record if record["placement"] or not follow or jobs.is_terminal(record) else await table.watch_job(job_id, placed)

        async def relay(node: str, ranks: list[int]) -> None:
            if node == s.node:
                await s.node_jobs.local_output(job_id, ranks, follow, emit)
                return
            try:
                channel_to = s.peers.channel(node)
                async with channel_to.stream("output_local", job=job_id, ranks=ranks, follow=follow) as items:
                    async for item in items:
                        await emit(item)
            except RemoteError as exc:
                await emit({"rank": None, "stream": 2, "data": f"gangd: output of {node} unavailable: {exc}\n".encode()})

        async with trio.open_nursery() as nursery:
            for node in jobs.nodes_of(current):
                ranks = [r for r in jobs.ranks_on(current, node) if wanted is None or r in wanted]
                if ranks:
                    nursery.start_soon(relay, node, ranks)

    return Stream(produce)


class Listing:
    """``gang ps`` and ``gang history``: pages of job summaries from etcd's
    hot table (or the coordinator's cache of it) and history, and (for live
    jobs) the gang scheduler and the nodes' CPU counters."""

    def __init__(self, *, table, calls, membership):
        self.table = table
        self.calls = calls
        self.membership = membership

    async def list_jobs(self, cred, args, channel):
        """One page of job summaries in id order: at most ``limit`` (<= JOBS_PAGE)
        jobs with ids above ``after`` (fewer when their ranks add up past
        JOBS_PAGE_RANKS); the client asks for pages until one is empty."""
        after = args.get("after", 0)
        limit = args.get("limit", LIST_PAGE)
        if not isinstance(after, int) or not isinstance(limit, int) or isinstance(after, bool) or isinstance(limit, bool):
            raise RemoteError("bad_request", "'after' and 'limit' must be integers")
        limit = max(1, min(limit, JOBS_PAGE))
        await self.table.wait_loaded()
        everything = bool(args.get("all"))
        cutoff = None if everything else time.time() - 3600
        def keep(r: dict) -> bool:
            return cutoff is None or not jobs.is_terminal(r) or (r.get("ended") or 0) > cutoff

        if self.membership is not None and not self.membership.connected:
            # Cut off from etcd: what this node knows (its own jobs), which the
            # answer says may be out of date (see ``staleness``).
            records = self.table.cached_page(after, limit, keep)
            return [_summary(r) for r in records]
        if not everything:
            records = await self.table.hot_page(after, limit, keep)
        else:
            # The history too (ended jobs past the retention period), merged in
            # id order: a full page of it ends the page (no hot job above it is read).
            past = await self.table.history(after, limit)
            records = await self.table.hot_page(after, limit, keep, below=past[-1]["id"] if len(past) >= limit else None)
            merged = {r["id"]: r for r in past}
            merged.update({r["id"]: r for r in records})
            records = [merged[job_id] for job_id in sorted(merged)[:limit]]
        ranks = list(itertools.accumulate(r["nranks"] for r in records))
        records = records[: max(1, bisect.bisect_right(ranks, JOBS_PAGE_RANKS))]
        summaries = [_summary(r) for r in records]
        live = [s for s in summaries if s["state"] in (jobs.RUNNING, jobs.SUSPENDED)]
        if live:
            await self._overlay_live(live)
        return summaries

    async def history(self, cred, args, channel):
        """Ended jobs, newest first: ``limit`` (<= LIST_PAGE) of them with ids
        below ``before``, of user ``uid`` only if given. Read from the hot
        table (recently ended) and etcd's history, page by page."""
        before, limit, uid = args.get("before"), args.get("limit", 50), args.get("uid")
        for name, value in (("before", before), ("uid", uid)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise RemoteError("bad_request", f"{name!r} must be an integer")
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise RemoteError("bad_request", "'limit' must be an integer")
        limit = max(1, min(limit, LIST_PAGE))
        table = self.table
        found: list[dict] = []
        cursor = before
        for _ in range(40):  # at most 40 pages of the history per answer (a filter that matches little stops there)
            hot = await table.hot_before(cursor, LIST_PAGE, jobs.is_terminal)
            past = await table.history_before(cursor, LIST_PAGE)
            merged = {r["id"]: r for r in past}
            merged.update({r["id"]: r for r in hot})
            page = [merged[i] for i in sorted(merged, reverse=True)][:LIST_PAGE]
            found += [r for r in page if uid is None or r["owner_uid"] == uid]
            if len(found) >= limit or len(page) < LIST_PAGE:
                break
            cursor = page[-1]["id"]
        return [_summary(r) for r in found[:limit]]

    async def _overlay_live(self, summaries: list[dict]) -> None:
        """What the gang scheduler is doing right now, and CPU used so far, for launched jobs."""
        try:
            with trio.fail_after(2):
                schedule = await self.calls.to_coordinator("coord_schedule")
        except (RemoteError, trio.TooSlowError):
            schedule = None
        by_node: dict[str, list[int]] = {}
        for summary in summaries:
            for node in summary["nodes"]:
                by_node.setdefault(node, []).append(summary["id"])
            times = (schedule or {}).get("jobs", {}).get(str(summary["id"]))
            if times:
                summary.update(run_seconds=times["run_seconds"], suspended_seconds=times["suspended_seconds"])
                if summary["state"] == jobs.RUNNING and not times["running_now"]:
                    summary["state"] = jobs.SUSPENDED  # gang-scheduled out for now
            summary["cpu_seconds"] = 0.0
        cpu: dict[int, float] = {}

        async def ask(node: str, ids: list[int]) -> None:
            if not self.membership.is_up(node):
                return
            try:
                for job_id, used in (await self.calls.call(node, "job_usage", jobs=ids)).items():
                    cpu[int(job_id)] = cpu.get(int(job_id), 0.0) + used
            except RemoteError:
                pass

        async with trio.open_nursery() as nursery:
            for node, ids in by_node.items():
                nursery.start_soon(ask, node, ids)
        for summary in summaries:
            summary["cpu_seconds"] = round(cpu.get(summary["id"], 0.0), 3)


def _summary(record: dict) -> dict:
    keys = (
        "id", "name", "owner", "owner_uid", "nranks", "placement", "state", "reason", "submitted", "started", "ended",
        "ranks", "kill_requested", "priority", "slice", "held", "run_seconds", "suspended_seconds",
        "lineage", "restart_of", "ckpt_every", "restart_seconds",  # (a restart's cost as measured: what --ckpt-every auto plans with)
        "requeue", "requeued_as", "recovery", "recovery_of", "recoveries",  # (a lost node's job recovered: gangd.daemon.recover)
        "spawned_by", "children",  # (MPI_Comm_spawn: gangd.daemon.spawns)
    )
    summary = {k: record.get(k) for k in keys}
    summary["nodes"] = jobs.nodes_of(record)
    summary["checkpoints"] = sum(1 for e in record.get("checkpoints") or [] if e["state"] in ("complete", "protected"))
    summary["exit_code"] = jobs.exit_code(record) if jobs.is_terminal(record) else None
    if jobs.is_terminal(record):
        summary["cpu_seconds"] = round(sum((s or {}).get("cpu", 0.0) for s in record["ranks"]), 3)
    return summary
