"""Block-level checkpoint files (format v2, ``GANGDCK2``): only the blocks that changed, restored block by block.

Issue 17 (paper 003's FHash): every protected value's bytes -- an array's
memory, a pickle's blob -- are cut into fixed blocks of ``block`` bytes (the
last one short; a block never spans two values). A block's xxh3-128 over
its raw bytes is its hash; the list of them is the value's *signature*.
A generation's file stores the blocks it chose to write (all of them, or
the ones whose hash differs from the reference generation's) and the full
signature of the state at that generation, so the next generation can be
compared with it by reading the index alone::

    "GANGDCK2" | stored blocks (value by value, ascending block index) | index | footer
    index  = msgpack {v: 2, iteration, extra, block, gen, role, parent, base, links, signed, overhead,
                      entries: [{name, kind, meta, nbytes, nblocks, whole, codec: "none"}]}
             + per entry: signature nblocks x 16 B (if signed) | present packbits(nblocks)
    footer = u64 index offset | u64 index length | 16 B xxh3-128(index) | "GANGDEND"

The index is at the end so blocks can be streamed (issue 18 compresses them
without knowing their sizes beforehand). ``whole``: the value is complete in
this file (new, or its kind, dtype, shape or size changed), so a chain
walk stops there for it. ``links``: every generation a restore of this file
reads, newest first; ``overhead``: the bytes of their magic, index and footer
(a restore reads each block once, so it reads the state's bytes plus that).

Restore (:func:`read_chain`) first finds every block in the chain's
indexes (nothing is allocated for a value no file holds), allocates each
value from the newest index, then walks the files newest to oldest, reading only the blocks not placed
yet, straight into the arrays (``preadv`` into their memory; a large array
all of whose blocks one file holds raw is a private mapping of that file
instead, :mod:`.mapped`, the newer files' blocks read over it), and
checks every placed block against the newest signature: a damaged link is a
:class:`StoreError` naming its path, the value and the block.

A file a user can write is hostile: every length, count, offset, block
size, dtype and shape of an index is checked against the file's size and
against each other before anything is allocated or read, and the footer's
hash covers the index. Files are opened without following symlinks and
must be regular files (a FIFO would hang a restart).

Hashing speed: one ``xxh3_128_digest`` call per block, each a row of a
numpy view of the value's bytes (no copy); the Python call is the cost,
which is why blocks are 16 KiB by default (``bench/delta.py`` sweeps the
size and prints the ratio to raw xxh3; :func:`hash_blocks`).
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from .. import ckptstore, directio
from ..checkpoint import delta
from ..ckptstore import StoreError
from . import mapped, units
from .units import pread as _pread
from .units import runs as _runs

MAGIC = b"GANGDCK2"
MAGIC3 = b"GANGDCK3"  # compressed units (issue 18, :mod:`.units`); written only when a codec other than none is asked for
END = b"GANGDEND"
FOOTER = struct.Struct("<QQ16s8s")  # index offset, index length, xxh3-128(index), END
SIG = 16  # bytes of one block's hash
DEFAULT_BLOCK = delta.DEFAULT_BLOCK_KIB << 10
MIN_BLOCK = 64
MAX_BLOCK = delta.MAX_BLOCK_KIB << 10
MAX_INDEX = 1 << 30  # bytes: 64 M blocks' hashes (1 TiB of state at 16 KiB); a larger index is refused unread
MAX_DIMS = 64
MAX_DTYPE = 1 << 16  # bytes of a dtype's description (a pickled record dtype with many fields)
CODECS = ("none",)
_ENTRY_KEYS = {"name", "kind", "meta", "nbytes", "nblocks", "whole", "codec"}
_INDEX_KEYS = {"v", "iteration", "extra", "block", "gen", "role", "parent", "base", "links", "signed", "overhead", "entries"}
_INDEX_KEYS3 = _INDEX_KEYS | {"unit", "codecs"}

_hash = xxhash.xxh3_128_digest
KICK = 4 << 20  # bytes: a delta's file is pushed to the disk in pieces this large while the rest is copied (through the cache only: GANGD_CKPT_DIRECT=0)


def _dtypes():
    """:mod:`.dtypes` (pickletools, its patterns), imported only for a dtype that is not a plain one."""
    from . import dtypes

    return dtypes


def _memory_cap() -> int:
    """The largest state a restore allocates: twice this machine's memory (it was in some machine's memory)."""
    try:
        return 2 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


# ====================================================================== the state, planned and hashed


@dataclass
class Value:
    """One protected value as bytes: ``data`` is the array's own memory (no copy) or the pickle."""

    name: str
    kind: str  # "nd" (raw array bytes) or "pk" (pickled)
    meta: dict
    nbytes: int
    data: memoryview
    sig: np.ndarray | None = None  # (nblocks, 16) uint8: the signature, once hashed


@dataclass
class State:
    """The values of one checkpoint, in order, cut into ``block``-byte blocks."""

    block: int
    values: list[Value]
    signed: bool = False

    @property
    def total(self) -> int:
        return sum(v.nbytes for v in self.values)


def nblocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block)


def _array_bytes(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data


def plan(values: Mapping[str, object], block: int = DEFAULT_BLOCK) -> State:
    """The values as byte buffers: arrays by reference, anything else pickled."""
    if type(block) is not int or not MIN_BLOCK <= block <= MAX_BLOCK:
        raise ValueError(f"a block size must be {MIN_BLOCK} to {MAX_BLOCK} bytes, not {block!r}")
    planned: list[Value] = []
    for name, value in values.items():
        if type(value) is np.ndarray and not value.dtype.hasobject:  # (subclasses: np.matrix, masked arrays... pickle)
            arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (keeps 0-d arrays 0-d)
            simple = arr.dtype.names is None and arr.dtype.subdtype is None
            # Records, padding and nested fields as a description numpy's public constructor rebuilds (never a pickle).
            dtype = arr.dtype.str if simple else _dtypes().describe(arr.dtype)
            planned.append(Value(name, "nd", {"dtype": dtype, "shape": list(arr.shape)}, arr.nbytes, _array_bytes(arr)))
        else:
            try:
                blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 -- pickling runs the value's own code: anything can fail; said as a TypeError
                raise TypeError(f"protected value {name!r} cannot be saved: {type(exc).__name__}: {exc}") from None
            planned.append(Value(name, "pk", {}, len(blob), memoryview(blob)))
    return State(block, planned)


def hash_blocks(data: memoryview, block: int) -> np.ndarray:
    """The xxh3-128 of each ``block`` bytes of ``data``: an (n, 16) uint8 array.

    One call per block, and the call is the cost: iterating the rows of a
    (n, block) numpy view of the bytes hands xxhash each block without a
    copy and with less per-block work than slicing a memoryview in Python
    (0.73x against 0.60x raw xxh3 at 16 KiB, CPU time, measured on the
    2-CPU machine; bench/delta.py prints it).
    """
    h = _hash
    full = len(data) // block
    rows = np.frombuffer(data, dtype=np.uint8, count=full * block).reshape(full, block)
    digests = [h(row) for row in rows]  # type: ignore[arg-type]  # (an ndarray row is a buffer)
    if full * block < len(data):
        digests.append(h(data[full * block :]))
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, SIG)


