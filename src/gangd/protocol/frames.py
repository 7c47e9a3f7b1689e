"""Length-prefixed msgpack frames, sans-I/O.

A frame is a 4-byte big-endian payload length followed by one msgpack map.
The decoder is fed arbitrary byte chunks and yields complete messages; it
never raises anything but :class:`ProtocolError`, whatever bytes it is given
(the fuzz tests hold it to that).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack

#: Largest payload a connection accepts unless configured otherwise. Output
#: chunks and job specs are far smaller; the cap exists so a garbage length
#: prefix cannot make a daemon allocate gigabytes.
DEFAULT_MAX_FRAME = 16 * 1024 * 1024

_HEADER = struct.Struct(">I")
HEADER_SIZE = _HEADER.size

#: One decoded frame: a msgpack map with string keys (``strict_map_key``); its
#: values are whatever the peer sent, checked field by field by the reader.
Message = dict[str, Any]


class ProtocolError(Exception):
    """The peer broke the wire protocol; the connection must be closed.

    ``code`` is a short machine-readable reason (``oversized``, ``malformed``,
    ``truncated``, ``auth_failed``, ``version_mismatch``, ...).
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


def encode_frame(message: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Serialise one message into a frame (header + payload)."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_frame:
        raise ProtocolError(
            "oversized", f"refusing to send a {len(payload)}-byte frame (limit {max_frame})"
        )
    return _HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> Message:
    """Decode one frame payload into a message map, or raise ProtocolError."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    # msgpack raises a zoo of unrelated types on hostile bytes (ValueError and its ExtraData/FormatError/StackError,
    # TypeError for an unhashable key, ...); every one of them must become a ProtocolError, never escape.
    except Exception as exc:  # noqa: BLE001 -- any decoder failure is the peer's malformed frame
        raise ProtocolError("malformed", f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("malformed", f"frame holds a {type(message).__name__}, not a map")
    return message


class FrameDecoder:
    """Accumulates bytes and splits them into decoded messages."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self.last_size = 0  # bytes (header included) of the frame last returned
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    def pending_length(self) -> int | None:
        """Bytes (header included) of the frame being received, once its header is in."""
        if len(self._buffer) < HEADER_SIZE:
            return None
        (length,) = _HEADER.unpack_from(self._buffer)
        return HEADER_SIZE + int(length)

    def next_message(self) -> Message | None:
        """Return the next complete message, or None if more bytes are needed."""
        if len(self._buffer) < HEADER_SIZE:
            return None
        (length,) = _HEADER.unpack_from(self._buffer)
        if length > self.max_frame:
            raise ProtocolError(
                "oversized", f"frame of {length} bytes exceeds the {self.max_frame}-byte limit"
            )
        end = HEADER_SIZE + length
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[HEADER_SIZE:end])
        del self._buffer[:end]
        self.last_size = end
        return decode_payload(payload)

    def __iter__(self) -> Iterator[Message]:
        while (message := self.next_message()) is not None:
            yield message

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def check_eof(self) -> None:
        """Call when the peer closed; a half-received frame is an error."""
        if self._buffer:
            raise ProtocolError(
                "truncated", f"connection closed in the middle of a frame ({len(self._buffer)} bytes pending)"
            )
