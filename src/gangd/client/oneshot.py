"""One request, one answer, over a blocking Unix socket: the ``gang`` commands that need nothing more.

Why: importing trio takes a command ~0.13 s, longer than a ``gang restart``
request takes to be answered (~0.07 s), and a command that sends one request
and prints its answer needs no event loop. This module drives the same
sans-I/O :class:`~gangd.protocol.Connection` as :mod:`gangd.rpc` — the same
handshake, framing and limits — from a plain socket, and finds its daemon
as :func:`gangd.client.api.connect` does (:mod:`gangd.client.locate`), with
the same errors: :class:`~gangd.client.locate.ClusterNotFound` when no
daemon answers, :class:`~gangd.errors.RemoteError` when the request fails.
:func:`connect` gives the same :class:`~gangd.client.session.Client` as
the trio API over such a socket, and :func:`drive` runs a command's
coroutine over it without an event loop (its requests block, so it never
suspends): ``gang ps``, ``submit``, ``kill``, ``job`` and the other
request-and-answer commands cost half the CPU they did with trio. Commands
that follow streams (``wait``, ``logs``, ``run``) use :mod:`gangd.client.api`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ..errors import Disconnected, RemoteError, handshake_failure, reply_result
from ..protocol import HANDSHAKE_MAX_FRAME, Connection, Item, Note, ProtocolError, Ready, RemoteClosed, Reply, Request, Role, State
from .locate import REFUSALS, locate, unreachable
from .session import Client

T = TypeVar("T")

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
            self.node = event.node  # (the daemon's node name)
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


def _dial(cluster: str | os.PathLike | None) -> _Link:
    """A link to the first daemon of ``cluster`` that answers (see :func:`~gangd.client.locate.locate`)."""
    errors = []
    for path in locate(cluster):
        try:
            return _Link(path)
        except ProtocolError as exc:
            if exc.code in REFUSALS:  # it is up and said why: trying another node would not help
                raise RemoteError(exc.code, f"gangd at {path} refused the connection: {exc.message.split(': ', 1)[-1]}") from None
            errors.append(f"{path}: {exc}")
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    raise unreachable(errors)


def request(cluster: str | os.PathLike | None, op: str, **args) -> object:
    """Send ``op`` to the first daemon of ``cluster`` that answers and return its answer."""
    link = _dial(cluster)
    try:
        return link.request(op, args)
    finally:
        link.sock.close()


class _BlockingChannel:
    """What :class:`~gangd.client.session.Client` needs of a channel, over a
    :class:`_Link`: its ``request`` is a coroutine that never suspends (it
    blocks on the socket), so :func:`drive` runs it without an event loop."""

    def __init__(self, link: _Link):
        self.link = link
        self.remote_node = link.node

    async def request(self, op: str, **args) -> object:
        return self.link.request(op, args)

    def stream(self, op: str, **args):
        raise TypeError(f"{op!r} follows a stream: use gangd.client.api.connect (trio), not gangd.client.oneshot")


@asynccontextmanager
async def connect(cluster: str | os.PathLike | None = None) -> AsyncIterator[Client]:
    """:func:`gangd.client.api.connect` without trio: a
    :class:`~gangd.client.session.Client` whose requests block. Only for
    coroutines run by :func:`drive` (or that may block their event loop)."""
    link = _dial(cluster)
    try:
        yield Client(_BlockingChannel(link))
    finally:
        link.sock.close()


def drive(fn: Callable[..., Coroutine[Any, Any, T]], *args) -> T:
    """Run ``fn(*args)``, a coroutine that awaits only :func:`connect`'s
    requests (which never suspend), to its end: one step, no event loop.
    A coroutine that does suspend (it awaited trio) is a programming error."""
    coro = fn(*args)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} suspended: it awaited something other than a blocking request")
