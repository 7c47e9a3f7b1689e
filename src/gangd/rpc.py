"""Binds the sans-I/O protocol to trio streams: requests, streamed replies, notes.

A :class:`Channel` is symmetric once the handshake is done: either side may
send requests and serve the other side's requests. The owner runs
:meth:`Channel.run` inside a nursery; that task reads frames and owns every
handler task it spawns, so closing the channel cancels all of them.

Handlers are ``async def handler(channel, request) -> result``. To stream,
return ``Stream(produce)`` where ``produce(emit)`` is an async function that
calls ``await emit(item)`` for each item; the final reply follows when it
returns (or when the requester cancels). A callback rather than an async
generator, so a producer may open nurseries freely: yielding from inside a
nursery in an async generator is not cancellation-safe in trio.

Memory stays bounded whatever the other side does: ``emit`` waits for the
requester's credit (see :mod:`gangd.protocol.connection`), a requester
grants credit only as its consumer takes items, the machine answers
requests beyond ``max_in_flight`` (or beyond the bytes it may hold) with
``busy``, at most ``max_notes`` note handlers run at once (beyond that the
channel stops reading: note handlers never wait on this connection, so that
cannot deadlock), and the machine's own unsent answers are written out
before more is read (a client that never reads them stalls only itself).
"""

from __future__ import annotations

import logging
import math
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from .errors import Disconnected as Disconnected
from .errors import RemoteError as RemoteError
from .errors import handshake_failure, reply_result
from .protocol import (
    DEFAULT_WINDOW,
    HANDSHAKE_MAX_FRAME,
    Cancel,
    Connection,
    Credit,
    Item,
    Note,
    ProtocolError,
    Ready,
    RemoteClosed,
    Reply,
    Request,
    Role,
    State,
)

log = logging.getLogger("gangd.rpc")

HANDSHAKE_TIMEOUT = 5.0
READ_SIZE = 256 * 1024
#: Read size before the handshake is done (a hello is far smaller).
HANDSHAKE_READ_SIZE = 2 * HANDSHAKE_MAX_FRAME
#: One-way notes of the other side handled at once before reading pauses.
DEFAULT_MAX_NOTES = 64


Emit = Callable[[object], Awaitable[None]]


@dataclass
class Stream:
    """Returned by a handler to stream items instead of one result."""

    produce: Callable[[Emit], Awaitable[None]]


Handler = Callable[["Channel", Request | Note], Awaitable[object]]


