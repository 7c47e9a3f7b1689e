"""The checkpoint protocol's messages, typed and checked at the boundary.

A rank's bytes are hostile (it runs the user's code), and so are a peer's
until checked: each message is a frozen dataclass whose ``from_wire`` takes
the decoded msgpack arguments and raises :class:`BadMessage` with a sentence
saying what is wrong, and whose ``to_wire`` gives the arguments of the same
op as before (the wire protocol between daemons and ranks is unchanged).

Incremental checkpoints (issue 17) add fields, never ops: the ``delta``
offer of a ``ckpt_start`` reply (:class:`DeltaOffer`), a write report's
role and links (:class:`WriteReport`: a rank may name only a tail of the
chain it was offered, so it can neither pin old generations against
retention nor make a restore read another's files), and a commit answer's
written and restore bytes, needs and roles (:class:`CommitAnswer`). A
message without them — from today's writer, or a daemon before deltas —
reads as a full file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import text

MAX_GEN = 2**62
MAX_ITERATION = 2**62
MAX_WHY = 1000  # characters of a reason a rank gives
MAX_DIGEST = 128  # characters of a rank's reported checksum (XXH3-128 hex has 32)
MAX_RANKS = 1 << 20


class BadMessage(ValueError):
    """A message that does not have the shape its op requires."""


def _show(value: Any) -> str:
    return text.printable(text.brief(value))[:40]  # (brief: a hostile 16 MiB value is not rendered whole to quote 40 characters)


def _int(args: dict, key: str, *, optional: bool = False, lo: int = 0, hi: int = MAX_GEN) -> Any:
    value = args.get(key)
    if value is None and optional:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise BadMessage(f"'{key}' must be an integer from {lo} to {hi}, not {_show(value)}")
    return value


def _why(args: dict, key: str = "why", default: str = "") -> str:
    value = args.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadMessage(f"'{key}' must be a string, not {_show(value)}")
    return text.printable(value)[:MAX_WHY]


def _dict(args: Any) -> dict:
    if not isinstance(args, dict):
        raise BadMessage(f"arguments must be a map, not {_show(args)}")
    return args


# ---------------------------------------------------------------- rank -> daemon


@dataclass(frozen=True)
class RankReport:
    """``ckpt_report``: the lowest boundary a rank can still stop at
    (``iteration``), or that it cannot take part (``iteration`` None, ``why``).
    ``gen`` None: the rank's own request to checkpoint the job."""

    op: ClassVar[str] = "ckpt_report"
    gen: int | None
    iteration: int | None
    why: str = ""

    @classmethod
    def from_wire(cls, args: Any) -> RankReport:
        args = _dict(args)
        return cls(_int(args, "gen", optional=True, lo=1), _int(args, "iteration", optional=True, lo=-1, hi=MAX_ITERATION), _why(args))

    def to_wire(self) -> dict:
        out: dict = {"gen": self.gen, "iteration": self.iteration}
        if self.why:
            out["why"] = self.why
        return out


#: The checkpoint modes a job may ask for (``--ckpt-mode``; issue 17).
MODES = ("full", "incremental", "differential", "adaptive")
#: What a rank's file of one generation is (``role`` of a write report):
#: whole, or the blocks changed since the previous generation (``incr``),
#: since the base (``diff``), or since the previous one as a new base (``rebase``).
ROLES = ("full", "incr", "diff", "rebase")
MAX_LINKS = 64  # generations one report may name (ckptstore.MAX_NEEDS; chain_max is far below)
MAX_CHAIN = 64  # the largest chain_max a cluster may set
MAX_BYTES = 2**62
MAX_PATH = 4096


