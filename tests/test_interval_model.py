"""The checkpoint-interval arithmetic (gangd.interval, issue 19), without daemons.

What a user of ``--ckpt-every auto`` relies on: the interval is the one paper 002's model (Vaidya's)
says is optimal, to a stated precision, and agrees with the published formulas it is reported beside
(Young's, Daly's); failure rates start from the config's prior and follow the cluster's own history;
the plan never names an iteration a rank may already have passed. The references are independent of the
code under test: published values, 60+-digit Decimal arithmetic, paper 002's Markov chain summed term by
term, a Monte Carlo run of the failure process, and a golden-section search over the overhead.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from decimal import Decimal, localcontext
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gangd.interval.model import daly, overhead_ratio, vaidya_gamma, vaidya_optimum, young
from gangd.interval.planner import LEAD_MAX, Measured, Plan, Smoother, lead_for, make_plan, moved, next_at
from gangd.interval.rates import Rate, job_rate, node_rate, parse_duration

MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1.0, True, "5", None]

# λC over the whole range the daemon can meet: a 1 ms checkpoint on a node failing once in ten years
# (3e-12) to a checkpoint half as long as the MTBF.
lam_c = st.floats(min_value=-12, max_value=math.log10(0.5)).map(lambda e: 10.0**e)
costs = st.floats(min_value=1e-3, max_value=1e5)


# -- Young's and Daly's published values ------------------------------------------------------------------


@pytest.mark.parametrize(("mtbf", "daly_min", "digits", "young_min"), [(24 * HOUR, 117, 0, 120), (6 * HOUR, 57, 0, 60), (15 * MINUTE, 9.1, 1, 12.2)])
def test_daly_and_young_reproduce_the_published_values(mtbf: float, daly_min: float, digits: int, young_min: float) -> None:
    """Daly 2006's example: δ = 5 min (R = 10 min, which neither formula uses), M = 24 h, 6 h, 15 min."""
    delta = 5 * MINUTE
    assert round(daly(delta, mtbf) / MINUTE, digits) == daly_min
    assert round(young(delta, mtbf) / MINUTE, 1) == young_min
    # Vaidya's exact optimum lies within 0.3 % of Daly's higher-order estimate on all three (9.17 min against
    # 9.14 for M = 15 min), and well below Young's first-order one.
    assert vaidya_optimum(delta, 1 / mtbf) == pytest.approx(daly(delta, mtbf), rel=3e-3)
    assert vaidya_optimum(delta, 1 / mtbf) < young(delta, mtbf)


def test_daly_past_twice_the_mtbf_is_the_mtbf() -> None:
    assert daly(3 * HOUR, HOUR) == HOUR
    assert daly(2 * HOUR, HOUR) == HOUR


def test_no_failures_or_free_checkpoints() -> None:
    assert vaidya_optimum(30.0, 0.0) == math.inf
    assert vaidya_optimum(0.0, 1e-5) == 0.0
    assert young(30.0, math.inf) == math.inf and daly(30.0, math.inf) == math.inf
    assert young(0.0, HOUR) == 0.0 and daly(0.0, HOUR) == 0.0
    assert vaidya_gamma(100.0, 7.0, 0.0) == 107.0
    assert vaidya_gamma(100.0, 7.0, 0.0, 50.0, L=30.0) == 107.0
    assert overhead_ratio(100.0, 7.0, 0.0) == pytest.approx(0.07, rel=1e-15)


# -- Γ: paper 002's chain, high precision, simulation ------------------------------------------------------


def _failure_time_given_before(lam: float, span: float, steps: int = 4000) -> float:
    """K = ∫₀^span λ t e^{-λt} dt / (1 - e^{-λ span}) by Simpson's rule (paper 002, eqs. 4 and 8)."""
    h = span / steps
    total = 0.0
    for i in range(steps + 1):
        t = i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += weight * lam * t * math.exp(-lam * t)
    return total * h / 3 / (1 - math.exp(-lam * span))


