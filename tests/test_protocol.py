"""Tests for gangd's sans-I/O wire protocol (frames and the Connection machine).

Everything here is synchronous: two Connection objects talk by shuttling the
bytes one returns into the other, no sockets involved.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gangd.protocol.connection as connection_module
from gangd.protocol import (
    DEFAULT_MAX_FRAME,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    Connection,
    FrameDecoder,
    Item,
    Note,
    ProtocolError,
    Ready,
    RemoteClosed,
    Reply,
    Request,
    Role,
    State,
    decode_payload,
    encode_frame,
)

SECRET = b"correct horse battery staple"
OTHER_SECRET = b"not the cluster secret"

EVENT_TYPES = (Ready, Request, Reply, Item, Cancel, connection_module.Credit, Note, RemoteClosed)


# ---------------------------------------------------------------- helpers


def raw_frame(obj: object) -> bytes:
    """Frame any msgpack value, bypassing encode_frame's checks."""
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def decode_all(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> list[dict]:
    """Split bytes that must be whole frames into messages."""
    decoder = FrameDecoder(max_frame)
    decoder.feed(data)
    messages = list(decoder)
    assert decoder.buffered == 0, "trailing partial frame"
    return messages


def drain(conn: Connection) -> list:
    events = []
    while (event := conn.next_event()) is not None:
        events.append(event)
    return events


def deliver(src: Connection, dst: Connection) -> list:
    """Move src's pending output into dst and return dst's events."""
    dst.receive_data(src.data_to_send())
    return drain(dst)


def handshake(dialer: Connection, listener: Connection) -> tuple[list, list]:
    """Run the handshake to quiescence; return (dialer events, listener events)."""
    dialer_events: list = []
    listener_events: list = []
    for _ in range(4):
        listener_events += deliver(dialer, listener)
        dialer_events += deliver(listener, dialer)
    return dialer_events, listener_events


def make_pair(role: Role) -> tuple[Connection, Connection]:
    secret = SECRET if role is Role.PEER else None
    dialer = Connection(dialer=True, node="alpha", role=role, secret=secret)
    listener = Connection(dialer=False, node="beta", secret=secret)
    dialer_events, listener_events = handshake(dialer, listener)
    assert dialer_events == [Ready(role, "beta")]
    assert listener_events == [Ready(role, "alpha")]
    return dialer, listener


def dialer_proof(secret: bytes, nonce_dialer: bytes, nonce_listener: bytes) -> bytes:
    """The dialer's proof as the module docstring specifies it, computed independently."""
    return hmac.new(secret, b"dialer|" + nonce_dialer + b"|" + nonce_listener, hashlib.sha256).digest()


def hand_made_hello(role: str = "peer", nonce: bytes = b"N" * NONCE_SIZE, **extra) -> dict:
    return {"t": "hello", "v": PROTOCOL_VERSION, "role": role, "node": "mallory", "nonce": nonce, **extra}


@pytest.fixture(params=[Role.CLIENT, Role.PEER], ids=["client", "peer"])
def pair(request) -> tuple[Connection, Connection]:
    return make_pair(request.param)


# ================================================================ frames

ROUND_TRIP_MESSAGES = [
    {},
    {"t": None},
    {"": ""},
    {"a": {}, "b": [], "c": b""},
    {"nested": {"deeper": {"deepest": [1, [2, [3, {"x": None}]]]}}, "list": [True, False, None]},
    {"blob": bytes(range(256)), "zero": b"\x00" * 1000},
    {"unicode": "héllo wörld ✓ 🐍 日本語", "ключ": "значение", "emoji🔑": ["💥"]},
    {"ints": [0, -1, 2**31, -(2**63), 2**64 - 1], "floats": [0.5, -1e300, 3.141592653589793]},
    {b"bytes-key": 1, "str-key": 2},
    {"big": "x" * 100_000},
]


@pytest.mark.parametrize("message", ROUND_TRIP_MESSAGES)
def test_frame_round_trip(message):
    frame = encode_frame(message)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode_payload(frame[4:]) == message
    assert decode_all(frame) == [message]


def test_unicode_is_sent_as_msgpack_str_and_bytes_as_bin():
    frame = encode_frame({"s": "é", "b": b"\xc3\xa9"})
    decoded = decode_all(frame)[0]
    assert type(decoded["s"]) is str and decoded["s"] == "é"
    assert type(decoded["b"]) is bytes and decoded["b"] == b"\xc3\xa9"


def test_several_frames_in_one_chunk():
    messages = [{"i": i, "pad": "y" * i} for i in range(20)] + [{}]
    decoder = FrameDecoder()
    decoder.feed(b"".join(encode_frame(m) for m in messages))
    assert list(decoder) == messages
    assert decoder.buffered == 0
    assert decoder.next_message() is None


def test_frames_split_across_chunk_boundaries():
    messages = [{"n": n, "data": b"z" * (n * 7)} for n in range(10)]
    stream = b"".join(encode_frame(m) for m in messages)
    decoder = FrameDecoder()
    got = []
    for start in range(0, len(stream), 13):  # 13 never lines up with a frame edge for long
        decoder.feed(stream[start : start + 13])
        got.extend(decoder)
    assert got == messages
    assert decoder.buffered == 0


def test_frame_one_byte_at_a_time():
    message = {"t": "req", "id": 7, "op": "ping", "args": {"x": "é" * 10}}
    frame = encode_frame(message)
    decoder = FrameDecoder()
    for i, byte in enumerate(frame[:-1]):
        decoder.feed(bytes([byte]))
        assert decoder.next_message() is None
        assert decoder.buffered == i + 1
    decoder.feed(frame[-1:])
    assert decoder.next_message() == message
    assert decoder.buffered == 0
    decoder.check_eof()  # nothing pending


def _payload_of_size(size: int) -> dict:
    """A message whose msgpack payload is exactly ``size`` bytes."""
    base = len(msgpack.packb({"p": b""}, use_bin_type=True))
    for pad in range(size, -1, -1):
        message = {"p": b"x" * pad}
        if len(msgpack.packb(message, use_bin_type=True)) == size:
            return message
    raise AssertionError(f"cannot build a {size}-byte payload (base {base})")


@pytest.mark.parametrize("limit", [64, 1000, 70_000])
def test_encode_max_frame_boundary(limit):
    at_limit = _payload_of_size(limit)
    frame = encode_frame(at_limit, max_frame=limit)
    assert len(frame) == 4 + limit
    over = _payload_of_size(limit + 1)
    with pytest.raises(ProtocolError) as info:
        encode_frame(over, max_frame=limit)
    assert info.value.code == "oversized"
    assert str(limit) in info.value.message


@pytest.mark.parametrize("limit", [64, 1000, 70_000])
def test_decoder_max_frame_boundary(limit):
    # exactly at the limit: accepted
    message = _payload_of_size(limit)
    frame = encode_frame(message, max_frame=limit)
    assert decode_all(frame, max_frame=limit) == [message]

    # one above: refused from the length prefix alone, before any payload arrives
    over = raw_frame(_payload_of_size(limit + 1))
    assert struct.unpack(">I", over[:4])[0] == limit + 1
    decoder = FrameDecoder(limit)
    decoder.feed(over[:3])
    assert decoder.next_message() is None  # header not complete yet
    decoder.feed(over[3:4])
    with pytest.raises(ProtocolError) as info:
        decoder.next_message()
    assert info.value.code == "oversized"


def test_decoder_refuses_huge_length_prefix_without_waiting():
    decoder = FrameDecoder()
    decoder.feed(b"\xff\xff\xff\xff")
    with pytest.raises(ProtocolError) as info:
        decoder.next_message()
    assert info.value.code == "oversized"
    assert str(DEFAULT_MAX_FRAME) in info.value.message


def test_connection_refuses_oversized_length_prefix():
    conn = Connection(dialer=False, node="beta", max_frame=1000)
    conn.receive_data(struct.pack(">I", 1001))
    with pytest.raises(ProtocolError) as info:
        conn.next_event()
    assert info.value.code == "oversized"
    assert conn.state is State.CLOSED
    (bye,) = decode_all(conn.data_to_send())
    assert bye["t"] == "bye" and bye["code"] == "oversized"


@pytest.mark.parametrize(
    "value", [[1, 2, 3], [], 42, -1, None, "a string", b"bytes", True, 1.5], ids=repr
)
def test_non_map_payload_refused(value):
    payload = msgpack.packb(value, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        decode_payload(payload)
    assert info.value.code == "malformed"

    decoder = FrameDecoder()
    decoder.feed(raw_frame(value))
    with pytest.raises(ProtocolError) as info:
        decoder.next_message()
    assert info.value.code == "malformed"


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # empty frame
        b"\xc1",  # reserved, never valid
        b"\x81\xa1t",  # map cut short inside the payload
        msgpack.packb({"a": 1}) + b"\x00",  # trailing garbage after the map
        msgpack.packb({1: "int key"}),  # non-string map key
        b"\x81\xa2\xff\xfe\x01",  # invalid UTF-8 in a str key
        b"\x81\xa1t\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    ],
    ids=["empty", "reserved", "cut-short", "trailing", "int-key", "bad-utf8", "huge-str"],
)
def test_undecodable_payload_refused(payload):
    with pytest.raises(ProtocolError) as info:
        decode_payload(payload)
    assert info.value.code == "malformed"


@pytest.mark.parametrize("cut", [1, 3, 4, 5, -1])
def test_truncated_frame_at_eof(cut):
    frame = encode_frame({"t": "hello", "pad": "z" * 20})
    decoder = FrameDecoder()
    decoder.feed(frame[:cut])
    assert decoder.next_message() is None
    with pytest.raises(ProtocolError) as info:
        decoder.check_eof()
    assert info.value.code == "truncated"

    conn = Connection(dialer=False, node="beta")
    conn.receive_data(frame[:cut])
    assert conn.next_event() is None
    with pytest.raises(ProtocolError) as info:
        conn.receive_eof()
    assert info.value.code == "truncated"
    assert conn.state is State.CLOSED


def test_clean_eof_is_not_an_error():
    decoder = FrameDecoder()
    decoder.check_eof()
    decoder.feed(encode_frame({"a": 1}))
    assert decoder.next_message() == {"a": 1}
    decoder.check_eof()

    dialer, listener = make_pair(Role.CLIENT)
    listener.receive_data(dialer.send_note("bye-bye"))
    assert drain(listener) == [Note("bye-bye", {})]
    listener.receive_eof()
    assert listener.state is State.CLOSED


# ---------------------------------------------------------------- frame properties

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
msgpack_maps = st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), msgpack_values, max_size=5)


