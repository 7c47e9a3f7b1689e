"""Restarts from a generation, for a user and for the system: the coordinator's side.

``gang restart`` (:meth:`Restarts.restart`) and a lost node's recovery
(:meth:`Restarts.recover`, :mod:`gangd.daemon.recover`) both start a new job
of the lineage from the newest generation they can use. Choosing it
(:meth:`Restarts._choose`) is where a restart meets every way a generation's
files may be missing: ranks that move have their files staged onto their
new nodes (:mod:`gangd.daemon.staging`), files only on nodes that are down
are rebuilt from a protected generation's redundancy on the node replacing
each (:mod:`gangd.daemon.rebuild`) or restored from the flush directory
(:class:`gangd.daemon.ckptflush.Flushes`), a delta's links go with it, and
a generation that cannot be used is passed over for an older one, with a
sentence saying why. Every node then verifies its files against its
manifest before the new job is submitted, and the job's gates open only once
every rank restored (:meth:`Restarts.on_restored`). One restart of a lineage
runs at a time (:attr:`Restarts.restarting`).

Split from :mod:`gangd.daemon.ckptcoord`, which owns the rounds, the
generations' record and their retention; this part takes what it uses: the
term's calls, this node's view (name, config, table, membership, calls to
the job's nodes), the lineage's records and generations, and the flushes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .. import jobs
from ..checkpoint import delta, recovery, relocate, retention
from ..redundancy.plan import PlanError, make_plan
from ..rpc import RemoteError
from .access import permission_check
from .ckptflush import Flushes
from .peers import natural_key

if TYPE_CHECKING:
    from .coordinator import CheckpointHost

log = logging.getLogger("gangd.ckptcoord")


class RestartTerm(Protocol):
    """What a restart needs of the coordinator's term (its :class:`~gangd.daemon.ckptcoord.TermPort` has it)."""

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None: ...
    async def update(self, job_id: int, change: Callable[[dict], Any]) -> dict: ...
    async def fail(self, job_id: int, reason: str, lost_nodes: frozenset = frozenset(), *, cause: bool = False) -> None: ...
    async def call(self, node: str, op: str, **args: Any) -> Any: ...
    async def submit(self, spec: dict, cred: dict, internal: dict | None = None, token: str | None = None) -> dict: ...


@dataclass(frozen=True)
class Chosen:
    """What a restart starts from: the generation's ``entry`` (with the copies
    a rebuild or restore added), the ``placement`` its files are ready on,
    the nodes taken as ``up``, the generations ``skipped`` (a sentence each)
    and the lost nodes whose files were ``rebuilt`` (lost -> target)."""

    entry: dict
    placement: list[str]
    up: list[str]
    skipped: list[str]
    rebuilt: dict[str, str]


