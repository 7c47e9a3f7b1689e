"""How two ranks of a job prove to each other that they are, without sending the job's token.

Anyone who can connect to a rank's listener (another user on the node, a
process on the cluster network), or who gets a rank to dial them, must learn
nothing that lets them into the job, and must get nothing into it: a message
may be a pickle, and unpickling runs code. So every new connection opens with
an HMAC challenge-response both ways, keyed by the job's token (which the
daemons hand each rank and which never crosses a rank-to-rank connection)::

    dialer   -> listener   HELLO frame: tag = dialer's rank, seq 0, meta = MAGIC + nonce_d
    listener -> dialer     nonce_l + HMAC(key, "listener" | dialer | listener | nonce_d | nonce_l)
    dialer   -> listener   HELLO frame: tag = dialer's rank, seq 1, meta = HMAC(key, "dialer" | ... the same)

Fresh random nonces from both sides go into both MACs, with both ranks and
the direction: a recorded handshake replays nowhere (the other side's nonce
differs), and neither MAC can be reflected as the other. MACs are compared in
constant time. Frames have fixed sizes and are read exactly (never a byte of
what follows); a peer that sends anything else, or too slowly (``TIMEOUT``),
is disconnected unanswered. The messages after the handshake are neither
encrypted nor authenticated: the README's security model says what the
cluster network must provide.

Who owns a connection, at every moment (the earlier version of this
handshake let the program's thread and the control thread both answer
hellos; see :class:`Doorman`):

* the listeners and every connection whose handshake is not done belong to
  the rank's :class:`Doorman` thread alone, which never takes the engine's
  lock, so it answers a dialer whatever the program is doing (computing,
  dialling that dialer itself, blocked in a send);
* a proven connection is handed over through :attr:`Doorman.proven` (a
  queue) and from then on belongs to the engine (under its lock);
* the dialer's side runs in the thread that sends, on a socket no other
  thread knows of until the handshake is done (:func:`dial`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from .errors import CommError
from .wire import HEADER, HEADER_SIZE, HELLO

#: First bytes of the dialer's hello: this protocol and its version. An old
#: token hello (meta = the token) or anything else is refused.
MAGIC = b"gangd.comm/hmac2"
NONCE = 16
MAC = hashlib.sha256().digest_size
HELLO_META = len(MAGIC) + NONCE
#: The dialer's frames (hello, then proof), each exactly this long (MAC == HELLO_META: 32 bytes of meta).
FRAME = HEADER_SIZE + HELLO_META
#: The listener's answer to a hello: its nonce and its MAC, raw bytes.
CHALLENGE = NONCE + MAC
#: Seconds a connection may take to complete its handshake at the listener
#: (not counting time this process spent stopped: a suspended job's ranks
#: stop together). A dialer waits longer for its answer (``dial``'s timeout).
TIMEOUT = 10.0
#: Handshakes under way at once, per rank. When full, a new connection
#: evicts the oldest: a stranger holding connections open cannot lock a
#: job's ranks out (a real dialer's handshake takes a round trip, so it
#: would have to open this many connections within one).
MAX_PENDING = 128


def derive_key(token: bytes) -> bytes:
    """The handshake's HMAC key: the job token, bound to this use of it."""
    return hmac.new(token, b"gangd.comm rank-to-rank handshake", hashlib.sha256).digest()


def mac(key: bytes, role: bytes, dialer: int, listener: int, nonce_d: bytes, nonce_l: bytes) -> bytes:
    """What ``role`` (b"dialer" or b"listener") proves with: both ranks, both nonces, the direction."""
    message = MAGIC + b"\0" + role + b"\0" + struct.pack("<ii", dialer, listener) + nonce_d + nonce_l
    return hmac.new(key, message, hashlib.sha256).digest()


def hello_frame(dialer: int, nonce_d: bytes) -> bytes:
    return HEADER.pack(HELLO, dialer, 0, HELLO_META, 0) + MAGIC + nonce_d


