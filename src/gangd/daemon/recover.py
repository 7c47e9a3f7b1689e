"""Automatic recovery: a job that loses a node comes back by itself.

When a node's lease in etcd expires, every active job with ranks there has
lost those ranks. Before, the coordinator failed each such job. Now it asks
:func:`decide` (pure: the job, its lineage, the lost nodes, the cluster's
limit) whether the job can come back:

- the job (or its lineage, for a restarted job) was not submitted with
  ``--no-requeue``; by default a job is requeued when it checkpoints;
- its lineage has not used up ``[checkpoint] max_recoveries``;
- it has a usable generation: a *protected* one (its redundancy written, so
  the lost node's files can be rebuilt from the partner or the XOR set), or
  a complete one none of whose files were on a lost node.

If not, the job FAILS as before, its reason saying why it was not recovered.
If so, :class:`Recoveries` runs the recovery inside the coordinator's term:

1. the job goes ``RECOVERING`` (visible in ``gang ps``: "node n3 went down;
   recovering from generation 4"), leaves the gang matrix, and its surviving
   ranks are killed everywhere;
2. a checkpoint round still under way for it is waited for (it aborts: its
   ranks are gone; the previous generation stays usable);
3. :meth:`gangd.daemon.ckptrestart.Restarts.recover` restarts the
   lineage from its newest usable generation on live nodes (spares first),
   rebuilding the lost files, as a NEW job of the same lineage;
4. the lost job ends ``REQUEUED`` with ``requeued_as`` naming the new job,
   and the new job's record gets ``recovery_of`` (the lost job, the nodes,
   the generation, the lineage's recovery count).

Why a new job id rather than the same one: every node keeps tables keyed by
job id (rank entries, exit reports, output files, network gates, PMI
state), and an old rank's late exit report or a node's delayed switch for
the old incarnation must never be mistaken for the new one's. A new id in
the same lineage is what ``gang restart`` already does, so the new job is
placed, launched, gated and accounted by the code every restart uses.
``gang wait`` and ``gang run`` follow ``requeued_as`` (:func:`gangd.jobs.successor`),
so a user waiting on the first id still gets the computation's end and
exit code.

A job a recovery started whose ranks cannot restore the generation (damage
below the file system: a bad sector leaves a file's times as they were, so
the restart's verification trusted it, and a rank's own check found it) is
recovered again the same way (:meth:`Recoveries.restore_failed`): its files
are read whole, the damaged generation (or link) is marked so, and the job
restarts from the newest generation still usable. Nobody is at a terminal
to run ``gang restart`` again for a job the system restarted. Each such
attempt counts against ``max_recoveries``; files found intact fail the job
with the rank's sentence, as an older generation would not help.

A deposed coordinator's recovery is cancelled with its term. The next
coordinator finds the job RECOVERING at takeover (:meth:`Recoveries.ensure`):
if a newer job of the lineage exists, the recovery got as far as submitting
it and only the link is recorded; otherwise the recovery runs again. One
lineage is never restarted twice at once: :attr:`Restarts.restarting`
and the rule that one job of a lineage is alive at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from .. import jobs
from ..checkpoint import delta, retention
from ..failpoint import hold, refuse
from ..rpc import RemoteError
from .ckptcoord import CheckpointCoordinator, TermTasks
from .peers import natural_key
from .store import Deposed

if TYPE_CHECKING:
    from .config import Config
    from .controlplane import ControlPlane
    from .peers import Peers
    from .store import JobTable

log = logging.getLogger("gangd.recover")

#: Generation states a recovery may start from.
USABLE = ("complete", "protected")
#: How long a recovery waits for a lineage's other restart (``gang restart``) to finish.
RESTART_WAIT = 60.0
ROOT = {"uid": 0, "gid": 0, "user": "root"}
#: Errors that say etcd is away or refused, not that the job cannot be recovered: the step is taken again.
TRANSIENT = ("etcd_unavailable", "etcd")
#: The longest pause between two attempts at a recovery step etcd stopped.
MAX_PAUSE = 30.0


# ------------------------------------------------------------ the policy, pure


@dataclass(frozen=True)
class Decision:
    """Recover the job (from generation ``gen``) or fail it; ``reason`` says why, for the user."""

    requeue: bool
    reason: str
    gen: int | None = None
    count: int = 0  # recoveries of the lineage so far (before this one)


def wants_requeue(record: dict, lineage: list[dict]) -> bool | None:
    """The job's ``--requeue``/``--no-requeue``; a restarted job inherits its
    lineage's (the oldest job that said); None: nobody said."""
    if record.get("requeue") is not None:
        return bool(record["requeue"])
    for r in sorted(lineage, key=lambda r: r["id"]):
        if r.get("requeue") is not None:
            return bool(r["requeue"])
    return None


