"""A codec choice as a validated value: parsed once at the edge, a frozen dataclass after.

A user names a codec on the command line, in ``GANGD_CKPT_CODEC`` or in
``init(codec=...)``; a checkpoint records, per block, the codec that wrote
it. Both are text a hostile or mistaken hand may have written, so both go
through :meth:`CodecSpec.parse`, which accepts only these and says so::

    none                      raw bytes
    lz4                       lz4 block format
    zstd[:LEVEL]              zstandard, LEVEL 1..22 (default 3)
    blosc2[:INNER][:LEVEL][:FILTER]
                              blosc2 chunks: INNER lz4|lz4hc|zstd|blosclz|zlib (default zstd),
                              LEVEL 1..9 (default 1), FILTER shuffle|bitshuffle|bytedelta|nofilter
                              (default shuffle); the filter works on the value's item size
    auto                      chosen per value from a sample (:mod:`gangd.codecs.auto`)
    NAME[:PARAM...]           a plug-in codec (entry point group ``gangd.codecs``), its
                              parameters checked by the plug-in itself

The parsed value is canonical (defaults filled in, fixed order), so
``str(spec)`` is the same for every spelling of one choice: ``zstd`` and
``zstd:3`` are one spec. A block's *identity* is that text plus the
codec's format version, ``zstd:3@1`` (:class:`CodecId`): short enough to
store per block, and all a restart needs to pick the decoder, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import CodecError

BUILTIN = ("none", "lz4", "zstd", "blosc2")
AUTO = "auto"
ZSTD_LEVELS = range(1, 23)
ZSTD_DEFAULT = 3
BLOSC2_INNER = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
BLOSC2_FILTERS = ("shuffle", "bitshuffle", "bytedelta", "nofilter")
BLOSC2_LEVELS = range(1, 10)
BLOSC2_DEFAULT = ("zstd", "1", "shuffle")
MAX_TEXT = 128
MAX_PARAMS = 8
MAX_VERSION = 1 << 16
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_PARAM = re.compile(r"[A-Za-z0-9._+-]{1,32}")
_VERSION = re.compile(r"[1-9][0-9]{0,5}")
ACCEPTED = (
    "none, lz4, zstd[:1..22], blosc2[:zstd|lz4|lz4hc|blosclz|zlib][:1..9][:shuffle|bitshuffle|bytedelta|nofilter], "
    "auto, or a plug-in's NAME[:PARAM...]"
)


def _level(name: str, token: str, levels: range) -> str:
    if not token.isascii() or not token.isdigit() or int(token) not in levels:
        raise CodecError(name, f"level {token!r} is not one of {levels.start}..{levels.stop - 1}")
    return str(int(token))


def _blosc2(params: list[str]) -> tuple[str, ...]:
    inner, level, filt = None, None, None
    for token in params:
        if token in BLOSC2_INNER and inner is None:
            inner = token
        elif token in BLOSC2_FILTERS and filt is None:
            filt = token
        elif token.isascii() and token.isdigit() and level is None:
            level = _level("blosc2", token, BLOSC2_LEVELS)
        else:
            raise CodecError(
                "blosc2",
                f"parameter {token!r} is not accepted (at most one of each: inner codec {'|'.join(BLOSC2_INNER)}, "
                f"level 1..9, filter {'|'.join(BLOSC2_FILTERS)})",
            )
    return (inner or BLOSC2_DEFAULT[0], level or BLOSC2_DEFAULT[1], filt or BLOSC2_DEFAULT[2])


@dataclass(frozen=True)
class CodecSpec:
    """A canonical codec choice: ``name`` and its parameters in their fixed order (see the module docstring)."""

    name: str
    params: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: object) -> CodecSpec:
        """The spec ``text`` names, or :class:`CodecError` saying what is accepted."""
        if not isinstance(text, str):
            raise CodecError("?", f"a codec is named by a string, not {type(text).__name__} (accepted: {ACCEPTED})")
        if not text or len(text) > MAX_TEXT:
            raise CodecError(text[:MAX_TEXT] or "?", f"a codec spec is 1..{MAX_TEXT} characters (accepted: {ACCEPTED})")
        name, *params = text.split(":")
        if not _NAME.fullmatch(name):
            raise CodecError(name[:40], f"not a codec name (accepted: {ACCEPTED})")
        if len(params) > MAX_PARAMS or not all(_PARAM.fullmatch(p) for p in params):
            raise CodecError(name, f"parameters {text[len(name) + 1:]!r} are not {MAX_PARAMS} or fewer words of [A-Za-z0-9._+-]")
        if name in ("none", "lz4", AUTO):
            if params:
                raise CodecError(name, f"takes no parameters (accepted: {ACCEPTED})")
            return cls(name)
        if name == "zstd":
            if len(params) > 1:
                raise CodecError(name, "takes one parameter, the level 1..22 (zstd:9)")
            return cls(name, (_level(name, params[0], ZSTD_LEVELS) if params else str(ZSTD_DEFAULT),))
        if name == "blosc2":
            return cls(name, _blosc2(params))
        return cls(name, tuple(params))

    def __str__(self) -> str:
        return ":".join((self.name, *self.params))

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN

    @property
    def auto(self) -> bool:
        return self.name == AUTO


@dataclass(frozen=True)
class CodecId:
    """What a block records of the codec that wrote it: the canonical spec and the codec's format version."""

    spec: CodecSpec
    version: int

    @classmethod
    def parse(cls, text: object) -> CodecId:
        """``spec@version`` (a bare spec, as format-2 files' ``"none"``, is version 1); ``auto`` is never an identity."""
        if not isinstance(text, str) or len(text) > MAX_TEXT + 8:
            # (only a prefix is shown: str() of a whole hostile value would cost memory in proportion to it)
            shown = text[:40] if isinstance(text, str) else f"a {type(text).__name__}"
            raise CodecError("?", f"a block's codec identity is a short string, not {shown!r}")
        body, at, version = text.partition("@")
        spec = CodecSpec.parse(body)
        if spec.auto:
            raise CodecError(AUTO, "a block records the codec auto chose, never auto itself")
        if str(spec) != body:
            raise CodecError(spec.name, f"identity {text!r} is not canonical (expected {str(spec)!r})")
        if not at:
            return cls(spec, 1)
        if not _VERSION.fullmatch(version) or not 1 <= int(version) <= MAX_VERSION:
            raise CodecError(spec.name, f"identity {text!r}: the version after '@' is a number 1..{MAX_VERSION}")
        return cls(spec, int(version))

    def __str__(self) -> str:
        return f"{self.spec}@{self.version}"