@settings(max_examples=200, deadline=None, database=None)
@given(messages=st.lists(msgpack_maps, max_size=3), data=st.data())
def test_frame_round_trip_property(messages, data):
    stream = b"".join(encode_frame(m) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    decoder = FrameDecoder()
    got = []
    previous = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[previous:cut])
        previous = cut
        got.extend(decoder)
    assert got == messages
    assert decoder.buffered == 0
    decoder.check_eof()


def _decode_stream(chunks: list[bytes], max_frame: int) -> tuple[list[str], str | None]:
    """Feed chunks, draining after each; return (reprs of messages, error code)."""
    decoder = FrameDecoder(max_frame)
    messages: list[str] = []
    for chunk in chunks:
        decoder.feed(chunk)
        try:
            for message in decoder:
                assert isinstance(message, dict)
                messages.append(repr(message))
        except ProtocolError as exc:
            assert exc.code in ("malformed", "oversized")
            return messages, exc.code
    try:
        decoder.check_eof()
    except ProtocolError as exc:
        assert exc.code == "truncated"
        return messages, exc.code
    return messages, None


# Streams that mix well-formed frames, lying length prefixes and raw noise.
stream_pieces = st.one_of(
    st.binary(max_size=40),
    msgpack_maps.map(raw_frame),
    msgpack_values.map(raw_frame),
    st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    st.integers(0, 200).map(lambda n: struct.pack(">I", n)),
)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(stream_pieces, max_size=8),
    max_frame=st.sampled_from([16, 64, 1024, DEFAULT_MAX_FRAME]),
    data=st.data(),
)
def test_decoder_fuzz_only_raises_protocol_error(pieces, max_frame, data):
    stream = b"".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # Any exception other than ProtocolError (or a failed assert) fails the test.
    chunked = _decode_stream(chunks, max_frame)
    # How the bytes were chunked must not change what comes out.
    assert chunked == _decode_stream([stream], max_frame)


# ================================================================ handshake


def test_client_handshake():
    dialer = Connection(dialer=True, node="laptop", role=Role.CLIENT)
    listener = Connection(dialer=False, node="node01")
    assert dialer.state is State.HELLO and listener.state is State.HELLO
    (hello,) = decode_all(dialer.data_to_send())
    assert hello["t"] == "hello" and hello["v"] == PROTOCOL_VERSION and hello["role"] == "client"
    assert hello["node"] == "laptop" and len(hello["nonce"]) == NONCE_SIZE
    listener.receive_data(raw_frame(hello))
    assert drain(listener) == [Ready(Role.CLIENT, "laptop")]
    assert listener.state is State.READY and listener.peer_node == "laptop"
    assert deliver(listener, dialer) == [Ready(Role.CLIENT, "node01")]
    assert dialer.state is State.READY and dialer.peer_node == "node01"
    # a client handshake needs no third message
    assert dialer.data_to_send() == b""


