"""The interface every codec implements, built-in or plug-in, and the bounds they all keep.

Small on purpose, so an accelerator (a GPU codec in the style of nvCOMP)
can be plugged in without the checkpoint pipeline knowing it: a codec
compresses one buffer into another and decompresses into a buffer the
caller owns. The caller always knows the exact decompressed size (a block's
size is in the checkpoint's index), so :meth:`Codec.decompress_into` is given
the destination and must fill it exactly: a decoder never allocates what
the compressed bytes *claim* (a hostile frame can claim terabytes), and
input that would produce more or fewer bytes is a :class:`CodecError`.

``name`` is the spec's name (``zstd``); ``version`` is the version of the
*format the codec writes*: a plug-in raises it whenever its output changes
so that an older release of it could not read it, and keeps reading every
older version. A restart refuses a block whose version is newer than the
installed codec's (:mod:`gangd.codecs.registry`), never guesses.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .errors import CodecError

BytesLike = bytes | bytearray | memoryview
# One call compresses at most this many bytes (blocks are KiB to a few MiB): lz4's block format and
# blosc2's chunks stop just short of 2 GiB, and a decoder's output is bounded by it whatever the caller asks.
MAX_BUFFER = 1 << 30


@runtime_checkable
class Codec(Protocol):
    """A compressor of buffers: see the module docstring for the contract."""

    name: str
    version: int

    def compress(self, data: BytesLike, itemsize: int) -> BytesLike:
        """``data`` compressed; ``itemsize`` is the bytes of one element (1 for plain bytes), for filters that use it."""
        ...

    def decompress_into(self, data: BytesLike, out: memoryview) -> int:
        """Decompress ``data`` into exactly ``len(out)`` bytes of ``out`` and return that count, else :class:`CodecError`."""
        ...


def flat(name: str, data: BytesLike) -> memoryview:
    """``data`` as a flat byte view in C order, checked against :data:`MAX_BUFFER`.

    A strided (non-C-contiguous) view is copied into its C-order bytes: those
    are the bytes a decoder gives back into a contiguous array of the shape.
    """
    view = memoryview(data)
    if view.nbytes > MAX_BUFFER:
        raise CodecError(name, f"{view.nbytes} bytes in one call, more than the {MAX_BUFFER} a codec takes (cut the value into blocks)")
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def destination(name: str, out: memoryview) -> memoryview:
    """``out`` as a flat writable byte view, within :data:`MAX_BUFFER` (C-contiguous: decoders write in place)."""
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise CodecError(name, "the destination is not a writable C-contiguous buffer")
    return flat(name, view)


def check_size(name: str, produced: int, expected: int) -> int:
    if produced != expected:
        raise CodecError(name, f"the data decompresses to {produced} bytes, not the {expected} the block holds")
    return produced
