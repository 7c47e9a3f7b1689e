"""The cluster's common time (gangd.daemon.clock), without daemons.

The offset filter is fed timestamps as two nodes with known clocks and
known wire delays would produce them, so every estimate can be checked
against the truth; sleep_until_wall runs on this machine's clocks.
"""

from __future__ import annotations

import time

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from gangd.daemon import clock
from gangd.daemon.clock import OffsetFilter


def ping(filt: OffsetFilter, *, offset: float, out: float, back: float, serve: float = 50e-6, at: float = 1000.0) -> None:
    """One heartbeat from us (wall clock ``at``) to a peer whose clock is
    ``offset`` ahead: ``out`` and ``back`` seconds on the wire, ``serve``
    spent in the peer."""
    sent = at
    came = sent + out + offset
    left = came + serve
    received = left - offset + back
    filt.add(sent, came, left, received)


def test_no_samples_means_no_offset_and_no_error_bound():
    filt = OffsetFilter()
    assert filt.offset == 0.0 and filt.error is None and filt.bounds() is None and filt.ours is None


def test_one_sample_bounds_the_offset_by_half_its_time_on_the_wire():
    filt = OffsetFilter()
    ping(filt, offset=0.005, out=300e-6, back=100e-6)
    low, high = filt.bounds()
    assert low <= 0.005 <= high
    assert high - low == pytest.approx(400e-6)  # the wire time both ways; the peer's own time left out
    assert filt.error == pytest.approx(200e-6)
    assert filt.offset == pytest.approx((low + high) / 2)


def test_an_offset_the_bounds_cannot_tell_from_zero_is_taken_as_zero():
    # Clocks kept in step by NTP or PTP (here: the same clock): no sample
    # ever excludes 0, so nothing is corrected, however lopsided the delays.
    filt = OffsetFilter()
    for i, (out, back) in enumerate([(900e-6, 100e-6), (150e-6, 700e-6), (2e-3, 1e-3)]):
        ping(filt, offset=0.0, out=out, back=back, at=1000.0 + i)
    assert filt.offset == 0.0
    assert filt.bounds()[0] <= 0 <= filt.bounds()[1]


def test_lopsided_delays_mislead_one_sample_but_the_intersection_of_many_does_not():
    # The heuristic "midpoint of the fastest sample" is off by half the
    # difference of the two directions; intersecting bounds is not.
    truth = 0.003
    filt = OffsetFilter()
    for i, (out, back) in enumerate([(800e-6, 50e-6), (60e-6, 900e-6), (400e-6, 400e-6), (70e-6, 60e-6)]):
        ping(filt, offset=truth, out=out, back=back, at=1000.0 + i)
    low, high = filt.bounds()
    assert low <= truth <= high and high - low <= 120e-6
    assert abs(filt.offset - truth) <= 60e-6


def test_the_peers_own_bounds_tighten_ours():
    truth = -0.002
    ours, theirs = OffsetFilter(), OffsetFilter()
    ping(ours, offset=truth, out=500e-6, back=40e-6)  # our pings: slow out
    ping(theirs, offset=-truth, out=500e-6, back=40e-6)  # theirs: slow out too, the other way
    alone = ours.bounds()
    ours.heard(theirs.ours)
    low, high = ours.bounds()
    assert low <= truth <= high
    assert high - low < alone[1] - alone[0]
    assert abs(ours.offset - truth) <= 60e-6


def test_when_old_samples_disagree_with_new_ones_the_new_ones_win():
    # A clock stepped (or drifted) between heartbeats: the intersection of
    # everything would be empty; the newest samples are what counts.
    filt = OffsetFilter()
    for i in range(5):
        ping(filt, offset=0.010, out=100e-6, back=100e-6, at=1000.0 + i)
    for i in range(3):
        ping(filt, offset=0.020, out=100e-6, back=100e-6, at=1010.0 + i)
    assert filt.offset == pytest.approx(0.020, abs=100e-6)


def test_a_sample_whose_clock_stepped_mid_request_is_ignored():
    filt = OffsetFilter()
    filt.add(sent=1000.0, came=999.0, left=999.0, received=999.5)  # answer came before the request left
    filt.add(sent=1000.0, came=1000.1, left=1000.0, received=1000.2)  # the peer answered before it was asked
    assert filt.bounds() is None and filt.offset == 0.0


@pytest.mark.parametrize("theirs", [None, "x", [1.0], [2.0, 1.0], [1, 2], {"low": 0}])
def test_nonsense_from_the_peer_is_ignored(theirs):
    filt = OffsetFilter()
    ping(filt, offset=0.004, out=100e-6, back=100e-6)
    alone = filt.bounds()
    filt.heard(theirs)
    assert filt.bounds() == alone


@given(
    truth=st.floats(-1.0, 1.0),
    delays=st.lists(st.tuples(st.floats(1e-6, 0.01), st.floats(1e-6, 0.01), st.floats(0, 0.001)), min_size=1, max_size=40),
)
def test_the_truth_is_always_within_the_bounds(truth, delays):
    filt = OffsetFilter()
    for i, (out, back, serve) in enumerate(delays):
        ping(filt, offset=truth, out=out, back=back, serve=serve, at=1000.0 + i)
    low, high = filt.bounds()
    assert low - 1e-9 <= truth <= high + 1e-9
    assert abs(filt.offset - truth) <= 2 * filt.error + 1e-9  # the estimate is within the bounds too


# ---------------------------------------------------------------- waking on time


@pytest.mark.parametrize("hold", [0.0, clock.HOLD])
def test_sleep_until_wall_never_returns_before_the_instant(hold):
    async def main():
        for ahead in (0.0005, 0.003, 0.02):
            at = time.time() + ahead
            await clock.sleep_until_wall(at, hold=hold)
            # The wall clock may be slewed by NTP against the monotonic one
            # the wait runs on: at most 500 ppm, a few microseconds here.
            assert time.time() >= at - 20e-6

    trio.run(main)


def test_an_instant_in_the_past_or_not_a_number_returns_at_once_and_one_far_ahead_is_capped():
    async def main():
        with trio.fail_after(1):
            await clock.sleep_until_wall(time.time() - 5)
            await clock.sleep_until_wall(float("nan"))
            await clock.sleep_until_wall(float("-inf"))
        t0 = time.monotonic()
        await clock.sleep_until_wall(time.time() + 3600)  # a wild clock must not hang a switch
        return time.monotonic() - t0

    waited = trio.run(main)
    assert clock.MAX_WAIT <= waited + 0.01 and waited < clock.MAX_WAIT + 1.0


def test_the_event_loop_runs_other_tasks_until_the_hold_begins():
    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.01)
            start = time.monotonic()
            await clock.sleep_until_wall(time.time() + 0.05, hold=0.005)
            nursery.cancel_scope.cancel()
        return [t - start for t in ticks if t >= start]

    during = trio.run(main)
    assert len([t for t in during if t < 0.04]) >= 5, during  # others ran while we waited