def reuse_unwritten(state: State, refs: Sequence[Index], watch) -> None:
    """Sign each tracked array from a reference generation's signature: its
    blocks not written since that generation's cut (``watch``, a
    :class:`.dirty.WriteWatch`) keep the hashes recorded there, the others are
    hashed. A value no reference covers is left for :func:`signature`."""
    h, block = _hash, state.block
    for v in state.values:
        if v.sig is not None or v.kind != "nd" or v.nbytes < 2 * block:
            continue
        start = np.frombuffer(v.data, dtype=np.uint8).ctypes.data
        for ref in refs:
            e = ref.entry(v.name) if ref.signed and ref.block == block else None
            if e is None or e.signature is None or (e.kind, e.meta, e.nbytes) != (v.kind, v.meta, v.nbytes):
                continue
            keep = watch.unchanged(v.name, ref.gen, start, v.nbytes, block)
            if keep is None or len(keep) != len(e.signature):
                continue
            sig = np.array(e.signature, dtype=np.uint8, copy=True)
            for i in np.flatnonzero(~keep).tolist():
                sig[i] = np.frombuffer(h(v.data[i * block : (i + 1) * block]), dtype=np.uint8)
            v.sig = sig
            break


def signature(values: Mapping[str, object] | State, block: int = DEFAULT_BLOCK) -> State:
    """Pass 1: the values planned (see :func:`plan`) and every block hashed."""
    state = values if isinstance(values, State) else plan(values, block)
    for v in state.values:
        if v.sig is None:
            v.sig = hash_blocks(v.data, state.block)
    state.signed = True
    return state


# ====================================================================== the index


@dataclass(frozen=True)
class Entry:
    """A value as one file's index describes it (checked against the file)."""

    name: str
    kind: str
    meta: dict
    nbytes: int
    nblocks: int
    whole: bool
    codec: str
    signature: np.ndarray | None  # (nblocks, 16) uint8, the full state's, if the file is signed
    present: np.ndarray  # (nblocks,) bool: the blocks this file stores
    offset: int  # where this value's first stored block starts in the file
    stored: int  # bytes of this value's stored blocks
    # Format 3 (compressed units, :mod:`.units`): each unit's [a, b) blocks, codec (a number in the file's table), stored length.
    units: tuple[tuple[int, int], ...] | None = None
    unit_codec: np.ndarray | None = None
    unit_len: np.ndarray | None = None

    def same_value(self, other: Entry) -> bool:
        """Whether blocks of ``other`` can stand in for blocks of this value (same kind, layout and size)."""
        return (self.kind, self.meta, self.nbytes) == (other.kind, other.meta, other.nbytes)


