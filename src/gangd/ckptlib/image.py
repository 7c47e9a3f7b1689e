"""A rank's saved state: one file with every protected value, bit for bit.

Two formats, both read here (old generations stay readable):

* version 2 (``GANGDCK2``, written): the block format of :mod:`.blocks` --
  the values' bytes in fixed blocks, an index at the end with each value's
  layout and (when hashed) the signature the next generation is compared
  with. :func:`save` / :func:`chunks` write a *full* file, every block and
  no signature (mode ``full`` hashes nothing); incremental generations are
  written by :func:`.blocks.write_delta` and restored with their chain by
  :func:`.blocks.read_chain`. :func:`load` reads a self-contained one.
* version 1 (``GANGDCK1``, read only)::

      b"GANGDCK1" | header length (8 bytes, little endian) | header (msgpack) | payloads

  The header lists ``[name, kind, meta, nbytes]`` per value in payload order
  and the iteration the state belongs to.

numpy arrays (``kind "nd"``) are written straight from their memory and
read straight into a new array of the same dtype and shape -- no pickle,
no intermediate copy; anything else is pickled (``kind "pk"``).

Why read, not map: mapping the file copy-on-write would give the arrays
back in ~3 ms instead of ~20 ms per 64 MiB, but then the program's first
write to each 4 KiB page is a copy-on-write fault -- 40-70 ms more over a
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

# The block format's module is imported where a file is written or read, not
# with this one: a program that never checkpoints does not pay for it
# (bench/ckpt.py Table 2).
MAGIC = b"GANGDCK1"  # version 1, read only
MAGIC2 = b"GANGDCK2"  # version 2, written (blocks.MAGIC)
MAGIC3 = b"GANGDCK3"  # version 3 (compressed units), written when a codec is asked for (blocks.MAGIC3)
DEFAULT_BLOCK = 16 << 10  # blocks.DEFAULT_BLOCK (checkpoint.delta.DEFAULT_BLOCK_KIB)
_LEN = struct.Struct("<Q")


def _array_bytes(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data


def chunks(values: dict[str, object], iteration: int, extra: dict | None = None, *, gen: int = 0,
           block: int = DEFAULT_BLOCK) -> list:
    """A full version 2 file's content as a list of buffers (arrays by reference, nothing hashed)."""
    from ..checkpoint import delta
    from . import blocks

    return blocks.encode(values, delta.FULL, None, gen=gen, iteration=iteration, extra=extra, block=block)[0]


def save(path: Path, values: dict[str, object], iteration: int, extra: dict | None = None, *, gen: int = 0) -> tuple[int, str]:
    """Write the state atomically as a full version 2 file (temporary name, fsync, rename); returns (size, checksum)."""
    return ckptstore.write_atomic(path, chunks(values, iteration, extra, gen=gen))


def load(path: Path, expect: tuple[int, str] | None = None, pipeline: object = None,
         map_values: bool | None = None) -> tuple[dict[str, object], int, dict]:
    """Read a self-contained state file (version 1 or 2); returns (values, iteration, extra).

    With ``expect`` = (size, checksum) from the manifest, a short or altered
    file raises :class:`StoreError` naming it instead of loading garbage.
    A version 2 file that needs older generations (an incremental one) is
    refused here: :func:`.blocks.read_chain` restores it with its chain.
    """
    path = Path(path)
    try:
        fh = os.fdopen(ckptstore.open_regular(path), "rb", buffering=0)  # (no symlink, no FIFO)
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc.strerror or exc}") from None
    with fh:
        if fh.read(len(MAGIC2)) not in (MAGIC2, MAGIC3):
            fh.seek(0)
            return _load_v1(fh, path, expect)
    from . import blocks

    return blocks.read_chain(path, (), expect, pipeline=pipeline, map_values=map_values)


def _load_v1(fh, path: Path, expect: tuple[int, str] | None) -> tuple[dict[str, object], int, dict]:
    digest = ckptstore.hasher()
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

    def check_room(name: str, nbytes: object) -> int:
        if type(nbytes) is not int or nbytes < 0:
            raise StoreError(f"{path} is corrupted: value {name!r} has no usable size")
        if fh.tell() + nbytes > size:
            raise StoreError(f"{path} is truncated: value {name!r} needs {nbytes} bytes, the file has {size - fh.tell()} left")
        return nbytes

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
        entries = [(str(name), kind, dict(meta), nbytes) for name, kind, meta, nbytes in entries]
    except Exception as exc:  # noqa: BLE001 -- any way a corrupted header fails is a StoreError
        raise StoreError(f"{path} is corrupted: unreadable header ({exc})") from None
    from . import blocks

    values: dict[str, object] = {}
    pickled: dict[str, bytearray] = {}
    for name, kind, meta, nbytes in entries:
        if kind == "nd":
            try:
                dtype = blocks._dtype(meta["dtype"], pickled=True)  # (raw bytes never become object pointers; a pickled dtype runs no numpy code)
                shape = meta["shape"]
                if not isinstance(shape, list) or len(shape) > blocks.MAX_DIMS or not all(type(n) is int and n >= 0 for n in shape):
                    raise ValueError(f"shape {shape!r}")
                expected = dtype.itemsize
                for n in shape:
                    expected *= n
                if expected != nbytes:
                    raise StoreError(f"{path} is corrupted: array {name!r} should hold {expected} bytes, the header says {nbytes}")
                check_room(name, nbytes)
                arr = np.empty(shape, dtype=dtype)
                if arr.nbytes != nbytes:  # (numpy's idea of a size must be the header's)
                    raise StoreError(f"{path} is corrupted: array {name!r} of its dtype holds {arr.nbytes} bytes, the header says {nbytes}")
            except StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 -- any way a corrupted entry fails is a StoreError
                raise StoreError(f"{path} is corrupted: array {name!r} has an unusable dtype or shape ({exc})") from None
            read_exact(_array_bytes(arr))
            values[name] = arr
        else:
            blob = bytearray(check_room(name, nbytes))
            read_exact(blob)
            values[name] = pickled[name] = blob  # unpickled after the checksum matched
    if fh.read(1):
        raise StoreError(f"{path} has trailing bytes after its last value")
    if expect is not None and digest.hexdigest() != expect[1]:
        raise StoreError(f"{path} is corrupted: its checksum does not match the manifest")
    for name, blob in pickled.items():
        try:
            values[name] = pickle.loads(bytes(blob))  # (the program's own state; bytes: a damaged pickle can leave a bytearray exported)
        except Exception as exc:  # noqa: BLE001 -- a damaged pickle (no manifest to check it against): say so
            raise StoreError(f"{path} is corrupted: value {name!r} does not unpickle ({type(exc).__name__}: {exc})") from None
    extra = header.get("extra") or {}
    return values, iteration, extra if isinstance(extra, dict) else {}
