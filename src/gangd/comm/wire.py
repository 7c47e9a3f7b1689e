"""Framing of the rank-to-rank data path: what one message looks like on a socket.

Every message is one frame::

    header (25 bytes, little endian) | meta (meta_len bytes) | payload (payload_len bytes)
    header = kind u8, tag i32, seq u64, meta_len u32, payload_len u64

``seq`` numbers the messages of one directed channel (sender -> receiver)
from 0; the receiver checks it, so a lost or doubled message is caught at
once instead of surfacing as wrong data later. Every connection opens with
the handshake of :mod:`.handshake` (HELLO frames, kind 0), which proves both
ends hold the job's token without sending it; no message frame is read
before it is done.

Payload kinds: numpy arrays travel as their raw bytes, with ``[dtype.str,
shape]`` as meta: never pickled, and a large one is not copied either (it is
sent from and received into the arrays themselves; a small one is cheaper to
copy next to its header). bytes and bytearray travel as is; anything else is
pickled.
"""

from __future__ import annotations

import ctypes
import enum
import pickle
import struct
from typing import Final

import msgpack
import numpy as np

from .errors import CommError

HEADER = struct.Struct("<BiQIQ")
HEADER_SIZE = HEADER.size

HELLO = 0
PICKLE = 1
BYTES = 2
BYTEARRAY = 3
NDARRAY = 4
KINDS = (PICKLE, BYTES, BYTEARRAY, NDARRAY)
#: Kinds whose payload is plain bytes the program may receive into its own buffer.
RAW_KINDS = (BYTES, BYTEARRAY, NDARRAY)

#: Meta is a dtype string and a shape; anything much larger is a corrupt header,
#: and refusing it keeps a garbage length from making us allocate gigabytes.
MAX_META = 4096

_meta_of: dict[tuple, bytes | None] = {}  # (dtype, shape) -> meta, or None if such arrays must be pickled
_array_of: dict[bytes, tuple] = {}  # meta -> (dtype, shape)
_CACHE_LIMIT = 512
#: Payloads up to this size are copied next to their header and sent with one send(): the
#: copy costs less than sendmsg() over two buffers (and, for arrays, than numpy's buffer export).
SMALL = 8 * 1024


class _Missing(enum.Enum):
    """``_UNKNOWN``: a (dtype, shape) not in ``_meta_of`` yet (None there means: pickle such arrays)."""

    UNKNOWN = enum.auto()


_UNKNOWN: Final = _Missing.UNKNOWN


def _array_meta(dtype: np.dtype, shape: tuple) -> bytes | None:
    """The meta of arrays of this dtype and shape, None if they cannot travel as raw bytes:
    object arrays (pointers) and structured ones (``dtype.str`` drops the fields)."""
    if len(_meta_of) >= _CACHE_LIMIT:
        _meta_of.clear()
    meta = None
    if not dtype.hasobject and dtype.fields is None and np.dtype(dtype.str) == dtype:
        meta = msgpack.packb([dtype.str, list(shape)])
    _meta_of[(dtype, shape)] = meta
    return meta


def parse_array_meta(meta: bytes) -> tuple[np.dtype, tuple]:
    found = _array_of.get(meta)
    if found is None:
        try:
            dtype_str, shape = msgpack.unpackb(meta)
            found = (np.dtype(dtype_str), tuple(int(n) for n in shape))
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise CommError(f"corrupt array description in a message: {exc}") from None
        if len(_array_of) >= _CACHE_LIMIT:
            _array_of.clear()
        _array_of[meta] = found
    return found


def encode(obj) -> tuple[int, bytes, object, int]:
    """(kind, meta, payload buffer, payload length) of one object to send.

    The payload buffer is the caller's own object where possible (no copy):
    the send completes before ``send`` returns, so nothing keeps it afterwards.
    """
    t = type(obj)
    if t is bytes:
        return BYTES, b"", obj, len(obj)
    if t is np.ndarray:
        key = (obj.dtype, obj.shape)
        meta = _meta_of.get(key, _UNKNOWN)
        if meta is _UNKNOWN:
            meta = _array_meta(*key)
        if meta is not None:
            nbytes = obj.nbytes
            if nbytes <= SMALL:
                # The bytes get copied next to the header anyway; tobytes() also lays out any
                # strides in C order, and costs less than asking numpy for the flags and a buffer.
                return NDARRAY, meta, obj.tobytes(), nbytes
            if not obj.flags.c_contiguous:
                obj = np.ascontiguousarray(obj)
            return NDARRAY, meta, obj, nbytes
    elif t is bytearray:
        return BYTEARRAY, b"", obj, len(obj)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return PICKLE, b"", data, len(data)