@dataclass(frozen=True)
class Index:
    """One v2 file's index, checked: see the module docstring for the fields."""

    path: Path
    size: int
    gen: int
    role: str
    parent: int | None
    base: int
    links: tuple[int, ...]
    iteration: int
    extra: dict
    block: int
    signed: bool
    overhead: int
    entries: tuple[Entry, ...]
    index_offset: int
    tail: bytes = field(repr=False, compare=False)  # index + footer, as read (the whole-file checksum covers them)
    version: int = 2
    codecs: tuple[str, ...] = ()  # format 3: the codec identities its units name (zstd:3@1)

    @property
    def own_overhead(self) -> int:
        """Bytes a restore reads of this file besides blocks: magic, index, footer."""
        return len(MAGIC) + len(self.tail)

    @property
    def depth(self) -> int:
        return len(self.links)

    @property
    def state(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @cached_property
    def _by_name(self) -> dict[str, Entry]:
        return {e.name: e for e in self.entries}

    def entry(self, name: str) -> Entry | None:
        """The value ``name`` (a dict: a scan per value made a restore or a diff of many values quadratic)."""
        return self._by_name.get(name)


#: The plain numeric dtypes' descriptions ("<f8", "|u1", ...) in either byte order: an index naming one is
#: decoded without :mod:`.dtypes` (whose import -- pickletools, re, its patterns -- each forked writer
#: otherwise paid again to read its parent's "<f8"); anything else goes through :func:`.dtypes.build`.
_PLAIN = frozenset(s for c in "?bBhHiIlLqQefdgFDG" for s in (np.dtype(c).str, np.dtype(c).newbyteorder().str))


def _dtype(spec: object, *, pickled: bool = False) -> np.dtype:
    """An index's dtype (:mod:`gangd.ckptlib.dtypes`); ``pickled``: a format 1
    file's pickled one is read too. ValueError for anything unusable."""
    if type(spec) is str and spec in _PLAIN:
        return np.dtype(spec)
    if isinstance(spec, bytes):
        if not pickled or len(spec) > MAX_DTYPE:
            raise ValueError("not a dtype description")
        return _dtypes().from_pickle(spec)
    return _dtypes().build(spec)


def _is_int(x: object, low: int = 0, high: int = 1 << 62) -> bool:
    return type(x) is int and low <= x <= high


def _decode(path: Path, size: int, index_offset: int, tail: bytes, version: int = 2) -> Index:
    """The index of ``tail`` (index + footer), every field checked; StoreError on anything off."""
    index = memoryview(tail)[: len(tail) - FOOTER.size]

    def bad(why: str) -> StoreError:
        return StoreError(f"{path} is corrupted: {why}")

    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(index), 1), strict_map_key=True)
    try:
        unpacker.feed(index)
        head = unpacker.unpack()
        used = unpacker.tell()
    except Exception as exc:  # noqa: BLE001 -- any way a damaged index fails to decode is a StoreError
        raise bad(f"unreadable index ({type(exc).__name__})") from None
    if not isinstance(head, dict) or set(head) != (_INDEX_KEYS3 if version == 3 else _INDEX_KEYS) or head["v"] != version:
        raise bad(f"its index is not a version {version} index")
    table: tuple[str, ...] = ()
    per = 0
    if version == 3:
        from ..codecs import CodecError, CodecId

        table, per = head["codecs"], head["unit"]
        if not isinstance(table, list) or len(table) > units.MAX_CODECS or not _is_int(per, 1, 1 << 30):  # (empty: no unit written)
            raise bad("its index has an unusable codec table or unit size")
        try:
            table = tuple(str(CodecId.parse(text)) for text in table)
        except CodecError as exc:
            raise bad(f"its codec table names no codec ({exc})") from None
        if not head["signed"]:
            raise bad("a compressed file is always signed (its blocks are checked after decompressing)")
    gen, role, parent, base, links = head["gen"], head["role"], head["parent"], head["base"], head["links"]
    block, signed, overhead, iteration, extra = head["block"], head["signed"], head["overhead"], head["iteration"], head["extra"]
    if not _is_int(gen) or role not in delta.ROLES or not isinstance(links, list) or not _is_int(block, MIN_BLOCK, MAX_BLOCK):
        raise bad("its index has an unusable generation, role, chain or block size")
    if type(signed) is not bool or not _is_int(overhead) or type(iteration) is not int or not isinstance(extra, dict):
        raise bad("its index has unusable fields")
    problem = delta.links_problem(gen, links, delta.MAX_CHAIN)
    if problem:
        raise bad(problem)
    if role == "full":
        chain_ok = parent is None and not links and base == gen
    else:
        chain_ok = signed and bool(links) and parent == links[0] and (base == gen if role == "rebase" else base in links)
        chain_ok = chain_ok and (role != "diff" or base == parent)
    if not chain_ok:
        raise bad(f"its index names an impossible chain (role {role}, parent {parent!r}, base {base!r}, links {links})")
    raw = head["entries"]
    if not isinstance(raw, list):
        raise bad("its index has no list of values")
    entries: list[Entry] = []
    names: set[str] = set()
    at, offset, total = used, len(MAGIC), 0
    cap = _memory_cap()
    for e in raw:
        if not isinstance(e, dict) or set(e) != _ENTRY_KEYS or not isinstance(e["name"], str) or e["name"] in names:
            raise bad("its index has a malformed or repeated value entry")
        name, kind, meta, nbytes, count, whole, codec = (e[k] for k in ("name", "kind", "meta", "nbytes", "nblocks", "whole", "codec"))
        what = f"value {name!r}"
        names.add(name)
        known = (isinstance(codec, str) and 0 < len(codec) <= 160) if version == 3 else codec in CODECS
        if kind not in ("nd", "pk") or not isinstance(meta, dict) or type(whole) is not bool or not known:
            raise bad(f"{what} has an unusable kind, layout or codec")
        if not _is_int(nbytes) or not _is_int(count) or count != nblocks(nbytes, block):
            raise bad(f"{what} has {count!r} blocks of {block} bytes for {nbytes!r} bytes")
        total += nbytes
        if total > cap:
            raise bad(f"its values add up to more than {cap} bytes, twice this machine's memory")
        if kind == "nd":
            shape = meta.get("shape")
            if set(meta) != {"dtype", "shape"} or not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(n) for n in shape):
                raise bad(f"{what} has an unusable shape")
            try:
                dtype = _dtype(meta["dtype"])
            except Exception as exc:  # noqa: BLE001 -- any way a damaged dtype fails is a StoreError
                raise bad(f"{what} has an unusable dtype ({exc})") from None
            expected = dtype.itemsize
            for n in shape:
                expected *= n
            if expected != nbytes:
                raise bad(f"{what} should hold {expected} bytes, the index says {nbytes}")
        elif meta:
            raise bad(f"{what} is a pickle with an array's layout")
        sig_len = count * SIG if signed else 0
        bits_len = -(-count // 8)
        if at + sig_len + bits_len > len(index):
            raise bad(f"its index is too short for {what}'s {count} blocks")
        sig = np.frombuffer(index, dtype=np.uint8, count=sig_len, offset=at).reshape(-1, SIG) if signed else None
        at += sig_len
        packed = np.frombuffer(index, dtype=np.uint8, count=bits_len, offset=at)
        at += bits_len
        present = np.unpackbits(packed, count=count).astype(bool) if count else np.zeros(0, bool)
        if count % 8 and packed[-1] & (0xFF >> (count % 8)):
            raise bad(f"{what}'s block map has bits beyond its last block")
        if (whole or role == "full") and not present.all():
            raise bad(f"{what} is marked complete in this file but misses blocks")
        if role == "full" and not whole:
            raise bad(f"{what} is not complete in a full checkpoint")
        n_present = int(np.count_nonzero(present))
        stored = n_present * block
        if count and present[-1]:
            stored -= count * block - nbytes  # the last block is short
        if version != 3:
            entries.append(Entry(name, kind, meta, nbytes, count, whole, codec, sig, present, offset, stored))
            offset += stored
            continue
        cuts = tuple(units.cut(present, per))
        if at + 9 * len(cuts) > len(index):
            raise bad(f"its index is too short for {what}'s {len(cuts)} compressed units")
        unit_codec = np.frombuffer(index, dtype=np.uint8, count=len(cuts), offset=at)
        at += len(cuts)
        unit_len = np.frombuffer(index, dtype="<u8", count=len(cuts), offset=at)
        at += 8 * len(cuts)
        raws = np.array([units.raw_length(a, b, block, nbytes) for a, b in cuts], dtype=np.int64)
        if len(cuts) and (int(unit_codec.max()) >= len(table) or int(unit_len.min()) < 1 or bool(np.any(unit_len > raws))):
            raise bad(f"{what} has a compressed unit with an unknown codec or a stored length of none or more than its raw bytes")
        raw_units = unit_codec == table.index(units.RAW) if units.RAW in table else np.zeros(len(cuts), bool)
        if bool(np.any(unit_len[raw_units] != raws[raw_units])):
            raise bad(f"{what} has a unit stored raw whose length is not its raw length")
        stored = int(unit_len.sum())
        entries.append(Entry(name, kind, meta, nbytes, count, whole, codec, sig, present, offset, stored, cuts, unit_codec, unit_len))
        offset += stored
    if at != len(index):
        raise bad(f"its index has {len(index) - at} bytes after its last value")
    if offset != index_offset:
        raise bad(f"its blocks take {offset - len(MAGIC)} bytes, but its index starts at {index_offset}")
    return Index(Path(path), size, gen, role, parent, base, tuple(links), iteration, extra, block, signed, overhead,
                 tuple(entries), index_offset, bytes(tail), version, table)


def _open(path: Path) -> int:
    try:
        return ckptstore.open_regular(path)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from None


def _index_of(fd: int, path: Path, expect_size: int | None = None) -> Index:
    size = os.fstat(fd).st_size
    if expect_size is not None and size != expect_size:
        raise StoreError(f"{path} is truncated or grew: {size} bytes, the manifest says {expect_size}")
    if size < len(MAGIC) + FOOTER.size:
        raise StoreError(f"{path} is truncated: {size} bytes cannot hold a checkpoint")
    magic = bytearray(len(MAGIC))
    _pread(fd, memoryview(magic), 0, path)
    if bytes(magic) not in (MAGIC, MAGIC3):
        raise StoreError(f"{path} is not a version 2 or 3 gangd checkpoint image (bad magic)")
    footer = bytearray(FOOTER.size)
    _pread(fd, memoryview(footer), size - FOOTER.size, path)
    index_offset, index_len, index_hash, end = FOOTER.unpack(footer)
    if end != END:
        raise StoreError(f"{path} is truncated or has trailing bytes: it does not end with its footer")
    if index_len > MAX_INDEX or index_offset < len(MAGIC) or index_offset + index_len + FOOTER.size != size:
        raise StoreError(f"{path} is corrupted: its footer places the index at {index_offset} (+{index_len}) in {size} bytes")
    tail = bytearray(index_len + FOOTER.size)
    _pread(fd, memoryview(tail), index_offset, path)
    if _hash(memoryview(tail)[:index_len]) != index_hash:
        raise StoreError(f"{path} is corrupted: its index does not match its checksum")
    return _decode(path, size, index_offset, bytes(tail), 3 if bytes(magic) == MAGIC3 else 2)


def read_index(path: Path, expect: Sequence | None = None) -> Index:
    """The checked index of a v2 file (``expect``: (size, checksum); only the size is checked, the blocks are not read)."""
    path = Path(path)
    fd = _open(path)
    try:
        return _index_of(fd, path, None if expect is None else int(expect[0]))
    finally:
        os.close(fd)


# ====================================================================== comparing and writing


@dataclass
class Diff:
    """Blocks of a state that differ from a reference: per value a mask, or
    None when the value has no comparable reference (new, or another kind,
    dtype, shape, size or block size); ``bytes``: the changed blocks' bytes."""

    changed: dict[str, np.ndarray | None]
    bytes: int


def _masked_bytes(mask: np.ndarray, nbytes: int, block: int) -> int:
    n = int(np.count_nonzero(mask))
    if n and mask[-1]:
        return n * block - (len(mask) * block - nbytes)
    return n * block


def diff(state: State, ref: Index | None) -> Diff:
    """Which blocks of the hashed ``state`` differ from ``ref``'s signature (vectorized per value)."""
    if not state.signed:
        raise ValueError("diff needs a hashed state (blocks.signature)")
    changed: dict[str, np.ndarray | None] = {}
    total = 0
    comparable = ref is not None and ref.signed and ref.block == state.block
    for v in state.values:
        e = ref.entry(v.name) if comparable and ref is not None else None
        if v.sig is None or e is None or e.signature is None or (e.kind, e.meta, e.nbytes) != (v.kind, v.meta, v.nbytes):
            changed[v.name] = None
            total += v.nbytes
        else:
            mask = np.any(v.sig != e.signature, axis=1)
            changed[v.name] = mask
            total += _masked_bytes(mask, v.nbytes, state.block)
    return Diff(changed, total)


def write_delta(path: Path, values: Mapping[str, object] | State, choice: delta.Choice, ref_sigs: Index | None, *,
                gen: int, iteration: int = 0, extra: dict | None = None, block: int = DEFAULT_BLOCK, durable: bool = True,
                changes: Diff | None = None, late: bool = False, codec: object = None, pipeline: object = None,
                after_copy: Callable[[], object] | None = None) -> dict:
    """Pass 2: write generation ``gen``'s file with the blocks ``choice`` asks for.

    ``values``: the values, or the :class:`State` pass 1 hashed (an unhashed
    state or a dict is written full and unsigned: mode ``full`` hashes
    nothing). ``ref_sigs``: the index of ``choice.against`` (None for a
    full); ``changes``: pass 1's :func:`diff` against it, if already made;
    ``late``: an unhashed full signed while its blocks go to disk (see :func:`encode`).
    Written atomically (temporary name, fsync unless ``durable=False``,
    rename). Returns {"size", "digest", "role", "parent", "base", "links",
    "state", "restore"}: ``state`` the values' bytes, ``restore`` the bytes
    a restore of this generation reads (each block once, plus every file's
    magic, index and footer).

    ``codec`` (a :class:`gangd.codecs.CodecSpec` other than ``none``): the blocks
    are compressed in units and written by a pipeline (format 3, :mod:`.units`;
    ``pipeline``: its :class:`gangd.pipeline.Settings`); the state is then hashed
    before it is written (a compressed file is always signed), and the result
    also has "stored" (the units' bytes), "pipeline" (bytes and busy time per stage) and "codecs" (the
    identities its units were stored with, as its index records them).
    ``after_copy``: see :func:`gangd.ckptstore.write_atomic`.
    """
    if _compressing(codec) and getattr(codec, "auto", False):
        values = values if isinstance(values, State) else plan(values, block)
        if all(str(units.choose(codec, v.data, _dtype(v.meta["dtype"]) if v.kind == "nd" else None)[0]) == "none" for v in values.values):
            # auto found nothing worth compressing (random data): the raw format and its direct write path, not
            # a pipeline copying every unit through its buffers to store it raw (bench/pipeline.py: 0.89x of raw
            # through the pipeline, under the 0.95x issue 18 asks of incompressible data)
            codec = None
    if _compressing(codec):
        late = False  # (encode hashes a compressed file's state before its units are written)
    direct = directio.wanted()
    signing = None
    if late and direct:
        # Written around the page cache, the blocks go at the disk's pace: a late full's signature is
        # hashed by a thread meanwhile (the index waits for it), not after the last block is on disk
        # (a 512 MiB first full: 0.63 s against 0.54 s unsigned, hashed after).
        values = values if isinstance(values, State) else plan(values, block)
        signing = threading.Thread(target=signature, args=(values,), name="gangd-ckpt-sign", daemon=True)
    chunks, result = encode(values, choice, ref_sigs, gen=gen, iteration=iteration, extra=extra, block=block, changes=changes,
                            late=late, kick=late and durable and not direct, codec=codec, pipeline=pipeline, path=Path(path),
                            signing=signing)
    # (A late full kicks its blocks once, before hashing them: see encode. Anything else starts the disk
    # on its blocks as they are copied, so the fsync after them waits for the last few MiB, not all.)
    try:
        if signing is not None:
            signing.start()
        size, digest = ckptstore.write_atomic(Path(path), chunks, durable=durable, kick=0 if late else KICK, stable=True,  # (views of the snapshot)
                                              direct=direct, after_copy=after_copy)
    finally:
        if signing is not None and signing.ident is not None:
            signing.join()  # (a failed write too: the thread reads the values, whose owner goes on after this)
    return {"size": size, "digest": digest, **result}


def _compressing(codec: object) -> bool:
    return codec is not None and getattr(codec, "name", "none") != "none"


def encode(values: Mapping[str, object] | State, choice: delta.Choice, ref_sigs: Index | None, *, gen: int, iteration: int = 0,
           extra: dict | None = None, block: int = DEFAULT_BLOCK, changes: Diff | None = None, late: bool = False,
           kick: bool = False, codec: object = None, pipeline: object = None, path: Path | None = None,
           signing: threading.Thread | None = None) -> tuple[list, dict]:
    """The file :func:`write_delta` writes, as a list of buffers (the values' blocks by reference), and its result fields.

    ``late`` (a full only): the state is hashed after its blocks are written,
    for the index's signature: the index is then a deferred chunk
    (:func:`gangd.ckptstore.write_chunks`) and the result's "restore" is
    filled in when it is built. ``kick``: before hashing, start the disk's
    writeback of the blocks (``sync_file_range``), so the hashing overlaps the
    disk instead of preceding the fsync (the dense case of :func:`save_generation`).
    ``signing`` (late only): a thread the caller runs :func:`signature` of ``values`` in while the
    blocks are written; the index waits for it instead of hashing.
    """
    state = values if isinstance(values, State) else plan(values, block)
    packed = _compressing(codec)
    # A compressed file is always signed (its blocks are checked after decompressing): an unhashed
    # full's blocks are hashed by a stage of the pipeline that writes them, on its own thread.
    hash_late = packed and not state.signed
    full = choice.role == "full"
    if choice.role not in delta.ROLES or full != (choice.against is None):
        raise ValueError(f"a {choice.role} checkpoint {'has no' if full else 'needs a'} reference generation")
    if late and (not full or state.signed):
        raise ValueError("only an unhashed full is signed after its blocks are written")
    if not _is_int(gen):
        raise ValueError(f"a generation is a non-negative integer, not {gen!r}")
    links: list[int] = []
    parent = base = None
    overhead = 0
    if not full:
        if not state.signed:
            raise ValueError("a delta needs a hashed state (blocks.signature)")
        if ref_sigs is None or ref_sigs.gen != choice.against or not ref_sigs.signed:
            raise ValueError(f"a delta against generation {choice.against} needs that generation's signed index")
        if ref_sigs.gen >= gen:
            raise ValueError(f"generation {gen} cannot be a delta against generation {ref_sigs.gen}")
        if changes is None or set(changes.changed) != {v.name for v in state.values}:
            changes = diff(state, ref_sigs)
        links = [ref_sigs.gen, *ref_sigs.links]
        parent = ref_sigs.gen
        base = ref_sigs.base
        overhead = ref_sigs.overhead + ref_sigs.own_overhead
    chunks: list = [MAGIC3 if packed else MAGIC]
    meta_entries: list[dict] = []
    presents: list[np.ndarray] = []
    offset = len(MAGIC)
    per = units.per_unit(state.block)
    todo: list[tuple[memoryview, object, int]] = []  # compressed: the units, in file order
    unit_at: list[tuple[Value, int, int]] = []  # compressed, hashed as written: each unit's value and blocks
    counts: list[int] = []  # compressed: units per value
    for v in state.values:
        count = nblocks(v.nbytes, state.block)
        mask = None if changes is None else changes.changed.get(v.name)
        whole = mask is None
        present = np.ones(count, dtype=bool) if mask is None else mask
        spec_text = "none"
        if packed:
            dtype = _dtype(v.meta["dtype"]) if v.kind == "nd" else None
            spec, itemsize = units.choose(codec, v.data, dtype)
            spec_text = str(spec)
            cuts = units.cut(present, per)
            todo.extend((v.data[a * state.block : min(b * state.block, v.nbytes)], spec, itemsize) for a, b in cuts)
            if hash_late:
                v.sig = np.empty((count, SIG), dtype=np.uint8)
                unit_at.extend((v, a, b) for a, b in cuts)
            counts.append(len(cuts))
        elif mask is None:
            if v.nbytes:
                chunks.append(v.data)
            offset += v.nbytes
        else:
            for a, b in _runs(mask):
                part = v.data[a * state.block : min(b * state.block, v.nbytes)]
                chunks.append(part)
                offset += len(part)
        meta_entries.append({"name": v.name, "kind": v.kind, "meta": v.meta, "nbytes": v.nbytes, "nblocks": count,
                             "whole": whole, "codec": spec_text})
        presents.append(present)
    result: dict[str, object] = {"role": choice.role, "parent": parent, "base": delta.base_of(gen, choice, base), "links": links, "state": state.total}
    written = None

    def tail() -> list[bytes]:
        raw: list[bytes] = []
        done = 0
        for number, (v, present) in enumerate(zip(state.values, presents, strict=True)):
            if state.signed and v.sig is not None:
                raw.append(v.sig.tobytes())
            raw.append(np.packbits(present).tobytes())
            if written is not None:
                n = counts[number]
                raw.append(np.array(written.unit_codec[done : done + n], dtype=np.uint8).tobytes())
                raw.append(np.array(written.unit_len[done : done + n], dtype="<u8").tobytes())
                done += n
        fields = {"v": 2, "iteration": iteration, "extra": extra or {}, "block": state.block, "gen": gen,
                  "role": choice.role, "parent": parent, "base": result["base"], "links": links,
                  "signed": state.signed, "overhead": overhead, "entries": meta_entries}
        end = offset
        if written is not None:
            fields.update({"v": 3, "unit": per, "codecs": written.codecs})
            end = len(MAGIC3) + written.written
        index = msgpack.packb(fields, use_bin_type=True) + b"".join(raw)
        # What a restore reads: every block once (this file's, stored compressed in a format-3 file: ``ckpt ls``
        # then shows the bytes on disk, not the state's; a link's blocks are counted raw), the links' overhead,
        # this file's header, index and footer.
        body = state.total if written is None else written.written + state.total - written.raw
        result["restore"] = body + overhead + len(MAGIC) + len(index) + FOOTER.size
        return [index, FOOTER.pack(end, len(index), _hash(index), END)]

    if packed:
        def hash_unit(key: int, data: memoryview) -> None:
            v, a, b = unit_at[key]
            v.sig[a:b] = hash_blocks(data, state.block)  # type: ignore[index]  # (allocated with the unit list)

        run, written = units.stream(path or Path(f"generation {gen}"), todo, pipeline, hash_unit if hash_late else None)

        def streamed(fd: int, digest, appender) -> tuple[int, list]:
            n, _ = run(fd, digest, appender)
            state.signed = state.signed or hash_late
            result["stored"] = written.written
            result["pipeline"] = {"in": written.raw, "out": written.written, "stages": written.stages}
            result["codecs"] = list(written.codecs)
            return n, tail()

        return [chunks[0], ckptstore.Streamed(streamed)], result

    if not late:
        return chunks + tail(), result

    def signed_tail(fd: int) -> list[bytes]:
        starter = None
        if kick:  # the blocks start for the disk now (from a thread: the call blocks while the disk's queue is full,
            # and ctypes lets go of the GIL), while this one hashes; the fsync after the index waits for what is left
            starter = threading.Thread(target=ckptstore.start_writeback, args=(fd,), name="gangd-writeback", daemon=True)
            starter.start()
        if signing is not None:
            signing.join()
        if not state.signed:  # (no thread, or it failed: here, where its error is raised)
            signature(state)
        if starter is not None:
            starter.join()
        return tail()

    return [*chunks, signed_tail], result


# ====================================================================== restoring a chain


@dataclass(frozen=True)
class Link:
    """An older generation's file a restore reads: ``expect`` (size, checksum) from its manifest, if known."""

    gen: int
    path: Path
    expect: tuple[int, str] | None = None


def _link(item: object) -> Link:
    if isinstance(item, Link):
        return item
    if isinstance(item, Mapping):
        gen, path, expect = item.get("gen"), item.get("path"), item.get("expect")
    elif isinstance(item, Sequence) and len(item) in (2, 3):
        gen, path, expect = item[0], item[1], item[2] if len(item) == 3 else None
    else:
        raise StoreError(f"a restore chain's link {item!r} is not (gen, path, expect)")
    if type(gen) is not int or gen < 0 or not isinstance(path, str | os.PathLike):
        raise StoreError(f"a restore chain's link {item!r} has no generation or path")
    if expect is not None and not (isinstance(expect, Sequence) and len(expect) == 2 and _is_int(expect[0]) and isinstance(expect[1], str)):
        raise StoreError(f"a restore chain's link {item!r} has an unusable expected size and checksum")
    return Link(gen, Path(path), None if expect is None else (expect[0], expect[1]))


def read_chain(path: Path, chain: Iterable = (), expect: Sequence | None = None, *, stats: dict | None = None,
               pipeline: object = None, map_values: bool | None = None) -> tuple[dict[str, object], int, dict]:
    """Restore the generation in ``path`` from it and its ``chain`` (its
    links, newest first: :class:`Link`, (gen, path[, expect]) or
    {"gen", "path", "expect"}); returns (values, iteration, extra).

    Every block is read once, straight into the new arrays. ``expect``:
    (size, checksum) of ``path`` from the manifest, checked as the file is
    read; a link's expected size is checked too (its checksum cannot be:
    only part of it is read). Every placed block is checked against the
    signature of ``path``'s generation. ``stats``, if given, gets "read"
    (bytes read), "blocks" (block bytes read) and "files". ``pipeline``: the
    :class:`gangd.pipeline.Settings` compressed units are read and
    decompressed with (None: the defaults). ``map_values``: large arrays
    are mappings of their files rather than copies (:mod:`.mapped`; None:
    as ``GANGD_CKPT_RESTORE`` says, by default they are).
    """
    path = Path(path)
    links = [_link(item) for item in chain]
    fds: list[int] = []
    read = blocks_read = 0
    try:
        fd = _open(path)
        fds.append(fd)
        top = _index_of(fd, path, None if expect is None else int(expect[0]))
        read += top.own_overhead
        if list(top.links) != [link.gen for link in links]:
            raise StoreError(f"{path} (generation {top.gen}) needs generations {list(top.links)}, "
                             f"but the restore was handed {[link.gen for link in links]}")
        files: list[tuple[Path, Index]] = [(path, top)]
        for number, link in enumerate(links, 1):
            fds.append(_open(link.path))
            index = _index_of(fds[-1], link.path, None if link.expect is None else link.expect[0])
            read += index.own_overhead
            if index.gen != link.gen or list(index.links) != [later.gen for later in links[number:]]:
                raise StoreError(f"{link.path} is not the link the chain of generation {top.gen} needs: it is generation "
                                 f"{index.gen} with links {list(index.links)}, expected generation {link.gen}")
            files.append((link.path, index))
        completes = _locate(path, top, files)  # (before anything is allocated: what a restore allocates, the files hold)
        values: dict[str, object] = {}
        views: dict[str, memoryview] = {}
        placed: dict[str, np.ndarray] = {}
        source: dict[str, np.ndarray] = {}  # per block: which file (0 = path, i = links[i-1]) it came from
        map_arrays = mapped.wanted() if map_values is None else map_values
        mapped_from: dict[str, int] = {}  # value -> the file it is a mapping of (its blocks there are in place)
        decoded: dict[str, np.ndarray] = {}  # per block: it was decompressed (the file's checksum covers what was decoded, not its output)
        for e in top.entries:
            try:
                if e.kind == "nd":
                    dtype = _dtype(e.meta["dtype"])
                    found = _mapping(files, fds, e, dtype, completes.get(e.name)) if map_arrays else None
                    if found is not None:
                        mapped_from[e.name], arr = found
                    else:
                        arr = np.empty(e.meta["shape"], dtype=dtype)
                    values[e.name], views[e.name] = arr, _array_bytes(arr)
                    if len(views[e.name]) != e.nbytes:  # (never trust numpy's idea of a size to match the index's)
                        raise ValueError(f"an array of it holds {len(views[e.name])} bytes")
                else:
                    blob = bytearray(e.nbytes)
                    values[e.name], views[e.name] = blob, memoryview(blob)
            except (MemoryError, ValueError) as exc:
                raise StoreError(f"cannot allocate value {e.name!r} of {path} ({e.nbytes} bytes): {exc}") from None
            placed[e.name] = np.zeros(e.nblocks, dtype=bool)
            source[e.name] = np.zeros(e.nblocks, dtype=np.int32)
            decoded[e.name] = np.zeros(e.nblocks, dtype=bool)
        digest = ckptstore.hasher() if expect is not None else None
        if digest is not None:
            digest.update(MAGIC3 if top.version == 3 else MAGIC)
        blocks_read += _place(fd, top, top, 0, views, placed, source, digest, pipeline, mapped_from, decoded)
        if digest is not None:
            digest.update(top.tail)
            if digest.hexdigest() != expect[1]:  # type: ignore[index]
                raise StoreError(f"{path} is corrupted: its checksum does not match the manifest")
        for number, (_, index) in enumerate(files[1:], 1):
            blocks_read += _place(fds[number], top, index, number, views, placed, source, None, pipeline, mapped_from, decoded)
        for e in top.entries:
            missing = int(np.count_nonzero(~placed[e.name]))
            if missing:
                raise StoreError(f"{files[-1][0]} ends the chain of {path} but value {e.name!r} still misses {missing} of its "
                                 f"{e.nblocks} blocks (a broken chain)")
    finally:
        for fd in fds:
            os.close(fd)
    if top.signed:
        for e in top.entries:
            if e.signature is None or not e.nblocks:
                continue
            # The raw blocks of ``path`` itself were covered by its checksum against the manifest, when there is one:
            # hashing them again would only find a writer that signed other bytes than it wrote. A decompressed
            # block is checked: the checksum covered its compressed bytes, not what this node's decoder made of them.
            only = (source[e.name] != 0) | decoded[e.name] if digest is not None else None
            first = _first_unsigned(views[e.name], top.block, e.signature, only)
            if first is not None:
                where = files[int(source[e.name][first])][0]
                raise StoreError(f"{where} is corrupted: block {first} of value {e.name!r} does not match "
                                 f"generation {top.gen}'s signature (restoring {path})")
    for e in top.entries:
        if e.kind == "pk":
            try:
                values[e.name] = pickle.loads(values[e.name])  # type: ignore[arg-type]  # (the program's own state)
            except Exception as exc:  # noqa: BLE001 -- a pickle that checked out but does not load: say so
                raise StoreError(f"{path} is corrupted: value {e.name!r} does not unpickle ({type(exc).__name__}: {exc})") from None
    if stats is not None:
        stats.update({"read": read + blocks_read, "blocks": blocks_read, "files": len(files)})
    return values, top.iteration, top.extra


def _first_unsigned(view: memoryview, block: int, signature: np.ndarray, only: np.ndarray | None) -> int | None:
    """The first block of ``view`` (of those ``only`` marks; None: all) whose hash is not its ``signature`` row."""
    spans = [(0, len(signature))] if only is None else _runs(only)
    for a, b in spans:
        bad = np.flatnonzero(np.any(hash_blocks(view[a * block : b * block], block) != signature[a:b], axis=1))
        if len(bad):
            return a + int(bad[0])
    return None


def _corrupt_link(top: Index, index: Index, e: Entry) -> StoreError | None:
    """Why ``index``'s file cannot stand in for blocks of ``top``'s value ``e``, or None."""
    mine = index.entry(e.name)
    if mine is None or not mine.same_value(e) or (index is not top and index.block != top.block):
        return StoreError(f"{index.path} is a corrupt link of generation {top.gen}'s chain: it does not hold value "
                          f"{e.name!r} as generation {top.gen} describes it")
    return None


def _locate(path: Path, top: Index, files: list[tuple[Path, Index]]) -> dict[str, tuple[int, int]]:
    """Every block of every value of ``top`` is stored by a file of its chain
    (``files``, newest first), walked as :func:`_place` will read them; a
    StoreError naming the file that breaks the chain otherwise. Run before
    the values are allocated, so a crafted index cannot make a restore
    allocate (and zero) more than its files hold. Returns, per value of any
    blocks, the file that completes it: (its number, the blocks it supplies)."""
    completes: dict[str, tuple[int, int]] = {}
    for e in top.entries:
        covered = np.zeros(e.nblocks, dtype=bool)
        for number, (_, index) in enumerate(files):
            if covered.all():
                break
            problem = _corrupt_link(top, index, e)
            if problem is not None:
                raise problem
            completes[e.name] = (number, int(np.count_nonzero(~covered)))
            covered |= index.entry(e.name).present  # type: ignore[union-attr]  # (checked just above)
        missing = int(np.count_nonzero(~covered))
        if missing:
            raise StoreError(f"{files[-1][0]} ends the chain of {path} but value {e.name!r} still misses {missing} of its "
                             f"{e.nblocks} blocks (a broken chain)")
    return completes


def _mapping(files: list[tuple[Path, Index]], fds: list[int], e: Entry, dtype: np.dtype,
             completes: tuple[int, int] | None) -> tuple[int, np.ndarray] | None:
    """Value ``e`` as a mapping of the file of the chain that completes it (``completes``: its number and
    the blocks it supplies, from :func:`_locate`), when that file holds all its blocks raw and supplies at
    least :data:`.mapped.MIN_SHARE` of them (see :mod:`.mapped`): (that file's number, the array); None:
    it is read (compressed there: decompressed into fresh memory; mostly newer blocks: read them)."""
    if completes is None:
        return None
    number, supplied = completes
    mine = files[number][1].entry(e.name)
    if mine is None or not mine.present.all() or mine.units is not None or supplied < mapped.MIN_SHARE * e.nblocks:
        return None
    arr = mapped.array(fds[number], mine.offset, e.nbytes, dtype, e.meta["shape"])
    return None if arr is None else (number, arr)


def _place(fd: int, top: Index, index: Index, number: int, views: dict[str, memoryview], placed: dict[str, np.ndarray],
           source: dict[str, np.ndarray], digest, pipeline: object = None, mapped_from: Mapping[str, int] | None = None,
           decoded: dict[str, np.ndarray] | None = None) -> int:
    """Read the blocks ``index``'s file holds that no newer file placed; returns the bytes read. A value
    that is a mapping of this file (``mapped_from``) has them in place already: they are only checksummed.
    ``decoded`` gets the blocks that were decompressed."""
    got = 0
    compressed: list[units.Job] = []  # a format 3 file's units, read and decompressed together below
    for e in top.entries:
        done = placed[e.name]
        if done.all():
            continue
        problem = _corrupt_link(top, index, e)
        mine = index.entry(e.name)
        if problem is not None or mine is None:
            raise problem or StoreError(f"{index.path} does not hold value {e.name!r}")
        need = mine.present & ~done
        if not need.any():
            continue
        if mine.units is not None and mine.unit_len is not None and mine.unit_codec is not None:
            compressed += units.jobs(e.name, index.codecs, mine.units, mine.unit_len, mine.unit_codec, mine.offset, views[e.name],
                                     need, top.block, e.nbytes)
            done |= need
            source[e.name][need] = number
            if decoded is not None:
                decoded[e.name] |= need
            continue
        stored_before = np.cumsum(mine.present) - mine.present  # stored blocks ahead of each block
        view, block = views[e.name], top.block
        in_place = mapped_from is not None and mapped_from.get(e.name) == number
        for a, b in _runs(need):
            part = view[a * block : min(b * block, e.nbytes)]
            if not in_place:
                _pread(fd, part, mine.offset + int(stored_before[a]) * block, index.path)
            if digest is not None:
                digest.update(part)
            got += len(part)
        done |= need
        source[e.name][need] = number
    if compressed:
        got += units.place(fd, index.path, compressed, digest, pipeline)
    return got


# ====================================================================== one generation, start to end


SAMPLE = 256  # blocks per value hashed to tell a dense change before the full pass (looks_dense)
_SAMPLE_MIN = 4 * SAMPLE  # a state of fewer blocks is hashed whole at once: the sample would save nothing


def looks_dense(state: State, refs: Sequence[Index], full_above: float = delta.DEFAULT_FULL_ABOVE) -> bool:
    """True when a sample of the state's blocks says that at least ``full_above``
    of its bytes changed against every one of ``refs`` (the parent and the base):
    then :func:`delta.choose` picks a full in every mode, and the full pass
    (hashing every block before anything is written) is not needed to know it.

    The sample is ``SAMPLE`` blocks per value at random places (a regular
    stride would alias with a regular update pattern), from a generator seeded
    by the state's layout, so the same state gives the same answer. A wrong
    "dense" only costs a full where a large delta would do: every full is
    self-contained and signed, so no restore chain depends on the guess.
    """
    if state.signed or not refs or sum(nblocks(v.nbytes, state.block) for v in state.values) < _SAMPLE_MIN:
        return False
    rng = np.random.default_rng([state.block, len(state.values), state.total])
    changed = [0.0] * len(refs)
    for v in state.values:
        count = nblocks(v.nbytes, state.block)
        entries = [ref.entry(v.name) if ref.signed and ref.block == state.block else None for ref in refs]
        comparable = [e is not None and e.signature is not None and (e.kind, e.meta, e.nbytes) == (v.kind, v.meta, v.nbytes)
                      for e in entries]
        picks = None
        if any(comparable) and count:
            picks = np.sort(rng.choice(count, SAMPLE, replace=False)) if count > SAMPLE else np.arange(count)
            if v.sig is not None:  # (signed already from a reference's signature: reuse_unwritten)
                sampled = v.sig[picks]
            else:
                sampled = np.frombuffer(b"".join(_hash(v.data[i * state.block : (i + 1) * state.block]) for i in picks.tolist()),
                                        dtype=np.uint8).reshape(-1, SIG)
        for k, e in enumerate(entries):
            if not comparable[k] or picks is None or e is None or e.signature is None:
                changed[k] += v.nbytes
            else:
                changed[k] += v.nbytes * float(np.mean(np.any(sampled != e.signature[picks], axis=1)))
    return all(c >= full_above * state.total for c in changed)


def save_generation(path: Path, values: Mapping[str, object], *, gen: int, iteration: int = 0, mode: str = delta.DEFAULT_MODE,
                    offered: Iterable = (), block: int = DEFAULT_BLOCK, chain_max: int = delta.DEFAULT_CHAIN_MAX,
                    threshold: float = delta.DEFAULT_THRESHOLD, full_above: float = delta.DEFAULT_FULL_ABOVE,
                    force_full: bool = False, extra: dict | None = None, durable: bool = True, codec: object = None,
                    pipeline: object = None, watch: object = None, after_copy: Callable[[], object] | None = None) -> dict:
    """Write generation ``gen`` of the values in ``mode``: hash (unless
    ``full``), compare with the offered parent and its base, :func:`delta.choose`,
    write. ``offered``: the parent generation's file first, then its chain
    (as for :func:`read_chain`); the daemon's ``ckpt_start`` offer, or the
    newest complete generation of a program run alone.

    A parent that cannot be read, or whose chain is not the one offered,
    makes this generation a full one (it then needs nothing older): a
    checkpoint does not fail because an older one is damaged. Returns
    :func:`write_delta`'s result plus "mode" and, when the parent was
    unusable, "why_full".

    When the generation is a full anyway -- no signed parent to compare
    with, or a sample shows nearly everything changed (:func:`looks_dense`)
    -- its blocks are written first and hashed for its signature while the
    disk writes them (no pass before the write); a dense full after a full
    is not signed at all, so a run of dense generations hashes every other
    one, and its next generation is a signed full (never a delta against an
    unsigned file). Dense adaptive then costs a plain full plus the sample.

    ``codec`` (a :class:`gangd.codecs.CodecSpec`; None or ``none``: raw, format 2
    exactly as before): the blocks written are compressed and written by a
    pipeline (:func:`write_delta`); ``auto`` picks per value, and writes the raw format
    when it picks ``none`` for every value.

    ``watch`` (a :class:`.dirty.WriteWatch`, in the process that cut this
    generation or its forked snapshot): the blocks of tracked arrays not
    written since the base's (or the parent's) cut are not hashed again
    (:func:`reuse_unwritten`). ``after_copy``: see :func:`gangd.ckptstore.write_atomic`.
    """
    if mode not in delta.MODES:
        raise ValueError(f"checkpoint mode {mode!r} is not one of {', '.join(delta.MODES)}")
    links = [_link(item) for item in offered]
    state = plan(values, block)
    why_full = None
    parent = base = None
    if mode != "full":
        if links and not force_full:
            try:
                parent = read_index(links[0].path, links[0].expect)
                if parent.gen != links[0].gen or list(parent.links) != [link.gen for link in links[1:]]:
                    raise StoreError(f"{links[0].path} is generation {parent.gen} with links {list(parent.links)}, "
                                     f"not the generation {links[0].gen} offered with links {[link.gen for link in links[1:]]}")
                if parent.base == parent.gen:
                    base = parent
                else:
                    where = next((link for link in links if link.gen == parent.base), None)
                    if where is None:
                        raise StoreError(f"{links[0].path} names base {parent.base}, which is not in its chain")
                    base = read_index(where.path, where.expect)
                    if base.gen != parent.base:
                        raise StoreError(f"{where.path} is generation {base.gen}, not the base {parent.base}")
            except StoreError as exc:
                why_full, parent, base = str(exc), None, None
        refs = (parent, base) if parent is not None and base is not None else None
        comparable = refs is not None and all(r.signed and r.block == state.block for r in refs)
        if comparable and watch is not None and refs is not None:
            reuse_unwritten(state, refs, watch)  # (the parent first: the fewest blocks written since its cut)
        dense = comparable and refs is not None and looks_dense(state, refs, full_above)
        if not comparable or dense:
            # A full, whatever the full pass would find: nothing to compare with, or nearly everything
            # changed. Its signature (which the next generation diffs against) is hashed while the disk
            # writes its blocks -- except after a signed full that was just as dense: a run of dense
            # generations signs every other one (the next is then a signed full, never a delta against
            # an unsigned one).
            sign = not (dense and parent is not None and parent.role == "full")
            result = write_delta(path, state, delta.FULL, None, gen=gen, iteration=iteration, extra=extra, durable=durable, late=sign,
                                 codec=codec, pipeline=pipeline, after_copy=after_copy)
            result["mode"] = mode
            if why_full is not None:
                result["why_full"] = why_full
            return result
        signature(state)
    if parent is None or base is None:
        choice = delta.FULL
    else:
        d_prev = diff(state, parent)
        d_base = d_prev if base is parent else diff(state, base)
        parent_ref, base_ref = delta.refs(parent.gen, parent.role, parent.base, parent.links)
        choice = delta.choose(mode, parent=parent_ref, base=base_ref, d_prev=d_prev.bytes, d_base=d_base.bytes, total=state.total,
                              chain_max=chain_max, threshold=threshold, full_above=full_above, force_full=force_full)
    ref, changes = None, None
    if choice.against is not None and parent is not None and base is not None:
        ref, changes = (parent, d_prev) if choice.against == parent.gen else (base, d_base)
    result = write_delta(path, state, choice, ref, gen=gen, iteration=iteration, extra=extra, durable=durable, changes=changes,
                         codec=codec, pipeline=pipeline, after_copy=after_copy)
    result["mode"] = mode
    if why_full is not None:
        result["why_full"] = why_full
    return result
