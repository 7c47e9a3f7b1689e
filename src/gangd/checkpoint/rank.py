"""A rank's agreement on the cut, as a pure state machine (the rules of
:mod:`gangd.ckptlib.agent`, without its thread, socket or condition variable).

The rank reports the lowest boundary it can still stop at; the daemons take
the largest report of all ranks as the cut and tell every rank; a rank that
reaches the boundary it reported before hearing the cut waits there (it might
be the cut); at the cut it saves; past it (it ran on before the cut came) it
declines, and the generation is aborted.

Whether the program asked for a checkpoint (``requested``) is the
:class:`~gangd.ckptlib.core.Checkpointer`'s flag, set by a signal handler at
any moment: the machine takes it as an input and says when to set or clear it
(:attr:`Step.request`) rather than owning it.

States: *idle* (no generation), *asked* (a generation began, not yet
reported), *reported* (waiting for the cut), *cut* (the cut is known). A
begin for another generation voids whatever an older one left; an abort or a
cut of another generation is ignored.

A **plan** (issue 19, ``--ckpt-every auto``: paper 002's "checkpoint at
iteration n, then every m") is kept beside: ``lead`` boundaries before ``n``
the rank asks for the checkpoint itself, offering ``n`` (:meth:`due`); the
begin that answers carries ``n`` as ``at``, below which no rank reports, so
every rank saves at ``n`` unless one is already past it (then at the first
boundary they can all still reach: late, never skipped). After saving at
``c`` the next is ``c + m``. A request the daemons did not take up (aborted,
refused) is asked again, at most once per :data:`PLAN_RETRY` seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .messages import AbortNote, BeginNote, CutNote, NoneNote, PlanNote, RankReport

PLAN_RETRY = 1.0  # s before a planned checkpoint that did not happen is asked for again


class Action(enum.Enum):
    RUN = "run"  # go on computing
    SAVE = "save"  # save generation ``Step.gen`` here
    WAIT = "wait"  # wait for the daemons' next word, then ask again


@dataclass
class Step:
    action: Action = Action.RUN
    gen: int | None = None
    reports: list[RankReport] = field(default_factory=list)
    request: bool | None = None  # set the Checkpointer's ``requested`` to this (None: leave it)
    warn: str | None = None


@dataclass
class RankAgreement:
    gen: int | None = None  # the checkpoint under way, as the daemons numbered it
    reported: int | None = None  # the boundary this rank said it can still stop at
    cut: tuple[int, int] | None = None  # (generation, iteration) the job saves at
    warned: int | None = None  # the last generation whose abort this rank printed
    at: int | None = None  # the generation's planned iteration: no report below it
    plan: PlanNote | None = None  # the interval plan (next, every, lead), or None
    asked_plan: tuple[int, float] | None = None  # (planned iteration, when) this rank last asked for
    waiting: int | None = None  # the boundary the program waits at (it can still stop there)

    @property
    def state(self) -> str:
        if self.cut is not None:
            return "cut"
        if self.reported is not None:
            return "reported"
        return "asked" if self.gen is not None else "idle"

    # -------------------------------------------------------- notes from the daemon

    def on_note(self, note: BeginNote | CutNote | AbortNote | NoneNote | PlanNote) -> Step:
        """A note from the daemon; a begin also asks for a report (:meth:`report`)."""
        step = Step()
        if isinstance(note, BeginNote):
            if note.gen != self.gen:  # a new checkpoint: whatever an older one left is void
                self.gen, self.reported, self.cut = note.gen, None, None
                self.at = note.at
            step.request = True
        elif isinstance(note, PlanNote):
            self.plan = note if note.every > 0 else None
            self.asked_plan = None
        elif isinstance(note, CutNote):
            if note.gen == self.gen:
                self.cut = (note.gen, note.iteration)
        elif isinstance(note, AbortNote):
            if note.gen is not None and note.gen == self.gen:
                if self.cut is not None:
                    step.warn = f"checkpoint {note.gen} was aborted: {note.why}"
                    self.warned = note.gen
                self.clear()
                step.request = False
        elif isinstance(note, NoneNote):
            if self.gen is None:  # nothing to checkpoint after all (e.g. the job is ending)
                self.clear()
                step.request = False
        return step

    def clear(self, gen: int | None = None) -> bool:
        """Forget the checkpoint under way (only ``gen``, if given: a newer one
        may have begun meanwhile). True if it was forgotten (the request is
        then void too)."""
        if gen is not None and self.gen not in (None, gen):
            return False
        self.gen = self.reported = self.cut = self.at = None
        return True

    # -------------------------------------------------------- the plan

    def due(self, k: int, requested: bool, now: float) -> Step:
        """At boundary ``k`` (before :meth:`boundary`): the rank's own request
        for the planned checkpoint, if it is due and not under way."""
        step = Step()
        plan = self.plan
        if plan is None or requested or self.gen is not None or self.cut is not None or k < plan.next - plan.lead:
            return step
        if self.asked_plan is not None and self.asked_plan[0] == plan.next and now - self.asked_plan[1] < PLAN_RETRY:
            return step
        offer = max(k, plan.next)  # (late: here, the first boundary this rank can still stop at)
        self.asked_plan = (plan.next, now)
        self.reported = offer
        step.request = True
        step.reports.append(RankReport(None, offer))
        return step

    def _saved(self, at: int) -> None:
        if self.plan is not None:  # then every m: counted from the checkpoint taken, planned or not
            self.plan = PlanNote(at + self.plan.every, self.plan.every, self.plan.lead)
            self.asked_plan = None

    # -------------------------------------------------------- the reader thread

    def report(self, requested: bool, iteration: int, start: int, done: str | None) -> Step:
        """The lowest boundary this rank can still stop at, when asked.
        ``iteration``: the last boundary passed (-1 before the loop);
        ``start``: where a restarted loop begins; ``done``: why it can never
        stop again (it left its loop), or None."""
        step = Step()
        if not requested or self.reported is not None or self.cut is not None:
            return step
        if done is not None:
            step.request = False
            step.reports.append(RankReport(self.gen, None, done))
            return step
        lowest = iteration if self.waiting == iteration else iteration + 1  # (sitting at a boundary: it can stop there)
        self.reported = max(lowest, start, -1 if self.at is None else self.at)
        step.reports.append(RankReport(self.gen, self.reported))
        return step

    def again(self, requested: bool) -> Step:
        """No word from the daemons for a while: a request of this rank's own
        (no generation yet) is sent again (the daemons drop one that comes while
        an older checkpoint is still being committed)."""
        step = Step()
        if self.gen is None and requested and self.reported is not None:
            step.reports.append(RankReport(None, self.reported))
        return step

    # -------------------------------------------------------- the program's thread

    def boundary(self, k: int, requested: bool) -> Step:
        """At loop boundary ``k``: run on, save here, or wait."""
        step = Step()
        self.waiting = None
        if self.cut is not None:
            gen, at = self.cut
            if k < at:
                return step
            if k == at:
                step.action, step.gen = Action.SAVE, gen
                self._saved(at)
                return step
            step.reports.append(RankReport(gen, None, f"it is at iteration {k}, past the cut {at}"))
            self.clear()
            step.request = False
            return step
        if not requested:
            return step
        if self.reported is None:  # the signal came just now: this thread reports
            self.reported = max(k + 1, -1 if self.at is None else self.at)
            step.reports.append(RankReport(self.gen, self.reported))
        if k < self.reported:
            return step
        step.action = Action.WAIT
        self.waiting = k
        return step

    def agree(self, k: int, requested: bool) -> Step:
        """At collective call ``k`` (``ckptlib.mpi.checkpoint()``): a rank asked
        to checkpoint offers *this* call; one that reported this call or an
        earlier one waits for the cut."""
        step = Step()
        if self.cut is not None:
            gen, at = self.cut
            if at == k:
                step.action, step.gen = Action.SAVE, gen
                self._saved(at)
            elif at < k:
                step.reports.append(RankReport(gen, None, f"it is at call {k} of checkpoint(comm), past the cut {at}"))
                self.clear()
                step.request = False
            return step
        if requested and self.reported is None:  # the request or the begin note came just now
            self.reported = max(k, -1 if self.at is None else self.at)
            step.reports.append(RankReport(self.gen, self.reported))
        if not requested or self.reported is None or self.reported > k:
            return step
        step.action = Action.WAIT
        return step

    def decline(self, gen: int, why: str) -> Step:
        step = Step(reports=[RankReport(gen, None, why)])
        if self.clear(gen):
            step.request = False
        return step
