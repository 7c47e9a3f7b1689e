"""The rank's half of gangd's consistent checkpoint (paper 000's Fig. 1 and 2, paper 002's iterations).

All ranks must save at the same iteration boundary, and no rank may already
be past it — decided without stopping the job to agree:

1. The daemon sends SIGQUIT and a ``ckpt_begin`` note naming the
   generation. The note wakes this module's thread, which reports the lowest
   boundary the rank can still stop at (the next one: ``iteration + 1``) —
   at once, even while the program is deep inside an iteration, blocked in a
   receive, or in a long C call that releases the GIL (numpy, BLAS, I/O —
   where the Python-level SIGQUIT handler cannot run until it returns). A C
   call that holds the GIL delays the report until it returns.
2. The daemons take the largest report of all ranks as the cut ``T`` and
   tell every rank (``ckpt_cut``). Meanwhile the ranks keep computing; a
   rank that reaches the boundary it reported before hearing ``T`` waits
   there (it might be ``T``).
3. At boundary ``T`` the rank asks for the **start sync** (``ckpt_start``);
   the daemons answer once every rank of the job is there, its send gates are
   closed and its network context is on disk.
4. The rank writes its protected values (or forks a snapshot that writes them
   behind its back) and asks for the **end sync** (``ckpt_end``); the answer
   comes when every rank did, with the gates open again.

On restart the daemon's attach reply names the generation and the file to
load; the rank reports ``ckpt_restored`` and the gates open once every rank
loaded its state.

Incremental checkpoints (issue 17): the ``ckpt_start`` reply carries the
daemon's offer (:class:`~gangd.checkpoint.messages.DeltaOffer`): the mode,
block size, chain bound and threshold of the job (the program's own
``init()`` choices win, the chain never longer than the daemon accepts) and
the parent generation's file with its chain. The writer (the forked child,
for background writes) reads the signatures it compares with from those
files' indexes and reports role, parent, base, links, state and restore,
which the daemon checks against the offer. A restart's attach reply carries
the generation's ``chain``, read by :func:`.blocks.read_chain`: each link's
index hash, size and generation checked, every placed block against the
generation's signatures.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..ckptstore import StoreError
from ..client.runtime import JobInfo
from ..comm.control import DaemonLink
from ..comm.errors import CommError
from ..protocol import Note, Reply
from . import spc
from .core import Checkpointer, CheckpointError, codec_missing, warn
from .pace import Pace

if TYPE_CHECKING:  # (imported at the first checkpoint or restore: a rank that takes none does not pay for them)
    from ..checkpoint import messages
    from ..checkpoint.rank import RankAgreement, Step
    from .writer import Written

REQUEST_AGAIN = 0.5  # s before a rank's unanswered checkpoint request is sent again
WATCH_EVERY = 0.01  # s of iterations between the boundaries an interval-planned rank looks at (see _paced)
FORCE_RETRY = 10.0  # s a forced checkpoint (ckptlib.mpi.checkpoint(force=True)) is asked for again after a "no"


class _Waiter:
    """A request of the program's thread: the reader thread sets ``done`` once ``reply`` came (or the connection went)."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Reply | None = None