@dataclass(frozen=True)
class Link:
    """A generation a rank may read blocks from: its file there and what the
    node's MANIFEST of that generation says the file holds."""

    gen: int
    path: str
    expect: tuple[int, str]  # (size, checksum)

    def to_wire(self) -> dict:
        return {"gen": self.gen, "path": self.path, "expect": [self.expect[0], self.expect[1]]}

    @classmethod
    def from_wire(cls, raw: Any) -> Link:
        raw = _dict(raw)
        path, expect = raw.get("path"), raw.get("expect")
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH:
            raise BadMessage(f"a link's 'path' must be a path, not {_show(path)}")
        if not (isinstance(expect, (list, tuple)) and len(expect) == 2 and type(expect[0]) is int and 0 <= expect[0] < MAX_BYTES
                and isinstance(expect[1], str) and 0 < len(expect[1]) <= MAX_DIGEST):
            raise BadMessage(f"a link's 'expect' must be [size, checksum], not {_show(expect)}")
        return cls(_int(raw, "gen", lo=1), path, (expect[0], expect[1]))


@dataclass(frozen=True)
class DeltaOffer:
    """The ``delta`` of a ``ckpt_start`` reply: how the rank may write its file
    of this generation. ``links``: the newest generation it may diff against
    (its *parent*) first, then every generation a restore of the parent's file
    reads, newest first. A rank names among those, and only those, what its
    file needs (:meth:`WriteReport.parse`). ``force_full`` (then no links):
    the rank writes its whole state — the job's first checkpoint, its ranks
    moved, no usable generation holds its file here, or the coordinator asked."""

    mode: str
    block_kib: int
    chain_max: int
    threshold: float
    force_full: bool
    links: tuple[Link, ...] = ()

    def __post_init__(self) -> None:
        if self.force_full and self.links:
            raise ValueError("a forced full checkpoint offers no links")

    @property
    def chain(self) -> tuple[int, ...]:
        """The offered generations, newest first."""
        return tuple(link.gen for link in self.links)

    def to_wire(self) -> dict:
        return {"mode": self.mode, "block_kib": self.block_kib, "chain_max": self.chain_max, "threshold": self.threshold,
                "force_full": self.force_full, "links": [link.to_wire() for link in self.links]}

    @classmethod
    def from_wire(cls, raw: Any) -> DeltaOffer:
        raw = _dict(raw)
        mode = raw.get("mode")
        if mode not in MODES:
            raise BadMessage(f"'mode' must be one of {', '.join(MODES)}, not {_show(mode)}")
        threshold = raw.get("threshold")
        if type(threshold) not in (int, float) or not 0 <= threshold <= 1:
            raise BadMessage(f"'threshold' must be a share from 0 to 1, not {_show(threshold)}")
        links = raw.get("links") or []
        if not isinstance(links, list) or len(links) > MAX_LINKS:
            raise BadMessage(f"'links' must be a list of at most {MAX_LINKS} generations")
        force_full = raw.get("force_full")
        if type(force_full) is not bool or (force_full and links):
            raise BadMessage("'force_full' must be true or false, and true offers no links")
        return cls(mode, _int(raw, "block_kib", lo=1, hi=1 << 20), _int(raw, "chain_max", lo=1, hi=MAX_CHAIN), float(threshold),
                   force_full, tuple(Link.from_wire(link) for link in links))


def _count(result: dict, key: str, default: int, hi: int) -> int:
    value = result.get(key, default)
    if value is None:
        return default
    if type(value) is not int or not 0 <= value <= hi:
        raise BadMessage(f"a '{key}' that is not a byte count from 0 to {hi} ({_show(value)})")
    return value


#: A compressed write's figures (issue 18), as ranks report them and nodes pass them on: bounded, every number
#: checked. Per stage: these fields (seconds, bytes, threads); stage names are short words ("hash", "compress").
STAGE_FIELDS = {"busy_s": float, "cpu_s": float, "wall_s": float, "bytes_in": int, "bytes_out": int, "workers": int}
MAX_STAGES = 8
MAX_CODECS = 64  # identities one report may list (ckptlib.units.MAX_CODECS)
MAX_CODEC = 64  # characters of one identity ("blosc2:zstd:9:bytedelta@1")