def test_peer_handshake():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    assert deliver(dialer, listener) == []
    assert listener.state is State.AUTH  # proven itself, waiting for the dialer's proof
    assert deliver(listener, dialer) == [Ready(Role.PEER, "node02")]
    assert dialer.state is State.READY
    assert deliver(dialer, listener) == [Ready(Role.PEER, "node01")]
    assert listener.state is State.READY and listener.role is Role.PEER
    assert dialer.data_to_send() == b"" and listener.data_to_send() == b""


def test_nonces_are_fresh_per_connection():
    first = decode_all(Connection(dialer=True, node="a").data_to_send())[0]["nonce"]
    second = decode_all(Connection(dialer=True, node="a").data_to_send())[0]["nonce"]
    assert first != second


def test_peer_dialer_needs_secret():
    with pytest.raises(ValueError):
        Connection(dialer=True, node="node01", role=Role.PEER)
    with pytest.raises(ValueError):
        Connection(dialer=True, node="node01", role=Role.PEER, secret=b"")


def test_listener_with_wrong_secret_is_caught_by_dialer():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="impostor", secret=OTHER_SECRET)
    assert deliver(dialer, listener) == []
    dialer.receive_data(listener.data_to_send())
    with pytest.raises(ProtocolError) as info:
        dialer.next_event()
    assert info.value.code == "auth_failed"
    assert "wrong cluster secret" in info.value.message
    assert "impostor" in info.value.message
    assert dialer.state is State.CLOSED
    # the dialer never proves anything to a listener that failed; it says why instead
    out = decode_all(dialer.data_to_send())
    assert [m["t"] for m in out] == ["bye"]
    assert out[0]["code"] == "auth_failed"
    # ... and the listener sees the refusal, never Ready
    listener.receive_data(raw_frame(out[0]))
    (closed,) = drain(listener)
    assert isinstance(closed, RemoteClosed)
    assert closed.code == "auth_failed" and "wrong cluster secret" in closed.message
    assert listener.state is State.CLOSED


def test_dialer_with_wrong_secret_is_caught_by_listener():
    # A dialer with the wrong secret would already reject the listener's proof,
    # so to reach the listener's check we play the dialer by hand and send an
    # auth computed with the wrong secret.
    def attempt(secret: bytes):
        listener = Connection(dialer=False, node="node02", secret=SECRET)
        nonce_d = b"D" * NONCE_SIZE
        listener.receive_data(raw_frame(hand_made_hello(nonce=nonce_d)))
        assert drain(listener) == []
        (reply,) = decode_all(listener.data_to_send())
        listener.receive_data(raw_frame({"t": "auth", "proof": dialer_proof(secret, nonce_d, reply["nonce"])}))
        return listener

    # control: the documented proof with the right secret authenticates
    good = attempt(SECRET)
    assert drain(good) == [Ready(Role.PEER, "mallory")]

    bad = attempt(OTHER_SECRET)
    with pytest.raises(ProtocolError) as info:
        bad.next_event()
    assert info.value.code == "auth_failed"
    assert "wrong cluster secret" in info.value.message
    assert bad.state is State.CLOSED
    (bye,) = decode_all(bad.data_to_send())
    assert bye["t"] == "bye" and bye["code"] == "auth_failed"


def test_reflected_proof_does_not_authenticate():
    # The dialer has no secret and echoes the listener's own proof back.
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(raw_frame(hand_made_hello()))
    assert drain(listener) == []
    (reply,) = decode_all(listener.data_to_send())
    listener.receive_data(raw_frame({"t": "auth", "proof": reply["proof"]}))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "auth_failed"
    assert listener.state is State.CLOSED


def test_reflected_proof_with_mirrored_nonces_does_not_authenticate():
    # Attacker opens a second connection, using the listener's nonce from the
    # first as its own dialer nonce, hoping to get a proof usable on the first.
    # (Its proof there is H("listener"|nonce_l1|nonce_l2) -- the label keeps it
    # from being the H("dialer"|nonce_d1|nonce_l1) the first connection wants.)
    first = Connection(dialer=False, node="node02", secret=SECRET)
    first.receive_data(raw_frame(hand_made_hello(nonce=b"A" * NONCE_SIZE)))
    assert drain(first) == []
    (hello1,) = decode_all(first.data_to_send())
    second = Connection(dialer=False, node="node02", secret=SECRET)
    second.receive_data(raw_frame(hand_made_hello(nonce=hello1["nonce"])))
    assert drain(second) == []
    (hello2,) = decode_all(second.data_to_send())
    first.receive_data(raw_frame({"t": "auth", "proof": hello2["proof"]}))
    with pytest.raises(ProtocolError) as info:
        first.next_event()
    assert info.value.code == "auth_failed"
    assert first.state is State.CLOSED


def test_replayed_dialer_auth_does_not_authenticate():
    # Record a whole successful dialer transcript, then replay it to a new listener.
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    recorded_hello = dialer.data_to_send()
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(recorded_hello)
    drain(listener)
    dialer.receive_data(listener.data_to_send())
    assert drain(dialer) == [Ready(Role.PEER, "node02")]
    recorded_auth = dialer.data_to_send()
    listener.receive_data(recorded_auth)
    assert drain(listener) == [Ready(Role.PEER, "node01")]

    replay_target = Connection(dialer=False, node="node02", secret=SECRET)
    replay_target.receive_data(recorded_hello)
    assert drain(replay_target) == []
    replay_target.receive_data(recorded_auth)
    with pytest.raises(ProtocolError) as info:
        replay_target.next_event()
    assert info.value.code == "auth_failed"
    assert replay_target.state is State.CLOSED


def test_replayed_listener_hello_does_not_authenticate():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(dialer.data_to_send())
    drain(listener)
    recorded = listener.data_to_send()
    dialer.receive_data(recorded)
    assert drain(dialer) == [Ready(Role.PEER, "node02")]

    # a fake listener replays that hello (with its valid-looking proof) to a new dialer
    victim = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    victim.data_to_send()
    victim.receive_data(recorded)
    with pytest.raises(ProtocolError) as info:
        victim.next_event()
    assert info.value.code == "auth_failed"
    # and the victim gave away no proof of its own
    assert [m["t"] for m in decode_all(victim.data_to_send())] == ["bye"]


def test_listener_hello_without_proof_is_refused_by_peer_dialer():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    dialer.data_to_send()
    # what a listener sends a *client*: no nonce, no proof
    dialer.receive_data(raw_frame({"t": "hello", "v": PROTOCOL_VERSION, "node": "node02"}))
    with pytest.raises(ProtocolError) as info:
        dialer.next_event()
    assert info.value.code == "malformed"
    assert dialer.state is State.CLOSED


