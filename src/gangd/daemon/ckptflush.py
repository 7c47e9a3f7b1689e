"""Flushing generations to a shared directory, and back: the coordinator's side of SCR's third level.

With ``[checkpoint] flush_dir`` set (a directory every node mounts at the
same path, on a parallel file system), every ``flush_every``-th generation of
a job is copied there behind the job once it is protected (or complete, at
level ``local``); each node copies its own files (``ckpt_flush``,
:mod:`gangd.daemon.flush`), and only when every node's copy is whole is the
generation recorded *flushed*. A restart that finds files on no live node
(more nodes lost than the redundancy survives) takes them from there
(:meth:`Flushes.unflush`). Nothing stays in the flush directory unrecorded:
a failed flush, or one whose generation retention removed meanwhile, has its
copy removed, and after every flush the lineage's unrecorded copies are swept.

Split from :mod:`gangd.daemon.ckptcoord`, which owns the generations and
their retention; this part owns what is being flushed and removed (retention
never removes a generation under flush), and reaches the term, the job table
and the other nodes only through what it is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..checkpoint import retention
from ..rpc import RemoteError

if TYPE_CHECKING:
    from .config import Config
    from .store import JobTable

log = logging.getLogger("gangd.ckptcoord")


class FlushTerm(Protocol):
    """What a flush needs of the coordinator's term (its :class:`~gangd.daemon.ckptcoord.TermPort` has it)."""

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None: ...
    async def update(self, job_id: int, change: Callable[[dict], Any]) -> dict: ...
    async def call(self, node: str, op: str, **args: Any) -> Any: ...