def recoveries(lineage: list[dict]) -> list[dict]:
    """The lineage's recoveries so far, oldest first: {job, as, lost, gen}."""
    out = []
    for r in sorted(lineage, key=lambda r: r["id"]):
        recovery = r.get("recovery")
        if not isinstance(recovery, dict):
            recovery = {}
        if r.get("state") == jobs.REQUEUED or r.get("requeued_as"):
            out.append({"job": r["id"], "as": r.get("requeued_as"), "lost": list(recovery.get("lost") or []), "gen": recovery.get("gen"),
                        "cause": cause_of(recovery)})
    return out


def cause_of(recovery: dict) -> str:
    """What a recovery recovers from, for the user: the lost nodes, or the
    generation a restarted job's ranks could not restore."""
    cause = recovery.get("cause")
    if isinstance(cause, str) and cause:
        return cause
    return f"{describe_lost(list(recovery.get('lost') or []))} lost"


def usable_generation(generations: list[dict], lost: set[str]) -> tuple[dict | None, str]:
    """The newest generation a recovery can start from, or None and why none can.

    Protected: the lost nodes' files can be rebuilt from the redundancy.
    Flushed (to ``[checkpoint] flush_dir``): every file is there.
    Complete: only if none of its files were on a lost node (nothing to rebuild)."""
    needs = retention.needs_of(generations)
    by_gen = {e["gen"]: e for e in generations}
    for entry in sorted(generations, key=lambda e: -e["gen"]):
        if needs.get(entry["gen"]):
            # Incremental files: usable where it and every link survive, or where
            # every one is protected (each link's lost files are rebuilt from its
            # own redundancy) or flushed (a flush flushes the links first).
            chain = [by_gen.get(g) for g in delta.needed(needs, [entry["gen"]])]
            if all(e is not None and e.get("state") in USABLE and _survives(e, lost) for e in chain):
                return entry, ""
            if all(e is not None and e.get("state") == "protected" for e in chain):
                return entry, ""
            if all(e is not None and e.get("state") in USABLE and e.get("flushed") for e in chain):
                return entry, ""
            continue
        if entry.get("state") == "protected" or (entry.get("state") in USABLE and entry.get("flushed")):
            return entry, ""
        if entry.get("state") == "complete" and _survives(entry, lost):
            return entry, ""
    if not generations:
        return None, "it has no checkpoint"
    newest = max(generations, key=lambda e: e["gen"])
    done = [e for e in generations if e.get("state") in USABLE]
    if not done:
        return None, f"none of its checkpoints completed (the newest, generation {newest['gen']}, is {newest.get('state')})"
    last = max(done, key=lambda e: e["gen"])
    gone = ", ".join(sorted(set(last.get("placement") or []) & lost, key=natural_key))
    redundancy = last.get("redundancy")
    how = (f"its {last.get('level')} redundancy was not written ({redundancy})" if isinstance(redundancy, str) and redundancy
           else "it has no redundancy (level local)" if last.get("level", "local") == "local"
           else "its redundancy was not written")
    return None, f"it has no protected checkpoint: generation {last['gen']} is only complete ({how}) and its files on {gone} are lost"


def _survives(entry: dict, lost: set[str]) -> bool:
    """Every rank's files of the generation are on a node not lost (where it ran, or a copy a restart staged)."""
    placement = entry.get("placement") or []
    copies = entry.get("copies") or {}
    for rank, node in enumerate(placement):
        if node in lost and not any(rank in ranks for n, ranks in copies.items() if n not in lost):
            return False
    return True


def allowed(record: dict, lineage: list[dict], max_recoveries: int) -> Decision:
    """Whether the job may be recovered at all (not being killed, not
    ``--no-requeue``, its lineage under ``max_recoveries``), whatever it
    would start from; ``gen`` is left None."""
    if record.get("kill_requested"):
        return Decision(False, f"it was being killed by {record['kill_requested']}")
    wanted = wants_requeue(record, lineage)
    if wanted is False:
        return Decision(False, "it was submitted with --no-requeue")
    done = recoveries(lineage)
    if len(done) >= max_recoveries:
        if max_recoveries == 0:
            return Decision(False, "this cluster does not recover jobs ([checkpoint] max_recoveries = 0)")
        return Decision(False, f"it was recovered {len(done)} time{'s' if len(done) != 1 else ''} already, "
                               f"the most [checkpoint] max_recoveries = {max_recoveries} allows", count=len(done))
    return Decision(True, "", count=len(done))


