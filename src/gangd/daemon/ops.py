"""What each request does.

Two audiences, two sets of operations:

* **client ops** come from local users over the Unix socket. The caller's
  uid is the kernel's word (SO_PEERCRED). Writes (submit, kill) are forwarded
  to the coordinator with those credentials; reads (ps, nodes, wait, output)
  are served from this node's replica of the job table.
* **peer ops** come from other daemons over authenticated TCP and are
  trusted: a peer forwarding a user request carries that user's credentials.

Every handler raises :class:`~gangd.rpc.RemoteError` with a specific code
for anything the caller got wrong; nothing a caller sends can stop the daemon.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import secrets
import signal
import time
from typing import Any

import msgpack
import trio

from .. import ckptstore, jobs, safefs
from ..protocol import Note, Request
from ..rpc import Channel, RemoteError, Stream
from . import clock
from .coordinator import permission_check
from .jobnet import expected_deliveries
from .limits import read_process_limits
from .peers import natural_key
from .store.jobtable import decode_record, pack

#: Most job summaries in one answer to ``jobs`` (the client pages through more).
LIST_PAGE = 500
#: A page of ``gang ps`` holds at most this many jobs and, summed, this many ranks
#: (a summary carries each rank's node and exit: bounded bytes per reply frame).
JOBS_PAGE = 2000
JOBS_PAGE_RANKS = 100_000

#: What only the coordinator commands, each carrying its term: a node refuses
#: a term older than the highest it has seen (see controlplane.check_term).
FENCED_OPS = frozenset({
    "launch", "kill_ranks", "switch", "resend_exits", "ckpt_begin", "ckpt_cut", "ckpt_capture", "ckpt_resume",
    "ckpt_commit", "ckpt_abort", "ckpt_prune", "ckpt_verify", "ckpt_open", "ckpt_abort_all",
})

#: After a switch stops a job, how long before its processes forked during
#: the slice are looked for (and stopped): after every node's part.
STRAGGLER_DELAY = 0.005

log = logging.getLogger("gangd.ops")



def _int(args: dict, key: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RemoteError("bad_request", f"{key!r} must be an integer, not {value!r}")
    return value


class Ops:
    def __init__(self, daemon):
        self.daemon = daemon
        self._ids: list[int] | None = None  # job ids in order (see _job_ids)
        self._id_set: set[int] = set()
        daemon.table.listeners.append(self._index_record)
        self.client_ops = {
            "info": self.info,
            "submit": self.submit,
            "kill": self.kill,
            "jobs": self.list_jobs,
            "history": self.history,
            "job": self.job,
            "nodes": self.nodes,
            "wait": self.wait,
            "output": self.output,
            "suspend": self.suspend,
            "resume": self.resume,
            "schedule": self.schedule,
            "comm_attach": self.comm_attach,
            "net": self.net,
            "net_capture": self.net_capture,
        }
        self.peer_ops = {
            "ping": self.ping,
            "launch": self.launch,
            "kill_ranks": self.kill_ranks,
            "ranks_exited": self.ranks_exited,
            "coord_submit": self.coord_submit,
            "coord_kill": self.coord_kill,
            "output_local": self.output_local,
            "resend_exits": self.resend_exits,
            "coord_suspend": self.coord_suspend,
            "coord_schedule": self.coord_schedule,
            "switch": self.switch,
            "job_usage": self.job_usage,
            "comm_gather": self.comm_gather,
            "net_gate": self.net_gate,
            "net_wait_closed": self.net_wait_closed,
            "net_counters": self.net_counters,
            "net_capture_local": self.net_capture_local,
            "net_restore": self.net_restore,
            "pmi_fence": self.pmi_fence,
            "coord_fail": self.coord_fail,
            "ckpt_job_env": self.ckpt_job_env,
        }
        from .ckptops import CheckpointOps

        self.ckpt = CheckpointOps(self)
        self.client_ops.update(self.ckpt.client_ops)
        self.peer_ops.update(self.ckpt.peer_ops)

    # ------------------------------------------------------------ dispatch

    async def handle(self, channel: Channel, message):
        if isinstance(message, Note):
            if not channel.context.get("peer"):
                if message.op.startswith("ckpt_"):
                    self.daemon.checkpoints.on_note(channel, message.op, message.args)
                else:
                    self.daemon.jobnet.on_client_note(channel, message.op, message.args)
            return None
        request: Request = message
        if channel.context.get("peer"):
            return await self.dispatch_peer(request.op, request.args, from_node=channel.context.get("node"), channel=channel)
        handler = self.client_ops.get(request.op)
        if handler is None:
            if request.op in self.peer_ops:
                raise RemoteError("permission_denied", f"{request.op!r} is a daemon-to-daemon operation")
            raise RemoteError("unknown_op", f"unknown operation {request.op!r}")
        return await handler(channel.context["cred"], request.args, channel)

    async def dispatch_peer(self, op: str, args: dict, *, from_node: str | None, channel: Channel | None = None):
        handler = self.peer_ops.get(op)
        if handler is None:
            raise RemoteError("unknown_op", f"unknown peer operation {op!r}")
        if op in FENCED_OPS:
            args = dict(args)
            self.daemon.membership.check_term(args.pop("term", None), op, from_node)
        return await handler(args, from_node, channel)

    async def to_coordinator(self, op: str, **args):
        """Run ``op`` on the coordinator, riding out a coordinator change
        (an election takes up to the lease TTL when the coordinator died)."""
        daemon = self.daemon
        membership = daemon.membership
        membership.refuse_if_isolated()
        patience = daemon.config.etcd.lease_ttl + 2 * daemon.config.heartbeat_timeout
        deadline = trio.current_time() + patience
        while True:
            leader = membership.coordinator()
            if leader is None:
                if trio.current_time() > deadline:
                    raise RemoteError("no_coordinator", f"the cluster has had no coordinator for {patience:g} s (see `gang nodes`)")
            else:
                try:
                    return await daemon.call(leader, op, **args)
                except RemoteError as exc:
                    if exc.code not in ("not_coordinator", "node_down", "disconnected") or trio.current_time() > deadline:
                        raise
            membership.refuse_if_isolated()
            await trio.sleep(0.1)

    async def _record(self, args: dict, cred: dict, action: str) -> dict:
        job_id = _int(args, "job")
        table = self.daemon.table
        # (from etcd if not cached: submitted a moment ago through another
        # node, or ended long ago and in the history)
        record = await table.fetch(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, action)
        return record

    # ------------------------------------------------------------ client ops

    async def info(self, cred, args, channel):
        daemon = self.daemon
        return {
            "node": daemon.node,
            "coordinator": daemon.membership.coordinator(),
            "nodes": [n.name for n in daemon.config.nodes],
            "uid": cred["uid"],
            "user": cred["user"],
        }

    async def submit(self, cred, args, channel):
        spec = args.get("spec")
        if not isinstance(spec, dict):
            raise RemoteError("bad_request", "submit needs a job spec")
        try:  # refused here, before it travels to the coordinator (which checks it again: it also takes restarts)
            jobs.JobSpec.from_wire(spec, [n.name for n in self.daemon.config.nodes])
        except jobs.BadSpec as exc:
            raise RemoteError(exc.code, exc.message) from None
        # The client's own rlimits, from the kernel (never the wire): its ranks get these, not the daemon's.
        pid = channel.context.get("pid")
        rlimits = await trio.to_thread.run_sync(read_process_limits, pid, cred["uid"]) if isinstance(pid, int) and pid > 0 else None
        # One token per submission: a retry after a lost answer gets the same job, not a second one.
        return await self.to_coordinator("coord_submit", spec=spec, cred=dict(cred, rlimits=rlimits), token=secrets.token_hex(16))

    async def kill(self, cred, args, channel):
        job_id = _int(args, "job")
        return await self.to_coordinator("coord_kill", job=job_id, cred=cred)

    def _job_ids(self) -> list[int]:
        """Every job id of the hot table, ascending: built once, then kept up
        to date record by record, so a listing never sorts the whole table
        (rebuilt when many ids left for the history)."""
        if self._ids is None or len(self._ids) > 2 * len(self.daemon.table.records) + 64:
            self._ids = sorted(self.daemon.table.records)
            self._id_set = set(self._ids)
        return self._ids

    def _index_record(self, record: dict) -> None:
        if self._ids is not None and record["id"] not in self._id_set:
            self._id_set.add(record["id"])
            bisect.insort(self._ids, record["id"])

    async def list_jobs(self, cred, args, channel):
        """One page of job summaries in id order: at most ``limit`` (<= JOBS_PAGE)
        jobs with ids above ``after`` (fewer when their ranks add up past
        JOBS_PAGE_RANKS); the client asks for pages until one is empty."""
        after = args.get("after", 0)
        limit = args.get("limit", LIST_PAGE)
        if not isinstance(after, int) or not isinstance(limit, int) or isinstance(after, bool) or isinstance(limit, bool):
            raise RemoteError("bad_request", "'after' and 'limit' must be integers")
        limit = max(1, min(limit, JOBS_PAGE))
        ids, table = self._job_ids(), self.daemon.table.records
        everything = bool(args.get("all"))
        cutoff = None if everything else time.time() - 3600
        records = []
        for job_id in itertools.islice(ids, bisect.bisect_right(ids, after), None):
            record = table.get(job_id)
            if record is None:
                continue  # (moved to the history)
            if cutoff is None or not jobs.is_terminal(record) or (record.get("ended") or 0) > cutoff:
                records.append(record)
                if len(records) >= limit:
                    break
        if everything:
            # The history too (ended jobs past the retention period), merged in id order.
            past = await self.daemon.table.history(after, limit)
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
        table = self.daemon.table
        found: list[dict] = []
        cursor = before
        for _ in range(40):  # at most 40 pages of the history per answer (a filter that matches little stops there)
            hot = [r for r in table.records.values() if jobs.is_terminal(r) and (cursor is None or r["id"] < cursor)]
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
                schedule = await self.to_coordinator("coord_schedule")
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
            if not self.daemon.membership.is_up(node):
                return
            try:
                for job_id, used in (await self.daemon.call(node, "job_usage", jobs=ids)).items():
                    cpu[int(job_id)] = cpu.get(int(job_id), 0.0) + used
            except RemoteError:
                pass

        async with trio.open_nursery() as nursery:
            for node, ids in by_node.items():
                nursery.start_soon(ask, node, ids)
        for summary in summaries:
            summary["cpu_seconds"] = round(cpu.get(summary["id"], 0.0), 3)

    async def suspend(self, cred, args, channel):
        return _summary(await self.to_coordinator("coord_suspend", job=_int(args, "job"), cred=cred, hold=True))

    async def resume(self, cred, args, channel):
        return _summary(await self.to_coordinator("coord_suspend", job=_int(args, "job"), cred=cred, hold=False))

    async def schedule(self, cred, args, channel):
        return await self.to_coordinator("coord_schedule", switches=bool(args.get("switches")))

    # ------------------------------------------------------------ job messaging

    async def comm_attach(self, cred, args, channel):
        return await self.daemon.jobnet.attach(cred, channel.context.get("pid"), args, channel)

    async def net(self, cred, args, channel):
        """Per channel (sender -> receiver): messages sent, received, delivered, in flight."""
        record = await self._record(args, cred, "inspect")
        counters = await self.on_job_nodes(record, "net_counters", job=record["id"])
        n = record["nranks"]
        rows = {}
        for per_node in counters.values():
            for rank, (sent, received, delivered) in per_node.items():
                rows[int(rank)] = (sent, received, delivered)
        channels = []
        for src in range(n):
            for dst in range(n):
                if src not in rows or dst not in rows:
                    continue
                sent, received, delivered = rows[src][0][dst], rows[dst][1][src], rows[dst][2][src]
                if sent or received:
                    channels.append({"src": src, "dst": dst, "sent": sent, "received": received, "delivered": delivered, "in_flight": sent - delivered})
        return {"job": record["id"], "attached": sorted(rows), "channels": channels}

    async def net_capture(self, cred, args, channel):
        """Close the job's gates everywhere, capture its network context, open them again.
        Returns {rank: context bytes}: what a checkpoint writes to disk."""
        record = await self._record(args, cred, "capture the network of")
        job_id = record["id"]
        # Closed everywhere first, then confirmed everywhere: a rank behind a
        # closed gate keeps draining its connections, so a send under way to
        # it completes — but only once its own node has closed too.
        await self.on_job_nodes(record, "net_gate", job=job_id, open=False, wait=False)
        try:
            await self.on_job_nodes(record, "net_wait_closed", job=job_id)
            counters = await self.on_job_nodes(record, "net_counters", job=job_id)
            expect = expected_deliveries(counters, record["nranks"])
            contexts = await self.on_job_nodes(record, "net_capture_local", job=job_id, expect=expect)
        finally:
            if args.get("reopen", True):
                await self.on_job_nodes(record, "net_gate", job=job_id, open=True, wait=False)
        return {rank: blob for per_node in contexts.values() for rank, blob in per_node.items()}

    async def on_job_nodes(self, record: dict, op: str, **args) -> dict[str, Any]:
        """Peer ``op`` on every node of the job at once, {node: result}; any
        failure raises one error naming the nodes (``not_ready`` wins: a
        checkpoint refused before it began is not a failure)."""
        results: dict[str, object] = {}
        errors: list[tuple[str, str]] = []

        async def one(node: str) -> None:
            try:
                results[node] = await self.daemon.call(node, op, **args)
            except RemoteError as exc:
                errors.append((exc.code, exc.message if node in exc.message else f"{node}: {exc.message}"))
            except Exception as exc:  # a bug or this node's own disk: still one clear error
                log.exception("%s on %s failed", op, node)
                errors.append(("internal", f"{node}: {type(exc).__name__}: {exc}"))

        async with trio.open_nursery() as nursery:
            for node in jobs.nodes_of(record):
                nursery.start_soon(one, node)
        if errors:
            codes = [code for code, _ in errors]
            code = "not_ready" if "not_ready" in codes else codes[0]
            raise RemoteError(code, "; ".join(sorted({m for _, m in errors})))
        return results

    async def job(self, cred, args, channel):
        return await self._record(args, cred, "inspect")

    async def nodes(self, cred, args, channel):
        daemon = self.daemon
        peers = daemon.peers
        now = time.time()
        membership = daemon.membership
        coordinator = membership.coordinator()
        rows = []
        for spec in sorted(daemon.config.nodes, key=lambda n: natural_key(n.name)):
            heartbeat: float | None
            if spec.name == daemon.node:
                running, heartbeat = daemon.ranks.running(), 0.0
                why = "" if membership.connected else f"cannot reach etcd: {membership.why_isolated}"
                offset = {"offset": 0.0, "error": 0.0}
            else:
                link = peers.links[spec.name]
                running = link.info.get("running", 0) if link.up else 0
                heartbeat = now - link.last_ok_wall if link.last_ok_wall else None
                if not membership.is_up(spec.name):
                    why = "no lease in etcd (stopped, stalled or cut off from etcd)"
                else:
                    why = "" if link.up else f"up in etcd, but {daemon.node}'s link to it is down: {link.why_down}"
                offset = {"offset": link.clock.offset, "error": link.clock.error}
            rows.append(
                {
                    "name": spec.name,
                    "address": spec.endpoint,
                    "state": "up" if membership.is_up(spec.name) else "down",
                    "cores": spec.cores,
                    "running": running,
                    "heartbeat": heartbeat,
                    "coordinator": spec.name == coordinator,
                    "clock": offset,  # its wall clock minus this node's, as estimated here (s)
                    "why": why,
                }
            )
        return rows

    async def wait(self, cred, args, channel):
        """Stream the job's record on every change until it ends.

        With ``kill_on_disconnect`` (what ``gang run`` asks for) a client that
        vanishes — terminal closed, process killed — takes its job with it.
        """
        record = await self._record(args, cred, "wait for")
        job_id = record["id"]
        kill_on_disconnect = bool(args.get("kill_on_disconnect"))
        table = self.daemon.table

        async def produce(emit):
            try:
                last_seq = -1
                while True:
                    changed = table.change_event()  # (a change while emit waits must not be lost)
                    current = table.get(job_id) or await table.fetch(job_id)  # (in the history once retired)
                    if current is None:
                        raise RemoteError("no_such_job", f"no job {job_id}")
                    if current["seq"] != last_seq:
                        last_seq = current["seq"]
                        await emit(current)
                    if jobs.is_terminal(current):
                        return
                    await changed.wait()
            finally:
                current = table.get(job_id)
                if kill_on_disconnect and channel.closed and current is not None and not jobs.is_terminal(current):
                    log.info("client of job %d went away; killing the job", job_id)
                    self.daemon.spawn(self._kill_quietly, job_id, cred)

        return Stream(produce)

    async def _kill_quietly(self, job_id: int, cred: dict) -> None:
        try:
            await self.to_coordinator("coord_kill", job=job_id, cred=cred)
        except RemoteError as exc:
            log.warning("could not kill job %d: %s", job_id, exc)

    async def output(self, cred, args, channel):
        """Stream ``{"rank", "stream", "data"}`` items of the job's output from
        every node that runs its ranks, each rank in order."""
        record = await self._record(args, cred, "read the output of")
        job_id = record["id"]
        follow = bool(args.get("follow", True))
        wanted = args.get("ranks")
        table = self.daemon.table

        async def produce(emit):
            # Wait until the job is placed (or ended without ever running).
            current = table.get(job_id) or record  # (a retired job: its record from the history)
            while not current["placement"] and not jobs.is_terminal(current) and follow:
                await table.wait_changed()
                current = table.get(job_id) or record

            async def relay(node: str, ranks: list[int]) -> None:
                if node == self.daemon.node:
                    await self._local_output(job_id, ranks, follow, emit)
                    return
                try:
                    channel_to = self.daemon.peers.channel(node)
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

    async def _local_output(self, job_id: int, ranks: list[int], follow: bool, emit) -> None:
        daemon = self.daemon

        async def one(rank: int) -> None:
            key = (job_id, rank)
            # The launch may still be on its way to this node.
            while key not in daemon.ranks.logs:
                record = daemon.table.get(job_id) or await daemon.table.fetch(job_id)
                # (record None while following: its launch has not reached this node yet)
                if not follow or (record is not None and (jobs.is_terminal(record) or record["ranks"][rank] is not None)):
                    break
                await daemon.table.wait_changed()
            log_ = daemon.ranks.logs.get(key)
            if log_ is not None:
                source = log_.follow(follow)
            else:  # after a daemon restart: only the file is left
                source = daemon.outputs.read(job_id, rank)
            async for stream, data in source:
                await emit({"rank": rank, "stream": stream, "data": data})

        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(one, rank)

    # ------------------------------------------------------------ peer ops

    async def ping(self, args, from_node, channel):
        # Our clock when the ping came and when the answer leaves, and our
        # bounds on the pinger's clock: it bounds our offset with them (see clock.py).
        came = time.time()
        info = self.daemon.heartbeat_info()
        link = self.daemon.peers.links.get(from_node)
        info["clock"] = [came, time.time(), link.clock.ours if link is not None else None]
        return info

    async def launch(self, args, from_node, channel):
        record = args.get("record")
        if not isinstance(record, dict):
            raise RemoteError("bad_request", "launch needs a job record")
        daemon = self.daemon
        daemon.membership.refuse_if_isolated()
        try:
            try:
                cached = decode_record(pack({k: v for k, v in record.items() if k not in ("env", "seq")}))
            except ValueError as exc:
                raise RemoteError("bad_request", f"launch: bad job record: {exc}") from None
            seq = record.get("seq")
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
                raise RemoteError("bad_request", "launch: the job record has no revision")
            if not isinstance(record.get("env"), dict):
                raise RemoteError("bad_request", "launch: the job's environment is missing")
            daemon.table.take(cached, seq)
            current = daemon.table.get(record["id"])
            if jobs.is_terminal(current) or current.get("kill_requested"):
                # A kill overtook this launch: starting ranks now would orphan them.
                raise RemoteError("job_ended", f"job {record['id']} is {current['state']}; not starting its ranks")
            drop = os.geteuid() == 0 and record["owner_uid"] != 0
            extra = daemon.jobnet.prepare(record, drop)
            if record.get("restart_of"):
                extra.update(await daemon.checkpoints.prepare_restart(record))
            if args.get("contexts"):
                daemon.jobnet.set_context(record["id"], args["contexts"])
            rank_setup = (lambda rank: daemon.pmi.prepare(record, rank, daemon.spawn)) if record.get("mpi") else None
            pids = await daemon.ranks.launch(daemon.spawn, record, daemon.config.state_dir / "jobs" / str(record["id"]), extra, rank_setup)
        except RemoteError:
            raise
        except Exception as exc:
            log.exception("launching job %d failed", record["id"])
            raise RemoteError("launch_failed", f"{type(exc).__name__}: {exc}") from None
        daemon.table.notify_changed()
        return {str(rank): pid for rank, pid in pids.items()}

    async def kill_ranks(self, args, from_node, channel):
        await self.daemon.ranks.kill_job(_int(args, "job"))
        return True

    def _coordinator(self):
        if not self.daemon.coordinator.active:
            raise RemoteError("not_coordinator", f"{self.daemon.node} is not the coordinator")
        return self.daemon.coordinator

    async def ranks_exited(self, args, from_node, channel):
        exits = [(rank, status) for rank, status in args.get("exits") or [] if isinstance(rank, int) and isinstance(status, dict)]
        await self._coordinator().ranks_exited(_int(args, "job"), exits)
        return True

    async def resend_exits(self, args, from_node, channel):
        return self.daemon.resend_exits()

    async def coord_submit(self, args, from_node, channel):
        token = args.get("token")
        return await self._coordinator().submit(args["spec"], args["cred"], token=token if isinstance(token, str) and len(token) <= 64 else None)

    async def coord_kill(self, args, from_node, channel):
        return await self._coordinator().kill(_int(args, "job"), args["cred"])

    async def coord_suspend(self, args, from_node, channel):
        return await self._coordinator().suspend(_int(args, "job"), args["cred"], bool(args.get("hold")))

    async def coord_schedule(self, args, from_node, channel):
        coordinator = self._coordinator()
        result = coordinator.schedule()
        if args.get("switches"):
            result["switch_log"] = list(coordinator.switches)
        return result

    async def switch(self, args, from_node, channel):
        """This node's part of a gang switch: the outgoing jobs' gates close and
        their processes stop; the incoming jobs' processes resume and their gates open.
        Their network context stays where it is, frozen with the processes.

        With ``at`` (this node's wall clock) the switch was announced ahead
        and happens at that instant, on every node together (see ``clock``)."""
        received = time.time()
        at = args.get("at")
        if isinstance(at, (int, float)) and not isinstance(at, bool):
            await clock.sleep_until_wall(at, hold=clock.HOLD)
        start = time.time()
        cpu0 = time.thread_time()
        daemon = self.daemon
        stopped = []
        for job_id in args.get("stop") or []:
            await daemon.jobnet.set_gate(job_id, False)
            daemon.ranks.signal_job(job_id, signal.SIGSTOP)
            daemon.jobnet.set_stopped(job_id, True)
            stopped.append(job_id)
        for job_id in args.get("cont") or []:
            daemon.ranks.signal_job(job_id, signal.SIGCONT)
            daemon.jobnet.set_stopped(job_id, False)
            await daemon.jobnet.set_gate(job_id, True)
        done = time.time()
        cpu = time.thread_time() - cpu0
        # On a node whose CPUs are all taken, other daemons (other nodes of a
        # local cluster, or anything real-time) may wait to do their part:
        # the reply and the follow-up below can wait for them.
        os.sched_yield()
        if stopped:
            daemon.spawn(self._stop_stragglers, stopped)
        return {"received": received, "start": start, "done": done, "cpu": cpu}

    async def _stop_stragglers(self, stopped: list[int]) -> None:
        """Processes forked since the job's last switch escaped the first
        pass, which only knew the older ones; stop them now, off the
        switch's critical path: it costs more than the switch itself (a
        read of every rank's ``cgroup.procs``)."""
        await trio.sleep(STRAGGLER_DELAY)
        for job_id in stopped:
            if self.daemon.jobnet.is_stopped(job_id):
                self.daemon.ranks.signal_new(job_id, signal.SIGSTOP)

    async def job_usage(self, args, from_node, channel):
        return {str(j): self.daemon.ranks.cpu_seconds(j) for j in args.get("jobs") or [] if isinstance(j, int)}

    async def comm_gather(self, args, from_node, channel):
        return await self.daemon.jobnet.gather(_int(args, "job"), str(args.get("reporter")), args.get("addrs") or {})

    async def net_gate(self, args, from_node, channel):
        job_id = _int(args, "job")
        epoch = await self.daemon.jobnet.set_gate(job_id, bool(args.get("open")))
        if not args.get("open") and args.get("wait"):
            await self.daemon.jobnet.wait_gate_closed(job_id)
        return epoch

    async def net_wait_closed(self, args, from_node, channel):
        await self.daemon.jobnet.wait_gate_closed(_int(args, "job"))
        return True

    async def net_counters(self, args, from_node, channel):
        return self.daemon.jobnet.counters(_int(args, "job"))

    async def net_capture_local(self, args, from_node, channel):
        return await self.daemon.jobnet.capture(_int(args, "job"), args.get("expect") or {})

    async def pmi_fence(self, args, from_node, channel):
        return await self.daemon.pmi.fence(_int(args, "job"), _int(args, "number"), str(args.get("reporter")), args.get("puts") or {})

    async def coord_fail(self, args, from_node, channel):
        coordinator = self._coordinator()
        if args.get("kill", True):
            await coordinator.fail(_int(args, "job"), str(args.get("reason") or "failed"))
        else:
            code = args.get("code")
            await coordinator.set_reason(_int(args, "job"), str(args.get("reason") or "failed"), code if isinstance(code, int) else None)
        return True

    async def ckpt_job_env(self, args, from_node, channel):
        """The environment a job had when generation ``gen`` of ``lineage`` was
        taken, from this node's copy of it (the record at the cut, readable by
        root and the job's owner only): what ``gang restart`` gives the new
        job, since an ended job's record no longer carries it."""
        root = self.daemon.config.checkpoint_root
        path = ckptstore.gen_dir(root, _int(args, "lineage"), _int(args, "gen")) / "job.msgpack"
        try:
            saved = await trio.to_thread.run_sync(_read_small_msgpack, path, MAX_SAVED_RECORD)
        except (OSError, ValueError) as exc:
            raise RemoteError("restart_failed", f"{self.daemon.node}: cannot read the job's saved description {path}: {exc}") from None
        env = (saved.get("record") or {}).get("env") if isinstance(saved, dict) else None
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise RemoteError("restart_failed", f"{self.daemon.node}: {path} holds no environment for the job")
        return env

    async def checkpoint_env(self, lineage: int, placement: list[str], gen: int) -> dict[str, str]:
        """The saved environment of a generation, from the first of its nodes that has it."""
        errors = []
        for node in dict.fromkeys(placement):
            try:
                return await self.daemon.call(node, "ckpt_job_env", lineage=lineage, gen=gen)
            except RemoteError as exc:
                errors.append(exc.message)
        raise RemoteError("restart_failed", "; ".join(errors) or "the generation has no nodes")

    async def net_restore(self, args, from_node, channel):
        self.daemon.jobnet.set_context(_int(args, "job"), args.get("contexts") or {})
        return True

    async def output_local(self, args, from_node, channel):
        job_id = _int(args, "job")
        ranks = [r for r in args.get("ranks") or [] if isinstance(r, int)]
        follow = bool(args.get("follow", True))
        return Stream(lambda emit: self._local_output(job_id, ranks, follow, emit))


#: A job.msgpack of a checkpoint is a job record: far below this.
MAX_SAVED_RECORD = 16 << 20


def _read_small_msgpack(path, limit: int):
    """A msgpack file a user's directory may hold: no links followed, at most ``limit`` bytes."""
    try:
        data = safefs.read_bounded_at(None, str(path), limit, path)
    except safefs.UnsafePath as exc:
        raise ValueError(str(exc)) from None
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises many unrelated types on hostile bytes; each becomes one ValueError
        raise ValueError(f"not msgpack ({exc})") from None


def _summary(record: dict) -> dict:
    keys = (
        "id", "name", "owner", "owner_uid", "nranks", "placement", "state", "reason", "submitted", "started", "ended",
        "ranks", "kill_requested", "priority", "slice", "held", "run_seconds", "suspended_seconds",
        "lineage", "restart_of", "ckpt_every",
    )
    summary = {k: record.get(k) for k in keys}
    summary["nodes"] = jobs.nodes_of(record)
    summary["checkpoints"] = sum(1 for e in record.get("checkpoints") or [] if e["state"] == "complete")
    summary["exit_code"] = jobs.exit_code(record) if jobs.is_terminal(record) else None
    if jobs.is_terminal(record):
        summary["cpu_seconds"] = round(sum((s or {}).get("cpu", 0.0) for s in record["ranks"]), 3)
    return summary
