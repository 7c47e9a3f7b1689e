"""Errors that cross the wire, importable without trio.

A request's failure (:class:`RemoteError`) is what every client sees, the
``gang`` command's one-shot client (:mod:`gangd.client.oneshot`) included,
which must not import trio to raise or catch it: loading trio costs a
command ~0.13 s, longer than most requests take. :mod:`gangd.rpc` re-exports
both classes, so ``from gangd.rpc import RemoteError`` stays the same class.
"""

from __future__ import annotations


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