def decide(record: dict, lineage: list[dict], generations: list[dict], lost: set[str], max_recoveries: int) -> Decision:
    """Requeue the job that lost ``lost``, or fail it: :class:`Decision`."""
    may = allowed(record, lineage, max_recoveries)
    if not may.requeue:
        return may
    entry, why = usable_generation(generations, lost)
    if entry is None:
        return Decision(False, why, count=may.count)
    return Decision(True, f"recovering from generation {entry['gen']}", gen=entry["gen"], count=may.count)


def describe_lost(lost: list[str]) -> str:
    return f"node{'s' if len(lost) > 1 else ''} {', '.join(lost)}"


# ------------------------------------------------------------ the orchestration


#: A test's hold point (:func:`gangd.failpoint.hold`): the recovery waits after killing the survivors.
HOLD = "recover.hold"
#: A test's refusal (:func:`gangd.failpoint.refuse`): the write that ends a RECOVERING job fails once.
END_REFUSED = "recover.end"


class RecoveryTerm(TermTasks, Protocol):
    """What a recovery asks of the coordinator's term besides :class:`TermTasks`: the job operations
    every other path uses too (kill, kill the ranks everywhere, leave the gang matrix, look at the
    queue again)."""

    async def kill(self, job_id: int, cred: dict) -> dict: ...
    async def kill_everywhere(self, job_id: int) -> None: ...
    def left(self, job_id: int) -> None: ...
    def kick(self) -> None: ...


