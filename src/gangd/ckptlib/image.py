"""A rank's saved state: one file with every protected value, bit for bit.

Layout::

    b"GANGDCK1" | header length (8 bytes, little endian) | header (msgpack) | payloads

The header lists ``[name, kind, meta, nbytes]`` per value in payload order
and the iteration the state belongs to. numpy arrays (``kind "nd"``) are
written straight from their memory and read straight into a new array of
the same dtype and shape — no pickle, no intermediate copy; anything else is
pickled (``kind "pk"``).

Why read, not map: mapping the file copy-on-write would give the arrays
back in ~3 ms instead of ~20 ms per 64 MiB, but then the program's first
write to each 4 KiB page is a copy-on-write fault — 40-70 ms more over a
first full sweep of 64 MiB (measured), where the read fills huge pages
with one bulk copy. A restart should not be quick at the cost of the
program's first iteration. The file's checksum is computed while it is written
and checked while it is read.
"""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import msgpack
import numpy as np

from .. import ckptstore
from ..ckptstore import StoreError

MAGIC = b"GANGDCK1"
_LEN = struct.Struct("<Q")


def _array_bytes(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data


def _plan(values: dict[str, object]) -> tuple[list, list[memoryview | bytes]]:
    entries: list = []
    payloads: list[memoryview | bytes] = []
    for name, value in values.items():
        if type(value) is np.ndarray and not value.dtype.hasobject:  # (subclasses: np.matrix, masked arrays... pickle)
            arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # (keeps 0-d arrays 0-d)
            simple = arr.dtype.names is None and arr.dtype.subdtype is None
            # Records, padding and nested fields survive only a pickled dtype; plain ones stay readable.
            dtype = arr.dtype.str if simple else pickle.dumps(arr.dtype, protocol=pickle.HIGHEST_PROTOCOL)
            entries.append([name, "nd", {"dtype": dtype, "shape": list(arr.shape)}, arr.nbytes])
            payloads.append(_array_bytes(arr))
        else:
            try:
                blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 -- pickling runs the value's own code: anything can fail; said as a TypeError
                raise TypeError(f"protected value {name!r} cannot be saved: {type(exc).__name__}: {exc}") from None
            entries.append([name, "pk", {}, len(blob)])
            payloads.append(blob)
    return entries, payloads


def chunks(values: dict[str, object], iteration: int, extra: dict | None = None) -> list:
    """The file's content as a list of buffers (arrays by reference)."""
    entries, payloads = _plan(values)
    header = msgpack.packb({"v": 1, "iteration": iteration, "entries": entries, "extra": extra or {}}, use_bin_type=True)
    return [MAGIC + _LEN.pack(len(header)) + header, *payloads]


def save(path: Path, values: dict[str, object], iteration: int, extra: dict | None = None) -> tuple[int, str]:
    """Write the state atomically (temporary name, fsync, rename); returns (size, checksum)."""
    return ckptstore.write_atomic(path, chunks(values, iteration, extra))


def load(path: Path, expect: tuple[int, str] | None = None) -> tuple[dict[str, object], int, dict]:
    """Read a state file; returns (values, iteration, extra).

    With ``expect`` = (size, checksum) from the manifest, a short or altered
    file raises :class:`StoreError` naming it instead of loading garbage.
    """
    path = Path(path)
    digest = ckptstore.hasher()
    try:
        fh = open(path, "rb", buffering=0)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror}") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if expect is not None and size != expect[0]:
            raise StoreError(f"{path} is truncated or grew: {size} bytes, the manifest says {expect[0]}")

        def read_exact(buf) -> None:
            view = memoryview(buf).cast("B")
            got = 0
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    raise StoreError(f"{path} is truncated (ends after {fh.tell()} bytes)")
                got += n
            digest.update(view)

        head = bytearray(len(MAGIC) + _LEN.size)
        read_exact(head)
        if bytes(head[: len(MAGIC)]) != MAGIC:
            raise StoreError(f"{path} is not a gangd checkpoint image (bad magic)")
        (length,) = _LEN.unpack_from(head, len(MAGIC))
        if len(head) + length > size:
            raise StoreError(f"{path} is truncated: its header needs {len(head) + length} bytes, the file has {size}")
        header_bytes = bytearray(length)
        read_exact(header_bytes)
        try:
            header = msgpack.unpackb(header_bytes, raw=False)
            entries, iteration = header["entries"], header["iteration"]
        except Exception as exc:  # noqa: BLE001 -- any way a corrupted header fails is a StoreError
            raise StoreError(f"{path} is corrupted: unreadable header ({exc})") from None
        values: dict[str, object] = {}
        pickled: dict[str, bytearray] = {}
        for name, kind, meta, nbytes in entries:
            if kind == "nd":
                try:
                    dtype = np.dtype(meta["dtype"]) if isinstance(meta["dtype"], str) else pickle.loads(meta["dtype"])
                    if not isinstance(dtype, np.dtype) or dtype.hasobject:  # (raw bytes never become object pointers)
                        raise ValueError(f"{dtype!r} is not a plain dtype")
                    arr = np.empty(meta["shape"], dtype=dtype)
                except Exception as exc:  # noqa: BLE001 -- any way a corrupted entry fails is a StoreError
                    raise StoreError(f"{path} is corrupted: array {name!r} has an unusable dtype or shape ({exc})") from None
                if arr.nbytes != nbytes:
                    raise StoreError(f"{path} is corrupted: array {name!r} should hold {arr.nbytes} bytes, the header says {nbytes}")
                read_exact(_array_bytes(arr))
                values[name] = arr
            else:
                blob = bytearray(nbytes)
                read_exact(blob)
                values[name] = pickled[name] = blob  # unpickled after the checksum matched
        if fh.read(1):
            raise StoreError(f"{path} has trailing bytes after its last value")
    if expect is not None and digest.hexdigest() != expect[1]:
        raise StoreError(f"{path} is corrupted: its checksum does not match the manifest")
    for name, blob in pickled.items():
        values[name] = pickle.loads(blob)
    return values, iteration, header.get("extra") or {}
