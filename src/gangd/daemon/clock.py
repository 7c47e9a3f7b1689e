"""The cluster's common time: each peer's clock offset, and waking at an instant.

Gang switches of the time-slice rotation are *announced ahead*: the
coordinator tells every node "switch at T" a little before T, and each node
acts when its own clock says T. The network fan-out then happens before the
switch instead of inside it, and the nodes switch together to within their
clocks' agreement, however many nodes there are (the idea of STORM's
strobes and of clock-driven co-scheduling).

That needs two things this module provides:

* :class:`OffsetFilter` — how far a peer's wall clock is from ours, from the
  heartbeats we already send. Each ping gives NTP's four timestamps (ours
  when it left and its answer came, the peer's when it came and its answer
  left), and with them a hard bound: the offset lies within half the time
  on the wire of that sample's estimate. The filter intersects the bounds
  of recent samples, and of the peer's own samples of us (each answer
  carries them), which is far tighter than any one sample on a loaded
  machine, where the two directions' delays differ by hundreds of
  microseconds. If the system's clock synchronisation (NTP, PTP) is
  consistent with every bound, the offset is taken as 0: we cannot measure
  better than it. If not, the middle of the intersection.
* :func:`sleep_until_wall` — act at a wall-clock instant, to the tens of
  microseconds. ``trio.sleep_until`` alone cannot: ``epoll_wait`` takes
  whole milliseconds, rounded up, so each node would wake up to 1 ms late,
  each by a different amount; and the event loop's own wake-up, cold after
  a slice of busy ranks, costs a few hundred microseconds more before the
  switch's first signal. So a ``timerfd`` (on CLOCK_MONOTONIC: the instant
  is converted once, and a wall-clock step meanwhile does not move it)
  wakes the event loop ``hold`` early, and the rest is slept with the loop
  held (``clock_nanosleep``), so at the instant the caller's next line runs.
  The daemon answers nothing during the hold: 2 ms per switch.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import deque
from collections.abc import Callable

import trio

#: Heartbeats whose bounds are intersected: the more, the tighter; few
#: enough (half a minute at the default 1 s interval) that the clocks'
#: drift within them stays negligible (and where it does not, the newest
#: samples win, see ``bounds``).
WINDOW = 32

#: An instant further ahead than this is a bug or a wild clock: act now.
MAX_WAIT = 1.0

#: How long before a switch's instant the event loop is given up (see above).
#: Enough for the wake-ups of every daemon on a loaded machine to be over;
#: measured with ``bench/switch.py``: 8 daemons on 2 CPUs need about 1 ms.
HOLD = 0.002


class OffsetFilter:
    """Estimates ``peer clock - our clock`` from request/reply timestamps.

    The bounds are worked out when a heartbeat brings a sample, not when
    they are read: the coordinator reads every node's offset at each switch."""

    def __init__(self, window: int = WINDOW):
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (low, high) bounds, oldest first
        self._theirs: tuple[float, float] | None = None  # the peer's bounds on ``our clock - its clock``
        self._ours: tuple[float, float] | None = None  # ours alone
        self._both: tuple[float, float] | None = None  # ours and theirs

    def add(self, sent: float, came: float, left: float, received: float) -> None:
        """Our wall clock when a request was ``sent`` and its answer ``received``;
        the peer's when the request ``came`` and the answer ``left``."""
        # The request took came - sent - offset >= 0 on the wire, the answer
        # received - left + offset >= 0.
        low, high = left - received, came - sent
        if low <= high and came <= left:  # else a clock stepped mid-request: the sample means nothing
            self._samples.append((low, high))
            self._update()

    def heard(self, theirs: object) -> None:
        """The peer's bounds on ``our clock - its clock`` (a pair, or None)."""
        if isinstance(theirs, (list, tuple)) and len(theirs) == 2 and all(isinstance(x, float) for x in theirs) and theirs[0] <= theirs[1]:
            self._theirs = (theirs[0], theirs[1])
        else:
            self._theirs = None
        self._update()

    def _update(self) -> None:
        newest_first = list(reversed(self._samples))
        self._ours = _intersect(newest_first)
        if self._theirs is not None:
            newest_first.insert(1, (-self._theirs[1], -self._theirs[0]))
        self._both = _intersect(newest_first)

    def bounds(self) -> tuple[float, float] | None:
        """The offsets every recent sample (ours and the peer's) allows, or None."""
        return self._both

    @property
    def ours(self) -> list[float] | None:
        """Our own bounds, to tell the peer (without theirs, which would come back to them)."""
        return None if self._ours is None else list(self._ours)

    @property
    def offset(self) -> float:
        """Best estimate in seconds: 0 while the clocks agree as far as we can
        measure (and until the first sample)."""
        found = self._both
        if found is None or found[0] <= 0 <= found[1]:
            return 0.0
        return (found[0] + found[1]) / 2

    @property
    def error(self) -> float | None:
        """Half the width of the bounds: how far off ``offset`` can be; None without samples."""
        found = self._both
        return None if found is None else (found[1] - found[0]) / 2


