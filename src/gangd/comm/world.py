"""The program's view of its job's network: :class:`World` and :func:`world`."""

from __future__ import annotations

import atexit
import operator
import os
import threading
from typing import NamedTuple, Self, cast

from ..client.runtime import job_info
from . import collectives, context, wire
from .control import ControlThread, DaemonLink
from .engine import ANY, Engine
from .errors import CommError
from .wire import NDARRAY

MAX_TAG = 2**31 - 1  # tags travel as int32; negative ones belong to the collectives
#: How long a receive polls before it sleeps, in microseconds (GANGD_COMM_SPIN_US; 0: never).
#: Being woken up costs more than our whole handling of a small message; a
#: peer that answers within the spin is heard at once. 50 us covers the
#: turnaround of messages up to ~128 KiB; a rank that waits longer pays one
#: spin per receive.
DEFAULT_SPIN_US = 50


class Status(NamedTuple):
    """Where a received message came from: its source rank, tag and payload size in bytes."""

    source: int
    tag: int
    nbytes: int


_status = tuple.__new__  # builds a Status at half the cost of calling the class


class _ClosedEngine:
    """Stands in for the engine of a closed world: the first thing every call touches raises."""

    closed = True

    @property
    def lock(self):
        raise CommError("this world is closed")


def _user_tag(tag) -> int:
    try:
        tag = operator.index(tag)
    except TypeError:
        raise TypeError(f"tags are integers, not {type(tag).__name__}") from None
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag {tag}: tags are integers from 0 to {MAX_TAG} (negative tags are reserved for collectives)")
    return tag


class World:
    """All ranks of this job. ``rank`` is this process's number, ``size`` the number of ranks.

    Calls are meant for one thread at a time (like MPI_THREAD_SERIALIZED).
    """

    def __init__(self, engine: Engine, control: ControlThread | None = None):
        self._engine = engine
        self._control = control
        self.rank = engine.rank
        self.size = engine.size

    def __repr__(self) -> str:
        return f"<gangd.comm.World rank {self.rank} of {self.size}{' (closed)' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        return self._engine.closed

    # ------------------------------------------------------------ argument checks

    def _dest(self, dest) -> int:
        if type(dest) is not int:
            dest = operator.index(dest)
        if not 0 <= dest < self.size:
            raise ValueError(f"rank {dest} does not exist: this job has ranks 0 to {self.size - 1}")
        return dest

    def _source(self, source) -> int:
        if source == ANY:
            return ANY
        return self._dest(source)

    # ------------------------------------------------------------ point to point

    def send(self, obj, dest: int, tag: int = 0) -> None:
        """Send ``obj`` to rank ``dest``; returns once the message is entirely in the kernel's hands.

        numpy arrays (of plain dtypes) travel as raw bytes without copies,
        bytes and bytearray as is, anything else pickled.
        """
        engine = self._engine
        if type(tag) is not int or tag < 0 or tag > MAX_TAG:
            tag = _user_tag(tag)
        if type(dest) is not int or not 0 <= dest < self.size:
            dest = self._dest(dest)
        kind, meta, payload, nbytes = wire.encode(obj)
        with engine.lock:
            engine.send(dest, tag, kind, meta, payload, nbytes)

    def recv(self, source: int = ANY, tag: int = ANY, *, status: bool = False):
        """The next message from ``source`` with ``tag`` (either may be ``ANY``), waiting for it.

        With ``status=True`` returns ``(obj, Status)``. Messages of one sender
        arrive in the order it sent them; ``ANY`` source takes the earliest
        arrived. Raises :class:`PeerExited` when the awaited rank (for ``ANY``:
        every other rank) has exited and nothing queued matches.
        """
        engine = self._engine
        if tag != ANY and (type(tag) is not int or tag < 0 or tag > MAX_TAG):
            tag = _user_tag(tag)
        if source != ANY and (type(source) is not int or not 0 <= source < self.size):
            source = self._source(source)
        with engine.lock:
            msg = engine.take(source, tag)
        obj = msg.payload
        if msg.kind != NDARRAY:  # an array is its own payload: skip the call
            obj = wire.decode(msg.kind, msg.meta, obj)
        if status:
            return obj, _status(Status, (msg.src, msg.tag, msg.nbytes))
        return obj

    def recv_into(self, buf, source: int = ANY, tag: int = ANY) -> Status:
        """Receive the payload of an array, bytes or bytearray message into ``buf`` (any writable,
        C-contiguous buffer at least as large). A large message that is still to
        arrive is read straight into ``buf``; nothing is allocated."""
        engine = self._engine
        if tag != ANY and (type(tag) is not int or tag < 0 or tag > MAX_TAG):
            tag = _user_tag(tag)
        if source != ANY and (type(source) is not int or not 0 <= source < self.size):
            source = self._source(source)
        view = _writable_bytes(buf)
        with engine.lock:
            msg = engine.take_into(buf, view, source, tag)
        if not msg.claimed and msg.nbytes:
            view[: msg.nbytes] = wire.byte_view(msg.payload)
        return _status(Status, (msg.src, msg.tag, msg.nbytes))

    # ------------------------------------------------------------ collectives

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        engine = self._engine
        with engine.lock:
            collectives.barrier(engine)

    def bcast(self, obj=None, root: int = 0):
        """``obj`` of rank ``root``, on every rank (other ranks' ``obj`` is ignored)."""
        engine = self._engine
        root = self._dest(root)
        with engine.lock:
            return collectives.bcast(engine, obj, root)

    def allreduce(self, value, op: str = "sum"):
        """``value`` combined over all ranks with ``op`` (sum, prod, min, max), on every rank.

        Arrays combine elementwise into a new array of the same dtype and
        shape; every rank gets bit-identical results.
        """
        engine = self._engine
        if op not in collectives.OPS:
            raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(collectives.OPS)}")
        with engine.lock:
            return collectives.allreduce(engine, value, op)

    # ------------------------------------------------------------ state

    def counters(self) -> dict[str, list[int]]:
        """Messages per peer rank: sent to it, received from it, delivered to the program."""
        engine = self._engine
        with engine.lock:
            return {"sent": list(engine.n_sent), "received": list(engine.n_recv), "delivered": list(engine.n_deliv)}

    def close(self) -> None:
        """Leave the job's network: stop the control thread, close every socket. Idempotent."""
        engine = self._engine
        if engine.closed:
            return
        stopped = self._control.stop() if self._control is not None else True
        engine.close(threads_stopped=stopped)
        self._engine = cast(Engine, _ClosedEngine())  # stands in: the first thing any call touches raises

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _writable_bytes(buf) -> memoryview:
    try:
        view = wire.byte_view(buf)
    except (ValueError, TypeError):
        raise ValueError("recv_into needs a writable, C-contiguous buffer") from None
    if view.readonly or not view.c_contiguous:
        raise ValueError("recv_into needs a writable, C-contiguous buffer")
    return view


