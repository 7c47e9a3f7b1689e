"""Where a restart runs, and where each of its ranks' files comes from (pure).

A generation's files are on the nodes its ranks ran on (its *placement*),
and on any node a restart staged them onto since (its *copies*: node →
ranks). A restart may run elsewhere (``gang restart -w/-N``, or because a
node of the generation is down); then each node of the new placement pulls
the files of its ranks that it does not hold from a live node that does
(:mod:`gangd.daemon.staging`). These functions decide both, from plain
values, so that every rule is testable without a cluster; the coordinator
(:meth:`gangd.daemon.ckptrestart.Restarts.restart`) executes
them. When a rank's files are only on nodes that are down and the
generation is *protected*, :func:`plan_rebuilds` says which node rebuilds
each lost node's files from its redundancy (``ckpt_rebuild``,
:mod:`gangd.daemon.rebuild`) before the rest goes as above; the rebuilt
files count as copies from then on. ``place`` is the coordinator's placement function
(:func:`gangd.daemon.coordinator.place`), passed in so the restart asks for
cores the same way a submission does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..redundancy.plan import Plan, distinct

Place = Callable[[dict, dict[str, int]], "list[str] | None"]


class Unplaceable(Exception):
    """The restart cannot run where it was asked (or anywhere now); the message says why.
    ``code``: ``bad_request`` for nodes the cluster does not have, else ``cannot_place``."""

    def __init__(self, message: str, code: str = "cannot_place"):
        super().__init__(message)
        self.code = code


def _natural(name: str):
    import re

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def choose_placement(*, nranks: int, old: list[str], up: Iterable[str], cores: Mapping[str, int], place: Place,
                     nodelist: list[str] | None = None, nodes: int | None = None) -> list[str]:
    """The restart's placement (a node per rank).

    ``nodelist`` (``-w``): only those nodes, every one up. ``nodes``
    (``-N``): that many live nodes. Neither: the generation's own placement
    if its nodes are all up, else its live nodes plus as many others as it
    had, then any live nodes. ``cores``: every node's cores (the restart
    waits for a slot with room, as any job does)."""
    live = {n for n in up if n in cores}
    if nodelist is not None:
        unknown = [n for n in nodelist if n not in cores]
        if unknown:
            known = ", ".join(sorted(cores, key=_natural))
            raise Unplaceable(f"unknown node{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (nodes: {known})", "bad_request")
        down = [n for n in nodelist if n not in live]
        if down:
            raise Unplaceable(f"node{'s' if len(down) > 1 else ''} {', '.join(down)} {'are' if len(down) > 1 else 'is'} down")
        return _place(place, {"nranks": nranks, "nodelist": list(nodelist)}, live, cores, f"on {', '.join(nodelist)}")
    if nodes is not None:
        if nodes > len(live):
            raise Unplaceable(f"{nodes} nodes asked for, but only {len(live)} {'is' if len(live) == 1 else 'are'} up")
        return _place(place, {"nranks": nranks, "nodes_wanted": nodes}, live, cores, f"on {nodes} node{'s' if nodes > 1 else ''}")
    if all(n in live for n in old):
        return list(old)
    distinct = list(dict.fromkeys(old))
    keep = [n for n in distinct if n in live]
    others = sorted(live - set(keep), key=_natural)
    chosen = keep + others[: len(distinct) - len(keep)]
    if len(chosen) == len(distinct):
        try:
            return _place(place, {"nranks": nranks, "nodelist": chosen}, live, cores, "")
        except Unplaceable:
            pass
    return _place(place, {"nranks": nranks}, live, cores, "on the nodes that are up")


def _place(place: Place, want: dict, live: set[str], cores: Mapping[str, int], where: str) -> list[str]:
    placement = place(want, {n: cores[n] for n in live})
    if placement is None:
        room = sum(cores[n] for n in live if not want.get("nodelist") or n in want["nodelist"])
        raise Unplaceable(f"its {want['nranks']} ranks do not fit {where or 'on the nodes that are up'} ({room} cores)".replace("  ", " "))
    return placement


@dataclass
class Sources:
    """Per target node, the ranks it pulls from each source (``pulls``), and
    the ranks whose files no live node holds (``missing``: rank → the nodes
    that hold them, all down)."""

    pulls: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    missing: dict[int, list[str]] = field(default_factory=dict)

    @property
    def moved(self) -> set[int]:
        return {r for per in self.pulls.values() for ranks in per.values() for r in ranks}


def holders(placement: list[str], copies: Mapping[str, Iterable[int]] | None) -> dict[int, list[str]]:
    """Every node holding each rank's files: where it ran first, then its copies."""
    out = {rank: [node] for rank, node in enumerate(placement)}
    for node, ranks in (copies or {}).items():
        for rank in ranks:
            if rank in out and node not in out[rank]:
                out[rank].append(node)
    return out


