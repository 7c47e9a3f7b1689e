"""Where a codec comes from: the built-ins, or a plug-in's entry point, each loaded on first use.

Start-up cost matters: every rank imports gangd, and lz4, zstandard and
blosc2 together take tens of milliseconds to import (blosc2 alone most of
it; the README has the figures). So nothing here imports them, or even
``importlib.metadata``, until a codec is asked for: a built-in's module is
imported by name when first used, and entry points are scanned only for a
name that is not a built-in.

Plug-ins: a package declares an entry point in the group ``gangd.codecs``
whose name is the codec's name and whose object is a factory called with
the spec's parameters (a tuple of strings) returning a :class:`~gangd.codecs.base.Codec`
(``nvcomp = "gangd_nvcomp:make"``). A built-in's name cannot be taken by a
plug-in: a block written as ``zstd`` is always read by zstd.

Every way a codec can be absent -- its library not installed, no package
providing the plug-in, a plug-in whose import fails -- is a
:class:`CodecMissing` naming the codec and how to install it, because the
typical case is a restart on a machine set up differently from the one that
wrote the generation.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from .base import Codec
from .errors import CodecError, CodecMissing
from .spec import BUILTIN, CodecId, CodecSpec

GROUP = "gangd.codecs"
# name -> (module of gangd.codecs with make(params), the PyPI package it needs or None)
_BUILTINS: dict[str, tuple[str, str | None]] = {
    "none": ("rawcodec", None),
    "lz4": ("lz4codec", "lz4"),
    "zstd": ("zstdcodec", "zstandard"),
    "blosc2": ("blosc2codec", "blosc2"),
}
assert set(_BUILTINS) == set(BUILTIN)  # noqa: S101 -- the two lists are one fact kept in two modules

_lock = threading.Lock()
_codecs: dict[CodecSpec, Codec] = {}
_plugins: dict[tuple[str, ...], dict[str, Any]] = {}  # sys.path -> {name: EntryPoint}


def _plugin_points() -> dict[str, Any]:
    """The group's entry points by name, scanned once per ``sys.path`` (a path added later is scanned again)."""
    key = tuple(sys.path)
    found = _plugins.get(key)
    if found is None:
        from importlib.metadata import entry_points  # slow to import and to scan: only for a plug-in's name

        found = {ep.name: ep for ep in entry_points(group=GROUP) if ep.name not in _BUILTINS}
        _plugins.clear()
        _plugins[key] = found
    return found


def plugins() -> list[str]:
    """The names of the plug-in codecs installed here."""
    return sorted(_plugin_points())


def _builtin_factory(name: str) -> Callable[[tuple[str, ...]], Any]:
    module, package = _BUILTINS[name]

    def make(params: tuple[str, ...]) -> Any:
        try:  # the library is imported by the module or by its codec's constructor
            return importlib.import_module(f"{__package__}.{module}").make(params)
        except ImportError as e:
            raise CodecMissing(
                name, f"needs the Python package {package!r}, which cannot be imported here ({e})", f"install it: pip install {package}"
            ) from None

    return make


def _plugin_factory(name: str) -> Callable[[tuple[str, ...]], Any]:
    point = _plugin_points().get(name)
    if point is None:
        raise CodecMissing(
            name,
            f"is neither a built-in ({', '.join(BUILTIN)}) nor provided by an installed package (entry point group {GROUP!r})",
            f"install the package that provides the {name!r} codec (pip install <package>), then check: gangd codecs are listed "
            f"by importlib.metadata.entry_points(group={GROUP!r})",
        )
    dist = getattr(point.dist, "name", None) or "the package providing it"
    try:
        factory: Callable[[tuple[str, ...]], Any] = point.load()
    except ImportError as e:
        raise CodecMissing(
            name, f"is provided by {dist} ({point.value}), which cannot be imported ({e})", f"reinstall it: pip install --force-reinstall {dist}"
        ) from None
    except Exception as e:  # noqa: BLE001 -- a third-party module failing at import is this codec's failure, said as one
        raise CodecError(name, f"loading {point.value} from {dist} failed: {type(e).__name__}: {e}") from None
    if not callable(factory):
        raise CodecError(name, f"entry point {point.value} of {dist} is not a factory (a callable taking the spec's parameters)")
    return factory


