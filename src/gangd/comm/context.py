"""A rank's network context: its channel counters and the messages it received but did not deliver.

With the gate closed on every rank and every rank drained up to what its
peers sent, nothing is in flight: the contexts of all ranks are the whole
state of the job's network. A restarted job gets them back at attach, before
any rank may send, and continues as if the network had never stopped.

Layout (msgpack)::

    {"v": 1, "rank": R, "size": N, "sent": [N], "received": [N], "delivered": [N],
     "messages": [[src, tag, seq, kind, meta, payload], ...]}   # arrival order
"""

from __future__ import annotations

import msgpack

from . import wire
from .engine import Engine, Msg
from .errors import CommError

VERSION = 1


def capture(engine: Engine) -> bytes:
    """Serialise the engine's network state (lock held, everything drained)."""
    messages = []
    for msg in engine.queue:
        if not msg.done:
            raise CommError(f"a message from rank {msg.src} is still arriving: the network is not quiet")
        payload = bytes(msg.view) if msg.claimed else wire.payload_bytes(msg.payload)  # (claimed: it arrived in view)
        messages.append([msg.src, msg.tag, msg.seq, msg.kind, msg.meta, payload])
    return msgpack.packb(
        {
            "v": VERSION,
            "rank": engine.rank,
            "size": engine.size,
            "sent": list(engine.n_sent),
            "received": list(engine.n_recv),
            "delivered": list(engine.n_deliv),
            "messages": messages,
        },
        use_bin_type=True,
    )


def restore(engine: Engine, blob: bytes) -> None:
    """Load a captured context into a fresh engine (before anything was sent or received)."""
    try:
        context = msgpack.unpackb(blob, raw=False)
        version, rank, size = context["v"], context["rank"], context["size"]
        sent, received, delivered = context["sent"], context["received"], context["delivered"]
        raw_messages = context["messages"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CommError(f"the daemon sent an unreadable network context: {exc}") from None
    if version != VERSION:
        raise CommError(f"network context version {version} is not supported (this library reads version {VERSION})")
    if rank != engine.rank or size != engine.size:
        raise CommError(f"the daemon sent the network context of rank {rank} of {size} to rank {engine.rank} of {engine.size}")
    if not all(type(row) is list and len(row) == size and all(type(n) is int and n >= 0 for n in row) for row in (sent, received, delivered)):
        raise CommError("network context counters do not match the job size")
    engine.load(sent, received, delivered, undelivered_messages(raw_messages, size, received, delivered))


def undelivered_messages(raw_messages: list, size: int, received: list[int], delivered: list[int]) -> list[Msg]:
    """The context's undelivered messages, checked: each channel's, in
    arrival order, are increasing sequence numbers below what was received,
    as many as were received and not delivered. Not a run from ``delivered``
    on: a program that takes a message by tag (or source) before earlier
    ones leaves holes behind it."""
    messages = []
    last_seq = [-1] * size
    undelivered = [0] * size
    for entry in raw_messages:
        try:
            src, tag, seq, kind, meta, payload = entry
        except (TypeError, ValueError):
            raise CommError("network context holds a malformed message entry") from None
        if not (type(src) is int and 0 <= src < size and type(seq) is int and last_seq[src] < seq < received[src]):
            raise CommError(f"network context holds message {seq} from rank {src} out of order")
        last_seq[src] = seq
        undelivered[src] += 1
        messages.append(Msg(src, tag, seq, kind, meta, wire.materialize(kind, meta, payload, 0, len(payload)), len(payload)))
    if undelivered != [r - d for r, d in zip(received, delivered, strict=True)]:
        raise CommError("network context: undelivered messages do not add up to received - delivered")
    return messages
