"""The coordinator: sole writer of the job table, placement and job lifecycle.

Exactly one daemon acts as coordinator at a time (the configured master,
else the lowest-named live node). Every change to a job goes through
:meth:`Coordinator.update`, which serialises read-modify-write, stamps the
record with the next sequence number, persists it and replicates it to every
node. A node that becomes coordinator first pulls what the others know, so a
takeover loses nothing that any live node saw.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import time

import trio

from .. import jobs
from ..rpc import RemoteError
from .peers import natural_key

log = logging.getLogger("gangd.coordinator")

KILL_REPORT_WAIT = 10.0


def permission_check(record: dict, cred: dict, action: str) -> None:
    if cred["uid"] in (0, record["owner_uid"]):
        return
    raise RemoteError(
        "permission_denied",
        f"job {record['id']} belongs to {record['owner']}; only its owner or root may {action} it",
    )


def place(record: dict, free: dict[str, int]) -> list[str] | None:
    """Ranks of ``record`` on nodes with ``free`` cores, or None if they do not fit now.

    Block placement (ranks 0..k-1 on the first node, and so on). With
    ``per_node`` each node takes that many ranks in turn (Slurm's
    --ntasks-per-node). Without it the ranks are spread as evenly as the free
    cores allow — what a user submitting "8 ranks on a 4-node cluster"
    expects. ``nodes`` picks that many nodes, those with the most room.
    """
    n = record["nranks"]
    per_node = record.get("per_node")
    candidates = sorted((name for name in free if free[name] > 0), key=natural_key)
    if record.get("nodelist"):
        candidates = [c for c in candidates if c in record["nodelist"]]
    room = {c: min(free[c], per_node) if per_node else free[c] for c in candidates}
    if record.get("nodes_wanted"):
        wanted = record["nodes_wanted"]
        if len(candidates) < wanted:
            return None
        chosen = set(sorted(candidates, key=lambda c: -room[c])[:wanted])  # stable: ties keep name order
        candidates = [c for c in candidates if c in chosen]
    if sum(room[c] for c in candidates) < n:
        return None
    counts = dict.fromkeys(candidates, 0)
    remaining = n
    if per_node:
        for c in candidates:
            counts[c] = min(room[c], remaining)
            remaining -= counts[c]
    else:
        while remaining:  # water-filling: one more rank per node with room, in turn
            for c in candidates:
                if remaining and counts[c] < room[c]:
                    counts[c] += 1
                    remaining -= 1
    return [c for c in candidates for _ in range(counts[c])]


class Coordinator:
    def __init__(self, daemon):
        self.daemon = daemon
        self.table = daemon.table
        self.active = False
        self._lock = trio.Lock()
        self._kick = trio.Event()

    # ------------------------------------------------------------ plumbing

    async def update(self, job_id: int, change) -> dict:
        """Apply ``change(record)`` to a copy of the record and commit it everywhere."""
        async with self._lock:
            if not self.active:
                raise RemoteError("not_coordinator", f"{self.daemon.node} is no longer the coordinator")
            current = self.table.get(job_id)
            if current is None:
                raise RemoteError("no_such_job", f"no job {job_id}")
            record = copy.deepcopy(current)
            if change(record) is False:
                return current
            await self.table.commit(record)
        self.daemon.peers.broadcast("table", records=[record])
        return record

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        """The scheduling loop: start queued jobs whenever something changed."""
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            if self.active:
                try:
                    await self._schedule()
                except Exception:  # e.g. the state disk is full: log, retry on the next kick
                    log.exception("scheduling pass failed")

    # ------------------------------------------------------------ takeover

    async def take_over(self) -> None:
        """Called when this node becomes coordinator."""
        peers = self.daemon.peers
        for node in peers.up_nodes():
            if node == self.daemon.node:
                continue
            try:
                records = await peers.call(node, "table_since", seq=0)
            except RemoteError as exc:
                log.warning("could not pull the job table from %s: %s", node, exc)
                continue
            for record in records:
                await self.table.apply(record)
        # Continue numbering after everything anybody has seen.
        self.active = True
        log.info("this node is now the coordinator (%d jobs known, seq %d)", len(self.table.records), self.table.seq)
        await self.check_nodes()
        for record in self.table.active():
            if record["state"] == jobs.QUEUED and record["placement"]:
                # The previous coordinator died while launching it; launch is idempotent per rank.
                log.info("job %d was being launched by the previous coordinator; launching again", record["id"])
                self.daemon.spawn(self._start, record["id"])
        # Bring every node up to date with the merged table, and collect the
        # exits the previous coordinator may have taken to its grave.
        self.daemon.peers.broadcast("table", records=self.table.since(0))
        for node in self.daemon.peers.up_nodes():
            try:
                await self.daemon.call(node, "resend_exits")
            except RemoteError as exc:
                log.warning("could not ask %s to resend rank exits: %s", node, exc)
        self.kick()

    # ------------------------------------------------------------ submit

    def capacity(self, spec: dict) -> tuple[int, str]:
        """Most ranks the cluster could ever hold for this job, and how that was counted."""
        config = self.daemon.config
        nodes = list(config.nodes)
        if spec.get("nodelist"):
            nodes = [n for n in nodes if n.name in spec["nodelist"]]
        if spec.get("nodes"):
            nodes = sorted(nodes, key=lambda n: -n.cores)[: spec["nodes"]]
        per_node = spec.get("per_node")
        total = sum(min(n.cores, per_node) if per_node else n.cores for n in nodes)
        how = f"{len(nodes)} node(s) x " + (f"{per_node} per node" if per_node else "their cores")
        return total, how

    async def submit(self, spec: dict, cred: dict) -> dict:
        argv = spec.get("argv")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise RemoteError("bad_request", "a job needs a command to run")
        for key, kind in (("name", str), ("cwd", str), ("env", dict)):
            if spec.get(key) is not None and not isinstance(spec[key], kind):
                raise RemoteError("bad_request", f"{key!r} must be a {kind.__name__}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (spec.get("env") or {}).items()):
            raise RemoteError("bad_request", "the environment must map strings to strings")
        for key in ("per_node", "nodes"):
            value = spec.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RemoteError("bad_request", f"{key!r} must be a positive integer, not {value!r}")
        if spec.get("nodelist") is not None and not (
            isinstance(spec["nodelist"], list) and all(isinstance(n, str) for n in spec["nodelist"])
        ):
            raise RemoteError("bad_request", "'nodelist' must be a list of node names")
        nranks = spec.get("nranks")
        if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
            raise RemoteError("bad_request", f"the number of ranks must be a positive integer, not {nranks!r}")
        names = [n.name for n in self.daemon.config.nodes]
        for name in spec.get("nodelist") or []:
            if name not in names:
                raise RemoteError("bad_request", f"unknown node {name!r} in --nodelist (nodes: {', '.join(names)})")
        if spec.get("nodes") is not None and not (1 <= spec["nodes"] <= len(names)):
            raise RemoteError("bad_request", f"--nodes must be between 1 and {len(names)}, not {spec['nodes']}")
        if spec.get("nodes") and spec.get("per_node") and spec["nodes"] * spec["per_node"] < nranks:
            raise RemoteError(
                "bad_request",
                f"{nranks} ranks do not fit on {spec['nodes']} node(s) with {spec['per_node']} per node",
            )
        capacity, how = self.capacity(spec)
        if nranks > capacity:
            raise RemoteError(
                "too_large",
                f"job asks for {nranks} ranks but the cluster can hold at most {capacity} ({how})",
            )
        if os.geteuid() != 0 and cred["uid"] != os.geteuid():
            raise RemoteError(
                "permission_denied",
                f"gangd runs as uid {os.geteuid()} (not root) and can only run jobs for that user",
            )
        async with self._lock:
            job_id = max(self.table.next_job_id(), 1)
            record = jobs.new_record(
                job_id=job_id, spec=spec, owner_uid=cred["uid"], owner_name=cred["user"], owner_gid=cred["gid"]
            )
            await self.table.commit(record)
        self.daemon.peers.broadcast("table", records=[record])
        log.info("job %d (%s) submitted by %s: %d ranks", job_id, record["name"], cred["user"], nranks)
        self.kick()
        return record

    # ------------------------------------------------------------ placement

    def _free_cores(self) -> dict[str, int]:
        config = self.daemon.config
        peers = self.daemon.peers
        free = {n.name: n.cores for n in config.nodes if peers.is_up(n.name)}
        for record in self.table.active():
            for node in record["placement"]:
                if node in free:
                    free[node] -= 1
        return free

    async def _schedule(self) -> None:
        free = self._free_cores()
        for record in sorted(self.table.active(), key=lambda r: r["id"]):
            if record["state"] != jobs.QUEUED or record["placement"]:
                continue
            try:
                placement = place(record, free)
            except Exception as exc:  # a bug or a record from an older version: fail it, keep the queue moving
                log.exception("placing job %d failed", record["id"])
                await self._fail(record["id"], f"cannot place the job: {exc}")
                continue
            if placement is None:
                break  # first come, first served: nobody overtakes the head of the queue
            for node in placement:
                free[node] -= 1
            await self.update(record["id"], lambda r, placement=placement: r.update(placement=placement))
            self.daemon.spawn(self._start, record["id"])

    async def _start(self, job_id: int) -> None:
        record = self.table.get(job_id)
        nodes = jobs.nodes_of(record)
        failures: list[str] = []

        async def launch_on(node: str) -> None:
            try:
                await self.daemon.call(node, "launch", record=record)
            except RemoteError as exc:
                failures.append(f"{node}: {exc.message}")
            except Exception as exc:  # e.g. this node's own disk failing
                log.exception("job %d: launch on %s failed", job_id, node)
                failures.append(f"{node}: {type(exc).__name__}: {exc}")

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(launch_on, node)
        if failures:
            reason = "launch failed on " + "; ".join(failures)
            log.error("job %d: %s", job_id, reason)
            await self._fail(job_id, reason)
            return

        def running(r):
            if r["state"] != jobs.QUEUED:
                return False  # killed or failed while launching
            r["state"] = jobs.RUNNING
            r["started"] = time.time()

        record = await self.update(job_id, running)
        if record["state"] != jobs.RUNNING:
            # Killed or failed while launching: whatever did start must go.
            await self._kill_everywhere(job_id)

    # ------------------------------------------------------------ exits and kills

    async def ranks_exited(self, job_id: int, exits: list[tuple[int, dict]]) -> None:
        """Record the exit of some of a job's ranks (one node's batch) in one update."""
        record = self.table.get(job_id)
        if record is None:
            return
        exits = [(rank, status) for rank, status in exits if 0 <= rank < record["nranks"] and record["ranks"][rank] is None]
        if not exits:
            return
        culprit = None
        if record["kill_on_bad_exit"] and not record["reason"]:
            for rank, status in exits:
                if (status.get("signal") or status.get("code", 0) != 0) and not status.get("killed"):
                    culprit = (rank, status)
                    break

        def change(r):
            if jobs.is_terminal(r):
                return False
            for rank, status in exits:
                if r["ranks"][rank] is None:
                    r["ranks"][rank] = status
            if culprit and not r["reason"]:
                rank, status = culprit
                r["reason"] = f"rank {rank} on {status.get('node', '?')} {jobs.describe_status(status)}"
            self._finish_if_done(r)

        record = await self.update(job_id, change)
        if culprit and not jobs.is_terminal(record):
            log.info("job %d: %s; killing the other ranks", job_id, record["reason"])
            self.daemon.spawn(self._kill_everywhere, job_id)
        if jobs.is_terminal(record):
            self.kick()

    def _finish_if_done(self, record: dict) -> None:
        if jobs.is_terminal(record) or any(s is None for s in record["ranks"]):
            return
        if record["kill_requested"]:
            record["state"] = jobs.KILLED
        elif record["reason"] or any(s.get("signal") or s.get("code", 0) or s.get("lost") for s in record["ranks"]):
            record["state"] = jobs.FAILED
        else:
            record["state"] = jobs.DONE
        record["ended"] = time.time()
        log.info("job %d %s%s", record["id"], record["state"], f": {record['reason']}" if record["reason"] else "")

    async def kill(self, job_id: int, cred: dict) -> dict:
        record = self.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, "kill")
        if jobs.is_terminal(record):
            return record

        def change(r):
            if jobs.is_terminal(r):
                return False
            r["kill_requested"] = cred["user"]
            r["reason"] = r["reason"] or f"killed by {cred['user']}"
            if not r["placement"] or r["state"] == jobs.QUEUED and not r["started"]:
                # never launched: nothing to wait for
                r["ranks"] = [s or {"killed": True, "signal": signal.SIGKILL, "never_started": True} for s in r["ranks"]]
            self._finish_if_done(r)

        await self.update(job_id, change)
        await self._kill_everywhere(job_id)
        self.kick()
        # Every rank is reaped by now; answer once their exit reports are in,
        # so `gang kill` returns when the job really is over.
        with trio.move_on_after(KILL_REPORT_WAIT):
            while not jobs.is_terminal(record := self.table.get(job_id)):
                await self.table.wait_changed()
        return record

    async def _kill_everywhere(self, job_id: int) -> None:
        record = self.table.get(job_id)

        async def kill_on(node):
            if not self.daemon.peers.is_up(node):
                return
            try:
                await self.daemon.call(node, "kill_ranks", job=job_id)
            except RemoteError as exc:
                log.warning("job %d: could not kill ranks on %s: %s", job_id, node, exc)

        async with trio.open_nursery() as nursery:
            for node in jobs.nodes_of(record):
                nursery.start_soon(kill_on, node)

    async def _fail(self, job_id: int, reason: str, lost_nodes: frozenset = frozenset()) -> None:
        def change(r):
            if jobs.is_terminal(r):
                return False
            r["reason"] = r["reason"] or reason
            for rank, node in enumerate(r["placement"]):
                if r["ranks"][rank] is None and (node in lost_nodes or not r["started"]):
                    r["ranks"][rank] = {"lost": True, "node": node, "why": reason}
            self._finish_if_done(r)

        await self.update(job_id, change)
        await self._kill_everywhere(job_id)
        self.kick()

    async def check_nodes(self) -> None:
        """Fail every active job that has ranks on a node that is down."""
        peers = self.daemon.peers
        for record in list(self.table.active()):
            down = sorted({n for n in record["placement"] if not peers.is_up(n)}, key=natural_key)
            if not down:
                continue
            why = "; ".join(f"node {n} ({self.daemon.config.spec(n).endpoint}) went down: {peers.links[n].why_down}" for n in down)
            log.warning("job %d fails: %s", record["id"], why)
            await self._fail(record["id"], why, frozenset(down))
