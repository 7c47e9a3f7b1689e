"""``blosc2[:INNER][:LEVEL][:FILTER]``: typed arrays, compressed knowing their item size.

What blosc2 is made for: its *shuffle* filter regroups the bytes of
``itemsize``-byte elements by significance (the high bytes of neighbouring
floats are alike), *bitshuffle* does it per bit, and *bytedelta* (after a
shuffle) stores each byte stream as differences, which suits smooth
floating-point fields; then an inner codec (zstd, lz4, ...) compresses the
result. The item size comes from the caller (the value's dtype) and is
recorded in blosc2's own chunk header, so the identity needs only the spec.

Decoding is bounded by a check of the chunk header before anything is
decompressed: its uncompressed size must equal the block's and its
compressed size the data's length. (blosc2 fills a too-small destination
silently, so without the check a wrong size would not even be an error.)
blosc2 does not detect corruption of the compressed stream in general: a
flipped byte can decode to wrong bytes without an error, which is why the
block's checksum over the raw bytes (:func:`gangd.codecs.decode`) is what
catches it. One thread per call: the pipeline runs its own threads.

Those threads overlap only if the codec lets go of the GIL while it works,
and blosc2 keeps it by default (``set_releasegil``, False): a thread
compressing held every other thread of the process for the length of each
unit (a Python thread spinning beside it kept 23 % of its pace, beside
lz4 or zstd all of it), so the write stage waited on the compression and
the pipeline was barely faster than compressing first and writing after.
The codec turns the release on when it is loaded (process-wide: it costs a
little on tiny buffers, and a checkpoint's units are large).
"""

from __future__ import annotations

from typing import Any

from .base import BytesLike, check_size, destination, flat
from .errors import CodecError

HEADER = 32  # a blosc2 chunk's header (its extended form); shorter data is not a chunk
MAX_TYPESIZE = 255  # blosc2's limit: a record dtype wider than this is compressed as bytes


class Blosc2:
    name = "blosc2"
    version = 1

    def __init__(self, inner: str, level: int, filt: str) -> None:
        import blosc2  # type: ignore[import-untyped]  # loaded with the codec, not with gangd (gangd.codecs.lz4codec)

        blosc2.set_releasegil(True)  # (the pipeline's stages run beside the compression: see the module's docstring)
        self._blosc2: Any = blosc2
        self.inner, self.level, self.filter = inner, level, filt
        self._codec = getattr(blosc2.Codec, inner.upper())
        f = blosc2.Filter
        self._filters = {
            "shuffle": [f.SHUFFLE],
            "bitshuffle": [f.BITSHUFFLE],
            "bytedelta": [f.SHUFFLE, f.BYTEDELTA],
            "nofilter": [f.NOFILTER],
        }[filt]

    def compress(self, data: BytesLike, itemsize: int) -> BytesLike:
        src = flat(self.name, data)
        typesize = itemsize if 1 <= itemsize <= MAX_TYPESIZE else 1
        try:
            return bytes(
                self._blosc2.compress2(
                    src,
                    typesize=typesize,
                    clevel=self.level,
                    codec=self._codec,
                    filters=self._filters,
                    filters_meta=[0] * len(self._filters),
                    nthreads=1,
                )
            )
        except (RuntimeError, ValueError) as e:
            raise CodecError(self.name, f"cannot compress: {e}") from None

    def decompress_into(self, data: BytesLike, out: memoryview) -> int:
        src, dst = flat(self.name, data), destination(self.name, out)
        if src.nbytes < HEADER:
            raise CodecError(self.name, f"{src.nbytes} bytes are not a blosc2 chunk (its header alone is {HEADER})")
        try:
            nbytes, cbytes, _ = self._blosc2.get_cbuffer_sizes(src)
            check_size(self.name, nbytes, dst.nbytes)
            if cbytes != src.nbytes:
                raise CodecError(self.name, f"the chunk says it is {cbytes} bytes long, the data is {src.nbytes}")
            if dst.nbytes:  # blosc2 refuses an empty destination; an empty chunk has nothing to decode
                self._blosc2.decompress2(src, dst=dst, nthreads=1)
        except (RuntimeError, ValueError) as e:
            raise CodecError(self.name, f"corrupt data: {e}") from None
        return dst.nbytes


def make(params: tuple[str, ...]) -> Blosc2:
    inner, level, filt = params
    return Blosc2(inner, int(level), filt)
