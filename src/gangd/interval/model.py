"""Vaidya's checkpoint model (paper 002's), its optimum, and Young's and Daly's formulas beside it.

Why this model: paper 002's interval server uses N. Vaidya's three-state Markov chain. A job computes T
seconds, then checkpoints for C seconds; failures arrive as a Poisson process of rate λ (the job's nodes'
rates summed: any node's failure stops the job); after a failure the job pays a recovery R and starts the
interval again from the last checkpoint. The expected time to get through one interval is

    Γ = λ⁻¹ e^{λR} (e^{λ(T+C)} - 1)

(paper 002, eq. 10, writes it with R = C: "restarting transfers the checkpoint, which costs C"; we keep R
separate because gangd measures it), the overhead ratio is r = Γ/T - 1 (eq. 11), and it is smallest where
e^{λ(T+C)} (1 - λT) = 1 (eq. 12) -- an optimum that depends on neither R nor the latency below. Young's
sqrt(2CM) and Daly's higher-order estimate are first-order approximations of the same optimum; gangd reports
them beside it so a user can compare with what other systems would pick.

Checkpoint latency (Vaidya 1997, "Impact of checkpoint latency on overhead ratio of a checkpointing
scheme"): a checkpoint may block the job only C seconds and yet become usable only L ≥ C seconds after it
began. A failure then rolls back past the newest *usable* generation, so every failure re-executes L - C
seconds more:

    Γ = λ⁻¹ e^{λ(R + L - C)} (e^{λ(T+C)} - 1)

The factor e^{λ(L-C)} multiplies Γ, so the optimal T does not move with L; only the overhead grows. (The
model has at most one checkpoint in flight: it holds for T + C ≥ L. When L - C exceeds the optimum, the best
interval the model allows is T = L - C, since r falls and then rises in T; the planner applies that bound --
Vaidya's "typically independent of latency".) This is
how gangd accounts for redundancy levels (``overhead_ratio(..., L=...)``): a node loss is survived only by a
*protected* generation (its partner or XOR copy written), so for partner/XOR redundancy L is the time from a
checkpoint's beginning until it is protected. For ``local`` redundancy L is the time until the generation is
complete -- and a node loss is not survivable at all (its checkpoint is on the lost disk), which the plan
must say rather than pretend the interval protects the job.

Numerics: everything is computed in x = λT, c = λC and with expm1/log1p and short series, never as a
difference of nearly equal exponentials, so λC from 1e-300 to 1e3 gives full double precision (the
optimum's relative error is a few ulp; the tests check it against a 50-digit Decimal residual).
"""

from __future__ import annotations

import math

__all__ = ["vaidya_gamma", "overhead_ratio", "vaidya_optimum", "young", "daly"]

# Past this, e^x overflows a double (math.exp raises OverflowError above ~709.78).
_EXP_MAX = 709.0
# From this λC on, the optimum's 1 - λT is e^{-(1+λC)} to within a relative 3e-16 (it is e^{-(1+c)+(1-x)}), at
# most 2.3e-16: λT = 1 - e^{-(1+c)} is correctly rounded, and the iteration's start would round to 1.
_C_SATURATED = 35.0
# Below this λC the asymptotic root sqrt(2c) (1 - sqrt(2c)/3 + 2c/36) is exact to double precision
# (its first omitted term is relatively O(c^1.5) ≈ 1e-45) and x² would underflow in the iteration.
_C_TINY = 1e-30


