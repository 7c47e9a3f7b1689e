"""Issue 17, lib21: what ckptlib costs a program that takes no checkpoint, and a dense adaptive checkpoint's cost.

* Start-up: ``import gangd.ckptlib`` and ``ckpt.init()`` (alone, or the
  daemon agent's module) load neither the writer nor the block format nor
  the dtype recipes (pickletools, regular expressions): a rank pays for them
  at its first checkpoint or restore (bench/ckpt.py Table 2), and alone
  without ``every`` no thread runs behind the program.
* Dense changes: when a sample shows nearly every block changed, adaptive
  writes a full whose signature is hashed after its blocks are written (while
  the disk writes them), not in a pass before the write; the result is a
  signed full that the next generation diffs against, restored bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gangd import ckptstore, directio
from gangd.ckptlib import blocks

LAZY = ("gangd.ckptlib.blocks", "gangd.ckptlib.writer", "gangd.ckptlib.dtypes", "pickletools", "gangd.checkpoint.messages", "gangd.checkpoint.rank")


def _fresh(code: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ckptlib_loads_no_writer_until_a_checkpoint(tmp_path):
    got = _fresh(
        "import json, sys, threading\n"
        "from gangd import ckptlib as ckpt\n"
        "import gangd.ckptlib.agent\n"
        f"cp = ckpt.init(directory={str(tmp_path / 'ck')!r}, background=False)\n"
        "u = ckpt.protect('u', lambda: list(range(10)))\n"
        "for i in ckpt.loop(range(4)):\n"
        "    if i == 1:\n"
        f"        before = [m for m in {LAZY!r} if m in sys.modules]\n"
        "        threads = threading.active_count()\n"
        "        ckpt.request()  # saved at the next boundary (2)\n"
        "    u[i] += 1\n"
        f"after = [m for m in {LAZY[:2]!r} if m in sys.modules]\n"
        "ckpt.fini()\n"
        "print(json.dumps({'before': before, 'threads': threads, 'after': after}))\n",
        tmp_path,
    )
    assert got["before"] == [], f"loaded before any checkpoint: {got['before']}"
    assert got["threads"] == 1, "a program alone without every= runs no thread behind its back"
    assert got["after"] == list(LAZY[:2]), "the first checkpoint loads the writer and the block format"
    # ... and that checkpoint restores.
    again = _fresh(
        "import json\n"
        "from gangd import ckptlib as ckpt\n"
        f"ckpt.init(directory={str(tmp_path / 'ck')!r}, restart='latest')\n"
        "u = ckpt.protect('u', lambda: None)\n"
        "print(json.dumps({'u': u}))\n",
        tmp_path,
    )
    assert again["u"] == [1, 2, *range(2, 10)]


# ---------------------------------------------------------------- dense changes


def _state(mib: float, seed: int = 0) -> dict:
    return {"u": np.random.default_rng(seed).random(int(mib * (1 << 20)) // 8), "stats": {"step": 0}}


def _link(gen: int, path: Path, result: dict) -> dict:
    return {"gen": gen, "path": str(path), "expect": [result["size"], result["digest"]]}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cached"])
def test_dense_adaptive_fulls_are_hashed_while_or_after_their_blocks_are_written_and_every_other_one_not_at_all(tmp_path, monkeypatch, direct):
    """No pass over the state before its write: through the page cache the blocks are hashed once
    they are written (the copy is fast, the disk works meanwhile); written around it (at the disk's
    pace) by a thread of their own while the blocks are written."""
    monkeypatch.setenv(directio.ENV, "1" if direct else "0")
    state = _state(32)
    real = blocks.hash_blocks
    seen: dict[int, list[int]] = {}
    threads: dict[int, set[str]] = {}
    gen = 0

    def spy(data, block):  # the temporary file's size when the blocks are hashed, and the thread hashing them
        tmp = tmp_path / f".g{gen}.tmp"
        seen.setdefault(gen, []).append(tmp.stat().st_size if tmp.exists() else -1)
        threads.setdefault(gen, set()).add(threading.current_thread().name)
        return real(data, block)

    def hashed_as_designed(g: int) -> bool:
        return threads[g] == {"gangd-ckpt-sign"} if direct else min(seen[g]) >= state["u"].nbytes

    monkeypatch.setattr(blocks, "hash_blocks", spy)
    results: dict[int, dict] = {}

    def save(g: int, parent: int | None) -> blocks.Index:
        nonlocal gen
        gen = g
        offered = [] if parent is None else [_link(parent, tmp_path / f"g{parent}", results[parent])]
        results[g] = blocks.save_generation(tmp_path / f"g{g}", state, gen=g, mode="adaptive", offered=offered)
        r = results[g]
        h = ckptstore.hasher()  # the whole file checksummed, the deferred index included
        h.update((tmp_path / f"g{g}").read_bytes())
        assert h.hexdigest() == r["digest"] and (tmp_path / f"g{g}").stat().st_size == r["size"]
        return blocks.read_index(tmp_path / f"g{g}", (r["size"], r["digest"]))

    first = save(1, None)  # nothing to diff against: a full, signed after its blocks are written
    assert first.role == "full" and first.signed and hashed_as_designed(1), (seen, threads)
    state["u"] += 1.0  # every block changes
    second = save(2, 1)  # dense after a full: a full, not signed (only the sample was hashed, not the blocks)
    assert second.role == "full" and not second.signed and 2 not in seen, seen
    state["u"] += 1.0
    third = save(3, 2)  # the parent is unsigned: a signed full, hashed after its blocks are written
    assert third.role == "full" and third.signed and hashed_as_designed(3), (seen, threads)
    entry = third.entry("u")
    assert entry is not None and entry.signature is not None
    assert np.array_equal(entry.signature, real(memoryview(state["u"]).cast("B"), third.block))
    state["u"][:1000] = -1.0  # sparse: a delta against the signed full
    fourth = save(4, 3)
    assert fourth.role != "full" and fourth.parent == 3 and results[4]["size"] < state["u"].nbytes // 10
    for g, chain in ((2, []), (3, []), (4, [_link(3, tmp_path / "g3", results[3])])):
        values, _, _ = blocks.read_chain(tmp_path / f"g{g}", chain, (results[g]["size"], results[g]["digest"]))
        assert values["stats"] == {"step": 0}
    assert np.array_equal(values["u"], state["u"])


def test_the_dense_sample_is_not_fooled_by_a_regular_sparse_pattern(tmp_path):
    state = _state(16, seed=1)
    parent = blocks.save_generation(tmp_path / "g1", state, gen=1, mode="adaptive")
    ref = blocks.read_index(tmp_path / "g1", (parent["size"], parent["digest"]))
    block_floats = blocks.DEFAULT_BLOCK // 8
    u = state["u"].reshape(-1, block_floats)
    u[::20, 0] += 1.0  # one block in 20 changed: every 20th, a stride a regular sample would alias with
    assert not blocks.looks_dense(blocks.plan(state), (ref, ref))
    u[:, 0] += 1.0  # every block changed
    assert blocks.looks_dense(blocks.plan(state), (ref, ref))
    small = {"u": np.zeros(100)}
    assert not blocks.looks_dense(blocks.plan(small), (ref,)), "a small state is hashed whole at once"


@pytest.mark.parametrize("mode", ["incremental", "differential", "adaptive"])
def test_dense_then_sparse_generations_restore_in_every_mode(tmp_path, mode):
    """Generations alternating dense and sparse changes, each restored from its chain, bit-identical."""
    rng = np.random.default_rng(7)
    state = _state(18, seed=3)
    written: list[tuple[Path, dict]] = []
    kept = []
    for gen in range(1, 9):
        if gen % 3 == 0:
            state["u"] += 0.5
        else:
            state["u"][rng.integers(0, len(state["u"]), 50)] = gen
        state["stats"]["step"] = gen
        path = tmp_path / f"g{gen}"
        offered = []
        if written:
            last_path, last = written[-1]
            offered = [_link(gen - 1, last_path, last)] + [
                _link(g, written[g - 1][0], written[g - 1][1]) for g in last["links"]]
        result = blocks.save_generation(path, state, gen=gen, mode=mode, offered=offered, chain_max=4)
        written.append((path, result))
        kept.append(state["u"].copy())
        if gen % 3 == 0:
            assert result["role"] == "full"
    for gen, (path, result) in enumerate(written, 1):
        chain = [_link(g, written[g - 1][0], written[g - 1][1]) for g in result["links"]]
        values, _, _ = blocks.read_chain(path, chain, (result["size"], result["digest"]))
        assert np.array_equal(values["u"], kept[gen - 1]), f"generation {gen} ({result['role']})"
        assert values["stats"] == {"step": gen}


def test_a_deferred_chunk_is_written_in_place_and_checksummed(tmp_path):
    calls = []

    def later(fd):
        calls.append(os.fstat(fd).st_size)
        return [b"tail"]

    size, digest = ckptstore.write_atomic(tmp_path / "f", [b"head-", later, b"-end"])
    assert (tmp_path / "f").read_bytes() == b"head-tail-end" and size == 13
    assert calls == [5], "called once, after what precedes it was written"
    h = ckptstore.hasher()
    h.update(b"head-tail-end")
    assert digest == h.hexdigest()


def test_many_small_buffers_and_early_writeback_write_the_same_file(tmp_path):
    """A delta's file is hundreds of block runs: they go out batched (writev) and pushed to the disk as
    they are copied (``kick``); the file and its checksum are those of the buffers in order, a deferred
    chunk in its place."""
    rng = np.random.default_rng(7)
    parts = [rng.bytes(int(n)) for n in rng.integers(1, 40_000, 1500)]  # ~29 MiB in 1500 pieces, > IOV per call
    mid = len(parts) // 2
    seen = []

    def later(fd):
        seen.append(os.fstat(fd).st_size)
        return [b"index", b"footer"]

    size, digest = ckptstore.write_atomic(tmp_path / "f", [*parts[:mid], later, *parts[mid:]], kick=1 << 20)
    expect = b"".join(parts[:mid]) + b"indexfooter" + b"".join(parts[mid:])
    assert (tmp_path / "f").read_bytes() == expect and size == len(expect)
    assert seen == [len(b"".join(parts[:mid]))], "the deferred chunk is called once everything before it is written"
    h = ckptstore.hasher()
    h.update(expect)
    assert digest == h.hexdigest()


def test_a_delta_against_a_plain_array_does_not_load_the_dtype_recipes(tmp_path):
    """A forked writer reads its parent's index to diff against it: for plain numeric arrays it decodes
    their dtype without :mod:`gangd.ckptlib.dtypes` (pickletools, regular expressions), which each
    writer would otherwise load again, per checkpoint."""
    got = _fresh(
        "import json, sys\n"
        "import numpy as np\n"
        "from gangd.ckptlib import blocks\n"
        "v = {'u': np.arange(300_000, dtype=np.float64), 'n': np.zeros(5000, dtype='>i4'), 'b': np.ones(9000, dtype=bool)}\n"
        f"r0 = blocks.save_generation({str(tmp_path / 'g0')!r}, v, gen=0, mode='adaptive')\n"
        "v['u'][:10] = -1\n"
        "before = 'gangd.ckptlib.dtypes' in sys.modules\n"
        f"r1 = blocks.save_generation({str(tmp_path / 'g1')!r}, v, gen=1, mode='adaptive',\n"
        f"                            offered=[(0, {str(tmp_path / 'g0')!r}, (r0['size'], r0['digest']))])\n"
        "after = 'gangd.ckptlib.dtypes' in sys.modules\n"
        f"back, _, _ = blocks.read_chain({str(tmp_path / 'g1')!r}, [(0, {str(tmp_path / 'g0')!r})])\n"
        "same = all(np.array_equal(back[k], v[k]) and back[k].dtype == v[k].dtype for k in v)\n"
        "print(json.dumps({'before': before, 'after': after, 'role': r1['role'], 'same': same}))\n",
        tmp_path,
    )
    assert got["role"] != "full" and got["same"], got
    assert not got["before"] and not got["after"], "the dtype recipes were loaded for plain arrays"


def test_a_background_writes_report_is_taken_before_the_writer_exits(tmp_path):
    """The forked writer's report is the answer as soon as it is whole (the file is on disk by then);
    its exit -- tearing down a copy of the job's memory -- is not waited for, and it is reaped later."""
    from gangd.ckptlib import writer

    hold_r, hold_w = os.pipe()
    real_exit = os._exit

    def linger(result):  # (in the child, before it reports: its exit then waits for the test)
        def held_exit(code):
            os.read(hold_r, 1)
            real_exit(code)

        os._exit = held_exit

    values = {"u": np.arange(100_000.0)}
    try:
        written = writer.write(tmp_path / "state", values, 3, background=True, then=linger)
        result = written.wait()
        assert "error" not in result and result["size"] == (tmp_path / "state").stat().st_size
        state = Path(f"/proc/{written.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state != "Z", "the writer is still there, held before its exit"
        assert written.pid in writer._unreaped
    finally:
        os.write(hold_w, b"x")
        os.close(hold_w)
    while Path(f"/proc/{written.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        os.sched_yield()
    writer.reap()
    assert written.pid not in writer._unreaped and not Path(f"/proc/{written.pid}").exists()
    os.close(hold_r)


def test_a_background_writer_that_dies_before_its_report_is_an_error_with_its_exit(tmp_path):
    from gangd.ckptlib import writer

    def die(result):
        os.kill(os.getpid(), 9)

    written = writer.write(tmp_path / "state", {"u": np.arange(1000.0)}, 3, background=True, then=die)
    assert written.wait() == {"error": "the writer process died (killed by SIGKILL)"}


def test_a_writer_that_dies_unreported_in_a_program_ignoring_sigchld_is_an_error_not_an_exception(tmp_path):
    """A program that ignores SIGCHLD has its children reaped by the kernel: the
    dead writer's status is gone, and the write is still an error, not a crash."""
    import signal

    from gangd.ckptlib import writer

    def die(result):
        os.kill(os.getpid(), 9)

    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        written = writer.write(tmp_path / "state", {"u": np.arange(1000.0)}, 3, background=True, then=die)
        assert written.wait() == {"error": "the writer process died (its exit status was collected elsewhere)"}
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_held_snapshot_writes_nothing_until_released_and_then_the_state_at_its_fork(tmp_path):
    """A rank under gangd holds its forked snapshot until the job resumes (writer.write's ``hold``): the
    snapshot writes nothing before the release, and then the state at the fork, not what the job changed."""
    from gangd.ckptlib import image, writer

    values = {"u": np.arange(100_000.0)}
    path = tmp_path / "state"
    written = writer.write(path, values, 3, background=True, hold=True)
    values["u"][:] = -1.0  # the job runs on
    time.sleep(0.3)  # (an unheld writer would have written its 800 kB by now)
    assert not written.done and not list(tmp_path.iterdir())
    written.release()
    result = written.wait()
    assert "error" not in result, result
    loaded, iteration, _ = image.load(path, (result["size"], result["digest"]))
    assert iteration == 3 and np.array_equal(loaded["u"], np.arange(100_000.0))


def test_a_held_snapshot_abandoned_or_left_by_its_job_writes_nothing_and_goes(tmp_path):
    """Released with write=False (the end sync failed: the generation is aborted) the snapshot reports that
    it wrote nothing; left by a job that died before the release (whose report could never reach the
    daemons) it leaves without writing rather than compete with the restart for the disk."""
    from gangd.ckptlib import writer

    written = writer.write(tmp_path / "abandoned", {"u": np.arange(5000.0)}, 7, background=True, hold=True)
    written.release(write=False)
    written.release(write=True)  # (once only: the first word stands)
    assert written.wait() == {"error": "the checkpoint was abandoned before its snapshot wrote it"}
    assert not (tmp_path / "abandoned").exists()

    path = tmp_path / "orphaned"
    program = (
        "import os, numpy as np\n"
        "from gangd.ckptlib import writer\n"
        f"w = writer.write({str(path)!r}, {{'u': np.arange(5000.0)}}, 7, background=True, hold=True)\n"
        "print(w.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    pid = int(subprocess.run([sys.executable, "-c", program], check=True, timeout=60, capture_output=True, text=True).stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the orphaned snapshot {pid} is still there")
    assert not list(tmp_path.glob("orphaned*"))