def test_version_mismatch_refused_by_listener(monkeypatch):
    monkeypatch.setattr(connection_module, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    future = Connection(dialer=True, node="future", role=Role.CLIENT)
    monkeypatch.undo()
    listener = Connection(dialer=False, node="node02")
    listener.receive_data(future.data_to_send())
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "version_mismatch"
    assert listener.state is State.CLOSED
    out = decode_all(listener.data_to_send())
    assert len(out) == 1
    bye = out[0]
    assert bye["t"] == "bye" and bye["code"] == "version_mismatch"
    assert str(PROTOCOL_VERSION + 1) in bye["message"] and str(PROTOCOL_VERSION) in bye["message"]
    assert "future" in bye["message"]
    # the newer dialer learns why
    future.receive_data(raw_frame(bye))
    assert drain(future) == [RemoteClosed("version_mismatch", bye["message"])]
    assert future.state is State.CLOSED


def test_version_mismatch_refused_by_dialer():
    dialer = Connection(dialer=True, node="node01")
    dialer.receive_data(raw_frame({"t": "hello", "v": PROTOCOL_VERSION + 1, "node": "node02"}))
    with pytest.raises(ProtocolError) as info:
        dialer.next_event()
    assert info.value.code == "version_mismatch"
    assert dialer.state is State.CLOSED


@pytest.mark.parametrize("version", [None, True, float(PROTOCOL_VERSION), str(PROTOCOL_VERSION), 0, -1])
def test_version_must_be_the_integer(version):
    listener = Connection(dialer=False, node="node02")
    hello = {"t": "hello", "role": "client", "node": "x"}
    if version is not None:
        hello["v"] = version
    listener.receive_data(raw_frame(hello))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "version_mismatch"


def test_listener_accepting_only_clients_refuses_peer():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02", secret=SECRET, accept=frozenset({Role.CLIENT}))
    listener.receive_data(dialer.data_to_send())
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "role_refused"
    assert listener.state is State.CLOSED
    (bye,) = decode_all(listener.data_to_send())
    assert bye["t"] == "bye" and bye["code"] == "role_refused"
    assert "proof" not in bye  # no proof leaked to a refused peer
    dialer.receive_data(raw_frame(bye))
    (closed,) = drain(dialer)
    assert isinstance(closed, RemoteClosed) and closed.code == "role_refused"

    # a client is still welcome on that socket
    client = Connection(dialer=True, node="user", role=Role.CLIENT)
    listener = Connection(dialer=False, node="node02", secret=SECRET, accept=frozenset({Role.CLIENT}))
    assert handshake(client, listener) == ([Ready(Role.CLIENT, "node02")], [Ready(Role.CLIENT, "user")])


def test_listener_accepting_only_peers_refuses_client():
    listener = Connection(dialer=False, node="node02", secret=SECRET, accept=frozenset({Role.PEER}))
    listener.receive_data(Connection(dialer=True, node="user").data_to_send())
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "role_refused"


def test_listener_without_secret_refuses_peers():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02")
    listener.receive_data(dialer.data_to_send())
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "role_refused"
    assert listener.state is State.CLOSED


@pytest.mark.parametrize(
    "hello, code",
    [
        (hand_made_hello(role="admin"), "malformed"),
        (hand_made_hello(role=None), "malformed"),
        (hand_made_hello(nonce=b"short"), "malformed"),
        (hand_made_hello(nonce=b"x" * (NONCE_SIZE + 1)), "malformed"),
        (hand_made_hello(nonce="N" * NONCE_SIZE), "malformed"),
        ({"t": "hello", "v": PROTOCOL_VERSION, "role": "peer", "node": "x"}, "malformed"),  # no nonce
        ({"t": "hello", "v": PROTOCOL_VERSION, "role": "client"}, "malformed"),  # no node
        ({"t": "hello", "v": PROTOCOL_VERSION, "role": "client", "node": 5}, "malformed"),
    ],
    ids=["unknown-role", "no-role", "short-nonce", "long-nonce", "str-nonce", "no-nonce", "no-node", "int-node"],
)
def test_bad_hello_refused(hello, code):
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(raw_frame(hello))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == code
    assert listener.state is State.CLOSED
    assert listener.data_to_send() != b""  # a bye saying why


PRE_HANDSHAKE_MESSAGES = [
    {"t": "req", "id": 1, "op": "ping", "args": {}},
    {"t": "rep", "id": 1, "ok": True, "result": None},
    {"t": "item", "id": 1, "data": 1},
    {"t": "cancel", "id": 1},
    {"t": "note", "op": "x", "args": {}},
    {"t": "auth", "proof": b"\x00" * 32},
    {"v": PROTOCOL_VERSION, "role": "client", "node": "no-type"},
    {"t": b"hello", "v": PROTOCOL_VERSION, "role": "client", "node": "bytes-type"},
]


@pytest.mark.parametrize("message", PRE_HANDSHAKE_MESSAGES, ids=lambda m: repr(m.get("t")))
@pytest.mark.parametrize("side", ["listener", "dialer"])
def test_messages_before_hello_refused(message, side):
    if side == "listener":
        conn = Connection(dialer=False, node="node02", secret=SECRET)
    else:
        conn = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
        conn.data_to_send()
    conn.receive_data(raw_frame(message))
    with pytest.raises(ProtocolError) as info:
        conn.next_event()
    assert info.value.code == "malformed"
    assert "hello" in info.value.message
    assert conn.state is State.CLOSED
    # whatever follows is ignored, even a perfect hello
    conn.receive_data(Connection(dialer=True, node="late").data_to_send())
    assert conn.next_event() is None


@pytest.mark.parametrize(
    "message",
    [
        {"t": "req", "id": 1, "op": "ping", "args": {}},
        hand_made_hello(),
        {"t": "auth"},
        {"t": "auth", "proof": "not bytes"},
    ],
    ids=["req", "hello-again", "auth-without-proof", "auth-str-proof"],
)
def test_listener_waiting_for_auth_accepts_only_auth(message):
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(raw_frame(hand_made_hello()))
    assert drain(listener) == []
    assert listener.state is State.AUTH
    listener.receive_data(raw_frame(message))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "malformed"
    assert listener.state is State.CLOSED


def test_bye_during_handshake_is_reported():
    listener = Connection(dialer=False, node="node02")
    listener.receive_data(raw_frame({"t": "bye", "code": "shutdown", "message": "going away"}))
    assert drain(listener) == [RemoteClosed("shutdown", "going away")]
    assert listener.state is State.CLOSED
    # a bye with odd field types still produces string fields
    dialer = Connection(dialer=True, node="node01")
    dialer.receive_data(raw_frame({"t": "bye", "code": 7, "message": [[["deep"]]]}))
    (closed,) = drain(dialer)
    assert isinstance(closed, RemoteClosed)
    assert closed.code == "7" and isinstance(closed.message, str) and "deep" in closed.message


def test_deeply_nested_values_in_errors_do_not_crash():
    # Quoting a wire value in an error message must not blow the recursion limit.
    deep: object = "x"
    for _ in range(1000):
        deep = [deep]
    for message in ({"t": deep}, {"t": "hello", "v": deep, "node": "n", "role": "client"}):
        conn = Connection(dialer=False, node="node02")
        conn.receive_data(raw_frame(message))
        with pytest.raises(ProtocolError):
            conn.next_event()
        assert conn.state is State.CLOSED
        assert len(conn.data_to_send()) < 2000


def test_huge_quoted_value_does_not_break_the_error_path():
    # The refusal quotes the offending value; with a small max_frame that must
    # not turn into an oversized error while building the bye.
    conn = Connection(dialer=False, node="node02", max_frame=200)
    conn.receive_data(raw_frame({"t": "z" * 150}))
    with pytest.raises(ProtocolError) as info:
        conn.next_event()
    assert info.value.code == "malformed"
    assert conn.state is State.CLOSED
    (bye,) = decode_all(conn.data_to_send(), max_frame=200)
    assert bye["t"] == "bye" and bye["code"] == "malformed"


def test_closed_connection_ignores_input():
    dialer, listener = make_pair(Role.CLIENT)
    listener.receive_data(dialer.send_bye("shutdown", "node draining"))
    assert drain(listener) == [RemoteClosed("shutdown", "node draining")]
    assert dialer.state is State.CLOSED
    listener.receive_data(encode_frame({"t": "req", "id": 1, "op": "x"}))
    assert listener.next_event() is None
    with pytest.raises(ProtocolError):
        dialer.send_request("x")


# ================================================================ after Ready


def test_request_reply_round_trip(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("status", {"jobs": [1, 2], "verbose": True})
    listener.receive_data(frame)
    assert drain(listener) == [Request(rid, "status", {"jobs": [1, 2], "verbose": True})]
    dialer.receive_data(listener.send_reply(rid, {"load": 0.5, "blob": b"\x00\xff"}))
    assert drain(dialer) == [Reply(rid, True, {"load": 0.5, "blob": b"\x00\xff"})]

    # the listener may issue requests too
    rid2, frame = listener.send_request("ping")
    dialer.receive_data(frame)
    assert drain(dialer) == [Request(rid2, "ping", {})]
    listener.receive_data(dialer.send_reply(rid2))
    assert drain(listener) == [Reply(rid2, True, None)]


def test_error_reply_round_trip(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("kill", {"job": 9})
    listener.receive_data(frame)
    (request,) = drain(listener)
    dialer.receive_data(listener.send_error(request.id, "no_such_job", "job 9 is not running"))
    (reply,) = drain(dialer)
    assert reply == Reply(rid, False, None, {"code": "no_such_job", "message": "job 9 is not running"})
    assert not reply.ok


def test_stream_items_cancel_and_final_reply(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", {"job": 3})
    listener.receive_data(frame)
    drain(listener)
    out = b"".join(listener.send_item(rid, chunk) for chunk in [b"line 1\n", {"line": 2}, None])
    dialer.receive_data(out)
    assert drain(dialer) == [Item(rid, b"line 1\n"), Item(rid, {"line": 2}), Item(rid, None)]
    listener.receive_data(dialer.send_cancel(rid))
    assert drain(listener) == [Cancel(rid)]
    dialer.receive_data(listener.send_error(rid, "cancelled", "stream cancelled"))
    assert drain(dialer) == [Reply(rid, False, None, {"code": "cancelled", "message": "stream cancelled"})]


def test_note_round_trip(pair):
    dialer, listener = pair
    listener.receive_data(dialer.send_note("heartbeat", {"load": [0.1, 0.2]}) + dialer.send_note("tick"))
    assert drain(listener) == [Note("heartbeat", {"load": [0.1, 0.2]}), Note("tick", {})]
    dialer.receive_data(listener.send_note("ünïcode-op", {"k": "✓"}))
    assert drain(dialer) == [Note("ünïcode-op", {"k": "✓"})]


def test_request_ids_increase(pair):
    dialer, listener = pair
    ids = [dialer.send_request("op")[0] for _ in range(5)]
    assert ids == sorted(set(ids)) and len(ids) == 5
    assert all(b > a for a, b in zip(ids, ids[1:], strict=False))
    # ids are per connection: the other side counts on its own
    assert listener.send_request("op")[0] == ids[0]


def test_many_messages_in_one_chunk_byte_by_byte(pair):
    dialer, listener = pair
    frames = []
    expected = []
    for i in range(5):
        rid, frame = dialer.send_request("op", {"i": i})
        frames.append(frame)
        expected.append(Request(rid, "op", {"i": i}))
    frames.append(dialer.send_note("done"))
    expected.append(Note("done", {}))
    got = []
    for byte in b"".join(frames):
        listener.receive_data(bytes([byte]))
        got += drain(listener)
    assert got == expected


MALFORMED_AFTER_READY = {
    "req-missing-id": {"t": "req", "op": "x", "args": {}},
    "req-id-str": {"t": "req", "id": "1", "op": "x", "args": {}},
    "req-id-bool": {"t": "req", "id": True, "op": "x", "args": {}},
    "req-id-float": {"t": "req", "id": 1.0, "op": "x", "args": {}},
    "req-missing-op": {"t": "req", "id": 1, "args": {}},
    "req-op-bytes": {"t": "req", "id": 1, "op": b"x", "args": {}},
    "req-args-list": {"t": "req", "id": 1, "op": "x", "args": [1, 2]},
    "req-args-nil": {"t": "req", "id": 1, "op": "x", "args": None},
    "rep-missing-id": {"t": "rep", "ok": True, "result": 1},
    "rep-id-bool": {"t": "rep", "id": False, "ok": True},
    "rep-missing-ok": {"t": "rep", "id": 1, "result": 1},
    "rep-ok-int": {"t": "rep", "id": 1, "ok": 1},
    "error-without-error": {"t": "rep", "id": 1, "ok": False},
    "error-without-code": {"t": "rep", "id": 1, "ok": False, "error": {"message": "m"}},
    "error-code-int": {"t": "rep", "id": 1, "ok": False, "error": {"code": 5, "message": "m"}},
    "error-without-message": {"t": "rep", "id": 1, "ok": False, "error": {"code": "c"}},
    "error-not-map": {"t": "rep", "id": 1, "ok": False, "error": "boom"},
    "item-missing-id": {"t": "item", "data": 1},
    "cancel-id-bool": {"t": "cancel", "id": True},
    "cancel-id-nil": {"t": "cancel", "id": None},
    "note-missing-op": {"t": "note", "args": {}},
    "note-args-str": {"t": "note", "op": "x", "args": "a=1"},
    "unknown-t": {"t": "explode", "id": 1},
    "no-t": {"id": 1, "op": "x"},
    "t-int": {"t": 3},
    "hello-again": {"t": "hello", "v": PROTOCOL_VERSION, "node": "x", "role": "client", "nonce": b"N" * 16},
    "auth-again": {"t": "auth", "proof": b"\x00" * 32},
}


@pytest.mark.parametrize("message", MALFORMED_AFTER_READY.values(), ids=MALFORMED_AFTER_READY.keys())
def test_malformed_message_closes_connection(pair, message):
    dialer, listener = pair
    for conn in (listener, dialer):
        conn.receive_data(raw_frame(message))
        with pytest.raises(ProtocolError) as info:
            conn.next_event()
        assert info.value.code == "malformed"
        assert conn.state is State.CLOSED
        (bye,) = decode_all(conn.data_to_send())
        assert bye["t"] == "bye" and bye["code"] == "malformed"
        # nothing further is processed, and nothing more can be sent
        conn.receive_data(encode_frame({"t": "note", "op": "ok", "args": {}}))
        assert conn.next_event() is None
        with pytest.raises(ProtocolError):
            conn.send_note("x")


def test_valid_messages_before_a_malformed_one_are_delivered(pair):
    dialer, listener = pair
    good = dialer.send_note("first")
    listener.receive_data(good + raw_frame({"t": "req", "id": True, "op": "x"}) + dialer.send_note("never"))
    assert listener.next_event() == Note("first", {})
    with pytest.raises(ProtocolError):
        listener.next_event()
    assert listener.next_event() is None


def test_undecodable_frame_after_ready_closes_connection(pair):
    dialer, listener = pair
    listener.receive_data(raw_frame([1, 2, 3]))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "malformed"
    assert listener.state is State.CLOSED
    listener.receive_data(dialer.send_note("x"))
    assert listener.next_event() is None


def test_sending_before_ready_raises():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    senders = [
        lambda c: c.send_request("op"),
        lambda c: c.send_reply(1, None),
        lambda c: c.send_error(1, "e", "m"),
        lambda c: c.send_item(1, b"x"),
        lambda c: c.send_cancel(1),
        lambda c: c.send_note("op"),
    ]
    deliver(dialer, listener)
    assert listener.state is State.AUTH  # half-way is still not ready
    for conn in (dialer, listener):
        for send in senders:
            with pytest.raises(ProtocolError) as info:
                send(conn)
            assert info.value.code == "not_ready"
    # no request id was used up by the failed attempts
    dialer_events, _ = handshake(dialer, listener)
    assert dialer_events == [Ready(Role.PEER, "node02")]
    assert dialer.send_request("op")[0] == 1


def test_send_bye_round_trip(pair):
    dialer, listener = pair
    listener.receive_data(dialer.send_bye("shutdown", "daemon stopping"))
    assert dialer.state is State.CLOSED
    assert drain(listener) == [RemoteClosed("shutdown", "daemon stopping")]
    assert listener.state is State.CLOSED


def test_oversized_send_refused():
    dialer = Connection(dialer=True, node="n1", max_frame=1024)
    listener = Connection(dialer=False, node="n2", max_frame=1024)
    handshake(dialer, listener)
    with pytest.raises(ProtocolError) as info:
        listener.send_reply(1, b"x" * 2000)
    assert info.value.code == "oversized"
    assert listener.state is State.READY  # our own refusal does not close the connection
    listener.send_reply(1, b"x" * 900)


# ================================================================ connection fuzzing

FIELD_NAMES = ["t", "id", "op", "args", "ok", "error", "nonce", "proof", "v", "node", "role",
               "result", "data", "code", "message", "win", "n"]
TYPE_NAMES = ["hello", "auth", "req", "rep", "item", "cancel", "credit", "note", "bye", "bogus"]

interesting_values = st.one_of(
    st.sampled_from(TYPE_NAMES),
    st.sampled_from(["client", "peer", "admin", ""]),
    st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0, True, False, 1.0, -1, 2**64 - 1, 1, 2**40, 2**40 + 1]),
    st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE),
    st.binary(min_size=32, max_size=32),
    st.fixed_dictionaries({}, optional={"code": msgpack_values, "message": msgpack_values}),
    msgpack_values,
)

fuzz_messages = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=4) | st.binary(max_size=2),
    interesting_values,
    max_size=8,
)
# A message that is at least shaped like one: a known type plus random fields.
typed_messages = st.builds(lambda t, rest: {**rest, "t": t}, st.sampled_from(TYPE_NAMES), fuzz_messages)