class DaemonAgent:
    def __init__(self, info: JobInfo):
        self.info = info
        if not info.socket:
            raise CheckpointError("cannot register with the gangd node daemon: GANGD_SOCKET is not set")
        try:
            self.link = DaemonLink(info.socket, f"ckpt-{info.job}.{info.rank}")
            attached = self.link.request("ckpt_attach", {"job": info.job, "rank": info.rank})
        except CommError as exc:
            raise CheckpointError(f"cannot register with the gangd node daemon: {exc}") from None
        self.restart = attached.get("restart")
        # ``--ckpt-every auto`` (issue 19): the daemons plan the interval from this rank's pace (its
        # progress reports) and send the plan (``ckpt_plan``); the rank then sees every boundary.
        self.pace: Pace | None = Pace() if attached.get("auto") is True else None
        self.io = threading.Lock()  # the protocol machine and socket writes, shared by two threads
        self.cond = threading.Condition()
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._agreement: RankAgreement | None = None  # the protocol's state (gangd.checkpoint.rank), made at first use
        self.gone: str | None = None  # why the daemon connection ended
        self.stopping = False  # fini: the reader thread ends before its fds are closed
        self.replies: dict[int, _Waiter] = {}
        self.background: dict[int, tuple[int, Written]] = {}  # pipe fd -> (generation, the write)
        self.cp: Checkpointer  # set by attach(), before the thread that reads it starts
        self.thread = threading.Thread(target=self._run, name=f"gangd-ckpt-{info.rank}", daemon=True)

    @property
    def agreement(self) -> RankAgreement:
        """The protocol's state, under cond; made (and :mod:`gangd.checkpoint.rank` with its messages
        imported) when a checkpoint first concerns this rank, not at start-up (bench/ckpt.py Table 2)."""
        if self._agreement is None:
            from ..checkpoint.rank import RankAgreement

            with self.cond:
                if self._agreement is None:
                    self._agreement = RankAgreement()
        return self._agreement

    # ------------------------------------------------------------ restart

    def restore(self, cp: Checkpointer, restart) -> None:
        if not self.restart:
            if restart not in (None, "auto", False):
                raise CheckpointError("this job was not restarted from a checkpoint (use `gang restart JOB`)")
            return
        gen, path = self.restart["gen"], Path(self.restart["path"])
        try:
            expect = tuple(self.restart["expect"])
            # Each link checked as read_chain reads it: its index hash and size, its generation against
            # the chain handed over, and every placed block against this generation's signatures.
            values, iteration = spc.read(cp.spc, path, expect, _chain_of(self.restart), cp.settings.pipeline_settings(),
                                         cp.settings.map_restore)
        except StoreError as exc:
            raise self.cannot_restore(str(exc)) from None
        except Exception as exc:
            if not codec_missing(exc):
                raise
            raise self.cannot_restore(str(exc)) from None
        cp.restored, cp.start, cp.generation = values, iteration, gen
        cp.restarted_from = gen
        self._note("ckpt_restored", {"gen": gen})

    def cannot_restore(self, why: str) -> CheckpointError:
        """Tell the node that this rank cannot restore the generation it was handed, and why (its job's
        reason, and for a recovered job the check of its files, say it); the error for the program."""
        self._note("ckpt_restored", {"gen": self.restart["gen"], "error": why})
        return CheckpointError(f"cannot restore rank {self.info.rank}: {why}")

    def attach(self, cp: Checkpointer) -> None:
        self.cp = cp
        if self.pace is not None:
            cp.watch = 0  # every boundary: the pace is measured, the plan's iteration recognised
        self.thread.start()
        if cp.requested:  # SIGQUIT came while this rank was registering
            self.on_request(cp)

    # ------------------------------------------------------------ the connection

    def _note(self, op: str, args: dict) -> None:
        with self.io:
            self.link.note(op, args)

    def call(self, op: str, args: dict):
        """A request from the program's thread; the reply comes through the reader thread."""
        waiter = _Waiter()
        with self.io:
            if self.gone:
                raise CheckpointError(f"the node daemon connection is gone ({self.gone})")
            self.replies[self.link.send_request(op, args)] = waiter
        waiter.done.wait()
        reply = waiter.reply
        if reply is None:
            raise CheckpointError(f"the node daemon connection is gone ({self.gone})")
        if not reply.ok:
            raise CheckpointError(reply.error["message"] if reply.error else f"the node daemon refused {op}")
        return reply.result

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 -- a dead thread would leave the program waiting forever
            self._lost(f"checkpoint thread failed: {exc!r}")

    def _loop(self) -> None:
        for event in self.link.take_pending():  # (what came with the ckpt_attach reply)
            self._handle(event)
        while not self.gone:
            fds = [self.link.fd, self.wake, *self.background]
            readable, _, _ = select.select(fds, [], [])
            if self.stopping:
                return
            if self.wake in readable:
                try:
                    os.eventfd_read(self.wake)
                except BlockingIOError:
                    pass
                self._report()
            for fd in readable:
                if fd in self.background:
                    gen, written = self.background[fd]
                    self._note("ckpt_written", {"gen": gen, **_report(written.wait())})
                    with self.cond:  # (only now: fini closes the connection once none is left)
                        del self.background[fd]
                        self.cond.notify_all()
            if self.link.fd in readable:
                with self.io:
                    events = self.link.read_ready()
                for event in events:
                    if event is None:
                        self._lost("the node daemon closed the connection")
                        return
                    self._handle(event)

    def _lost(self, why: str) -> None:
        with self.io:
            self.gone = why
            waiters, self.replies = list(self.replies.values()), {}
        for waiter in waiters:
            waiter.done.set()
        with self.cond:
            self.cond.notify_all()

    def _report(self) -> None:
        """Tell the daemon the lowest boundary this rank can still stop at.

        Without a generation (a SIGQUIT or ``request()`` of the program's
        own) the report asks the daemons to checkpoint the job; they answer
        with ``ckpt_begin``, and the rank reports again for that generation.
        """
        cp = self.cp
        with self.cond:
            done = None
            if cp.loop_done or cp.closed:
                done = "it has made its last checkpoint(comm) call (ckpt.fini())" if cp.points == "mpi" else "it has left its checkpointed loop"
            # (cp.iteration is -1 until the loop runs; after a restart the loop starts at cp.start)
            self._apply(self.agreement.report(cp.requested, cp.iteration, cp.start, done))

    def _apply(self, step: Step) -> Step:
        """Carry out what the agreement decided (cond held): the request flag, reports, a warning."""
        if step.request is not None:
            self.cp.requested = step.request
        for report in step.reports:
            self._note(report.op, report.to_wire())
        if step.warn:
            warn(step.warn)
        return step

    def _handle(self, event) -> None:
        if isinstance(event, Reply):
            with self.io:
                waiter = self.replies.pop(event.id, None)
            if waiter is not None:
                waiter.reply = event
                waiter.done.set()
            return
        if not isinstance(event, Note):
            return
        from ..checkpoint import messages

        note = messages.daemon_note(event.op, event.args)
        if note is None:
            return
        with self.cond:
            self._apply(self.agreement.on_note(note))
            self.cond.notify_all()
        if isinstance(note, messages.BeginNote):
            self._report()
            _warm_writer()
        elif isinstance(note, messages.PlanNote):
            self.cp.watch = 0  # (the program's thread looks at its next boundary: the plan may name an earlier one)

    def _clear(self, gen: int | None = None) -> None:
        """Forget the checkpoint under way (only ``gen``, if given: a newer
        one may have begun meanwhile, and it is not this caller's to end)."""
        if self.agreement.clear(gen):
            self.cp.requested = False

    # ------------------------------------------------------------ the program's side

    def on_request(self, cp: Checkpointer) -> None:
        os.eventfd_write(self.wake, 1)

    def _wait_daemon(self, cp: Checkpointer) -> None:
        """Wait (cond held) for the daemons' next word. A request of this
        rank's own (no generation yet) is sent again now and then: the
        daemons drop one that comes while an older checkpoint is still
        being committed, and nothing else would ever answer it."""
        if not self.cond.wait(REQUEST_AGAIN):
            self._apply(self.agreement.again(cp.requested))

    def _paced(self, cp: Checkpointer, k: int) -> None:
        """An interval-planned job's boundary ``k``: measure the pace, report
        progress now and then, and ask for the planned checkpoint when due."""
        pace = self.pace
        assert pace is not None  # noqa: S101 (only called with one)
        now = time.monotonic()
        pace.boundary(k, now)
        if pace.progress_due(now) and not self.gone:
            self._note("ckpt_progress", {"iteration": k, "t_iter": pace.t_iter})
        plan = self._agreement.plan if self._agreement is not None else None
        if plan is not None and not cp.requested:
            with self.cond:
                self._apply(self.agreement.due(k, cp.requested, now))
        # The next boundary worth a look: in a loop of microsecond iterations, every WATCH_EVERY seconds'
        # worth of them (a clock read per boundary would cost as much as the loop), and the plan's.
        stride = 1 if pace.t_iter is None or pace.t_iter >= WATCH_EVERY else int(WATCH_EVERY / pace.t_iter)
        watch = k + stride
        if plan is not None:
            watch = min(watch, max(k + 1, plan.next - plan.lead))
        cp.watch = watch

    def at_boundary(self, cp: Checkpointer, k: int) -> None:
        from ..checkpoint.rank import Action

        if self.pace is not None:
            self._paced(cp, k)
            if not cp.requested:
                return
        with self.cond:
            while True:
                if self.gone:
                    cp.requested = False
                    return
                step = self._apply(self.agreement.boundary(k, cp.requested))
                if step.action is Action.RUN:
                    return
                if step.action is Action.SAVE:
                    gen = step.gen
                    break
                self._wait_daemon(cp)
        assert gen is not None  # noqa: S101 (a SAVE names its generation)
        self._checkpoint(cp, gen, k)

    def agree(self, cp: Checkpointer, k: int, force: bool = False) -> int | None:
        """At ``ckptlib.mpi.checkpoint()`` call ``k``: the generation to save here, or None.
        Either way this rank is past call ``k`` from now on (``cp.iteration``).

        The same agreement as a loop boundary, except that a rank asked to
        checkpoint offers *this* call (it cannot run on to a later one
        alone: the calls are collective). A rank that reported this call or
        an earlier one waits for the cut; past this point its reports name
        the next call. The ranks then confirm over MPI that they all agree.

        ``force``: the program wants this call saved; a request answered
        "no" (a generation refused because a rank has not registered yet,
        say) is made again for a while.
        """
        from ..checkpoint.rank import Action

        if self.pace is not None:
            self._paced(cp, k)
        deadline = time.monotonic() + FORCE_RETRY
        agreement = self.agreement
        with self.cond:
            while not self.gone:
                if agreement.cut is None and force and not cp.requested and agreement.gen is None and time.monotonic() < deadline:
                    self.cond.wait(0.2)  # (no hurry: the "no" may be about a rank that is still starting)
                    if agreement.gen is None and agreement.cut is None:
                        cp.requested = True
                step = self._apply(agreement.agree(k, cp.requested))
                if step.action is Action.SAVE:
                    # Committed to this call: a report from now on (to a
                    # later generation, if this one is aborted) names the next.
                    cp.iteration = k
                    return step.gen
                if step.action is Action.RUN:
                    break
                self._wait_daemon(cp)  # for the cut, or for the begin note that answers this rank's own request
            cp.iteration = k
            return None

    def decline(self, cp: Checkpointer, gen: int, why: str) -> None:
        """This rank cannot save generation ``gen`` after all: the daemons abort it."""
        with self.cond:
            step = self.agreement.decline(gen, why)
            if self.gone:
                step.reports = []
            self._apply(step)

    def save(self, cp: Checkpointer, gen: int, k: int, resume: int) -> int | None:
        return gen if self._checkpoint(cp, gen, k, resume) else None

    def _checkpoint(self, cp: Checkpointer, gen: int, k: int, resume: int | None = None) -> bool:
        began = time.monotonic()
        try:
            where = self.call("ckpt_start", {"gen": gen, "iteration": k})
            offer = _offer_of(where)
            settings = cp.settings.under(offer)
            # Mode full writes a whole file as before deltas (no signatures: nothing will diff against it), raw by
            # the direct path; with a codec it goes through save_generation like any other mode, offered nothing
            # (else a job's --ckpt-codec would be ignored in mode full).
            if settings.mode != "full":
                offered: list | None = [link.to_wire() for link in offer.links]
            else:
                offered = None if settings.codec == "none" else []
            # A forked snapshot is held until the end sync: until then the job is blocked, and its cores are
            # what the ranks and daemons need to get through the sync (writer.write's ``hold``).
            written = cp.snapshot(Path(where["path"]), k if resume is None else resume, gen=gen, offered=offered,
                                  settings=settings, force_full=offer.force_full, hold=True)
            try:
                cp.writes.remove(written)
                if written.done:
                    self.call("ckpt_end", {"gen": gen, "result": _report(written.wait())})
                else:
                    with self.io:
                        self.background[written.pipe] = (gen, written)
                    os.eventfd_write(self.wake, 1)  # the reader thread watches the new pipe
                    self.call("ckpt_end", {"gen": gen, "background": True})  # (returns once the job resumed)
                    written.release(write=True)
            finally:
                written.release(write=False)  # (the end sync failed: the generation is aborted, nothing to write)
            cp.generation = gen
            return True
        except CheckpointError as exc:
            if not self.gone and self.agreement.warned != gen:  # (the abort note may have said it already)
                warn(f"checkpoint {gen} failed: {exc}")
            return False
        finally:
            with self.cond:
                self._clear(gen)
            if self.pace is not None:
                self.pace.checkpointed(time.monotonic() - began)

    def fini(self, cp: Checkpointer) -> None:
        with self.cond:
            while self.background and not self.gone:
                self.cond.wait()
        self.close()

    def close(self) -> None:
        """End the connection: the reader thread (if started) first, then the fds it reads."""
        # The reader thread selects on and reads these fds by number: it must be
        # gone before they are closed, or it reads whatever reuses the numbers
        # next (gangd.comm's new connections: it stole their bytes).
        self.stopping = True
        os.eventfd_write(self.wake, 1)
        if self.thread.ident is not None:
            self.thread.join(timeout=10)
        self.link.close()
        if not self.thread.is_alive():
            os.close(self.wake)


