"""Stages in threads over bounded rings: the engine, and the one place threads are started and joined.

Paper 004's point is that compress-then-write costs the *sum* of the stages
and a pipeline only the *longest* (1.02-1.03x it in PCCR). Stages are
threads because the work that matters releases the GIL (zlib and the other
codecs, ``pwrite``, ``preadv``, ``fsync``); a stage is one thread, so its
ring has one producer and one consumer and order is kept without sequence
numbers: **every stage, the writer included, sees items in the order they
were submitted** (a stage that emits several items for one keeps them in its
own order).

A *parallel* stage (``Stage.parallel``: compression, whose one thread made a
compressed checkpoint slower than a raw one on a fast disk) runs in
``Settings.workers`` threads over the same input ring. Each worker takes the
next buffer under the stage's take lock, which numbers it; does the work
(:meth:`Stage.work_slot`, the codec calls, concurrently with the other
workers); then waits for its number's turn and hands the results on
(:meth:`Stage.hand_on`, in order, one worker at a time) before releasing
the buffer. So the order above still holds; memory is still bounded (each
worker holds one input buffer and its results); and a worker that fails
wakes the others waiting for their turn, as the rings' abort wakes the other
stages. The last worker to finish ends the stream for the stage after.

:class:`Pipeline` is a context manager that owns its threads the way a trio
nursery owns its tasks: no thread outlives the ``with`` block. If any stage
raises (a full disk under the writer, a codec's error), the first error is
kept, every ring is aborted so every other stage stops at its next hand-off,
every thread is joined, every buffer goes back to Empty, and the caller gets
:class:`PipelineError` naming the stage, with the original exception as its
``__cause__``. The caller leaving the block early (its own exception, or
:meth:`Pipeline.cancel` from another thread) tears down the same way. A stage
stuck inside a system call is joined once that call returns: "promptly"
means at the stage's next buffer, not mid-call.

Leaving the block normally finishes the pipeline (as if :meth:`Pipeline.finish`
had been called: it waits for every stage and raises a failure).

The first stage is either the caller (``submit``: the caller's thread packs
items into the first ring) or a :class:`Source` with a thread of its own
(the restart direction: reading file ranges). The last stage's ``result``
is what :meth:`Pipeline.finish` returns (for a writer: where each item
landed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from types import TracebackType

from .emit import Packer
from .ring import Aborted, Ring, Slot
from .settings import Settings
from .stats import StageStats


class PipelineError(Exception):
    """A stage failed; ``stage`` names it, ``__cause__`` is what it raised."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"pipeline stage {stage!r} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.errno: int | None = getattr(cause, "errno", None)


class PipelineCancelled(PipelineError):
    """The caller cancelled the pipeline."""


class Stage:
    """A step that takes items from the ring before it and emits 0..n items into the ring after it.

    Subclasses override :meth:`process` (one item) or :meth:`process_slot`
    (a whole buffer, e.g. a writer), and :meth:`close` for work at the end
    of the stream. ``out`` is None for the last stage.
    """

    #: The ring before this stage cuts items at buffer boundaries so each buffer is full (a writer).
    whole_buffers = False
    #: Run by ``Settings.workers`` threads: :meth:`work_slot` must then be thread-safe (see the module docstring).
    parallel = False
    result: object = None

    def __init__(self, name: str):
        self.name = name
        self.stats = StageStats(name)

    def process(self, key: Hashable, data: memoryview, out: Packer | None) -> None:
        raise NotImplementedError

    def process_slot(self, slot: Slot, out: Packer | None) -> None:
        for record in slot.records:
            self.stats.items_in += 1
            self.stats.bytes_in += record[2]
            self.process(record[0], slot.item(record), out)

    def work_slot(self, slot: Slot) -> object:
        """A parallel stage's work on one buffer, run by any of its workers at the same time as the others."""
        raise NotImplementedError

    def hand_on(self, slot: Slot, work: object, out: Packer | None) -> None:
        """A parallel stage's results for ``slot`` into the next ring: in buffer order, one worker at a time."""
        raise NotImplementedError

    def close(self, out: Packer | None) -> None:
        """The stream ended (not called when the pipeline is torn down by an error)."""


class Source(Stage):
    """A first stage that produces items itself, in a thread of its own."""

    def produce(self, out: Packer) -> None:
        raise NotImplementedError