fuzz_pieces = st.one_of(
    typed_messages.map(raw_frame),
    fuzz_messages.map(raw_frame),
    msgpack_values.map(raw_frame),
    st.binary(max_size=24),
    st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
)


def _fresh_connection(kind: str, max_frame: int) -> tuple[Connection, bool]:
    """Return (connection, whether only a valid HMAC proof could make it Ready as a peer)."""
    if kind in ("listener-auth", "ready-peer"):
        max_frame = max(max_frame, 128)  # a peer hello (nonce + proof) needs ~90 bytes
    if kind == "listener":
        return Connection(dialer=False, node="beta", max_frame=max_frame), False
    if kind == "listener-secret":
        return Connection(dialer=False, node="beta", secret=SECRET, max_frame=max_frame), True
    if kind == "listener-auth":
        conn = Connection(dialer=False, node="beta", secret=SECRET, max_frame=max_frame)
        conn.receive_data(raw_frame(hand_made_hello()))
        assert conn.next_event() is None and conn.state is State.AUTH
        conn.data_to_send()
        return conn, True
    if kind == "dialer-client":
        conn = Connection(dialer=True, node="alpha", max_frame=max_frame)
        conn.data_to_send()
        return conn, False
    if kind == "dialer-peer":
        conn = Connection(dialer=True, node="alpha", role=Role.PEER, secret=SECRET, max_frame=max_frame)
        conn.data_to_send()
        return conn, True
    # already through the handshake
    role = Role.PEER if kind == "ready-peer" else Role.CLIENT
    dialer = Connection(dialer=True, node="alpha", role=role, secret=SECRET, max_frame=max_frame)
    listener = Connection(dialer=False, node="beta", secret=SECRET, max_frame=max_frame)
    handshake(dialer, listener)
    assert listener.state is State.READY
    return listener, False


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(
        ["listener", "listener-secret", "listener-auth", "dialer-client", "dialer-peer", "ready-client", "ready-peer"]
    ),
    max_frame=st.sampled_from([64, 256, DEFAULT_MAX_FRAME]),
    pieces=st.lists(fuzz_pieces, min_size=1, max_size=6),
    data=st.data(),
    eof=st.booleans(),
)
def test_connection_fuzz_only_raises_protocol_error(kind, max_frame, pieces, data, eof):
    conn, needs_proof = _fresh_connection(kind, max_frame)
    stream = b"".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    bounds = [0, *cuts, len(stream)]
    failed = False
    for a, b in zip(bounds, bounds[1:], strict=False):
        conn.receive_data(stream[a:b])
        try:
            while (event := conn.next_event()) is not None:
                assert isinstance(event, EVENT_TYPES)
                if isinstance(event, Ready):
                    assert conn.state is State.READY
                    # nobody can forge an HMAC: fuzz input never authenticates a peer
                    assert not (needs_proof and event.role is Role.PEER)
                if isinstance(event, RemoteClosed):
                    assert isinstance(event.code, str) and isinstance(event.message, str)
                    assert conn.state is State.CLOSED
        except ProtocolError as exc:
            assert isinstance(exc.code, str) and exc.code
            assert conn.state is State.CLOSED
            assert conn.next_event() is None
            failed = True
        # whatever the machine queued to send is well-framed within its own limit
        for message in decode_all(conn.data_to_send(), max_frame=conn.max_frame):
            assert isinstance(message.get("t"), str)
        if failed:
            break
    if eof:
        try:
            conn.receive_eof()
        except ProtocolError as exc:
            assert exc.code == "truncated"
        assert conn.state is State.CLOSED