@pytest.mark.parametrize(("T", "C", "lam"), [(600.0, 30.0, 1 / DAY), (3600.0, 300.0, 1 / (6 * HOUR)), (50.0, 20.0, 1 / 100)])
def test_gamma_is_paper_002s_markov_chain_summed(T: float, C: float, lam: float) -> None:
    """Eq. 10's left side, term by term, with recovery R = C as the paper has it, equals its closed form."""
    p01 = math.exp(-lam * (T + C))
    p02 = 1 - p01
    p22 = 1 - math.exp(-lam * (T + 2 * C))
    k01, k21 = T + C, T + 2 * C
    k02 = _failure_time_given_before(lam, T + C)
    k22 = _failure_time_given_before(lam, T + 2 * C)
    chain = p01 * k01 + p02 * (k02 + p22 / (1 - p22) * k22 + k21)
    assert vaidya_gamma(T, C, lam) == pytest.approx(chain, rel=1e-9)
    assert vaidya_gamma(T, C, lam, C) == vaidya_gamma(T, C, lam)


def _gamma_decimal(T: float, C: float, lam: float, R: float, L: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 80
        d = [Decimal(v) for v in (T, C, lam, R, L)]
        T_, C_, lam_, R_, L_ = d
        return (lam_ * (R_ + L_ - C_)).exp() * ((lam_ * (T_ + C_)).exp() - 1) / lam_


@settings(max_examples=200, deadline=None)
@given(c=lam_c, C=costs, t=st.floats(min_value=1e-3, max_value=1e3), r=st.floats(0, 10), late=st.floats(0, 10))
def test_overhead_ratio_keeps_its_precision_when_small(c: float, C: float, t: float, r: float, late: float) -> None:
    """r = Γ/T - 1 against 80-digit Decimal: no cancellation even when λC is 1e-12 and r is 1e-6."""
    lam = c / C
    T, R, L = t * C, r * C, (1 + late) * C
    with localcontext() as ctx:
        ctx.prec = 80
        exact = _gamma_decimal(T, C, lam, R, L) / Decimal(T) - 1
    assert overhead_ratio(T, C, lam, R, L=L) == pytest.approx(float(exact), rel=1e-12)
    assert vaidya_gamma(T, C, lam, R, L=L) == pytest.approx(float(_gamma_decimal(T, C, lam, R, L)), rel=1e-12)


def test_gamma_with_latency_matches_a_simulated_failure_process() -> None:
    """A job that must run T + C seconds unbroken; each failure costs R and L - C of extra rework before it tries
    again. 20 000 seeded runs: the mean lands within 4 standard errors of Γ (the seed makes it repeatable)."""
    T, C, R, L, lam = 40.0, 10.0, 15.0, 25.0, 1 / 80
    rng = random.Random(19)
    samples = []
    for _ in range(20_000):
        elapsed, need = 0.0, T + C
        while True:
            failure = rng.expovariate(lam)
            if failure >= need:
                elapsed += need
                break
            elapsed += failure
            need = R + (L - C) + T + C
        samples.append(elapsed)
    mean = math.fsum(samples) / len(samples)
    stderr = math.sqrt(math.fsum((s - mean) ** 2 for s in samples) / (len(samples) - 1) / len(samples))
    assert abs(mean - vaidya_gamma(T, C, lam, R, L=L)) < 4 * stderr
    # ... and the latency is what separates it from the no-latency model by more than the noise.
    assert abs(mean - vaidya_gamma(T, C, lam, R)) > 10 * stderr


# -- the optimum -------------------------------------------------------------------------------------------


def _golden_minimum(f: Callable[[float], float], lo: float, hi: float, rounds: int = 120) -> float:
    """The argmin of a unimodal f on [lo, hi] by golden-section search on log T."""
    a, b = math.log(lo), math.log(hi)
    k = (math.sqrt(5) - 1) / 2
    x1, x2 = b - k * (b - a), a + k * (b - a)
    f1, f2 = f(math.exp(x1)), f(math.exp(x2))
    for _ in range(rounds):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - k * (b - a)
            f1 = f(math.exp(x1))
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + k * (b - a)
            f2 = f(math.exp(x2))
    return math.exp((a + b) / 2)


def _equation_error(T: float, C: float, lam: float) -> float:
    """|x - x*| / x for x = λT, from the residual g(x) = λC + x + ln(1 - x) of eq. 12 in Decimal: g' = -x/(1-x)."""
    with localcontext() as ctx:
        ctx.prec = 60 + int(-2 * math.log10(lam * T))
        x = Decimal(lam) * Decimal(T)  # exact: the product of two doubles has at most 106 bits
        g = Decimal(lam) * Decimal(C) + x + (1 - x).ln()
        return float(abs(g * (1 - x) / x / x))


@settings(max_examples=150, deadline=None)
@given(c=lam_c, C=costs)
def test_optimum_solves_the_equation_and_minimises_the_overhead(c: float, C: float) -> None:
    """Relative error below 1e-14 against eq. 12; a golden-section search on r(T) (precision ~1e-8, the
    overhead being flat at its minimum) finds the same T within 1e-6, and no nearby T does better."""
    lam = c / C
    T = vaidya_optimum(C, lam)
    assert _equation_error(T, C, lam) < 1e-14
    best = _golden_minimum(lambda t: overhead_ratio(t, C, lam), T / 100, min(1 / lam, T * 100))
    assert T == pytest.approx(best, rel=1e-6)
    r = overhead_ratio(T, C, lam)
    assert r <= overhead_ratio(best, C, lam) * (1 + 1e-12)
    assert r < overhead_ratio(T * 1.001, C, lam) and r < overhead_ratio(T / 1.001, C, lam)


@pytest.mark.parametrize("c", [1e-300, 1e-100, 1e-31, 1e-30, 1e-29, 1e-20, 1e-9, 1e-6, 0.01, 0.25, 0.5, 1.0, 5.0, 30.0, 34.9])
def test_optimum_precision_across_every_magnitude(c: float) -> None:
    """Including the ranges solved by asymptotics (λC < 1e-30) and where λT nears 1."""
    C = 100.0
    assert _equation_error(vaidya_optimum(C, c / C), C, c / C) < 1e-14


def test_optimum_saturates_at_the_mtbf_when_checkpoints_outlast_it() -> None:
    C, lam = 1000.0, 1.0
    assert vaidya_optimum(C, lam) == pytest.approx(1 / lam, rel=1e-15)
    assert vaidya_optimum(35.0, 1.0) == pytest.approx(1.0, rel=3e-16)
    assert vaidya_optimum(34.9, 1.0) == pytest.approx(1.0, rel=1e-15)
    assert vaidya_optimum(30.0, 1.0) < 1.0
    assert vaidya_optimum(1e300, 1e10) == 1e-10  # λC overflows to inf: λT = 1


@settings(max_examples=100, deadline=None)
@given(c=st.floats(min_value=-15, max_value=-2).map(lambda e: 10.0**e), C=costs)
def test_optimum_tends_to_young_for_rare_failures(c: float, C: float) -> None:
    """T_opt / Young -> 1 as λC -> 0, from below, by about sqrt(2λC)/3."""
    lam = c / C
    ratio = vaidya_optimum(C, lam) / young(C, 1 / lam)
    assert 1 - math.sqrt(2 * c) / 3 * 1.05 <= ratio <= 1 - math.sqrt(2 * c) / 3 * 0.95 + 1e-15


@settings(max_examples=60, deadline=None)
@given(c=lam_c, C=costs, r=st.floats(0, 5), late=st.floats(0, 20))
def test_latency_and_recovery_leave_the_optimum_and_raise_the_overhead(c: float, C: float, r: float, late: float) -> None:
    """Vaidya 1997: the optimum does not depend on L or R; the overhead at it grows with them."""
    lam = c / C
    T = vaidya_optimum(C, lam)
    R, L = r * C, (1 + late) * C
    best = _golden_minimum(lambda t: overhead_ratio(t, C, lam, R, L=L), T / 100, min(1 / lam, T * 100))
    assert T == pytest.approx(best, rel=1e-6)
    assert overhead_ratio(T, C, lam, R, L=L + C) > overhead_ratio(T, C, lam, R, L=L)
    assert overhead_ratio(T, C, lam, R + C, L=L) > overhead_ratio(T, C, lam, R, L=L)


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_model_refuses_odd_inputs(bad: Any) -> None:
    for call in (
        lambda: vaidya_gamma(bad, 1.0, 1e-3),
        lambda: vaidya_gamma(10.0, bad, 1e-3),
        lambda: overhead_ratio(10.0, 1.0, bad),
        lambda: overhead_ratio(10.0, 1.0, 1e-3, bad if bad is not None else -1.0),  # (None is R's default: C)
        lambda: vaidya_optimum(bad, 1e-3),
        lambda: vaidya_optimum(1.0, bad),
        lambda: young(bad, 100.0),
        lambda: daly(bad, 100.0),
    ):
        with pytest.raises(ValueError):
            call()


def test_model_refuses_latency_shorter_than_the_block_and_work_of_zero() -> None:
    with pytest.raises(ValueError, match="max"):
        overhead_ratio(100.0, 10.0, 1e-3, L=9.0)
    with pytest.raises(ValueError, match="T must be > 0"):
        overhead_ratio(0.0, 10.0, 1e-3)
    with pytest.raises(ValueError):
        young(10.0, 0.0)
    with pytest.raises(ValueError):
        vaidya_optimum(10.0, 1e-3, rel_tol=0.0)


def test_huge_exponents_give_infinity_not_an_error() -> None:
    assert vaidya_gamma(1e6, 10.0, 1.0) == math.inf
    assert overhead_ratio(1e6, 10.0, 1.0) == math.inf
    assert overhead_ratio(10.0, 10.0, 1.0, 1e6) == math.inf


# -- failure rates -----------------------------------------------------------------------------------------


def test_prior_alone_gives_the_configured_mtbf() -> None:
    rate = node_rate(0, 0.0, 30 * DAY)
    assert rate.mtbf == pytest.approx(30 * DAY, rel=1e-15)
    assert rate.lam == pytest.approx(1 / (30 * DAY), rel=1e-15)
    assert rate.basis == "prior: MTBF 30d (config)"
    assert node_rate(0, 0.0, 30 * DAY, prior_weight=5.0).mtbf == pytest.approx(30 * DAY, rel=1e-15)


def test_history_takes_over_as_it_accumulates() -> None:
    """A node that lost 500 times in 1000 days: the estimate is the history's 2 days, within the prior's pull."""
    rate = node_rate(500, 1000 * DAY, 30 * DAY)
    assert rate.mtbf == pytest.approx(2 * DAY, rel=0.03)
    assert rate.basis == "history: 500 losses in 1000d + prior 30d"
    assert node_rate(2, 5.1 * DAY, 30 * DAY).basis == "history: 2 losses in 5.1d + prior 30d"
    assert node_rate(1, 90 * MINUTE, 30 * DAY).basis == "history: 1 loss in 1.5h + prior 30d"


@given(
    losses=st.integers(0, 10_000),
    exposure=st.floats(0, 1e10),
    prior=st.floats(60, 1e9),
    weight=st.floats(0.01, 100),
)
def test_rate_lies_between_prior_and_history_and_moves_the_right_way(losses: int, exposure: float, prior: float, weight: float) -> None:
    rate = node_rate(losses, exposure, prior, weight)
    assert rate.mtbf == pytest.approx(1 / rate.lam)
    if exposure > 0 and losses > 0:
        history, low_high = losses / exposure, sorted([1 / prior, losses / exposure])
        assert low_high[0] * (1 - 1e-12) <= rate.lam <= low_high[1] * (1 + 1e-12), history
    assert node_rate(losses + 1, exposure, prior, weight).lam > rate.lam
    if losses / (weight + losses) < exposure / (weight * prior + exposure) * 0.999:  # history's rate below the estimate
        assert node_rate(losses, exposure * 2 + 1, prior, weight).lam < rate.lam


def test_a_quiet_history_lengthens_the_mtbf_past_the_prior() -> None:
    assert node_rate(0, 60 * DAY, 30 * DAY).mtbf == pytest.approx(90 * DAY)


def test_job_rate_sums_its_nodes() -> None:
    rates = [node_rate(0, 0.0, 30 * DAY)] * 8 + [node_rate(0, 0.0, 10 * DAY)]
    assert job_rate(rates) == pytest.approx(8 / (30 * DAY) + 1 / (10 * DAY), rel=1e-15)
    assert job_rate([]) == 0.0


@pytest.mark.parametrize(
    "args",
    [(-1, 0.0, DAY), (1.5, 0.0, DAY), (True, 0.0, DAY), (0, -1.0, DAY), (0, math.nan, DAY), (0, math.inf, DAY),
     (0, 0.0, 0.0), (0, 0.0, -DAY), (0, 0.0, math.inf), (0, 0.0, math.nan), (0, 0.0, DAY, 0.0), (0, 0.0, DAY, math.nan), (0, "1", DAY)],
)
def test_node_rate_refuses_odd_inputs(args: tuple) -> None:
    with pytest.raises(ValueError):
        node_rate(*args)


def test_rate_refuses_a_rate_that_is_not_one() -> None:
    with pytest.raises(ValueError):
        Rate(lam=math.nan, mtbf=1.0, basis="")
    with pytest.raises(ValueError):
        Rate(lam=-1.0, mtbf=1.0, basis="")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30d", 30 * DAY), ("12h", 12 * HOUR), ("90m", 90 * MINUTE), ("45s", 45.0), ("1.5d", 1.5 * DAY), ("3600", 3600.0),
     ("0.25", 0.25), (".5h", 1800.0), (" 2 H ", 2 * HOUR), ("7.", 7.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "-5m", "+5m", "1e3", "inf", "nan", "5w", "5ms", "1_000", "١٢", "5 m s", "1" * 65, "5d5h", "."])
