"""``--ckpt-every auto``: the coordinator's interval planner (issue 19, paper 002).

Paper 002 runs an interval-optimisation server beside the job: it hears the
job's time per iteration and checkpoint cost, sums the failure rates of the
hosts the job uses, and tells every rank "checkpoint at iteration n, then
every m" — no global stop — recomputing only when the measurements move.
This is that server, one task per planned job in the coordinator's term (it
ends with the job, or with the term: the next coordinator starts its own).

What it measures, and where from (each figure's *basis* is shown by
``gang ckpt plan``):

* **C**, the overhead a checkpoint costs the job: the time its ranks were
  blocked (``blocked`` of the slowest node; a forked snapshot blocks for
  milliseconds of a write that lasts seconds), the mean of the lineage's
  last :data:`RECENT` generations — so incremental generations that cost
  less move the plan (the first, a full base, costs more than the deltas).
* **L**, the latency until a generation is *usable after a node loss*:
  begin → complete, plus the redundancy write for partner/xor (a node loss
  needs a protected generation; with ``local`` it needs the node back).
* **R**, the restart cost: measured when the lineage was restarted
  (submitted → every rank restored), else estimated as this job's start-up
  plus reading its state at the bandwidth its checkpoints were written at.
* **λ**, the job's failure rate: the sum over its nodes of each node's rate
  from its lives in etcd (:class:`gangd.daemon.store.NodeLog`), with the
  configured MTBF as the prior until the history says enough
  (:func:`gangd.interval.rates.node_rate`).
* **t_iter**, seconds of computation per iteration, checkpoints excluded:
  the slowest rank's, from the progress reports its node keeps
  (:mod:`gangd.ckptlib.pace`).

The plan itself (Vaidya's optimum, Young's and Daly's beside it) is
:func:`gangd.interval.planner.make_plan`; the ranks follow it on their own
(:mod:`gangd.checkpoint.rank`: they ask ``lead`` iterations early, and the
generation's ``at`` keeps every rank to the planned iteration).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .. import jobs
from ..checkpoint.messages import MAX_ITERATION, MAX_T_ITER, MIN_T_ITER
from ..interval.planner import Measured, Plan, lead_for, make_plan, moved, next_at
from ..interval.rates import Rate, job_rate, node_rate
from ..rpc import RemoteError

log = logging.getLogger("gangd.interval")

RECENT = 3  # generations whose blocked time make C
PLANS_KEPT = 1024  # jobs whose last plan `gang ckpt plan` still shows (the running ones and the newest ended)
C_UNMEASURED = 1.0  # s: C before the job's first checkpoint (the first plan is re-made once it is measured)
POLL_MIN, POLL_MAX = 1.0, 30.0  # s between a planner's looks at the job's pace
LEAD_TIME = 0.05  # s: a rank asks this long ahead of the planned iteration (a request's round trip, with room)
REPORT_AGE = 0.4  # s: a computing rank reports its progress this often at least (gangd.ckptlib.pace: every 0.25 s)
DELIVERY = 0.5  # s: a plan names an iteration at least this far ahead of the ranks (the plan's trip to them, under load)


@dataclass
class JobPlan:
    """What ``gang ckpt plan`` shows of one job: the plan, the iteration it names next, and why."""

    plan: Plan
    next: int | None = None
    lead: int = 0
    reach: int = 0  # how far ahead of the ranks the plan had to name its iteration (lead + delivery)
    iteration: int | None = None  # the furthest boundary a rank reported
    made: float = field(default_factory=time.time)
    sent: bool = False  # told to every node of the job

    def to_wire(self) -> dict:
        return {**self.plan.to_wire(), "next": self.next, "lead": self.lead, "reach": self.reach, "iteration": self.iteration, "made": self.made,
                "sent": self.sent}


# ---------------------------------------------------------------- measurements (pure: records in, figures out)


def usable(generations: list[dict]) -> list[dict]:
    return [g for g in generations if g.get("state") in ("complete", "protected") and isinstance(g.get("nodes"), dict) and g["nodes"]]


def _seconds(node: dict, key: str) -> float | None:
    t = node.get(key)
    return float(t) if isinstance(t, int | float) and math.isfinite(t) and t >= 0 else None


def measure_c(generations: list[dict]) -> tuple[float, str]:
    """C: the time the ranks are blocked by a checkpoint, the mean of the newest :data:`RECENT` usable
    generations (each its slowest node's). Blocked time spent *waiting* for another node's ranks to
    reach the cut or to finish is left out (``write`` + ``sync_overhead`` of :func:`gangd.checkpoint.round.node_stats`):
    it is the ranks' misalignment, which the job pays at its next collective anyway, and it swamped the
    cost itself (a node waiting 240 ms at the start sync for a write of 90 ms)."""
    costs = []
    for g in usable(generations)[-RECENT:]:
        times = []
        for n in g["nodes"].values():
            if not isinstance(n, dict):
                continue
            write, sync, blocked = _seconds(n, "write"), _seconds(n, "sync_overhead"), _seconds(n, "blocked")
            if write is not None and sync is not None:
                times.append(min(write + sync, blocked) if blocked is not None else write + sync)
            elif blocked is not None:
                times.append(blocked)
        if times:
            costs.append(max(times))
    if not costs:
        return C_UNMEASURED, f"assumed {C_UNMEASURED:g} s until the first checkpoint"
    return max(1e-4, sum(costs) / len(costs)), f"measured: mean time blocked saving, last {len(costs)} checkpoint(s)"


def measure_l(generations: list[dict], level: str, c: float) -> tuple[float, str]:
    """L: begin -> usable after a node loss (complete, plus the redundancy write unless local)."""
    for g in reversed(usable(generations)):
        started, ended = g.get("started"), g.get("ended")
        if not isinstance(started, int | float) or not isinstance(ended, int | float):
            continue
        # From the cut, not from the begin: a planned round begins ``lead`` iterations ahead, and the
        # ranks computing up to the cut (``agree`` + ``reach``) is the job's work, not the checkpoint's
        # latency (a round that waited out a 4 s iteration raised the plan to 4 s through L - C).
        ahead = [a + r for n in g["nodes"].values() if isinstance(n, dict)
                 and (a := _seconds(n, "agree")) is not None and (r := _seconds(n, "reach")) is not None]
        latency = max(0.0, float(ended) - float(started) - min(ahead, default=0.0))
        if level == "local":
            return max(latency, c), "measured: begin to complete (local: a node loss is survived only when the node comes back)"
        protect = g.get("protect_seconds")
        if g.get("state") == "protected" and isinstance(protect, int | float):
            return max(latency + float(protect), c), f"measured: begin to protected ({level})"
    return c, "taken as C until a generation is measured"


def measure_r(records: list[dict], record: dict, generations: list[dict]) -> tuple[float, str]:
    """R: a measured restart of the lineage, else this job's start-up plus reading its state back."""
    measured = [r["restart_seconds"] for r in records if isinstance(r.get("restart_seconds"), int | float)]
    if measured:
        return max(0.01, float(measured[-1])), "measured: the lineage's last restart (submitted to every rank restored)"
    startup = 0.0
    if isinstance(record.get("started"), int | float) and isinstance(record.get("submitted"), int | float):
        startup = max(0.0, float(record["started"]) - float(record["submitted"]))
    read = 0.0
    recent = usable(generations)[-RECENT:]
    if recent:
        nodes = [n for n in recent[-1]["nodes"].values() if isinstance(n, dict)]
        # (the best bandwidth the recent writes showed: a small delta's write is slow per byte, the disk is not)
        rates = [n["bandwidth"] for g in recent for n in g["nodes"].values()
                 if isinstance(n, dict) and isinstance(n.get("bandwidth"), int | float) and n["bandwidth"] > 0]
        restore = recent[-1].get("restore_bytes") or sum(n.get("bytes", 0) for n in nodes if isinstance(n.get("bytes"), int))
        if rates and isinstance(restore, int):
            read = restore / max(1, len(nodes)) / max(rates)
    return max(0.01, startup + read), "estimated: this job's start-up plus reading its state at its checkpoints' bandwidth"


def node_rates(histories: dict[str, Any], priors: dict[str, float], weight: float) -> dict[str, Rate]:
    """Each node's rate from its history (``NodeHistory`` or its wire dict) and its prior MTBF."""
    out = {}
    for node, prior in priors.items():
        h = histories.get(node)
        if h is None:
            losses, exposure = 0, 0.0
        elif isinstance(h, dict):
            losses, exposure = int(h.get("losses") or 0), float(h.get("exposure") or 0.0)
        else:
            losses, exposure = h.losses, h.exposure
        out[node] = node_rate(losses, exposure, prior, weight)
    return out


# ---------------------------------------------------------------- the planner (one task per planned job)


@dataclass
class Ports:
    """What the planner uses, passed in by the checkpoint coordinator (no reaching through a daemon)."""

    record: Callable[[int], dict | None]  # the job's record, None once gone
    generations: Callable[[dict], list[dict]]  # the lineage's generations, oldest first
    lineage_records: Callable[[dict], list[dict]]
    level: Callable[[dict], str]  # the job's redundancy level
    on_job_nodes: Callable[..., Awaitable[dict[str, Any]]]  # (record, op, **args): a peer op on every node of the job
    histories: Callable[[list[str]], Awaitable[dict[str, Any]]]  # node -> its history in etcd
    priors: Callable[[], dict[str, float]]  # node -> prior MTBF (s)
    prior_weight: float
    replan: float
    interval_min: float
    interval_max: float
    term: Callable[[], int]
    active: Callable[[], bool]


class IntervalPlanner:
    def __init__(self, ports: Ports):
        self.ports = ports
        self.plans: dict[int, JobPlan] = {}
        self.running: set[int] = set()

    async def measured(self, record: dict, t_iter: float | None, generations: list[dict] | None = None) -> Measured:
        """The job's measurements now (t_iter: the ranks' pace; None: not known, 1 s taken so that a plan in seconds
        can be made; ``generations``: the lineage's, if the caller read them already)."""
        p = self.ports
        if generations is None:
            generations = p.generations(record)
        level = p.level(record)
        c, c_basis = measure_c(generations)
        latency, l_basis = measure_l(generations, level, c)
        r, r_basis = measure_r(p.lineage_records(record), record, generations)
        nodes = sorted(jobs.nodes_of(record))
        try:
            histories = await p.histories(nodes)
        except Exception as exc:  # noqa: BLE001 -- etcd away: the priors alone (said so in the basis)
            log.info("job %d: no failure history (%s): planning with the configured MTBFs", record["id"], exc)
            histories = {}
        priors = p.priors()
        rates = node_rates(histories, {n: priors.get(n, max(priors.values(), default=30 * 86400.0)) for n in nodes}, p.prior_weight)
        lam = job_rate(rates.values())
        basis = {"C": c_basis, "L": l_basis, "R": r_basis,
                 "lam": "; ".join(f"{n}: {rate.basis}" for n, rate in rates.items()),
                 "t_iter": "measured: the slowest rank's smoothed time per iteration, checkpoints excluded" if t_iter else "not known yet"}
        return Measured(C=c, L=max(latency, c), R=r, lam=lam, t_iter=t_iter or 1.0, basis=basis,
                        node_loss_survivable=level != "local" or len(nodes) == 1)

    async def view(self, record: dict) -> dict:
        """``gang ckpt plan``: the job's plan if it is planned, else what it would be (in seconds)."""
        held = self.plans.get(record["id"])
        if held is not None:
            return {"auto": True, **held.to_wire()}
        plan = make_plan(await self.measured(record, None), min_s=self.ports.interval_min, max_s=self.ports.interval_max)
        out = plan.to_wire()
        out.update(auto=False, every=None, next=None)
        return out

    def start(self, spawn: Callable[..., Any], job_id: int) -> None:
        if job_id not in self.running:
            self.running.add(job_id)
            spawn(self._run, job_id)

    async def _run(self, job_id: int) -> None:
        try:
            await self._plan_job(job_id)
        finally:
            self.running.discard(job_id)

    async def _pace(self, record: dict) -> tuple[int | None, float | None]:
        """The furthest iteration a rank is at *now* (its last report, run on at its pace for the report's age)
        and the slowest rank's time per iteration."""
        answers = await self.ports.on_job_nodes(record, "ckpt_pace", job=record["id"])
        answers = {n: a for n, a in answers.items() if isinstance(a, dict)}
        paces = [a["t_iter"] for a in answers.values() if type(a.get("t_iter")) in (int, float) and MIN_T_ITER <= a["t_iter"] <= MAX_T_ITER]
        t_iter = max(paces, default=None)
        now = []
        for a in answers.values():
            if type(a.get("iteration")) is int:
                # A report is at most REPORT_AGE old while the rank computes; an older one means it
                # is inside a long iteration, where it is not moving: no more than that is run on (an
                # extrapolation over a 4 s iteration named an iteration 200 further on, a skipped checkpoint).
                age = min(float(a["age"]), REPORT_AGE) if type(a.get("age")) in (int, float) and a["age"] >= 0 else 0.0
                fast = min(paces, default=None)  # (the fastest pace: a rank is at least this far on)
                now.append(a["iteration"] + (math.ceil(age / fast) if fast else 0))
        return max(now, default=None), t_iter

    async def _plan_job(self, job_id: int) -> None:
        p = self.ports
        held: JobPlan | None = None
        silent = 0  # looks in a row with no pace: a job whose ranks take no checkpoints is asked less and less often
        while True:
            record = p.record(job_id)
            if record is None or jobs.is_terminal(record) or not p.active():
                return  # (its last plan stays for `gang ckpt plan`, the newest PLANS_KEPT jobs')
            try:
                iteration, t_iter = await self._pace(record)
            except RemoteError as exc:
                log.debug("job %d: pace: %s", job_id, exc.message)
                iteration, t_iter = None, None
            if t_iter is None:  # (no rank has reported its pace yet)
                silent += 1
                await trio.sleep(min(POLL_MAX, POLL_MIN * 2 ** min(silent // 5, 5)))
                continue
            silent = 0
            generations = p.generations(record)  # (read once a look: measured, the last cut and the first plan all use it)
            taken = usable(generations)
            m = await self.measured(record, t_iter, generations)
            last_cut = max((g["iteration"] for g in taken if type(g.get("iteration")) is int), default=None)
            if held is None or moved(held.plan.inputs, m, p.replan) or self._overdue(held, iteration, last_cut):
                plan = make_plan(m, min_s=p.interval_min, max_s=p.interval_max)
                lead = 0 if t_iter >= 4 * LEAD_TIME else lead_for(t_iter, LEAD_TIME)
                current = max(0, iteration if iteration is not None else 0)
                # The plan must reach every rank before any passes the iteration it names: named no
                # sooner than DELIVERY seconds ahead of where the ranks are now, and the ranks then
                # ask ``lead`` iterations before it. No checkpoint yet: the first as soon as that
                # allows (C, L and R are then measured, and the plan made again).
                reach = lead + math.ceil(DELIVERY / t_iter)
                nxt = next_at(last_cut, current, plan.every if taken else 1, reach)
                nxt = min(nxt, MAX_ITERATION)  # (a rank says where it is: past the wire's bound no node would take the plan)
                held = JobPlan(plan, nxt, lead, reach, iteration)
                self.plans.pop(job_id, None)
                self.plans[job_id] = held
                while len(self.plans) > PLANS_KEPT:
                    del self.plans[next(iter(self.plans))]
                try:
                    await p.on_job_nodes(record, "ckpt_set_plan", job=job_id, plan={"next": nxt, "every": plan.every, "lead": lead}, term=p.term())
                    held.sent = True
                    log.info("job %d: checkpoint every %d iterations (%.1f s; C %.3f s, R %.2f s, MTBF %.0f s, %.3f s/iteration), next at %d",
                             job_id, plan.every, plan.every_s, m.C, m.R, 1 / m.lam if m.lam else math.inf, t_iter, nxt)
                except RemoteError as exc:
                    log.info("job %d: could not send its checkpoint plan: %s", job_id, exc.message)
            else:
                held.iteration = iteration
                if last_cut is not None and held.next is not None and last_cut >= held.next:
                    held.next = last_cut + held.plan.every  # (the ranks plan the next the same way)
            await trio.sleep(min(POLL_MAX, max(POLL_MIN, held.plan.every_s / 4)))

    @staticmethod
    def _overdue(held: JobPlan, iteration: int | None, last_cut: int | None) -> bool:
        """The ranks ran well past the planned iteration with no checkpoint there (a plan that did not reach
        them, or requests that failed): plan again from where they are."""
        if not held.sent:
            return True
        if held.next is None or iteration is None:
            return False
        return iteration > held.next + max(2, held.lead) + held.plan.every and (last_cut is None or last_cut < held.next)
