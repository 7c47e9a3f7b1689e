"""What a checkpoint generation writes, and which generations a kept one needs (issue 17; paper 003, HBICT).

Pure decisions, no I/O, so that the rank (which alone sees its blocks'
hashes), the node daemon (which checks what a rank reports) and the
coordinator (which prunes) apply one rule:

* :func:`choose`: after pass 1 (hash every block, compare with the parent's
  and the base's signatures) whether this generation is a ``full`` copy, an
  ``incr`` (blocks changed since the previous generation), a ``diff``
  (blocks changed since the base) or a ``rebase`` (an incremental against
  the previous generation that becomes the new base: 003's adaptive rule).
* :func:`needed`: the generations a set of kept generations needs (the
  transitive closure of their ``needs``): retention removes the rest and
  nothing more.
* :func:`chain_usable`: a generation restores only if it and every
  generation it needs are usable.

The chain bound: a restore of a generation reads the generation itself and
its ``links``; ``len(links) + 1 <= chain_max`` always (:func:`links_problem`
checks a reported chain against it). ``chain_max=1`` means every generation
is full.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

MODES = ("full", "incremental", "differential", "adaptive")
ROLES = ("full", "incr", "diff", "rebase")
DEFAULT_MODE = "adaptive"
DEFAULT_CHAIN_MAX = 8
DEFAULT_THRESHOLD = 0.10
DEFAULT_FULL_ABOVE = 0.90
MAX_CHAIN = 1024  # links: a bound on any chain a file or a report may name, whatever the setting
DEFAULT_BLOCK_KIB = 16  # bench/delta.py's sweep: 16 KiB hashes at ~0.6x raw xxh3 here, 4 KiB at ~0.4x
MAX_BLOCK_KIB = 1 << 20  # 1 GiB


@dataclass(frozen=True)
class Ref:
    """A generation a new one may be a delta against: ``depth`` is how many
    links a restore of it reads beyond itself (0 for a full)."""

    gen: int
    role: str
    depth: int


@dataclass(frozen=True)
class Choice:
    """What to write: ``role`` (full, incr, diff, rebase), the generation the
    blocks are compared against (None for a full) and whether this generation
    becomes the base later differentials are taken against."""

    role: str
    against: int | None
    new_base: bool


FULL = Choice("full", None, True)


def choose(mode: str, *, parent: Ref | None, base: Ref | None, d_prev: int, d_base: int, total: int,
           chain_max: int = DEFAULT_CHAIN_MAX, threshold: float = DEFAULT_THRESHOLD, full_above: float = DEFAULT_FULL_ABOVE,
           force_full: bool = False) -> Choice:
    """The role of the next generation.

    ``d_prev`` / ``d_base``: bytes of the blocks changed against the parent
    (the newest committed generation) / against the base; ``total``: the
    state's bytes. ``base`` None means the parent is the base. A delta whose
    restore would read more than ``chain_max`` files, or that would write
    ``full_above`` of the state anyway, is a full instead: when nearly
    everything changed, adaptive costs a full plus pass 1.
    """
    if mode not in MODES:
        raise ValueError(f"checkpoint mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "full" or force_full or parent is None or chain_max <= 1:
        return FULL
    base = base if base is not None else parent
    if mode == "incremental":
        if parent.depth + 1 >= chain_max or d_prev >= full_above * total:
            return FULL
        return Choice("incr", parent.gen, False)
    # differential, and adaptive by default: a differential against the base
    if mode == "differential" or d_base - d_prev <= threshold * total:
        if base.depth + 1 >= chain_max or d_base >= full_above * total:
            return FULL
        return Choice("diff", base.gen, False)
    # adaptive, 003's rule: the volume changed against the base exceeds the volume changed against the
    # previous generation by more than the threshold: an incremental against the previous one, the new base.
    if parent.depth + 1 >= chain_max or d_prev >= full_above * total:
        return FULL
    return Choice("rebase", parent.gen, True)


def base_of(gen: int, choice: Choice, against_base: int | None) -> int:
    """The base a generation written with ``choice`` names (what a later
    differential is taken against): itself for a full or a rebase, else its
    reference's base (``against_base``)."""
    if choice.new_base or choice.against is None:
        return gen
    return choice.against if against_base is None else against_base


def refs(gen: int, role: str, base: int, links: Iterable[int]) -> tuple[Ref, Ref]:
    """The (parent, base) references for a next generation, from the newest
    committed generation's ``gen``, ``role``, ``base`` and ``links`` (as in
    its file's index). A link's own links are the ones after it in the
    chain, so the base's depth follows from where it stands."""
    chain = list(links)
    parent = Ref(gen, role, len(chain))
    if base == gen or base not in chain:
        return parent, parent
    at = chain.index(base)
    return parent, Ref(base, "base", len(chain) - at - 1)


def links_problem(gen: int, links: Iterable[object], chain_max: int) -> str | None:
    """Why a chain reported for ``gen`` is not acceptable, or None: every link
    an older generation (a non-negative integer), newest first, no repeats,
    and a restore reading at most ``chain_max`` files."""
    chain = list(links)
    if len(chain) + 1 > max(1, chain_max):
        return f"its chain reads {len(chain) + 1} generations, more than the bound of {chain_max}"
    previous = gen
    for link in chain:
        if type(link) is not int or link < 0:
            return f"the link {link!r} is not a generation number"
        if link >= previous:
            return f"the link {link} is not older than {previous} (links go newest first)"
        previous = link
    return None


def needed(entries: Mapping[int, Iterable[int]], seeds: Iterable[int]) -> set[int]:
    """The generations to keep: ``seeds`` and, transitively, every
    generation their ``needs`` (``entries[gen]``) name. A generation named
    but absent from ``entries`` is in the answer too (it is needed; whether
    it exists is the caller's question)."""
    keep: set[int] = set()
    todo = list(seeds)
    while todo:
        gen = todo.pop()
        if gen in keep:
            continue
        keep.add(gen)
        todo.extend(link for link in entries.get(gen, ()) if link not in keep)
    return keep


def missing_links(gen: int, entries: Mapping[int, Iterable[int]], usable: Callable[[int], bool] | Container[int]) -> list[int]:
    """The generations of ``gen``'s closure (itself included) that are not
    usable, newest first; ``usable``: a predicate (complete or protected,
    say) or a set of usable generations."""
    ok = usable if callable(usable) else usable.__contains__
    return sorted((g for g in needed(entries, [gen]) if not ok(g)), reverse=True)


def chain_usable(gen: int, entries: Mapping[int, Iterable[int]], usable: Callable[[int], bool] | Container[int]) -> bool:
    """Whether ``gen`` restores: it and every generation it needs, transitively, are usable."""
    return not missing_links(gen, entries, usable)
