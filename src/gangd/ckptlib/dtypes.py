"""Array dtypes in a checkpoint's index, described as data, never unpickled by numpy.

A plain dtype is its ``str`` (``"<f8"``). A record or subarray dtype used to
be stored pickled, and numpy's own unpickling of a dtype (``__setstate__``)
trusts its state: a flipped byte in it crashed the reading process with a
segmentation fault (found by fuzzing old files). So a dtype is now
described as plain msgpack data and rebuilt only through numpy's public
constructor, which checks what it is given:

    plain     "<f8", "|S5", "<U3", "|V16"
    record    {"names": [..], "formats": [description, ..], "offsets": [..], "itemsize": n}
    subarray  {"sub": description, "shape": [..]}

Old (format 1) files' pickled dtypes are read by :func:`from_pickle`: a
restricted unpickler that records numpy's reduce arguments and state
without running any numpy code, whose result is checked and rebuilt as
above. Everything is bounded: depth, field count, sizes.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re

import numpy as np

MAX_DEPTH = 8
MAX_FIELDS = 4096
MAX_ITEMSIZE = 1 << 31
MAX_SUB_DIMS = 32
_FIXED = re.compile(r"[biufc]\d{1,2}|[mM]8")
_TIME_UNITS = frozenset({"Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "generic"})


def describe(dtype: np.dtype) -> str | dict:
    """The description of ``dtype`` (see the module docstring)."""
    if dtype.subdtype is not None:
        base, shape = dtype.subdtype
        return {"sub": describe(base), "shape": list(shape)}
    if dtype.names is not None:
        fields = [dtype.fields[name] for name in dtype.names]  # type: ignore[index]
        return {"names": list(dtype.names), "formats": [describe(f[0]) for f in fields],
                "offsets": [int(f[1]) for f in fields], "itemsize": dtype.itemsize}
    return dtype.str


def build(spec: object, depth: int = 0) -> np.dtype:
    """The dtype a description names; ValueError for anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("dtype nested too deep")
    if isinstance(spec, str) and len(spec) <= 64:
        dtype = np.dtype(spec)  # (the public constructor parses a string; "<f8", "|S5", "<M8[s]")
        if dtype.names is not None or dtype.subdtype is not None:
            raise ValueError(f"{spec!r} is not a plain dtype")
        if dtype.itemsize == 0 and dtype.kind in "SU":
            # (unsized: numpy says 0 bytes, but gives an array of it 1 byte per element, "U" 4: never what was written)
            raise ValueError(f"{spec!r} is a string dtype without a size")
    elif isinstance(spec, dict) and set(spec) == {"sub", "shape"}:
        shape = spec["shape"]
        if not isinstance(shape, list) or not 0 < len(shape) <= MAX_SUB_DIMS or not all(_count(n) for n in shape):
            raise ValueError("a subarray dtype with an unusable shape")
        dtype = np.dtype((build(spec["sub"], depth + 1), tuple(shape)))
    elif isinstance(spec, dict) and set(spec) == {"names", "formats", "offsets", "itemsize"}:
        names, formats, offsets, itemsize = spec["names"], spec["formats"], spec["offsets"], spec["itemsize"]
        if not (isinstance(names, list) and isinstance(formats, list) and isinstance(offsets, list)
                and 0 < len(names) == len(formats) == len(offsets) <= MAX_FIELDS):
            raise ValueError("a record dtype with unusable fields")
        if not all(isinstance(n, str) and 0 < len(n) <= 256 for n in names) or len(set(names)) != len(names):
            raise ValueError("a record dtype with unusable field names")
        if not _count(itemsize) or not all(_count(o) for o in offsets):
            raise ValueError("a record dtype with unusable offsets or size")
        built = [build(f, depth + 1) for f in formats]
        if any(o + f.itemsize > itemsize for o, f in zip(offsets, built, strict=True)):
            raise ValueError("a record dtype's field lies past its end")
        dtype = np.dtype({"names": names, "formats": built, "offsets": offsets, "itemsize": itemsize})
    else:
        raise ValueError("not a dtype description")
    if dtype.hasobject or dtype.itemsize > MAX_ITEMSIZE:
        raise ValueError(f"{dtype!r} is not a plain-data dtype")
    return dtype


