"""gangd's wire protocol, sans-I/O: frames, handshake and message events.

Nothing in this package touches a socket; :mod:`gangd.rpc` binds it to trio
streams. See :mod:`gangd.protocol.connection` for the handshake.
"""

from .connection import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_WINDOW,
    HANDSHAKE_MAX_FRAME,
    MAX_CLIENT_REQUEST,
    MAX_CREDIT,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    Connection,
    Credit,
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
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_WINDOW",
    "HANDSHAKE_MAX_FRAME",
    "MAX_CLIENT_REQUEST",
    "MAX_CREDIT",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "Cancel",
    "Connection",
    "Credit",
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