def proof_frame(dialer: int, proof: bytes) -> bytes:
    return HEADER.pack(HELLO, dialer, 1, MAC, 0) + proof


# ---------------------------------------------------------------- the dialer's side


class HandshakeError(CommError):
    """The other end did not prove it is the rank we dialled (or not in time)."""


def dial(sock: socket.socket, key: bytes, me: int, dest: int, wait: Callable[[float], bool], timeout: float = 3 * TIMEOUT) -> None:
    """Prove ourselves to ``dest`` over ``sock`` (connected, blocking) and check its proof.

    ``wait(seconds)`` blocks until ``sock`` may be readable or ``seconds``
    passed (the engine reads its own incoming connections meanwhile) and
    returns False if the wait should stop (``dest`` is gone). Raises
    HandshakeError (the process there is not ``dest`` of this job, or it
    did not answer in time) or OSError.
    """
    nonce_d = os.urandom(NONCE)
    sock.sendall(hello_frame(me, nonce_d))
    sock.setblocking(False)
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < CHALLENGE:
        try:
            chunk = sock.recv(CHALLENGE - len(got))
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            raise ConnectionResetError(0, "it closed the connection during the handshake")
        if chunk:
            got += chunk
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HandshakeError(f"rank {dest} did not answer the handshake within {timeout:.0f} s")
        before = time.monotonic()
        if not wait(min(remaining, 1.0)):
            raise ConnectionResetError(0, "it is gone")
        late = time.monotonic() - before - min(remaining, 1.0)
        if late > 0.5:
            deadline += late  # this process was stopped (a suspended job): that time does not count
    nonce_l, theirs = got[:NONCE], got[NONCE:]
    if not hmac.compare_digest(theirs, mac(key, b"listener", me, dest, nonce_d, nonce_l)):
        raise HandshakeError(f"the process there is not rank {dest} of this job (it could not prove it holds the job's token)")
    frame = proof_frame(me, mac(key, b"dialer", me, dest, nonce_d, nonce_l))
    if sock.send(frame, socket.MSG_NOSIGNAL) != len(frame):  # (a fresh socket's buffer: always room for 57 bytes)
        raise HandshakeError(f"cannot finish the handshake with rank {dest}: its socket took part of {len(frame)} bytes")


# ---------------------------------------------------------------- the listener's side


