"""The checkpoint protocol's messages, typed and checked at the boundary.

A rank's bytes are hostile (it runs the user's code), and so are a peer's
until checked: each message is a frozen dataclass whose ``from_wire`` takes
the decoded msgpack arguments and raises :class:`BadMessage` with a sentence
saying what is wrong, and whose ``to_wire`` gives the arguments of the same
op as before (the wire protocol between daemons and ranks is unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
    return text.printable(repr(value))[:40]


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


@dataclass(frozen=True)
class WriteReport:
    """What a rank says it wrote: checked before anything uses it."""

    size: int
    digest: str
    seconds: float

    @classmethod
    def parse(cls, result: Any, max_size: int) -> WriteReport:
        """Raises :class:`BadMessage` (a ValueError) with a sentence saying what is wrong."""
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
        return cls(size, digest, float(seconds))

    def to_wire(self) -> dict:
        return {"size": self.size, "digest": self.digest, "seconds": self.seconds}


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
        return cls(gen, result, text.printable(str(error))[:MAX_WHY] if error else "")

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


#: What ranks send as notes, by op.
RANK_NOTES: dict[str, Any] = {m.op: m for m in (RankReport, RankWritten, RankRestored)}


def rank_note(op: str, args: Any) -> RankReport | RankWritten | RankRestored:
    """A rank's note, checked; raises :class:`BadMessage` (an unknown op too)."""
    kind = RANK_NOTES.get(op)
    if kind is None:
        raise BadMessage(f"no checkpoint note {text.printable(op)[:40]!r}")
    return kind.from_wire(args)


# ---------------------------------------------------------------- daemon -> rank


@dataclass(frozen=True)
class BeginNote:
    op: ClassVar[str] = "ckpt_begin"
    gen: int

    @classmethod
    def from_wire(cls, args: Any) -> BeginNote:
        return cls(_int(_dict(args), "gen", lo=1))

    def to_wire(self) -> dict:
        return {"gen": self.gen}


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


DAEMON_NOTES: dict[str, Any] = {m.op: m for m in (BeginNote, CutNote, AbortNote, NoneNote)}


def daemon_note(op: str, args: Any) -> BeginNote | CutNote | AbortNote | NoneNote | None:
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
    """A node's answer to ``ckpt_commit``: its timings and byte counts."""

    node: str
    ranks: int
    bytes: int
    state_bytes: int
    times: dict

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
        return cls(node, _int(result, "ranks", hi=MAX_RANKS), _int(result, "bytes"), _int(result, "state_bytes"), dict(times))

    def to_wire(self) -> dict:
        return {"node": self.node, "ranks": self.ranks, "bytes": self.bytes, "state_bytes": self.state_bytes, "times": dict(self.times)}
