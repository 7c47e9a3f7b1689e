"""Sockets and the progress engine of one rank.

One connection per directed pair of ranks: the sender dials the receiver on
its first message and that connection carries only sender -> receiver
messages, so each connection is a FIFO channel and ordering per pair comes
for free. Same node: AF_UNIX; other nodes: TCP.

Everything on the data path happens in the thread that calls the API, with
non-blocking sockets and one ``select.poll`` over the listeners, the incoming
connections and a wakeup eventfd. Nothing reads the network in the
background while the gate is open: like MPI, the network progresses when the
program calls in. A send that cannot complete keeps reading its incoming
connections while it waits, so two ranks sending large messages to each other
cannot deadlock. A receive with nothing to take polls for a few microseconds
before it sleeps (see :meth:`Engine._spin`).

Messages that fit in a connection's 64 KiB read buffer are parsed out of it
(several per recv); a larger one is read straight into the payload object
the program will get (an ``np.empty`` array, a bytes object, or the buffer
of a waiting ``recv_into``).

New connections are the :class:`~.handshake.Doorman` thread's until they
proved they belong to this job (:mod:`.handshake`): it owns the listeners
and every connection whose handshake is under way, and hands proven ones
over through a queue that whoever holds ``lock`` empties (:meth:`Engine.adopt`).
Neither thread here ever reads a connection that is not yet proven.

The control thread (:mod:`.control`) shares this state. ``lock`` guards it:
the program's thread holds it for the whole of a call and releases it only
around a blocking poll; the control thread takes it to apply what the daemon
said and, while the gate is closed, to drain incoming connections itself
(a sender blocked on a rank that is busy computing must still be able to
finish, or the gate could never be confirmed closed).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from . import handshake, wire
from .errors import CommError, PeerExited
from .wire import (
    BYTES,
    HEADER,
    HEADER_SIZE,
    MAX_META,
    NDARRAY,
    PICKLE,
    RAW_KINDS,
    SMALL,
)

ANY = -1

READ_BUFFER = 64 * 1024  # per connection: small messages arrive in one recv, several at a time
SOCKET_BUFFER = 4 * 1024 * 1024  # capped by net.core.[rw]mem_max; fewer wakeups for large messages
CONNECT_TIMEOUT = 30.0
#: How long a rank the daemon reported gone may keep its connection to us
#: open before we stop waiting for the rest of its bytes (a node that died
#: sends no FIN).
EXIT_GRACE = 5.0

_ndarray = np.ndarray
_unpack_header = HEADER.unpack_from
_pack_header = HEADER.pack
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_NOSIGNAL = socket.MSG_NOSIGNAL  # EPIPE, never SIGPIPE, whatever the program did with the signal
_NO_VIEW = memoryview(b"")  # Msg.view of a message that is not arriving


class Msg:
    """One message, arrived or arriving. ``done`` once all its payload bytes are in."""

    __slots__ = ("claimed", "done", "got", "kind", "meta", "nbytes", "payload", "seq", "src", "tag", "view")

    def __init__(self, src: int, tag: int, seq: int, kind: int, meta: bytes, payload: Any, nbytes: int, done: bool = True) -> None:
        self.src = src
        self.tag = tag
        self.seq = seq
        self.kind = kind
        self.meta = meta
        self.payload = payload
        self.nbytes = nbytes
        self.view = _NO_VIEW  # writable bytes of the payload while it arrives (kept once arrived if claimed), else empty
        self.got = 0
        self.done = done
        self.claimed = False  # arriving straight into the buffer of a waiting recv_into


class Incoming:
    """A connection from rank ``src`` to us, proven (see :mod:`.handshake`)."""

    __slots__ = ("buf", "cur", "end", "fd", "sock", "src", "start", "view")

    def __init__(self, sock: socket.socket, src: int):
        self.sock = sock
        self.fd = sock.fileno()
        self.src = src
        self.buf = bytearray(READ_BUFFER)
        self.view = memoryview(self.buf)
        self.start = 0  # unparsed bytes are buf[start:end]
        self.end = 0
        self.cur: Msg | None = None  # the message whose payload is read directly into its buffer


class Want:
    """A recv_into waiting for a message: a matching large message may land straight in ``view``."""

    __slots__ = ("buf", "source", "tag", "view")

    def __init__(self, source: int, tag: int, buf: object, view: memoryview) -> None:
        self.source = source
        self.tag = tag
        self.buf = buf
        self.view = view


def _matches(source: int, tag: int, src: int, mtag: int) -> bool:
    # ANY tag never matches internal (negative) tags: collectives stay invisible to the program.
    return (source == ANY or source == src) and (mtag == tag if tag != ANY else mtag >= 0)


def _tag_name(tag: int) -> str:
    return "any tag" if tag == ANY else f"tag {tag}"


class Engine:
    def __init__(self, rank: int, size: int, node: str | None = None, *, gate: bool = True, spin: float = 0.0):
        self.rank = rank
        self.size = size
        self.node = node
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()  # held around each whole message send (the gate waits for it)
        self.key = b""  # the handshake's HMAC key, derived from the job token
        self.peers: list[dict[str, Any] | None] = [None] * size
        self.gate_enabled = gate
        self.spin = spin  # seconds a receive polls before it sleeps (see _spin)
        self.gate_open = True
        self.gate_epoch = 0
        self.daemon_lost: str | None = None
        self.closed = False
        # Authoritative counts are Python lists (cheap to bump); each bump is
        # mirrored into ``counters``, the file the daemon maps.
        self.n_sent = [0] * size
        self.n_recv = [0] * size
        self.n_deliv = [0] * size
        self._set_counters(np.zeros((3, size), np.uint64))
        self.queue: deque[Msg] = deque()  # arrived, not yet delivered, in arrival order
        self._poll = select.poll()
        self._net: dict[int, Incoming] = {}  # fd -> proven incoming connection
        self._listeners: list[socket.socket] = []  # the doorman's, once it runs
        self.doorman: handshake.Doorman | None = None
        self._from: dict[int, Incoming] = {}  # src -> its connection to us
        self._out: list[socket.socket | None] = [None] * size
        self._cut: dict[int, tuple] = {}  # dest -> (exception class, message) sends to it raise: its channel broke
        self._out_fd = -1  # the outgoing socket a blocked send waits on
        self._writable = False
        self._exited: dict[int, str] = {}  # rank -> why, from the daemon
        self._exited_at: dict[int, float] = {}
        self._eof: dict[int, str] = {}  # rank -> how its connection to us ended: it will send nothing more
        self._pending_exits: set[int] = set()  # exited per the daemon, but its last bytes may be on their way
        self._want: Want | None = None
        self.fd_gen = 0  # bumped whenever the set of sockets changes (the control thread re-polls)
        self.unix_path: str | None = None
        self.wake_main = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.wake_ctl = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll.register(self.wake_main, _POLLIN)
        # Chosen once: with the gate compiled out a send does not even look at it.
        self.send = self._send_gated if gate else self._send_now

    # ------------------------------------------------------------ setup

    def _set_counters(self, counters: np.ndarray) -> None:
        self.counters = counters
        # Bumped through memoryviews: a memoryview item store is ~5x cheaper than numpy's.
        self._c_sent, self._c_recv, self._c_deliv = (memoryview(row) for row in counters)

    def map_counters(self, path: str) -> None:
        """Keep the counters in ``path``, a file the daemon maps (readable while we are stopped)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, 3 * self.size * 8)
        finally:
            os.close(fd)
        mapped = np.memmap(path, dtype=np.uint64, mode="r+", shape=(3, self.size))
        mapped[:] = self.counters
        self._set_counters(mapped)

    def listen(self, comm_dir: str, address: str) -> tuple[str, list]:
        """Open the Unix and TCP listeners; returns their addresses for the daemon."""
        path = os.path.join(comm_dir, f"rank-{self.rank}.sock")
        if len(os.fsencode(path)) >= 108:
            raise CommError(f"socket path {path} is too long for AF_UNIX (GANGD_COMM_DIR is too deep)")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(path)
        self.unix_path = path
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
        tcp = socket.socket(family, socket.SOCK_STREAM)
        tcp.bind((address, 0))
        for listener in (unix, tcp):
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
            self._listeners.append(listener)
        return path, [address, tcp.getsockname()[1]]

    def start(self, peers: list[dict[str, Any] | None], token: bytes, gate: dict) -> None:
        if len(peers) != self.size:
            raise CommError(f"the daemon sent {len(peers)} peer addresses for a job of {self.size} ranks")
        self.peers = peers
        self.key = handshake.derive_key(token)
        self.gate_open = bool(gate.get("open", True))
        self.gate_epoch = int(gate.get("epoch", 0))
        if self._listeners:  # (connections that came meanwhile wait in the listeners' backlog)
            self.doorman = handshake.Doorman(self.rank, self.size, self.key, self._listeners, self._on_proven)
            self.doorman.start()

    def _on_proven(self) -> None:
        """Doorman thread: a proven connection waits in its queue; wake whoever may take it."""
        os.eventfd_write(self.wake_main, 1)
        os.eventfd_write(self.wake_ctl, 1)

    def adopt(self) -> None:
        """Take over the connections the doorman proved (lock held)."""
        doorman = self.doorman
        if doorman is None:
            return
        proven = doorman.proven
        while proven:
            sock, src = proven.popleft()
            if self.closed or src in self._from or src in self._eof:
                sock.close()  # a second connection from the same rank (never a legitimate one)
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Incoming(sock, src)
            self._from[src] = c
            self._add(c.fd, c)

    def handover_waiting(self) -> bool:
        """The doorman has proven connections for us to adopt (any thread, no lock)."""
        doorman = self.doorman
        return doorman is not None and bool(doorman.proven)

    def _unproven(self) -> bool:
        """Connections the doorman has not handed over yet (one may hold a rank's last messages)."""
        doorman = self.doorman
        return doorman is not None and (doorman.pending > 0 or bool(doorman.proven))

    def load(self, sent: list, received: list, delivered: list, messages: list[Msg]) -> None:
        """Counters and undelivered messages of a restored network context."""
        self.n_sent, self.n_recv, self.n_deliv = list(sent), list(received), list(delivered)
        self.counters[:] = [sent, received, delivered]
        self.queue = deque(messages)

    def _add(self, fd: int, what: Incoming) -> None:
        self._net[fd] = what
        self._poll.register(fd, _POLLIN)
        self._fds_changed()

    def _remove(self, fd: int) -> None:
        self._net.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except KeyError:
            pass
        self._fds_changed()

    def _fds_changed(self) -> None:
        self.fd_gen += 1
        if not self.gate_open:
            os.eventfd_write(self.wake_ctl, 1)  # the draining control thread must poll the new set

    # ------------------------------------------------------------ waiting

    def wait(self, timeout_ms: int = -1, spin: bool = False) -> None:
        """Block until something happens on the network or the control thread wakes us
        (after polling without sleeping for ``self.spin`` seconds if ``spin``).

        Releases ``lock`` only for the poll itself.
        """
        if timeout_ms < 0 and self._pending_exits:
            timeout_ms = 250  # re-check ranks whose last bytes may still be on their way
        self.lock.release()
        try:
            events = self._spin() if spin and self.spin else None
            if not events:
                events = self._poll.poll(timeout_ms)
        finally:
            self.lock.acquire()
        net = self._net
        for fd, _ in events:
            what = net.get(fd)
            if what is not None:
                self._read(what)
            elif fd == self._out_fd:
                self._writable = True
            elif fd == self.wake_main:
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass
                self.adopt()

    def _spin(self) -> list:
        """Poll without sleeping for up to ``self.spin`` seconds (lock released).

        A receiver that sleeps pays for being woken up again (several
        microseconds, more than all of our own work on a small message);
        one whose answer comes within the spin never sleeps. Bounded, so a
        rank that waits long costs one spin per wait; used for receives only.
        """
        poll, clock = self._poll.poll, time.perf_counter
        deadline = clock() + self.spin
        while not (events := poll(0)):
            if clock() > deadline:
                break
        return events

    def watch_fds(self) -> list[int]:
        """The incoming connections (after taking over those just proven): what the
        control thread drains while the gate is closed (lock held)."""
        self.adopt()
        return list(self._net)

    def on_fd(self, fd: int) -> None:
        """``fd`` is readable: read that connection (lock held)."""
        what = self._net.get(fd)
        if what is not None:
            self._read(what)

    def drain_until(self, expect: list[int], timeout: float) -> None:
        """Control thread, lock held: read incoming connections until ``received >= expect``."""
        deadline = time.monotonic() + timeout
        poll, gen = select.poll(), -1  # (fd_gen counts up from 0)
        while True:
            short = [src for src in range(self.size) if self.n_recv[src] < expect[src]]
            if not short:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = ", ".join(f"rank {s}: {self.n_recv[s]} of {expect[s]}" for s in short)
                raise CommError(f"messages the daemon counted as sent never arrived within {timeout:.0f} s ({detail})")
            self.adopt()
            if gen != self.fd_gen:
                poll, gen = select.poll(), self.fd_gen
                poll.register(self.wake_ctl, _POLLIN)  # (the doorman's handovers)
                for fd in self._net:
                    poll.register(fd, _POLLIN)
            self.lock.release()
            try:
                events = poll.poll(min(remaining, 0.5) * 1000)
            finally:
                self.lock.acquire()
            for fd, _ in events:
                if fd == self.wake_ctl:
                    try:
                        os.eventfd_read(fd)
                    except BlockingIOError:
                        pass
                else:
                    self.on_fd(fd)

    # ------------------------------------------------------------ receiving: network side

    def _read(self, c: Incoming) -> None:
        """Read what one connection has, never blocking, and turn it into messages.

        One recv per readiness unless the buffer filled up: poll is
        level-triggered, so stopping early costs nothing, while reading on to
        EAGAIN would cost a syscall and an exception per message. Whole
        messages are parsed out of the connection's buffer right here (this
        is the small-message latency path); a message that did not fit is
        read straight into its own payload buffer.
        """
        view = c.view
        while True:
            if c.cur is not None:
                self._read_payload(c, c.cur)  # then back to poll, which says whether the next message is there already
                return
            pos, end = c.start, c.end
            if pos:
                # Only a partial header (+ meta) is ever left over: moving it is cheap.
                view[: end - pos] = view[pos:end]
                pos, end = 0, end - pos
            space = READ_BUFFER - end
            try:
                n = c.sock.recv_into(view[end:] if end else view, space)
            except BlockingIOError:
                c.start, c.end = pos, end
                return
            except OSError as exc:
                self._drop(c, f"connection failed: {exc}")
                return
            if n == 0:
                self._drop(c, "closed its connection" if end == pos else "connection closed in the middle of a message")
                return
            end += n
            buf, src, queue, n_recv = c.buf, c.src, self.queue, self.n_recv
            while end - pos >= HEADER_SIZE:
                kind, tag, seq, mlen, plen = _unpack_header(buf, pos)
                pstart = pos + HEADER_SIZE + mlen
                if mlen > MAX_META:
                    self._violation(c, f"a {mlen}-byte message description")
                    return
                if pstart > end:
                    break
                if seq != n_recv[src] or kind not in wire.KINDS:
                    what = f"a message of unknown kind {kind}" if kind not in wire.KINDS else ""
                    self._violation(c, what or f"message number {seq} where {n_recv[src]} was due (lost or repeated message)")
                    return
                meta = bytes(view[pos + HEADER_SIZE : pstart]) if mlen else b""
                stop = pstart + plen
                if stop > end:  # the rest goes straight into the payload's own buffer
                    try:
                        msg = self._begin(src, tag, seq, kind, meta, plen)
                    except CommError as exc:
                        self._violation(c, str(exc))
                        return
                    msg.got = end - pstart
                    if msg.got:
                        msg.view[: msg.got] = view[pstart:end]
                    c.cur = msg
                    pos = end
                    break
                pos = stop
                arrived = None
                want = self._want
                if want is not None and _matches(want.source, want.tag, src, tag):
                    self._want = None  # this one is for the waiting recv_into; nothing else may land in its buffer
                    if kind in RAW_KINDS and plen <= want.view.nbytes:
                        want.view[:plen] = view[pstart:stop]  # straight there: recv_into allocates nothing
                        arrived = Msg(src, tag, seq, kind, meta, want.buf, plen)
                        arrived.view, arrived.claimed = want.view[:plen], True
                if arrived is None:
                    if kind == BYTES or kind == PICKLE:
                        payload: object = bytes(view[pstart:stop])
                    else:
                        try:
                            payload = wire.materialize(kind, meta, buf, pstart, plen)
                        except CommError as exc:
                            self._violation(c, str(exc))
                            return
                    arrived = Msg(src, tag, seq, kind, meta, payload, plen)
                n_recv[src] = seq + 1  # (_complete, inlined)
                self._c_recv[src] = seq + 1
                queue.append(arrived)
            if pos == end:
                c.start = c.end = 0
            else:
                c.start, c.end = pos, end
            if n < space and c.cur is None:
                return  # drained: poll is level-triggered, no need to read on to EAGAIN

    def _read_payload(self, c: Incoming, msg: Msg) -> None:
        """Read more of the payload of ``msg``, the one arriving on ``c`` (``c.cur``), straight into its buffer."""
        want = msg.nbytes - msg.got
        try:
            n = c.sock.recv_into(msg.view[msg.got :], want)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(c, f"connection failed: {exc}")
            return
        if n == 0:
            self._drop(c, "connection closed in the middle of a message")
            return
        msg.got += n
        if n == want:
            c.cur = None
            self._complete(msg)

    def _violation(self, c: Incoming, what: str) -> None:
        self._drop(c, f"broke the message protocol ({what})")
        raise CommError(f"rank {c.src} sent {what} to rank {self.rank}: this is a bug in gangd.comm")

    def _drop(self, c: Incoming, why: str) -> None:
        self._remove(c.fd)
        c.sock.close()
        if self._from.get(c.src) is c:
            del self._from[c.src]
        self._eof[c.src] = why
        self._pending_exits.discard(c.src)
        msg = c.cur
        if msg is not None:  # half a message: it will never be complete
            c.cur = None
            if msg.claimed:
                self.queue.remove(msg)

    def _begin(self, src: int, tag: int, seq: int, kind: int, meta: bytes, plen: int) -> Msg:
        """A message whose payload is still arriving: give it a buffer to arrive in."""
        want = self._want
        if want is not None and kind in RAW_KINDS and plen <= want.view.nbytes and _matches(want.source, want.tag, src, tag):
            # Straight into the waiting recv_into's buffer. It takes its place
            # in the arrival order now, so that nothing arriving meanwhile can
            # be handed to that recv_into ahead of it.
            msg = Msg(src, tag, seq, kind, meta, want.buf, plen, done=False)
            msg.view = want.view[:plen]
            msg.claimed = True
            self._want = None
            self.queue.append(msg)
            return msg
        payload, view = wire.allocate(kind, meta, plen)
        msg = Msg(src, tag, seq, kind, meta, payload, plen, done=False)
        msg.view = view
        return msg

    def _complete(self, msg: Msg) -> None:
        msg.done = True
        src = msg.src
        n = self.n_recv[src] + 1
        self.n_recv[src] = n
        self._c_recv[src] = n
        if msg.claimed:
            return  # already queued
        msg.view = _NO_VIEW
        self.queue.append(msg)
        want = self._want
        if want is not None and _matches(want.source, want.tag, src, msg.tag):
            self._want = None  # that recv_into takes this one; nothing may land in its buffer now

    # ------------------------------------------------------------ receiving: program side

    def _first(self, source: int, tag: int) -> Msg | None:
        for msg in self.queue:
            if (source == ANY or msg.src == source) and (msg.tag == tag if tag != ANY else msg.tag >= 0):
                return msg
        return None

    def _deliver(self, msg: Msg) -> Msg:
        queue = self.queue
        if queue[0] is msg:
            queue.popleft()
        else:
            queue.remove(msg)
        src = msg.src
        n = self.n_deliv[src] + 1
        self.n_deliv[src] = n
        self._c_deliv[src] = n
        return msg

    def take(self, source: int, tag: int) -> Msg:
        """The earliest arrived message matching (source, tag), waiting for it (lock held)."""
        queue = self.queue
        while True:
            for msg in queue:  # _first and _deliver, inlined: this is the latency path
                if (source == ANY or msg.src == source) and (msg.tag == tag if tag != ANY else msg.tag >= 0):
                    if not msg.done:
                        break  # the earliest match is still arriving
                    if queue[0] is msg:
                        queue.popleft()
                    else:
                        queue.remove(msg)
                    src = msg.src
                    n = self.n_deliv[src] + 1
                    self.n_deliv[src] = n
                    self._c_deliv[src] = n
                    return msg
            else:
                if (self._eof or self._pending_exits or source == self.rank or self.size == 1) and self._hopeless(source, tag):
                    continue  # draining found it after all
            # self.wait(spin=True), inlined (the same, minus the blocked-send case)
            lock = self.lock
            lock.release()
            try:
                events = self._spin() if self.spin else None
                if not events:
                    events = self._poll.poll(250 if self._pending_exits else -1)
            finally:
                lock.acquire()
            for fd, _ in events:
                what = self._net.get(fd)
                if what is not None:
                    self._read(what)
                elif fd == self.wake_main:
                    try:
                        os.eventfd_read(fd)
                    except BlockingIOError:
                        pass
                    self.adopt()

    def take_into(self, buf, view: memoryview, source: int, tag: int) -> Msg:
        """Like take, but a message still to arrive may be read straight into ``view``.

        The caller copies the payload of a message that is not ``claimed``.
        """
        queue = self.queue
        want = None
        try:
            while True:
                for msg in queue:
                    if (source == ANY or msg.src == source) and (msg.tag == tag if tag != ANY else msg.tag >= 0):
                        if not msg.done:
                            break
                        if not msg.claimed:
                            if msg.kind not in RAW_KINDS:
                                raise CommError(
                                    f"the message from rank {msg.src} (tag {msg.tag}) holds a pickled object; receive it with recv()"
                                )
                            if msg.nbytes > view.nbytes:
                                raise CommError(
                                    f"the message from rank {msg.src} (tag {msg.tag}) has {msg.nbytes} bytes; "
                                    f"the buffer holds only {view.nbytes}"
                                )
                        return self._deliver(msg)
                else:
                    if (self._eof or self._pending_exits or source == self.rank or self.size == 1) and self._hopeless(source, tag):
                        continue
                if want is None:  # nothing queued: a large match may now arrive straight into the buffer
                    want = self._want = Want(source, tag, buf, view)
                self.wait(spin=True)
        finally:
            if want is not None:
                self._want = None
                for msg in queue:
                    if msg.claimed and not msg.done and msg.payload is buf:
                        self._unclaim(msg)

    def _unclaim(self, msg: Msg) -> None:
        # recv_into gave up (an exception) while its message was arriving:
        # the rest must not land in a buffer the program owns again.
        payload, view = wire.allocate(msg.kind, msg.meta, msg.nbytes)
        view[: msg.got] = msg.view[: msg.got]
        msg.payload, msg.view, msg.claimed = payload, view, False

    def _hopeless(self, source: int, tag: int) -> bool:
        """Raise if nothing matching (source, tag) can ever arrive; True if draining found a match."""
        if source == self.rank or self.size == 1:
            raise CommError(
                f"rank {self.rank} would wait forever: nothing queued from itself matches {_tag_name(tag)} and no other rank could send one"
            )
        if self._pending_exits:
            # Their last bytes may still sit in our socket buffers: read them first.
            self._poll_now()
            if self._first(source, tag) is not None:
                return True
        if source != ANY:
            if self._finished(source):
                raise PeerExited(f"rank {source} {self._why(source)}; no message from it matches {_tag_name(tag)}", source)
            return False
        if len(self._eof) + len(self._pending_exits) < self.size - 1:
            return False  # some rank is certainly still there
        others = [r for r in range(self.size) if r != self.rank]
        if all(self._finished(r) for r in others):
            detail = "; ".join(f"rank {r} {self._why(r)}" for r in others)
            raise PeerExited(f"every other rank has exited and nothing queued matches {_tag_name(tag)} ({detail})")
        return False

    def _finished(self, r: int) -> bool:
        """Rank ``r`` will send us nothing more."""
        if r in self._eof:
            return True
        if r not in self._exited:
            return False
        if (r in self._from or self._unproven()) and (
            time.monotonic() - self._exited_at[r] < EXIT_GRACE
        ):
            return False  # its connection (or one not yet identified) may still hold its last messages
        self._eof[r] = self._exited[r]
        self._pending_exits.discard(r)
        return True

    def _why(self, r: int) -> str:
        why = self._exited.get(r)
        if why:
            return f"has exited ({why})"
        return f"is gone ({self._eof.get(r, 'unknown')})"

    def _poll_now(self) -> None:
        self.adopt()
        for fd, _ in self._poll.poll(0):
            self.on_fd(fd)

    # ------------------------------------------------------------ sending

    # The two ways to send, one chosen at start: with the gate and without it
    # (GANGD_COMM_GATE=0). They share everything but the few lines that put a
    # message on the socket, which are repeated rather than called: a Python
    # call costs as much here as the gate check itself.

    # (*) An ndarray exports the buffer protocol, but numpy's stubs declare it (``__buffer__``) for Python 3.12+ only.

    def _send_gated(self, dest: int, tag: int, kind: int, meta: bytes, payload, nbytes: int) -> None:
        """Send one encoded message; returns once all of it is in the kernel (lock held).

        The whole message goes out under the send lock and only while the gate is open.
        """
        lock = self.send_lock
        lock.acquire()
        try:
            if not self.gate_open:
                self._wait_gate(dest)
            sock = self._out[dest]
            if sock is None or dest in self._exited:
                sock = self._route(dest)
                if sock is None:
                    self._send_self(tag, kind, meta, payload, nbytes)
                    return
            seq = self.n_sent[dest]
            header = _pack_header(kind, tag, seq, len(meta), nbytes)
            if meta:
                header += meta
            if nbytes <= SMALL:
                data = header + payload if payload.__class__ is not _ndarray else b"".join((header, payload))  # type: ignore[arg-type]  # (*)
                try:
                    n = sock.send(data, _NOSIGNAL)
                except OSError as exc:
                    n = self._send_failed(dest, exc)
                if n < len(data):
                    self._send_rest(dest, sock, data, None, 0, n)
            else:
                self._send_large(dest, sock, header, payload, nbytes)
            self.n_sent[dest] = seq + 1
            self._c_sent[dest] = seq + 1
        finally:
            lock.release()
            if not self.gate_open:
                os.eventfd_write(self.wake_ctl, 1)  # a close came during our send: it can be confirmed now

    def _send_now(self, dest: int, tag: int, kind: int, meta: bytes, payload, nbytes: int) -> None:
        """``_send_gated`` without the gate."""
        sock = self._out[dest]
        if sock is None or dest in self._exited:
            sock = self._route(dest)
            if sock is None:
                self._send_self(tag, kind, meta, payload, nbytes)
                return
        seq = self.n_sent[dest]
        header = _pack_header(kind, tag, seq, len(meta), nbytes)
        if meta:
            header += meta
        if nbytes <= SMALL:
            data = header + payload if payload.__class__ is not _ndarray else b"".join((header, payload))  # type: ignore[arg-type]  # (*)
            try:
                n = sock.send(data, _NOSIGNAL)
            except OSError as exc:
                n = self._send_failed(dest, exc)
            if n < len(data):
                self._send_rest(dest, sock, data, None, 0, n)
        else:
            self._send_large(dest, sock, header, payload, nbytes)
        self.n_sent[dest] = seq + 1
        self._c_sent[dest] = seq + 1

    def _send_large(self, dest: int, sock: socket.socket, header: bytes, payload, nbytes: int) -> None:
        """Header and payload in one sendmsg, no copy; the rest as the socket makes room."""
        try:
            n = sock.sendmsg((header, payload), (), _NOSIGNAL)
        except OSError as exc:
            n = self._send_failed(dest, exc)
        if n < len(header) + nbytes:
            self._send_rest(dest, sock, header, payload, nbytes, n)

    def _send_failed(self, dest: int, exc: OSError) -> int:
        """A send raised: 0 bytes went out if the socket is just full, else the peer is gone."""
        if isinstance(exc, BlockingIOError):
            return 0
        raise self._broken(dest, exc) from None

    def _wait_gate(self, dest: int) -> None:
        """Wait for the gate to open, without the send lock (entered and left holding it)."""
        lock = self.send_lock
        while not self.gate_open:
            # Without the send lock, so the control thread can confirm the close (and tell it
            # so: it may have tried the lock in the instant we held it).
            lock.release()
            os.eventfd_write(self.wake_ctl, 1)
            try:
                while not self.gate_open:
                    if self.daemon_lost:
                        raise CommError(f"the send gate is closed and the node daemon is gone ({self.daemon_lost}): it will never open")
                    if dest in self._exited:
                        raise PeerExited(f"cannot send to rank {dest}: it {self._why(dest)}", dest)
                    self.wait()
            finally:
                lock.acquire()

    def _route(self, dest: int) -> socket.socket | None:
        """The socket to ``dest`` (dialled now if need be); None for ourselves."""
        if dest == self.rank:
            return None
        if dest in self._exited:
            raise PeerExited(f"cannot send to rank {dest}: it {self._why(dest)}", dest)
        if dest in self._cut:
            kind, message = self._cut[dest]
            raise PeerExited(message, dest) if kind is PeerExited else CommError(message)
        return self._out[dest] or self._dial(dest)

    def _send_self(self, tag: int, kind: int, meta: bytes, payload, nbytes: int) -> None:
        # The program may change its buffer once send returns: keep a copy.
        if kind == NDARRAY:
            payload = payload.copy() if payload.__class__ is _ndarray else wire.materialize(kind, meta, payload, 0, nbytes)
        elif kind == wire.BYTEARRAY:
            payload = bytearray(payload)
        me = self.rank
        seq = self.n_sent[me]
        self.n_sent[me] = seq + 1
        self._c_sent[me] = seq + 1
        self._complete(Msg(me, tag, seq, kind, meta, payload, nbytes, done=False))

    def _send_rest(self, dest, sock, header: bytes, payload, nbytes: int, sent: int) -> None:
        """The socket buffer is full: wait for room, reading our incoming connections meanwhile."""
        hlen = len(header)
        total = hlen + nbytes
        hview = memoryview(header)
        pview = wire.byte_view(payload) if nbytes else _NO_VIEW
        fd = sock.fileno()
        self._poll.register(fd, _POLLOUT)
        self._out_fd = fd
        done = False
        try:
            while sent < total:
                self._writable = False
                while not self._writable:
                    if self._exited and dest in self._exited:
                        raise PeerExited(f"rank {dest} {self._why(dest)} while a message to it was being sent", dest)
                    self.wait()
                if sent < hlen:
                    buffers: tuple[memoryview, ...] = (hview[sent:], pview)
                else:
                    buffers = (pview[sent - hlen :],)
                try:
                    sent += sock.sendmsg(buffers, (), _NOSIGNAL)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise self._broken(dest, exc) from None
            done = True
        finally:
            self._out_fd = -1
            try:
                self._poll.unregister(fd)
            except KeyError:
                pass
            if not done and self._out[dest] is sock:
                # Interrupted (KeyboardInterrupt, the peer exited...) with part of the message
                # on the wire: the channel can never carry a whole message again.
                self._out[dest] = None
                self._cut[dest] = (CommError, f"cannot send to rank {dest}: a send to it was interrupted after {sent} of {total} bytes")
                sock.close()
                self._fds_changed()

    def _broken(self, dest: int, exc: OSError) -> PeerExited:
        """The connection to ``dest`` failed: it is gone for good (what it lost cannot be resent)."""
        sock = self._out[dest]
        self._out[dest] = None
        if sock is not None:
            sock.close()
            self._fds_changed()
        why = self._exited.get(dest)
        reason = f"{exc.strerror or exc}" + (f"; the daemon says: {why}" if why else "")
        message = f"rank {dest} closed its connection while rank {self.rank} was sending to it ({reason})"
        self._cut[dest] = (PeerExited, message)
        return PeerExited(message, dest)

    def _dial(self, dest: int) -> socket.socket:
        peer = self.peers[dest] or {}
        unix = peer.get("unix") if peer.get("node") == self.node else None  # same node: AF_UNIX
        where = unix or peer.get("tcp")
        sock = None
        try:
            if unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(CONNECT_TIMEOUT)
                sock.connect(unix)
            else:
                if not where:
                    raise CommError(f"the daemon gave no address for rank {dest}")
                sock = socket.create_connection((where[0], where[1]), timeout=CONNECT_TIMEOUT)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if unix and SOCKET_BUFFER:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
                except OSError:
                    pass
            handshake.dial(sock, self.key, self.rank, dest, lambda seconds: self._wait_handshake(sock, dest, seconds))
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as exc:
            if sock is not None:
                sock.close()
            raise PeerExited(
                f"cannot reach rank {dest} at {where}: {exc.strerror or exc} (it has exited or closed its world)", dest
            ) from None
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise CommError(f"cannot connect to rank {dest} at {where}: {exc}") from None
        except handshake.HandshakeError as exc:
            if sock is not None:
                sock.close()
            raise CommError(f"cannot connect to rank {dest} at {where}: {exc}") from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        sock.setblocking(False)
        self._out[dest] = sock
        self._fds_changed()
        return sock

    def _wait_handshake(self, sock: socket.socket, dest: int, seconds: float) -> bool:
        """While dialling ``dest``: wait (lock released) until ``sock`` may have its answer,
        reading our own incoming connections meanwhile; False once ``dest`` is gone."""
        if dest in self._exited:
            return False
        fd = sock.fileno()
        self._poll.register(fd, _POLLIN)
        self._out_fd = fd
        try:
            self.wait(int(seconds * 1000) + 1)
        finally:
            self._out_fd = -1
            try:
                self._poll.unregister(fd)
            except KeyError:
                pass
        return dest not in self._exited

    # ------------------------------------------------------------ the control thread's side

    def set_gate(self, open_: bool, epoch: int) -> None:
        self.gate_epoch = epoch
        self.gate_open = open_
        if open_:
            os.eventfd_write(self.wake_main, 1)

    def peer_exited(self, rank: int, why: str) -> None:
        with self.lock:
            if rank not in self._exited:
                self._exited[rank] = why
                self._exited_at[rank] = time.monotonic()
                if rank not in self._eof:
                    self._pending_exits.add(rank)
        os.eventfd_write(self.wake_main, 1)

    def lose_daemon(self, reason: str) -> None:
        self.daemon_lost = reason
        os.eventfd_write(self.wake_main, 1)

    # ------------------------------------------------------------ teardown

    def close(self, threads_stopped: bool = True) -> None:
        """Close every socket (``threads_stopped``: the control thread is gone, so the eventfds it polls may go too)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            doorman = self.doorman
            # A doorman that would not stop keeps its sockets and the eventfds it
            # writes: closed, their numbers could be reused under it.
            stopped = doorman is None or doorman.stop()
            if stopped:
                for listener in self._listeners:
                    listener.close()
                while doorman is not None and doorman.proven:
                    doorman.proven.popleft()[0].close()
            for sock in [*(c.sock for c in self._net.values()), *(s for s in self._out if s)]:
                sock.close()
            self._listeners.clear()
            self._from.clear()
            self._net.clear()
            self._out = [None] * self.size
            self.fd_gen += 1
            if self.unix_path:
                try:
                    os.unlink(self.unix_path)
                except OSError:
                    pass
            if isinstance(self.counters, np.memmap):
                self.counters.flush()
            if stopped and threads_stopped:  # (no thread left that could use their numbers)
                for fd in (self.wake_main, self.wake_ctl):
                    os.close(fd)
