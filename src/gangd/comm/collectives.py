"""Collectives over point-to-point messages, with reserved negative tags.

Every rank calls the same collectives in the same order (as in MPI), and
each channel is FIFO, so a tag per kind of collective (per round for the
barrier) is enough to keep consecutive collectives apart. The program's
``ANY`` tag never matches these tags.

All functions run with the engine's lock held and take and return what the
World methods do.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from . import wire
from .engine import Engine
from .errors import CommError

TAG_BARRIER = -100  # minus the round: -100, -101, ...
TAG_BCAST = -200
TAG_REDUCE = -300

#: op name -> (ufunc for arrays, function for Python numbers)
OPS: dict[str, tuple[np.ufunc, Callable[[Any, Any], Any]]] = {
    "sum": (np.add, operator.add),
    "prod": (np.multiply, operator.mul),
    "min": (np.minimum, min),
    "max": (np.maximum, max),
}

_EMPTY = b""


def barrier(engine: Engine) -> None:
    """Dissemination barrier: ceil(log2 n) rounds, in round k rank r signals r + 2^k."""
    rank, size = engine.rank, engine.size
    distance, round_ = 1, 0
    while distance < size:
        tag = TAG_BARRIER - round_
        engine.send((rank + distance) % size, tag, wire.BYTES, _EMPTY, _EMPTY, 0)
        engine.take((rank - distance) % size, tag)
        distance <<= 1
        round_ += 1


def bcast(engine: Engine, obj, root: int):
    """Binomial tree from ``root``; forwards the encoded message, so it is serialised once."""
    rank, size = engine.rank, engine.size
    if size == 1:
        return obj
    relative = (rank - root) % size
    if relative == 0:
        encoded = wire.encode(obj)
    mask = 1
    while mask < size:
        if relative & mask:
            msg = engine.take((relative - mask + root) % size, TAG_BCAST)
            encoded = (msg.kind, msg.meta, msg.payload, msg.nbytes)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if relative + mask < size:
            engine.send((relative + mask + root) % size, TAG_BCAST, encoded[0], encoded[1], encoded[2], encoded[3])
        mask >>= 1
    if relative == 0:
        return obj
    return wire.decode(encoded[0], encoded[1], encoded[2])


def allreduce(engine: Engine, value, op: str):
    """Reduce to rank 0 along a binomial tree, then broadcast the result.

    Only rank 0 combines the final values, in a fixed order, so every rank
    gets bit-identical results (recursive doubling would combine in a
    different order on each rank).
    """
    try:
        ufunc, pyfunc = OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(OPS)}") from None
    rank, size = engine.rank, engine.size
    is_array = type(value) is np.ndarray
    acc, owned = value, False
    mask = 1
    while mask < size:
        if rank & mask:
            kind, meta, payload, nbytes = wire.encode(acc)
            engine.send(rank - mask, TAG_REDUCE, kind, meta, payload, nbytes)
            break
        if rank + mask < size:
            msg = engine.take(rank + mask, TAG_REDUCE)
            other = wire.decode(msg.kind, msg.meta, msg.payload)
            if is_array:
                if type(other) is not np.ndarray or other.shape != acc.shape or other.dtype != acc.dtype:
                    raise CommError(f"allreduce: rank {rank + mask} contributed {_describe(other)} where rank {rank} has {_describe(acc)}")
                if not owned:  # into a new array (out= keeps 0-d arrays arrays, not scalars)
                    acc, owned = ufunc(acc, other, out=np.empty_like(acc)), True
                else:
                    ufunc(acc, other, out=acc)
            else:
                acc = pyfunc(acc, other)
        mask <<= 1
    result = bcast(engine, acc if rank == 0 else None, 0)
    if is_array and result is value:
        result = value.copy()  # never hand back the caller's own array as the result
    return result


def _describe(value) -> str:
    if type(value) is np.ndarray:
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"