class Restarts:
    """Every restart and recovery of the jobs this term records, and the restored reports of the jobs they started."""

    def __init__(self, term: RestartTerm, host: CheckpointHost, *, lineage_records: Callable[[dict], list[dict]],
                 generations: Callable[[dict], list[dict]], on_job_nodes: Callable[..., Awaitable[dict[str, Any]]], flushes: Flushes):
        """``lineage_records``/``generations``: a job's lineage's records and
        recorded generations (oldest first); ``on_job_nodes(record, op, **args)``:
        ``op`` on every node of the job at once."""
        self.term = term
        self.host = host
        self.lineage_records = lineage_records
        self.generations = generations
        self.on_job_nodes = on_job_nodes
        self.flushes = flushes
        self.restored: dict[int, dict] = {}  # restarted job -> {node: error or None}
        # Lineages a restart is under way for: between its check that no job
        # of the lineage is alive and the submission of the new one it
        # verifies the files (seconds, for large states) — a second restart
        # meanwhile would pass the same check and start a second job.
        self.restarting: set[int] = set()


    async def restart(self, job_id: int, cred: dict, gen: int | None, *, nodelist: list[str] | None = None, nodes: int | None = None) -> dict:
        """A new job of the lineage from a complete generation, on the
        generation's nodes, on ``nodelist`` (``-w``) or on ``nodes`` live
        nodes (``-N``); files of ranks that move are staged first, and files
        only on nodes that are down rebuilt first from a protected
        generation's redundancy (:meth:`_rebuild`)."""
        record = self.host.table.get(job_id) or await self.host.table.fetch(job_id)  # (the history too)
        if record is None:
            raise RemoteError("no_such_job", f"no job {job_id}")
        permission_check(record, cred, "restart")
        if not jobs.is_terminal(record):
            raise RemoteError("bad_state", f"job {job_id} is {record['state']}; kill it first (`gang kill {job_id}`) to restart it from a checkpoint")
        async with self._restarting(record) as lineage:
            return await self._restart(job_id, record, lineage, gen, nodelist, nodes)

    @asynccontextmanager
    async def _restarting(self, record: dict) -> AsyncIterator[int]:
        """One restart of a lineage at a time (``gang restart``, a recovery, a
        re-pinning), with the lineage's older jobs read from the history:
        yields the lineage. Raises :class:`RemoteError` ``busy``."""
        lineage = record.get("lineage") or record["id"]
        if lineage in self.restarting:
            raise RemoteError("busy", f"a restart from job {record['id']}'s checkpoints is already under way; one job of a lineage runs at a time")
        self.restarting.add(lineage)
        try:
            await self.host.table.read_lineage(lineage)
            yield lineage
        finally:
            self.restarting.discard(lineage)

    async def recover(self, record: dict, lost: set[str]) -> dict:
        """Restart ``record``'s job from its newest usable generation, on
        behalf of the system (no user's permission asked, and the job need not
        have ended: the caller, recovering the jobs of ``lost`` nodes, decides
        what becomes of it). ``lost``: nodes taken as gone whatever the
        membership says. A protected generation whose files were on a lost
        node has them rebuilt on the node that replaces it (spares first)
        from its partner's copy or its XOR set; an unusable generation is
        skipped for an older one, as ``gang restart`` does.

        Returns what :meth:`restart` returns: ``record`` (the new job of the
        lineage), ``gen``, ``iteration``, ``placement``, ``skipped`` (a
        sentence per generation passed over) and ``rebuilt`` (lost node ->
        the node that rebuilt its files). Raises :class:`RemoteError`
        (``no_checkpoint`` naming what cannot be rebuilt, ``busy``, ...)."""
        async with self._restarting(record) as lineage:
            return await self._restart(record["id"], record, lineage, None, lost=set(lost), system=True)

    async def replan(self, record: dict, lost: set[str]) -> list[str]:
        """A restart still QUEUED (``record``: never placed) is pinned to
        ``lost`` nodes: they went down after the restart put (or rebuilt) its
        generation's files there. Choose its nodes again from the same
        generation as :meth:`recover` would, rebuilding or restoring what
        only the lost nodes held, and re-pin the job; its id, lineage and
        ``restart_of`` stay. Returns the new placement. Raises
        :class:`RemoteError` (``no_checkpoint``: the generation cannot be
        used any more; ``busy``)."""
        gen = int(record["restart_of"]["gen"])
        async with self._restarting(record) as lineage:
            chosen = await self._choose(record["id"], record, lineage, gen, lost=set(lost), system=True)
        placement = chosen.placement

        def change(r):
            if r["state"] != jobs.QUEUED or r["placement"]:
                return False
            r["pinned"] = list(placement)

        await self.term.update(record["id"], change)
        rebuilt = f" (rebuilt: {', '.join(f'{a} on {b}' for a, b in chosen.rebuilt.items())})" if chosen.rebuilt else ""
        log.info("job %d: %s went down before it started; it restarts from generation %d on %s instead%s", record["id"],
                 ", ".join(sorted(lost, key=natural_key)), gen, jobs.compress_nodes(list(dict.fromkeys(placement))), rebuilt)
        return placement

    async def _choose(self, job_id: int, record: dict, lineage: int, gen: int | None,
                      nodelist: list[str] | None = None, nodes: int | None = None, *,
                      lost: set[str] | None = None, system: bool = False) -> Chosen:
        """The generation a restart of ``record`` starts from and where its
        ranks run, its files verified there, staged, rebuilt or restored
        first: the newest usable generation (``gen`` if given), skipping
        the unusable ones (each with its sentence in ``skipped``)."""
        alive = [r["id"] for r in self.lineage_records(record) if not jobs.is_terminal(r) and not (system and r["id"] == job_id)]
        if alive:
            other = self.host.table.get(alive[0])
            state = other["state"] if other is not None else "ending"
            raise RemoteError("bad_state", f"job {alive[0]}, restarted from the same checkpoints, is {state}; one job of a lineage runs at a time")
        generations = self.generations(record)
        complete = [e for e in reversed(generations) if e["state"] in ("complete", "protected")]
        if gen is not None:
            chosen = [e for e in generations if e["gen"] == gen]
            if not chosen:
                raise RemoteError("no_checkpoint", f"job {job_id} has no checkpoint generation {gen}")
            if chosen[0]["state"] not in ("complete", "protected"):
                why = f"generation {gen} of job {job_id} is {chosen[0]['state']}, not complete: {chosen[0].get('reason') or ''}"
                raise RemoteError("no_checkpoint", why.rstrip(": "))
            complete = chosen
        if not complete:
            raise RemoteError("no_checkpoint", f"job {job_id} has no complete checkpoint to restart from")
        from .coordinator import place  # (coordinator imports this module)

        gone = lost or set()
        up = [n.name for n in self.host.config.nodes
              if n.name not in gone and (n.name == self.host.node or self.host.membership.is_up(n.name))]
        cores = {n.name: n.cores for n in self.host.config.nodes}
        skipped: list[str] = []
        rebuilt: dict[str, str] = {}
        for candidate in complete:
            entry = candidate  # (with the copies a rebuild adds)
            rebuilt = {}
            # A live node whose disk was wiped holds nothing: for this
            # generation's files it counts as down (its ranks may still run there).
            wiped = await self._wiped(lineage, entry, up)
            holding = [n for n in up if n not in wiped]
            down = [n for n in dict.fromkeys(entry["placement"]) if n not in holding]
            protected = entry["state"] == "protected" and entry.get("level") in ("partner", "xor") and bool(down)
            default = nodelist is None and nodes is None
            try:
                placement = relocate.choose_placement(nranks=record["nranks"], old=list(entry["placement"]), up=up, cores=cores,
                                                      place=place, nodelist=nodelist, nodes=nodes)
            except relocate.Unplaceable as exc:
                recovered = self._recovery_placement(entry, down, up, cores) if protected and default else None
                if recovered is None:
                    unrebuildable = self._unrebuildable(entry, down, holding) if protected and not entry.get("flushed") else ""
                    if unrebuildable:  # (its lost files are the problem, not where it would run)
                        skipped.append(f"generation {entry['gen']}: {_wiped_first(wiped, unrebuildable)}")
                        continue
                    raise RemoteError(exc.code, f"cannot restart job {job_id} there: {exc}") from None
                placement = recovered
            sources = relocate.plan_sources(placement, list(entry["placement"]), entry.get("copies"), holding)
            unchained = self._chain_problem(entry, generations, sources, rebuildable=protected)
            if unchained:
                log.warning("job %d: generation %d is unusable: %s", job_id, entry["gen"], unchained)
                skipped.append(f"generation {entry['gen']}: {unchained}")
                continue
            if sources.missing and protected and default:
                # Files to rebuild: the survivors' ranks stay, each lost node's go to one replacement, spares first.
                recovered = self._recovery_placement(entry, down, up, cores)
                if recovered is not None and recovered != placement:
                    placement = recovered
                    sources = relocate.plan_sources(placement, list(entry["placement"]), entry.get("copies"), holding)
            if sources.missing and protected:
                try:
                    steps = relocate.plan_rebuilds(placement, list(entry["placement"]), sources.missing,
                                                   make_plan(entry["placement"], entry["level"]), holding)
                except (relocate.CannotRebuild, PlanError) as exc:
                    if not entry.get("flushed"):
                        log.warning("job %d: generation %d cannot be rebuilt: %s", job_id, entry["gen"], exc)
                        skipped.append(f"generation {entry['gen']}: {_wiped_first(wiped, str(exc))}")
                        continue
                    log.info("job %d: generation %d cannot be rebuilt (%s); the flush directory has its files", job_id, entry["gen"], exc)
                    steps = []
                if steps and entry.get("needs"):
                    link_failures = await self._rebuild_links(record, lineage, entry, generations, placement, holding)
                    if link_failures:
                        skipped += [f"generation {entry['gen']}: {p}" for p in link_failures]
                        continue
                if steps:
                    entry, failures, damaged = await self._rebuild(record, lineage, entry, steps)
                    if damaged:  # (the next restart must not count on this redundancy again)
                        await self._unprotect(entry, "; ".join(damaged))
                    if failures and not entry.get("flushed"):
                        for problem in failures:
                            log.warning("job %d: generation %d is unusable: %s", job_id, entry["gen"], problem)
                        skipped += [f"generation {entry['gen']}: {p}" for p in failures]
                        continue
                    if failures:
                        log.info("job %d: generation %d could not be rebuilt (%s); the flush directory has its files",
                                 job_id, entry["gen"], "; ".join(failures))
                    else:
                        rebuilt = {step.lost: step.target for step in steps}
                        holding += [t for t in rebuilt.values() if t not in holding]  # (a wiped node that took its own files back)
                        sources = relocate.plan_sources(placement, list(entry["placement"]), entry.get("copies"), holding)
            if sources.missing and entry.get("flushed") and entry.get("needs"):
                link_failures = await self._unflush_links(record, lineage, entry, generations, placement, holding)
                if link_failures:
                    skipped += [f"generation {entry['gen']}: {p}" for p in link_failures]
                    continue
            if sources.missing and entry.get("flushed"):
                failures, restored, copies = await self._from_flush(record, lineage, entry, placement, sources.missing)
                if failures:
                    skipped += [f"generation {entry['gen']} (from the flush directory): {p}" for p in failures]
                    continue
                log.info("job %d: ranks %s of generation %d restored from the flush directory", job_id, sorted(sources.missing), entry["gen"])
                entry = {**entry, "copies": copies}
                holding += [t for t in restored if t not in holding]
                sources = relocate.plan_sources(placement, list(entry["placement"]), copies, holding)
            if sources.missing:
                problem = relocate.describe_missing(sources.missing)
                if wiped and not protected and not entry.get("flushed") and all(set(nodes) <= set(wiped) for nodes in sources.missing.values()):
                    problem = "; ".join(f"node {n} no longer holds its files ({why})" for n, why in sorted(wiped.items()))
                    await self._mark(entry, "damaged", problem)  # (a wiped disk does not come back, unlike a node that is down)
                log.warning("job %d: generation %d is unusable: %s", job_id, entry["gen"], problem)
                skipped.append(f"generation {entry['gen']}: {problem}")
                continue
            # Ranks that stay are checked where they are; the files of ranks
            # that move are checked by their transfer (against the source's manifest).
            staying = [r for r in range(len(placement)) if r not in sources.moved]
            began = time.monotonic()
            damaged, unreachable = await self._verify(lineage, {**entry, "placement": placement}, staying)
            log.debug("job %d: generation %d verified on its nodes in %.3f s", job_id, entry["gen"], time.monotonic() - began)
            if not damaged and not unreachable and entry.get("needs"):
                damaged, unreachable = await self._verify_links(lineage, entry, generations, placement, staying)
            if not damaged and not unreachable and entry.get("needs"):
                damaged, unreachable = await self._stage_links(record, lineage, entry, generations, placement, holding)
            if not damaged and not unreachable and sources.pulls:
                damaged, unreachable = await self._stage(record, lineage, entry, sources)
            if not damaged and not unreachable:
                break
            problems = damaged + unreachable
            for problem in problems:
                log.warning("job %d: generation %d is unusable: %s", job_id, entry["gen"], problem)
            skipped += [f"generation {entry['gen']}: {p}" for p in problems]
            if damaged:  # (a node that is down may come back; damaged files do not heal)
                await self._mark(entry, "damaged", "; ".join(damaged))
        else:
            raise RemoteError("no_checkpoint", "no intact complete checkpoint: " + "; ".join(skipped))
        return Chosen(entry, placement, up, skipped, rebuilt)

    async def _restart(self, job_id: int, record: dict, lineage: int, gen: int | None,
                       nodelist: list[str] | None = None, nodes: int | None = None, *,
                       lost: set[str] | None = None, system: bool = False) -> dict:
        began = time.monotonic()
        chosen = await self._choose(job_id, record, lineage, gen, nodelist, nodes, lost=lost, system=system)
        entry, placement, up, skipped, rebuilt = chosen.entry, chosen.placement, chosen.up, chosen.skipped, chosen.rebuilt
        log.debug("job %d: generation %d chosen for its restart in %.3f s", job_id, entry["gen"], time.monotonic() - began)
        spec = {key: record.get(key) for key in ("argv", "cwd", "env", "nranks", "name", "kill_on_bad_exit", "priority", "slice", "ckpt_every", "mpi")}
        # The lineage's codec and pipeline settings go on in the new job's record, shown there (its new generations
        # use them; each block records its own codec).
        for key in ("ckpt_codec", "ckpt_pipeline"):
            spec[key] = record.get(key) or next((r[key] for r in self.lineage_records(record) if r.get(key)), None)
        if spec["env"] is None:  # an ended job's record keeps no environment: the checkpoint has it
            holders = [n for n in dict.fromkeys([*placement, *entry["placement"]]) if n in up]
            spec["env"] = await self.host.ops.checkpoint_env(lineage, holders, entry["gen"])
        owner = {"uid": record["owner_uid"], "gid": record["owner_gid"], "user": record["owner"], "rlimits": record.get("rlimits")}
        internal = {
            "lineage": lineage,
            "restart_of": {"job": entry["job"], "gen": entry["gen"], "iteration": entry["iteration"]},
            "pinned": list(placement),
        }
        new = await self.term.submit(spec, owner, internal=internal)
        moved = f" on {jobs.compress_nodes(list(dict.fromkeys(placement)))}" if placement != list(entry["placement"]) else ""
        log.info("job %d restarted as job %d from generation %d (iteration %s)%s", job_id, new["id"], entry["gen"], entry["iteration"], moved)
        if rebuilt:
            log.info("job %d: the files of lost node%s %s rebuilt on %s", job_id, "s" if len(rebuilt) > 1 else "",
                     ", ".join(rebuilt), ", ".join(rebuilt.values()))
        return {"record": new, "gen": entry["gen"], "iteration": entry["iteration"], "skipped": skipped, "placement": placement,
                "rebuilt": rebuilt}

    async def _wiped(self, lineage: int, entry: dict, up: list[str]) -> dict[str, str]:
        """The live nodes that held a generation's files (where its ranks ran,
        or copies) and no longer do, each with what is gone (``ckpt_holds``):
        a node that came back with its checkpoint disk wiped. A node that
        cannot answer is left to the verification."""
        nodes = [n for n in dict.fromkeys([*entry["placement"], *(entry.get("copies") or {})]) if n in up]
        out: dict[str, str] = {}

        async def one(node: str) -> None:
            try:
                with trio.fail_after(30):
                    why = await self.term.call(node, "ckpt_holds", lineage=lineage, gen=entry["gen"])
            except (RemoteError, trio.TooSlowError) as exc:
                log.info("could not ask %s whether it holds generation %d of lineage %d: %s", node, entry["gen"], lineage, exc)
                return
            if isinstance(why, str) and why:
                out[node] = why[:300]

        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(one, node)
        for node, why in sorted(out.items()):
            log.warning("node %s no longer holds its files of generation %d of lineage %d (%s): they count as lost", node, entry["gen"], lineage, why)
        return out

    def _unrebuildable(self, entry: dict, down: list[str], up: list[str]) -> str:
        """The sentence naming the down nodes of a protected generation whose
        files its redundancy cannot rebuild and no live node holds, or ""."""
        placement = list(entry["placement"])
        try:
            result = make_plan(placement, entry["level"]).recovery(down)
        except PlanError as exc:
            return str(exc)
        have = relocate.holders(placement, entry.get("copies"))
        lost = [n for n in down if any(not set(have[r]) & set(up) for r, p in enumerate(placement) if p == n)]
        return "; ".join(p for p in result.unrecoverable if any(p.startswith(f"node {n}'s ") for n in lost))

    def _recovery_placement(self, entry: dict, down: list[str], up: list[str], cores: dict[str, int]) -> list[str] | None:
        """Where a protected generation with ``down`` nodes restarts by
        default: its ranks on live nodes stay, each down node's ranks go to one
        replacement (spares first: :func:`gangd.checkpoint.recovery.plan_recovery`);
        None if it has no answer (the usual placement is tried then)."""
        placement = list(entry["placement"])
        try:
            plan = make_plan(placement, entry["level"])
            free = {n: cores[n] - placement.count(n) for n in up if n in cores}
            spares = [n.name for n in self.host.config.nodes if getattr(n, "spare", False)]
            return list(recovery.plan_recovery(placement, plan, down, free, spares).placement)
        except (recovery.CannotRecover, PlanError):
            return None

    async def _rebuild(self, record: dict, lineage: int, entry: dict, steps: list[relocate.RebuildStep]) -> tuple[dict, list[str], list[str]]:
        """Each lost node's files rebuilt on its replacement (``ckpt_rebuild``,
        :mod:`gangd.daemon.rebuild`), the nodes at once, within ``checkpoint_timeout``;
        the entry with the rebuilt files among its ``copies`` (recorded as a
        staging records them), a line per failure naming node and file, and
        those of them that found the redundancy damaged."""
        timeout = float(self.host.config.checkpoint_timeout)
        failures: list[str] = []
        damaged: list[str] = []
        done: dict[str, list[int]] = {}

        async def one(step: relocate.RebuildStep) -> None:
            try:
                with trio.fail_after(timeout + 10):
                    answer = await self.term.call(step.target, "ckpt_rebuild", lineage=lineage, gen=entry["gen"],
                                                owner=[record["owner_uid"], record["owner_gid"]], lost=step.lost, method=step.method,
                                                sources=list(step.sources), timeout=timeout)
            except trio.TooSlowError:
                failures.append(f"{step.target}: rebuilding node {step.lost}'s files took more than {timeout + 10:.0f} s")
                return
            except RemoteError as exc:
                failures.append(exc.message if exc.message.startswith(step.target) else f"{step.target}: {exc.message}")
                if exc.code == "redundancy_damaged":  # (rebuild.DAMAGED: a parity or copy that is there but wrong)
                    damaged.append(failures[-1])
                return
            got = set(answer.get("ranks") or []) if isinstance(answer, dict) else set()
            if not set(step.ranks) <= got:
                failures.append(f"{step.target}: node {step.lost}'s rebuilt files hold ranks {sorted(got)}, not {list(step.ranks)}")
                return
            done[step.target] = sorted(set(done.get(step.target, [])) | set(step.ranks))
            log.info("job %d: node %s's files of generation %d rebuilt on %s (%s)", record["id"], step.lost, entry["gen"], step.target, step.method)

        async def on(target: str) -> None:  # (one at a time per node: each rewrites that node's MANIFEST)
            for step in steps:
                if step.target == target:
                    await one(step)

        async with trio.open_nursery() as nursery:
            for target in dict.fromkeys(step.target for step in steps):
                nursery.start_soon(on, target)
        if done:
            copies = entry.get("copies")
            for node, ranks in done.items():
                copies = relocate.with_copies(copies, node, ranks)
            entry = {**entry, "copies": copies}
            await self._add_copies(entry, done, "rebuilt copies")
        return entry, failures, damaged

    async def _stage(self, record: dict, lineage: int, entry: dict, sources: relocate.Sources) -> tuple[list[str], list[str]]:
        """Every target node pulls its moved ranks' files, all at once, within
        ``checkpoint_timeout``; (damaged files, other failures), each a line
        naming node and path. A transfer whose bytes do not match the source's
        manifest is diagnosed by the source's own check (``ckpt_verify``), so a
        damaged file is named where it lies and the generation marked. What
        was staged is recorded in the generation's entry (``copies``: a later
        restart pulls from them, retention removes them)."""
        timeout = float(self.host.config.checkpoint_timeout)
        failures: list[str] = []
        suspects: dict[str, set[int]] = {}
        staged: dict[str, list[int]] = {}

        async def one(target: str, pulls: dict[str, list[int]]) -> None:
            try:
                with trio.fail_after(timeout + 10):
                    await self.term.call(target, "ckpt_stage", lineage=lineage, gen=entry["gen"],
                                       owner=[record["owner_uid"], record["owner_gid"]], pulls=pulls, timeout=timeout)
                staged[target] = sorted(r for ranks in pulls.values() for r in ranks)
            except trio.TooSlowError:
                failures.append(f"{target}: staging the files of ranks {sorted(r for v in pulls.values() for r in v)} took more than {timeout + 10:.0f} s")
            except RemoteError as exc:
                failures.append(exc.message if exc.message.startswith(f"{target}") else f"{target}: {exc.message}")
                if exc.code == "transfer_failed":
                    for source, ranks in pulls.items():
                        suspects.setdefault(source, set()).update(ranks)

        async with trio.open_nursery() as nursery:
            for target, pulls in sources.pulls.items():
                nursery.start_soon(one, target, pulls)
        if staged:
            await self._add_copies(entry, staged, "copies")
        if not failures:
            return [], []
        damaged: list[str] = []
        for source, ranks in suspects.items():
            if source == self.host.node or self.host.membership.is_up(source):
                try:
                    damaged += await self.term.call(source, "ckpt_verify", lineage=lineage, gen=entry["gen"], ranks=sorted(ranks))
                except RemoteError as exc:
                    log.warning("job %d: could not check generation %d on %s: %s", record["id"], entry["gen"], source, exc)
        return sorted(damaged), ([] if damaged else sorted(failures))

    async def _add_copies(self, entry: dict, added: dict[str, list[int]], what: str) -> None:
        """Record that the nodes of ``added`` now also hold its ranks' files of
        ``entry``'s generation (``copies``: a later restart pulls from them,
        retention removes them); ``what`` they are, for the log if it fails."""
        def change(r):
            for e in r.get("checkpoints") or []:
                if e["gen"] == entry["gen"]:
                    copies = e.setdefault("copies", {})
                    for node, ranks in added.items():
                        copies[node] = sorted(set(copies.get(node, [])) | set(ranks))

        try:
            await self.term.update(entry["job"], change)
        except RemoteError as exc:
            log.warning("job %d: could not record the %s of generation %d: %s", entry["job"], what, entry["gen"], exc)

    async def _unprotect(self, entry: dict, reason: str) -> None:
        """A protected generation whose redundancy a rebuild found damaged is
        only *complete* from now on (``redundancy``: why): its files on live
        nodes stay usable, but no restart counts on rebuilding from it again,
        and retention no longer keeps it as the one that survives a lost node."""
        def change(r):
            for e in r.get("checkpoints") or []:
                if e["gen"] == entry["gen"] and e["state"] == "protected":
                    e["state"], e["redundancy"] = "complete", f"damaged: {reason}"
                    return None
            return False

        log.warning("job %d: generation %d is no longer protected: its redundancy is damaged: %s", entry["job"], entry["gen"], reason)
        try:
            await self.term.update(entry["job"], change)
        except RemoteError as exc:
            log.warning("job %d: could not record that generation %d's redundancy is damaged: %s", entry["job"], entry["gen"], exc)

    async def _mark(self, entry: dict, state: str, reason: str) -> None:
        """Record a generation as unusable, so retention never keeps it over intact ones."""
        def change(r):
            for e in r.get("checkpoints") or []:
                if e["gen"] == entry["gen"]:
                    e["state"], e["reason"] = state, reason

        try:
            await self.term.update(entry["job"], change)
        except RemoteError as exc:
            log.warning("job %d: could not mark generation %d %s: %s", entry["job"], entry["gen"], state, exc)

    @staticmethod
    def _chain_problem(entry: dict, generations: list[dict], sources: relocate.Sources, *, rebuildable: bool = False) -> str:
        """Why a restart cannot start from ``entry``'s chain ("" if it can):
        a generation it needs is not complete or protected any more, or
        files of lost nodes would have to be rebuilt or restored from the
        flush directory, which moves a generation's own files and not the
        older ones a delta needs (issue 17 step 3, not built yet; a restart
        elsewhere stages every link: :meth:`_stage_links`)."""
        needs = retention.needs_of(generations)
        if not needs.get(entry["gen"]):
            return ""
        done = {e["gen"] for e in generations if e.get("state") in retention.DONE}
        broken = [g for g in delta.missing_links(entry["gen"], needs, done) if g != entry["gen"]]
        if broken:
            states = {e["gen"]: e.get("state") for e in generations}
            return "its incremental files need " + ", ".join(f"generation {g} ({states.get(g) or 'not recorded'})" for g in broken)
        by_gen = {e["gen"]: e for e in generations}
        chain_protected = rebuildable and all(by_gen[g].get("state") == "protected" and by_gen[g].get("level") == entry.get("level")
                                              for g in needs[entry["gen"]])
        chain_flushed = bool(entry.get("flushed")) and all(by_gen[g].get("flushed") for g in needs[entry["gen"]])
        if sources.missing and not chain_protected and not chain_flushed:
            return (f"its files are incremental (they need generations {needs[entry['gen']]}), and the lost files of a chain come "
                    "back only when the generation and every link are protected or flushed: " + relocate.describe_missing(sources.missing))
        return ""

    async def _from_flush(self, record: dict, lineage: int, entry: dict, placement: list[str],
                          missing: Iterable[int]) -> tuple[list[str], list[str], dict[str, list[int]]]:
        """The files of ranks ``missing`` (on no live node) of ``entry``'s
        generation restored from the flush directory onto their nodes in
        ``placement``, and recorded as copies (retention removes them, even
        after a restart that failed): (failures, each naming the node; the
        nodes that restored theirs; the generation's copies now)."""
        missing = sorted(missing)
        failures, restored = await self.flushes.unflush(record, lineage, entry, placement, missing)
        copies = {node: list(ranks) for node, ranks in (entry.get("copies") or {}).items()}
        for rank in missing:
            if placement[rank] in restored:
                copies[placement[rank]] = sorted({*copies.get(placement[rank], []), rank})
        if restored:
            await self._record_copies(entry, copies)
        return failures, restored, copies

    async def _unflush_links(self, record: dict, lineage: int, entry: dict, generations: list[dict], placement: list[str],
                             holding: list[str]) -> list[str]:
        """The lost files of every generation a flushed delta needs, restored
        from the flush directory onto the nodes ``placement`` gives their
        ranks, oldest first (:meth:`_from_flush`), each link's copies recorded;
        the problems, each naming the link."""
        for gen, link, sources in _links(entry, generations, placement, holding):
            if not sources.missing:
                continue
            failures, restored, copies = await self._from_flush(record, lineage, link, placement, sources.missing)
            if restored:
                link["copies"] = copies
            if failures:
                return [f"it needs generation {gen} (from the flush directory): {p}" for p in failures]
        return []

    async def _rebuild_links(self, record: dict, lineage: int, entry: dict, generations: list[dict], placement: list[str],
                             holding: list[str]) -> list[str]:
        """The lost files of every generation a protected delta needs, rebuilt
        from each link's own redundancy on the nodes ``placement`` gives the
        lost ranks, oldest first (:meth:`_rebuild`); the problems, each naming
        the link. Each link's recorded copies are updated here too, so that
        :meth:`_stage_links` finds the rebuilt files."""
        for gen, link, sources in _links(entry, generations, placement, holding):
            if not sources.missing:
                continue
            try:
                steps = relocate.plan_rebuilds(placement, list(link["placement"]), sources.missing,
                                               make_plan(link["placement"], link["level"]), holding)
            except (relocate.CannotRebuild, PlanError) as exc:
                return [f"it needs generation {gen}, which cannot be rebuilt: {exc}"]
            rebuilt, failures, damaged = await self._rebuild(record, lineage, link, steps)
            if damaged:
                await self._unprotect(rebuilt, "; ".join(damaged))
            if failures:
                return [f"it needs generation {gen}: {p}" for p in failures]
            link["copies"] = rebuilt.get("copies")
        return []

    async def _stage_links(self, record: dict, lineage: int, entry: dict, generations: list[dict], placement: list[str],
                           holding: list[str]) -> tuple[list[str], list[str]]:
        """A restart elsewhere from a delta: every generation ``entry`` needs
        is staged as it is (each rank that moves pulls its file of each link
        from a node holding it), oldest first; (damaged, other problems),
        each naming the link."""
        for gen, link, sources in _links(entry, generations, placement, holding):
            if sources.missing:
                return [], [f"it needs generation {gen}: {relocate.describe_missing(sources.missing)}"]
            if not sources.pulls:
                continue
            damaged, failures = await self._stage(record, lineage, link, sources)
            if damaged:
                await self._mark(link, "damaged", "; ".join(damaged))
                link["state"] = "damaged"
            if damaged or failures:
                return ([f"it needs generation {gen}, which is damaged: {p}" for p in damaged],
                        [f"it needs generation {gen}: {p}" for p in failures])
        return [], []

    async def _verify_links(self, lineage: int, entry: dict, generations: list[dict], placement: list[str],
                            ranks: list[int], *, full: bool = False) -> tuple[list[str], list[str]]:
        """Verify every generation ``entry`` needs, for the ``ranks`` that stay
        (on the node ``placement`` puts them, which holds their files of every
        link as of the generation: a chain never spans a layout change); the
        files of ranks that move are checked by their transfer. A damaged link
        is marked damaged, and each problem names the link, its node and path."""
        by_gen = {e["gen"]: e for e in generations}
        for gen in sorted(retention.needs_of(generations).get(entry["gen"]) or (), reverse=True):
            link = by_gen[gen]
            damaged, unreachable = await self._verify(lineage, {**link, "placement": placement}, ranks, full=full)
            if damaged:
                await self._mark(link, "damaged", "; ".join(damaged))
                link["state"] = "damaged"  # (an older candidate that needs it is skipped too)
            if damaged or unreachable:
                return ([f"it needs generation {gen}, which is damaged: {p}" for p in damaged],
                        [f"it needs generation {gen}: {p}" for p in unreachable])
        return [], []

    async def _verify(self, lineage: int, entry: dict, ranks: list[int] | None = None, *, full: bool = False) -> tuple[list[str], list[str]]:
        """(damaged files, nodes that could not check) of a generation, each a
        line naming node and path (``ranks``: only those ranks', each where
        ``entry["placement"]`` puts it). A node reads whole only the files
        that changed since they were last found intact (daemon/verified.py),
        every file with ``full``."""
        problems: list[str] = []
        unreachable: list[str] = []
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(entry["placement"]):
            if ranks is None or rank in ranks:
                by_node.setdefault(node, []).append(rank)

        async def one(node: str, ranks: list[int]) -> None:
            if node != self.host.node and not self.host.membership.is_up(node):
                unreachable.append(f"node {node}, which holds ranks {ranks}, is down")
                return
            try:
                problems.extend(await self.term.call(node, "ckpt_verify", lineage=lineage, gen=entry["gen"], ranks=ranks,
                                                   **({"full": True} if full else {})))
            except RemoteError as exc:
                unreachable.append(f"{node}: {exc.message}")

        async with trio.open_nursery() as nursery:
            for node, ranks in by_node.items():
                nursery.start_soon(one, node, ranks)
        return sorted(problems), sorted(unreachable)

    async def on_restored(self, job_id: int, node: str, error: str | None) -> None:
        """A node's ranks of a restarted job loaded their state (or could not)."""
        record = self.host.table.get(job_id)
        if record is None or jobs.is_terminal(record):
            return
        if error:
            gen = record["restart_of"]["gen"]
            await self.term.fail(job_id, f"restart from generation {gen} failed: {error}")
            self.term.spawn(self._damaged_on_restore, record, node)
            return
        seen = self.restored.setdefault(job_id, {})
        seen[node] = None
        if set(seen) >= set(jobs.nodes_of(record)):
            await self.on_job_nodes(record, "ckpt_open")  # (fails: the nodes report again, and this is retried)
            if self.restored.pop(job_id, None) is not None:
                log.info("job %d: every rank restored generation %d; gates open", job_id, record["restart_of"]["gen"])
                # The restart cost R that --ckpt-every auto plans with (issue 19): submitted -> every rank restored.
                seconds = round(max(0.0, time.time() - float(record.get("submitted") or time.time())), 3)

                def note(r: dict) -> None:
                    r["restart_seconds"] = seconds

                try:
                    await self.term.update(job_id, note)
                except RemoteError as exc:  # (a measurement: the job runs on without it)
                    log.info("job %d: could not record its restart time: %s", job_id, exc.message)

    async def _damaged_on_restore(self, record: dict, node: str) -> None:
        """A rank on ``node`` could not restore its state: :meth:`check_restore`
        there, so that the next restart starts from an older generation if
        the files are damaged."""
        try:
            damaged, _ = await self.check_restore(record, [node])
        except Exception as exc:  # noqa: BLE001 -- a diagnosis; the job has failed with its reason already
            log.info("job %d: could not check generation %s on %s after its restore failed: %s", record["id"],
                     record["restart_of"]["gen"], node, exc)
            return
        if damaged:
            log.warning("job %d: damage found as a rank restored its state: %s", record["id"], "; ".join(damaged))

    async def check_restore(self, record: dict, nodes: list[str] | None = None) -> tuple[list[str], list[str]]:
        """Read whole the files the ranks of ``record`` (a restarted job) on
        ``nodes`` (every node: None) restored from: its generation's, then
        every generation that one needs. The restart's verification trusted
        files unchanged since they were last found intact, and damage below
        the file system does not show in a file's times. A damaged generation
        is marked damaged (a restart skips it, and every generation that
        needs it). Returns (damaged, unread): the problems, each naming node
        and path, and the nodes that could not check (down, unreachable)."""
        gen = int(record["restart_of"]["gen"])
        lineage = record.get("lineage") or record["id"]
        generations = self.generations(record)
        entry = next((e for e in generations if e["gen"] == gen), None)
        if entry is None:
            return [], [f"generation {gen} is no longer recorded"]
        if entry["state"] == "damaged":  # (found already, by another node's check)
            return [f"generation {gen} is damaged: {entry.get('reason') or ''}".rstrip(": ")], []
        if entry["state"] not in ("complete", "protected"):
            return [], [f"generation {gen} is {entry['state']}"]
        placement = list(record.get("placement") or record.get("pinned") or [])
        ranks = [r for r, n in enumerate(placement) if nodes is None or n in nodes]
        if not ranks:
            return [], [f"no rank of the job ran on {', '.join(nodes or [])}"]
        damaged, unread = await self._verify(lineage, {**entry, "placement": placement}, ranks, full=True)
        if damaged:
            await self._mark(entry, "damaged", "; ".join(damaged))
            return [f"generation {gen} is damaged: {p}" for p in damaged], unread
        if entry.get("needs") and not unread:
            damaged, unread = await self._verify_links(lineage, entry, generations, placement, ranks, full=True)
        return damaged, unread

    async def _record_copies(self, entry: dict, copies: dict[str, list[int]]) -> None:
        """Where a generation's files now also are (a later restart uses them, retention removes them)."""
        def change(r):
            for e in r.get("checkpoints") or []:
                if e["gen"] == entry["gen"]:
                    e["copies"] = copies

        try:
            await self.term.update(entry["job"], change)
        except RemoteError as exc:
            log.warning("job %d: could not record the copies of generation %d: %s", entry["job"], entry["gen"], exc)



def _wiped_first(wiped: dict[str, str], problem: str) -> str:
    """``problem`` after the nodes that are up but lost their files (a user
    sees them up: the sentence must say why they count as lost)."""
    said = "; ".join(f"node {n} no longer holds its files ({why})" for n, why in sorted(wiped.items()))
    return f"{said}; {problem}" if said else problem


def _links(entry: dict, generations: list[dict], placement: list[str], holding: list[str]) -> Iterator[tuple[int, dict, relocate.Sources]]:
    """Every generation ``entry`` needs (a delta's links), oldest first, each
    with where its ranks' files are for ``placement`` on the ``holding`` nodes."""
    by_gen = {e["gen"]: e for e in generations}
    for gen in sorted(retention.needs_of(generations).get(entry["gen"]) or ()):
        link = by_gen[gen]
        yield gen, link, relocate.plan_sources(placement, list(link["placement"]), link.get("copies"), holding)
