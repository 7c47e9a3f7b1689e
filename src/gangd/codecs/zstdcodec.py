"""``zstd[:LEVEL]``: zstandard, the ratio/speed trade-off a user tunes with the level.

Each block is one zstd frame carrying its content size. zstandard's
``decompress`` allocates what a frame *declares* (``max_output_size`` only
applies to frames without a size), so the declared size is read first and
must equal the block's size, frames without one are refused, and data after
the frame is an error (``allow_extra_data=False``): nothing a hostile frame
claims is allocated. Compressor and decompressor objects are not
thread-safe, so each thread keeps its own (the pipeline compresses on
several threads; zstandard releases the GIL).
"""

from __future__ import annotations

import threading
from typing import Any

from .base import BytesLike, check_size, destination, flat
from .errors import CodecError


class Zstd:
    name = "zstd"
    version = 1

    def __init__(self, level: int) -> None:
        import zstandard  # loaded with the codec, not with gangd (gangd.codecs.lz4codec)

        self._zstd: Any = zstandard
        self.level = level
        self._local = threading.local()

    def _compressor(self) -> Any:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._zstd.ZstdCompressor(level=self.level, write_content_size=True)
        return c

    def _decompressor(self) -> Any:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = self._zstd.ZstdDecompressor()
        return d

    def compress(self, data: BytesLike, itemsize: int) -> BytesLike:
        return bytes(self._compressor().compress(flat(self.name, data)))

    def decompress_into(self, data: BytesLike, out: memoryview) -> int:
        src, dst = flat(self.name, data), destination(self.name, out)
        try:
            declared = self._zstd.frame_content_size(src)
            if declared < 0:
                raise CodecError(self.name, "the frame does not declare its size")
            check_size(self.name, declared, dst.nbytes)
            raw = self._decompressor().decompress(src, allow_extra_data=False)
        except self._zstd.ZstdError as e:
            raise CodecError(self.name, f"corrupt data: {e}") from None
        dst[:] = memoryview(raw)[: check_size(self.name, len(raw), dst.nbytes)]
        return dst.nbytes


def make(params: tuple[str, ...]) -> Zstd:
    return Zstd(int(params[0]))
