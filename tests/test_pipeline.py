"""The stage pipeline (gangd.pipeline, issue 18's groundwork, paper 004) on real threads and real files.

* order and completeness: hypothesis-generated item sizes and settings, the
  writer's landing table in submission order, every byte where it says;
* a zlib "compress" stage (the codec layer is not merged yet) writes a file
  bit-identical to a plain serial compress-then-write, and the mirror
  pipeline (read -> decompress -> place) restores the arrays exactly;
* aggregation boundaries: items equal to, larger than and far smaller than
  a buffer; every write but the last is a whole buffer;
* failure: a stage raising midway, a corrupt input under the decompressor,
  hostile landing tables, a real full file system (a 1 MiB tmpfs) -- each
  ends with every thread joined, every buffer Empty and an error naming the
  stage; the caller cancelling or leaving the block early likewise;
* back-pressure: a writer that does not drain holds the caller to the pool;
* parallel stages (several compress workers): the order survives random
  worker timing, the file is the serial one's byte for byte, and a worker
  failing while the others are busy aborts the whole pipeline cleanly.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import zlib
from collections.abc import Hashable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import tmpfs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd.pipeline import Pipeline, PipelineCancelled, PipelineError, Place, ReadRanges, Settings, SettingsError, Stage, Transform, Write
from gangd.pipeline.emit import Packer
from gangd.pipeline.ring import State

KIB = 1024
SMALL = Settings(buffer_count=2, buffer_size=4 * KIB, aggregate_bytes=8 * KIB)


def payload(seed: int, size: int) -> bytes:
    """Deterministic bytes that compress somewhat (a repeated pattern with noise)."""
    pattern = bytes((seed * 7 + i * 13) % 251 for i in range(97))
    noise = os.urandom(max(1, size // 16))
    body = (pattern * (size // len(pattern) + 1))[:size]
    return bytes(b ^ (noise[i % len(noise)] if i % 5 == 0 else 0) for i, b in enumerate(body)) if size < 65536 else body


def compress(key: Hashable, data: memoryview) -> bytes:
    return zlib.compress(data, 1)


def identity(key: Hashable, data: memoryview) -> bytes:
    return bytes(data)


def assert_torn_down(pipe: Pipeline) -> None:
    """No thread of the pipeline alive, every buffer of every ring Empty with no records."""
    assert pipe.threads_alive() == 0
    assert not [t for t in threading.enumerate() if t.name.startswith(f"{pipe.name}:")]
    assert pipe.buffers_in_use() == 0
    for ring in pipe.rings:
        assert all(slot.state is State.EMPTY and not slot.records and slot.used == 0 for slot in ring.slots)
        assert ring.peak <= len(ring.slots)


def write_pipeline(path: Path, items: list[tuple[Hashable, bytes]], stages_before: list[Stage], config: Settings, **kw):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with Pipeline([*stages_before, Write(fd, **kw)], config) as pipe:
            for key, data in items:
                pipe.submit(key, data)
            landing = pipe.finish()
    finally:
        os.close(fd)
    assert_torn_down(pipe)
    return landing, pipe


class Collect(Stage):
    """A last stage that keeps what it got, in order."""

    def __init__(self, name: str = "collect"):
        super().__init__(name)
        self.result: list[tuple[Hashable, bytes]] = []

    def process(self, key: Hashable, data: memoryview, out: Packer | None) -> None:
        self.result.append((key, bytes(data)))


# ---------------------------------------------------------------------------------------------------- order

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.one_of(st.integers(0, 64), st.integers(0, 20 * KIB)), max_size=60),
       count=st.integers(2, 4), buffer_kib=st.sampled_from([4, 8]), aggregate_kib=st.sampled_from([4, 8, 12]))
def test_every_item_lands_once_in_submission_order(tmp_path, sizes, count, buffer_kib, aggregate_kib):
    config = Settings(buffer_count=count, buffer_size=buffer_kib * KIB, aggregate_bytes=aggregate_kib * KIB)
    items = [(("block", i), os.urandom(n)) for i, n in enumerate(sizes)]
    landing, _ = write_pipeline(tmp_path / "out", items, [Transform("copy", identity)], config)
    assert [key for key, _, _ in landing.entries] == [key for key, _ in items]
    blob = (tmp_path / "out").read_bytes()
    assert blob == b"".join(data for _, data in items)
    offset = 0
    for (_key, data), (_, at, length) in zip(items, landing.entries, strict=True):
        assert (at, length) == (offset, len(data))
        offset += len(data)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 10 * KIB), max_size=50), drop=st.integers(2, 5))
def test_transforms_that_drop_and_fan_out_keep_the_order(sizes, drop):
    """A hash-and-compare stage drops some items, a splitter emits two per item: the last stage sees them in order."""
    items = [(i, os.urandom(n)) for i, n in enumerate(sizes)]

    def changed(key, data):
        return None if key % drop == 0 else bytes(data)

    def halves(key, data):
        return ((key, 0), data[:len(data) // 2]), ((key, 1), data[len(data) // 2:])

    with Pipeline([Transform("compare", changed), Transform("split", halves, many=True), Collect()], SMALL) as pipe:
        for key, data in items:
            pipe.submit(key, data)
        got = pipe.finish()
    assert_torn_down(pipe)
    want = [((k, h), part) for k, d in items if k % drop for h, part in enumerate((d[:len(d) // 2], d[len(d) // 2:]))]
    assert got == want
    compare, split = pipe.stats()[1:3]
    assert (compare.items_in, compare.items_out, split.items_out) == (len(items), len(want) // 2, len(want))


# ---------------------------------------------------------------------------------------------------- bit-identical

def test_a_zlib_pipeline_writes_the_same_file_as_serial_compress_then_write(tmp_path):
    sizes = [0, 1, 100, 4 * KIB, 4 * KIB + 1, 70 * KIB, 300 * KIB, 17, 1 * KIB * KIB, 5]
    items = [(i, payload(i, n)) for i, n in enumerate(sizes)]
    serial = b"".join(zlib.compress(data, 1) for _, data in items)
    config = Settings(buffer_count=3, buffer_size=64 * KIB, aggregate_bytes=256 * KIB)
    landing, pipe = write_pipeline(tmp_path / "piped", items, [Transform("compress", compress)], config, offset=4096, fsync=True)
    blob = (tmp_path / "piped").read_bytes()
    assert blob[:4096] == bytes(4096)  # the writer starts at the offset it was given (a header goes there)
    assert blob[4096:] == serial
    for (key, data), (landed_key, at, length) in zip(items, landing.entries, strict=True):
        assert landed_key == key
        assert zlib.decompress(blob[at:at + length]) == data
    submit, comp, write = pipe.stats()
    assert submit.bytes_out == comp.bytes_in == sum(sizes)
    assert comp.bytes_out == write.bytes_in == landing.size == len(serial)
    assert all(s.busy_s >= 0 and s.wall_s >= s.idle_in_s + s.idle_out_s - 1e-9 for s in pipe.stats()[1:])


def test_the_mirror_pipeline_restores_the_arrays_bit_identical(tmp_path):
    """write: compress -> aggregate -> write; restart: read -> decompress -> place, items in shuffled file order."""
    sizes = [3 * KIB, 0, 9 * KIB, 40 * KIB, 1, 12 * KIB]
    items = [(("v", i), payload(i, n)) for i, n in enumerate(sizes)]
    landing, _ = write_pipeline(tmp_path / "gen", items, [Transform("compress", compress)], SMALL)
    where, offset = {}, 0
    for key, data in items:
        where[key] = (offset, len(data))
        offset += len(data)

    def decompress(key, data):
        inflater = zlib.decompressobj()
        out = inflater.decompress(data, where[key][1] + 1)  # never more than one byte past what is expected
        if not inflater.eof:
            raise zlib.error(f"{key}: truncated or longer than recorded")
        return out

    target = bytearray(offset)
    fd = os.open(tmp_path / "gen", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        ranges = list(reversed(landing.entries))
        with Pipeline([ReadRanges(fd, ranges), Transform("decompress", decompress), Place(memoryview(target), where)], SMALL) as pipe:
            placed = pipe.finish()
    finally:
        os.close(fd)
    assert_torn_down(pipe)
    assert placed == offset
    assert bytes(target) == b"".join(data for _, data in items)


def test_a_writer_without_offsets_streams_into_a_pipe():
    """``Write(fd, offset=None)`` uses write(2) at the fd's position: a pipe (or socket) gets the same bytes, in order."""
    items = [(i, os.urandom(i * 311 % 9000)) for i in range(120)]
    reader, writer = os.pipe()
    received = bytearray()

    def drain():
        while chunk := os.read(reader, 65536):
            received.extend(chunk)

    thread = threading.Thread(target=drain)
    thread.start()
    try:
        with Pipeline([Transform("copy", identity), Write(writer, offset=None)], SMALL) as pipe:
            for key, data in items:
                pipe.submit(key, data)
            landing = pipe.finish()
    finally:
        os.close(writer)
        thread.join()
        os.close(reader)
    assert bytes(received) == b"".join(d for _, d in items)
    assert [(k, at) for k, at, _ in landing.entries] == [(k, sum(len(d) for _, d in items[:i])) for i, (k, _) in enumerate(items)]
    assert_torn_down(pipe)