def parse_pipeline(raw: Any) -> dict | None:
    """``{"in": bytes, "out": bytes, "stages": {name: {field: number}}}`` from a hostile peer, or None (none reported).
    Unknown stage fields are dropped; a malformed value is a :class:`BadMessage`."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadMessage(f"'pipeline' must be a map, not {_show(raw)}")
    out: dict = {"in": _count(raw, "in", 0, MAX_BYTES), "out": _count(raw, "out", 0, MAX_BYTES), "stages": {}}
    stages = raw.get("stages") or {}
    if not isinstance(stages, dict) or len(stages) > MAX_STAGES:
        raise BadMessage(f"'pipeline' stages must be a map of at most {MAX_STAGES}, not {_show(stages)}")
    for name, figures in stages.items():
        if not isinstance(name, str) or not 0 < len(name) <= 32 or not name.isidentifier():
            raise BadMessage(f"a pipeline stage name that is not a short word ({_show(name)})")
        if not isinstance(figures, dict):
            raise BadMessage(f"pipeline stage {name}'s figures must be a map, not {_show(figures)}")
        kept: dict = {}
        for key, kind in STAGE_FIELDS.items():
            value = figures.get(key)
            if value is None:
                continue
            if kind is int and (type(value) is not int or not 0 <= value <= MAX_BYTES):
                raise BadMessage(f"pipeline stage {name}'s {key} is not a count ({_show(value)})")
            if kind is float and (type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= 1e9):
                raise BadMessage(f"pipeline stage {name}'s {key} is not a number of seconds ({_show(value)})")
            kept[key] = value
        out["stages"][name] = kept
    return out


def parse_codecs(raw: Any) -> tuple[str, ...]:
    """The codec identities a file's units were stored with, from a hostile peer (empty: none reported, raw)."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_CODECS:
        raise BadMessage(f"'codecs' must list at most {MAX_CODECS} codec identities, not {_show(raw)}")
    for ident in raw:
        if not isinstance(ident, str) or not 0 < len(ident) <= MAX_CODEC or text.printable(ident) != ident or " " in ident:
            raise BadMessage(f"a codec identity that is not a short printable word ({_show(ident)})")
    return tuple(sorted(set(raw)))


def merge_pipelines(reports: list[dict | None]) -> dict | None:
    """One node's figures from its ranks' (each parsed): bytes and CPU summed; a stage's busy, wall time and
    workers the largest of the node's ranks (they write at the same time: the node waits for the slowest)."""
    got = [r for r in reports if r]
    if not got:
        return None
    out: dict = {"in": sum(r["in"] for r in got), "out": sum(r["out"] for r in got), "stages": {}}
    for r in got:
        for name, figures in r["stages"].items():
            mine = out["stages"].setdefault(name, {})
            for key, value in figures.items():
                summed = key in ("cpu_s", "bytes_in", "bytes_out")
                mine[key] = (mine.get(key, 0) + value) if summed else max(mine.get(key, 0), value)
    for figures in out["stages"].values():
        for key in ("busy_s", "cpu_s", "wall_s"):
            if key in figures:
                figures[key] = round(figures[key], 6)
    return out


