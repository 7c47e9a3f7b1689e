"""What one node does with its jobs, on the coordinator's command.

Launching a job's ranks here, killing them, this node's part of a gang
switch, the CPU they used, their output; reporting their exits to the
coordinator, and bringing the ranks in line with the table whenever a
session with etcd begins. The coordinator reaches these
through :mod:`.calls` like any other node (on its own node, the local call
path), never by calling into this object: the domain below the handlers,
above the ranks, cgroups and the job network it drives.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import trio

from .. import ckptstore, jobs, safefs
from ..rpc import RemoteError
from . import clock
from .ranks import Rank
from .store.jobtable import decode_record, pack

#: After a switch stops a job, how long before its processes forked during
#: the slice are looked for (and stopped): after every node's part.
STRAGGLER_DELAY = 0.005

#: A job.msgpack of a checkpoint is a job record: far below this.
MAX_SAVED_RECORD = 16 << 20

log = logging.getLogger("gangd.ops")


#: Jobs a node remembers were killed here (a launch under way at the kill checks it).
KILLED_KEPT = 4096


class NodeJobs:
    def __init__(
        self, *, node: str, table, ranks, jobnet, pmi, checkpoints, outputs, membership, spawn: Callable[..., None],
        jobs_dir: Path, checkpoint_root: Path, call,
    ):
        """``call``: a peer operation on a node (:meth:`.calls.Calls.call`: rank
        exits go to the coordinator); ``spawn``: the daemon's contained tasks."""
        self.node = node
        self.table = table
        self.ranks = ranks
        self.jobnet = jobnet
        self.pmi = pmi
        self.checkpoints = checkpoints
        self.outputs = outputs
        self.membership = membership
        self.spawn = spawn
        self.jobs_dir = jobs_dir
        self.checkpoint_root = checkpoint_root
        self.call = call
        self._sessions = 0
        # Jobs a kill reached here (the newest KILLED_KEPT): a launch of one of
        # them that was under way when the kill came kills what it started.
        self._killed: dict[int, None] = {}
        # Rank exits on their way to the coordinator (one per rank that ran here: bounded by the ranks).
        self._reports_send, self._reports_receive = trio.open_memory_channel[tuple](math.inf)

    async def launch(self, record: dict, contexts) -> dict[str, int]:
        """Start this node's ranks of ``record`` (the coordinator's copy, with its environment)."""
        self.membership.refuse_if_isolated()
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
            self.table.take(cached, seq)
            current = self.table.get(record["id"])
            if jobs.is_terminal(current) or current.get("kill_requested"):
                # A kill overtook this launch: starting ranks now would orphan them.
                raise RemoteError("job_ended", f"job {record['id']} is {current['state']}; not starting its ranks")
            drop = os.geteuid() == 0 and record["owner_uid"] != 0
            extra = self.jobnet.prepare(record, drop)
            if record.get("restart_of"):
                extra.update(await self.checkpoints.prepare_restart(record))
            extra["GANGD_CKPT_CODEC"] = self.checkpoints.job_codec(record)  # (issue 18: the job's, its lineage's or the cluster's)
            extra["GANGD_CKPT_PIPELINE"] = self.checkpoints.job_pipeline(record)  # (likewise; "": the defaults)
            if contexts:
                self.jobnet.set_context(record["id"], contexts)
            rank_setup = (lambda rank: self.pmi.prepare(record, rank, self.spawn)) if record.get("mpi") else None
            pids = await self.ranks.launch(self.spawn, record, self.jobs_dir / str(record["id"]), extra, rank_setup)
            current = self.table.get(record["id"])
            if record["id"] in self._killed or current is None or jobs.is_terminal(current) or current.get("kill_requested"):
                # A kill overtook the launch while its ranks were starting: they
                # were not there to be killed then; they are now.
                await self.ranks.kill_job(record["id"])
                raise RemoteError("job_ended", f"job {record['id']} was killed while its ranks started on {self.node}")
        except RemoteError:
            raise
        except Exception as exc:
            log.exception("launching job %d failed", record["id"])
            raise RemoteError("launch_failed", f"{type(exc).__name__}: {exc}") from None
        self.table.notify_changed()
        return {str(rank): pid for rank, pid in pids.items()}

    async def kill(self, job_id: int) -> None:
        self._killed[job_id] = None
        while len(self._killed) > KILLED_KEPT:
            del self._killed[next(iter(self._killed))]
        await self.ranks.kill_job(job_id)

    async def switch(self, stop: list[int], cont: list[int], at: float | None) -> dict:
        """This node's part of a gang switch: the outgoing jobs' gates close and
        their processes stop; the incoming jobs' processes resume and their gates open.
        Their network context stays where it is, frozen with the processes.

        With ``at`` (this node's wall clock) the switch was announced ahead
        and happens at that instant, on every node together (see ``clock``)."""
        received = time.time()
        if at is not None:
            await clock.sleep_until_wall(at, hold=clock.HOLD)
        start = time.time()
        cpu0 = time.thread_time()
        stopped = []
        for job_id in stop:
            await self.jobnet.set_gate(job_id, False)
            self.ranks.signal_job(job_id, signal.SIGSTOP)
            self.jobnet.set_stopped(job_id, True)
            stopped.append(job_id)
        for job_id in cont:
            self.ranks.signal_job(job_id, signal.SIGCONT)
            self.jobnet.set_stopped(job_id, False)
            await self.jobnet.set_gate(job_id, True)
        done = time.time()
        cpu = time.thread_time() - cpu0
        # On a node whose CPUs are all taken, other daemons (other nodes of a
        # local cluster, or anything real-time) may wait to do their part:
        # the reply and the follow-up below can wait for them.
        os.sched_yield()
        if stopped:
            self.spawn(self._stop_stragglers, stopped)
        return {"received": received, "start": start, "done": done, "cpu": cpu}

    async def _stop_stragglers(self, stopped: list[int]) -> None:
        """Processes forked since the job's last switch escaped the first
        pass, which only knew the older ones; stop them now, off the
        switch's critical path: it costs more than the switch itself (a
        read of every rank's ``cgroup.procs``)."""
        await trio.sleep(STRAGGLER_DELAY)
        for job_id in stopped:
            if self.jobnet.is_stopped(job_id):
                self.ranks.signal_new(job_id, signal.SIGSTOP)

    def usage(self, job_ids: list[int]) -> dict[str, float]:
        """CPU seconds each job's ranks here used so far."""
        return {str(j): self.ranks.cpu_seconds(j) for j in job_ids}

    async def local_output(self, job_id: int, ranks: list[int], follow: bool, emit) -> None:
        """Emit ``{"rank", "stream", "data"}`` items of this node's ranks of the job, each rank in order."""

        async def one(rank: int) -> None:
            key = (job_id, rank)
            # The launch may still be on its way to this node.
            while key not in self.ranks.logs:
                record = self.table.get(job_id) or await self.table.fetch(job_id)
                # (record None while following: its launch has not reached this node yet)
                if not follow or (record is not None and (jobs.is_terminal(record) or record["ranks"][rank] is not None)):
                    break
                await self.table.wait_changed()
            log_ = self.ranks.logs.get(key)
            if log_ is not None:
                source = log_.follow(follow)
            else:  # after a daemon restart: only the file is left
                source = self.outputs.read(job_id, rank)
            async for stream, data in source:
                await emit({"rank": rank, "stream": stream, "data": data})

        async with trio.open_nursery() as nursery:
            for rank in ranks:
                nursery.start_soon(one, rank)

    async def saved_env(self, lineage: int, gen: int) -> dict[str, str]:
        """The environment a job had when generation ``gen`` of ``lineage`` was
        taken, from this node's copy of it (the record at the cut, readable by
        root and the job's owner only): what ``gang restart`` gives the new
        job, since an ended job's record no longer carries it."""
        path = ckptstore.gen_dir(self.checkpoint_root, lineage, gen) / "job.msgpack"
        try:
            saved = await trio.to_thread.run_sync(read_small_msgpack, path, MAX_SAVED_RECORD)
        except (OSError, ValueError) as exc:
            raise RemoteError("restart_failed", f"{self.node}: cannot read the job's saved description {path}: {exc}") from None
        env = (saved.get("record") or {}).get("env") if isinstance(saved, dict) else None
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise RemoteError("restart_failed", f"{self.node}: {path} holds no environment for the job")
        return env


    # ------------------------------------------------------------ this node in line with the table

    async def session_started(self) -> None:
        """A session with etcd began (the table is read): bring this node's
        ranks in line with it. A node back from a stall or a partition kills
        every rank of a job the table no longer runs here, so nothing is
        orphaned; a daemon that restarted reports the ranks it lost."""
        self._sessions += 1
        if self._sessions == 1:
            self._lost_ranks_from_previous_life()
        orphans = set()
        for (job_id, rank), entry in list(self.ranks.ranks.items()):
            if entry.status is not None:
                continue
            record = self.table.get(job_id)
            if record is None or jobs.is_terminal(record) or rank >= len(record["placement"]) or record["placement"][rank] != self.node:
                orphans.add(job_id)
        for job_id in sorted(orphans):
            record = self.table.get(job_id)
            log.warning("killing this node's ranks of job %d: the job is %s", job_id, record["state"] if record else "no longer in the table")
            self.spawn(self.ranks.kill_job, job_id)
        self.resend_exits()

    def kill_if_ended(self, record: dict) -> None:
        """An ended job's ranks go, here too, even if the coordinator's kill never reached this node."""
        if jobs.is_terminal(record) and any(r.status is None for r in self.ranks.of_job(record["id"])):
            self.spawn(self.ranks.kill_job, record["id"])

    async def grace_over(self, why: str) -> None:
        if self.ranks.running():
            log.error("%s: killing this node's %d running ranks (their jobs were failed when its lease expired)", why, self.ranks.running())
            await self.ranks.kill_all()


    # ------------------------------------------------------------ rank exits

    def rank_exited(self, entry: Rank) -> None:
        words = self.checkpoints.last_words(entry.job_id, entry.rank)
        if words and entry.status is not None and entry.status.get("code") and "why" not in entry.status:
            entry.status["why"] = words  # (it ended on that error: its exit says why, not "exit 1" alone; cut where recorded)
        self._reports_send.send_nowait((entry.job_id, entry.rank, entry.status))
        if all(r.status is not None for r in self.ranks.of_job(entry.job_id)):
            self.ranks.envs.pop(entry.job_id, None)
        # Its local peers hear at once; remote ones when the table says so.
        why = f"rank {entry.rank} on {self.node} {jobs.describe_status(entry.status)}"
        self.jobnet.rank_exited(entry.job_id, entry.rank, why)
        self.checkpoints.rank_exited(entry.job_id, entry.rank, why)
        self.table.notify_changed()

    async def report_exits(self) -> None:
        """Deliver rank exits to whoever is coordinator, retrying until they land.

        Exits that pile up while a report is in flight go together in the
        next one, one request per job: a job of many ranks ending at once
        costs the coordinator a few updates, not one per rank.
        """
        async for first in self._reports_receive:
            batch = [first]
            while True:
                try:
                    batch.append(self._reports_receive.receive_nowait())
                except trio.WouldBlock:
                    break
            by_job: dict[int, list] = {}
            for job_id, rank, status in batch:
                by_job.setdefault(job_id, []).append([rank, status])
            for job_id, exits in by_job.items():
                if self.checkpoints.exits_held(job_id):  # (its reason first; other jobs' exits do not wait)
                    self.spawn(self._deliver_exits_after_report, job_id, exits)
                else:
                    await self._deliver_exits(job_id, exits)

    async def _deliver_exits_after_report(self, job_id: int, exits: list) -> None:
        await self.checkpoints.exits_after_report(job_id)
        await self._deliver_exits(job_id, exits)

    async def _deliver_exits(self, job_id: int, exits: list) -> None:
        while True:
            record = self.table.get(job_id)
            if record is not None:
                exits = [e for e in exits if record["ranks"][e[0]] is None]
                if jobs.is_terminal(record) or not exits:
                    return
            leader = self.membership.coordinator()
            try:
                if leader is None:
                    raise RemoteError("no_coordinator", "no coordinator right now")
                await self.call(leader, "ranks_exited", job=job_id, exits=exits)
                return
            except Exception as exc:  # noqa: BLE001 -- RemoteError, the coordinator's disk failing, a link down: retried until delivered
                log.debug("reporting exits of job %d failed (%s); retrying", job_id, exc)
                await trio.sleep(0.2)

    def resend_exits(self) -> int:
        """Queue again every local rank exit the table does not show yet (a
        coordinator may have acknowledged one and died before replicating it)."""
        count = 0
        for (job_id, rank), entry in self.ranks.ranks.items():
            record = self.table.get(job_id)
            if entry.status is not None and record is not None and not jobs.is_terminal(record) and record["ranks"][rank] is None:
                self._reports_send.send_nowait((job_id, rank, entry.status))
                count += 1
        return count

    def _lost_ranks_from_previous_life(self) -> None:
        """Ranks this node ran before a restart are gone (they die with the
        daemon): report them so their jobs end instead of waiting forever."""
        for record in self.table.active():
            if not record["started"]:
                continue
            for rank in jobs.ranks_on(record, self.node):
                if record["ranks"][rank] is None:
                    status = {"lost": True, "node": self.node, "why": f"gangd on {self.node} restarted"}
                    self._reports_send.send_nowait((record["id"], rank, status))

    async def drain_reports(self, timeout: float) -> None:
        """Give the exit reports queued so far up to ``timeout`` to reach the coordinator (a daemon stopping)."""
        with trio.move_on_after(timeout):
            # Polled: the queue has no "drained" event, and its reader also empties it batch by batch.
            while self._reports_receive.statistics().current_buffer_used:  # noqa: ASYNC110 -- bounded poll of a queue's fill
                await trio.sleep(0.02)


def read_small_msgpack(path, limit: int):
    """A msgpack file a user's directory may hold: no links followed, at most ``limit`` bytes."""
    try:
        data = safefs.read_bounded_at(None, str(path), limit, path)
    except safefs.UnsafePath as exc:
        raise ValueError(str(exc)) from None
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises many unrelated types on hostile bytes; each becomes one ValueError
        raise ValueError(f"not msgpack ({exc})") from None