def test_parse_duration_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match=r"not a duration|characters"):
        parse_duration(text)


@pytest.mark.parametrize("value", [None, 5, 5.0, b"5m"])
def test_parse_duration_wants_text(value: Any) -> None:
    with pytest.raises(ValueError, match="must be text"):
        parse_duration(value)


# -- the planner -------------------------------------------------------------------------------------------


def measured(**changes: Any) -> Measured:
    values: dict[str, Any] = {"C": 20.0, "L": 30.0, "R": 60.0, "lam": 1 / (3 * DAY), "t_iter": 2.0}
    values.update(changes)
    return Measured(**values)


def test_plan_is_vaidyas_optimum_in_iterations_with_the_formulas_beside_it() -> None:
    m = measured()
    plan = make_plan(m)
    optimum = vaidya_optimum(m.C, m.lam)
    assert plan.every_s == optimum == plan.optimum_s
    assert plan.every == round(optimum / m.t_iter)
    assert plan.young_s == young(m.C, 3 * DAY) and plan.daly_s == daly(m.C, 3 * DAY)
    assert plan.overhead == overhead_ratio(plan.every * m.t_iter, m.C, m.lam, m.R, L=m.L)
    # what the plan is for: the predicted overhead beats half and twice the interval
    assert plan.overhead < overhead_ratio(plan.every_s / 2, m.C, m.lam, m.R, L=m.L)
    assert plan.overhead < overhead_ratio(plan.every_s * 2, m.C, m.lam, m.R, L=m.L)


