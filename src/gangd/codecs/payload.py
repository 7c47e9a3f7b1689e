"""One block in, one block out: compress with a fallback to raw, decompress bounded and checked.

What the checkpoint writer and restart will call per block (issue 18's
pipeline; the block format records the identity this returns). A block
that does not shrink is stored raw, so incompressible data never costs
more than its size and decodes at copy speed. Decoding goes through the
identity the block recorded, fills exactly the caller's buffer, and, given
the block's xxh3-128 over its raw bytes (the signature the block format
already keeps), verifies it: several codecs (blosc2 above all) decode a
flipped byte into wrong bytes without any error, so the checksum is what
catches a corrupted compressed block. Any failure of a plug-in codec, whose
errors gangd cannot know, is reported as a :class:`CodecError` naming it.
"""

from __future__ import annotations

from .base import BytesLike, destination, flat
from .errors import CodecError
from .registry import for_block, get, identity
from .spec import CodecId, CodecSpec

RAW = CodecId(CodecSpec("none"), 1)


def encode(spec: CodecSpec | str, data: BytesLike, itemsize: int = 1) -> tuple[CodecId, memoryview]:
    """``data`` compressed with ``spec`` and the identity to record, or raw (``none@1``) if it did not shrink."""
    spec = CodecSpec.parse(spec) if isinstance(spec, str) else spec
    src = flat(str(spec), data)
    if spec.name == "none":
        return RAW, src
    codec = get(spec)
    packed = flat(codec.name, codec.compress(src, itemsize))  # (a plug-in may hand back any buffer: counted in bytes)
    if packed.nbytes >= src.nbytes:
        return RAW, src
    return identity(spec), packed


def decode(ident: CodecId | str, data: BytesLike, out: memoryview, digest: bytes | None = None) -> int:
    """Decompress a block recorded as ``ident`` into all of ``out``; check ``digest`` (xxh3-128 of the raw bytes) if given."""
    codec = for_block(ident)
    dst = destination(codec.name, out)
    try:
        n = codec.decompress_into(data, dst)
    except CodecError:
        raise
    except Exception as e:  # noqa: BLE001 -- a plug-in's own error type on hostile input is its codec's failure
        raise CodecError(codec.name, f"{type(e).__name__}: {e}") from None
    if n != dst.nbytes:
        raise CodecError(codec.name, f"decompressed {n} bytes, not the {dst.nbytes} the block holds")
    if digest is not None:
        import xxhash  # the block format's checksum (gangd.ckptlib.blocks); imported with the first decode

        if xxhash.xxh3_128_digest(dst) != digest:
            raise CodecError(codec.name, "the decompressed block does not match its checksum (the stored block is corrupt)")
    return n