class Recoveries:
    """The recoveries under way, run in the coordinator's term (``term.spawn``).

    Built with what it uses: the term (:class:`RecoveryTerm`), the checkpoint
    coordinator that restarts a lineage elsewhere and rebuilds its files, and
    the node's configuration, job table, membership (who is up) and peer links
    (who is reachable)."""

    def __init__(self, term: RecoveryTerm, ckpt: CheckpointCoordinator, *, config: Config, table: JobTable,
                 membership: ControlPlane, peers: Peers):
        self.term = term
        self.ckpt = ckpt
        self.config = config
        self.table = table
        self.membership = membership
        self.peers = peers
        self.under_way: set[int] = set()  # job ids
        self.repinning: set[int] = set()  # queued restarts whose nodes are being chosen again

    async def node_lost(self, record: dict, lost: list[str], why: str) -> None:
        """``record`` has ranks on ``lost`` nodes (down, or out of the
        configuration; ``why`` says which): recover it, or fail it saying why not."""
        job_id = record["id"]
        ckpt = self.ckpt
        lineage = await self._lineage(record)
        decision = decide(record, lineage, ckpt.generations(record), set(lost), self.config.max_recoveries)
        if not decision.requeue:
            log.warning("job %d fails: %s; not recovered: %s", job_id, why, decision.reason)
            # (the reason replaces a rank's error exit: its peer on the lost node vanished)
            await self.term.fail(job_id, f"{why}; not recovered: {decision.reason}", frozenset(lost), cause=True)
            return
        short = f"{describe_lost(lost)} lost"
        log.warning("job %d: %s; %s (recovery %d of at most %d)", job_id, why, decision.reason, decision.count + 1, self.config.max_recoveries)

        def change(r):
            if jobs.is_terminal(r) or r["state"] == jobs.RECOVERING:
                return False
            r["state"] = jobs.RECOVERING
            r["reason"] = f"{short}; {decision.reason}"
            r["recovery"] = {"lost": list(lost), "gen": decision.gen, "why": why, "started": time.time(), "count": decision.count + 1}
            for rank, node in enumerate(r["placement"]):
                if r["ranks"][rank] is None and node in lost:
                    r["ranks"][rank] = {"lost": True, "node": node, "why": why}

        record = await self.term.update(job_id, change)
        if record["state"] != jobs.RECOVERING:
            return
        self.term.left(job_id)
        self.start(job_id)

    async def restore_failed(self, record: dict, node: str, error: str) -> bool:
        """A rank of ``record`` on ``node`` could not restore the generation
        the job restarts from (``error``: the node's sentence). When a
        recovery started the job and its lineage may be recovered again,
        the job goes RECOVERING and :meth:`_recover` reads the files whole
        before restarting it from an older generation: True. False: the
        caller fails the job as any restart whose restore failed (the user
        who ran ``gang restart`` is told, and runs it again)."""
        job_id = record["id"]
        if record["state"] == jobs.RECOVERING:
            return True  # (another node's ranks said so first)
        if not record.get("recovery_of") or jobs.is_terminal(record):
            return False
        gen = int(record["restart_of"]["gen"])
        decision = allowed(record, await self._lineage(record), self.config.max_recoveries)
        if not decision.requeue:
            log.warning("job %d: generation %d could not be restored on %s; not recovered: %s", job_id, gen, node, decision.reason)
            return False
        cause = f"generation {gen} could not be restored on {node}"
        why = f"restart from generation {gen} failed: {error}"
        log.warning("job %d: %s; reading its files whole, then recovering from an older generation (recovery %d of at most %d)",
                    job_id, why, decision.count + 1, self.config.max_recoveries)

        def change(r):
            if jobs.is_terminal(r) or r["state"] == jobs.RECOVERING:
                return False
            r["state"] = jobs.RECOVERING
            r["reason"] = f"{cause}; checking its files, then recovering from an older generation"
            r["recovery"] = {"lost": [], "gen": None, "why": why, "cause": cause, "restore_failed": {"node": node, "gen": gen},
                             "started": time.time(), "count": decision.count + 1}

        record = await self.term.update(job_id, change)
        if record["state"] != jobs.RECOVERING:
            return not jobs.is_terminal(record)
        self.term.left(job_id)
        self.start(job_id)
        return True

    async def _lineage(self, record: dict) -> list[dict]:
        """``record``'s lineage, its older jobs read from the history first (they count
        towards ``max_recoveries`` too); what the table holds if the history cannot be read."""
        try:
            await self.table.read_lineage(record.get("lineage") or record["id"])
        except RemoteError as exc:
            log.warning("job %d: could not read its lineage from the history: %s", record["id"], exc.message)
        return self.ckpt.lineage_records(record)

    def start(self, job_id: int, taken_up: bool = False) -> None:
        if job_id not in self.under_way:
            self.under_way.add(job_id)
            self.term.spawn(self._run, job_id, taken_up)

    def ensure(self, record: dict) -> None:
        """``record`` is RECOVERING: recover it unless a task of this term
        already is (takeover, and every later pass of ``check_nodes``: a
        recovery the previous coordinator left, or one whose last write etcd
        refused, is taken up again). What is left is found from etcd, not
        from where the last attempt stopped (:meth:`_step`)."""
        self.start(record["id"], taken_up=True)

    def repin(self, record: dict, lost: list[str]) -> None:
        """``record`` is a restart still QUEUED, pinned to ``lost`` nodes (its
        generation's files were put or rebuilt there, then the node went
        down): choose its nodes again (:meth:`Restarts.replan`),
        or fail it saying why it cannot start."""
        if record["id"] not in self.repinning:
            self.repinning.add(record["id"])
            self.term.spawn(self._repin, record["id"], list(lost))

    async def _repin(self, job_id: int, lost: list[str]) -> None:
        async def attempt() -> None:
            record = self.table.get(job_id)
            if record is None or record["state"] != jobs.QUEUED or record["placement"] or not record.get("restart_of"):
                return
            try:
                await self.ckpt.restarts.replan(record, set(lost))
            except RemoteError as exc:
                # (busy, bad_state: the lineage's other restart, or the recovery that made this job, is not over yet)
                if isinstance(exc, Deposed) or exc.code in (*TRANSIENT, "busy", "bad_state"):
                    raise
                log.warning("job %d: %s lost before it started, and it cannot start elsewhere: %s", job_id, describe_lost(lost), exc.message)
                await self.term.fail(job_id, f"{describe_lost(lost)} lost before it started; it cannot restart elsewhere: {exc.message}")
            self.term.kick()

        try:
            await self._until_done(job_id, "choosing its nodes again", attempt)
        finally:
            self.repinning.discard(job_id)

    async def _run(self, job_id: int, taken_up: bool) -> None:
        """Recover the job until it has ended REQUEUED or FAILED."""
        try:
            await self._until_done(job_id, "its recovery", lambda: self._step(job_id, taken_up))
        finally:
            self.under_way.discard(job_id)

    async def _until_done(self, job_id: int, what: str, attempt) -> None:
        """Run ``attempt`` until it ends without a RemoteError: a step that
        etcd stops half-way (unreachable, refusing) is taken again after a
        pause, from what etcd says was done, for as long as the term lasts."""
        pause = 1.0
        while True:
            try:
                await attempt()
                return
            except RemoteError as exc:
                if isinstance(exc, Deposed) or not self.term.active:
                    raise
                log.warning("job %d: %s stopped (%s); trying again in %.0f s", job_id, what, exc.message, pause)
            await trio.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE)

    async def _step(self, job_id: int, taken_up: bool) -> None:
        record = self.table.get(job_id)
        if record is None or record["state"] != jobs.RECOVERING:
            return
        newer = [r for r in self.ckpt.lineage_records(record) if r["id"] > job_id and r.get("restart_of")]
        if newer:  # the recovery got as far as the new job: only the link is missing
            new = min(newer, key=lambda r: r["id"])
            log.info("job %d: its recovery (left by the previous coordinator, or stopped by etcd) had started job %d", job_id, new["id"])
            await self._link(job_id, new, (new.get("restart_of") or {}).get("gen"))
            return
        if taken_up:
            log.info("job %d: resuming its recovery, left by the previous coordinator", job_id)
        try:
            await self._recover(job_id)
        except RemoteError as exc:
            if isinstance(exc, Deposed) or not self.term.active or exc.code in TRANSIENT:
                raise
            log.warning("job %d: recovery failed: %s", job_id, exc.message)
            await self._end(job_id, jobs.FAILED, f"not recovered: {exc.message}")
        except Exception as exc:  # a bug: the job must not stay RECOVERING forever
            log.exception("job %d: recovery failed", job_id)
            await self._end(job_id, jobs.FAILED, f"not recovered: {type(exc).__name__}: {exc}")

    async def _recover(self, job_id: int) -> None:
        term, ckpt = self.term, self.ckpt
        record = self.table.get(job_id)
        if record is None or record["state"] != jobs.RECOVERING:
            return
        lost = list((record.get("recovery") or {}).get("lost") or [])
        # A round under way cannot finish (its ranks are gone): it aborts, and
        # the previous generation stays the one to use.
        live = ckpt.live.get(job_id)
        if live is not None:
            with trio.move_on_after(float(self.config.checkpoint_timeout) + 30):
                await live.done.wait()
        await term.kill_everywhere(job_id)
        await hold(HOLD)
        lost = await self._settle(record, lost)
        failed = (record.get("recovery") or {}).get("restore_failed")
        if isinstance(failed, dict):
            # Damage below the file system is found by reading every byte, on every node (another node's
            # ranks may have failed too, their report coming second). Intact files mean the restore failed
            # for another reason, which an older generation would not cure. Files that could not be read
            # (their node down, say) are for the restart to skip or rebuild, as after any loss.
            damaged, unread = await ckpt.restarts.check_restore(record)
            if not damaged and not unread:
                why = (record.get("recovery") or {}).get("why") or "its restore failed"
                raise RemoteError("restore_failed", f"{why}; the generation's files are intact (read whole on every node)")
            if damaged:
                log.warning("job %d: %s", job_id, "; ".join(damaged))
            else:
                log.warning("job %d: could not read its files whole (%s): restarting from what the verification finds usable",
                            job_id, "; ".join(unread))
        lineage = record.get("lineage") or job_id
        with trio.move_on_after(RESTART_WAIT):
            while lineage in ckpt.restarts.restarting:  # noqa: ASYNC110 -- a set of ckptrestart.Restarts', no event to wait on
                await trio.sleep(0.2)
        record = self.table.get(job_id)
        if record is None or record["state"] != jobs.RECOVERING:
            return
        if record.get("kill_requested"):
            await self._end(job_id, jobs.KILLED, "")
            return
        await self.table.read_lineage(lineage)
        started = time.monotonic()
        try:
            result = await ckpt.restarts.recover(record, set(lost))
        except RemoteError as exc:
            if isinstance(exc, Deposed) or exc.code != "no_checkpoint":
                raise
            # A node that failed while the recovery ran (verifying, rebuilding
            # on it) made every generation look unusable: once etcd or the
            # links say so, the recovery starts again knowing it is lost too.
            more = await self._settle(record, lost)
            if set(more) == set(lost):
                raise
            log.warning("job %d: %s lost while it recovered; recovering again without %s", job_id,
                        describe_lost([n for n in more if n not in lost]), "them" if len(more) - len(lost) > 1 else "it")
            lost = more
            result = await ckpt.restarts.recover(record, set(lost))
        new = result["record"]
        log.info("job %d recovered as job %d from generation %s in %.1f s", job_id, new["id"], result.get("gen"), time.monotonic() - started)
        await self._link(job_id, new, result.get("gen"), result)

    async def _settle(self, record: dict, lost: list[str]) -> list[str]:
        """The job's lost nodes once the others are known good: nodes fail
        together (a rack, a switch), and a node this coordinator cannot reach
        while its lease still runs (its connection closed, even within the
        link's grace period) is waited for until etcd says it is down or its
        link is back (at most a lease and a heartbeat timeout); still
        unreachable then, it is taken as lost too, never as a source or a
        target of the rebuild. Recorded with the recovery."""
        membership, peers, config = self.membership, self.peers, self.config
        patience = float(config.etcd.lease_ttl) + float(config.heartbeat_timeout)
        nodes = jobs.nodes_of(record)
        known = {n.name for n in config.nodes}
        with trio.move_on_after(patience):
            while [n for n in nodes if n not in lost and n in known and membership.is_up(n) and not peers.connected(n)]:  # noqa: ASYNC110 -- two sources (etcd, the links), no one event
                await trio.sleep(0.1)
        gone = [n for n in nodes if n in lost or n not in known or not membership.is_up(n) or not peers.connected(n)]
        if set(gone) != set(lost):
            log.warning("job %d: %s lost too", record["id"], describe_lost([n for n in gone if n not in lost]))

            def change(r):
                if r["state"] != jobs.RECOVERING:
                    return False
                r["recovery"] = {**(r.get("recovery") or {}), "lost": gone}

            await self.term.update(record["id"], change)
        return gone

    async def _link(self, job_id: int, new: dict, gen: int | None, result: dict | None = None) -> None:
        """Record the recovery on both jobs; a job killed meanwhile takes its successor with it."""
        record = self.table.get(job_id)
        if record is None:
            return
        recovery = dict(record.get("recovery") or {})
        lost = list(recovery.get("lost") or [])
        count = int(recovery.get("count") or 1)
        info = {"job": job_id, "lost": lost, "gen": gen, "count": count, "cause": cause_of(recovery)}
        if result is not None:
            info.update({k: result[k] for k in ("placement", "rebuilt", "skipped") if k in result})

        def on_new(r):
            if r.get("recovery_of"):
                return False
            r["recovery_of"] = info
            r["recoveries"] = count

        try:
            await self.term.update(new["id"], on_new)
        except RemoteError as exc:
            if isinstance(exc, Deposed):
                raise
            log.warning("job %d: could not record that it recovers job %d: %s", new["id"], job_id, exc.message)
        if record.get("kill_requested"):
            log.info("job %d was killed while it recovered: killing job %d too", job_id, new["id"])
            await self.term.kill(new["id"], ROOT)
            await self._end(job_id, jobs.KILLED, "")
            return
        where = f" on {jobs.compress_nodes(jobs.nodes_of({'placement': result['placement']}))}" if result and result.get("placement") else ""
        reason = f"{cause_of(recovery)}; requeued as job {new['id']} from generation {gen}{where}"
        await self._end(job_id, jobs.REQUEUED, reason, requeued_as=new["id"])
        after = self.table.get(job_id)
        if after is not None and after["state"] == jobs.KILLED:  # (killed between the check above and the end)
            await self.term.kill(new["id"], ROOT)

    async def _end(self, job_id: int, state: str, reason: str, **fields) -> None:
        """End a RECOVERING job: ``state``, ``reason`` prefixed with the loss, every rank accounted."""
        def change(r):
            if r["state"] != jobs.RECOVERING:
                return False
            r["state"] = state if not r.get("kill_requested") else jobs.KILLED
            if r["state"] == jobs.KILLED:
                r["reason"] = r["reason"] if r["reason"].startswith("killed") else f"killed by {r['kill_requested']}"
            elif state == jobs.FAILED:
                r["reason"] = f"{cause_of(r.get('recovery') or {})}; {reason}"
            else:
                r["reason"] = reason
            r.update(fields)
            for rank, status in enumerate(r["ranks"]):
                if status is None:
                    r["ranks"][rank] = {"killed": True, "signal": 9, "node": r["placement"][rank] if rank < len(r["placement"]) else "?",
                                        "why": "killed for the recovery"}
            r["ended"] = time.time()

        if refuse(END_REFUSED):
            raise RemoteError("etcd", f"etcd refused the change: failpoint {END_REFUSED}")
        await self.term.update(job_id, change)
        self.term.kick()