def test_plan_clamps_and_never_plans_fewer_than_one_iteration() -> None:
    no_failures = make_plan(measured(lam=0.0), max_s=7200.0)
    assert no_failures.every_s == 7200.0 and no_failures.every == 3600
    assert no_failures.optimum_s == math.inf and no_failures.young_s == math.inf
    cheap = make_plan(measured(C=1e-6, L=1e-6), min_s=5.0)
    assert cheap.every_s == 5.0 and cheap.every == 2  # round(5 / 2) (banker's rounding: 2.5 -> 2)
    long_iterations = make_plan(measured(t_iter=10 * DAY))
    assert long_iterations.every == 1
    assert long_iterations.overhead == overhead_ratio(10 * DAY, 20.0, 1 / (3 * DAY), 60.0, L=30.0)
    with pytest.raises(ValueError, match="above"):
        make_plan(measured(), min_s=10.0, max_s=5.0)


def test_slow_protection_does_not_stretch_the_plan() -> None:
    """Protection slower than the optimum: the plan stays at the optimum (gangd begins the next checkpoint
    while the previous one's redundancy is still written; bench/interval.py's simulation of that found the
    L - C floor 6 % slower), and the latency shows in the predicted overhead, not in the interval."""
    m = measured(C=5.0, L=5.0 + 4 * HOUR, lam=1 / DAY, t_iter=1.0)
    plan = make_plan(m)
    assert plan.every_s == pytest.approx(vaidya_optimum(m.C, m.lam)) and plan.every_s < 4 * HOUR
    quick = make_plan(measured(C=5.0, L=5.0, lam=1 / DAY, t_iter=1.0))
    assert plan.every == quick.every and plan.overhead > quick.overhead


