"""gangd's wire protocol, sans-I/O: frames, handshake and message events.

Nothing in this package touches a socket; :mod:`gangd.rpc` binds it to trio
streams. See :mod:`gangd.protocol.connection` for the handshake.
"""

from .connection import (
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    Connection,
    Event,
    Item,
    Note,
    Ready,
    RemoteClosed,
    Reply,
    Request,
    Role,
    State,
)
from .frames import DEFAULT_MAX_FRAME, FrameDecoder, ProtocolError, decode_payload, encode_frame

__all__ = [
    "DEFAULT_MAX_FRAME",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "Cancel",
    "Connection",
    "Event",
    "FrameDecoder",
    "Item",
    "Note",
    "ProtocolError",
    "Ready",
    "RemoteClosed",
    "Reply",
    "Request",
    "Role",
    "State",
    "decode_payload",
    "encode_frame",
]