class _Pending:
    """A connection whose handshake is under way (the Doorman's alone)."""

    __slots__ = ("buf", "claimed", "deadline", "expect", "got", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray(FRAME)
        self.got = 0
        self.claimed = -1  # the rank its hello claimed
        self.expect = b""  # the dialer's MAC due next (after our answer)


class Doorman(threading.Thread):
    """Owns a rank's listeners and its connections until they proved the job's key.

    Proven connections go to ``proven`` as (socket, rank); ``on_proven`` is
    called after each (it wakes the engine). ``pending`` counts handshakes
    under way. ``refused`` counts connections closed unproven (for tests and
    for ``gang net``-style diagnostics).
    """

    def __init__(self, rank: int, size: int, key: bytes, listeners: list[socket.socket], on_proven: Callable[[], None]):
        super().__init__(name=f"gangd-comm-doorman-{rank}", daemon=True)
        self.rank = rank
        self.size = size
        self._key = key
        self._listeners = {s.fileno(): s for s in listeners}
        self._on_proven = on_proven
        self.proven: deque[tuple[socket.socket, int]] = deque()
        self._pending: dict[int, _Pending] = {}
        self.refused = 0
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stopping = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    def stop(self) -> bool:
        """Stop the thread and close what it owns; False if it did not stop (then nothing is closed)."""
        self._stopping = True
        os.eventfd_write(self._stop_fd, 1)
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        if self.is_alive():
            return False
        for p in self._pending.values():
            p.sock.close()
        self._pending.clear()
        os.close(self._stop_fd)
        return True

    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 -- a dead doorman would leave every dialer waiting: say why
            if not self._stopping:
                print(f"gangd.comm rank {self.rank}: handshake thread failed: {exc!r}", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        poll = select.poll()
        poll.register(self._stop_fd, select.POLLIN)
        for fd in self._listeners:
            poll.register(fd, select.POLLIN)
        while not self._stopping:
            timeout = 1.0
            if self._pending:
                timeout = max(0.0, min(timeout, min(p.deadline for p in self._pending.values()) - time.monotonic()))
            before = time.monotonic()
            events = poll.poll(timeout * 1000 + 1)
            late = time.monotonic() - before - timeout
            if late > 0.5:  # stopped meanwhile (SIGSTOP, the freezer): so were this job's dialers
                for p in self._pending.values():
                    p.deadline += late
            for fd, _ in events:
                if fd == self._stop_fd:
                    continue
                listener = self._listeners.get(fd)
                if listener is not None:
                    self._accept(listener, poll)
                else:
                    pending = self._pending.get(fd)
                    if pending is not None:
                        self._step(fd, pending, poll)
            now = time.monotonic()
            for fd in [fd for fd, p in self._pending.items() if p.deadline <= now]:
                self._refuse(fd, poll)

    def _accept(self, listener: socket.socket, poll: select.poll) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # e.g. the dialer already gave up (ECONNABORTED)
            if len(self._pending) >= MAX_PENDING:
                self._refuse(min(self._pending, key=lambda fd: self._pending[fd].deadline), poll)
            sock.setblocking(False)
            fd = sock.fileno()
            self._pending[fd] = _Pending(sock, time.monotonic() + TIMEOUT)
            poll.register(fd, select.POLLIN)

    def _refuse(self, fd: int, poll: select.poll) -> None:
        pending = self._pending.pop(fd)
        poll.unregister(fd)
        pending.sock.close()
        self.refused += 1

    def _step(self, fd: int, p: _Pending, poll: select.poll) -> None:
        """Read what is there of the current frame (never more); act on a whole one."""
        try:
            n = p.sock.recv_into(memoryview(p.buf)[p.got :], FRAME - p.got)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if n == 0:
            self._refuse(fd, poll)
            return
        p.got += n
        if p.got >= HEADER_SIZE:
            kind, tag, seq, mlen, plen = HEADER.unpack_from(p.buf, 0)
            first = p.claimed < 0
            if (
                kind != HELLO
                or seq != (0 if first else 1)
                or mlen != HELLO_META
                or plen != 0
                or not 0 <= tag < self.size
                or tag == self.rank
                or (not first and tag != p.claimed)
            ):
                self._refuse(fd, poll)  # an old token hello, a message, garbage: unanswered
                return
        if p.got < FRAME:
            return
        meta = bytes(p.buf[HEADER_SIZE:FRAME])
        p.got = 0
        if p.claimed < 0:
            if meta[: len(MAGIC)] != MAGIC:
                self._refuse(fd, poll)
                return
            nonce_d, nonce_l = meta[len(MAGIC) :], os.urandom(NONCE)
            answer = nonce_l + mac(self._key, b"listener", tag, self.rank, nonce_d, nonce_l)
            try:
                sent = p.sock.send(answer, socket.MSG_NOSIGNAL)  # (a fresh socket's buffer: always room)
            except OSError:
                sent = 0
            if sent != len(answer):
                self._refuse(fd, poll)
                return
            p.claimed, p.expect = tag, mac(self._key, b"dialer", tag, self.rank, nonce_d, nonce_l)
            return
        if not hmac.compare_digest(meta, p.expect):
            self._refuse(fd, poll)
            return
        # Proven: the engine owns it from here (whatever followed the proof is still in the kernel).
        del self._pending[fd]
        poll.unregister(fd)
        self.proven.append((p.sock, p.claimed))
        self._on_proven()