def test_cheaper_checkpoints_or_a_higher_rate_shorten_the_plan() -> None:
    base = make_plan(measured())
    assert make_plan(measured(C=2.0, L=3.0)).every < base.every  # incremental: a tenth of the cost
    assert make_plan(measured(lam=10 / (3 * DAY))).every < base.every  # a node's λ rose


def test_plan_goes_on_the_wire_as_plain_json() -> None:
    m = Measured(C=20.0, L=20.0, R=5.0, lam=0.0, t_iter=1.0, basis={"lam": "prior: MTBF 30d (config)"}, node_loss_survivable=False)
    wire = make_plan(m).to_wire()
    back = json.loads(json.dumps(wire, allow_nan=False))
    assert back == wire
    assert wire["young_s"] is None and wire["daly_s"] is None and wire["optimum_s"] is None
    assert wire["every"] == 86400 and wire["every_s"] == 86400.0
    assert wire["inputs"] == {"C": 20.0, "L": 20.0, "R": 5.0, "lam": 0.0, "t_iter": 1.0,
                              "basis": {"lam": "prior: MTBF 30d (config)"}, "node_loss_survivable": False}
    assert isinstance(make_plan(measured()), Plan)


@pytest.mark.parametrize(
    "changes",
    [{"C": -1.0}, {"C": math.nan}, {"lam": math.inf}, {"t_iter": 0.0}, {"t_iter": -1.0}, {"R": math.nan}, {"L": 10.0}, {"lam": True}],
)
def test_measured_refuses_what_cannot_be_measured(changes: dict) -> None:
    with pytest.raises(ValueError):
        measured(**changes)