#: "pipeline" (bytes in and out, each stage's busy and CPU seconds) and "codecs" are a compressed write's
#: (issue 18): ``gang ckpt stats`` and ``gang ckpt ls`` show them per node and per generation.
_REPORTED = ("size", "digest", "seconds", "role", "parent", "base", "links", "state", "restore", "error", "pipeline", "codecs")


def _warm_writer() -> None:
    """Import the writer (and the block format under it) now, in this thread,
    while the job runs on to the cut, rather than at the first snapshot, in
    the program's thread, while the job is blocked.

    It is imported at the first checkpoint, not with ckptlib (a program that
    never checkpoints pays nothing for it), and that import was 10-40 ms of
    the first checkpoint's blocked time with 4 ranks on 2 cores
    (``bench/ckpt.py``, Table 5). A second call costs a dictionary lookup;
    an import that fails is left for the snapshot to report."""
    try:
        from . import writer  # noqa: F401
    except Exception:  # noqa: BLE001,S110 -- the checkpoint itself reports it
        pass


def refused(info: JobInfo, why: str) -> None:
    """``init()`` refused this rank's settings (a codec this machine lacks, say): tell its node why.
    Otherwise the node would see only its exit ("exit 1") and the job's reason would not say what is
    missing. A rank being restarted cannot restore (a job a recovery started is then checked and
    recovered as one whose restore failed); any other rank's sentence is kept by its node as its last
    words, said with its exit if the program ends on the error (one that catches it and runs on without
    checkpoints is not failed for it). Asked as a request: answered once the node has it, so its exit
    cannot be seen first."""
    try:
        agent = DaemonAgent(info)
    except CheckpointError:
        return  # (no daemon to tell: the rank's own message says it)
    try:
        if agent.restart:
            agent.cannot_restore(why)
        else:
            agent.link.request("ckpt_refused", {"error": why})
    except CommError:
        pass  # (the daemon went meanwhile: the rank's own message says it)
    finally:
        agent.close()