@dataclass(frozen=True)
class WriteReport:
    """What a rank says it wrote: checked before anything uses it.

    Besides the file's ``size`` and ``digest``: its ``role`` (:data:`ROLES`),
    the ``parent`` it is a delta of, the ``base`` its differentials anchor
    on, its ``links`` (every older generation a restore of it reads, newest
    first), the ``state`` it holds (logical bytes: the rank's whole state,
    not the file's) and the bytes a ``restore`` of it reads. A report of
    today's writer (size, digest, seconds) is a full file."""

    size: int
    digest: str
    seconds: float
    role: str = "full"
    parent: int | None = None
    base: int | None = None
    links: tuple[int, ...] = ()
    state: int = 0
    restore: int = 0
    pipeline: dict | None = None  # a compressed write's figures (:func:`parse_pipeline`)
    codecs: tuple[str, ...] = ()  # the codec identities its units were stored with (none: a raw file)

    @classmethod
    def parse(cls, result: Any, max_size: int, offer: DeltaOffer | None = None, gen: int | None = None) -> WriteReport:
        """Raises :class:`BadMessage` (a ValueError) with a sentence saying what is wrong.

        ``offer``: what the daemon offered the rank (None: nothing, so only a
        full file is accepted); its links must be a tail of the offered chain
        (what a restore of the file's newest link reads, and that link), at
        most ``chain_max`` long. ``gen``: the generation being written."""
        if not isinstance(result, dict):
            raise BadMessage("a malformed write result")
        size, digest, seconds = result.get("size"), result.get("digest"), result.get("seconds", 0.0)
        if type(size) is not int or size < 0:
            raise BadMessage(f"a state size that is not a byte count ({_show(size)})")
        if size > max_size:
            raise BadMessage(f"a state file of {size} bytes, more than the {max_size} bytes one rank may commit (checkpoint_max_rank_bytes)")
        if not isinstance(digest, str) or not 0 < len(digest) <= MAX_DIGEST:
            raise BadMessage("a malformed checksum")
        if type(seconds) not in (int, float) or not math.isfinite(seconds) or seconds < 0:
            raise BadMessage(f"a write time that is not a number of seconds ({_show(seconds)})")
        role = result.get("role", "full")
        if role is None:
            role = "full"
        if role not in ROLES:
            raise BadMessage(f"a file role that is not one of {', '.join(ROLES)} ({_show(role)})")
        links = cls._links(result.get("links"), role, offer)
        parent = _int(result, "parent", optional=True, lo=1)
        if role == "full" and parent is not None:
            raise BadMessage(f"a full file with a parent (generation {parent})")
        if role != "full" and parent != links[0]:
            raise BadMessage(f"a {role} file whose parent ({_show(parent)}) is not its newest link ({links[0]})")
        base = _int(result, "base", optional=True, lo=1)
        if base is not None and base not in links and base != gen:
            raise BadMessage(f"a base (generation {base}) that is neither this generation nor one of its links")
        chain = len(links) + 1
        state = _count(result, "state", size, MAX_BYTES)
        restore = _count(result, "restore", size, min(MAX_BYTES, max_size * chain))  # (each link's file is at most max_size)
        return cls(size, digest, float(seconds), role, parent, base, links, state, restore,
                   parse_pipeline(result.get("pipeline")), parse_codecs(result.get("codecs")))

    @staticmethod
    def _links(raw: Any, role: str, offer: DeltaOffer | None) -> tuple[int, ...]:
        if raw is None:
            raw = []
        if not isinstance(raw, (list, tuple)) or len(raw) > MAX_LINKS:
            raise BadMessage(f"'links' that are not a list of at most {MAX_LINKS} generations")
        if not all(type(g) is int for g in raw):
            raise BadMessage(f"'links' that are not generation numbers ({_show(raw)})")
        links = tuple(raw)
        if role == "full":
            if links:
                raise BadMessage(f"a full file that needs other generations ({_show(list(links))})")
            return links
        if not links:
            raise BadMessage(f"a {role} file that names no generation it needs")
        offered = offer.chain if offer is not None else ()
        if not offered:
            raise BadMessage(f"a {role} file, but no generation was offered to diff against (a full checkpoint was asked for)")
        stray = [g for g in links if g not in offered]
        if stray:
            raise BadMessage(f"links to generations {_show(stray)} that were not offered (offered: {list(offered)})")
        if links != offered[len(offered) - len(links):]:
            raise BadMessage(f"links {_show(list(links))} that are not the tail of the offered chain {list(offered)} (newest first, none skipped)")
        if offer is not None and len(links) + 1 > offer.chain_max:  # (the file itself is read too: delta.links_problem)
            raise BadMessage(f"a chain of {len(links) + 1} files, more than the {offer.chain_max} allowed (chain_max)")
        return links

    def to_wire(self) -> dict:
        out: dict = {"size": self.size, "digest": self.digest, "seconds": self.seconds}
        if self.role != "full" or self.links:
            out.update(role=self.role, parent=self.parent, base=self.base, links=list(self.links))
        if self.state != self.size:
            out["state"] = self.state
        if self.restore != self.size:
            out["restore"] = self.restore
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.codecs:
            out["codecs"] = list(self.codecs)
        return out


