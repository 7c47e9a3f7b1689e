"""Which generations of a lineage retention keeps, with incremental checkpoints (issue 17).

A delta generation restores only with the older generations it ``needs``
(its files' chains), so counting the newest ``checkpoint_keep`` is no longer
enough: removing a base would leave every kept generation built on it
unrestorable. The rule, pure so that it is tested alone and applied the same
way everywhere (DESIGN17 §2, "Retention"):

* usable: complete or protected, *and* every generation it needs is usable
  (:func:`gangd.checkpoint.delta.chain_usable`);
* seeds: the newest ``keep`` usable generations, the newest protected one,
  the newest flushed one, the one being flushed, and whatever a checkpoint
  under way may have been offered to diff against (``holding``);
* kept: the seeds and, transitively, what they need (:func:`delta.needed`);
  every other complete or protected generation is removed, and nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import delta

DONE = ("complete", "protected")


def needs_of(gens: Iterable[dict]) -> dict[int, list[int]]:
    """``gen -> the generations it needs`` from the lineage's entries (none recorded: a whole-file generation)."""
    out: dict[int, list[int]] = {}
    for e in gens:
        raw = e.get("needs") or ()
        out[e["gen"]] = [g for g in raw if type(g) is int] if isinstance(raw, (list, tuple)) else []
    return out


def usable(gens: list[dict]) -> list[dict]:
    """The generations that restore (complete or protected, and so is every one they need), oldest first.

    A link no entry records (its job's record gone from the history) is
    taken as usable here: retention must not remove a generation for what
    it cannot see (a restart verifies the link on the nodes anyway)."""
    needs = needs_of(gens)
    unseen = {g for links in needs.values() for g in links} - set(needs)
    done = {e["gen"] for e in gens if e.get("state") in DONE} | unseen
    return [e for e in sorted(gens, key=lambda e: e["gen"]) if e["gen"] in done and delta.chain_usable(e["gen"], needs, done)]


def doomed(gens: list[dict], keep: int, *, flushing: int | None = None, holding: Iterable[int] = ()) -> list[dict]:
    """The complete or protected generations to remove, oldest first (see the module docstring).

    ``flushing``: the generation a flush reads now; ``holding``: generations
    a checkpoint under way may diff against (kept with what they need until
    that checkpoint is recorded)."""
    ok = usable(gens)
    seeds = {e["gen"] for e in ok[-keep:]} if keep > 0 else set()
    protected = [e for e in ok if e.get("state") == "protected"]
    if protected:
        seeds.add(protected[-1]["gen"])
    flushed = [e for e in ok if e.get("flushed")]
    if flushed:
        seeds.add(flushed[-1]["gen"])
    if flushing is not None:
        seeds.add(flushing)
    seeds |= set(holding)
    kept = delta.needed(needs_of(gens), seeds)
    return [e for e in sorted(gens, key=lambda e: e["gen"]) if e.get("state") in DONE and e["gen"] not in kept]