def plan_sources(new: list[str], placement: list[str], copies: Mapping[str, Iterable[int]] | None, up: Iterable[str]) -> Sources:
    """Which files each node of ``new`` pulls, and from where: a rank's files
    stay put when its new node holds them; else they come from a live
    holder, the original node first (spreading reads is not worth a less
    predictable source)."""
    live = set(up)
    have = holders(placement, copies)
    out = Sources()
    for rank, target in enumerate(new):
        nodes = have.get(rank, [])
        if target in nodes and target in live:  # (a live node that lost its disk holds nothing: it is not in ``up``)
            continue
        source = next((n for n in nodes if n in live), None)
        if source is None:
            out.missing[rank] = nodes
            continue
        out.pulls.setdefault(target, {}).setdefault(source, []).append(rank)
    return out


def describe_missing(missing: Mapping[int, list[str]]) -> str:
    """One sentence: which ranks' files are only on nodes that are down."""
    by_nodes: dict[tuple[str, ...], list[int]] = {}
    for rank, nodes in sorted(missing.items()):
        by_nodes.setdefault(tuple(nodes), []).append(rank)
    parts = []
    for held, ranks in by_nodes.items():
        which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        where = " and ".join(held)
        parts.append(f"the files of {which} are only on node{'s' if len(held) > 1 else ''} {where}, which {'are' if len(held) > 1 else 'is'} down")
    return "; ".join(parts)


class CannotRebuild(Exception):
    """Files of the restart's ranks are lost and the generation's redundancy
    cannot bring them back; the message is the plan's sentence naming what."""


@dataclass(frozen=True)
class RebuildStep:
    """Node ``target`` rebuilds node ``lost``'s files (those of ``ranks``) by
    ``method`` (``partner``/``xor``) from ``sources``."""

    lost: str
    target: str
    method: str
    sources: tuple[str, ...]
    ranks: tuple[int, ...]


def plan_rebuilds(new: list[str], placement: list[str], missing: Mapping[int, Iterable[str]], plan: Plan, up: Iterable[str]) -> list[RebuildStep]:
    """The rebuilds that bring back the files of ``missing`` ranks (their
    holders all down) of a generation placed on ``placement`` with
    redundancy ``plan``, for a restart on ``new``. Each lost node is rebuilt
    as a whole on *one* node (a rebuild reconstructs a node's files
    together): the new node of its lowest missing rank; its other ranks then
    move from there as from any copy. Whether a loss is rebuildable is
    judged with every down node of the generation lost (a down member of an
    XOR set cannot give its data). Raises :class:`CannotRebuild`."""
    live = set(up)
    down = [n for n in distinct(placement) if n not in live]
    recovery = plan.recovery(down)
    by_node = {r.node: r for r in recovery.rebuilds}
    needed = distinct(placement[rank] for rank in sorted(missing))
    steps: list[RebuildStep] = []
    cannot = [n for n in needed if n not in by_node]
    if cannot:
        sentences = [p for p in recovery.unrecoverable if any(p.startswith(f"node {n}'s ") for n in cannot)]
        raise CannotRebuild("; ".join(sentences) or recovery.message)
    for node in needed:
        ranks = tuple(r for r, n in enumerate(placement) if n == node)
        target = new[min(r for r in missing if placement[r] == node)]
        r = by_node[node]
        steps.append(RebuildStep(node, target, r.method, r.sources, ranks))
    return steps


def with_copies(copies: Mapping[str, Iterable[int]] | None, node: str, ranks: Iterable[int]) -> dict[str, list[int]]:
    """``copies`` (node -> ranks whose files it holds besides where they ran) with ``ranks`` on ``node`` too."""
    out = {n: sorted(set(r)) for n, r in (copies or {}).items()}
    out[node] = sorted(set(out.get(node, [])) | set(ranks))
    return out