class Flushes:
    """Every flush under way, and every removal of a flushed copy, of the generations this term records."""

    def __init__(self, term: FlushTerm, *, node: str, config: Config, table: JobTable,
                 generations: Callable[[dict], list[dict]], on_job_nodes: Callable[..., Awaitable[dict[str, Any]]]):
        """``generations``: a job's lineage's recorded generations, oldest first;
        ``on_job_nodes(record, op, **args)``: ``op`` on every node of the job at once."""
        self.term = term
        self.node, self.config, self.table = node, config, table
        self.generations = generations
        self.on_job_nodes = on_job_nodes
        # lineage -> the generation being flushed (one at a time per lineage;
        # retention never removes it meanwhile), and flushed copies being removed.
        self.flushing: dict[int, int] = {}
        self.unflushing: set[tuple[int, int]] = set()

    def maybe(self, job_id: int, gen: int) -> None:
        """A generation goes to ``[checkpoint] flush_dir`` too, behind the job,
        when ``flush_every`` generations passed since the lineage's last
        flushed one (aborted rounds spend numbers: they do not delay it), and
        no flush of the lineage is under way (its next generation waits for the next chance)."""
        config = self.config
        record = self.table.get(job_id)
        if config.checkpoint_flush_dir is None or record is None:
            return
        lineage = record.get("lineage") or job_id
        if lineage in self.flushing:
            return
        last = max([e["gen"] for e in self.generations(record) if e.get("flushed")] or [0])
        if gen - last >= config.checkpoint_flush_every:
            self.flushing[lineage] = gen
            self.term.spawn(self._flush, job_id, lineage, gen)

    def transfer_timeout(self, nbytes: int, rate: int) -> float:
        """What moving ``nbytes`` may take: the checkpoint timeout, plus the
        time at the throttle's rate (else at a slow 20 MiB/s), twice over."""
        return float(self.config.checkpoint_timeout) + 2 * nbytes / (rate or 20 << 20)

    async def _flush(self, job_id: int, lineage: int, gen: int) -> None:
        """Every node of the job copies its files of generation ``gen`` to the
        flush directory (``ckpt_flush``); all done: the generation is recorded
        *flushed* (a restart may then take any rank's files from there). A
        flush that fails, or whose generation is gone meanwhile, has its copy
        removed: nothing stays on the shared file system unrecorded."""
        try:
            record = self.table.get(job_id)
            gens = self.generations(record) if record is not None else []
            entry = next((e for e in gens if e["gen"] == gen), None)
            if record is None or entry is None or entry["state"] not in ("complete", "protected"):
                return
            # A delta is restorable from the flush directory only with its links: each is flushed first (once).
            by_gen = {e["gen"]: e for e in gens}
            for link in sorted(retention.needs_of(gens).get(gen) or ()):
                held = by_gen.get(link)
                if held is None or held.get("flushed"):
                    continue
                if held["state"] not in ("complete", "protected") or not await self._one(record, lineage, held):
                    await self._failed(entry, f"its link, generation {link}, was not flushed")
                    return
            if await self._one(record, lineage, entry):
                await self._sweep(lineage, job_id)
        finally:
            if self.flushing.get(lineage) == gen:
                del self.flushing[lineage]
        # Generations completed meanwhile waited: the newest of them goes now, if due.
        record = self.table.get(job_id)
        newest = [e for e in self.generations(record) if e["state"] in ("complete", "protected")] if record is not None else []
        if newest and newest[-1]["gen"] > gen and not newest[-1].get("flushed") and not newest[-1].get("flush"):
            self.maybe(newest[-1]["job"], newest[-1]["gen"])

    async def _failed(self, entry: dict, why: str) -> None:
        log.warning("job %d: checkpoint %d was not flushed: %s", entry["job"], entry["gen"], why)

        change = _entry_change(entry["gen"], _usable, lambda e: e.update(flush=f"failed: {why}"))
        try:
            await self.term.update(entry["job"], change)
        except RemoteError as exc:
            log.warning("job %d: could not record the failed flush of checkpoint %d: %s", entry["job"], entry["gen"], exc)

    async def _one(self, record: dict, lineage: int, entry: dict) -> bool:
        """Every node of the job copies its files of ``entry``'s generation to
        the flush directory and the entry is recorded flushed (True); a failed
        flush has its copy removed (False)."""
        job_id, gen = entry["job"], entry["gen"]
        config = self.config
        rate = int(config.checkpoint_flush_mib_per_s * (1 << 20))
        largest = _largest_share(entry)
        started = time.monotonic()
        try:
            answers = await self.on_job_nodes(record, "ckpt_flush", lineage=lineage, gen=gen, rate=rate, timeout=self.transfer_timeout(largest, rate))
        except RemoteError as exc:
            log.warning("job %d: checkpoint %d was not flushed to %s: %s", job_id, gen, config.checkpoint_flush_dir, exc.message)
            fields: dict[str, Any] = {"flush": f"failed: {exc.message}"}
        else:
            written = sum(a.get("bytes", 0) for a in answers.values() if isinstance(a, dict))
            seconds = time.monotonic() - started
            log.info("job %d: checkpoint %d flushed to %s (%d bytes in %.2f s)", job_id, gen, config.checkpoint_flush_dir, written, seconds)
            fields = {"flushed": {"at": time.time(), "bytes": written, "seconds": round(seconds, 3)}}
        recorded = False

        def record_flush(e: dict) -> None:
            nonlocal recorded
            e.update(fields)
            recorded = "flushed" in fields

        try:
            await self.term.update(job_id, _entry_change(gen, _usable, record_flush))
        except RemoteError as exc:
            log.warning("job %d: could not record the flush of checkpoint %d: %s", job_id, gen, exc)
        if not recorded:
            await self.remove(lineage, gen, job_id)
        return recorded

    async def _sweep(self, lineage: int, job_id: int) -> None:
        """After a flush is recorded: remove the lineage's copies in the flush
        directory that nothing records flushed (a flush a previous coordinator
        left half-written, of another generation than the ones flushed since)."""
        try:
            await self.table.read_lineage(lineage)  # (a flushed generation of an older job of the lineage is kept too)
            record = self.table.get(job_id)
            if record is None:
                return
            keep = {e["gen"] for e in self.generations(record) if e.get("flushed")}
            if lineage in self.flushing:
                keep.add(self.flushing[lineage])
            keep |= {g for (lin, g) in self.unflushing if lin == lineage}
            await self.term.call(self.node, "ckpt_flush_remove", lineage=lineage, keep=sorted(keep))
        except RemoteError as exc:
            log.warning("could not sweep job-%d in the flush directory: %s", lineage, exc.message)

    async def remove(self, lineage: int, gen: int, job_id: int | None = None) -> None:
        """Remove a generation's copy in the flush directory (any node sees it:
        this one asks its own daemon), then forget it was flushed."""
        if (lineage, gen) in self.unflushing:
            return
        self.unflushing.add((lineage, gen))
        try:
            try:
                await self.term.call(self.node, "ckpt_flush_remove", lineage=lineage, gen=gen)
            except RemoteError as exc:
                log.warning("could not remove job-%d/gen-%d from the flush directory (retried at the next prune): %s", lineage, gen, exc)
                return
            if job_id is None:
                return
            try:
                await self.term.update(job_id, _entry_change(gen, lambda e: bool(e.get("flushed")), lambda e: e.pop("flushed")))
            except RemoteError as exc:
                log.warning("job %d: could not record that generation %d left the flush directory: %s", job_id, gen, exc)
        finally:
            self.unflushing.discard((lineage, gen))

    async def unflush(self, record: dict, lineage: int, entry: dict, placement: list[str], ranks: list[int]) -> tuple[list[str], list[str]]:
        """The files of ``ranks`` (on no live node) copied from the flush
        directory onto the nodes they restart on: (failures, each a line
        naming the node; the nodes that restored theirs)."""
        pulls: dict[str, dict[str, list[int]]] = {}
        for rank in ranks:
            pulls.setdefault(placement[rank], {}).setdefault(entry["placement"][rank], []).append(rank)
        largest = _largest_share(entry)
        timeout = self.transfer_timeout(largest * len(pulls), 0)
        failures: list[str] = []
        done: list[str] = []

        async def one(target: str, from_nodes: dict[str, list[int]]) -> None:
            try:
                with trio.fail_after(timeout + 10):
                    await self.term.call(target, "ckpt_unflush", lineage=lineage, gen=entry["gen"], owner=[record["owner_uid"], record["owner_gid"]],
                                       pulls=from_nodes, timeout=timeout)
                done.append(target)
            except trio.TooSlowError:
                failures.append(f"{target}: restoring from the flush directory took more than {timeout + 10:.0f} s")
            except RemoteError as exc:
                failures.append(exc.message if exc.message.startswith(f"{target}:") else f"{target}: {exc.message}")

        async with trio.open_nursery() as nursery:
            for target, from_nodes in pulls.items():
                nursery.start_soon(one, target, from_nodes)
        return sorted(failures), done


def _largest_share(entry: dict) -> int:
    """The most bytes one node committed of a generation (what its slowest transfer moves)."""
    return max([v.get("bytes", 0) for v in (entry.get("nodes") or {}).values() if isinstance(v, dict)] or [0])

def _usable(entry: dict) -> bool:
    return entry["state"] in ("complete", "protected")

def _entry_change(gen: int, wanted: Callable[[dict], bool], action: Callable[[dict], object]) -> Callable[[dict], bool | None]:
    """A change of a job record (for ``co.update``): ``action`` on the entry
    of generation ``gen`` if ``wanted(entry)``; no such entry: nothing to
    write (False)."""
    def change(record: dict) -> bool | None:
        for e in record.get("checkpoints") or []:
            if e["gen"] == gen and wanted(e):
                action(e)
                return None
        return False

    return change
