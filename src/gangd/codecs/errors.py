"""The one error a codec raises, so a caller catches one type whatever library failed.

A checkpoint's compressed bytes come from a file the job's owner can write:
every decoder meets hostile input. lz4, zstandard and blosc2 each fail in
their own way (``LZ4BlockError``, ``ZstdError``, ``ValueError``,
``RuntimeError``); the codecs turn all of them into :class:`CodecError`
carrying the codec's name, so a restart can say which block of which value
failed under which codec without knowing the libraries. :class:`CodecMissing`
is the case a user can fix: the codec a generation was written with is not
installed here, and its message says how to install it.
"""

from __future__ import annotations


class CodecError(Exception):
    """A codec refused its input (bad spec, corrupt or oversized data, wrong size): ``codec`` names it."""

    def __init__(self, codec: str, message: str):
        super().__init__(f"codec {codec!r}: {message}")
        self.codec = codec
        self.message = message


class CodecMissing(CodecError):
    """The codec is not available on this machine; ``hint`` says how to get it (e.g. ``pip install blosc2``)."""

    def __init__(self, codec: str, message: str, hint: str):
        super().__init__(codec, f"{message}; {hint}")
        self.hint = hint
