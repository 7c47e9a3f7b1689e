"""Exceptions of :mod:`gangd.comm` (a module of their own so every layer can raise them)."""

from __future__ import annotations


class CommError(Exception):
    """Messaging failed: the daemon refused us, a peer broke the protocol, the world is closed...

    ``code`` is the daemon's machine-readable error code when the daemon said no, else None.
    """

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class PeerExited(CommError):
    """The rank we wanted to talk to has exited (``rank`` is None when it is "every other rank")."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
