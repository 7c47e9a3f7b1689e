"""One request, one answer, over a blocking Unix socket: the ``gang`` commands that need nothing more.

Why: importing trio takes a command ~0.13 s, longer than a ``gang restart``
request takes to be answered (~0.07 s), and a command that sends one request
and prints its answer needs no event loop. This module drives the same
sans-I/O :class:`~gangd.protocol.Connection` as :mod:`gangd.rpc` — the same
handshake, framing and limits — from a plain socket, and finds its daemon
as :func:`gangd.client.api.connect` does (:mod:`gangd.client.locate`), with
the same errors: :class:`~gangd.client.locate.ClusterNotFound` when no
daemon answers, :class:`~gangd.errors.RemoteError` when the request fails.
Commands that follow streams (``wait``, ``output``, ``run``) use
:mod:`gangd.client.api`.
"""

from __future__ import annotations

import os
import socket

from ..errors import Disconnected, RemoteError, handshake_failure, reply_result
from ..protocol import HANDSHAKE_MAX_FRAME, Connection, Item, Note, ProtocolError, Ready, RemoteClosed, Reply, Request, Role, State
from .locate import REFUSALS, locate, unreachable

#: Seconds to connect and finish the handshake (as gangd.rpc's dial_unix).
HANDSHAKE_TIMEOUT = 5.0
READ_SIZE = 256 * 1024


class _Link:
    """A connected, handshaken socket and its protocol machine."""

    def __init__(self, path: str):
        self.label = f"gangd at {path}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn = Connection(dialer=True, node="client", role=Role.CLIENT)
        try:
            self.sock.settimeout(HANDSHAKE_TIMEOUT)
            self.sock.connect(path)
            event = self._next_event()
            if not isinstance(event, Ready):
                raise handshake_failure(event, self.label)
            self._flush()
            self.sock.settimeout(None)  # (a request such as a restart that stages files takes as long as it takes)
        except BaseException:
            self.sock.close()
            raise

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _next_event(self):
        """The machine's next event, reading as needed; None at the end of the connection."""
        while True:
            event = self.conn.next_event()  # raises ProtocolError
            if event is not None:
                return event
            self._flush()  # (its own answers first, as gangd.rpc does)
            if self.conn.backlogged:
                continue
            size = READ_SIZE if self.conn.state is State.READY else 2 * HANDSHAKE_MAX_FRAME
            try:
                data = self.sock.recv(size)
            except (TimeoutError, ConnectionError):  # (a timeout only during the handshake)
                if self.conn.state is not State.READY:
                    raise
                data = b""
            if not data:
                self.conn.receive_eof()  # raises if a frame was cut short
                return None
            self.conn.receive_data(data)

    def request(self, op: str, args: dict) -> object:
        rid, frame = self.conn.send_request(op, args)
        try:
            self.sock.sendall(frame)
            while True:
                event = self._next_event()
                if event is None:
                    raise Disconnected(f"connection to {self.label} closed before {op!r} was answered")
                if isinstance(event, Reply) and event.id == rid:
                    return reply_result(event)
                if isinstance(event, Item):  # an item nobody asked for: its credit back, as gangd.rpc does
                    self.sock.sendall(self.conn.send_credit(event.id, event.size))
                elif isinstance(event, Request):
                    self.sock.sendall(self.conn.send_error(event.id, "unsupported", "this side serves no requests"))
                elif isinstance(event, Note):
                    self.conn.note_done(event)
                elif isinstance(event, RemoteClosed):
                    raise Disconnected(f"{self.label} closed the connection before {op!r} was answered: {event.message}")
        except ProtocolError as exc:
            raise Disconnected(f"connection to {self.label} broken before {op!r} was answered: {exc}") from None
        except OSError as exc:
            raise Disconnected(f"connection to {self.label} lost before {op!r} was answered: {exc.strerror or exc}") from None


def request(cluster: str | os.PathLike | None, op: str, **args) -> object:
    """Send ``op`` to the first daemon of ``cluster`` that answers (see
    :func:`~gangd.client.locate.locate`) and return its answer."""
    errors = []
    for path in locate(cluster):
        try:
            link = _Link(path)
        except ProtocolError as exc:
            if exc.code in REFUSALS:  # it is up and said why: trying another node would not help
                raise RemoteError(exc.code, f"gangd at {path} refused the connection: {exc.message.split(': ', 1)[-1]}") from None
            errors.append(f"{path}: {exc}")
            continue
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
            continue
        try:
            return link.request(op, args)
        finally:
            link.sock.close()
    raise unreachable(errors)
