"""One job's checkpoint plan under ``--ckpt-every auto``, as pure functions: measurements in, decisions out.

Why pure: the daemon measures (blocked time, latency until protected, restart cost, time per iteration) and
sums λ over the job's nodes, asynchronously and on several nodes; keeping the decision itself free of
trio, clocks and etcd makes it the same in the daemon, in ``gang ckpt plan`` and in the simulation bench,
and testable on its own (as :mod:`gangd.checkpoint.round` is for a checkpoint's round).

Paper 002's server tells every rank "checkpoint at iteration n, then every m" with no global stop, and
recomputes only when the measurements move noticeably. Here:

- :func:`make_plan`: Vaidya's optimal compute time between checkpoints (:mod:`.model`), clamped to a sane
  range, turned into a whole number of iterations, with Young's and Daly's values and the predicted
  overhead beside it;
- :func:`moved`: whether new measurements differ enough from those of the current plan to replace it;
- :func:`next_at` and :func:`lead_for`: the iteration of the next checkpoint, never one a rank may already
  have passed -- so irregular or very long iterations delay a checkpoint, never skip it;
- :class:`Smoother`: an exponentially weighted mean (constant memory) for the noisy per-checkpoint and
  per-iteration measurements, so one slow checkpoint does not replan the job by itself.

Redundancy levels enter through ``Measured.L`` (see :mod:`.model`): with partner/XOR redundancy L is the time
from a checkpoint's beginning until it is protected, which only makes the overhead larger and leaves the
interval where it is; with ``local`` redundancy L is the time until complete and
``node_loss_survivable=False`` records, on the plan and on the wire, that a node loss ends the job whatever
the interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .model import daly, overhead_ratio, vaidya_optimum, young

__all__ = ["Measured", "Plan", "make_plan", "moved", "next_at", "lead_for", "Smoother", "LEAD_MAX", "EVERY_MAX"]

# A plan's ``every`` is at most this (2**53: exact as a float and in JSON); reached only with absurd inputs
# (a day's interval over sub-nanosecond iterations).
EVERY_MAX = 2**53
# lead_for's upper bound: a 1 s round trip at 1 µs per iteration. A larger lead would plan a checkpoint
# further ahead than any measurement stays valid.
LEAD_MAX = 1_000_000
_FIELDS = ("C", "L", "R", "lam", "t_iter")


def _finite(name: str, value: float, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '≥ 0'}, not {value!r}")


@dataclass(frozen=True)
class Measured:
    """What one job's plan is computed from.

    ``C``: seconds a checkpoint blocks the job (its overhead); ``L``: seconds from a checkpoint's beginning
    until it is usable after a failure (protected, or complete for ``local`` redundancy), ≥ C; ``R``: seconds
    a restart costs; ``lam``: the job's failure rate (1/s, its nodes' rates summed); ``t_iter``: seconds of
    compute per iteration, checkpoint time excluded (> 0). ``basis`` says for each where it came from
    (``{"C": "measured: 12 checkpoints", "lam": "prior"}``); ``node_loss_survivable`` is False when no
    generation survives a node loss (``local`` redundancy). Negative, NaN or infinite values, and L < C,
    raise ValueError: a caller whose clocks disagree passes ``max(L, C)``.
    """

    C: float
    L: float
    R: float
    lam: float
    t_iter: float
    basis: dict[str, str] = field(default_factory=dict)
    node_loss_survivable: bool = True

    def __post_init__(self) -> None:
        for name in ("C", "L", "R", "lam"):
            _finite(name, getattr(self, name))
        _finite("t_iter", self.t_iter, positive=True)
        if self.L < self.C:
            raise ValueError(f"L ({self.L!r} s, begin → usable) cannot be shorter than C ({self.C!r} s, the blocked part of it)")
        if not isinstance(self.basis, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in self.basis.items()):
            raise ValueError("basis must map names to phrases (str → str)")
        if not isinstance(self.node_loss_survivable, bool):
            raise ValueError(f"node_loss_survivable must be a bool, not {self.node_loss_survivable!r}")


def _wire(value: float) -> float | None:
    return None if math.isinf(value) else value


@dataclass(frozen=True)
class Plan:
    """A job's checkpoint interval.

    ``every_s``: seconds of compute between checkpoints (Vaidya's optimum, clamped to
    make_plan's range);
    ``every``: the same in iterations (≥ 1); ``young_s``, ``daly_s``: Young's and Daly's estimates, unclamped
    (inf without failures); ``overhead``: the predicted overhead ratio r = Γ/T - 1 at the interval the ranks
    will actually keep, ``every x t_iter``; ``inputs``: what it was computed from; ``optimum_s``: Vaidya's
    optimum before clamping (inf without failures).
    """

    every_s: float
    every: int
    young_s: float
    daly_s: float
    overhead: float
    inputs: Measured
    optimum_s: float = math.inf

    def to_wire(self) -> dict[str, object]:
        """Plain JSON types (for etcd, the RPC and ``gang ckpt plan --json``): inf becomes None."""
        m = self.inputs
        return {
            "every_s": _wire(self.every_s),
            "every": self.every,
            "optimum_s": _wire(self.optimum_s),
            "young_s": _wire(self.young_s),
            "daly_s": _wire(self.daly_s),
            "overhead": _wire(self.overhead),
            "inputs": {
                "C": m.C, "L": m.L, "R": m.R, "lam": m.lam, "t_iter": m.t_iter,
                "basis": dict(m.basis), "node_loss_survivable": m.node_loss_survivable,
            },
        }


def make_plan(m: Measured, *, min_s: float = 1.0, max_s: float = 86400.0) -> Plan:
    """Vaidya's optimum for ``m``, clamped to [min_s, max_s] seconds, in seconds and in iterations.

    Not raised to L - C when the latency exceeds the optimum: Vaidya's model assumes a checkpoint begins
    only once the previous one is usable (T + C ≥ L), but gangd begins the next while the previous one's
    redundancy is still being written, and bench/interval.py's simulation of exactly that found the optimum
    (and Young's, and T/2, T/4) 6 % faster than the L - C floor (C 20 s, L 30 min, M 2 h). The overhead
    predicted there is the model's, an estimate. ``every = max(1, round(every_s / t_iter))``:
    an iteration longer than the interval gives a checkpoint every iteration. Without failures (λ = 0) the
    interval is ``max_s``.
    """
    _finite("min_s", min_s)
    _finite("max_s", max_s, positive=True)
    if min_s > max_s:
        raise ValueError(f"min_s ({min_s!r}) is above max_s ({max_s!r})")
    optimum = vaidya_optimum(m.C, m.lam)
    every_s = min(max(optimum, min_s), max_s)
    iterations = every_s / m.t_iter
    every = EVERY_MAX if iterations >= EVERY_MAX else max(1, round(iterations))
    mtbf = 1 / m.lam if m.lam else math.inf
    return Plan(
        every_s=every_s,
        every=every,
        young_s=young(m.C, mtbf),
        daly_s=daly(m.C, mtbf),
        overhead=overhead_ratio(every * m.t_iter, m.C, m.lam, m.R, L=m.L),
        inputs=m,
        optimum_s=optimum,
    )


def moved(old: Measured, new: Measured, threshold: float) -> bool:
    """Whether any of C, R, L, λ or t_iter changed by more than ``threshold`` relatively, in either direction.

    A value moved when new/old or old/new exceeds 1 + threshold: halving and doubling count alike (the
    optimum goes as sqrt(C/λ), symmetric in the ratio). From 0 to non-zero, or back, always counts; 0 to 0
    does not. A change of the redundancy's survivability counts too.
    """
    _finite("threshold", threshold)
    limit = 1 + threshold
    if old.node_loss_survivable != new.node_loss_survivable:
        return True
    for name in _FIELDS:
        a, b = getattr(old, name), getattr(new, name)
        if a == b:
            continue
        if a == 0 or b == 0:
            return True
        if max(a / b, b / a) > limit:
            return True
    return False


def _count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be a whole number ≥ {least}, not {value!r}")


def next_at(last_cut: int | None, current: int, every: int, lead: int) -> int:
    """The iteration at which the job's next checkpoint is planned.

    ``last_cut + every`` (``current + every`` before the job's first checkpoint), unless that is at or before
    ``current + lead`` -- a rank may already be there by the time the plan reaches it -- in which case the
    first iteration every rank can still reach, ``current + lead + 1``: a checkpoint late, never skipped.
    """
    if last_cut is not None:
        _count("last_cut", last_cut, 0)
    _count("current", current, 0)
    _count("every", every, 1)
    _count("lead", lead, 0)
    planned = (current if last_cut is None else last_cut) + every
    return max(planned, current + lead + 1)


def lead_for(t_iter: float, rtt: float = 0.05) -> int:
    """How many iterations ahead a plan must name, so that it reaches every rank before any passes it.

    ``ceil(rtt / t_iter)``, at least 1, at most :data:`LEAD_MAX`. ``t_iter`` (> 0) should be the shortest
    recent iteration rather than the mean if iterations vary, and ``rtt`` the slowest rank's round trip.
    """
    _finite("t_iter", t_iter, positive=True)
    _finite("rtt", rtt)
    ratio = rtt / t_iter
    if ratio >= LEAD_MAX:
        return LEAD_MAX
    return max(1, math.ceil(ratio))


class Smoother:
    """An exponentially weighted moving average: constant memory, recent samples weigh most.

    ``value`` after samples x₁..xₙ is xₙ·alpha + value·(1 - alpha) (the first sample is taken as is); with alpha = 0.25
    a sample's weight halves every 2.4 samples, so one slow checkpoint moves C by a quarter of its excess and
    a lasting change is followed within a handful. Samples must be finite and ≥ 0 (else ValueError: a
    measurement from a rank is hostile).
    """

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float = 0.25) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], not {alpha!r}")
        self.alpha = float(alpha)
        self.count = 0
        self.value: float | None = None

    def add(self, sample: float) -> float:
        """Fold one sample in; the new average."""
        _finite("a sample", sample)
        value = float(sample) if self.value is None else self.value + self.alpha * (sample - self.value)
        self.value = value
        self.count += 1
        return value
