"""``lz4``: the fastest of the built-ins (GB/s per core), for state that changes little between generations.

lz4's *block* format without its 4-byte size prefix (``store_size=False``):
the caller gives the exact size, so the decoder allocates that and nothing a
hostile prefix claims. ``lz4.block.decompress`` returns whatever shorter
output the data decodes to, so the size is checked after; corrupt input is
caught by liblz4's safe decoder (``LZ4_decompress_safe``), which never
reads or writes outside its buffers. The library is imported on first use:
a rank that never compresses never loads it.
"""

from __future__ import annotations

from .base import BytesLike, check_size, destination, flat
from .errors import CodecError


class Lz4:
    name = "lz4"
    version = 1

    def __init__(self) -> None:
        import lz4.block  # type: ignore[import-untyped]  # loaded with the codec, not with gangd (the module docstring)

        self._block = lz4.block

    def compress(self, data: BytesLike, itemsize: int) -> BytesLike:
        src = flat(self.name, data)
        if not src.nbytes:
            return b""
        return bytes(self._block.compress(src, store_size=False))

    def decompress_into(self, data: BytesLike, out: memoryview) -> int:
        src, dst = flat(self.name, data), destination(self.name, out)
        if not dst.nbytes or not src.nbytes:
            return check_size(self.name, src.nbytes, dst.nbytes)  # empty decodes only from empty
        try:
            raw = self._block.decompress(src, uncompressed_size=dst.nbytes)
        except self._block.LZ4BlockError as e:
            raise CodecError(self.name, f"corrupt data: {e}") from None
        dst[:] = memoryview(raw)[: check_size(self.name, len(raw), dst.nbytes)]
        return dst.nbytes


def make(params: tuple[str, ...]) -> Lz4:
    return Lz4()