# ---------------------------------------------------------------------------------------------------- aggregation

@pytest.mark.parametrize(("sizes", "what"), [
    ([8 * KIB] * 3, "items exactly one aggregate buffer"),
    ([20 * KIB, 3, 8 * KIB - 3, 40 * KIB + 7], "items larger than a buffer, cut across several"),
    ([3] * 5000 + [0] * 50 + [1] * 7, "many tiny items (and empty ones)"),
    ([8 * KIB - 1, 2, 8 * KIB - 1], "items that straddle a boundary by one byte"),
])
def test_writes_are_whole_aggregate_buffers(tmp_path, sizes, what):
    items = [(i, os.urandom(n)) for i, n in enumerate(sizes)]
    landing, _pipe = write_pipeline(tmp_path / "out", items, [Transform("copy", identity)], SMALL)
    total = sum(sizes)
    assert landing.size == total
    assert landing.writes == -(-total // SMALL.aggregate_bytes)  # one write per whole buffer, the last one partial
    assert (tmp_path / "out").read_bytes() == b"".join(d for _, d in items)
    assert [(at, n) for _, at, n in landing.entries] == [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]


def test_an_item_larger_than_a_buffer_passes_between_transforms_by_reference():
    big = memoryview(os.urandom(100 * KIB))  # 25 buffers of 4 KiB: it travels uncut, in a buffer of its own
    seen = []

    def look(key, data):
        seen.append((key, len(data), data.obj is big.obj if key == "big" else None))
        return data

    with Pipeline([Transform("look", look), Collect()], SMALL) as pipe:
        pipe.submit("small", b"x" * 10)
        pipe.submit("big", big)
        pipe.submit("after", b"y" * 10)
        got = pipe.finish()
    assert seen == [("small", 10, None), ("big", len(big), True), ("after", 10, None)]
    assert got == [("small", b"x" * 10), ("big", bytes(big)), ("after", b"y" * 10)]
    assert_torn_down(pipe)


def test_arrays_are_items_and_strided_views_are_refused():
    """A contiguous numpy array is submitted as its bytes; a strided view cannot be written as one run and is refused."""
    small, large = np.arange(100, dtype=np.float64), np.arange(4096, dtype=np.int32).reshape(64, 64)
    with Pipeline([Transform("copy", identity), Collect()], SMALL) as pipe:
        pipe.submit("small", small)
        pipe.submit("large", large)  # 16 KiB, more than a 4 KiB buffer: by reference
        with pytest.raises((TypeError, ValueError)):
            pipe.submit("strided", large[:, ::2])
    assert pipe.result == [("small", small.tobytes()), ("large", large.tobytes())]
    assert_torn_down(pipe)


# ---------------------------------------------------------------------------------------------------- failures

def test_a_stage_raising_midway_stops_every_stage_and_names_itself(tmp_path):
    class Broken(Exception):
        pass

    def compress_then_fail(key, data):
        if key == 57:
            raise Broken("codec state corrupted")
        return zlib.compress(data, 1)

    items = [(i, os.urandom(3 * KIB)) for i in range(200)]
    with pytest.raises(PipelineError) as caught:
        write_pipeline(tmp_path / "out", items, [Transform("copy", identity), Transform("compress", compress_then_fail)], SMALL)
    assert caught.value.stage == "compress"
    assert "compress" in str(caught.value) and "codec state corrupted" in str(caught.value)
    assert isinstance(caught.value.__cause__, Broken)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline:")]


def test_a_corrupt_item_under_the_decompressor_fails_the_restore(tmp_path):
    items = [(i, payload(i, 6 * KIB)) for i in range(6)]
    landing, _ = write_pipeline(tmp_path / "gen", items, [Transform("compress", compress)], SMALL)
    _, at, length = landing.entries[3]
    with open(tmp_path / "gen", "r+b") as f:
        f.seek(at + length // 2)
        f.write(b"\xff" * 8)
    where = {i: (i * 6 * KIB, 6 * KIB) for i in range(6)}
    fd = os.open(tmp_path / "gen", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        pipe = Pipeline([ReadRanges(fd, landing.entries), Transform("decompress", lambda k, d: zlib.decompress(d)),
                         Place(memoryview(bytearray(36 * KIB)), where)], SMALL)
        with pytest.raises(PipelineError) as caught, pipe:
            pipe.finish()
    finally:
        os.close(fd)
    assert caught.value.stage == "decompress" and isinstance(caught.value.__cause__, zlib.error)
    assert_torn_down(pipe)


@pytest.mark.parametrize(("where", "ranges", "stage", "says"), [
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (1, 10, 10), (1, 10, 10)], "place", "arrived twice"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (1, 10, 9)], "place", "9 bytes, 10 expected"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (7, 10, 10)], "place", "no place"),
    ({0: (0, 10), 1: (15, 10)}, [(0, 0, 10), (1, 10, 10)], "place", "outside the target"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10)], "place", "1 of 2 items never arrived"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (1, 30, 10)], "read", "past the end of the file (32 bytes)"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (1, 0, 2**40)], "read", "past the end of the file"),
    ({0: (0, 10), 1: (10, 10)}, [(0, 0, 10), (1, -1, 10)], "read", "negative range"),
])
def test_a_hostile_landing_table_is_refused_by_the_restore(tmp_path, where, ranges, stage, says):
    (tmp_path / "gen").write_bytes(bytes(range(32)))
    fd = os.open(tmp_path / "gen", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        pipe = Pipeline([ReadRanges(fd, ranges), Place(memoryview(bytearray(20)), where)], SMALL)
        with pytest.raises(PipelineError) as caught, pipe:
            pipe.finish()
    finally:
        os.close(fd)
    assert caught.value.stage == stage and says in str(caught.value)
    assert_torn_down(pipe)


def test_a_range_inside_a_huge_sparse_file_is_refused_before_it_is_allocated(tmp_path):
    """The file's size bounds nothing a user wants bounded: a sparse file of 1 TiB costs its owner
    no disk, and an index naming all of it as one item must not become a 1 TiB read buffer."""
    with open(tmp_path / "gen", "wb") as f:
        f.write(bytes(range(32)))
        f.truncate(2**40 + 32)
    fd = os.open(tmp_path / "gen", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        pipe = Pipeline([ReadRanges(fd, [(0, 0, 10), (1, 32, 2**40)]), Place(memoryview(bytearray(20)), {0: (0, 10), 1: (10, 10)})], SMALL)
        with pytest.raises(PipelineError) as caught, pipe:
            pipe.finish()
    finally:
        os.close(fd)
    assert caught.value.stage == "read" and "larger than" in str(caught.value), caught.value
    assert_torn_down(pipe)


def feed_until_it_fails(path, compress_fn, config, items):
    """(pipe, the PipelineError raised, items submitted) of a parallel compress -> write pipeline into
    ``path`` fed ``items`` until a stage fails (the test fails if none does)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    submitted = 0
    try:
        pipe = Pipeline([Transform("compress", compress_fn, parallel=True), Write(fd, fsync=True)], config)
        with pytest.raises(PipelineError) as caught, pipe:
            for key, data in items:
                pipe.submit(key, data)
                submitted += 1
            pipe.finish()
    finally:
        os.close(fd)
    return pipe, caught, submitted


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB file system (tmpfs), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    with tmpfs(mount, "1m", "0700"):
        yield mount


@pytest.mark.root
@pytest.mark.parametrize("workers", [1, 3])
def test_a_full_disk_under_the_writer_aborts_the_pipeline_cleanly(tiny_fs, workers):
    items = [(i, os.urandom(64 * KIB)) for i in range(64)]  # 4 MiB of incompressible data into 1 MiB
    config = Settings(buffer_count=2, buffer_size=64 * KIB, aggregate_bytes=256 * KIB, workers=workers)
    pipe, caught, submitted = feed_until_it_fails(tiny_fs / "gen", compress, config, items)
    assert caught.value.stage == "write" and caught.value.errno == errno.ENOSPC
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert submitted < len(items)  # the caller was stopped at its next submit, not left to feed a dead pipeline
    assert_torn_down(pipe)


def test_cancel_from_another_thread_unblocks_a_caller_held_by_back_pressure(tmp_path):
    gate = threading.Event()

    class Stuck(Stage):
        def process(self, key, data, out):
            gate.wait()

    pipe = Pipeline([Transform("copy", identity), Stuck("sink")], SMALL)
    cancelled = threading.Event()

    def canceller():
        while not pipe.rings[0].producer_waiting:  # the caller is held by back-pressure
            threading.Event().wait(0.01)
        pipe.cancel()
        cancelled.set()
        gate.set()

    with pytest.raises(PipelineCancelled) as caught, pipe:
        helper = threading.Thread(target=canceller)
        helper.start()
        for i in range(10000):
            pipe.submit(i, b"z" * KIB)
        pipe.finish()
    helper.join()
    assert cancelled.is_set() and caught.value.stage == "caller"
    assert_torn_down(pipe)


def test_leaving_the_block_normally_finishes_the_pipeline(tmp_path):
    items = [(i, os.urandom(5 * KIB)) for i in range(40)]
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        with Pipeline([Transform("copy", identity), Write(fd)], SMALL) as pipe:
            for key, data in items:
                pipe.submit(key, data)
    finally:
        os.close(fd)
    assert_torn_down(pipe)
    assert (tmp_path / "out").read_bytes() == b"".join(d for _, d in items)
    assert [k for k, _, _ in pipe.result.entries] == list(range(40))


def test_leaving_the_block_early_tears_the_pipeline_down():
    pipe = Pipeline([Transform("copy", identity), Collect()], SMALL)
    with pytest.raises(KeyError), pipe:
        pipe.submit(0, b"a" * 100)
        raise KeyError("the caller's own failure")
    assert_torn_down(pipe)
    with pytest.raises(RuntimeError):
        pipe.submit(1, b"b")


# ---------------------------------------------------------------------------------------------------- parallel stages

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 12 * KIB), max_size=40), delays=st.lists(st.sampled_from([0, 0, 1, 3]), min_size=1, max_size=40),
       workers=st.integers(2, 4), count=st.integers(2, 4))
def test_parallel_workers_hand_on_in_submission_order_whatever_their_timing(tmp_path, sizes, delays, workers, count):
    """Workers that finish out of order (random per-item delays) still feed the writer in order: the file is
    byte for byte what one thread writes, and the mirror pipeline (parallel decompress) restores every item."""
    config = Settings(buffer_count=count, buffer_size=8 * KIB, aggregate_bytes=8 * KIB, workers=workers)
    items = [(i, payload(i, n)) for i, n in enumerate(sizes)]

    def jittery(key, data):
        time.sleep(delays[key % len(delays)] / 1000)
        return zlib.compress(data, 1)

    landing, pipe = write_pipeline(tmp_path / "parallel", items, [Transform("compress", jittery, parallel=True)], config)
    serial, _ = write_pipeline(tmp_path / "serial", items, [Transform("compress", compress)], replace(config, workers=1))
    assert landing.entries == serial.entries and [k for k, _, _ in landing.entries] == [k for k, _ in items]
    assert (tmp_path / "parallel").read_bytes() == (tmp_path / "serial").read_bytes()
    stage = pipe.stats()[1]
    assert (stage.name, stage.workers, stage.items_in, stage.items_out) == ("compress", workers, len(items), len(items))
    total = sum(len(d) for _, d in items)
    where, at = {}, 0
    for key, data in items:
        where[key] = (at, len(data))
        at += len(data)
    target = bytearray(total)
    fd = os.open(tmp_path / "parallel", os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with Pipeline([ReadRanges(fd, landing.entries), Transform("decompress", lambda k, d: zlib.decompress(d), parallel=True),
                       Place(memoryview(target), where)], config) as back:
            assert back.finish() == total
    finally:
        os.close(fd)
    assert_torn_down(back)
    assert bytes(target) == b"".join(d for _, d in items)


@pytest.mark.parametrize("workers", [2, 4])
def test_a_worker_failing_while_the_others_are_busy_aborts_the_pipeline_cleanly(tmp_path, workers):
    """One compress worker raises while the others are inside their codec calls: the error names the stage,
    the caller is stopped at its next submit, every worker and stage thread is joined, every buffer Empty."""
    class Broken(Exception):
        pass

    failing = threading.Event()
    busy = threading.Semaphore(0)

    def compress_or_fail(key, data):
        if key == 0:
            for _ in range(workers - 1):  # the others are in their calls (or the caller has nothing more to give them)
                busy.acquire(timeout=5)
            failing.set()
            raise Broken("codec state corrupted")
        busy.release()
        failing.wait(5)
        time.sleep(0.01)  # still busy when the failure is raised
        return zlib.compress(data, 1)

    config = Settings(buffer_count=2, buffer_size=4 * KIB, aggregate_bytes=8 * KIB, workers=workers)
    items = [(i, payload(i, 3 * KIB)) for i in range(400)]
    pipe, caught, submitted = feed_until_it_fails(tmp_path / "out", compress_or_fail, config, items)
    assert caught.value.stage == "compress" and isinstance(caught.value.__cause__, Broken)
    assert submitted < len(items)
    assert_torn_down(pipe)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline:")]


def test_a_parallel_stage_with_one_worker_is_the_single_thread_stage():
    items = [(i, payload(i, 2 * KIB)) for i in range(30)]
    with Pipeline([Transform("compress", compress, parallel=True), Collect()], replace(SMALL, workers=1)) as pipe:
        for key, data in items:
            pipe.submit(key, data)
        got = pipe.finish()
    assert got == [(k, zlib.compress(d, 1)) for k, d in items]
    assert pipe.stats()[1].workers == 1 and len(pipe.rings[0].slots) == SMALL.buffer_count


# ---------------------------------------------------------------------------------------------------- back-pressure

@pytest.mark.parametrize("count", [2, 3, 8])
def test_a_writer_that_does_not_drain_holds_the_caller_to_the_pool(count):
    """However many items the caller has, no more than the pool's bytes are ever between it and the writer."""
    config = Settings(buffer_count=count, buffer_size=4 * KIB, aggregate_bytes=8 * KIB)
    gate = threading.Event()
    consumed = [0]
    submitted = [0]
    worst = [0]

    class SlowWriter(Stage):
        whole_buffers = True

        def process(self, key, data, out):
            gate.wait()
            consumed[0] += len(data)
            worst[0] = max(worst[0], submitted[0] - consumed[0])

    pipe = Pipeline([Transform("copy", identity), SlowWriter("write")], config)
    pool = sum(len(ring.slots) * ring.capacity for ring in pipe.rings)
    item = 1000

    def release_when_held():
        while not pipe.rings[0].producer_waiting:  # the caller is held by back-pressure
            threading.Event().wait(0.01)
        worst[0] = max(worst[0], submitted[0] - consumed[0])
        gate.set()

    helper = threading.Thread(target=release_when_held)
    with pipe:
        helper.start()
        for i in range(2000):  # 2 MB through a pool of 24..96 KiB
            pipe.submit(i, bytes([i % 256]) * item)
            submitted[0] += item
        pipe.finish()
    helper.join()
    assert consumed[0] == 2000 * item
    assert 0 < worst[0] <= pool + item
    assert_torn_down(pipe)


# ---------------------------------------------------------------------------------------------------- settings

def test_settings_defaults_and_bounds():
    default = Settings()
    assert default.aggregate_bytes >= 4 * 1024 * KIB and default.buffer_count >= 2
    for bad in ({"buffer_count": 1}, {"buffer_count": 10**6}, {"buffer_size": 100}, {"aggregate_bytes": 2**40},
                {"buffer_count": True}, {"buffer_size": 4096.0}, {"buffer_count": 256, "aggregate_bytes": 256 * 1024 * KIB},
                {"block": 4}, {"workers": 0}, {"workers": 65}, {"workers": 2.0}):
        with pytest.raises(SettingsError):
            Settings.from_mapping(bad)
    assert Settings.from_mapping({"buffer_count": 8}) == Settings(buffer_count=8)
    assert 1 <= default.workers <= 4 and Settings(buffer_count=2, workers=4).parallel_count == 6