@dataclass(frozen=True)
class RankWritten:
    """``ckpt_written`` (a forked snapshot finished) or the ``result`` of
    ``ckpt_end``: either a report or the error that kept the rank from writing.
    The report itself is parsed against the node's size limit later
    (:meth:`WriteReport.parse`)."""

    op: ClassVar[str] = "ckpt_written"
    gen: int
    result: dict
    error: str = ""

    @classmethod
    def from_wire(cls, args: Any) -> RankWritten:
        args = _dict(args)
        gen = _int(args, "gen", lo=1)
        result = {k: v for k, v in args.items() if k != "gen"}
        error = result.get("error")
        return cls(gen, result, text.printable(text.brief(error, MAX_WHY, quote=False))[:MAX_WHY] if error else "")

    def to_wire(self) -> dict:
        return {"gen": self.gen, **self.result}


@dataclass(frozen=True)
class RankRestored:
    """``ckpt_restored``: the rank loaded its state (or could not, ``error``)."""

    op: ClassVar[str] = "ckpt_restored"
    gen: int | None
    error: str = ""

    @classmethod
    def from_wire(cls, args: Any) -> RankRestored:
        args = _dict(args)
        return cls(_int(args, "gen", optional=True, lo=1), _why(args, "error"))

    def to_wire(self) -> dict:
        out: dict = {"gen": self.gen}
        if self.error:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class RankRefused:
    """``ckpt_refused`` (a request): the rank's ``ckpt.init()`` refused its
    settings (a codec its machine lacks), ``error`` saying why. Answered
    once the node has it: the rank's exit, if the program ends on the
    error, cannot be seen before it."""

    op: ClassVar[str] = "ckpt_refused"
    error: str

    @classmethod
    def from_wire(cls, args: Any) -> RankRefused:
        error = _why(_dict(args), "error")
        if not error:
            raise BadMessage("'error' must say why")
        return cls(error)

    def to_wire(self) -> dict:
        return {"error": self.error}


@dataclass(frozen=True)
class StartSync:
    """``ckpt_start`` (a request): the rank is at the cut, blocked until the start sync."""

    op: ClassVar[str] = "ckpt_start"
    gen: int
    iteration: int | None

    @classmethod
    def from_wire(cls, args: Any) -> StartSync:
        args = _dict(args)
        return cls(_int(args, "gen", lo=1), _int(args, "iteration", optional=True, lo=-1, hi=MAX_ITERATION))

    def to_wire(self) -> dict:
        return {"gen": self.gen, "iteration": self.iteration}


@dataclass(frozen=True)
class EndSync:
    """``ckpt_end`` (a request): the rank wrote its state (``result``) or forked
    the snapshot that writes it (``background``); blocked until the end sync."""

    op: ClassVar[str] = "ckpt_end"
    gen: int
    result: dict | None = None
    background: bool = False

    @classmethod
    def from_wire(cls, args: Any) -> EndSync:
        args = _dict(args)
        result = args.get("result")
        if result is not None and not isinstance(result, dict):
            raise BadMessage(f"'result' must be a map, not {_show(result)}")
        return cls(_int(args, "gen", lo=1), result, bool(args.get("background", False)))

    def to_wire(self) -> dict:
        out: dict = {"gen": self.gen}
        if self.result is not None:
            out["result"] = self.result
        if self.background:
            out["background"] = True
        return out


MAX_T_ITER = 1e7  # seconds: an iteration longer than 115 days is not a measurement
MIN_T_ITER = 1e-9  # seconds: nor is one shorter than a nanosecond (the planner divides by it: 5e-324 made inf)


@dataclass(frozen=True)
class RankProgress:
    """``ckpt_progress``: a rank under ``--ckpt-every auto`` says where it is
    (the last boundary passed) and how long its iterations take without
    checkpoints (``t_iter``, seconds, smoothed): what the interval is planned
    in (issue 19). Sent every quarter second at most; a hostile rank can only make
    its own job's plan worse, within the bounds checked here."""

    op: ClassVar[str] = "ckpt_progress"
    iteration: int
    t_iter: float | None

    @classmethod
    def from_wire(cls, args: Any) -> RankProgress:
        args = _dict(args)
        t_iter = args.get("t_iter")
        if t_iter is not None and (type(t_iter) not in (int, float) or not MIN_T_ITER <= t_iter <= MAX_T_ITER):
            raise BadMessage(f"'t_iter' must be seconds from {MIN_T_ITER:g} to {MAX_T_ITER:g}, not {_show(t_iter)}")
        return cls(_int(args, "iteration", lo=-1, hi=MAX_ITERATION), None if t_iter is None else float(t_iter))

    def to_wire(self) -> dict:
        return {"iteration": self.iteration, "t_iter": self.t_iter}


