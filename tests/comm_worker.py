"""Rank programs for tests/test_comm_units.py: ``python comm_worker.py SCENARIO [ARGS...]``.

Each scenario is the code of one rank (it looks at its rank to know its
part). Lines the test waits for are printed and flushed as they happen; the
outcome is one ``RESULT {json}`` line. A scenario that finds a wrong result
raises, so the rank exits non-zero with the traceback on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from gangd import comm


def say(*words) -> None:
    print(*words, flush=True)


def result(**values) -> None:
    say("RESULT " + json.dumps(values))


def wait_stdin(word: str) -> None:
    line = sys.stdin.readline().strip()
    assert line == word, f"expected {word!r} on stdin, got {line!r}"


def same(got, expected) -> bool:
    """Equal values of the same type; arrays bit for bit (NaN, -0.0 included)."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, np.ndarray):
        if got.dtype != expected.dtype or got.shape != expected.shape:
            return False
        if expected.dtype.hasobject:
            return got.tolist() == expected.tolist()
        return np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes()
    return got == expected


SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------- ordering, exactly once


def message(src: int, dst: int, i: int):
    """The i-th message src sends dst: random kind and size (0 B .. 4 MiB), a tag 0..3."""
    rng = np.random.default_rng([src, dst, i])
    size = 0 if rng.random() < 0.1 else int(2 ** rng.uniform(0, 22))
    kind = int(rng.integers(5))
    tag = int(rng.integers(4))
    if kind == 0:
        obj = np.frombuffer(rng.bytes(size), np.uint8).copy()
    elif kind == 1:
        obj = rng.bytes(size)
    elif kind == 2:
        obj = rng.standard_normal(size // 8)
    elif kind == 3:
        obj = ("object", src, dst, i, rng.bytes(min(size, 1000)))
    else:
        obj = bytearray(rng.bytes(size))
    return obj, tag


@scenario
def ordering(count: str, linger: str = ""):
    count = int(count)
    w = comm.world()
    me, others = w.rank, [r for r in range(w.size) if r != w.rank]
    order = np.random.default_rng(me)
    for i in range(count):
        for dst in order.permutation(others):
            obj, tag = message(me, int(dst), i)
            w.send(obj, int(dst), tag)
    got = dict.fromkeys(others, 0)
    total = count * len(others)

    def check(obj, status):
        src = status.source
        expected, tag = message(src, me, got[src])
        assert status.tag == tag, (src, got[src], status.tag, tag)
        assert same(obj, expected), f"message {got[src]} from {src} differs"
        got[src] += 1

    if me % 2 == 0:  # ANY source, ANY tag: whatever arrived first
        for _ in range(total):
            check(*w.recv(comm.ANY, comm.ANY, status=True))
    else:  # one source at a time, round robin
        for _ in range(count):
            for src in others:
                check(*w.recv(source=src, status=True))
    w.barrier()
    result(received=got, counters=w.counters())
    if linger:  # stay attached until the test is done with our network
        wait_stdin("exit")


# ---------------------------------------------------------------- arrays and objects


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # mutable, compared by value: unhashable (what defining __eq__ alone already made it)


def cases() -> list:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((6, 5))
    structured = np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8")])
    structured["x"] = [1, 2, 3]
    return [
        a,
        a[::2, ::3],  # not contiguous
        a.T,  # Fortran order
        np.arange(24, dtype=">i4").reshape(2, 3, 4),  # big endian
        np.array([True, False, True]),
        (rng.standard_normal(7) + 1j * rng.standard_normal(7)).astype(np.complex64),
        np.arange(10).astype("datetime64[s]"),
        np.arange(5).astype("timedelta64[ms]"),
        np.linspace(0, 1, 9, dtype=np.float16),
        np.array(["ab", "cde"], dtype="<U3"),
        np.array([np.nan, -0.0, np.inf, -np.inf]),
        np.zeros((0, 4)),
        np.zeros((3, 0, 2), dtype=np.int16),
        np.array(3.5),  # 0-d
        np.frombuffer(b"\x00\x01" * 8, dtype=np.uint16),  # read-only
        rng.integers(0, 2**63, size=1 << 19, dtype=np.uint64),  # 4 MiB
        np.float64(2.0),  # numpy scalar: pickled
        np.array([1, "x", None], dtype=object),  # pickled
        structured,  # pickled
        {"a": [1, 2.5, None], "t": (1, "x")},
        Point(1, 2),
        b"",
        b"raw bytes",
        bytearray(b"abc"),
        "unicode \u00e9",
        2**100,
        None,
    ]


@scenario
def arrays():
    w = comm.world()
    peer = 1 - w.rank
    expected = cases()
    for obj in expected:  # both ranks send at once: the 4 MiB one needs the drain-while-sending
        w.send(obj, peer, tag=5)
    for i, want in enumerate(expected):
        got = w.recv(peer, 5)
        assert same(got, want), f"case {i}: got {got!r:.80} expected {want!r:.80}"
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
    if w.rank == 0:
        time.sleep(0.3)  # rank 1 is waiting in recv_into by now: the payload lands in its buffer
        w.send(big, 1, tag=1)
        w.send(np.arange(3, dtype=np.int32), 1, tag=2)
        w.send(np.arange(10.0), 1, tag=3)  # too big for the buffer rank 1 offers
        w.send({"pickled": True}, 1, tag=4)
        w.send(bytearray(b"0123456789"), 1, tag=6)
        time.sleep(0.2)  # rank 1 is waiting in recv_into again: a small message lands in its buffer too
        w.send(np.arange(5, dtype=np.int16), 1, tag=7)
        statuses = None
    else:
        into = np.empty_like(big)
        st1 = w.recv_into(into, 0, 1)
        assert same(into, big), "recv_into of 8 MiB"
        small = np.zeros(3, np.int32)
        st2 = w.recv_into(small, 0, 2)
        assert small.tolist() == [0, 1, 2]
        errors = []
        for tag in (3, 4):
            try:
                w.recv_into(np.empty(4), 0, tag)
            except comm.CommError as exc:
                errors.append(str(exc))
        assert np.array_equal(w.recv(0, 3), np.arange(10.0))  # still queued after the refusal
        assert w.recv(0, 4) == {"pickled": True}
        raw = bytearray(16)
        st3 = w.recv_into(memoryview(raw), 0, 6)
        assert raw[: st3.nbytes] == b"0123456789"
        five = np.zeros(8, np.int16)
        st4 = w.recv_into(five, 0, 7)
        assert five.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
        statuses = [[st.source, st.tag, st.nbytes] for st in (st1, st2, st3, st4)] + [errors]
    w.barrier()
    result(cases=len(expected), statuses=statuses)


# ---------------------------------------------------------------- large both ways


@scenario
def bidir():
    w = comm.world()
    peer = 1 - w.rank
    mine = np.full(4 << 20, w.rank + 1, dtype=np.float64)  # 32 MiB
    for i in range(3):
        w.send(mine, peer)
        w.send(i, peer)  # and a small one after it
        got = w.recv(peer)
        assert got.shape == mine.shape and bool((got == peer + 1).all())
        assert w.recv(peer) == i
    result(ok=True, gated=w._engine.gate_enabled)


# ---------------------------------------------------------------- collectives


def contribution(rank: int):
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal(1000), rng.integers(-50, 50, size=(4, 5)).astype(np.int32), rank + 1, 0.5 * rank


def digest(value) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}" + hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
    return repr(value)


