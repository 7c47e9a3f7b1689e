"""How long a rank's iterations take, without its checkpoints (issue 19).

The optimal interval is planned in iterations (paper 002: "checkpoint at
iteration n, then every m"), so the planner needs the time one iteration of
*computation* takes: the time between boundaries minus what the rank spent
checkpointing (blocked in the syncs and the write, or forking its snapshot).
It is measured over spans of at least :data:`SPAN` seconds (a loop of
microsecond iterations costs a clock read per boundary, not a division), and
is the *median* of the last :data:`SAMPLES` spans: iterations of irregular
length average out within a span, and one iteration far longer than the
rest (a 3 s I/O phase among 20 ms steps) is one sample the median passes
over, where a mean would have shrunk the planned interval in iterations
for a long while after it (measured: checkpoints every 16-20 iterations
instead of 137). A lasting change moves the median within
``SAMPLES // 2 + 1`` spans, and the planner re-plans. A planned iteration is
never skipped, however long the iterations before it take.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..interval.planner import Plan

SPAN = 0.2  # s: the shortest stretch of boundaries measured as one sample
SAMPLES = 9  # spans the median is taken over
PROGRESS_EVERY = 0.25  # s between a rank's progress reports to its daemon (a few dozen bytes each)


class Pace:
    """Boundaries in, smoothed seconds per iteration out (no clock of its own: the caller passes ``now``)."""

    def __init__(self) -> None:
        self.t_iter: float | None = None
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self._mark: tuple[int, float] | None = None  # (boundary, when) the current span began
        self._excluded = 0.0  # s of checkpoints inside the current span
        self._reported = -PROGRESS_EVERY  # when progress was last reported

    def boundary(self, k: int, now: float) -> None:
        """The program reached boundary ``k`` at ``now``."""
        if self._mark is None or k < self._mark[0]:
            self._mark, self._excluded = (k, now), 0.0
            return
        k0, t0 = self._mark
        span = now - t0
        if k == k0 or span < SPAN:
            return
        sample = max(0.0, span - self._excluded) / (k - k0)
        if sample > 0:
            first = self.t_iter is None
            self._samples.append(sample)
            self.t_iter = statistics.median(self._samples)
            if first:
                self._reported = -PROGRESS_EVERY  # (the first measurement is reported at once: the first plan waits for it)
        self._mark, self._excluded = (k, now), 0.0

    def checkpointed(self, seconds: float) -> None:
        """``seconds`` of the current span went to a checkpoint, not to computing."""
        if seconds > 0:
            self._excluded += seconds

    def progress_due(self, now: float) -> bool:
        """Whether a progress report is due (and, if so, it counts as sent)."""
        if now - self._reported < PROGRESS_EVERY:
            return False
        self._reported = now
        return True


DEFAULT_MTBF = 30 * 86400.0  # s: a process alone has no cluster history; GANGD_MTBF says otherwise


class AlonePlan:
    """``init(every="auto")`` in a process alone (issue 19): the same plan as
    the daemons make (:func:`gangd.interval.planner.make_plan`), from this
    process's own measurements — C the time its checkpoints block it, the
    pace of its iterations, R taken as C (paper 002's assumption: reading the
    state back costs what writing it did), λ = 1 / ``GANGD_MTBF`` (a
    duration such as ``7d``; default 30 days). The first checkpoint is
    taken at once, to measure C; then every ``every`` iterations, re-planned
    when a measurement moves by more than :data:`REPLAN`."""

    REPLAN = 0.25

    def __init__(self, mtbf: float) -> None:
        self.pace = Pace()
        self.lam = 1.0 / mtbf
        self.c: float | None = None
        self.next = 0  # the iteration of the next checkpoint (0: the first boundary)
        self.last = 0  # the iteration of the last one
        self.paceless = False  # the last plan waited for a pace to be measured
        self.plan: Plan | None = None  # the plan in force

    @classmethod
    def from_environment(cls, value: str | None) -> AlonePlan:
        from ..interval.rates import parse_duration

        if not value:
            return cls(DEFAULT_MTBF)
        try:
            mtbf = parse_duration(value)
        except ValueError as exc:
            raise ValueError(f"GANGD_MTBF={value!r} is not a duration (e.g. 7d, 12h): {exc}") from None
        if not mtbf > 0:
            raise ValueError(f"GANGD_MTBF={value!r} must be positive")
        return cls(mtbf)

    def due(self, k: int, now: float) -> bool:
        self.pace.boundary(k, now)
        if self.paceless and self.pace.t_iter is not None:  # (the pace is known now: the plan in iterations can be made)
            self._plan(self.last)
        return k >= self.next

    def saved(self, k: int, blocked: float) -> None:
        """A checkpoint at ``k`` blocked the program ``blocked`` seconds: plan the next."""
        self.pace.checkpointed(blocked)
        self.c = blocked if self.c is None else 0.7 * self.c + 0.3 * blocked
        self.last = k
        self._plan(k)

    def _plan(self, last: int) -> None:
        from ..interval.planner import Measured, make_plan, moved

        c = max(self.c or 0.0, 1e-6)
        t_iter = self.pace.t_iter
        self.paceless = t_iter is None
        if t_iter is None:  # no pace yet: nothing planned in iterations until there is one
            self.next = 2**62
            return
        m = Measured(C=c, L=c, R=c, lam=self.lam, t_iter=t_iter, basis={"C": "measured", "lam": "GANGD_MTBF or 30 days"})
        plan = self.plan
        if plan is None or moved(plan.inputs, m, self.REPLAN):
            plan = self.plan = make_plan(m)
        self.next = last + plan.every