#: What ranks send as notes, by op.
RANK_NOTES: dict[str, Any] = {m.op: m for m in (RankReport, RankWritten, RankRestored, RankProgress)}


def rank_note(op: str, args: Any) -> RankReport | RankWritten | RankRestored | RankProgress:
    """A rank's note, checked; raises :class:`BadMessage` (an unknown op too)."""
    kind = RANK_NOTES.get(op)
    if kind is None:
        raise BadMessage(f"no checkpoint note {text.printable(op)[:40]!r}")
    return kind.from_wire(args)


# ---------------------------------------------------------------- daemon -> rank


@dataclass(frozen=True)
class BeginNote:
    """A generation begins. ``at``: the iteration it was planned at (issue
    19's ``--ckpt-every auto``): no rank reports a boundary before it, so the
    cut is the planned iteration unless a rank is already past it."""

    op: ClassVar[str] = "ckpt_begin"
    gen: int
    at: int | None = None

    @classmethod
    def from_wire(cls, args: Any) -> BeginNote:
        args = _dict(args)
        return cls(_int(args, "gen", lo=1), _int(args, "at", optional=True, lo=0, hi=MAX_ITERATION))

    def to_wire(self) -> dict:
        return {"gen": self.gen} if self.at is None else {"gen": self.gen, "at": self.at}


@dataclass(frozen=True)
class PlanNote:
    """Paper 002's "checkpoint at iteration ``next``, then every ``every``"
    (issue 19): the rank asks for the checkpoint ``lead`` iterations before
    ``next`` (so that every rank hears of it before any passes it), and after
    each checkpoint plans the next ``every`` iterations on. ``every`` 0: no
    plan (the job's interval is not ``auto`` any more)."""

    op: ClassVar[str] = "ckpt_plan"
    next: int
    every: int
    lead: int = 0

    @classmethod
    def from_wire(cls, args: Any) -> PlanNote:
        args = _dict(args)
        return cls(_int(args, "next", lo=0, hi=MAX_ITERATION), _int(args, "every", lo=0, hi=MAX_ITERATION),
                   _int(args, "lead", optional=True, lo=0, hi=1 << 20) or 0)

    def to_wire(self) -> dict:
        return {"next": self.next, "every": self.every, "lead": self.lead}


@dataclass(frozen=True)
class CutNote:
    op: ClassVar[str] = "ckpt_cut"
    gen: int
    iteration: int

    @classmethod
    def from_wire(cls, args: Any) -> CutNote:
        args = _dict(args)
        return cls(_int(args, "gen", lo=1), _int(args, "iteration", lo=-1, hi=MAX_ITERATION))

    def to_wire(self) -> dict:
        return {"gen": self.gen, "iteration": self.iteration}


@dataclass(frozen=True)
class AbortNote:
    op: ClassVar[str] = "ckpt_abort"
    gen: int | None
    why: str = ""

    @classmethod
    def from_wire(cls, args: Any) -> AbortNote:
        args = _dict(args)
        return cls(_int(args, "gen", optional=True, lo=1), _why(args))

    def to_wire(self) -> dict:
        return {"gen": self.gen, "why": self.why}


@dataclass(frozen=True)
class NoneNote:
    """Nothing to checkpoint after all (the rank's own request was refused)."""

    op: ClassVar[str] = "ckpt_none"

    @classmethod
    def from_wire(cls, args: Any) -> NoneNote:
        _dict(args)
        return cls()

    def to_wire(self) -> dict:
        return {}


DAEMON_NOTES: dict[str, Any] = {m.op: m for m in (BeginNote, CutNote, AbortNote, NoneNote, PlanNote)}


def daemon_note(op: str, args: Any) -> BeginNote | CutNote | AbortNote | NoneNote | PlanNote | None:
    """A note from the daemon to a rank, or None if it is not one (ignored)."""
    kind = DAEMON_NOTES.get(op)
    if kind is None:
        return None
    try:
        return kind.from_wire(args)
    except BadMessage:
        return None