@scenario
def collectives():
    w = comm.world()
    entered, left = [], []
    for _ in range(3):
        time.sleep(0.05 * w.rank)
        entered.append(time.monotonic())
        w.barrier()
        left.append(time.monotonic())
    bcasts = []
    for root in range(w.size):
        obj = {"root": root, "data": list(range(root + 3))} if w.rank == root else None
        bcasts.append(w.bcast(obj, root=root))
        arr = np.arange(5, dtype=np.int64) * root if w.rank == root else None
        got = w.bcast(arr, root=root)
        assert np.array_equal(got, np.arange(5) * root)
    floats, ints, n, x = contribution(w.rank)
    everyone = [contribution(r) for r in range(w.size)]
    out = {}
    for op in ("sum", "prod", "min", "max"):
        f = w.allreduce(floats, op)
        i = w.allreduce(ints, op)
        assert f.dtype == floats.dtype and f.shape == floats.shape and i.dtype == ints.dtype and i.shape == ints.shape
        assert f is not floats
        ref = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
        assert np.allclose(f, ref([c[0] for c in everyone], axis=0))
        assert np.array_equal(i, ref([c[1] for c in everyone], axis=0).astype(np.int32))
        out[op] = [digest(f), digest(i), w.allreduce(n, op), w.allreduce(x, op)]
    unchanged = np.array_equal(floats, contribution(w.rank)[0])
    # ANY tag skips collective messages: rank 0's bcast message reaches its children
    # before its user message, and their recv(ANY, ANY) must take the user message.
    if w.rank == 0:
        tree = w.bcast("tree", root=0)
        for r in range(1, w.size):
            w.send("user", r, tag=9)
        user = ["user", 0, 9]
    else:
        obj, st = w.recv(comm.ANY, comm.ANY, status=True)
        user = [obj, st.source, st.tag]
        tree = w.bcast(None, root=0)
    result(entered=entered, left=left, bcasts=bcasts, reductions=out, unchanged=unchanged, user=user, tree=tree)


# ---------------------------------------------------------------- gate


@scenario
def gate():
    w = comm.world()
    if w.rank == 0:
        say("sending")
        w.send(np.ones(4 << 20), 1)  # 32 MiB: stays under way until rank 1 reads
        say("sent1", time.monotonic())
        w.send(b"small", 1)  # the gate is closed by now: waits for it to open
        say("sent2", time.monotonic())
    else:
        say("ready")
        wait_stdin("recv")  # "computing" until the test says so: rank 0's send cannot finish
        say("receiving", time.monotonic())
        assert w.recv(0).shape == (4 << 20,)
        assert w.recv(0) == b"small"
        say("got2", time.monotonic())
    result(ok=True)


