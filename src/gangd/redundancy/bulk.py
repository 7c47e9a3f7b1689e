"""A bulk data path for checkpoint bytes between daemons: raw TCP, not the RPC channel.

Why: through the peers' msgpack :class:`gangd.rpc.Channel` a file moves in
128 KiB items under a 256 KiB credit window, each item packed, framed,
unpacked and credited on the daemons' event loops (~4.5 ms of CPU per MiB
across both ends): partner copies ran at 0.07x and XOR parity at 0.13x of
local writes. Here the *control* stays on the channel — the puller asks
``ckpt_bulk_read {lineage, gen, name | start, length}``, the sender checks the
request and opens the file exactly as for ``ckpt_file_read``, then answers
one item ``{ticket, port, size}`` — and only the *bytes* move on a TCP
connection of their own, read and written by worker threads in 1 MiB
chunks straight from and into preallocated buffers.

Who may open one: the connection opens with an HMAC challenge-response keyed
by the cluster secret (bound to this use: :func:`bulk_key`), in the manner of
the peers' handshake (:mod:`gangd.protocol.connection`)::

    dialer   -> listener   MAGIC | nonce_d | ticket                       (48 bytes)
    listener -> dialer     nonce_l | H(key, MAGIC|"listener"|nonce_d|nonce_l|ticket)
    dialer   -> listener   H(key, MAGIC|"dialer"|nonce_d|nonce_l|ticket)

The listener answers only a ticket it issued (16 random bytes, sent only
over the authenticated channel, one use, alive only while that channel
request is); fresh nonces on both sides and a label per direction: a
recorded exchange replays nowhere, and neither proof reflects as the other.
A process without the secret (another user on the node: the secret file
is root's) gets the connection closed and no byte of a file.

On the wire after that: chunks of ``header(len u32, xxh3_64 u64) | bytes``,
every chunk ``min(CHUNK, left)`` long, then a header of length 0, then the
sender closes. The receiver never trusts the sender: it knows the size (a
manifest it holds, or the slice it asked for) and refuses a chunk of
another length, a chunk whose hash does not match, a trailer that is not
one, a byte after it, a connection that ends short; a file's whole XXH3-128
must be the manifest's. A file lands under a temporary name, fsynced,
renamed; a refused transfer leaves nothing. Paths come from the receiver's
own arguments, never from the peer. The receiver reads a chunk's bytes and
the header after them in one ``recvmsg_into`` (its length already checked,
both into buffers of their own fixed size): one system call, one release
of the GIL, per chunk.

Blocking I/O runs in worker threads, one per transfer and per side, each
doing its side's whole share in one hand-off from the event loop: the
sender's thread sends and then closes the socket and the source; the
puller's dials, proves itself and receives (for an XOR slice, the parity's
own thread does it, and it waits for the sender's offer on a
``threading.Event``, not through the event loop). The thread owns (and
closes) every fd it uses; the event loop holds a :class:`Line` per
transfer and, when the transfer is cancelled, cuts it: the socket is shut
down so the thread's blocking call fails at once, on either side, even if
the peer is hung and never lets go of its end (a socket the thread
attaches after the cut is closed before a byte moves; what a thread that
never started was handed is closed by the event loop). The cancel then
waits, up to :data:`HANDSHAKE_TIMEOUT`, for the cut thread to clean up
(its fds closed, a temporary file removed): a cancelled transfer has left
nothing when the cancel returns.

Why so few hand-offs: a transfer's fixed cost is control, not bytes — a
channel request and its items, a ticket, the handshake, a TCP connection,
and each crossing between the event loop and a thread (~0.1-0.2 ms of CPU
each here, on a loaded 2-CPU machine). With a ``to_thread`` to open, to
dial, to send and to close, and ``from_thread`` round trips to start the
request, take the socket and release the request, a 64 KiB slice cost
4.9-5.4 ms of CPU (both ends, 7 at once in one process: the XOR's pattern);
with the hand-offs above, 3.0-3.6 ms (load 8-11); ``bench/bulk_control.py``,
6 alternating runs at load 2.4-9: medians 5.1 -> 4.1 ms, and 1.45x -> 1.15x
the channel path's own cost in the same run. In ``bench/recovery.py``
(8 nodes, XOR set of 8) every node pulls one slice from each of 7 peers and
serves 7, one transfer per peer pair and direction per generation: there
is nothing to batch there, so a connection reused across a generation's
transfers would not lower their count; the cost per transfer is what was
left to cut. A peer that stops sending
fails the transfer after :data:`IO_TIMEOUT` seconds: the kernel's timeout
(``SO_RCVTIMEO``/``SO_SNDTIMEO``, :func:`blocking`), not Python's, whose
socket timeout polls before every call. With it a chunk's header and its
bytes are each one ``recv_into(MSG_WAITALL)`` (a Python-timeout socket is
non-blocking underneath: ~6 calls, each after a poll, per MiB); measured on
loopback, one sender and one receiver thread (1 MiB chunks, each read from
the page cache and hashed at both ends): 0.59 ms of CPU per MiB -> 0.50;
in ``bench/recovery.py`` (8 nodes, 56 connections at once on 2 CPUs) it is
within that bench's noise. (``os.sendfile`` from the page cache was
measured too and rejected: it saves the sender's copy, but the receiver then
copies out of page-sized fragments, and the pair cost 0.73 ms/MiB.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio
import xxhash

from .. import ckptstore, safefs
from ..directio import DirectFile, aligned_buffer
from ..rpc import Channel, RemoteError, Stream

MAGIC = b"gangd.bulk/hmac1"
NONCE = 16
TICKET = 16
MAC = hashlib.sha256().digest_size
HELLO = len(MAGIC) + NONCE + TICKET
#: Bytes per chunk on the wire (and per read of the disk).
CHUNK = 1 << 20
HEADER = struct.Struct("<IQ")
#: Seconds for a handshake (a peer answers in milliseconds), and for any one read or write of a transfer.
HANDSHAKE_TIMEOUT = 3.0
IO_TIMEOUT = 60.0
#: Seconds a ticket waits for its connection.
CLAIM_TIMEOUT = 30.0
#: Tickets outstanding, and handshakes under way, at once (per daemon).
MAX_TICKETS = 256
MAX_HANDSHAKES = 64
SOCKET_BUFFER = 4 << 20


class BulkError(RemoteError):
    """A bulk transfer refused or failed; the message names the peer and what."""

    def __init__(self, message: str):
        super().__init__("transfer_failed", message)


class BulkMismatch(BulkError):
    """The bytes arrived whole (each chunk checked) and are not what the manifest says: the source is damaged."""


def bulk_key(secret: bytes) -> bytes:
    """The handshake's HMAC key: the cluster secret, bound to this use of it."""
    return hmac.new(secret, b"gangd checkpoint bulk transfer", hashlib.sha256).digest()