def _real(name: str, value: float, *, allow_inf: bool = False) -> float:
    """A non-negative real number, or ValueError: NaN, negatives, bools, strings and (unless allowed) inf are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a {'non-negative number' if allow_inf else 'finite number ≥ 0'}, not {value!r}")
    return value


def _phi(a: float) -> float:
    """(e^a - 1)/a for a ≥ 0, 1 at 0; inf on overflow."""
    if a == 0:
        return 1.0
    if a > _EXP_MAX:
        return math.inf
    return math.expm1(a) / a


def _psi(a: float) -> float:
    """(e^a - 1 - a)/a² for a ≥ 0 (1/2 at 0), by its series where the subtraction would cancel."""
    if a < 0.5:
        total, term, k = 0.5, 0.5, 2
        while True:
            k += 1
            term *= a / k
            if term <= 1e-17 * total:
                return total
            total += term
    if a > _EXP_MAX:
        return math.inf
    return (math.expm1(a) - a) / a / a


def _q(x: float) -> float:
    """-(x + log(1 - x)) = Σ_{k≥2} x^k/k for 0 ≤ x < 1, by its series where the subtraction would cancel."""
    if x < 0.25:
        total, power, k = 0.0, x * x, 2
        while True:
            term = power / k
            total += term
            if term <= 1e-17 * total:
                return total
            power *= x
            k += 1
    return -(x + math.log1p(-x))


def _rework(C: float, R: float | None, L: float | None) -> tuple[float, float]:
    """(R, L) with their defaults (R = C as in paper 002, L = C: usable when unblocked), checked."""
    R = C if R is None else _real("R", R)
    L = C if L is None else _real("L", L)
    if L < C:
        raise ValueError(f"L (begin → usable, {L!r} s) cannot be shorter than C (the blocked part, {C!r} s): pass max(L, C)")
    return R, L


def vaidya_gamma(T: float, C: float, lam: float, R: float | None = None, *, L: float | None = None) -> float:
    """Expected wall time to complete T seconds of work and then a checkpoint of overhead C.

    ``Γ = λ⁻¹ e^{λ(R + L - C)} (e^{λ(T+C)} - 1)``: failures of rate ``lam`` (per second), each costing the
    recovery ``R`` (default C, as in paper 002) plus the rework since the last usable checkpoint; ``L``
    (default C) is the checkpoint latency, begin → usable (see the module docstring). ``lam == 0`` gives
    T + C exactly; an overflowing result is ``inf``.
    """
    T, C, lam = _real("T", T), _real("C", C), _real("lam", lam)
    R, L = _rework(C, R, L)
    rho = lam * (R + L - C)
    if rho > _EXP_MAX:
        return math.inf
    # λ⁻¹ (e^{λ(T+C)} - 1) written as (T + C) · φ(λ(T+C)): no division by a λ that may be subnormal.
    return (T + C) * _phi(lam * (T + C)) * math.exp(rho)


def overhead_ratio(T: float, C: float, lam: float, R: float | None = None, *, L: float | None = None) -> float:
    """r = Γ/T - 1: the time lost to checkpoints, recoveries and rework per second of useful work (``T > 0``).

    Computed without the subtraction: with a = λ(T+C) and rho = λ(R + L - C),
    ``r·T = λ(T+C)² ψ(a) + C + (e^rho - 1)(T+C) φ(a)`` where ψ(a) = (e^a - 1 - a)/a² and φ(a) = (e^a - 1)/a, all
    terms ≥ 0 -- so a small overhead (λC = 1e-9 gives r ≈ 4.5e-5) keeps its full precision.
    """
    T, C, lam = _real("T", T), _real("C", C), _real("lam", lam)
    if T == 0:
        raise ValueError("T must be > 0: the overhead per second of work is undefined without work")
    R, L = _rework(C, R, L)
    a = lam * (T + C)
    rho = lam * (R + L - C)
    if rho > _EXP_MAX:
        return math.inf
    failures = lam * (T + C) * (T + C) * _psi(a) if lam else 0.0
    latency = math.expm1(rho) * (T + C) * _phi(a) if rho else 0.0
    return (failures + C + latency) / T


def _solve(c: float, rel_tol: float) -> float:
    """x in (0, 1) with c + x + log(1 - x) = 0, for c > 0.

    g(x) = c - q(x) with q(x) = -(x + log(1 - x)) is decreasing and concave on (0, 1), g(0) = c > 0 and g → -∞
    at 1. Newton from the right of the root never overshoots on a concave decreasing function; the bracket
    [lo, hi] and a bisection fallback keep it safe anyway. The start, sqrt(2c), is right of the root
    (q(x) > x²/2) and within a relative sqrt(2c)/3 of it; 1 - e^{-(1+c)} always is (g there is x - 1 < 0).
    Each q(x) is accurate to a few ulp, and dq/dx ≥ x, so the root is found to a few ulp relative. It stops
    when a step is below ``rel_tol`` relative: Newton converges quadratically, so the error left is then of
    the order of the step squared.
    """
    if c < _C_TINY:
        s = math.sqrt(2 * c)
        return s * (1 - s / 3 + s * s / 36)
    if c >= _C_SATURATED:
        return -math.expm1(-(1 + c))  # 1 - e^{-(1+c)}: 1 to double precision (and exactly 1 when c is inf)
    lo, hi = 0.0, -math.expm1(-(1 + c))
    if c < 0.5:
        hi = min(hi, math.sqrt(2 * c))
    x = hi
    for _ in range(200):
        g = c - _q(x)
        if g == 0:
            return x
        if g > 0:
            lo = x
        else:
            hi = x
        step = g * (1 - x) / x  # Newton: g'(x) = -x/(1 - x)
        nxt = x + step
        if abs(step) <= rel_tol * x:  # (a last step of a few ulp may land on the bracket's end: x is as good)
            return nxt if lo <= nxt <= hi else x
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        x = nxt
    return x


def vaidya_optimum(C: float, lam: float, *, rel_tol: float = 1e-12) -> float:
    """The compute time T (seconds) between checkpoints that minimises Vaidya's overhead ratio.

    The root of ``e^{λ(T+C)} (1 - λT) = 1`` (paper 002, eq. 12), solved as c + x + log1p(-x) = 0 in x = λT,
    c = λC. Precision: with the default ``rel_tol`` (the iteration stops once a Newton step is below it,
    relative; the error left is of the order of that step squared) T is within a relative 1e-14 of the exact
    root for every λC (a few ulp: the tests check it with a Decimal residual at 60+ digits). Independent of R
    and of the latency L (the planner bounds it below by L - C: see the module docstring). ``lam == 0`` (no
    failures) gives ``inf``; ``C == 0`` (free checkpoints) gives 0; for λC ≥ 35, λT is within 2.3e-16 of 1:
    T = 1/λ, the MTBF.
    """
    C, lam = _real("C", C), _real("lam", lam)
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, int | float) or not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), not {rel_tol!r}")
    if lam == 0:
        return math.inf
    if C == 0:
        return 0.0
    c = lam * C
    return _solve(c, rel_tol) / lam


def young(C: float, mtbf: float) -> float:
    """Young 1974: sqrt(2·C·M), the first-order optimum (seconds); inf for an infinite MTBF (unless C is 0)."""
    C, mtbf = _real("C", C), _real("mtbf", mtbf, allow_inf=True)
    if mtbf == 0:
        raise ValueError("mtbf must be > 0")
    if C == 0:
        return 0.0
    return math.sqrt(2 * C * mtbf)


def daly(C: float, mtbf: float) -> float:
    """Daly 2006's higher-order estimate: sqrt(2δM) [1 + ⅓ sqrt(δ/2M) + δ/(18M)] - δ for δ < 2M, else M.

    δ = C, the checkpoint's cost. Daly's published example (δ = 5 min): 117, 57 and 9.1 min for
    M = 24 h, 6 h and 15 min.
    """
    delta, M = _real("C", C), _real("mtbf", mtbf, allow_inf=True)
    if M == 0:
        raise ValueError("mtbf must be > 0")
    if delta == 0:
        return 0.0
    if math.isinf(M):
        return math.inf
    if delta >= 2 * M:
        return M
    return math.sqrt(2 * delta * M) * (1 + math.sqrt(delta / (2 * M)) / 3 + delta / (18 * M)) - delta
