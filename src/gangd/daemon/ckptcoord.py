"""Consistent checkpoints and restarts across the cluster: the coordinator's side.

One checkpoint of a job is a *generation*. The coordinator runs it as
rounds that every node of the job answers in parallel (each node's part is
:mod:`gangd.daemon.checkpoint`)::

    begin    SIGQUIT every rank; each reports the next boundary it can stop at
    cut      the largest report is the cut; ranks run up to it and block;
             send gates close                                   (start sync)
    capture  network context + job record to disk; ranks write their state
    resume   gates open, ranks continue                         (end sync)
    commit   every file fsynced, each node's manifest written

Only when every node committed is the generation recorded as *complete*, in
the job's record — which the table replicates and fsyncs on every node. Any
failure on the way (a rank or a node dying, a full disk, a timeout) aborts
the generation on every node; the previous complete one stays usable. The
previous complete generation is kept until a newer one is complete; older
ones are removed (``checkpoint_keep``).

A restart (``gang restart``) is a new job in the same *lineage*, pinned to
the nodes of the generation, which every node first verifies against its
manifest (sizes and checksums; a file unchanged since it was last found
intact is not read again, :mod:`gangd.daemon.verified`, and the ranks check
every byte as they restore). The new job's gates stay closed until every
rank has loaded its state. A restart elsewhere first moves the files
of ranks that move (:mod:`gangd.daemon.staging`); files that are only on
nodes that are down are rebuilt, if the generation is *protected*, from its
redundancy on the node replacing each lost one (:mod:`gangd.daemon.rebuild`);
:meth:`~gangd.daemon.ckptrestart.Restarts.recover` does the same for the
system, when a node is lost under a running job.

Three parts, each taking only what it uses: this module's
:class:`CheckpointCoordinator` runs the rounds and owns the generations'
record, their redundancy write and their retention;
:mod:`gangd.daemon.ckptrestart` restarts and recovers from them;
:mod:`gangd.daemon.ckptflush` copies them to a shared flush directory
(SCR's third level) and back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .. import jobs
from ..checkpoint import node as nd
from ..checkpoint import retention
from ..checkpoint import round as rd
from ..redundancy.plan import default_level
from ..rpc import RemoteError
from .access import permission_check
from .checkpoint import OFFER_CANDIDATES
from .ckptflush import Flushes
from .ckptrestart import Restarts
from .interval import IntervalPlanner, Ports
from .jobnet import expected_deliveries
from .store import Fence

if TYPE_CHECKING:
    from .coordinator import CheckpointHost

log = logging.getLogger("gangd.ckptcoord")

ROOT = {"uid": 0, "gid": 0, "user": "root"}
# A checkpoint keeps its job running whatever the gang slot (pinned) for at most this many time slices: its
# ranks choose the cut (and a planned generation's ``at``), so a rank that names an iteration it never reaches
# would otherwise keep its job running through every other job's slots for the whole checkpoint_timeout, again
# and again. Past it the round goes on, the job gang-scheduled like any other (it reaches the cut in its slots).
PIN_SLICES = 100


class LiveRound:
    """A round under way and whoever waits for it. Reads as the mapping
    ``gang ckpt ls`` shows (``gen``, ``phase``, ``trigger``, ``started``)."""

    def __init__(self, rnd: rd.Round):
        self.round = rnd
        self.done = trio.Event()
        self.result: dict | None = None

    def __getitem__(self, key: str):
        rnd = self.round
        return {"gen": rnd.gen, "phase": rnd.phase.value, "trigger": rnd.trigger, "started": rnd.started}[key]


class TermTasks(Protocol):
    """What every part run in the coordinator's term asks of it (DESIGN.md 1: narrow ports, not the
    coordinator object): whether the term lasts, tasks that end with it, fenced changes to jobs, and
    failing a job. The checkpoint coordinator's port (:class:`TermPort`) and the recoveries'
    (:class:`gangd.daemon.recover.RecoveryTerm`) each add what they use besides."""

    @property
    def active(self) -> bool: ...
    def spawn(self, fn: Callable[..., Any], *args: Any) -> None: ...
    async def update(self, job_id: int, change: Callable[[dict], Any]) -> dict: ...
    async def fail(self, job_id: int, reason: str, lost_nodes: frozenset = frozenset(), *, cause: bool = False) -> None: ...


class TermPort(TermTasks, Protocol):
    """What the checkpoint coordinator asks of the coordinator's term besides :class:`TermTasks`: its
    fence, commands to nodes under it, submitting a job, and holding a job running while its round
    needs it."""

    pinned: set[int]  # jobs that must run whatever their slot (a checkpoint under way)

    def current_fence(self) -> Fence: ...
    async def call(self, node: str, op: str, **args: Any) -> Any: ...
    async def submit(self, spec: dict, cred: dict, internal: dict | None = None, token: str | None = None) -> dict: ...
    def gang_changed(self) -> None: ...
    async def reconcile(self, at: float | None = None) -> None: ...


class CheckpointCoordinator:
    def __init__(self, term: TermPort, host: CheckpointHost):
        """``term``: the coordinator's term (:class:`TermPort`); ``host``: this node's
        name, configuration, job table, membership and calls to other nodes."""
        self.co = term
        self.host = host
        self.live: dict[int, LiveRound] = {}  # job -> the checkpoint under way
        self.periodic: set[int] = set()
        # lineage -> the last generation number handed out: a refused round
        # leaves no entry, but its number is spent (the nodes remember it aborted).
        self.issued: dict[int, int] = {}
        # The third level: generations copied to [checkpoint] flush_dir behind the job, and back on a restart.
        self.flushes = Flushes(term, node=host.node, config=host.config, table=host.table, generations=self.generations, on_job_nodes=self._all)
        # `gang restart` and a lost node's recovery, and the restored reports of the jobs they start.
        self.restarts = Restarts(term, host, lineage_records=self.lineage_records, generations=self.generations, on_job_nodes=self._all,
                                 flushes=self.flushes)
        config = self.host.config
        membership = host.membership
        self.planner = IntervalPlanner(Ports(
            record=self.host.table.get, generations=self.generations, lineage_records=self.lineage_records,
            level=lambda record: self.level(record)[0], on_job_nodes=self.host.ops.on_job_nodes,
            histories=membership.nodelog.histories,
            priors=lambda: {n.name: config.prior_mtbf(n) for n in config.nodes}, prior_weight=config.failure_prior_weight,
            replan=config.checkpoint_replan, interval_min=config.checkpoint_interval_min, interval_max=config.checkpoint_interval_max,
            term=lambda: self.co.current_fence().term, active=lambda: self.co.active,
        ))

    # ------------------------------------------------------------ lineage

    def lineage_records(self, record: dict) -> list[dict]:
        """The lineage's jobs in the hot table and, as last read (read_lineage), in the history."""
        return self.host.table.lineage(record.get("lineage") or record["id"])

    def generations(self, record: dict) -> list[dict]:
        """Every recorded generation of the job's lineage, oldest first, each with the job that took it."""
        out = []
        for r in self.lineage_records(record):
            for entry in r.get("checkpoints") or []:
                out.append({**entry, "job": r["id"]})
        return sorted(out, key=lambda e: e["gen"])

    def _next_gen(self, record: dict) -> int:
        known = [e["gen"] for e in self.generations(record)]
        lineage = {r["id"] for r in self.lineage_records(record)}
        known += [live["gen"] for job_id, live in self.live.items() if job_id in lineage]
        key = record.get("lineage") or record["id"]
        gen = max([*known, self.issued.get(key, 0)]) + 1
        self.issued[key] = gen
        return gen

    def delta_gate(self, record: dict) -> bool:
        """Whether the ranks of ``record`` may write deltas (:func:`delta_gate`)."""
        asked = record.get("ckpt_mode") or next((r["ckpt_mode"] for r in self.lineage_records(record) if r.get("ckpt_mode")), None)
        return delta_gate(asked, self.host.config.checkpoint_mode)

    def level(self, record: dict) -> tuple[str, str]:
        """The redundancy level of the job's generations, and why it is not
        the one asked for (or ""): the job's ``--ckpt-redundancy`` (a
        restarted job inherits its lineage's), else the cluster's
        ``[checkpoint] redundancy``; ``auto`` and a level the job's nodes
        cannot have (its ranks landed on one node) follow the node count."""
        asked = record.get("ckpt_redundancy")
        if asked is None:
            asked = next((r.get("ckpt_redundancy") for r in sorted(self.lineage_records(record), key=lambda r: r["id"])
                          if r.get("ckpt_redundancy")), None)
        count = len(jobs.nodes_of(record))
        if asked is None:
            asked = self.host.config.checkpoint_redundancy
        if asked == "auto":
            return default_level(count), ""
        if asked != "local" and count < 2:
            return "local", f"{asked} needs 2 nodes; the job's ranks are all on one"
        return asked, ""

    # ------------------------------------------------------------ requests

    async def request(self, job_id: int, cred: dict, trigger: str, wait: bool = True, at: int | None = None) -> dict:
        record = self.host.table.get(job_id)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, "checkpoint")
        if record["state"] not in (jobs.RUNNING, jobs.SUSPENDED):
            raise RemoteError("bad_state", f"job {job_id} is {record['state']}; only a running or suspended job can be checkpointed")
        if record.get("children") or record.get("spawned_by") is not None:
            # (see gangd.daemon.spawns: the intercommunicators between them are in no rank's image)
            related = f"was spawned by job {record['spawned_by']}" if record.get("spawned_by") is not None else "has spawned processes (MPI_Comm_spawn)"
            raise RemoteError("not_supported", f"job {job_id} {related}: gangd does not checkpoint jobs with dynamic processes")
        await self.host.table.read_lineage(record.get("lineage") or job_id)  # (its generations in the history count too)
        live = self.live.get(job_id)
        if live is None:
            level, note = self.level(record)
            rnd = rd.Round(
                job=job_id, gen=self._next_gen(record), lineage=record.get("lineage") or job_id,
                nodes=frozenset(jobs.nodes_of(record)), trigger=trigger, started=time.time(),
                placement=list(record["placement"]), expect=expected_deliveries, nranks=record["nranks"], clock=time.time,
                redundancy=level, force_full=not self.delta_gate(record), at=at,
            )
            rnd.entry["level"] = level
            if note:
                rnd.entry["level_note"] = note
            live = LiveRound(rnd)
            self.live[job_id] = live
            self.co.spawn(self._run, job_id, live)
        if not wait:
            return {"job": job_id, "gen": live["gen"], "state": "running", "trigger": live["trigger"]}
        await live.done.wait()
        result = live.result
        if result is None:
            raise RemoteError("internal", f"checkpoint {live['gen']} of job {job_id} ended without a result")
        if result["state"] == "refused":
            raise RemoteError(result["code"], result["reason"])
        return result

    async def request_all(self, trigger: str) -> list[dict]:
        """Checkpoint every running or suspended job (SIGUSR1 to a daemon): one
        entry per job, its generation or why it was refused (a job whose ranks
        take no checkpoints does not keep the others from theirs)."""
        out = []
        for record in list(self.host.table.active()):
            if record["state"] in (jobs.RUNNING, jobs.SUSPENDED):
                try:
                    out.append(await self.request(record["id"], ROOT, trigger, wait=False))
                except RemoteError as exc:
                    out.append({"job": record["id"], "refused": exc.message})
        return out

    # ------------------------------------------------------------ one generation

    async def _all(self, record: dict, op: str, **args) -> dict[str, Any]:
        """``op`` for this job on every node of it at once (one error naming the nodes if any fails)."""
        return await self.host.ops.on_job_nodes(record, op, job=record["id"], term=self.co.current_fence().term, **args)

    async def _run(self, job_id: int, live: LiveRound) -> None:
        """The trio shell of :class:`gangd.checkpoint.round.Round`: feed it
        the nodes' answers, execute its instructions."""
        record = self.host.table.get(job_id)
        rnd = live.round
        if record is None:  # (it ended between the request and this task's start)
            self._finish(job_id, live, {"job": job_id, "gen": rnd.gen, "state": "aborted", "code": "no_such_job",
                                        "reason": f"job {job_id} ended before its checkpoint began"})
            return
        co = self.co
        co.pinned.add(job_id)  # a suspended job runs for its checkpoint; no switch stops it until it is on disk (or PIN_SLICES pass)
        pinned = True

        def unpin() -> None:
            nonlocal pinned
            if pinned:
                pinned = False
                co.pinned.discard(job_id)
                co.gang_changed()

        limit = trio.CancelScope()
        try:
            try:
                co.spawn(self._pin_limit, job_id, rnd.gen, unpin, limit)
                await co.reconcile()
                queue = deque(rnd.handle(rd.Start(rnd.gen)))
            except RemoteError as exc:
                queue = deque(rnd.handle(rd.Failed(rnd.gen, exc.code, exc.message)))
            while queue:
                instruction = queue.popleft()
                if not isinstance(instruction, (rd.CallNodes, rd.AbortNodes)):
                    unpin()  # (the generation is decided: the job may be switched while it is recorded)
                queue.extend(await self._execute(record, live, instruction))
        except trio.Cancelled:
            # This coordinator stepped down: the new one aborts the round on the nodes.
            for instruction in rnd.handle(rd.Deposed(rnd.gen)):
                if isinstance(instruction, rd.Finish):
                    self._finish(job_id, live, instruction.result)
            raise
        finally:
            limit.cancel()
            unpin()
            if not live.done.is_set():  # (a bug in the machine must not leave a waiter forever)
                why = "the checkpoint ended unexpectedly"
                self._finish(job_id, live, {"job": job_id, "gen": rnd.gen, "state": "aborted", "code": "internal", "reason": why})

    async def _pin_limit(self, job_id: int, gen: int, unpin: Callable[[], None], scope: trio.CancelScope) -> None:
        """Unpin the job after :data:`PIN_SLICES` time slices if its round is still undecided (see there)."""
        with scope:
            await trio.sleep(PIN_SLICES * self.host.config.time_slice)
            log.info("job %d: checkpoint %d still waits for its ranks after %d time slices: the job is gang-scheduled again meanwhile",
                     job_id, gen, PIN_SLICES)
            unpin()

    async def _execute(self, record: dict, live: LiveRound, instruction: rd.Instruction) -> list[rd.Instruction]:
        job_id, rnd = record["id"], live.round
        if isinstance(instruction, rd.CallNodes):
            try:
                answers = await self._all(record, instruction.op, **instruction.args)
            except Exception as exc:  # RemoteError from a round; anything else is a bug, but must not wedge the job
                if not isinstance(exc, RemoteError):
                    log.exception("job %d: checkpoint %d failed", job_id, rnd.gen)
                    exc = RemoteError("internal", f"{type(exc).__name__}: {exc}")
                return rnd.handle(rd.Failed(rnd.gen, exc.code, exc.message))
            out: list[rd.Instruction] = []
            for node, answer in answers.items():
                out += rnd.handle(rd.Answered(rnd.gen, instruction.phase, node, answer))
            return out
        if isinstance(instruction, rd.AbortNodes):
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                try:
                    await self._all(record, "ckpt_abort", gen=instruction.gen, lineage=rnd.lineage, why=instruction.why)
                except RemoteError as abort_exc:
                    log.warning("job %d: aborting checkpoint %d: %s", job_id, instruction.gen, abort_exc)
            return []
        if isinstance(instruction, rd.WriteRedundancy):
            return await self._protect(record, rnd, instruction)
        try:
            if isinstance(instruction, rd.Record):
                entry = instruction.entry
                if entry["state"] == "aborted":
                    log.warning("job %d: checkpoint %d aborted: %s", job_id, entry["gen"], entry["reason"])
                elif entry["state"] == "complete":
                    total = sum(s["bytes"] for s in entry["nodes"].values())
                    log.info(
                        "job %d: checkpoint %d complete at iteration %d: %d bytes in %.3f s",
                        job_id, entry["gen"], entry["iteration"], total, entry["ended"] - entry["started"],
                    )
                if entry["state"] == "protected" or (entry["state"] == "complete" and "redundancy" in entry):
                    await self._record_protection(job_id, entry)  # (the redundancy write's outcome)
                    if entry["state"] == "protected":
                        await self._prune(record)  # (an older protected generation may go now)
                    self.flushes.maybe(job_id, entry["gen"])
                else:
                    await self._record(job_id, entry)
                    if entry["state"] == "complete" and self.level(record)[0] == "local":
                        self.flushes.maybe(job_id, entry["gen"])  # (no redundancy write comes)
            elif isinstance(instruction, rd.Prune):
                await self._prune(record)
            elif isinstance(instruction, rd.Finish):
                if instruction.result["state"] == "refused":
                    log.info("job %d: no checkpoint: %s", job_id, instruction.result["reason"])
                self._finish(job_id, live, instruction.result)
        except Exception:  # (recording or pruning): whoever waits must still get an answer
            log.exception("job %d: %s of checkpoint %d failed", job_id, type(instruction).__name__, rnd.gen)
        return []

    async def _protect(self, record: dict, rnd: rd.Round, instruction: rd.WriteRedundancy) -> list[rd.Instruction]:
        """Every node of the job writes its share of the generation's
        redundancy (``ckpt_protect``, :mod:`gangd.daemon.protect`); all whole:
        :class:`~gangd.checkpoint.round.Protected`, else
        :class:`~gangd.checkpoint.round.RedundancyFailed` with the reason. The
        job runs on meanwhile (its round finished), and a next checkpoint may
        start: this write names its generation, in its own directory."""
        job_id, gen = record["id"], instruction.gen
        started = time.monotonic()
        try:
            answers = await self._all(record, "ckpt_protect", lineage=rnd.lineage, gen=gen, level=instruction.level, members=jobs.nodes_of(record))
        except Exception as exc:  # RemoteError from a node; anything else is a bug, but the generation stays complete
            if not isinstance(exc, RemoteError):
                log.exception("job %d: the redundancy write of checkpoint %d failed", job_id, gen)
                exc = RemoteError("internal", f"{type(exc).__name__}: {exc}")
            log.warning("job %d: checkpoint %d stays complete, not protected: its %s redundancy write failed: %s", job_id, gen, instruction.level, exc.message)
            return rnd.handle(rd.RedundancyFailed(gen, exc.message))
        seconds = time.monotonic() - started
        written = sum(a.get("bytes", 0) for a in answers.values() if isinstance(a, dict))
        log.info("job %d: checkpoint %d protected (%s, %d bytes of redundancy in %.3f s)", job_id, gen, instruction.level, written, seconds)
        out = rnd.handle(rd.Protected(gen))
        for instr in out:
            if isinstance(instr, rd.Record):
                instr.entry.update(redundancy_bytes=written, protect_seconds=round(seconds, 6))
        return out

    def resume_protection(self, record: dict) -> None:
        """A new coordinator: the job's newest usable generation, if it is
        complete with no redundancy outcome recorded (the previous
        coordinator stepped down while its redundancy was being written), has
        its redundancy written now, behind the job, in this term; one whose
        flush the previous coordinator left unrecorded is flushed (again)."""
        usable = [e for e in self.generations(record) if e["state"] in ("complete", "protected")]
        if usable and (usable[-1]["state"] == "protected" or "redundancy" in usable[-1] or self.level(record)[0] == "local") \
                and not usable[-1].get("flushed") and not usable[-1].get("flush"):
            self.flushes.maybe(usable[-1]["job"], usable[-1]["gen"])  # (a flush the previous coordinator left, or never began)
        if not usable or usable[-1]["state"] != "complete" or "redundancy" in usable[-1] or usable[-1].get("job") != record["id"]:
            return
        level, _ = self.level(record)
        if level != "local":
            self.co.spawn(self._protect_again, record["id"], usable[-1]["gen"])

    async def _protect_again(self, job_id: int, gen: int) -> None:
        record = self.host.table.get(job_id)
        if record is None or jobs.is_terminal(record):
            return
        level, _ = self.level(record)
        lineage = record.get("lineage") or job_id
        started = time.monotonic()
        for attempt in range(10):  # (a node may still be finishing the write the previous coordinator asked for)
            try:
                answers = await self._all(record, "ckpt_protect", lineage=lineage, gen=gen, level=level, members=jobs.nodes_of(record))
                break
            except RemoteError as exc:
                if exc.code == "busy" and attempt < 9:
                    await trio.sleep(1.0)
                    continue
                log.warning("job %d: checkpoint %d stays complete, not protected: its %s redundancy write, resumed after "
                            "the coordinator changed, failed: %s", job_id, gen, level, exc.message)
                await self._record_protection(job_id, {"gen": gen, "state": "complete", "redundancy": f"failed: {exc.message}"})
                return
        written = sum(a.get("bytes", 0) for a in answers.values() if isinstance(a, dict))
        seconds = time.monotonic() - started
        log.info("job %d: checkpoint %d protected (%s, resumed after the coordinator changed; %d bytes in %.3f s)", job_id, gen, level, written, seconds)
        await self._record_protection(job_id, {"gen": gen, "state": "protected", "redundancy_bytes": written, "protect_seconds": round(seconds, 6)})
        await self._prune(self.host.table.get(job_id) or record)
        self.flushes.maybe(job_id, gen)

    # ------------------------------------------------------------ what the job's record says of a generation

    async def _record_protection(self, job_id: int, entry: dict) -> None:
        """A complete generation's redundancy outcome: applied only while the
        recorded entry is still complete (a prune may have removed it
        meanwhile, and a removed generation must never read as protected)."""
        fields = {k: entry[k] for k in ("state", "redundancy", "redundancy_bytes", "protect_seconds") if k in entry}

        def change(r):
            for e in r.get("checkpoints") or []:
                if e["gen"] == entry["gen"] and e["state"] == "complete":
                    e.update(fields)

        try:
            await self.co.update(job_id, change)
        except RemoteError as exc:
            log.warning("job %d: could not record the redundancy of checkpoint %d: %s", job_id, entry["gen"], exc)

    def _finish(self, job_id: int, live: LiveRound, result: dict) -> None:
        live.result = result
        if self.live.get(job_id) is live:
            self.live.pop(job_id)
        live.done.set()

    async def _record(self, job_id: int, entry: dict) -> None:
        """The generation's entry in the job's record (replacing an earlier
        state of the same generation: complete, then protected)."""
        def change(r):
            entries = r.setdefault("checkpoints", [])
            for i, e in enumerate(entries):
                if e["gen"] == entry["gen"]:
                    entries[i] = entry
                    return
            entries.append(entry)

        try:
            await self.co.update(job_id, change)
        except RemoteError as exc:
            log.warning("job %d: could not record checkpoint %d: %s", job_id, entry["gen"], exc)

    async def record_abandoned(self, rounds: list[dict], why: str) -> None:
        """Rounds a previous coordinator left under way (the nodes' answers to
        ``ckpt_abort_all``): each recorded as aborted, once, unless the
        generation already has an entry (it completed, or was recorded)."""
        seen: set[tuple[int, int]] = set()
        for item in rounds:
            job_id, gen = item.get("job") if isinstance(item, dict) else None, item.get("gen") if isinstance(item, dict) else None
            if not isinstance(job_id, int) or not isinstance(gen, int) or (job_id, gen) in seen:
                continue
            seen.add((job_id, gen))
            record = self.host.table.get(job_id)
            if record is None or any(e["gen"] == gen for e in record.get("checkpoints") or []):
                continue
            down = sorted({n for n in record["placement"] if not self.host.membership.is_up(n)})
            reason = why + (f"; node{'s' if len(down) > 1 else ''} {', '.join(down)} of the job went down" if down else "")
            now = time.time()
            await self._record(job_id, {
                "job": job_id, "gen": gen, "state": "aborted", "trigger": "", "started": now, "ended": now, "iteration": None,
                "reason": reason, "placement": list(record["placement"]), "nodes": {},
            })
            log.warning("job %d: checkpoint %d, left under way by the previous coordinator, aborted: %s", job_id, gen, reason)

    def _offered(self, lineage: int, gens: list[dict]) -> set[int]:
        """The generations the ranks of a checkpoint of ``lineage`` under way
        may have been offered to diff against (every parent any node may pick:
        :func:`gangd.checkpoint.node.parent_candidates`), until that
        checkpoint is recorded: its own entry's ``needs`` then say what it uses."""
        out: set[int] = set()
        recorded = {e["gen"] for e in gens if e.get("state") != "running"}
        for live in self.live.values():
            rnd = live.round
            if rnd.lineage != lineage or rnd.gen in recorded or rnd.force_full:
                continue
            out |= set(nd.parent_candidates(gens, list(rnd.placement), rnd.gen, OFFER_CANDIDATES).parents)
        return out

    async def _prune(self, record: dict) -> None:
        """Keep the newest ``checkpoint_keep`` usable (complete or protected,
        and so is every generation it needs) generations of the lineage, the
        newest protected one whatever its age (while newer ones are only
        complete, it is the one that survives a lost node), the newest
        flushed one and the one being flushed, what a checkpoint under way
        may be diffing against, and every generation those need (their
        chains: :mod:`gangd.checkpoint.retention`); remove the rest, their
        redundancy with them (it lives in the generation's directory)."""
        keep = self.host.config.checkpoint_keep
        await self.host.table.read_lineage(record.get("lineage") or record["id"])
        gens = self.generations(self.host.table.get(record["id"]) or record)
        lineage = record.get("lineage") or record["id"]
        doomed = retention.doomed(gens, keep, flushing=self.flushes.flushing.get(lineage), holding=self._offered(lineage, gens))
        for e in gens:
            if e["state"] == "removed" and e.get("flushed"):  # (a removal from the flush directory that failed before)
                self.co.spawn(self.flushes.remove, lineage, e["gen"], e["job"])
        # Leftovers of aborted generations on a node that missed the abort
        # (it was down) go too; removing what is not there costs nothing.
        leftovers = [e for e in gens if e["state"] == "aborted"]
        if not doomed and not leftovers:
            return
        by_node: dict[str, list[int]] = {}
        for e in doomed + leftovers:
            for node in dict.fromkeys([*e["placement"], *(e.get("copies") or {})]):  # (copies: staged by a restart elsewhere)
                by_node.setdefault(node, []).append(e["gen"])

        async def prune_on(node: str, node_gens: list[int]) -> None:
            try:
                await self.co.call(node, "ckpt_prune", lineage=lineage, gens=node_gens)
            except RemoteError as exc:
                log.warning("could not remove old checkpoints on %s: %s", node, exc)

        async with trio.open_nursery() as nursery:  # (every node at once: a full generation's removal takes each disk a while)
            for node, node_gens in by_node.items():
                if self.host.membership.is_up(node) or node == self.host.node:
                    nursery.start_soon(prune_on, node, node_gens)
        if not doomed:
            return
        for e in doomed:
            if e.get("flushed"):  # (in the background: a checkpoint never waits on the shared file system)
                self.co.spawn(self.flushes.remove, lineage, e["gen"], e["job"])
        removed = {(e["job"], e["gen"]) for e in doomed}
        for job in {j for j, _ in removed}:
            def change(r, job=job):
                for e in r.get("checkpoints") or []:
                    if (job, e["gen"]) in removed:
                        e["state"] = "removed"

            try:
                await self.co.update(job, change)
            except RemoteError as exc:
                log.warning("job %d: could not record removed checkpoints: %s", job, exc)

    # ------------------------------------------------------------ periodic checkpoints

    def job_started(self, record: dict) -> None:
        if record.get("ckpt_every") == "auto":  # (issue 19: the interval planned from measurements)
            self.planner.start(self.co.spawn, record["id"])
            return
        if record.get("ckpt_every") and record["id"] not in self.periodic:
            self.periodic.add(record["id"])
            self.co.spawn(self._periodic, record["id"])

    async def _periodic(self, job_id: int) -> None:
        try:
            while True:
                record = self.host.table.get(job_id)
                if record is None or jobs.is_terminal(record) or not self.co.active:
                    return
                await trio.sleep(float(record["ckpt_every"]))
                record = self.host.table.get(job_id)
                if record is None or jobs.is_terminal(record) or not self.co.active:
                    return
                try:
                    await self.request(job_id, ROOT, f"every {record['ckpt_every']:g} s")
                except RemoteError as exc:
                    log.info("job %d: periodic checkpoint skipped: %s", job_id, exc.message)
        finally:
            self.periodic.discard(job_id)


def delta_gate(asked: str | None, cluster: str) -> bool:
    """Whether a job may write deltas: its mode is ``asked``, its (or its
    lineage's) ``--ckpt-mode``, else ``cluster``, the cluster's ``[checkpoint]
    mode`` (default adaptive); in mode full the coordinator asks the nodes
    for whole files (``force_full``: offers in mode full, nothing held
    against retention for it). Every path that moves a generation's files
    moves its links too (a restart elsewhere stages them, a lost node's are
    rebuilt from each link's redundancy, a flush flushes them first and a
    restore from the flush directory restores them), so neither the
    redundancy level nor a flush closes the gate."""
    return (asked or cluster) != "full"