def load(spec: CodecSpec | str) -> None:
    """Load ``spec``'s codec now (for ``auto``: every codec it may pick), or raise the
    :class:`CodecMissing`/:class:`CodecError` that its first use would.

    A job does this when it starts (``ckptlib.init``): a rank on a node set up without the codec
    then fails at once, saying which codec and how to install it, not at its first checkpoint
    hours later; and that first checkpoint does not pay the import (blosc2's alone is 0.4-0.6 s
    of CPU) while the job is blocked."""
    if isinstance(spec, str):
        spec = CodecSpec.parse(spec)
    if spec.auto:
        from .auto import CANDIDATES

        for each in CANDIDATES:
            get(each)
    else:
        get(spec)


def get(spec: CodecSpec | str) -> Codec:
    """The codec for ``spec`` (one instance per spec, shared by threads), or :class:`CodecError`/:class:`CodecMissing`."""
    if isinstance(spec, str):
        spec = CodecSpec.parse(spec)
    codec = _codecs.get(spec)
    if codec is not None:
        return codec
    if spec.auto:
        raise CodecError("auto", "auto is resolved per value (gangd.codecs.auto.choose), it compresses nothing itself")
    with _lock:
        codec = _codecs.get(spec)
        if codec is None:
            if spec.builtin and CodecSpec.parse(str(spec)) != spec:  # built by hand, not parsed: check it as parsed text
                raise CodecError(spec.name, f"parameters {spec.params!r} are not canonical (CodecSpec.parse gives {CodecSpec.parse(str(spec))})")
            factory = _builtin_factory(spec.name) if spec.builtin else _plugin_factory(spec.name)
            codec = _made(spec, factory)
            _codecs[spec] = codec
    return codec


def _made(spec: CodecSpec, factory: Callable[[tuple[str, ...]], Any]) -> Codec:
    try:
        codec = factory(spec.params)
    except CodecError:
        raise
    except (ValueError, TypeError) as e:
        raise CodecError(spec.name, f"parameters {':'.join(spec.params)!r} refused: {e}") from None
    if not isinstance(codec, Codec):
        raise CodecError(spec.name, f"the factory returned {type(codec).__name__}, not a codec (name, version, compress, decompress_into)")
    if codec.name != spec.name:
        raise CodecError(spec.name, f"the factory returned a codec named {codec.name!r}")
    if not isinstance(codec.version, int) or isinstance(codec.version, bool) or not 1 <= codec.version <= 1 << 16:
        raise CodecError(spec.name, f"its version {codec.version!r} is not a number 1..65536")
    return codec


def identity(spec: CodecSpec | str) -> CodecId:
    """What a block compressed with ``spec`` records (loads the codec: the version is the installed codec's)."""
    if isinstance(spec, str):
        spec = CodecSpec.parse(spec)
    return CodecId(spec, get(spec).version)


def for_block(ident: CodecId | str) -> Codec:
    """The codec that reads blocks recorded as ``ident``: the installed one, if it reads that version."""
    if isinstance(ident, str):
        ident = CodecId.parse(ident)
    codec = get(ident.spec)
    if ident.version > codec.version:
        raise CodecMissing(
            ident.spec.name,
            f"the block was written in version {ident.version} of its format; the installed codec reads up to {codec.version}",
            "upgrade the package that provides it" + (" (and gangd)" if ident.spec.builtin else ""),
        )
    return codec


def forget() -> None:
    """Drop the loaded codecs and the scanned entry points (after installing a plug-in into a running process)."""
    with _lock:
        _codecs.clear()
        _plugins.clear()