# ---------------------------------------------------------------- the process's world

_world: World | None = None
_world_lock = threading.Lock()


def world() -> World:
    """This process's world: under gangd, its job's ranks; otherwise a world of one rank.

    The first call joins the job's network (it returns once every rank of the
    job has called it); later calls return the same world.
    """
    global _world
    with _world_lock:
        if _world is None:
            _world = _create(os.environ)
            atexit.register(_world.close)
        elif _world.closed:
            raise CommError("this process's world was closed; a process joins its job's network once")
        return _world


_restored_alone: bytes | None = None  # a one-rank world's context, from a checkpoint (ckptlib, alone)


def alone_context() -> bytes | None:
    """A one-rank world's network context (its messages to itself not yet
    received), for ckptlib to save with a program running alone; None if no
    world exists or it runs under gangd (there the daemons save it)."""
    current = _world
    if current is None or current.closed or current.size != 1 or current._control is not None:
        return None
    engine = current._engine
    with engine.lock:
        return context.capture(engine)


def restore_alone_context(blob: bytes) -> None:
    """Give a program restarted alone its one-rank world's saved messages (before it sends any)."""
    global _restored_alone
    with _world_lock:
        if _world is None:
            _restored_alone = blob
            return
    with _world._engine.lock:
        context.restore(_world._engine, blob)


def _create(environ) -> World:
    global _restored_alone
    info = job_info(environ)
    if not info.under_gangd:
        engine = Engine(0, 1, None, gate=False)
        engine.start([{"node": None}], b"", {"open": True, "epoch": 0})
        if _restored_alone is not None:
            context.restore(engine, _restored_alone)
            _restored_alone = None
        return World(engine)
    comm_dir = environ.get("GANGD_COMM_DIR")
    if not comm_dir or not info.socket:
        raise CommError("GANGD_COMM_DIR or GANGD_SOCKET is not set: this gangd does not support gangd.comm")
    if not 0 <= info.rank < info.size:
        raise CommError(f"GANGD_RANK={info.rank} is not a rank of a job of GANGD_SIZE={info.size}")
    engine = Engine(
        info.rank,
        info.size,
        info.node,
        gate=environ.get("GANGD_COMM_GATE", "1") != "0",
        spin=float(environ.get("GANGD_COMM_SPIN_US", DEFAULT_SPIN_US)) * 1e-6,
    )
    link = None
    try:
        unix, tcp = engine.listen(comm_dir, environ.get("GANGD_ADDRESS") or "127.0.0.1")
        counters = os.path.join(comm_dir, f"rank-{info.rank}.counters")
        engine.map_counters(counters)
        link = DaemonLink(info.socket, f"job{info.job}.rank{info.rank}")
        reply = link.request("comm_attach", {"job": info.job, "rank": info.rank, "unix": unix, "tcp": tcp, "counters": counters})
        if not isinstance(reply, dict) or not isinstance(reply.get("peers"), list) or not reply.get("token"):
            raise CommError(f"gangd answered comm_attach with {reply!r:.200}")
        token = reply["token"]
        engine.start(reply["peers"], token.encode() if isinstance(token, str) else bytes(token), reply.get("gate") or {})
        if reply.get("context") is not None:
            context.restore(engine, bytes(reply["context"]))
    except BaseException:
        if link is not None:
            link.close()
        engine.close()
        raise
    control = ControlThread(engine, link)
    control.start()
    return World(engine, control)