@settings(max_examples=200)
@given(
    name=st.sampled_from(["C", "R", "L", "lam", "t_iter"]),
    threshold=st.floats(0.01, 2.0),
    margin=st.floats(0.0, 0.99),
    up=st.booleans(),
)
def test_moved_is_a_relative_threshold_either_way(name: str, threshold: float, margin: float, up: bool) -> None:
    old = measured(L=1000.0)  # (far enough above C that moving either keeps L ≥ C)
    base = getattr(old, name)
    inside = (1 + threshold * margin) if up else 1 / (1 + threshold * margin)
    outside = (1 + threshold * 1.01) if up else 1 / (1 + threshold * 1.01)
    assert not moved(old, measured(**{"L": 1000.0, name: base * inside}), threshold)
    assert moved(old, measured(**{"L": 1000.0, name: base * outside}), threshold)


def test_moved_from_and_to_zero() -> None:
    assert moved(measured(lam=0.0), measured(lam=1e-12), 10.0)
    assert moved(measured(lam=1e-12), measured(lam=0.0), 10.0)
    assert not moved(measured(lam=0.0), measured(lam=0.0), 0.0)
    assert not moved(measured(), measured(), 0.0)
    assert moved(measured(R=0.0), measured(R=1e-9), 0.5)
    survivable = measured()
    local = Measured(C=survivable.C, L=survivable.L, R=survivable.R, lam=survivable.lam, t_iter=survivable.t_iter, node_loss_survivable=False)
    assert moved(survivable, local, 100.0)
    with pytest.raises(ValueError):
        moved(measured(), measured(), math.nan)