class Pipeline:
    """``with Pipeline([stage, ...], settings) as p: p.submit(key, data) ...; result = p.finish()``."""

    def __init__(self, stages: Sequence[Stage], settings: Settings | None = None, *, name: str = "pipeline"):
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        if isinstance(stages[0], Source) and len(stages) < 2:
            raise ValueError("a Source needs a stage after it")
        if any(isinstance(s, Source) for s in stages[1:]):
            raise ValueError("only the first stage may be a Source")
        if len({s.name for s in stages}) != len(stages):
            raise ValueError("stage names must differ (errors and statistics are reported by name)")
        self.settings = settings or Settings()
        self.name = name
        self.stages = list(stages)
        self._sourced = isinstance(stages[0], Source)
        consumers = self.stages[1:] if self._sourced else self.stages
        self.submitter = StageStats("submit")
        self.rings = [Ring(f"{name}:{c.name}", self.settings.parallel_count if self._workers(c) > 1 else self.settings.buffer_count,
                           self.settings.aggregate_bytes if c.whole_buffers else self.settings.buffer_size)
                      for c in consumers]
        self._turns: dict[int, _Turns] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._error: PipelineError | None = None
        self._entered = self._finished = False
        self._packer: Packer | None = None
        self._began = 0.0
        self.result: object = None  # the last stage's result, once finished

    # -- the caller's side -------------------------------------------------------------------------------------------
    def __enter__(self) -> Pipeline:
        if self._entered:
            raise RuntimeError("a pipeline runs once")
        self._entered = True
        self._began = time.perf_counter()
        if not self._sourced:
            self._packer = Packer(self.rings[0], self.submitter, split=self.stages[0].whole_buffers)
        try:
            for index, stage in enumerate(self.stages):
                workers = self._workers(stage)
                if workers > 1:
                    self._turns[index] = _Turns(workers)
                    for worker in range(workers):
                        thread = threading.Thread(target=self._run_worker, args=(index, worker), name=f"{self.name}:{stage.name}#{worker}")
                        thread.start()
                        self._threads.append(thread)
                    continue
                thread = threading.Thread(target=self._run, args=(index,), name=f"{self.name}:{stage.name}")
                thread.start()
                self._threads.append(thread)
        except BaseException as exc:
            self._finished = True
            self._fail(PipelineCancelled("caller", exc))
            self._teardown()
            raise
        return self

    def submit(self, key: Hashable, data: object) -> None:
        """Queue one item; waits while every buffer of the first ring is in use (back-pressure).

        An item up to half a buffer is copied into one, so ``data`` may be
        reused when this returns; a larger item is queued by reference and
        must stay unchanged until :meth:`finish` returns (a snapshot's
        arrays do).
        """
        if self._packer is None or self._finished:
            raise RuntimeError("submit() needs a running pipeline whose first stage is not a Source")
        self._raise_if_failed()
        try:
            self._packer.emit(key, data)
        except Aborted:
            self._raise_if_failed()
            raise RuntimeError("pipeline aborted") from None

    def finish(self) -> object:
        """End of input: wait for every stage, raise the first failure, return the last stage's ``result``."""
        if not self._entered or self._finished:
            raise RuntimeError("finish() needs a running pipeline")
        self._finished = True
        if self._packer is not None:
            try:
                self._packer.flush()
                self.rings[0].close()
            except Aborted:
                pass
            self.submitter.wall_s = time.perf_counter() - self._began
        self._teardown()
        self._raise_if_failed()
        self.result = self.stages[-1].result
        return self.result

    def cancel(self) -> None:
        """Stop every stage (from any thread); the pipeline's ``finish`` raises :class:`PipelineCancelled`."""
        self._fail(PipelineCancelled("caller", RuntimeError("cancelled")))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None and not self._finished:
            self.finish()  # the block ended normally: like a nursery, wait for the stages (and raise their failure)
            return
        # The caller's exception (an interrupt inside finish() included): stop the stages before joining them.
        self._finished = True
        self._fail(PipelineCancelled("caller", exc if exc is not None else RuntimeError("cancelled")))
        self._teardown()

    # -- statistics --------------------------------------------------------------------------------------------------
    def stats(self) -> list[StageStats]:
        """Per stage (the caller's ``submit`` first, when it feeds the pipeline)."""
        return ([] if self._sourced else [self.submitter]) + [s.stats for s in self.stages]

    def buffers_in_use(self) -> int:
        return sum(r.in_use for r in self.rings)

    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    # -- internals ---------------------------------------------------------------------------------------------------
    def _workers(self, stage: Stage) -> int:
        return self.settings.workers if stage.parallel and not isinstance(stage, Source) else 1

    def _fail(self, error: PipelineError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        for ring in self.rings:
            ring.abort()
        for turns in self._turns.values():
            with turns.cond:
                turns.cond.notify_all()

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is not None:
            raise error

    def _teardown(self) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        for ring in self.rings:
            ring.reclaim()

    def _run(self, index: int) -> None:
        stage = self.stages[index]
        stats = stage.stats
        began, cpu = time.perf_counter(), time.thread_time()
        ring_in = None if self._sourced and index == 0 else self.rings[index - self._sourced]
        ring_out = self.rings[index + 1 - self._sourced] if index + 1 < len(self.stages) else None
        out = None if ring_out is None else Packer(ring_out, stats, split=self.stages[index + 1].whole_buffers)
        try:
            if ring_in is None:
                assert isinstance(stage, Source) and out is not None  # noqa: S101 -- the constructor guarantees both
                stage.produce(out)
            else:
                while True:
                    slot, waited = ring_in.take()
                    stats.idle_in_s += waited
                    if slot is None:
                        break
                    stage.process_slot(slot, out)
                    ring_in.release(slot)
            self._end_stream(stage, out, ring_out)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller as PipelineError (the stage named), not swallowed
            self._stage_failed(stage, exc)
        finally:
            stats.wall_s = time.perf_counter() - began
            stats.cpu_s = time.thread_time() - cpu

    @staticmethod
    def _end_stream(stage: Stage, out: Packer | None, ring_out: Ring | None) -> None:
        """The stage's input ended: its own end of stream, its last buffer handed on, the next ring closed."""
        stage.close(out)
        if out is not None and ring_out is not None:
            out.flush()
            ring_out.close()

    def _stage_failed(self, stage: Stage, exc: BaseException) -> None:
        error = PipelineError(stage.name, exc)
        error.__cause__ = exc
        self._fail(error)

    def _run_worker(self, index: int, worker: int) -> None:
        """One of a parallel stage's workers (the module docstring says how they keep the order)."""
        stage, turns = self.stages[index], self._turns[index]
        stats = stage.stats
        began, cpu = time.perf_counter(), time.thread_time()
        ring_in = self.rings[index - self._sourced]
        ring_out = self.rings[index + 1 - self._sourced] if index + 1 < len(self.stages) else None
        with turns.cond:
            if turns.out is None and ring_out is not None:
                turns.out = Packer(ring_out, stats, split=self.stages[index + 1].whole_buffers)
            out = turns.out
        idle_in = idle_out = 0.0
        try:
            while True:
                waited = time.perf_counter()
                with turns.take_lock:
                    slot, _ = ring_in.take()
                    number = turns.taken
                    turns.taken += 1
                idle_in += time.perf_counter() - waited
                if slot is None:
                    break
                work = stage.work_slot(slot)
                waited = time.perf_counter()
                with turns.cond:
                    while turns.handed != number and self._error is None:
                        turns.cond.wait()
                    if self._error is not None:
                        raise Aborted
                idle_out += time.perf_counter() - waited
                before = stats.idle_out_s
                try:
                    stage.hand_on(slot, work, out)  # (only this worker hands on now: the others wait for their turn)
                    idle_out += stats.idle_out_s - before
                    ring_in.release_now(slot)
                finally:
                    with turns.cond:
                        turns.handed += 1
                        turns.cond.notify_all()
            with turns.cond:
                turns.ended += 1
                last = turns.ended == turns.workers
            if last:  # every other worker has handed on its last buffer: the stream ends here
                self._end_stream(stage, out, ring_out)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller as PipelineError (the stage named), not swallowed
            self._stage_failed(stage, exc)
        finally:
            with turns.cond:
                turns.idle_in += idle_in
                turns.idle_out += idle_out
                turns.cpu += time.thread_time() - cpu
                turns.done += 1
                if turns.done == turns.workers:  # the stage's figures: idle times are the workers' mean, CPU their sum
                    stats.workers = turns.workers
                    stats.wall_s = time.perf_counter() - began
                    stats.idle_in_s = turns.idle_in / turns.workers
                    stats.idle_out_s = turns.idle_out / turns.workers
                    stats.cpu_s = turns.cpu


class _Turns:
    """A parallel stage's shared state: who takes the next buffer, whose turn it is to hand on, the workers' figures."""

    def __init__(self, workers: int):
        self.workers = workers
        self.take_lock = threading.Lock()
        self.cond = threading.Condition()
        self.taken = self.handed = self.ended = self.done = 0
        self.out: Packer | None = None
        self.idle_in = self.idle_out = self.cpu = 0.0
