"""Errors that cross the wire, importable without trio.

A request's failure (:class:`RemoteError`) is what every client sees, the
``gang`` command's one-shot client (:mod:`gangd.client.oneshot`) included,
which must not import trio to raise or catch it: loading trio costs a
command ~0.13 s, longer than most requests take. :mod:`gangd.rpc` re-exports
both classes, so ``from gangd.rpc import RemoteError`` stays the same class.
"""

from __future__ import annotations

from .protocol import ProtocolError, RemoteClosed, Reply


class RemoteError(Exception):
    """A request failed; ``code`` is machine-readable, ``message`` is for people."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


class Disconnected(RemoteError):
    def __init__(self, message: str = "connection lost"):
        super().__init__("disconnected", message)


def reply_result(reply: Reply) -> object:
    """A final reply's result, or its error raised as :class:`RemoteError`."""
    if reply.ok:
        return reply.result
    if reply.error is None:  # the Connection never hands up a failed Reply without its error map
        raise RemoteError("malformed", "error reply without a code and message")
    raise RemoteError(reply.error["code"], reply.error["message"])


def handshake_failure(event: object, label: str) -> ProtocolError:
    """Why a handshake with ``label`` ended on ``event`` instead of Ready (None: the connection closed)."""
    if isinstance(event, RemoteClosed):
        return ProtocolError(event.code, f"refused by {label}: {event.message}")
    if event is None:
        return ProtocolError("truncated", f"{label} closed the connection during the handshake")
    return ProtocolError("malformed", f"unexpected {type(event).__name__} during the handshake")