def _count(n: object) -> bool:
    return type(n) is int and 0 <= n <= MAX_ITEMSIZE


# ---------------------------------------------------------------- format 1's pickled dtypes


class _Recipe:
    """What numpy's pickle of a dtype says: ``numpy.dtype(*args)`` then ``__setstate__(state)``."""

    def __init__(self, *args):
        self.args = args
        self.state: object = None

    def __setstate__(self, state) -> None:
        self.state = state


class _RecipeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("numpy", "dtype"):
            return _Recipe
        raise pickle.UnpicklingError(f"{module}.{name} is not a dtype")


#: The opcodes of numpy's pickle of a dtype (checked before unpickling:
#: CPython's unpickler allocates what a damaged length asks for first).
_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "MARK", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT",
    "GET", "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "INT",
    "SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "SHORT_BINBYTES", "BINBYTES", "SHORT_BINSTRING", "BINSTRING",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
})


def from_pickle(blob: bytes) -> np.dtype:
    """A format 1 file's pickled dtype, rebuilt from what the pickle says
    (no numpy code runs on it); ValueError for anything but a dtype."""
    for op, _, _ in pickletools.genops(blob):  # (a length past the end is refused here, unallocated)
        if op.name not in _OPCODES:
            raise ValueError(f"a pickled dtype does not use {op.name}")
    recipe = _RecipeUnpickler(io.BytesIO(blob)).load()
    return build(_spec(recipe, 0))


def _spec(recipe: object, depth: int) -> str | dict:
    if depth > MAX_DEPTH or not isinstance(recipe, _Recipe):
        raise ValueError("not a dtype")
    state = recipe.state
    if not (isinstance(state, tuple) and len(state) >= 8 and state[0] in (3, 4) and recipe.args and isinstance(recipe.args[0], str)):
        raise ValueError("not numpy's pickle of a dtype")
    endian, sub, names, fields, elsize = state[1], state[2], state[3], state[4], state[5]
    if endian not in ("<", ">", "|", "=") or not (_count(elsize) or elsize == -1):
        raise ValueError("a dtype with an unusable byte order or size")
    if sub is not None:
        if not (isinstance(sub, tuple) and len(sub) == 2 and isinstance(sub[1], tuple)):
            raise ValueError("an unusable subarray dtype")
        return {"sub": _spec(sub[0], depth + 1), "shape": list(sub[1])}
    if names is not None:
        if not (isinstance(names, tuple) and isinstance(fields, dict) and len(names) <= MAX_FIELDS):
            raise ValueError("an unusable record dtype")
        formats, offsets = [], []
        for name in names:
            field = fields.get(name) if isinstance(name, str) else None
            if not (isinstance(field, tuple) and len(field) in (2, 3)):
                raise ValueError("an unusable record field")
            formats.append(_spec(field[0], depth + 1))
            offsets.append(field[1])
        return {"names": list(names), "formats": formats, "offsets": offsets, "itemsize": elsize}
    order = endian if endian in "<>" else "|"
    kind = recipe.args[0][:1]
    if elsize == -1:  # (a fixed-size type: its size is in its name)
        if not _FIXED.fullmatch(recipe.args[0]):
            raise ValueError(f"a {recipe.args[0][:8]!r} dtype is not read from an old checkpoint")
        if kind not in "mM":
            return f"{order}{recipe.args[0]}"
        meta = state[8] if len(state) > 8 else None
        unit = meta[1] if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], tuple) and len(meta[1]) == 4 else None
        if not (unit and isinstance(unit[0], bytes) and unit[0].decode("ascii", "replace") in _TIME_UNITS
                and type(unit[1]) is int and 1 <= unit[1] <= MAX_ITEMSIZE):
            raise ValueError("an unusable datetime dtype")
        return f"{order}{recipe.args[0]}[{unit[1] if unit[1] != 1 else ''}{unit[0].decode()}]"
    if kind not in ("S", "U", "V"):
        raise ValueError(f"a {recipe.args[0][:8]!r} dtype is not read from an old checkpoint")
    if kind == "U":
        if elsize % 4:
            raise ValueError("an unusable unicode dtype")
        return f"{order}U{elsize // 4}"
    return f"|{kind}{elsize}"