@given(
    last=st.one_of(st.none(), st.integers(0, 10**6)),
    ahead=st.integers(0, 10**6),
    every=st.integers(1, 10**5),
    lead=st.integers(0, 10**4),
)
def test_next_at_is_never_one_a_rank_may_have_passed(last: int | None, ahead: int, every: int, lead: int) -> None:
    current = (last or 0) + ahead
    at = next_at(last, current, every, lead)
    assert at > current + lead
    planned = (current if last is None else last) + every
    assert at >= planned  # never earlier than the interval asks
    if planned > current + lead:
        assert at == planned  # and on it whenever it can still be reached
    else:
        assert at == current + lead + 1  # late, not skipped: the first reachable iteration


def test_next_at_examples() -> None:
    assert next_at(None, 0, 50, 3) == 50
    assert next_at(100, 120, 50, 3) == 150
    assert next_at(100, 149, 50, 3) == 153  # one iteration ran long: the plan would already be past
    assert next_at(100, 400, 50, 0) == 401  # far past (a very long iteration): the next one, not a skipped grid
    bads: list[tuple[Any, ...]] = [(None, -1, 5, 1), (0, 0, 0, 1), (0, 0, 5, -1), (-1, 0, 5, 1), (None, 0, True, 1), (None, 0.5, 5, 1)]
    for bad in bads:
        with pytest.raises(ValueError):
            next_at(*bad)


@given(t_iter=st.floats(1e-12, 1e6), rtt=st.floats(0, 10))
def test_lead_covers_the_round_trip_within_bounds(t_iter: float, rtt: float) -> None:
    lead = lead_for(t_iter, rtt)
    assert 1 <= lead <= LEAD_MAX
    if lead < LEAD_MAX:
        assert lead * t_iter >= rtt * (1 - 1e-12)  # the plan reaches every rank before any passes it
        assert lead == 1 or (lead - 1) * t_iter < rtt  # and asks no further ahead than that


def test_lead_examples_and_odd_inputs() -> None:
    assert lead_for(1.0) == 1
    assert lead_for(0.01, 0.05) == 5
    assert lead_for(1e-9, 1.0) == LEAD_MAX
    for bad in [(0.0, 0.05), (-1.0, 0.05), (math.nan, 0.05), (1.0, math.inf), (1.0, -0.1)]:
        with pytest.raises(ValueError):
            lead_for(*bad)


def test_smoother_follows_a_lasting_change_and_damps_one_outlier() -> None:
    s = Smoother(alpha=0.25)
    assert s.value is None
    for _ in range(20):
        s.add(10.0)
    assert s.value == pytest.approx(10.0)
    assert s.add(50.0) == pytest.approx(20.0)  # one slow checkpoint: a quarter of its excess
    for _ in range(40):
        s.add(2.0)
    assert s.value == pytest.approx(2.0, rel=1e-3)
    assert s.count == 61
    with pytest.raises(ValueError):
        s.add(math.nan)
    with pytest.raises(ValueError):
        s.add(-1.0)
    with pytest.raises(ValueError):
        Smoother(alpha=0.0)
