"""Codecs for compressed checkpoints (issue 18): the layer alone, not yet used by the checkpoint writer.

Paper 004 (PCCR) compresses checkpoints in a pipeline; this package is the
part every stage of that pipeline shares and that can be tested alone: a
small interface (:class:`Codec`: compress a buffer, decompress into a buffer
of a stated size), the built-in codecs over well-kept libraries (``none``,
``lz4``, ``zstd``, ``blosc2`` with filters using the item size), plug-ins
through entry points (an accelerator's codec), ``auto`` choosing per value,
and the validated spec a user writes and a block records. Modules:

    spec      CodecSpec (what a user names), CodecId (what a block records)
    base      the Codec protocol and the bounds every codec keeps
    errors    CodecError, CodecMissing
    registry  built-ins and entry points, loaded on first use
    auto      the per-value choice from a sample
    payload   encode/decode of one block (raw fallback, checksum)
    rawcodec, lz4codec, zstdcodec, blosc2codec   the built-ins

Importing this package imports none of the compression libraries (a
rank's start-up pays for them only if it compresses).
"""

from __future__ import annotations

from .auto import choose
from .base import MAX_BUFFER, Codec
from .errors import CodecError, CodecMissing
from .payload import decode, encode
from .registry import GROUP, for_block, get, identity, plugins
from .spec import CodecId, CodecSpec

__all__ = [
    "CodecSpec", "CodecId", "Codec", "CodecError", "CodecMissing",
    "get", "identity", "for_block", "plugins", "choose", "encode", "decode", "GROUP", "MAX_BUFFER",
]