def leaf_error(exc: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups.

    trio wraps whatever a nursery's children raise in groups; callers want
    the RemoteError that one of them raised, not the group around it.
    """
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)] or list(exc.exceptions)
        remote = [e for e in inner if isinstance(e, (RemoteError, BaseExceptionGroup))]
        exc = (remote or inner)[0]
    return exc


def peer_credentials(stream: trio.SocketStream) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class Channel:
    def __init__(
        self,
        stream: trio.abc.Stream,
        conn: Connection,
        *,
        label: str = "?",
        window: int = DEFAULT_WINDOW,
        max_notes: int = DEFAULT_MAX_NOTES,
        read_size: int = READ_SIZE,
    ):
        self.transport = stream
        self.read_size = read_size
        self.conn = conn
        self.label = label
        self.remote_node: str | None = None
        self.closed = False
        self.close_reason = ""
        self.context: dict = {}  # what the server knows of the other side (uid, node...)
        self._send_lock = trio.Lock()
        self.window = window  # bytes of stream items buffered per request of ours
        self._pending: dict[int, trio.MemorySendChannel] = {}
        self._serving: dict[int, trio.CancelScope] = {}
        self._credit_wakeups: dict[int, trio.Event] = {}
        self._ungranted: dict[int, int] = {}  # rid -> consumed item bytes not yet granted back
        self._note_slots = trio.Semaphore(max_notes)

    # ------------------------------------------------------------ handshake

    async def handshake(self, timeout: float = HANDSHAKE_TIMEOUT) -> Ready:
        """Complete the handshake; raises ProtocolError, RemoteError, or
        trio.TooSlowError after ``timeout`` seconds."""
        with trio.fail_after(timeout):
            await self._flush()
            while True:
                event = await self._next_event()
                if isinstance(event, Ready):
                    self.remote_node = event.node
                    await self._flush()
                    return event
                raise handshake_failure(event, self.label)

    # ------------------------------------------------------------ sending

    async def _send(self, data: bytes) -> None:
        if self.closed:
            raise Disconnected(f"connection to {self.label} is closed: {self.close_reason}")
        async with self._send_lock:
            try:
                await self.transport.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._mark_closed(f"send failed: {exc}")
                raise Disconnected(f"connection to {self.label} lost: {exc}") from None

    async def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self._send(data)

    async def request(self, op: str, **args) -> object:
        """Send a request and wait for its final reply (items are not expected)."""
        async with self.pending(op, **args) as reply:
            return await reply()

    @asynccontextmanager
    async def pending(self, op: str, **args):
        """Send a request now, collect its reply later — to put requests to
        many peers on the wire before waiting for any::

            async with ch.pending("switch", ...) as reply:
                ...  # other work
                result = await reply()
        """
        async with self._open_request(op, args) as (rid, receive):

            async def reply() -> object:
                async for event in receive:
                    if isinstance(event, Reply):
                        return reply_result(event)
                    await self._grant(rid, event.size, at_once=True)  # an item nobody wants
                raise Disconnected(f"connection to {self.label} closed before {op!r} was answered{self._why_closed()}")

            yield reply

    @asynccontextmanager
    async def stream(self, op: str, **args) -> AsyncIterator[AsyncIterator]:
        """``async with ch.stream(op) as items: async for x in items`` — leaving
        the block early cancels the stream on the server."""
        async with self._open_request(op, args) as (rid, receive):
            done = False

            async def items():
                nonlocal done
                async for event in receive:
                    if isinstance(event, Item):
                        yield event.data
                        # Only now, once the consumer asks for the next one:
                        # a consumer that stops reading stops the stream.
                        await self._grant(rid, event.size)
                    elif isinstance(event, Reply):
                        done = True
                        reply_result(event)
                        return
                raise Disconnected(f"connection to {self.label} closed during {op!r}{self._why_closed()}")

            try:
                yield items()
            finally:
                if not done and not self.closed:
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        try:
                            await self._send(self.conn.send_cancel(rid))
                        except RemoteError:
                            pass

    def _framed(self, make, *args):
        """A frame from the state machine. One that has closed (the other side
        hung up, not yet seen by this side's reader) refuses to make frames:
        that is a connection lost, as a failed send would be."""
        try:
            return make(*args)
        except ProtocolError as exc:
            if exc.code == "not_ready":
                raise Disconnected(f"connection to {self.label} is closed{self._why_closed()}") from None
            raise

    @asynccontextmanager
    async def _open_request(self, op: str, args: dict):
        if self.closed:
            raise Disconnected(f"connection to {self.label} is closed: {self.close_reason}")
        try:
            rid, frame = self._framed(lambda: self.conn.send_request(op, args, window=self.window))
        except ProtocolError as exc:  # larger than the other side takes: say so here, not by a cut connection
            raise RemoteError("too_large", f"the {op!r} request is too large: {exc.message}") from None
        # Unbounded in type only: the machine refuses items beyond the credit
        # granted, so this holds at most window + one frame (and the reply).
        send, receive = trio.open_memory_channel(math.inf)
        self._pending[rid] = send
        self._ungranted[rid] = 0
        try:
            await self._send(frame)
            yield rid, receive
        finally:
            self._pending.pop(rid, None)
            self._ungranted.pop(rid, None)

    async def _grant(self, rid: int, size: int, *, at_once: bool = False) -> None:
        """Give back the credit of consumed items, in batches of half a window."""
        if rid not in self._ungranted:
            return
        self._ungranted[rid] += size
        if self._ungranted[rid] < self.window // 2 and not at_once:
            return
        n, self._ungranted[rid] = self._ungranted[rid], 0
        if self.closed:
            return
        try:
            data = self.conn.send_credit(rid, n)
        except ProtocolError:
            return
        if data:
            try:
                await self._send(data)
            except RemoteError:
                pass  # the connection is gone; the reader reports it

    async def note(self, op: str, **args) -> None:
        await self._send(self._framed(self.conn.send_note, op, args))

    # ------------------------------------------------------------ receiving

    async def _next_event(self):
        while True:
            event = self.conn.next_event()  # raises ProtocolError
            if event is not None:
                return event
            # The state machine may have queued a reply of its own (handshake,
            # busy answers): written out before reading on, so a client that
            # never reads them stalls its own connection, not the daemon's memory.
            await self._flush()
            if self.conn.backlogged:
                continue  # (it stopped for its outbox) frames still buffered come before new bytes
            # Small reads until the handshake is done: what an unauthenticated
            # connection can make us hold is a few KiB, not READ_SIZE.
            size = self.read_size if self.conn.state is State.READY else HANDSHAKE_READ_SIZE
            try:
                data = await self.transport.receive_some(size)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                data = b""
                self.close_reason = str(exc)
            if not data:
                self.conn.receive_eof()  # raises if a frame was cut short
                return None
            self.conn.receive_data(data)

    async def run(self, handler: Handler | None = None) -> None:
        """Read and dispatch until the connection closes. Never raises for
        anything the other side does; protocol violations close this
        connection only and are logged."""
        violation: ProtocolError | None = None
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await self._read_loop(nursery, handler)
                except ProtocolError as exc:
                    # Caught here, inside the nursery: once it left, trio
                    # would wrap it in an exception group.
                    violation = exc
                except Disconnected:
                    pass  # an answer of the read loop's own met a hung-up socket: the other side left
                finally:
                    # Closed before the handlers are cancelled, so a handler's
                    # cleanup can tell "the other side went away" from "asked to stop".
                    self._mark_closed(str(violation) if violation else self.close_reason or "closed by the other side")
                    nursery.cancel_scope.cancel()
            if violation is not None:
                log.warning("closing connection from %s: %s", self.label, violation)
                with trio.move_on_after(0.5) as scope:
                    scope.shield = True
                    data = self.conn.data_to_send()  # the bye the machine queued, telling them why
                    if data:
                        try:
                            await self.transport.send_all(data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            pass
        finally:
            self._mark_closed(self.close_reason or "closed")
            self.conn.release_all()  # requests cut off by the close no longer count against their user
            with trio.CancelScope(shield=True):
                await self.transport.aclose()

    async def _read_loop(self, nursery: trio.Nursery, handler: Handler | None) -> None:
        while True:
            event = await self._next_event()
            if event is None:
                return
            if isinstance(event, (Reply, Item)):
                target = self._pending.get(event.id)
                if target is not None:
                    target.send_nowait(event)
            elif isinstance(event, Request):
                if handler is None:
                    await self._send(self.conn.send_error(event.id, "unsupported", "this side serves no requests"))
                    continue
                scope = trio.CancelScope()
                self._serving[event.id] = scope
                nursery.start_soon(self._serve_one, handler, event, scope)
            elif isinstance(event, Cancel):
                cancelled = self._serving.get(event.id)
                if cancelled is not None:
                    cancelled.cancel()
            elif isinstance(event, Credit):
                wakeup = self._credit_wakeups.pop(event.id, None)
                if wakeup is not None:
                    wakeup.set()
            elif isinstance(event, Note):
                if handler is not None:
                    await self._note_slots.acquire()  # backpressure: stop reading while full
                    nursery.start_soon(self._serve_note, handler, event)
            elif isinstance(event, RemoteClosed):
                self.close_reason = f"{event.code}: {event.message}"
                if event.code not in ("bye",):
                    log.warning("%s closed the connection: %s", self.label, event.message)
                return

    async def _serve_note(self, handler: Handler, note: Note) -> None:
        try:
            await handler(self, note)
        except Exception:
            log.exception("note %r from %s failed", note.op, self.label)
        finally:
            self.conn.note_done(note)
            self._note_slots.release()

    async def _emit(self, rid: int, item: object) -> None:
        """Send one stream item once the requester has granted credit for it."""
        while self.conn.item_credit(rid) <= 0:
            if self.closed:
                raise Disconnected(f"connection to {self.label} is closed: {self.close_reason}")
            wakeup = self._credit_wakeups.setdefault(rid, trio.Event())
            await wakeup.wait()
        # No checkpoint between the credit check and the accounting: another
        # emitter of the same stream cannot slip in between.
        await self._send(self._framed(self.conn.send_item, rid, item))

    async def _serve_one(self, handler: Handler, request: Request, scope: trio.CancelScope) -> None:
        try:
            with scope:
                try:
                    result = await handler(self, request)
                    if isinstance(result, Stream):

                        async def emit(item, rid=request.id):
                            await self._emit(rid, item)

                        await result.produce(emit)
                        result = None
                    frame = self._framed(self.conn.send_reply, request.id, result)
                except (RemoteError, BaseExceptionGroup) as caught:
                    exc = leaf_error(caught)
                    if isinstance(exc, trio.Cancelled):
                        raise
                    if not isinstance(exc, RemoteError):
                        log.error("request %r from %s failed", request.op, self.label, exc_info=exc)
                        exc = RemoteError("internal", f"{type(exc).__name__}: {exc}")
                    if isinstance(exc, Disconnected) and (self.closed or self.conn.state is State.CLOSED):
                        return
                    frame = self._framed(self.conn.send_error, request.id, exc.code, exc.message)
                except ProtocolError as exc:  # e.g. a result too large for one frame
                    frame = self._framed(self.conn.send_error, request.id, exc.code, exc.message)
                except Exception as exc:
                    log.exception("request %r from %s failed", request.op, self.label)
                    frame = self._framed(self.conn.send_error, request.id, "internal", f"{type(exc).__name__}: {exc}")
                await self._send(frame)
            if scope.cancelled_caught and not self.closed and self.conn.serving(request.id):
                # The requester cancelled: close the stream politely.
                await self._send(self._framed(self.conn.send_reply, request.id, None))
        except RemoteError:
            pass  # connection went away; nothing to tell anybody
        finally:
            self._serving.pop(request.id, None)
            self._credit_wakeups.pop(request.id, None)

    def _why_closed(self) -> str:
        """The reason the connection closed, as a suffix for error messages (empty if none is known)."""
        return f": {self.close_reason}" if self.close_reason and self.close_reason != "closed by the other side" else ""

    def _mark_closed(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        for send in self._pending.values():
            send.close()
        self._pending.clear()
        for wakeup in self._credit_wakeups.values():
            wakeup.set()  # emitters waiting for credit see the channel closed
        self._credit_wakeups.clear()

    async def aclose(self) -> None:
        self._mark_closed("closed locally")
        with trio.CancelScope(shield=True):
            await self.transport.aclose()


# ---------------------------------------------------------------- dialing


async def dial_unix(path: str, *, node: str = "client", timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
    with trio.fail_after(timeout):
        stream = await trio.open_unix_socket(path)
    return await _handshake(Channel(stream, Connection(dialer=True, node=node, role=Role.CLIENT), label=f"gangd at {path}"))


async def dial_tcp(host: str, port: int, *, node: str, secret: bytes, label: str, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(host, port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return await _handshake(Channel(stream, Connection(dialer=True, node=node, role=Role.PEER, secret=secret), label=label))


async def _handshake(channel: Channel) -> Channel:
    try:
        await channel.handshake()
    except BaseException:
        with trio.CancelScope(shield=True):
            await channel.transport.aclose()
        raise
    return channel


@asynccontextmanager
async def running(channel: Channel, handler: Handler | None = None):
    """Run ``channel`` in a background task for the duration of the block."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.run, handler)
        try:
            yield channel
        finally:
            nursery.cancel_scope.cancel()