# ---------------------------------------------------------------- node -> coordinator (round answers)


@dataclass(frozen=True)
class BeginAnswer:
    """A node's answer to ``ckpt_begin``: the largest boundary its ranks reported."""

    iteration: int | None

    @classmethod
    def from_wire(cls, result: Any) -> BeginAnswer:
        return cls(_int(_dict(result), "iteration", optional=True, lo=-1, hi=MAX_ITERATION))

    def to_wire(self) -> dict:
        return {"iteration": self.iteration}


@dataclass(frozen=True)
class CommitAnswer:
    """A node's answer to ``ckpt_commit``: its timings and byte counts.

    ``bytes``: every file of the generation on the node; ``state_bytes``: the
    logical bytes of its ranks' state (what a full checkpoint writes);
    ``written``: the bytes of its ranks' files (less than ``state_bytes``
    for deltas); ``restore``: the bytes a restore of them reads (the files
    and the parts of their links); ``needs``: the older generations any of
    its files needs, newest first; ``modes``: how many rank files of each
    role. A node's answer without the last four (a daemon before deltas)
    reads as full files."""

    node: str
    ranks: int
    bytes: int
    state_bytes: int
    times: dict
    written: int = 0
    restore: int = 0
    needs: tuple[int, ...] = ()
    modes: dict = field(default_factory=dict)
    pipeline: dict | None = None  # its ranks' compressed writes together (:func:`merge_pipelines`)
    codecs: tuple[str, ...] = ()  # every codec identity its ranks' files were stored with

    @classmethod
    def from_wire(cls, result: Any) -> CommitAnswer:
        result = _dict(result)
        node = result.get("node")
        if not isinstance(node, str) or not 0 < len(node) <= 255:
            raise BadMessage(f"'node' must be a node name, not {_show(node)}")
        times = result.get("times")
        if not isinstance(times, dict) or len(times) > 64 or not all(
            isinstance(k, str) and type(v) in (int, float) and math.isfinite(v) for k, v in times.items()
        ):
            raise BadMessage("'times' must map phase names to seconds")
        ranks, total, state = _int(result, "ranks", hi=MAX_RANKS), _int(result, "bytes"), _int(result, "state_bytes")
        written = _int(result, "written") if result.get("written") is not None else state
        restore = _int(result, "restore") if result.get("restore") is not None else written
        needs = result.get("needs") or []
        if not isinstance(needs, list) or len(needs) > MAX_LINKS or not all(type(g) is int and 1 <= g <= MAX_GEN for g in needs):
            raise BadMessage(f"'needs' must list at most {MAX_LINKS} generations, not {_show(needs)}")
        modes = result.get("modes") or {}
        if not isinstance(modes, dict) or not all(k in ROLES and type(v) is int and 0 <= v <= MAX_RANKS for k, v in modes.items()):
            raise BadMessage(f"'modes' must count rank files by role ({', '.join(ROLES)}), not {_show(modes)}")
        return cls(node, ranks, total, state, dict(times), written, restore, tuple(sorted(set(needs), reverse=True)), dict(modes),
                   parse_pipeline(result.get("pipeline")), parse_codecs(result.get("codecs")))

    def to_wire(self) -> dict:
        out = {"node": self.node, "ranks": self.ranks, "bytes": self.bytes, "state_bytes": self.state_bytes, "times": dict(self.times),
               "written": self.written, "restore": self.restore, "needs": list(self.needs), "modes": dict(self.modes)}
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.codecs:
            out["codecs"] = list(self.codecs)
        return out


def generation_mode(modes: dict) -> str:
    """A generation's mode from its files' roles (summed over nodes):
    ``full``, ``incremental``, ``differential``, ``rebase`` (adaptive's new
    base: every file the blocks changed since the previous generation) or
    ``mixed`` (ranks whose files differ, e.g. some rebased, some not)."""
    roles = {role for role, count in modes.items() if count}
    if not roles or roles == {"full"}:
        return "full"
    if roles == {"incr"}:
        return "incremental"
    if roles == {"diff"}:
        return "differential"
    if roles == {"rebase"}:
        return "rebase"
    return "mixed"
