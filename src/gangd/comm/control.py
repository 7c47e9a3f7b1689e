"""The rank's control connection to its node daemon: a blocking binding of gangd's protocol.

Job code is synchronous, so instead of :mod:`gangd.rpc` (trio) the rank
drives the sans-I/O :class:`~gangd.protocol.Connection` with a plain socket:
:class:`DaemonLink` does the handshake and the ``comm_attach`` request, then
:class:`ControlThread` reads the connection for as long as the rank lives and
applies what the daemon says:

* ``gate`` notes open and close the send gate; a close is confirmed with a
  ``gate_closed`` note once no send is under way;
* ``peer_exited`` notes tell which ranks are gone;
* ``capture`` requests ask for the rank's network context.

While the gate is closed the thread also drains the rank's incoming
connections itself: a peer blocked sending to this rank (which may be busy
computing) must be able to finish its send, or that peer could never confirm
the close. It never touches a connection whose handshake is not done: those
are the doorman's (:mod:`.handshake`), which hands proven ones to the engine.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
from collections import deque

from ..protocol import (
    Connection,
    Note,
    ProtocolError,
    Ready,
    RemoteClosed,
    Reply,
    Request,
    Role,
)
from . import context
from .engine import Engine
from .errors import CommError

HANDSHAKE_TIMEOUT = 10.0
READ_SIZE = 256 * 1024
CAPTURE_TIMEOUT = 25.0  # under the daemon's own 30 s, so the daemon hears why


class DaemonLink:
    """A client connection to the node daemon with blocking reads and thread-safe writes."""

    def __init__(self, path: str, name: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise CommError(f"cannot reach the gangd node daemon at {path}: {exc}") from None
        self.conn = Connection(dialer=True, node=name, role=Role.CLIENT)
        self._write_lock = threading.Lock()
        self.backlog: deque = deque()  # events that arrived while waiting for a reply
        try:
            self._write(self.conn.data_to_send())
            while True:
                event = self._next_event()
                if isinstance(event, Ready):
                    break
                if isinstance(event, RemoteClosed):
                    raise CommError(f"gangd at {path} refused the connection: {event.message}", event.code)
                if event is None:
                    raise CommError(f"gangd at {path} closed the connection during the handshake")
        except (OSError, CommError):
            self.sock.close()
            raise
        self.sock.settimeout(None)

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    def _write(self, data: bytes) -> None:
        if data:
            with self._write_lock:
                self.sock.sendall(data)

    def _feed(self) -> bool:
        """One read from the socket into the protocol machine; False at EOF."""
        try:
            data = self.sock.recv(READ_SIZE)
        except TimeoutError:
            raise CommError(f"gangd at {self.path} did not answer within {HANDSHAKE_TIMEOUT:.0f} s") from None
        except OSError:
            data = b""
        if not data:
            try:
                self.conn.receive_eof()
            except ProtocolError:
                pass
            return False
        self.conn.receive_data(data)
        return True

    def _event(self):
        try:
            return self.conn.next_event()
        except ProtocolError as exc:
            raise CommError(f"gangd at {self.path} broke the protocol: {exc}") from None

    def _next_event(self):
        """The next event, reading as needed; None once the daemon closed the connection."""
        while True:
            event = self._event()
            if event is not None:
                return event
            if not self._feed():
                return None

    def send_request(self, op: str, args: dict) -> int:
        """Send a request without waiting; its reply comes to whoever reads the
        connection (matched by the id returned). Like every use of the protocol
        machine, under the caller's lock where two threads share the link."""
        rid, frame = self.conn.send_request(op, args)
        self._write(frame)
        return rid

    def request(self, op: str, args: dict):
        """Send a request and wait for its reply (other events are kept in ``backlog``)."""
        rid = self.send_request(op, args)
        while True:
            event = self._next_event()
            if event is None:
                raise CommError(f"gangd at {self.path} closed the connection before answering {op!r}")
            if isinstance(event, RemoteClosed):
                raise CommError(f"gangd at {self.path} closed the connection: {event.message}", event.code)
            if isinstance(event, Reply) and event.id == rid:
                if event.ok:
                    return event.result
                error = event.error or {}  # (never empty: the connection checks that a refusal has its code and message)
                raise CommError(f"gangd refused {op}: {error.get('message')}", error.get("code"))
            self.backlog.append(event)

    def take_pending(self) -> list:
        """The events a reader must handle before it first waits on the socket:
        those that came while :meth:`request` waited for its reply (kept in
        ``backlog``) and those that came in the same read as the reply (still
        in the protocol machine). The socket will not wake a reader for
        either: a note the daemon sends right after answering (a gate opening,
        a checkpoint beginning) would wait for the next one."""
        events = list(self.backlog)
        self.backlog.clear()
        while (event := self._event()) is not None:
            events.append(event)
        return events

    def read_ready(self) -> list:
        """After poll said readable: the events now complete; a trailing None means the connection ended."""
        alive = self._feed()
        events = []
        while (event := self._event()) is not None:
            events.append(event)
        if not alive:
            events.append(None)
        return events

    def note(self, op: str, args: dict) -> None:
        try:
            self._write(self.conn.send_note(op, args))
        except (OSError, ProtocolError):
            pass  # the daemon is gone; the read side reports that

    def reply(self, rid: int, result) -> None:
        try:
            frame = self.conn.send_reply(rid, result)
        except ProtocolError as exc:  # e.g. a network context larger than a frame may be
            frame = self.conn.send_error(rid, exc.code, f"cannot send the answer: {exc.message}")
        try:
            self._write(frame)
        except OSError:
            pass

    def error(self, rid: int, code: str, message: str) -> None:
        try:
            self._write(self.conn.send_error(rid, code, message))
        except (OSError, ProtocolError):
            pass

    def shutdown(self) -> None:
        """End the connection but keep its fd: wakes a thread polling it, which may still use its number."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()
        self.sock.close()


class ControlThread(threading.Thread):
    def __init__(self, engine: Engine, link: DaemonLink):
        super().__init__(name=f"gangd-comm-control-{engine.rank}", daemon=True)
        self.engine = engine
        self.link = link
        self._ack_epoch: int | None = None  # a close to confirm once no send is under way
        self._stopping = False

    def stop(self) -> bool:
        """Stop the thread; True once it is gone. Only then are the fds it polls
        by number closed (its link here, the engine's eventfds by the caller):
        closed under a live thread, their numbers could be reused by a new
        connection that thread would then read from."""
        self._stopping = True
        self.link.shutdown()  # wakes the thread out of its poll
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2)
        if self.is_alive():
            return False
        self.link.close()
        return True

    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 -- a thread dying silently would leave the gate unconfirmed forever
            if not self._stopping:
                print(f"gangd.comm rank {self.engine.rank}: control thread failed: {exc!r}", file=sys.stderr)
                self.engine.lose_daemon(f"control thread failed: {exc}")

    def _loop(self) -> None:
        engine, link = self.engine, self.link
        for event in link.take_pending():
            self._handle(event)
        poll = select.poll()
        poll.register(link.fd, select.POLLIN)
        poll.register(engine.wake_ctl, select.POLLIN)
        watched: set[int] = set()
        gen = None
        while not self._stopping:
            if not engine.gate_open:
                if gen != engine.fd_gen or engine.handover_waiting():
                    with engine.lock:  # (watch_fds adopts what the doorman proved)
                        fds, gen = set(engine.watch_fds()), engine.fd_gen
                    for fd in watched - fds:
                        poll.unregister(fd)
                    for fd in fds - watched:
                        poll.register(fd, select.POLLIN)
                    watched = fds
            elif watched:
                for fd in watched:
                    poll.unregister(fd)
                watched, gen = set(), None
            self._maybe_ack()
            for fd, _ in poll.poll():
                if fd == link.fd:
                    for event in link.read_ready():
                        if event is None:
                            if not self._stopping:
                                engine.lose_daemon("the node daemon closed the connection")
                            return
                        self._handle(event)
                elif fd == engine.wake_ctl:
                    try:
                        os.eventfd_read(fd)
                    except BlockingIOError:
                        pass
                else:
                    try:
                        with engine.lock:
                            engine.on_fd(fd)
                    except CommError as exc:  # a peer broke the protocol; its connection is dropped
                        print(f"gangd.comm rank {engine.rank}: {exc}", file=sys.stderr)

    def _maybe_ack(self) -> None:
        if self._ack_epoch is None or self.engine.gate_open:
            return
        lock = self.engine.send_lock
        if lock.acquire(blocking=False):  # no send under way; a later one will see the gate closed
            lock.release()
            self.link.note("gate_closed", {"epoch": self._ack_epoch})
            self._ack_epoch = None

    def _handle(self, event) -> None:
        if isinstance(event, Note):
            self._note(event.op, event.args)
        elif isinstance(event, Request):
            if event.op == "capture":
                self._capture(event.id, event.args)
            else:
                self.link.error(event.id, "unsupported", f"a gangd.comm rank does not serve {event.op!r}")
        elif isinstance(event, RemoteClosed):
            self.engine.lose_daemon(f"the node daemon closed the connection: {event.message}")

    def _note(self, op: str, args: dict) -> None:
        engine = self.engine
        if op == "gate":
            epoch = args.get("epoch")
            if not isinstance(epoch, int) or epoch < engine.gate_epoch:
                return  # older than what we know (e.g. from the attach reply)
            open_ = bool(args.get("open"))
            engine.set_gate(open_, epoch)
            self._ack_epoch = None if open_ else epoch
        elif op == "peer_exited":
            rank = args.get("rank")
            if isinstance(rank, int) and 0 <= rank < engine.size:
                engine.peer_exited(rank, str(args.get("why") or "exited"))

    def _capture(self, rid: int, args: dict) -> None:
        engine = self.engine
        expect = args.get("expect") or [0] * engine.size
        if not isinstance(expect, list) or len(expect) != engine.size or not all(isinstance(n, int) for n in expect):
            self.link.error(rid, "bad_request", f"capture: 'expect' must list {engine.size} message counts, one per rank")
            return
        if not engine.gate_enabled:
            self.link.error(rid, "gate_disabled", f"rank {engine.rank} runs with GANGD_COMM_GATE=0: its sends are not gated")
            return
        if engine.gate_open:
            self.link.error(rid, "gate_open", f"the gate of rank {engine.rank} is open: close it before capturing")
            return
        started = time.monotonic()
        try:
            with engine.lock:
                engine.drain_until(expect, CAPTURE_TIMEOUT)
                blob = context.capture(engine)
        except CommError as exc:
            self.link.error(rid, "capture_failed", f"rank {engine.rank}: {exc} (after {time.monotonic() - started:.1f} s)")
            return
        self.link.reply(rid, {"context": blob})
