"""Where a job lost with a node comes back, and where each rank's files come from (pure).

When a node is lost, a job with ranks there that has a protected generation
is restarted from it on live nodes (issue 16). This is the decision, from
plain values, so that every rule is testable without a cluster:

* The lost nodes' files must be rebuildable: the generation's redundancy
  plan (:func:`gangd.redundancy.plan.make_plan`) says from where
  (:meth:`~gangd.redundancy.plan.Plan.recovery`); if one is not, the job
  cannot come back and the answer is that plan's sentence naming it.
* Ranks on surviving nodes stay where they are (their files are there).
* Each lost node is replaced by *one* node, which takes all of its ranks —
  a rebuild reconstructs a node's files as a whole (its partner's copy, or
  its XOR set's parity), so they land on one disk. Replacements are chosen
  spares first (``spare = true`` in the config), then other live nodes
  outside the job, then the job's own surviving nodes, each only with the
  free cores the lost node's ranks need; in node-name order within each
  class, so the choice is predictable.

The daemon side executes it: :meth:`gangd.daemon.ckptrestart.Restarts.restart`
and ``recover`` take this placement when a protected generation's files
must be rebuilt, :func:`gangd.checkpoint.relocate.plan_rebuilds` says which
node rebuilds what, and ``ckpt_rebuild`` (:mod:`gangd.daemon.rebuild`) does it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..redundancy.plan import Plan


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class RankSource:
    """Where rank ``rank``, now on ``node``, finds its files: ``method``
    ``local`` (already on ``node``), ``partner`` (a copy on ``sources[0]``) or
    ``xor`` (rebuilt from ``sources``, the survivors of the lost node's set)."""

    rank: int
    node: str
    method: str
    sources: tuple[str, ...]
    lost: str | None = None  # the node it ran on, if that one is lost


@dataclass(frozen=True)
class RecoveryPlan:
    placement: tuple[str, ...]
    replacements: Mapping[str, str]  # lost node -> the node that takes its ranks and rebuilds its files
    ranks: tuple[RankSource, ...]


class CannotRecover(Exception):
    """The job cannot come back from this generation now; the message names what is missing."""


def plan_recovery(placement: list[str], plan: Plan, lost: Iterable[str], free: Mapping[str, int],
                  spares: Iterable[str] = ()) -> RecoveryPlan:
    """The new placement and per-rank sources for a job on ``placement``
    (a node per rank) whose newest protected generation has redundancy
    ``plan``, after ``lost`` nodes are gone. ``free``: free cores of each
    live node (a node absent is not live); ``spares``: nodes marked spare.
    Raises :class:`CannotRecover` with a sentence."""
    gone = [n for n in dict.fromkeys(lost) if n in plan.nodes]
    job_nodes = list(dict.fromkeys(placement))
    if set(job_nodes) != set(plan.nodes):
        raise CannotRecover("the generation's redundancy plan is for other nodes than the job's")
    recovery = plan.recovery(gone)
    if not recovery.ok:
        raise CannotRecover(recovery.message)
    rebuild_of = {r.node: r for r in recovery.rebuilds}
    need = {node: placement.count(node) for node in gone}
    room = {n: c for n, c in free.items() if n not in gone and c > 0}
    spare = set(spares)

    def rank_class(name: str) -> tuple[int, list]:
        if name in spare and name not in job_nodes:
            return (0, _natural(name))
        if name not in job_nodes:
            return (1, _natural(name))
        return (2, _natural(name))

    replacements: dict[str, str] = {}
    for node in sorted(gone, key=lambda n: (-need[n], _natural(n))):  # biggest first: it has the fewest fits
        fits = [n for n in room if room[n] >= need[node]]
        if not fits:
            raise CannotRecover(
                f"no live node has {need[node]} free core{'s' if need[node] > 1 else ''} for the "
                f"{need[node]} rank{'s' if need[node] > 1 else ''} of lost node {node}"
            )
        chosen = min(fits, key=rank_class)
        replacements[node] = chosen
        room[chosen] -= need[node]
    new = tuple(replacements.get(node, node) for node in placement)
    ranks = []
    for rank, node in enumerate(placement):
        if node in replacements:
            r = rebuild_of[node]
            ranks.append(RankSource(rank, replacements[node], r.method, r.sources, node))
        else:
            ranks.append(RankSource(rank, node, "local", (node,)))
    return RecoveryPlan(new, replacements, tuple(ranks))