def byte_view(payload) -> memoryview:
    """A flat unsigned-byte view of a (C-contiguous) payload buffer, for partial sends and receives."""
    try:
        view = memoryview(payload)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (ValueError, TypeError):
        # numpy exports no buffer for datetime64/timedelta64 arrays, memoryview
        # will not cast empty multi-dimensional ones: view those as bytes in numpy.
        if type(payload) is not np.ndarray or not payload.flags.c_contiguous:
            raise  # (reshape would copy a non-contiguous array: writes into the view would be lost)
        return payload.reshape(-1).view(np.uint8).data


def allocate(kind: int, meta: bytes, nbytes: int) -> tuple[object, memoryview]:
    """A fresh payload object for an incoming message and a writable byte view of it."""
    if kind == NDARRAY:
        dtype, shape = parse_array_meta(meta)
        array = np.empty(shape, dtype)
        if array.nbytes != nbytes:
            raise CommError(f"array message of {nbytes} bytes claims shape {shape} of {dtype} ({array.nbytes} bytes)")
        return array, byte_view(array)
    if kind not in KINDS:
        raise CommError(f"message of unknown kind {kind}")
    if kind == BYTES and nbytes > 1:
        return _unfilled_bytes(nbytes)
    buf = bytearray(nbytes)
    return buf, memoryview(buf)


# A large bytes message is received straight into the bytes object the program
# gets: created unfilled and written once, the way C code builds bytes
# (PyBytes_FromStringAndSize(NULL, n), then fill it before anyone sees it).
# Receiving into a bytearray instead would cost a second copy of the whole
# payload at the end, which halves the bandwidth of large bytes messages.
_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.restype = ctypes.c_void_p
_PyBytes_AsString.argtypes = (ctypes.py_object,)


def _unfilled_bytes(nbytes: int) -> tuple[bytes, memoryview]:
    """A new bytes object of ``nbytes`` (> 1: shorter ones are shared singletons) and a writable view of its bytes."""
    obj = _PyBytes_FromStringAndSize(None, nbytes)
    return obj, memoryview((ctypes.c_char * nbytes).from_address(_PyBytes_AsString(obj))).cast("B")


def materialize(kind: int, meta: bytes, buf, offset: int, nbytes: int) -> object:
    """The payload object of a message whose bytes are all at hand in ``buf[offset:offset + nbytes]``, copied once."""
    if kind == NDARRAY:
        dtype, shape = parse_array_meta(meta)
        itemsize = dtype.itemsize
        if nbytes and itemsize:
            count = nbytes // itemsize
            if count * itemsize != nbytes:
                raise CommError(f"array message of {nbytes} bytes is no whole number of {dtype} items")
            # An array over a fresh bytearray copy of the bytes: writable, C-ordered, and
            # several times cheaper than np.empty and a byte view to copy into.
            data = buf[offset : offset + nbytes] if type(buf) is bytearray else bytearray(memoryview(buf)[offset : offset + nbytes])
            array = np.frombuffer(data, dtype)
            if shape == (count,):
                return array
            try:
                return array.reshape(shape)
            except ValueError:
                raise CommError(f"array message of {nbytes} bytes claims shape {shape} of {dtype}") from None
        return allocate(kind, meta, nbytes)[0]
    view = memoryview(buf)[offset : offset + nbytes]
    if kind == BYTES or kind == PICKLE:
        return bytes(view)
    if kind == BYTEARRAY:
        return bytearray(view)
    raise CommError(f"message of unknown kind {kind}")


def decode(kind: int, meta: bytes, payload) -> object:
    """The object a payload stands for, as the program sees it."""
    if kind == BYTES:
        return payload if type(payload) is bytes else bytes(payload)
    if kind == NDARRAY:
        return payload
    if kind == PICKLE:
        # The connection's peer proved it holds this job's token before a byte of a message was read (the
        # handshake): another rank of the same job and user, so this runs only that user's own code. (The frames
        # after the handshake are not authenticated: the README's security model trusts the cluster network.)
        return pickle.loads(payload)  # noqa: S301 -- a rank of the same job and user, proven by the HMAC handshake
    if kind == BYTEARRAY:
        return payload if type(payload) is bytearray else bytearray(payload)
    raise CommError(f"message of unknown kind {kind}")


def payload_bytes(payload) -> bytes:
    """The payload's bytes, for a saved network context."""
    if type(payload) is bytes:
        return payload
    return bytes(byte_view(payload))