def _report(result: dict) -> dict:
    """What the daemon hears of a write (:class:`gangd.checkpoint.messages.WriteReport`):
    the writer's notes for this process (why a delta became a full) stay here."""
    if result.get("why_full"):
        warn(f"wrote a whole file instead of a delta: {result['why_full']}")
    return {key: result[key] for key in _REPORTED if key in result}


def _offer_of(reply) -> messages.DeltaOffer:
    """The ``delta`` of a ``ckpt_start`` reply; a daemon that offers none (or
    a malformed one) gets a whole file, written in the job's settings."""
    from ..checkpoint import messages

    raw = reply.get("delta") if isinstance(reply, dict) else None
    try:
        return messages.DeltaOffer.from_wire(raw)
    except (messages.BadMessage, TypeError, ValueError):
        return messages.DeltaOffer("full", 16, 1, 0.0, True)


def _chain_of(restart: dict) -> list[dict]:
    """The links of a restart's generation (the attach reply's ``chain``, newest first), each checked."""
    from ..checkpoint import messages

    raw = restart.get("chain") or []
    if not isinstance(raw, list) or len(raw) > messages.MAX_LINKS:
        raise StoreError("the node daemon handed over a malformed chain of generations")
    try:
        return [messages.Link.from_wire(link).to_wire() for link in raw]
    except messages.BadMessage as exc:
        raise StoreError(f"the node daemon handed over a malformed link: {exc}") from None
