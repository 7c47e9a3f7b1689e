"""--ckpt-every auto (issue 19): is the planned interval the best one, and does a job pay what the plan predicts?

Two parts (``--parts``, default both), every ratio against a baseline measured in the same run:

  model    no cluster, CPU only, seconds. A job of W seconds of work checkpoints every T seconds of
           compute; each checkpoint blocks it C seconds and becomes usable L >= C seconds after it
           began (a failure within L of a checkpoint's start rolls back past it, to the newest usable
           one); failures are exponential at rate λ (seeded numpy RNG), and each costs a restart R
           (a failure during the restart starts it again). Simulated literally, failure by failure,
           ``--runs`` jobs per interval (vectorised over the runs), for T = T_opt (gangd's own
           ``gangd.interval.planner.make_plan``, i.e. ``vaidya_optimum`` raised to L - C), T_opt x
           1/4, 1/2, 2, 4, Young's sqrt(2CM), Daly's, and "fixed 5 min", a guess a user might type.
           Every interval sees the same failure stream (common random numbers: run i's k-th failure
           is the same draw for every T), so the ratios against T_opt are paired and their noise
           small. Printed per interval: mean makespan, its standard error, the overhead r =
           makespan/W - 1 simulated, the model's r for this very job (Vaidya's expectation summed
           over its intervals, first and last included: ``job r``) and the model's steady-state
           ``overhead_ratio(T)`` (what ``gang ckpt plan`` predicts), the ratio of mean makespans
           against T_opt's and the paired z of the difference (huge where T is within a few % of T_opt:
           the same failures then give nearly the same makespans, and the ratio is the figure). W is
           200.5 x T_opt: long, so that the first and the last interval move r little, and not a whole
           number of T_opt's intervals, which would spare T_opt alone the last checkpoint (a ratio of
           1 + C/makespan in its favour, as large as Daly's whole difference from it). The figures
           that matter: T_opt's makespan is at most every other interval's within noise (z > -2),
           and the simulated r is the model's (|sim - job r| within ~2 standard errors).
  cluster  a local cluster (``gangd.client.cluster.up``: 2 daemons, 2 cores each, the MTBF prior
           ``--mtbf`` per node, so that the planned interval is seconds rather than a real cluster's
           hours) runs tests/interval_app.py (2 ranks, one per node, ``--steps`` iterations of 20 ms,
           ``--mib`` MiB of state per rank, ``--ckpt-mode full`` so that every checkpoint costs the
           same, written inline -- GANGD_CKPT_BACKGROUND=0 -- so that a checkpoint's cost is time
           the ranks are blocked, which the planner measures as C) three ways, alternating order,
           ``--repeats`` times:
             base   no checkpoints (the baseline);
             auto   ``--ckpt-every auto``;
             fixed  ``--ckpt-every`` 10x shorter than the plan the first auto run showed (at least
                    1 s, gangd's smallest period: the ratio actually used is printed).
           Per kind: the job's wall time (its record's started -> ended: each rank's start-up is in
           it, the same for all three) and its ratio against base; the checkpoints taken; the
           measured overhead (kind/base - 1, no failures in the run) against what the model
           predicts with no failure (the checkpoints taken x their mean blocked time -- what the
           planner calls C -- / base's wall time; for auto the plan's steady-state C/T too) and the
           plan's predicted overhead r with failures (``gang ckpt plan --json``'s ``overhead``).
           An auto job takes its first checkpoint as soon as it can (that is how gangd measures C)
           and then one every T: a job a few intervals long pays more than C/T. For auto, how far
           each planned generation's cut is from its ``planned_at`` (0 expected), and the
           planner's C against the times ``gang ckpt stats --json`` lists for the newest usable
           generations before the plan was made (at most 3: as many as its basis says, gangd's
           retention may have removed older ones by then), the slowest node's of each: BLOCKED, and
           WRITE + SYNC (at most BLOCKED: the time blocked saving, without the wait for the other
           node's ranks), which the planner has averaged as C since 4f0c362 (equal expected).

The clusters are brought down on the way out, Ctrl-C included. The load average is printed before
and after: the machine is shared, and wall times on it are noisy.

    python bench/interval.py [--quick] [--parts model,cluster] [--runs 5000] [--repeats 2] [--steps 1000]
                             [--mib 24] [--mtbf 200] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gangd.interval.model import daly, overhead_ratio, vaidya_gamma, young
from gangd.interval.planner import Measured, make_plan

PY = sys.executable
APP = str(Path(__file__).resolve().parent.parent / "tests" / "interval_app.py")
TERMINAL = ("DONE", "FAILED", "KILLED")
MIN, HOUR = 60.0, 3600.0


# ---------------------------------------------------------------- part 1: the model against a simulation


@dataclass(frozen=True)
class Case:
    name: str
    C: float  # s a checkpoint blocks the job
    mtbf: float  # s, the job's (its nodes' rates summed)
    R: float  # s a restart costs
    L: float  # s from a checkpoint's start until it is usable (>= C)


CASES = (
    Case("Daly 2006, M = 24 h", 5 * MIN, 24 * HOUR, 10 * MIN, 5 * MIN),
    Case("Daly 2006, M = 6 h", 5 * MIN, 6 * HOUR, 10 * MIN, 5 * MIN),
    Case("Daly 2006, M = 15 min", 5 * MIN, 15 * MIN, 10 * MIN, 5 * MIN),
    # Paper 002's model: R = C (a restart transfers the checkpoint), L = C. The paper gives no numbers:
    # 64 nodes of a 30-day MTBF each (a job MTBF of 11.25 h), a 2-minute checkpoint.
    Case("paper 002 (R = C), 64 nodes x 30 d", 2 * MIN, 30 * 86400 / 64, 2 * MIN, 2 * MIN),
    # gangd with partner redundancy: the ranks blocked 20 s, the generation protected 3 min after it began.
    Case("latency: C 20 s, L 3 min, R 5 min, M 2 h", 20.0, 2 * HOUR, 5 * MIN, 3 * MIN),
    # A protection slower than the optimum: the planner raises T to L - C (the model needs T + C >= L); shorter
    # intervals put several checkpoints in flight, which the simulation allows and the model does not.
    Case("latency > optimum: C 20 s, L 30 min, R 5 min, M 2 h", 20.0, 2 * HOUR, 5 * MIN, 30 * MIN),
)


def simulate(W: float, T: float, C: float, L: float, R: float, lam: float, runs: int, seed: int) -> np.ndarray:
    """Makespans of ``runs`` jobs of W s of work checkpointing every T s of compute, simulated failure by failure.

    From a restart at checkpoint j (progress jT; j = 0 is the job's start, which costs no restart), the
    failure-free schedule is deterministic: ``rec`` (R after a failure, 0 at the start), then compute,
    checkpoint m > j beginning at rec + (m-j)T + (m-j-1)C and usable L later, the job done at
    rec + (W - jT) + (M - j)C (M checkpoints, none after the last piece of work). The next failure,
    x after the restart, either comes after that end (the job is done) or sends the run back to the
    newest checkpoint usable at x. Draw k of every loop is run i's k-th failure whatever T is
    (common random numbers: the intervals are compared on the same failures).
    """
    M = max(0, math.ceil(W / T - 1e-12) - 1)
    rng = np.random.default_rng(seed)
    j = np.zeros(runs)
    rec = np.zeros(runs)
    total = np.zeros(runs)
    active = np.ones(runs, dtype=bool)
    for _ in range(10_000_000):
        if not active.any():
            return total
        x = rng.exponential(1 / lam, size=runs)
        end = rec + (W - j * T) + (M - j) * C
        done = active & (x >= end)
        fail = active & ~done
        total[done] += end[done]
        total[fail] += x[fail]
        k = np.minimum(np.maximum(np.floor((x - rec - L + C) / (T + C)), 0.0), M - j)
        j[fail] += k[fail]
        rec[fail] = R
        active = fail
    raise RuntimeError("simulation did not end")


def expected_makespan(W: float, T: float, C: float, L: float, R: float, lam: float) -> float | None:
    """The model's expected makespan of this very job (None where it does not apply: T + C < L).

    Vaidya's argument, exact for the simulated job: between two moments a checkpoint becomes usable,
    the job needs d failure-free seconds; a failure there costs the time lost, the restart R and the
    re-execution of the L - C seconds of work done between that checkpoint's end and it becoming
    usable (none before the first: the job's start is usable at once), each restarted by a failure
    -- so ``λ⁻¹ e^{λ·rho} (e^{λd} - 1)`` with rho = R (+ L - C). A full interval's is gangd's
    ``vaidya_gamma(T, C, λ, R, L)`` (checked below); the first's and the last's are shorter or longer.
    """
    if T + C < L:
        return None
    M = max(0, math.ceil(W / T - 1e-12) - 1)
    end = W + M * C
    usable = [m * T + (m - 1) * C + L for m in range(1, M + 1)]
    bounds = [0.0, *[u for u in usable if u < end], end]
    total = 0.0
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        rho = R if i == 0 else R + L - C
        unit = math.exp(lam * rho) * math.expm1(lam * (b - a)) / lam
        if 0 < i < len(bounds) - 2:  # (a full interval: the model's Γ)
            gamma = vaidya_gamma(T, C, lam, R, L=L)
            assert math.isclose(unit, gamma, rel_tol=1e-9), (unit, gamma)
        total += unit
    return total


def span(seconds: float) -> str:
    if seconds >= 2 * HOUR:
        return f"{seconds / HOUR:.2f} h"
    if seconds >= 2 * MIN:
        return f"{seconds / MIN:.1f} min"
    return f"{seconds:.1f} s"


def model_case(case: Case, runs: int, seed: int) -> dict:
    lam = 1 / case.mtbf
    plan = make_plan(Measured(C=case.C, L=case.L, R=case.R, lam=lam, t_iter=1e-3), min_s=0.0, max_s=1e12)
    t_opt = plan.every_s
    W = 200.5 * t_opt  # (not a whole number of T_opt's intervals: see the module docstring)
    intervals = [("T_opt (gangd)", t_opt), ("T_opt x 1/4", t_opt / 4), ("T_opt x 1/2", t_opt / 2), ("T_opt x 2", 2 * t_opt),
                 ("T_opt x 4", 4 * t_opt), ("Young", young(case.C, case.mtbf)), ("Daly", daly(case.C, case.mtbf)), ("fixed 5 min", 5 * MIN)]
    base = simulate(W, t_opt, case.C, case.L, case.R, lam, runs, seed)
    rows = []
    for name, T in intervals:
        spans = base if name.startswith("T_opt (") else simulate(W, T, case.C, case.L, case.R, lam, runs, seed)
        mean = float(spans.mean())
        se = float(spans.std(ddof=1) / math.sqrt(runs))
        diff = spans - base
        sd = float(diff.std(ddof=1))
        z = float(diff.mean() / (sd / math.sqrt(runs))) if sd > 0 else 0.0
        job = expected_makespan(W, T, case.C, case.L, case.R, lam)
        rows.append({
            "interval": name, "T": T, "mean": mean, "se": se, "r_sim": mean / W - 1, "r_se": se / W,
            "r_job": None if job is None else job / W - 1, "r_model": overhead_ratio(T, case.C, lam, case.R, L=case.L),
            "ratio": mean / float(base.mean()), "z": z,
        })
    return {"case": case.name, "C": case.C, "mtbf": case.mtbf, "R": case.R, "L": case.L, "W": W, "runs": runs,
            "T_opt": t_opt, "optimum_s": plan.optimum_s, "plan_overhead": plan.overhead, "rows": rows}


def print_model(results: list[dict]) -> None:
    print("== model: Vaidya's optimum (gangd.interval.make_plan) against other intervals, simulated ==")
    print("r = makespan/W - 1; 'job r' the model's expectation for this job, 'model r' its steady state overhead_ratio(T);")
    print("ratio = mean makespan / T_opt's (same failures: z is the paired difference over its standard error)")
    for res in results:
        print()
        print(f"{res['case']}: C {span(res['C'])}, L {span(res['L'])}, R {span(res['R'])}, MTBF {span(res['mtbf'])}, "
              f"W {span(res['W'])} (200.5 T_opt), {res['runs']} runs; T_opt {span(res['T_opt'])}")
        print(f"  {'interval':14} {'T':>10} {'makespan':>11} {'± se':>9} {'r sim':>8} {'± se':>7} {'job r':>8} {'model r':>8} {'ratio':>7} {'z':>7}")
        for row in res["rows"]:
            job = "-" if row["r_job"] is None else f"{row['r_job']:.4f}"
            print(f"  {row['interval']:14} {span(row['T']):>10} {span(row['mean']):>11} {span(row['se']):>9} {row['r_sim']:8.4f} {row['r_se']:7.4f} "
                  f"{job:>8} {row['r_model']:8.4f} {row['ratio']:7.4f} {row['z']:7.1f}")
        worst = min(res["rows"][1:], key=lambda r: r["z"])
        opt = res["rows"][0]
        dev = (opt["r_sim"] - opt["r_job"]) / opt["r_se"] if opt["r_job"] is not None and opt["r_se"] > 0 else float("nan")
        lowest = "yes" if worst["z"] > -2 else "NO"
        print(f"  T_opt lowest within noise: {lowest} (smallest z {worst['z']:.1f}, {worst['interval']}); "
              f"T_opt's r simulated {opt['r_sim']:.4f} ± {opt['r_se']:.4f}, model for this job {opt['r_job']:.4f} ({dev:+.1f} se), "
              f"steady state (gang ckpt plan's) {res['plan_overhead']:.4f}")
        if res["T_opt"] > res["optimum_s"] * (1 + 1e-9):
            print(f"  (T_opt here is the planner's floor L - C, above Vaidya's optimum {span(res['optimum_s'])}: shorter intervals put "
                  "several checkpoints in flight, which the simulation allows and the model, 'job r' '-', does not)")


# ---------------------------------------------------------------- part 2: a real local cluster


def _gang(directory: Path, *args, env: dict | None = None, timeout: float = 60) -> str:
    cmd = [PY, "-m", "gangd.client.cli", "--cluster", str(directory), *map(str, args)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    if result.returncode != 0:
        raise SystemExit(f"gang {' '.join(map(str, args))} failed: {result.stderr.strip()}")
    return result.stdout


def _plain(value):
    """The client's answer as `gang ... --json` prints it (plain JSON types)."""
    return json.loads(json.dumps(value, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)))


def run_job(directory: Path, kind: str, every: float | None, steps: int, mib: float, background: bool) -> dict:
    """Submit one job of interval_app.py, follow it (a look a second, in this process, the same for every kind)."""
    import trio

    from gangd.client.api import connect

    options = {"base": [], "auto": ["--ckpt-every", "auto"], "fixed": ["--ckpt-every", f"{every or 0:g}"]}[kind]
    env = dict(os.environ)
    if not background:
        env["GANGD_CKPT_BACKGROUND"] = "0"
    job = int(_gang(directory, "submit", "-n", 2, "--per-node", 1, "--ckpt-mode", "full", *options, "--",
                    PY, APP, "--steps", steps, "--sleep", 0.02, "--jitter", 0, "--mib", mib, env=env))

    async def follow() -> tuple[dict, list[dict], list[dict]]:
        plans: list[dict] = []
        deadline = time.monotonic() + 30 + steps * 0.2
        async with connect(directory) as gang:
            while True:
                record = await gang.job(job)
                if record["state"] in TERMINAL:
                    return _plain(record), _plain((await gang.checkpoints(job))["generations"]), plans
                plan = _plain(await gang.interval_plan(job))
                if plan.get("next") is not None and (not plans or plans[-1]["made"] != plan.get("made")):
                    plans.append(plan)
                if time.monotonic() > deadline:
                    raise SystemExit(f"job {job} ({kind}) did not end in {deadline:.0f} s")
                await trio.sleep(1.0)

    record, gens, plans = trio.run(follow)
    if record["state"] != "DONE":
        raise SystemExit(f"job {job} ({kind}) ended {record['state']}: {record.get('reason')}")
    # Every generation the job took: the older ones are "removed" by the time it ends (gangd keeps the last few).
    taken = [g for g in gens if g.get("state") in ("complete", "protected", "removed") and g.get("nodes")]
    timeline = [{"gen": g["gen"], "at": round(g["started"] - record["started"], 3), "blocked": round(blocked(g), 4),
                 "latency": round(g["ended"] - g["started"], 4), "iteration": g.get("iteration"), "trigger": g.get("trigger")} for g in taken]
    return {"kind": kind, "job": job, "every": every, "wall": record["ended"] - record["started"], "checkpoints": len(taken),
            "generations": taken, "plans": plans, "timeline": timeline, "cpu": [r.get("cpu") for r in record.get("ranks") or []]}


def blocked(g: dict) -> float:
    """The generation's cost to the job: its slowest node's blocked time, as ``gang ckpt stats --json`` lists it."""
    return max(float(n["blocked"]) for n in g["nodes"].values())


def saving(g: dict) -> float:
    """The slowest node's time blocked *saving*: WRITE + SYNC of ``gang ckpt stats`` (at most BLOCKED), the wait
    for the other nodes' ranks left out -- what the planner takes as C since 4f0c362."""
    times = []
    for n in g["nodes"].values():
        write, sync = n.get("write"), n.get("sync_overhead")
        both = isinstance(write, int | float) and isinstance(sync, int | float)
        times.append(min(float(write) + float(sync), float(n["blocked"])) if both else float(n["blocked"]))
    return max(times)


def cluster_part(args, repeats: int, steps: int) -> dict:
    from gangd.client import cluster as local

    base = Path(tempfile.mkdtemp(prefix="gangd-bench-interval-"))
    os.chmod(base, 0o755)  # noqa: S103 -- traversable: the job runs as its submitter
    directory = base / "cluster"
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    runs: list[dict] = []
    fixed_every: float | None = None
    try:
        local.up(directory, 2, cores=2, mtbf=args.mtbf)
        # A warm-up job, not measured: the first job on a fresh cluster pays for cold caches (whichever kind it is).
        run_job(directory, "base", None, 20, args.mib, args.background)
        for r in range(repeats):
            order = ("auto", "base", "fixed") if r % 2 == 0 else ("fixed", "base", "auto")
            for kind in order:
                run = run_job(directory, kind, fixed_every if kind == "fixed" else None, steps, args.mib, args.background)
                run["repeat"] = r
                runs.append(run)
                print(f"  repeat {r}: {kind:5} job {run['job']}: {run['wall']:.2f} s, {run['checkpoints']} checkpoint(s)", file=sys.stderr, flush=True)
                if kind == "auto" and fixed_every is None:  # (repeat 0 runs auto first: its plan sets fixed's period)
                    if not run["plans"]:
                        raise SystemExit("the auto job showed no plan: make --steps longer")
                    fixed_every = max(1.0, round(run["plans"][-1]["every_s"] / 10, 1))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a second Ctrl-C must not stop the cleaning up)
        with contextlib.suppress(Exception):
            for line in _kill_left(directory):
                print(line, file=sys.stderr)
        with contextlib.suppress(Exception):
            local.down(directory)
        subprocess.run(["rm", "-rf", str(base)], check=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
    return summarise(runs, fixed_every)


def _kill_left(directory: Path) -> list[str]:
    """Kill the bench's jobs still alive (interrupted)."""
    if not (directory / "cluster.toml").exists() and not any(directory.glob("*")):
        return []
    out = subprocess.run([PY, "-m", "gangd.client.cli", "--cluster", str(directory), "ps", "--json"], capture_output=True, text=True, timeout=30, check=False)
    said = []
    with contextlib.suppress(ValueError):
        for record in json.loads(out.stdout or "[]"):
            if record.get("state") not in TERMINAL:
                subprocess.run([PY, "-m", "gangd.client.cli", "--cluster", str(directory), "kill", str(record["id"])],
                               capture_output=True, timeout=30, check=False)
                said.append(f"killed job {record['id']}")
    return said


def summarise(runs: list[dict], fixed_every: float | None) -> dict:
    kinds = ("base", "auto", "fixed")
    wall = {k: statistics.median(r["wall"] for r in runs if r["kind"] == k) for k in kinds if any(r["kind"] == k for r in runs)}
    pairs = {k: [r["wall"] / b["wall"] for r in runs if r["kind"] == k for b in runs if b["kind"] == "base" and b["repeat"] == r["repeat"]]
             for k in ("auto", "fixed")}
    autos = [r for r in runs if r["kind"] == "auto"]
    last_plan = autos[-1]["plans"][-1] if autos and autos[-1]["plans"] else None
    out: dict = {"wall": wall, "paired_ratios": pairs, "fixed_every": fixed_every, "runs": [], "plan": last_plan}
    for r in runs:
        out["runs"].append({k: r[k] for k in ("kind", "repeat", "job", "wall", "checkpoints", "every", "timeline", "cpu")})
    # Planned generations: the cut against the iteration the plan named; the planner's C against the blocked times.
    offsets, c_checks = [], []
    for r in autos:
        for g in r["generations"]:
            if str(g.get("trigger", "")).startswith("planned interval") and isinstance(g.get("planned_at"), int):
                offsets.append(g["iteration"] - g["planned_at"])
        for plan in r["plans"]:
            # The planner averages the newest usable generations (at most 3; gangd's retention may have
            # removed older ones by then): as many as its basis says, the newest that ended before the plan.
            counted = re.search(r"last (\d+) checkpoint", plan["inputs"]["basis"].get("C", ""))
            before = [g for g in r["generations"] if isinstance(g.get("ended"), int | float) and g["ended"] <= plan["made"]]
            if before and counted:
                newest = before[-int(counted.group(1)):]
                stats = [blocked(g) for g in newest]
                saved = [saving(g) for g in newest]
                c_checks.append({"job": r["job"], "plan_C": plan["inputs"]["C"], "stats_blocked": stats, "stats_mean": sum(stats) / len(stats),
                                 "stats_saving": saved, "saving_mean": sum(saved) / len(saved), "basis": plan["inputs"]["basis"]["C"]})
    out["cut_offsets"] = offsets
    out["c_checks"] = c_checks
    # Predicted overhead without failures: the checkpoints taken x C / the baseline's wall time.
    per_kind = {}
    for k in ("auto", "fixed"):
        mine = [r for r in runs if r["kind"] == k]
        if not mine or "base" not in wall:
            continue
        n = statistics.median(r["checkpoints"] for r in mine)
        costs = [blocked(g) for r in mine for g in r["generations"]]
        c = statistics.mean(costs) if costs else 0.0
        per_kind[k] = {"checkpoints": n, "C_mean": c, "measured": wall[k] / wall["base"] - 1, "predicted_no_failure": n * c / wall["base"],
                       "unexplained_s": wall[k] - wall["base"] - n * c}
    out["overhead"] = per_kind
    return out


def print_cluster(res: dict, args, steps: int, repeats: int) -> None:
    print()
    print(f"== cluster: 2 nodes x 2 cores, MTBF prior {args.mtbf:g} s per node; interval_app.py, 2 ranks x {args.mib:g} MiB, "
          f"{steps} x 20 ms, --ckpt-mode full, {'forked' if args.background else 'inline'} writes; {repeats} repeat(s), alternating ==")
    plan = res["plan"]
    if plan:
        m = plan["inputs"]
        print(f"plan (last auto run): every {plan['every']} iterations = {plan['every_s']:.2f} s (Young {plan['young_s']:.2f}, Daly {plan['daly_s']:.2f}); "
              f"C {m['C']:.3f} s, L {m['L']:.3f} s, R {m['R']:.3f} s, λ {m['lam']:.3g}/s, t_iter {m['t_iter'] * 1000:.2f} ms; "
              f"predicted overhead r {plan['overhead']:.4f} (with failures), C/T {m['C'] / plan['every_s']:.4f} (without)")
    if res["fixed_every"] is not None and plan:
        print(f"fixed: --ckpt-every {res['fixed_every']:g} s = plan / {plan['every_s'] / res['fixed_every']:.1f}")
    wall = res["wall"]
    print(f"  {'kind':6} {'wall s':>8} {'x base':>7} {'paired x base':>22} {'ckpts':>6} {'blk s':>7} {'overhead measured':>18} {'predicted (no failure)':>23}"
          f" {'unexplained s':>14}")
    for k in ("base", "auto", "fixed"):
        if k not in wall:
            continue
        o = res["overhead"].get(k)
        pairs = ", ".join(f"{x:.3f}" for x in res["paired_ratios"].get(k, [])) or "-"
        if o:
            extra = f"{o['checkpoints']:6g} {o['C_mean']:7.3f} {o['measured']:18.4f} {o['predicted_no_failure']:23.4f} {o['unexplained_s']:14.2f}"
        else:
            extra = f"{0:6d} {'-':>7} {'-':>18} {'-':>23} {'-':>14}"
        print(f"  {k:6} {wall[k]:8.2f} {wall[k] / wall['base']:7.3f} {pairs:>22} {extra}")
    offsets = res["cut_offsets"]
    print(f"planned generations' cut - planned_at: {offsets} (max |offset| {max(map(abs, offsets), default=0)})")
    for c in res["c_checks"]:
        print(f"  job {c['job']}: planner C {c['plan_C']:.4f} s ({c['basis']}); ckpt stats of the newest before the plan (slowest node): "
              f"BLOCKED {[round(x, 4) for x in c['stats_blocked']]} mean {c['stats_mean']:.4f} s (C/it {c['plan_C'] / c['stats_mean']:.4f}), "
              f"WRITE+SYNC {[round(x, 4) for x in c['stats_saving']]} mean {c['saving_mean']:.4f} s (C/it {c['plan_C'] / c['saving_mean']:.4f})")
    walls = sorted(r["wall"] for r in res["runs"] if r["kind"] == "base")
    if len(walls) > 1:
        print(f"noise: base's wall times {', '.join(f'{w:.2f}' for w in walls)} s (spread {(walls[-1] - walls[0]) / walls[0] * 100:.1f} %)")
    print("blk s: the mean BLOCKED (slowest node) of the kind's checkpoints; predicted (no failure): ckpts x blk s / base's wall;")
    print("unexplained s: kind's wall - base's - ckpts x blk s (time the job lost that is not its checkpoints' blocked time)")
    print("caveat: one 2-core machine shared with other work; the wall times include each job's start-up (the same for every kind).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs, one repeat, shorter jobs (under a minute)")
    parser.add_argument("--parts", default="model,cluster")
    parser.add_argument("--runs", type=int, default=None, help="simulated jobs per interval (default 5000, quick 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="runs of each kind on the cluster (default 2, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="iterations of 20 ms per job (default 1000, quick 400)")
    parser.add_argument("--mib", type=float, default=24, help="state per rank (MiB)")
    parser.add_argument("--mtbf", type=float, default=200, help="the cluster's MTBF prior per node (s)")
    parser.add_argument("--background", action="store_true", help="forked-snapshot writes (the default in gangd; C is then milliseconds)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    runs = args.runs or (1000 if args.quick else 5000)
    repeats = args.repeats or (1 if args.quick else 2)
    steps = args.steps or (400 if args.quick else 1000)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", file=sys.stderr if args.json else sys.stdout, flush=True)
    out: dict = {"load_before": load}
    if "model" in parts:
        t0 = time.process_time()
        out["model"] = [model_case(case, runs, args.seed) for case in CASES]
        out["model_cpu_s"] = time.process_time() - t0
        if not args.json:
            print_model(out["model"])
            print(f"(model part: {out['model_cpu_s']:.1f} s CPU)")
    if "cluster" in parts:
        out["cluster"] = cluster_part(args, repeats, steps)
        if not args.json:
            print_cluster(out["cluster"], args, steps, repeats)
    load = os.getloadavg()
    out["load_after"] = load
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    else:
        print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def interrupted(exc: BaseException) -> bool:
    """A Ctrl-C, raised as is or inside trio's exception group."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and all(interrupted(e) for e in exc.exceptions)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:
        if not interrupted(exc):
            raise
        print("interrupted: the cluster was brought down", file=sys.stderr)
        sys.exit(130)