# ================================================================ bounds (protocol version 2)

from gangd.protocol import (  # noqa: E402
    DEFAULT_WINDOW,
    HANDSHAKE_MAX_FRAME,
    MAX_CREDIT,
    Credit,
)


def _header(length: int) -> bytes:
    return struct.pack(">I", length)


@pytest.mark.parametrize("accept", [frozenset({Role.CLIENT}), frozenset({Role.PEER}), frozenset(Role)])
def test_listener_refuses_a_large_frame_before_the_handshake_from_its_header_alone(accept):
    listener = Connection(dialer=False, node="node02", secret=SECRET, accept=accept)
    listener.receive_data(_header(DEFAULT_MAX_FRAME))  # 16 MiB announced, nothing of it sent
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "oversized" and str(HANDSHAKE_MAX_FRAME) in info.value.message
    assert listener.state is State.CLOSED
    (bye,) = decode_all(listener.data_to_send())
    assert bye["t"] == "bye" and bye["code"] == "oversized"


def test_handshake_frame_limit_boundary():
    listener = Connection(dialer=False, node="node02")
    hello = {"t": "hello", "v": PROTOCOL_VERSION, "role": "client", "node": "x", "pad": b""}
    base = len(raw_frame(hello)) - 4
    hello["pad"] = b"\x00" * (HANDSHAKE_MAX_FRAME - base - 1)  # msgpack bin header grows by one byte here
    frame = raw_frame(hello)
    assert len(frame) - 4 <= HANDSHAKE_MAX_FRAME
    listener.receive_data(frame)
    assert isinstance(drain(listener)[0], Ready)