# ---------------------------------------------------------------- capture and restore


def capture_messages(src: int) -> list:
    """What rank ``src`` sends rank 1 in the capture scenario: (object, tag)."""
    rng = np.random.default_rng(src)
    return [
        (b"first", 0),
        (rng.standard_normal(1000), 1),
        ({"from": src, "list": [1, 2, 3]}, 2),
        (bytearray(b"ba" * 10), 3),
        (np.arange(7, dtype=np.int16), 4),
        # 6 MiB, last: may still be under way when the gate closes (sends after it would wait for the gate)
        (rng.integers(0, 255, size=6 << 20, dtype=np.uint8), 5),
    ]


@scenario
def capture(taken: str = "first"):
    """``taken``: ``first`` (rank 1 takes each sender's first message) or
    ``out-of-order`` (also rank 0's tag 4, before its tags 1-3: by tag, as MPI allows)."""
    w = comm.world()
    if w.rank == 1:
        assert w.recv(0) == b"first"
        assert w.recv(2) == b"first"
        if taken == "out-of-order":
            assert same(w.recv(0, tag=4), capture_messages(0)[4][0])
        say("ready")
        wait_stdin("exit")  # "computing": only the control thread reads the network now
    else:
        for obj, tag in capture_messages(w.rank):
            w.send(obj, 1, tag)
        say("sent")
        wait_stdin("exit")
    result(ok=True)


@scenario
def restored(taken: str = "first"):
    w = comm.world()
    if w.rank == 1:
        order = []
        pending = {0: capture_messages(0)[1:], 2: capture_messages(2)[1:]}
        if taken == "out-of-order":
            del pending[0][3]  # (tag 4, taken before the capture)
        for _ in range(sum(map(len, pending.values()))):
            obj, st = w.recv(status=True)
            want, tag = pending[st.source].pop(0)
            assert st.tag == tag and same(obj, want), (st, tag)
            order.append([st.source, st.tag])
        after = [w.recv(0), w.recv(2)]
        assert after == [b"after 0", b"after 2"], after
        result(order=order, counters=w.counters())
    else:
        w.send(f"after {w.rank}".encode(), 1)
        w.barrier()  # seq numbers continue from the restored counters on every channel
        result(counters=w.counters())
        return
    w.barrier()


# ---------------------------------------------------------------- peers that exit


@scenario
def peer_exit():
    w = comm.world()
    if w.rank == 2:
        time.sleep(0.3)
        sys.exit(3)  # never sent anything: only the daemon can tell rank 0
    if w.rank == 1:
        assert w.recv(0) == b"hello"
        w.send(b"bye", 0)
        os._exit(0)  # abruptly: no goodbye on any socket
    caught = {}

    def attempt(name, fn):
        try:
            fn()
        except comm.PeerExited as exc:
            caught[name] = [exc.rank, str(exc)]
        else:
            caught[name] = None

    start = time.monotonic()
    attempt("recv_from_2", lambda: w.recv(source=2))
    attempt("send_to_2", lambda: w.send(b"x", 2))
    w.send(b"hello", 1)
    assert w.recv(1) == b"bye"
    time.sleep(0.3)
    attempt("big_send_to_1", lambda: w.send(np.zeros(8 << 20), 1))
    attempt("send_again_to_1", lambda: w.send(b"x", 1))
    attempt("recv_any", w.recv)
    result(caught=caught, seconds=time.monotonic() - start)


# ---------------------------------------------------------------- strangers


@scenario
def wrong_token():
    w = comm.world()
    if w.rank == 0:
        say("ready")
        obj, st = w.recv(status=True)
        result(obj=obj.decode(), source=st.source, counters=w.counters())
    else:
        wait_stdin("go")
        w.send(b"legit", 0)
        result(ok=True)


@scenario
def attach_refused():
    try:
        comm.world()
    except comm.CommError as exc:
        result(error=str(exc), code=exc.code)


@scenario
def solo():
    w = comm.world()
    assert (w.rank, w.size) == (0, 1)
    w.send(np.arange(4.0), 0, tag=2)
    w.send({"x": 1}, 0)
    obj, st = w.recv(status=True)  # earliest arrived
    assert np.array_equal(obj, np.arange(4.0)) and (st.source, st.tag, st.nbytes) == (0, 2, 32)
    assert w.recv(0, 0) == {"x": 1}
    w.barrier()
    errors = []
    for bad in (lambda: w.send(1, 0, tag=-3), lambda: w.recv(tag=-5), lambda: w.send(1, 1)):
        try:
            bad()
        except ValueError as exc:
            errors.append(str(exc))
    try:
        w.recv()
    except comm.CommError as exc:
        errors.append(str(exc))
    arr = np.arange(3)
    total = w.allreduce(arr, "sum")
    result(
        bcast=w.bcast([1, 2]),
        allreduce=[total.tolist(), total is not arr, w.allreduce(2.5, "max")],
        errors=errors,
        counters=w.counters(),
    )
    w.close()
    try:
        w.send(1, 0)
    except comm.CommError as exc:
        say("closed:", exc)


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
