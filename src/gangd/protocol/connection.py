"""The gangd connection state machine, sans-I/O (in the manner of h11).

Bytes go in with :meth:`Connection.receive_data`, events come out of
:meth:`Connection.next_event`, and every ``send_*`` method returns the bytes
to write. Bytes the machine must send on its own (handshake replies) are
collected in :meth:`Connection.data_to_send`. No sockets anywhere.

Handshake
---------
The side that dials sends ``hello`` with the protocol version, its role
(``client`` for a local user on the Unix socket, ``peer`` for another
daemon), its node name and a random nonce. The listener answers with its own
``hello``. For peers both sides prove knowledge of the cluster secret
(HMAC-SHA256 over both nonces, with a different label per direction so a
proof cannot be reflected back), in the way munge vouches for Slurm
daemons::

    dialer   -> hello{v, role, node, nonce_d}
    listener -> hello{v, node, nonce_l, proof_l = H(secret, "listener"|nonce_d|nonce_l)}
    dialer   -> auth{proof_d = H(secret, "dialer"|nonce_d|nonce_l)}

Local clients do not authenticate on the wire: the daemon learns their uid
from the Unix socket's peer credentials. After the handshake both sides may
send requests, replies, stream items, cancels, credits and one-way notes.

Bounds (version 2)
------------------
Nothing the other side sends may grow this side without limit:

* Until the handshake is done, frames are limited to
  :data:`HANDSHAKE_MAX_FRAME` (a hello is a few dozen bytes), so an
  unauthenticated peer cannot make a daemon buffer a 16 MiB frame.
* Every request carries a *window* (``win``): how many bytes of stream items
  its requester is ready to buffer. The server may send items while it has
  credit left (one frame may overshoot it); the requester grants more with
  ``credit{id, n}`` frames as it consumes items. An item beyond the credit
  is a protocol violation. So a requester that stops reading stalls only its
  own stream, and its buffer stays under ``win + max_frame``.
* At most ``max_in_flight`` requests of the other side are served at once,
  and their frames (with the notes handed up and not yet done) hold at most
  ``max_in_flight_bytes`` — and, across all connections of one local user,
  what the shared ``budget`` allows (a request's arguments live as long as
  it is served: 64 ``wait`` requests each carrying 4 MiB would otherwise pin
  256 MiB per connection). Beyond either, requests are answered ``busy`` at
  once (by the machine itself) rather than by no longer reading the socket:
  the frames behind them may be the credits and cancels that let requests in
  flight finish, and a reader that stopped would deadlock on them. A frame
  larger than :data:`BIG_FRAME` is charged when its header arrives, before
  its payload is buffered; if it does not fit, the connection is closed with
  a ``bye`` (``too_much_in_flight``) instead of buffering it.
* Frames of requests and notes are limited to ``max_request_frame`` (a
  daemon gives local clients less than the ``max_frame`` of its peers);
  replies and items to our own requests may use all of ``max_frame``.
* What the machine writes on its own (``busy`` answers) is bounded too:
  while more than ``max_outbox`` bytes of it are unsent, :meth:`next_event`
  hands up nothing more, and the I/O side must write them out before it
  reads again. A client that floods requests and never reads its answers
  therefore stalls its own connection instead of growing the daemon by a
  ``busy`` reply (~150 bytes) for every ~40-byte request.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .frames import DEFAULT_MAX_FRAME, FrameDecoder, Message, ProtocolError, encode_frame

PROTOCOL_VERSION = 2
NONCE_SIZE = 16

#: Frame limit until the handshake is done: a hello or auth is < 200 bytes.
HANDSHAKE_MAX_FRAME = 4096
#: Bytes of stream items a requester is ready to buffer per request, unless it says otherwise.
DEFAULT_WINDOW = 256 * 1024
#: Requests of the other side served at once, unless configured otherwise.
DEFAULT_MAX_IN_FLIGHT = 64
#: Largest request or note a local client may send a daemon (what a daemon
#: takes from its Unix socket; see gangd.daemon.admission.Limits.client_max_frame).
#: A client connection refuses to send more, with a clear error, rather than
#: having the daemon cut it off mid-frame.
MAX_CLIENT_REQUEST = 4 * 1024 * 1024
#: Most bytes of the machine's own unsent output (``busy`` answers) before it stops handing up events.
DEFAULT_MAX_OUTBOX = 64 * 1024
#: Frames above this size are charged against the in-flight byte limits when
#: their header arrives (smaller ones when they are decoded): at most this much
#: is buffered for a frame before the connection knows it may take it.
BIG_FRAME = 64 * 1024
#: Largest window or credit grant a frame may carry, and the most credit a
#: stream may accumulate (so a generous peer cannot make counters grow forever).
MAX_CREDIT = 1 << 40


class ByteBudget(Protocol):
    """Bytes shared by several connections (one local user's): ``take`` says whether ``n`` more fit."""

    def take(self, n: int) -> bool: ...

    def release(self, n: int) -> None: ...

    def describe(self) -> str: ...


class Role(enum.StrEnum):
    CLIENT = "client"
    PEER = "peer"


class State(enum.Enum):
    HELLO = "hello"  # waiting for the other side's hello
    AUTH = "auth"  # listener waiting for the dialer's proof
    READY = "ready"
    CLOSED = "closed"


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Ready:
    """Handshake done; ``node`` names the other side (a peer's node name, or
    the daemon's node name as seen by a client)."""

    role: Role
    node: str


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """Final answer to request ``id``. ``error`` is ``{"code", "message"}`` when not ok."""

    id: int
    ok: bool
    result: object = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Item:
    """One element of a streamed reply to request ``id`` (zero or more precede the Reply).

    ``size`` is the frame's size in bytes: what the consumer gives back with
    :meth:`Connection.send_credit` once it has dealt with the item.
    """

    id: int
    data: object
    size: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Credit:
    """The requester of ``id`` may now buffer ``n`` more bytes of items (already applied)."""

    id: int
    n: int


@dataclass(frozen=True)
class Cancel:
    """The requester of ``id`` lost interest; stop streaming and reply."""

    id: int


@dataclass(frozen=True)
class Note:
    """A one-way message; no reply is expected.

    ``size`` is the frame's size, held against the in-flight byte limits
    until the handler gives it back with :meth:`Connection.note_done`.
    """

    op: str
    args: dict[str, Any] = field(default_factory=dict)
    size: int = field(default=0, compare=False)


@dataclass(frozen=True)
class RemoteClosed:
    """The other side sent ``bye`` or an error during the handshake."""

    code: str
    message: str


Event = Ready | Request | Reply | Item | Cancel | Credit | Note | RemoteClosed


def _proof(secret: bytes, label: bytes, nonce_dialer: bytes, nonce_listener: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + nonce_dialer + b"|" + nonce_listener, hashlib.sha256).digest()


#: Bounded repr for values that came off the wire: error messages quote them,
#: and a plain repr of a deeply nested or huge value could raise RecursionError
#: or make the ``bye`` frame that carries the message exceed ``max_frame``.
_wire_repr = reprlib.Repr()
_wire_repr.maxlevel = 3
_wire_repr.maxstring = 60
_wire_repr.maxother = 60
_wire_repr.maxlist = _wire_repr.maxtuple = _wire_repr.maxdict = 4

#: Longest reason text put into a ``bye`` frame.
_MAX_BYE_MESSAGE = 512


def _show(value: object) -> str:
    return _wire_repr.repr(value)


_T = TypeVar("_T")


def _require(message: Message, key: str, kind: type[_T], what: str) -> _T:
    value = message.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError("malformed", f"{what}: field {key!r} missing or not {getattr(kind, '__name__', kind)}")
    return value


class Connection:
    """One end of a gangd connection.

    ``dialer`` is True on the side that opened the connection. ``role`` is
    what the dialer is (a listener accepts either role unless ``accept`` says
    otherwise). ``secret`` is required for peer connections. ``max_frame``
    applies once the handshake is done (:data:`HANDSHAKE_MAX_FRAME` before);
    ``max_request_frame`` (default ``max_frame``) to the other side's
    requests and notes. ``max_in_flight`` bounds the other side's requests
    served at once, ``max_in_flight_bytes`` (default: unbounded) the bytes of
    their frames, and ``budget`` the bytes shared with other connections.
    ``max_outbox`` bounds the machine's own unsent output.
    """

    def __init__(
        self,
        *,
        dialer: bool,
        node: str,
        role: Role = Role.CLIENT,
        secret: bytes | None = None,
        accept: frozenset[Role] = frozenset(Role),
        max_frame: int = DEFAULT_MAX_FRAME,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_request_frame: int | None = None,
        max_in_flight_bytes: int | None = None,
        budget: ByteBudget | None = None,
        max_outbox: int = DEFAULT_MAX_OUTBOX,
    ):
        self.dialer = dialer
        self.node = node
        self.role = role
        self.secret = secret
        self.accept = accept
        self.max_frame = max_frame
        self.state = State.HELLO
        self.peer_node: str | None = None
        self.max_in_flight = max_in_flight
        self.max_request_frame = max_frame if max_request_frame is None else min(max_request_frame, max_frame)
        self.max_in_flight_bytes = max_in_flight_bytes
        self.budget = budget
        self.max_outbox = max_outbox
        # Bytes held against the limits: frames of requests being served and
        # notes handed up, and a big frame charged while it arrives.
        self._held: dict[int, int] = {}  # rid -> bytes of its request frame
        self.held_bytes = 0
        self._reserved = 0
        self._decoder = FrameDecoder(min(max_frame, HANDSHAKE_MAX_FRAME))
        self._outbox = bytearray()
        # Requests of ours awaiting their reply: rid -> bytes of items the other side may still send.
        self._awaiting: dict[int, int] = {}
        # Requests of theirs being served: rid -> bytes of items we may still send.
        self._serving: dict[int, int] = {}
        self.refused_busy = 0  # requests answered busy so far (for logs and tests)
        self._next_id = 1
        self._nonce = os.urandom(NONCE_SIZE)
        self._peer_nonce = b""
        if dialer:
            if role is Role.PEER and not secret:
                raise ValueError("a peer connection needs the cluster secret")
            self._emit({"t": "hello", "v": PROTOCOL_VERSION, "role": role.value, "node": node, "nonce": self._nonce})

    # ------------------------------------------------------------ I/O side

    def receive_data(self, data: bytes | bytearray) -> None:
        if self.state is State.CLOSED:
            return
        self._decoder.feed(data)

    def receive_eof(self) -> None:
        """The transport closed. Raises ProtocolError if a frame was cut short."""
        self.state = State.CLOSED
        self._decoder.check_eof()

    @property
    def backlogged(self) -> bool:
        """A complete frame is buffered already: handle it before reading more."""
        if self.state is State.CLOSED:
            return False  # (nothing more is handed up: there is no backlog to work off)
        length = self._decoder.pending_length()
        return length is not None and self._decoder.buffered >= length

    def data_to_send(self) -> bytes:
        data = bytes(self._outbox)
        self._outbox.clear()
        return data

    def next_event(self) -> Event | None:
        """Return the next event, or None when more bytes are needed.

        Raises ProtocolError when the other side broke the protocol; the
        caller should write :meth:`data_to_send` (it may hold an error
        message for the other side) and close.
        """
        while self.state is not State.CLOSED:
            if len(self._outbox) > self.max_outbox:
                return None  # write out what we owe first (see the module's "Bounds")
            try:
                self._reserve_big_frame()
                message = self._decoder.next_message()
                if message is None:
                    return None
                try:
                    event = self._handle(message)
                finally:
                    if self._reserved:  # not taken over by a request or note: give it back
                        self._give(self._reserved)
                        self._reserved = 0
            except ProtocolError as exc:
                self._fail(exc)
                raise
            if event is not None:
                return event
        return None

    # ------------------------------------------------------------ send side

    def send_request(self, op: str, args: dict[str, Any] | None = None, *, window: int = DEFAULT_WINDOW) -> tuple[int, bytes]:
        """A request; ``window`` is how many bytes of stream items we will buffer before granting more."""
        self._check_ready()
        if not 0 <= window <= MAX_CREDIT:
            raise ValueError(f"window {window} out of range")
        rid = self._next_id
        limit = min(self.max_frame, MAX_CLIENT_REQUEST) if self.dialer and self.role is Role.CLIENT else self.max_frame
        frame = encode_frame({"t": "req", "id": rid, "op": op, "args": args or {}, "win": window}, limit)
        self._next_id += 1
        self._awaiting[rid] = window
        self._set_frame_limit()
        return rid, frame

    def send_reply(self, rid: int, result: object = None) -> bytes:
        self._check_ready()
        frame = encode_frame({"t": "rep", "id": rid, "ok": True, "result": result}, self.max_frame)
        self._served(rid)
        return frame

    def send_error(self, rid: int, code: str, message: str) -> bytes:
        self._check_ready()
        frame = encode_frame(
            {"t": "rep", "id": rid, "ok": False, "error": {"code": code, "message": message}}, self.max_frame
        )
        self._served(rid)
        return frame

    def note_done(self, note: Note) -> None:
        """The handler of ``note`` finished: its bytes no longer count."""
        self._give(note.size)

    def release_all(self) -> None:
        """The connection is gone: give back every byte it held (idempotent)."""
        self._give(self.held_bytes)
        self._held.clear()
        self._reserved = 0

    def serving(self, rid: int) -> bool:
        """True while request ``rid`` of the other side waits for its reply from us."""
        return rid in self._serving

    @property
    def in_flight(self) -> int:
        """Requests of the other side being served now."""
        return len(self._serving)

    def item_credit(self, rid: int) -> int:
        """Bytes of items we may still send on request ``rid`` (<= 0: wait for a Credit)."""
        return self._serving.get(rid, 0)

    def send_item(self, rid: int, data: object) -> bytes:
        """One item of the stream answering ``rid``. Raises ProtocolError
        ``no_credit`` unless :meth:`item_credit` is positive."""
        self._check_ready()
        credit = self._serving.get(rid)
        if credit is None:
            raise ProtocolError("not_serving", f"request {rid} is not being served")
        if credit <= 0:
            raise ProtocolError("no_credit", f"the requester of {rid} has granted no credit for more items")
        frame = encode_frame({"t": "item", "id": rid, "data": data}, self.max_frame)
        self._serving[rid] = credit - len(frame)
        return frame

    def send_credit(self, rid: int, n: int) -> bytes:
        """Grant the server of our request ``rid`` ``n`` more bytes of items
        (b"" if it was answered meanwhile: nothing to grant)."""
        self._check_ready()
        if rid not in self._awaiting or n <= 0:
            return b""
        n = min(n, MAX_CREDIT)
        self._awaiting[rid] = min(self._awaiting[rid] + n, MAX_CREDIT)
        return encode_frame({"t": "credit", "id": rid, "n": n}, self.max_frame)

    def send_cancel(self, rid: int) -> bytes:
        self._check_ready()
        return encode_frame({"t": "cancel", "id": rid}, self.max_frame)

    def send_note(self, op: str, args: dict[str, Any] | None = None) -> bytes:
        self._check_ready()
        return encode_frame({"t": "note", "op": op, "args": args or {}}, self.max_frame)

    def send_bye(self, code: str = "bye", message: str = "closing") -> bytes:
        self.state = State.CLOSED
        return encode_frame({"t": "bye", "code": code, "message": message}, self.max_frame)

    # ------------------------------------------------------------ internals

    def _emit(self, message: Message) -> None:
        self._outbox += encode_frame(message, self.max_frame)

    def _fail(self, exc: ProtocolError) -> None:
        # Stop, then tell the other side why where that is useful. The bye is
        # best effort: with a tiny max_frame even a short reason may not fit.
        self.state = State.CLOSED
        if exc.code in ("auth_failed", "version_mismatch", "role_refused", "malformed", "oversized", "flow_control", "too_much_in_flight"):
            try:
                self._outbox += encode_frame(
                    {"t": "bye", "code": exc.code, "message": exc.message[:_MAX_BYE_MESSAGE]}, self.max_frame
                )
            except ProtocolError:
                pass

    def _ready(self) -> None:
        self.state = State.READY
        self._set_frame_limit()

    def _set_frame_limit(self) -> None:
        # Replies to our requests may be large (a rank's network context);
        # what the other side sends of its own accord is limited further.
        if self.state is State.READY:
            self._decoder.max_frame = self.max_frame if self._awaiting else self.max_request_frame

    # -------- in-flight bytes

    def _take(self, n: int) -> str | None:
        """Charge ``n`` bytes; None if they fit, else why not."""
        if self.max_in_flight_bytes is None and self.budget is None:
            return None  # nothing to account against (peers, and the clients' own side)
        if self.max_in_flight_bytes is not None and self.held_bytes + n > self.max_in_flight_bytes:
            return (
                f"requests of this connection in flight hold {self.held_bytes} bytes already"
                f" (limit {self.max_in_flight_bytes}); retry when one is answered"
            )
        if self.budget is not None and not self.budget.take(n):
            return f"{self.budget.describe()}; retry when one is answered"
        self.held_bytes += n
        return None

    def _give(self, n: int) -> None:
        n = min(n, self.held_bytes)
        if n > 0:
            self.held_bytes -= n
            if self.budget is not None:
                self.budget.release(n)

    def _served(self, rid: int) -> None:
        self._serving.pop(rid, None)
        self._give(self._held.pop(rid, 0))

    def _reserve_big_frame(self) -> None:
        """Charge a big frame when its header arrives, before its payload is buffered."""
        if self.state is not State.READY or self._reserved or self._awaiting:
            return  # (frames while we await replies: limited by max_frame, checked when decoded)
        length = self._decoder.pending_length()
        if length is None or length <= BIG_FRAME or length - 4 > self._decoder.max_frame:
            return  # (an oversized one is refused by the decoder)
        why = self._take(length)
        if why is not None:
            raise ProtocolError("too_much_in_flight", f"a {length}-byte frame does not fit: {why}")
        self._reserved = length

    def _charge(self, size: int) -> str | None:
        """Charge a request's or note's frame (already charged if it was big)."""
        if self._reserved:
            self._reserved = 0  # taken over
            return None
        return self._take(size)

    def _check_ready(self) -> None:
        if self.state is not State.READY:
            raise ProtocolError("not_ready", f"cannot send in state {self.state.value}")

    def _check_request_size(self, what: str) -> int:
        size = self._decoder.last_size
        if size - 4 > self.max_request_frame:
            raise ProtocolError("oversized", f"{what} frame of {size - 4} bytes exceeds the {self.max_request_frame}-byte limit")
        return size

    def _handle(self, message: Message) -> Event | None:
        kind = message.get("t")
        if kind == "bye":
            self.state = State.CLOSED
            code = message.get("code", "bye")
            text = message.get("message", "")
            return RemoteClosed(
                code if isinstance(code, str) else _show(code), text if isinstance(text, str) else _show(text)
            )
        if self.state is State.HELLO:
            if kind != "hello":
                raise ProtocolError("malformed", f"expected hello, got {_show(kind)}")
            return self._on_hello(message)
        if self.state is State.AUTH:
            if kind != "auth":
                raise ProtocolError("malformed", f"expected auth, got {_show(kind)}")
            proof = _require(message, "proof", bytes, "auth")
            expected = _proof(self.secret or b"", b"dialer", self._peer_nonce, self._nonce)
            if not hmac.compare_digest(proof, expected):
                raise ProtocolError(
                    "auth_failed", f"peer {_show(self.peer_node)} failed authentication: wrong cluster secret"
                )
            self._ready()
            return Ready(Role.PEER, self.peer_node or "?")
        return self._on_ready_message(kind, message)

    def _on_hello(self, message: Message) -> Event | None:
        version = message.get("v")
        node = _require(message, "node", str, "hello")
        # type() check: True == 1 and 1.0 == 1 must not pass for version 1.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolError(
                "version_mismatch",
                f"{_show(node)} speaks gangd protocol version {_show(version)}, this daemon speaks {PROTOCOL_VERSION}",
            )
        self.peer_node = node
        if self.dialer:
            if self.role is Role.PEER:
                self._peer_nonce = _require(message, "nonce", bytes, "hello")
                proof = _require(message, "proof", bytes, "hello")
                expected = _proof(self.secret or b"", b"listener", self._nonce, self._peer_nonce)
                if not hmac.compare_digest(proof, expected):
                    raise ProtocolError(
                        "auth_failed", f"node {_show(node)} failed authentication: wrong cluster secret"
                    )
                self._emit({"t": "auth", "proof": _proof(self.secret or b"", b"dialer", self._nonce, self._peer_nonce)})
            self._ready()
            return Ready(self.role, node)
        # listener side
        role = next((known for known in Role if known.value == message.get("role")), None)
        if role is None:
            raise ProtocolError("malformed", f"hello from {_show(node)} names unknown role {_show(message.get('role'))}")
        if role not in self.accept:
            raise ProtocolError("role_refused", f"{role.value} connections are not accepted on this socket")
        self.role = role
        if role is Role.PEER:
            if not self.secret:
                raise ProtocolError("role_refused", "this daemon has no cluster secret; peers cannot join")
            self._peer_nonce = _require(message, "nonce", bytes, "hello")
            if len(self._peer_nonce) != NONCE_SIZE:
                raise ProtocolError("malformed", "hello nonce has the wrong size")
            self._emit(
                {
                    "t": "hello",
                    "v": PROTOCOL_VERSION,
                    "node": self.node,
                    "nonce": self._nonce,
                    "proof": _proof(self.secret, b"listener", self._peer_nonce, self._nonce),
                }
            )
            self.state = State.AUTH
            return None
        self._emit({"t": "hello", "v": PROTOCOL_VERSION, "node": self.node})
        self._ready()
        return Ready(Role.CLIENT, node)

    def _on_ready_message(self, kind: object, message: Message) -> Event | None:
        if kind == "req":
            rid = _require(message, "id", int, "request")
            op = _require(message, "op", str, "request")
            args = message.get("args", {})
            if not isinstance(args, dict):
                raise ProtocolError("malformed", "request: args is not a map")
            window = _require(message, "win", int, "request")
            if not 0 <= window <= MAX_CREDIT:
                raise ProtocolError("malformed", f"request: window {_show(window)} out of range")
            if rid in self._serving:
                raise ProtocolError("malformed", f"request id {_show(rid)} is already in flight")
            size = self._check_request_size("request")
            if len(self._serving) >= self.max_in_flight:
                why: str | None = f"{self.max_in_flight} requests of this connection are in flight already; retry when one is answered"
            else:
                why = self._charge(size)
            if why is not None:
                # Answered here, not handed up: no task, no memory beyond this frame.
                self.refused_busy += 1
                self._emit({"t": "rep", "id": rid, "ok": False, "error": {"code": "busy", "message": f"busy: {why}"}})
                return None
            self._serving[rid] = window
            self._held[rid] = size
            return Request(rid, op, args)
        if kind == "credit":
            rid = _require(message, "id", int, "credit")
            n = _require(message, "n", int, "credit")
            if not 0 < n <= MAX_CREDIT:
                raise ProtocolError("malformed", f"credit: grant {_show(n)} out of range")
            if rid not in self._serving:
                return None  # answered meanwhile: a grant in flight crossed the reply
            self._serving[rid] = min(self._serving[rid] + n, MAX_CREDIT)
            return Credit(rid, n)
        if kind == "item":
            rid = _require(message, "id", int, "item")
            size = self._decoder.last_size
            credit = self._awaiting.get(rid)
            if credit is None:
                raise ProtocolError("malformed", f"item for request {_show(rid)}, which is not awaiting a reply")
            if credit <= 0:
                raise ProtocolError("flow_control", f"item for request {rid} beyond the credit granted")
            self._awaiting[rid] = credit - size
            return Item(rid, message.get("data"), size)
        if kind == "rep":
            rid = _require(message, "id", int, "reply")
            if self._awaiting.pop(rid, None) is None:
                raise ProtocolError("malformed", f"reply to request {_show(rid)}, which is not awaiting one")
            self._set_frame_limit()
            ok = message.get("ok")
            if not isinstance(ok, bool):
                raise ProtocolError("malformed", "reply: field 'ok' missing or not bool")
            if ok:
                return Reply(rid, True, message.get("result"))
            error = message.get("error")
            if not (isinstance(error, dict) and isinstance(error.get("code"), str) and isinstance(error.get("message"), str)):
                raise ProtocolError("malformed", "error reply without a code and message")
            return Reply(rid, False, None, error)
        if kind == "cancel":
            return Cancel(_require(message, "id", int, "cancel"))
        if kind == "note":
            args = message.get("args", {})
            if not isinstance(args, dict):
                raise ProtocolError("malformed", "note: args is not a map")
            op = _require(message, "op", str, "note")
            size = self._check_request_size("note")
            why = self._charge(size)
            if why is not None:  # one-way: nobody to say busy to
                raise ProtocolError("too_much_in_flight", f"note {_show(op)} does not fit: {why}")
            return Note(op, args, size)
        raise ProtocolError("malformed", f"unknown message type {_show(kind)}")