def _intersect(intervals: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The intersection of ``intervals``, newest first, until one disagrees
    (clocks drift: old samples give way); None for none."""
    if not intervals:
        return None
    low, high = intervals[0]
    for a, b in intervals[1:]:
        if max(low, a) > min(high, b):
            break
        low, high = max(low, a), min(high, b)
    return low, high


# ---------------------------------------------------------------- waking on time

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_FLAGS = os.O_CLOEXEC | os.O_NONBLOCK  # TFD_CLOEXEC and TFD_NONBLOCK share these values


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc_timerfd() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """(create, settime) from the C library, or None where there is no timerfd
    (Python 3.13 has ``os.timerfd_create``; 3.11 and 3.12 do not)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    return create, settime


_HAVE_OS_TIMERFD = sys.version_info >= (3, 13) and hasattr(os, "timerfd_create")  # os grew timerfd in 3.13
_TIMERFD = _libc_timerfd() if not _HAVE_OS_TIMERFD else None


def _arm(deadline: float) -> int | None:
    """A timerfd that becomes readable at monotonic ``deadline``, or None."""
    if sys.version_info >= (3, 13) and _HAVE_OS_TIMERFD:  # (the version test is for the type checker)
        fd = os.timerfd_create(time.CLOCK_MONOTONIC, flags=_TFD_FLAGS)
        os.timerfd_settime_ns(fd, flags=os.TFD_TIMER_ABSTIME, initial=int(deadline * 1e9))
        return fd
    if _TIMERFD is None:
        return None
    create, settime = _TIMERFD
    fd = create(_CLOCK_MONOTONIC, _TFD_FLAGS)
    if fd < 0:
        return None
    sec = int(deadline)
    spec = _Itimerspec(_Timespec(0, 0), _Timespec(sec, int((deadline - sec) * 1e9)))
    if settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
        os.close(fd)
        return None
    return fd


async def sleep_until_wall(at: float, *, hold: float = 0.0) -> None:
    """Return when this node's wall clock reads ``at`` (at once if it is past,
    after at most :data:`MAX_WAIT` whatever ``at`` says). The last ``hold``
    seconds block the event loop: the return is then not delayed by it."""
    delay = at - time.time()
    if not delay > 0:  # past, or not a number
        return
    delay = min(delay, MAX_WAIT)
    deadline = time.monotonic() + delay
    if delay > hold:
        fd = _arm(deadline - hold)
        if fd is None:
            await trio.sleep(delay - hold)
        else:
            try:
                await trio.lowlevel.wait_readable(fd)
            finally:
                os.close(fd)
    rest = deadline - time.monotonic()
    if rest > 0:
        time.sleep(rest)  # noqa: ASYNC251 -- clock_nanosleep: the loop is held on purpose, see above
