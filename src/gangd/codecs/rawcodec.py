"""``none``: the bytes as they are, for incompressible values and for a block that would not shrink.

A codec like the others so the pipeline has one path: a block stored raw
records ``none@1`` and is "decompressed" by a bounded copy.
"""

from __future__ import annotations

from .base import BytesLike, check_size, destination, flat


class Raw:
    name = "none"
    version = 1

    def compress(self, data: BytesLike, itemsize: int) -> BytesLike:
        return flat(self.name, data)

    def decompress_into(self, data: BytesLike, out: memoryview) -> int:
        src, dst = flat(self.name, data), destination(self.name, out)
        check_size(self.name, src.nbytes, dst.nbytes)
        dst[:] = src
        return dst.nbytes


def make(params: tuple[str, ...]) -> Raw:
    return Raw()
