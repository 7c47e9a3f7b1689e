"""Who holds which redundancy of a generation, and what a loss leaves rebuildable.

Pure functions over a job's node list (no I/O), so the checkpoint state
machines and recovery can ask the same questions in tests as in the daemon.

Levels, as in SCR (its SINGLE, PARTNER and XOR schemes):

* ``local`` — each node's files only on its own disk: no loss survivable.
* ``partner`` — each node's files also on the *next* node of a ring of the
  job's distinct nodes (in their order): storage 2·B; a node is rebuildable
  unless it and its partner are both lost.
* ``xor`` — the nodes in consecutive sets of at most ``k`` (default 8, or
  the node count if smaller); in a set of ``n``, each node's data is split
  into ``n - 1`` chunks and every node stores the XOR of one chunk of each
  other member (reduce-scatter), i.e. ``1/(n - 1)`` of its data extra: storage
  ``B·n/(n - 1)``. Any one lost member of a set is rebuildable from the
  ``n - 1`` survivors; two in one set are not.

When ``N`` is not a multiple of ``k``, the nodes are split into
``ceil(N / k)`` consecutive sets of sizes differing by at most one (SCR
would leave a short last set; a set of one node could not protect anything,
so with ``k = 2`` and odd ``N`` one set has 3).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LEVELS = ("local", "partner", "xor")
DEFAULT_SET_SIZE = 8
#: Node names become directory names of partner copies: nothing else allowed.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")


class PlanError(ValueError):
    """A redundancy level or set size that cannot apply to these nodes; the message says why."""


def default_level(node_count: int) -> str:
    """``xor`` where a job spans at least 3 nodes, ``partner`` on 2, ``local`` on 1."""
    return "xor" if node_count >= 3 else "partner" if node_count == 2 else "local"


def distinct(nodes: Iterable[str]) -> tuple[str, ...]:
    """The job's nodes in first-seen order (a placement lists a node once per rank)."""
    return tuple(dict.fromkeys(nodes))


@dataclass(frozen=True)
class Rebuild:
    """How one lost node's files come back: ``method`` ``partner`` (a copy
    held by ``sources[0]``) or ``xor`` (from every survivor of its set)."""

    node: str
    method: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Recovery:
    """What a set of lost nodes leaves: one :class:`Rebuild` per rebuildable
    lost node, one sentence per node that cannot be rebuilt."""

    lost: tuple[str, ...]
    rebuilds: tuple[Rebuild, ...]
    unrecoverable: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.unrecoverable

    @property
    def message(self) -> str:
        return "; ".join(self.unrecoverable)


@dataclass(frozen=True)
class Plan:
    level: str
    nodes: tuple[str, ...]  # distinct, in the job's order
    sets: tuple[tuple[str, ...], ...]  # xor: the sets; partner/local: one per node

    # ------------------------------------------------------------ partner

    def partner_of(self, node: str) -> str:
        """The node that keeps a copy of ``node``'s files (the next on the ring)."""
        i = self._index(node)
        return self.nodes[(i + 1) % len(self.nodes)]

    def partnered_by(self, node: str) -> str:
        """The node whose copy ``node`` keeps (the previous on the ring)."""
        i = self._index(node)
        return self.nodes[(i - 1) % len(self.nodes)]

    # ------------------------------------------------------------ xor

    def set_of(self, node: str) -> tuple[str, ...]:
        self._index(node)
        return next(s for s in self.sets if node in s)

    def holds(self, node: str) -> dict[str, tuple[str, ...]]:
        """What ``node`` stores beyond its own files: ``{"partner": (whose copy,)}``
        or ``{"xor": (its set, in order)}`` (it keeps every member's manifest
        and its parity chunk), or ``{}`` for ``local``."""
        if self.level == "partner":
            return {"partner": (self.partnered_by(node),)}
        if self.level == "xor":
            return {"xor": self.set_of(node)}
        self._index(node)
        return {}

    def storage(self, sizes: dict[str, int]) -> int:
        """Bytes stored in all for a generation whose nodes hold ``sizes``
        (padding included: an XOR set pads every member to its largest)."""
        total = sum(sizes[n] for n in self.nodes)
        if self.level == "partner":
            return 2 * total
        if self.level == "xor":
            return total + sum(len(s) * math.ceil(max(sizes[n] for n in s) / (len(s) - 1)) for s in self.sets)
        return total

    # ------------------------------------------------------------ losses

    def recovery(self, lost: Iterable[str]) -> Recovery:
        """Whether each lost node's files can be rebuilt, and from which nodes."""
        gone = distinct(n for n in lost)
        for n in gone:
            self._index(n)
        dead = set(gone)
        rebuilds: list[Rebuild] = []
        problems: list[str] = []
        for node in gone:
            if self.level == "partner":
                partner = self.partner_of(node)
                if partner in dead:
                    problems.append(f"node {node}'s checkpoint files cannot be rebuilt: its partner {partner}, which holds their copy, is lost too")
                else:
                    rebuilds.append(Rebuild(node, "partner", (partner,)))
            elif self.level == "xor":
                members = self.set_of(node)
                others = [m for m in members if m in dead and m != node]
                if others:
                    problems.append(
                        f"node {node}'s checkpoint files cannot be rebuilt: {', '.join(others)} of its XOR set "
                        f"({', '.join(members)}) {'is' if len(others) == 1 else 'are'} lost too (parity survives one loss per set)"
                    )
                else:
                    rebuilds.append(Rebuild(node, "xor", tuple(m for m in members if m != node)))
            else:
                problems.append(f"node {node}'s checkpoint files cannot be rebuilt: the generation was kept on local disks only")
        return Recovery(gone, tuple(rebuilds), tuple(problems))

    def _index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise PlanError(f"node {node!r} is not one of the job's nodes ({', '.join(self.nodes)})") from None


def xor_sets(nodes: Sequence[str], k: int) -> tuple[tuple[str, ...], ...]:
    """Consecutive sets of at most ``k`` nodes, sizes differing by at most one
    (with ``k = 2`` and an odd count, one set of 3: never a set of one)."""
    count = max(1, min(math.ceil(len(nodes) / k), len(nodes) // 2))
    base, extra = divmod(len(nodes), count)
    out, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        out.append(tuple(nodes[start : start + size]))
        start += size
    return tuple(out)


def make_plan(nodes: Iterable[str], level: str | None = None, set_size: int | None = None) -> Plan:
    """The plan for a job on ``nodes`` (in order; repeats ignored).

    ``level`` None: :func:`default_level`. ``set_size``: the XOR set size k
    (default 8, capped at the node count). Raises :class:`PlanError` for a
    level these nodes cannot have (partner or xor on one node, k < 2).
    """
    names = distinct(nodes)
    if not names:
        raise PlanError("a job has at least one node")
    for name in names:
        if not isinstance(name, str) or not NODE_NAME.match(name):
            raise PlanError(f"{name!r} is not a node name")
    level = default_level(len(names)) if level is None else level
    if level not in LEVELS:
        raise PlanError(f"unknown checkpoint redundancy {level!r}: one of {', '.join(LEVELS)}")
    if level != "local" and len(names) < 2:
        raise PlanError(f"{level} redundancy needs at least 2 nodes; the job has one ({names[0]})")
    if level == "xor":
        k = DEFAULT_SET_SIZE if set_size is None else set_size
        if type(k) is not int or k < 2:
            raise PlanError(f"an XOR set has at least 2 nodes, not {k!r}")
        sets = xor_sets(names, min(k, len(names)))
    else:
        sets = tuple((n,) for n in names)
    return Plan(level, names, sets)
