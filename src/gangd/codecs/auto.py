"""``auto``: pick a value's codec from a quick sample, and store raw what would not shrink.

Compressing random bytes (encrypted data, already-compressed images, noise)
costs time and saves nothing, and different values want different codecs:
numeric arrays compress far better through blosc2's filters, which use
their item size, than through a general-purpose codec. So, per value, a few
blocks spread through it (:data:`SAMPLES` of :data:`SAMPLE` bytes, one in
the middle of each of as many equal parts, aligned to whole items: a
header or a tail of padding does not decide for the whole value) are compressed
with the candidate that fits the value's kind, and if the sample's ratio is
below :data:`MIN_RATIO` the value is stored raw (``none``).

Candidates: a numeric array (bool excepted: its items are bytes) gets blosc2
with a filter for its item size -- bytedelta for floating point, whose
smooth fields it suits, shuffle for integers and times; anything else
(bytes, strings, records, pickles) gets zstd at level 1. The sample is at
most 256 KiB whatever the value's size, so the choice costs a bounded,
small fraction of compressing the value (``bench/codecs.py`` measures it).
"""

from __future__ import annotations

from typing import Any

from .base import BytesLike, flat
from .registry import get
from .spec import CodecSpec

SAMPLE = 64 << 10
SAMPLES = 4
MIN_RATIO = 1.1
NUMERIC_FLOAT = CodecSpec.parse("blosc2:zstd:1:bytedelta")
NUMERIC_INT = CodecSpec.parse("blosc2:zstd:1:shuffle")
BYTES = CodecSpec.parse("zstd:1")
NONE = CodecSpec.parse("none")
CANDIDATES = (NUMERIC_FLOAT, NUMERIC_INT, BYTES)  # every codec auto may pick besides none


def candidate(dtype: Any | None) -> tuple[CodecSpec, int]:
    """The codec worth sampling for a value of numpy ``dtype`` (None: plain bytes), and the item size it uses."""
    if dtype is None or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize < 2 or dtype.kind not in "iufcmM":
        return BYTES, 1
    return (NUMERIC_FLOAT if dtype.kind in "fc" else NUMERIC_INT), dtype.itemsize


def sample(data: BytesLike, itemsize: int) -> memoryview:
    """Up to :data:`SAMPLES` pieces of :data:`SAMPLE` bytes spread through ``data``, joined (all of it if small)."""
    view = flat("auto", data)
    if view.nbytes <= SAMPLE * SAMPLES:
        return view
    piece = SAMPLE - SAMPLE % itemsize if itemsize <= SAMPLE else SAMPLE
    part = view.nbytes // SAMPLES
    starts = [part * i + (part - piece) // 2 for i in range(SAMPLES)]
    starts = [s - s % itemsize for s in starts]
    return memoryview(b"".join(view[s : s + piece] for s in starts))


def choose(data: BytesLike, dtype: Any | None = None) -> CodecSpec:
    """The codec ``auto`` picks for this value: its candidate, or ``none`` if the sample shrinks less than 1.1x."""
    spec, itemsize = candidate(dtype)
    piece = sample(data, itemsize)
    if not piece.nbytes:
        return NONE
    ratio = piece.nbytes / max(1, len(memoryview(get(spec).compress(piece, itemsize))))
    return spec if ratio >= MIN_RATIO else NONE