def test_peer_listener_keeps_the_small_limit_until_the_dialer_authenticated():
    dialer = Connection(dialer=True, node="node01", role=Role.PEER, secret=SECRET)
    listener = Connection(dialer=False, node="node02", secret=SECRET)
    listener.receive_data(dialer.data_to_send())
    assert drain(listener) == []
    assert listener.state is State.AUTH
    listener.receive_data(_header(HANDSHAKE_MAX_FRAME + 1))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "oversized"


def test_dialer_refuses_a_large_frame_in_place_of_the_hello():
    dialer = Connection(dialer=True, node="node01", role=Role.CLIENT)
    dialer.receive_data(_header(HANDSHAKE_MAX_FRAME + 1))
    with pytest.raises(ProtocolError) as info:
        dialer.next_event()
    assert info.value.code == "oversized"


def test_large_frames_are_accepted_once_ready(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("put", {"blob": b"\x00" * (4 * HANDSHAKE_MAX_FRAME)})
    listener.receive_data(frame)
    (request,) = drain(listener)
    assert request.id == rid and len(request.args["blob"]) == 4 * HANDSHAKE_MAX_FRAME


def test_a_version_1_hello_is_refused_saying_both_versions():
    listener = Connection(dialer=False, node="node02")
    listener.receive_data(raw_frame({"t": "hello", "v": 1, "role": "client", "node": "old"}))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "version_mismatch"
    (bye,) = decode_all(listener.data_to_send())
    assert "version 1" in bye["message"] and f"speaks {PROTOCOL_VERSION}" in bye["message"]


# ---------------------------------------------------------------- flow control


def test_requests_carry_their_window(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", window=1234)
    (message,) = decode_all(frame)
    assert message["win"] == 1234
    listener.receive_data(frame)
    drain(listener)
    assert listener.item_credit(rid) == 1234
    _, frame = dialer.send_request("tail")
    assert decode_all(frame)[0]["win"] == DEFAULT_WINDOW


@pytest.mark.parametrize("window", [-1, MAX_CREDIT + 1])
def test_send_request_refuses_a_window_out_of_range(pair, window):
    with pytest.raises(ValueError):
        pair[0].send_request("tail", window=window)


def test_server_sends_items_only_while_it_has_credit(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", window=100)
    listener.receive_data(frame)
    drain(listener)
    sent = []
    while listener.item_credit(rid) > 0:
        sent.append(listener.send_item(rid, b"x" * 30))
    size = len(sent[0])
    assert len(sent) == -(-100 // size)  # the last one may overshoot the window, by less than a frame
    assert listener.item_credit(rid) == 100 - sum(map(len, sent))
    with pytest.raises(ProtocolError) as info:
        listener.send_item(rid, b"more")
    assert info.value.code == "no_credit"
    dialer.receive_data(b"".join(sent))
    items = drain(dialer)
    assert [i.size for i in items] == [len(f) for f in sent]
    # The consumer took them: credit comes back and the server may go on.
    listener.receive_data(dialer.send_credit(rid, sum(i.size for i in items)))
    assert drain(listener) == [Credit(rid, sum(map(len, sent)))]
    assert listener.item_credit(rid) == 100 - sum(map(len, sent)) + sum(map(len, sent))
    listener.send_item(rid, b"more")


def test_an_item_beyond_the_credit_is_a_protocol_violation(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", window=10)
    listener.receive_data(frame)
    drain(listener)
    dialer.receive_data(listener.send_item(rid, b"x" * 20))  # overshoots: allowed once
    assert len(drain(dialer)) == 1
    dialer.receive_data(raw_frame({"t": "item", "id": rid, "data": b"y"}))  # a server ignoring credit
    with pytest.raises(ProtocolError) as info:
        dialer.next_event()
    assert info.value.code == "flow_control"
    assert dialer.state is State.CLOSED
    (bye,) = decode_all(dialer.data_to_send())
    assert bye["code"] == "flow_control"


def test_a_zero_window_request_gets_no_items_until_credit(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", window=0)
    listener.receive_data(frame)
    drain(listener)
    assert listener.item_credit(rid) == 0
    with pytest.raises(ProtocolError):
        listener.send_item(rid, 1)
    listener.receive_data(dialer.send_credit(rid, 1))
    drain(listener)
    dialer.receive_data(listener.send_item(rid, 1))
    assert drain(dialer) == [Item(rid, 1)]


def test_items_and_replies_for_requests_never_made_are_refused(pair):
    for message in ({"t": "item", "id": 99, "data": 1}, {"t": "rep", "id": 99, "ok": True}):
        conn = Connection(dialer=False, node="x")
        conn.receive_data(raw_frame({"t": "hello", "v": PROTOCOL_VERSION, "role": "client", "node": "y"}))
        drain(conn)
        conn.receive_data(raw_frame(message))
        with pytest.raises(ProtocolError) as info:
            conn.next_event()
        assert info.value.code == "malformed"


def test_a_second_reply_to_one_request_is_refused(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("x")
    listener.receive_data(frame)
    drain(listener)
    dialer.receive_data(listener.send_reply(rid, 1))
    assert drain(dialer) == [Reply(rid, True, 1)]
    dialer.receive_data(raw_frame({"t": "rep", "id": rid, "ok": True}))
    with pytest.raises(ProtocolError):
        dialer.next_event()


def test_credit_after_the_reply_is_ignored_on_both_sides(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail")
    listener.receive_data(frame)
    drain(listener)
    grant = dialer.send_credit(rid, 10)  # crosses the reply on the wire
    dialer.receive_data(listener.send_reply(rid))
    drain(dialer)
    listener.receive_data(grant)
    assert drain(listener) == []
    assert dialer.send_credit(rid, 10) == b""
    assert not listener.serving(rid)


@pytest.mark.parametrize(
    "message",
    [
        {"t": "credit", "id": 1, "n": 0},
        {"t": "credit", "id": 1, "n": -5},
        {"t": "credit", "id": 1, "n": MAX_CREDIT + 1},
        {"t": "credit", "id": 1},
        {"t": "credit", "n": 5},
        {"t": "credit", "id": 1, "n": True},
        {"t": "req", "id": 1, "op": "x", "args": {}},  # no window
        {"t": "req", "id": 1, "op": "x", "args": {}, "win": -1},
        {"t": "req", "id": 1, "op": "x", "args": {}, "win": MAX_CREDIT + 1},
        {"t": "req", "id": 1, "op": "x", "args": {}, "win": 1.5},
    ],
)
def test_malformed_credit_and_window_close_the_connection(pair, message):
    _, listener = pair
    listener.receive_data(raw_frame(message))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "malformed"


def test_credit_accumulates_up_to_a_cap(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("tail", window=MAX_CREDIT)
    listener.receive_data(frame)
    drain(listener)
    for _ in range(3):
        listener.receive_data(raw_frame({"t": "credit", "id": rid, "n": MAX_CREDIT}))
        drain(listener)
    assert listener.item_credit(rid) == MAX_CREDIT


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    window=st.integers(1, 5000),
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=60),
    consume=st.lists(st.integers(0, 4), min_size=1, max_size=60),
)
def test_flow_control_bounds_what_the_requester_buffers(window, sizes, consume):
    """However the producer's items and the consumer's pace interleave, what the
    requester holds unconsumed never exceeds its window plus one frame, and
    every item gets through once the consumer reads."""
    dialer, listener = make_pair(Role.CLIENT)
    rid, frame = dialer.send_request("tail", window=window)
    listener.receive_data(frame)
    drain(listener)
    todo = list(sizes)
    buffered: list[Item] = []
    got = 0
    largest = max(len(encode_frame({"t": "item", "id": rid, "data": b"x" * s})) for s in sizes)
    step = 0
    while todo or buffered:
        while todo and listener.item_credit(rid) > 0:
            dialer.receive_data(listener.send_item(rid, b"x" * todo.pop(0)))
        for event in drain(dialer):
            buffered.append(event)
        assert sum(i.size for i in buffered) <= window + largest
        take = consume[step % len(consume)] or (1 if not todo or listener.item_credit(rid) <= 0 else 0)
        step += 1
        taken, buffered = buffered[:take], buffered[take:]
        got += len(taken)
        grant = dialer.send_credit(rid, sum(i.size for i in taken))
        listener.receive_data(grant)
        drain(listener)
    assert got == len(sizes)


# ---------------------------------------------------------------- requests in flight


def test_requests_beyond_max_in_flight_are_answered_busy_by_the_machine():
    dialer = Connection(dialer=True, node="c", role=Role.CLIENT)
    listener = Connection(dialer=False, node="d", max_in_flight=3)
    deliver(dialer, listener)
    deliver(listener, dialer)
    frames = [dialer.send_request("wait") for _ in range(5)]
    listener.receive_data(b"".join(f for _, f in frames))
    served = drain(listener)
    assert [r.id for r in served] == [rid for rid, _ in frames[:3]]
    assert listener.in_flight == 3 and listener.refused_busy == 2
    replies = deliver(listener, dialer)
    assert [r.id for r in replies] == [rid for rid, _ in frames[3:]]
    assert all(not r.ok and r.error["code"] == "busy" and "in flight" in r.error["message"] for r in replies)
    # One answered: room for one more.
    dialer.receive_data(listener.send_reply(served[0].id))
    drain(dialer)
    assert listener.in_flight == 2
    rid, frame = dialer.send_request("wait")
    listener.receive_data(frame)
    assert drain(listener) == [Request(rid, "wait", {})]
    assert listener.in_flight == 3


def test_a_request_id_already_in_flight_is_a_protocol_violation(pair):
    _, listener = pair
    listener.receive_data(raw_frame({"t": "req", "id": 5, "op": "x", "args": {}, "win": 0}))
    assert len(drain(listener)) == 1
    listener.receive_data(raw_frame({"t": "req", "id": 5, "op": "y", "args": {}, "win": 0}))
    with pytest.raises(ProtocolError) as info:
        listener.next_event()
    assert info.value.code == "malformed"


def test_an_error_reply_ends_the_request_in_flight(pair):
    dialer, listener = pair
    rid, frame = dialer.send_request("x")
    listener.receive_data(frame)
    drain(listener)
    assert listener.serving(rid) and listener.in_flight == 1
    listener.send_error(rid, "nope", "no")
    assert not listener.serving(rid) and listener.in_flight == 0