def proof(key: bytes, role: bytes, nonce_d: bytes, nonce_l: bytes, ticket: bytes) -> bytes:
    return hmac.new(key, MAGIC + b"|" + role + b"|" + nonce_d + b"|" + nonce_l + b"|" + ticket, hashlib.sha256).digest()


def chunk_hash(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _tune(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def blocking(sock: socket.socket, timeout: float | None = None) -> None:
    """Make ``sock`` blocking with the kernel's send and receive timeouts
    (default :data:`IO_TIMEOUT`): a call that waits longer fails with
    EAGAIN (:func:`_timed_out`), and no call polls first."""
    timeout = IO_TIMEOUT if timeout is None else timeout
    sock.settimeout(None)
    seconds = int(timeout)
    tv = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _timed_out(exc: OSError) -> bool:
    """A blocking call that hit the socket's kernel timeout (:func:`blocking`)."""
    return isinstance(exc, TimeoutError) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


# ---------------------------------------------------------------- sources (sender side)


@dataclass
class Source:
    """What a ticket sends: ``size`` bytes, ``read_into(offset, view)`` fills a view; ``close`` releases."""

    size: int
    read_into: Callable[[int, memoryview], None]
    close: Callable[[], None]


def file_source(fd: int, size: int, what: str) -> Source:
    with contextlib.suppress(OSError):  # (read ahead while the first chunks go out)
        os.posix_fadvise(fd, 0, min(size, 16 << 20), os.POSIX_FADV_WILLNEED)

    def read_into(offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise BulkError(f"{what} shrank while it was sent")
            done += n

    return Source(size, read_into, lambda: os.close(fd))


def send_source(sock: socket.socket, source: Source) -> int:
    """Send ``source`` as chunks then the trailer, then half-close (blocking; a worker thread)."""
    buf = memoryview(bytearray(min(CHUNK, max(source.size, 1))))
    off = 0
    while off < source.size:
        n = min(CHUNK, source.size - off)
        view = buf[:n]
        source.read_into(off, view)
        _send_parts(sock, [HEADER.pack(n, chunk_hash(view)), view])
        off += n
    sock.sendall(HEADER.pack(0, 0))
    sock.shutdown(socket.SHUT_WR)
    return off


def _send_parts(sock: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


# ---------------------------------------------------------------- receiving (a worker thread)


def _recv_exact(sock: socket.socket, view: memoryview, what: str, at: str) -> None:
    """Fill ``view`` (one call, normally: MSG_WAITALL on a blocking socket;
    again after a signal or a timeout that cut it short)."""
    _recv_parts(sock, [view], what, [at])


def _recv_parts(sock: socket.socket, views: list[memoryview], what: str, ats: list[str]) -> None:
    """Fill every view in turn with one ``recvmsg_into`` (MSG_WAITALL), again
    only after a signal or a timeout that cut it short; ``ats[i]``: where
    the stream is if it ends inside ``views[i]``."""
    left = [v for v in views if len(v)]
    places = [at for v, at in zip(views, ats, strict=True) if len(v)]
    while left:
        try:
            n = sock.recvmsg_into(left, 0, socket.MSG_WAITALL)[0]
        except OSError as exc:
            if _timed_out(exc):
                raise BulkError(f"{what}: the peer sent nothing for {IO_TIMEOUT:.0f} s ({places[0]})") from None
            raise BulkError(f"{what}: the connection failed ({places[0]}): {exc.strerror or exc}") from None
        if n == 0:
            raise BulkError(f"{what}: the connection ended {places[0]}")
        while left and n >= len(left[0]):
            n -= len(left[0])
            left.pop(0)
            places.pop(0)
        if left and n:
            left[0] = left[0][n:]


class Receiver:
    """Reads a sender's chunks from ``sock`` into one buffer, each checked
    (its length the one expected, its hash right), never past ``size``; then
    the trailer and the end of the connection, nothing after it. A chunk's
    bytes and the header after them (the next chunk's, or the trailer) come
    in one call: one system call and one release of the GIL per chunk, not two."""

    def __init__(self, sock: socket.socket, size: int, what: str, *, digest=None):
        self.sock, self.size, self.what, self.digest = sock, size, what, digest
        # page-aligned (mmap), so a chunk can be written with O_DIRECT
        self.buf = aligned_buffer(min(CHUNK, size))
        self.header = memoryview(bytearray(HEADER.size))
        self.off = 0

    def chunks(self) -> Iterator[memoryview]:
        """Each verified chunk (a view of the one buffer: used before the next is asked for)."""
        _recv_exact(self.sock, self.header, self.what, f"after 0 of {self.size} bytes" if self.size else "before its trailer")
        while self.off < self.size:
            want = min(CHUNK, self.size - self.off)
            n, h = HEADER.unpack(self.header)
            if n != want:
                if n == 0:
                    raise BulkError(f"{self.what}: the peer ended after {self.off} of {self.size} bytes")
                if self.off + n > self.size:
                    raise BulkError(f"{self.what}: the peer sent more than the {self.size} bytes expected")
                raise BulkError(f"{self.what}: the peer sent a chunk of {n} bytes at offset {self.off}, {want} were expected")
            view = self.buf[:n]
            after = self.off + n
            _recv_parts(self.sock, [view, self.header], self.what,
                        [f"inside the chunk at offset {self.off}", f"after {after} of {self.size} bytes" if after < self.size else "before its trailer"])
            if chunk_hash(view) != h:
                raise BulkError(f"{self.what}: the chunk at offset {self.off} is corrupted (its checksum does not match)")
            if self.digest is not None:
                self.digest.update(view)
            self.off = after
            yield view
        self.finish()

    def finish(self) -> None:
        """The header after the last chunk (read with it) must be the trailer, and then the end of the connection."""
        if HEADER.unpack(self.header) != (0, 0):
            raise BulkError(f"{self.what}: the peer sent more than the {self.size} bytes expected")
        try:
            extra = self.sock.recv(1)
        except OSError as exc:
            if _timed_out(exc):
                raise BulkError(f"{self.what}: the peer neither closed nor sent anything for {IO_TIMEOUT:.0f} s after the end") from None
            raise BulkError(f"{self.what}: the connection failed after the end: {exc.strerror or exc}") from None
        if extra:
            raise BulkError(f"{self.what}: the peer sent more after the end of the file")


def receive_file(sock: socket.socket, dest_dir: Path, leaf: str, size: int, checksum: str, owner: tuple[int, int] | None, what: str,
                 durable: bool = True) -> None:
    """Receive ``size`` bytes into ``dest_dir/leaf`` (via a temporary name,
    fsynced, renamed), checked against ``checksum``; owns and closes ``sock``.
    On any refusal nothing is left under either name. ``durable=False``:
    no fsync (the caller syncs a batch of files before its manifest)."""
    tmp = f".{leaf}.transfer"
    try:
        try:
            dir_fd = os.open(dest_dir, safefs.DIR_FLAGS)
        except OSError as exc:
            raise BulkError(f"{what}: cannot open {dest_dir}: {exc.strerror}") from None
        out: DirectFile | None = None
        done = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            out = DirectFile(tmp, dir_fd)
            if size:
                with contextlib.suppress(OSError):
                    os.posix_fallocate(out.fd, 0, size)
            digest = ckptstore.hasher()
            for chunk in Receiver(sock, size, what, digest=digest).chunks():
                out.write(chunk)
            mine = digest.hexdigest()
            if mine != checksum:
                raise BulkMismatch(f"{what}: checksum {mine[:16]}… of the bytes received does not match the manifest's {checksum[:16]}…")
            if owner is not None:  # only once every byte checked out: until then the file is root's, 0600
                os.fchown(out.fd, *owner)
            if durable:
                os.fsync(out.fd)
            out.close()
            os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            done = True
            if durable:
                os.fsync(dir_fd)
        except OSError as exc:
            raise BulkError(f"{what}: {ckptstore.describe_os_error(exc, Path(dest_dir) / leaf)}") from None
        finally:
            if out is not None:
                out.close()
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
            os.close(dir_fd)
    finally:
        sock.close()


# ---------------------------------------------------------------- the dialer's side


class Line:
    """The bulk socket of a transfer that a worker thread opens, uses and
    closes, and that the event loop can cut at any moment (:meth:`cut`:
    the thread's blocking call fails at once; a socket attached after the
    cut is closed before a byte moves). The thread owns the fd; the event
    loop only ever shuts it down."""

    def __init__(self, sock: socket.socket | None = None, owned: tuple[Callable[[], None], ...] = ()) -> None:
        self._lock = threading.Lock()
        self.sock = sock
        #: What the thread is handed to close: closed by the event loop instead if the thread never starts.
        self.owned = owned
        self._cut = self._started = False
        #: Set when the thread is done (its fds closed, a refused file's temporary name removed).
        self.done = threading.Event()

    def begin(self) -> bool:
        """The thread starts using the line: False if it was cut first (then the thread does nothing)."""
        with self._lock:
            self._started = not self._cut
            return self._started

    def attach(self, sock: socket.socket, what: str) -> None:
        with self._lock:
            if self._cut:
                sock.close()
                raise BulkError(f"{what}: the transfer was cancelled")
            self.sock = sock

    def cut(self) -> bool:
        """Shut the socket down; True if the thread had started (it closes
        what it holds), else what it was handed is closed here."""
        with self._lock:
            self._cut = True
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
            started = self._started
        if not started:
            for close in self.owned:
                with contextlib.suppress(OSError):
                    close()
        return started


def dial(host: str, port: int, key: bytes, ticket: bytes, what: str, line: Line | None = None) -> socket.socket:
    """Connect to a peer's bulk listener and prove we hold the cluster secret
    (blocking: a worker thread); the peer must prove it too. Returns the
    socket, blocking with the kernel's :data:`IO_TIMEOUT` (:func:`blocking`).
    ``line``: the socket is attached to it before the handshake (a cut
    stops the handshake too)."""
    try:
        sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
    except OSError as exc:
        raise BulkError(f"{what}: cannot connect to the peer's bulk port {host}:{port}: {exc.strerror or exc}") from None
    if line is not None:
        line.attach(sock, what)
    try:
        _tune(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce_d = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce_d + ticket)
        answer = memoryview(bytearray(NONCE + MAC))
        _recv_exact(sock, answer, what, "during the handshake (the peer refused it)")
        nonce_l, theirs = bytes(answer[:NONCE]), bytes(answer[NONCE:])
        if not hmac.compare_digest(theirs, proof(key, b"listener", nonce_d, nonce_l, ticket)):
            raise BulkError(f"{what}: the bulk listener could not prove it holds the cluster secret")
        sock.sendall(proof(key, b"dialer", nonce_d, nonce_l, ticket))
        blocking(sock)
        return sock
    except BaseException:
        sock.close()
        raise
    # (OSError from sendall: the caller's BulkError wrapper names it)


# ---------------------------------------------------------------- the listener's side


@dataclass
class _Slot:
    claimed: trio.Event = field(default_factory=trio.Event)
    sock: socket.socket | None = None


class BulkServer:
    """The sender's bulk listener. ``await nursery.start(server.run)`` binds
    it (``port`` then known); :func:`handle_bulk_read` issues tickets."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0):
        self.key = bulk_key(secret)
        self.host, self.port = host, port
        self.tickets: dict[bytes, _Slot] = {}
        # Handshakes under way, oldest first: when the table is full the
        # oldest is cut off to make room (a stranger holding idle
        # connections open cannot lock the real peers out, who need
        # milliseconds), never the newcomer refused.
        self._pending: dict[int, trio.CancelScope] = {}
        self._serial = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self.port)
            for listener in listeners:
                nursery.start_soon(self._accept, listener)

    async def _accept(self, listener: trio.SocketListener) -> None:
        async with listener, trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                if len(self._pending) >= MAX_HANDSHAKES:
                    oldest = next(iter(self._pending))
                    self._pending.pop(oldest).cancel()
                self._serial += 1
                scope = trio.CancelScope(deadline=trio.current_time() + HANDSHAKE_TIMEOUT)
                self._pending[self._serial] = scope
                nursery.start_soon(self._admit, stream, self._serial, scope)

    async def _admit(self, stream: trio.SocketStream, serial: int, scope: trio.CancelScope) -> None:
        try:
            slot, sock = None, stream.socket
            with scope:
                hello = await _read_exact(sock, HELLO)
                if hello is None or hello[: len(MAGIC)] != MAGIC:
                    return
                nonce_d, ticket = hello[len(MAGIC) : len(MAGIC) + NONCE], hello[len(MAGIC) + NONCE :]
                slot = self.tickets.get(ticket)
                if slot is None or slot.claimed.is_set():
                    return
                nonce_l = os.urandom(NONCE)
                await stream.send_all(nonce_l + proof(self.key, b"listener", nonce_d, nonce_l, ticket))
                theirs = await _read_exact(sock, MAC)
                if theirs is None or not hmac.compare_digest(theirs, proof(self.key, b"dialer", nonce_d, nonce_l, ticket)):
                    return
                if self.tickets.get(ticket) is not slot or slot.claimed.is_set():
                    return
                plain = socket.socket(fileno=sock.detach())
                blocking(plain)
                _tune(plain)
                slot.sock = plain
                slot.claimed.set()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._pending.pop(serial, None)
            if sock.fileno() >= 0:
                sock.close()

    def issue(self) -> tuple[bytes, _Slot]:
        if len(self.tickets) >= MAX_TICKETS:
            raise RemoteError("busy", f"this node has {MAX_TICKETS} checkpoint transfers under way; try again")
        ticket = os.urandom(TICKET)
        slot = self.tickets[ticket] = _Slot()
        return ticket, slot


async def _read_exact(sock, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        got = await sock.recv(n - len(data))
        if not got:
            return None
        data += got
    return data


async def serve(server: BulkServer, open_source: Callable[[], Source], what: str,
                send: Callable[[socket.socket, Source], int] = send_source) -> Stream:
    """A channel op's answer: once its stream starts, open the source (a
    worker thread), issue a ticket, tell the puller ``{ticket, port, size}``, wait for its bulk
    connection, send, then ``{end}``. Everything is released when the
    request ends, however it ends."""

    async def produce(emit) -> None:
        # (opened here, not before: a stream that never starts holds no fd)
        source = await trio.to_thread.run_sync(open_source)
        ticket, slot, handed = None, None, False
        try:
            ticket, slot = server.issue()
            await emit({"ticket": ticket, "port": server.port, "size": source.size})
            with trio.move_on_after(CLAIM_TIMEOUT) as waited:
                await slot.claimed.wait()
            if waited.cancelled_caught or slot.sock is None:
                raise BulkError(f"{what}: the puller did not open its bulk connection within {CLAIM_TIMEOUT:.0f} s")
            sock, slot.sock, handed = slot.sock, None, True  # (from here the worker thread owns both, and closes them)
            sent = await run_on_line(Line(sock, owned=(source.close, sock.close)), _send_then_close, send, sock, source)
            await emit({"end": sent})
        finally:
            if ticket is not None:
                server.tickets.pop(ticket, None)
            if slot is not None and slot.sock is not None:
                slot.sock.close()
            if not handed:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(source.close)

    return Stream(produce)


def _send_then_close(send: Callable[[socket.socket, Source], int], sock: socket.socket, source: Source) -> int:
    """The sender's thread: ``send``, then the socket and the source closed
    here (one hand-off per transfer, not one to send and one to close)."""
    try:
        return send(sock, source)
    finally:
        try:
            source.close()
        finally:
            sock.close()


async def run_on_socket(sock: socket.socket, fn, *args):
    """``fn(*args)`` in a worker thread; cancelled, the socket is shut down so
    the thread's blocking call fails at once (the thread still owns its fds)."""
    return await run_on_line(Line(sock), fn, *args)


async def run_on_line(line: Line, fn, *args):
    """``fn(*args)`` in a worker thread, which uses (and may open:
    :func:`dial` with ``line``) the line's socket; cancelled, the line is
    cut so the thread's blocking call fails at once."""
    def guarded():
        try:
            if not line.begin():
                raise BulkError("the transfer was cancelled")  # (nobody waits for this: the caller was cancelled)
            return fn(*args)
        finally:
            line.done.set()

    try:
        return await trio.to_thread.run_sync(guarded, abandon_on_cancel=True)
    except trio.Cancelled:
        if line.cut():
            # The cut thread fails at once and cleans up (closes its fds,
            # removes a temporary file): wait for that, a little, so a
            # cancelled transfer has left nothing when the cancel returns.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(line.done.wait, HANDSHAKE_TIMEOUT)
        raise
    except OSError as exc:
        if _timed_out(exc):
            raise BulkError(f"the peer stopped sending or receiving for {IO_TIMEOUT:.0f} s") from None
        raise BulkError(f"the bulk connection failed: {exc.strerror or exc}") from None


# ---------------------------------------------------------------- the puller's control


@dataclass(frozen=True)
class Bulk:
    """What a puller needs to use the bulk path: the cluster secret's bulk
    key, and the host to dial (default: the channel's peer address, or this
    machine for a Unix-socket channel)."""

    key: bytes
    host: str | None = None

    @classmethod
    def from_secret(cls, secret: bytes, host: str | None = None) -> Bulk:
        return cls(bulk_key(secret), host)

    def host_of(self, channel: Channel) -> str:
        if self.host is not None:
            return self.host
        sock = getattr(channel.transport, "socket", None)
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            return sock.getpeername()[0]
        return "127.0.0.1"


def check_offer(offer: object, size: int, what: str) -> tuple[bytes, int]:
    """The sender's ``{ticket, port, size}``: well formed and of the size we expect."""
    if not isinstance(offer, dict):
        raise BulkError(f"{what}: the peer answered with a malformed offer")
    ticket, port, got = offer.get("ticket"), offer.get("port"), offer.get("size")
    if not isinstance(ticket, bytes) or len(ticket) != TICKET or type(port) is not int or not 0 < port < 65536 or type(got) is not int:
        raise BulkError(f"{what}: the peer answered with a malformed offer")
    if got != size:
        raise BulkError(f"{what}: the peer offers {got} bytes; {size} were expected")
    return ticket, port


async def first_item(items, what: str) -> object:
    async for item in items:
        return item
    raise BulkError(f"{what}: the peer ended the request without an offer")
