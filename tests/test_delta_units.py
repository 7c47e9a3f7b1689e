"""Incremental checkpoints (issue 17), the format and the engine, on real files (no mocks).

* :mod:`gangd.checkpoint.delta` -- the pure decision (``choose``) over
  hypothesis-generated histories: a chain never reads more than
  ``chain_max`` files, a full never has a parent, differential chains are
  one link deep; retention's closure (``needed``) and ``chain_usable``.
* :mod:`gangd.ckptlib.blocks` -- 50 generations of an app that changes a
  few blocks per iteration, in every mode, every generation restored
  bit-identical from its chain after all were written, each block read
  once; dtype, shape and value-set changes (a new base for that value);
  block sizes that do not divide a value, 0-byte and 0-d arrays, pickles
  that grow; a corrupted or truncated middle link named by its path.
* hostile files: random flips and cuts of a valid delta file, with and
  without its index checksum recomputed (what a user who can write the
  file can do), raise nothing but ``StoreError``; indexes that ask for
  absurd sizes are refused before anything is allocated; symlinks and
  FIFOs are not opened.
* :mod:`gangd.ckptlib.image` -- version 1 files (old generations) still load.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash
from ckpthelpers import flip_byte
from deltahelpers import Generations, SparseApp, assert_same_values, footer, refresh_index_hash, rewrite_index, save_v1
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd import ckptstore
from gangd.checkpoint import delta
from gangd.ckptlib import blocks, image
from gangd.ckptlib.core import Checkpointer, Standalone
from gangd.ckptstore import StoreError

BLOCK = 4096
MODES = list(delta.MODES)

# ====================================================================== delta.choose, pure


def walk(mode: str, history: list[tuple[float, float]], chain_max: int, threshold: float) -> list[tuple[delta.Choice, int]]:
    """Apply choose() over a history of (dirty vs parent, dirty vs base) fractions, as a writer does; (choice, depth) per generation."""
    total = 1000
    out = []
    parent: delta.Ref | None = None
    base: delta.Ref | None = None
    depths: dict[int, int] = {}
    bases: dict[int, int] = {}
    for gen, (f_prev, f_base) in enumerate(history):
        choice = delta.choose(mode, parent=parent, base=base, d_prev=int(f_prev * total), d_base=int(f_base * total), total=total,
                              chain_max=chain_max, threshold=threshold)
        depth = 0 if choice.against is None else depths[choice.against] + 1
        depths[gen] = depth
        bases[gen] = delta.base_of(gen, choice, None if choice.against is None else bases[choice.against])
        out.append((choice, depth))
        parent = delta.Ref(gen, choice.role, depth)
        base = delta.Ref(bases[gen], "base", depths[bases[gen]])
    return out


fractions = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from(MODES), history=st.lists(st.tuples(fractions, fractions), min_size=1, max_size=60),
       chain_max=st.integers(min_value=1, max_value=12), threshold=st.floats(min_value=0.0, max_value=1.0))
def test_choose_bounds_every_chain(mode, history, chain_max, threshold):
    for gen, (choice, depth) in enumerate(walk(mode, history, chain_max, threshold)):
        assert choice.role in delta.ROLES
        assert depth + 1 <= chain_max  # a restore reads at most chain_max files
        if choice.role == "full":
            assert choice.against is None and choice.new_base and depth == 0
        else:
            assert choice.against is not None and choice.against < gen
        if gen == 0 or mode == "full":
            assert choice.role == "full"
        if mode == "differential":
            assert depth <= 1 and choice.role in ("full", "diff")
        if mode == "incremental":
            assert choice.role in ("full", "incr") and (choice.against in (None, gen - 1))
        if choice.role in ("incr", "rebase"):
            assert choice.against == gen - 1


@given(mode=st.sampled_from(MODES), depth=st.integers(min_value=0, max_value=20), d=st.integers(min_value=900, max_value=1000))
def test_choose_nearly_everything_changed_is_a_full(mode, depth, d):
    ref = delta.Ref(5, "diff", depth)
    assert delta.choose(mode, parent=ref, base=ref, d_prev=d, d_base=d, total=1000) == delta.FULL


def test_choose_adaptive_follows_003():
    full = delta.Ref(0, "full", 0)
    # little changed against the base: a differential against the base
    assert delta.choose("adaptive", parent=delta.Ref(3, "diff", 1), base=full, d_prev=10, d_base=50, total=1000) == delta.Choice("diff", 0, False)
    # against the base it changed much more than against the previous one (by more than the threshold): a new base
    assert delta.choose("adaptive", parent=delta.Ref(3, "diff", 1), base=full, d_prev=10, d_base=200, total=1000) == delta.Choice("rebase", 3, True)
    assert delta.choose("incremental", parent=delta.Ref(3, "incr", 7), base=full, d_prev=1, d_base=1, total=1000, chain_max=8) == delta.FULL
    assert delta.choose("differential", parent=None, base=None, d_prev=0, d_base=0, total=0) == delta.FULL
    assert delta.choose("incremental", parent=full, base=full, d_prev=0, d_base=0, total=1000, force_full=True) == delta.FULL
    with pytest.raises(ValueError, match="not one of"):
        delta.choose("sometimes", parent=None, base=None, d_prev=0, d_base=0, total=0)


def test_refs_and_links_problem():
    parent, base = delta.refs(9, "diff", 6, [6, 5, 0])
    assert parent == delta.Ref(9, "diff", 3) and base == delta.Ref(6, "base", 2)
    parent, base = delta.refs(4, "full", 4, [])
    assert parent == base == delta.Ref(4, "full", 0)
    assert delta.links_problem(9, [6, 5, 0], 4) is None
    assert "more than the bound" in delta.links_problem(9, [6, 5, 0], 3)
    assert "not older" in delta.links_problem(9, [9], 8)
    assert "not older" in delta.links_problem(9, [3, 5], 8)
    assert "not a generation" in delta.links_problem(9, [-1], 8)
    assert "not a generation" in delta.links_problem(9, ["3"], 8)


def test_needed_keeps_every_transitive_need_and_nothing_else():
    # 0 full, 1 diff(0), 2 rebase(1) <- base, 3 diff(2), 4 full, 5 incr(4); another rank's rebase ripple: 3 also needs 1
    needs = {0: [], 1: [0], 2: [1, 0], 3: [2, 1, 0], 4: [], 5: [4], 6: [5, 4], 7: []}
    assert delta.needed(needs, [3]) == {3, 2, 1, 0}
    assert delta.needed(needs, [6, 7]) == {7, 6, 5, 4}
    assert delta.needed(needs, []) == set()
    assert delta.needed({1: [0], 0: [1]}, [1]) == {0, 1}  # a cycle (a hostile entry) ends
    assert delta.needed({2: [1]}, [2]) == {1, 2}  # 1 is needed, whether or not it exists
    assert delta.chain_usable(3, needs, {0, 1, 2, 3})
    assert not delta.chain_usable(3, needs, {1, 2, 3})
    assert delta.missing_links(3, needs, lambda g: g != 1) == [1]
    assert delta.chain_usable(7, needs, {7})


@given(needs=st.dictionaries(st.integers(0, 30), st.lists(st.integers(0, 30), max_size=5), max_size=30), seeds=st.sets(st.integers(0, 30)))
def test_needed_is_the_closure(needs, seeds):
    keep = delta.needed(needs, seeds)
    assert set(seeds) <= keep
    for gen in keep:
        assert set(needs.get(gen, ())) <= keep  # nothing a kept generation needs is removed
    # nothing else is kept: every kept generation is reachable from a seed
    reach, todo = set(), list(seeds)
    while todo:
        g = todo.pop()
        if g not in reach:
            reach.add(g)
            todo.extend(needs.get(g, ()))
    assert keep == reach


# ====================================================================== the signature


@pytest.mark.parametrize("block", [64, 100, 4096, 16384])
@pytest.mark.parametrize("nbytes", [0, 1, 99, 4096, 16385, 100_003])
def test_signature_is_xxh3_128_of_each_raw_block(nbytes, block):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    sig = blocks.hash_blocks(data.data.cast("B"), block)
    raw = data.tobytes()
    want = [xxhash.xxh3_128_digest(raw[i : i + block]) for i in range(0, nbytes, block)]
    assert sig.shape == (len(want), 16) and sig.tobytes() == b"".join(want)
    state = blocks.signature({"v": data, "p": raw}, block)  # a pickle is blocked the same way
    assert state.values[0].sig.tobytes() == b"".join(want)
    assert len(state.values[1].sig) == blocks.nblocks(state.values[1].nbytes, block)


# ====================================================================== 50 generations in every mode


@pytest.mark.parametrize("mode", MODES)
def test_fifty_generations_restore_bit_identical(tmp_path, mode):
    app = SparseApp(seed=MODES.index(mode))
    gens = Generations(tmp_path)
    snapshots = {}
    chain_max = 6
    for gen in range(50):
        if gen:
            app.step()
        snapshots[gen] = app.snapshot()
        gens.write(gen, app.values, gen - 1 if gen else None, mode=mode, block=BLOCK, chain_max=chain_max)
    state = sum(blocks.plan(snapshots[49], BLOCK).total for _ in [0])
    for gen, result in gens.results.items():  # every generation, after all were written
        assert len(result["links"]) + 1 <= chain_max
        if result["role"] == "full":
            assert result["parent"] is None and result["links"] == []
        if mode == "differential":
            assert len(result["links"]) <= 1
        stats: dict = {}
        values, iteration, _ = gens.restore(gen, stats)
        assert iteration == gen * 10
        assert_same_values(values, snapshots[gen])
        # each block read once: the bytes read are the state's, plus every file's magic, index and footer
        assert stats["blocks"] == blocks.plan(snapshots[gen], BLOCK).total
        assert stats["read"] == result["restore"]
        assert stats["files"] == len(result["links"]) + 1
    written = sum(r["size"] for r in gens.results.values())
    if mode == "full":
        assert all(r["role"] == "full" for r in gens.results.values())
    else:
        assert written < 50 * state * 0.5, (mode, written, state)  # a few blocks per generation, not the whole state
        assert any(r["role"] != "full" for r in gens.results.values())
    if mode == "adaptive":
        assert {r["role"] for r in gens.results.values()} >= {"full", "diff"}


def test_adaptive_with_everything_changed_costs_a_full(tmp_path):
    rng = np.random.default_rng(7)
    u = rng.random(300_000)
    gens = Generations(tmp_path)
    gens.write(0, {"u": u}, None, mode="adaptive")
    u[:] = rng.random(u.size)
    adaptive = gens.write(1, {"u": u}, 0, mode="adaptive")
    full = blocks.save_generation(tmp_path / "plain.state", {"u": u}, gen=1, mode="full")
    assert adaptive["role"] == "full" and adaptive["links"] == []
    assert adaptive["size"] <= 1.05 * full["size"]  # the signature: 16 B per 16 KiB block


def test_dtype_shape_and_value_set_changes_make_a_new_base_per_value(tmp_path):
    gens = Generations(tmp_path)
    a = np.arange(10_000, dtype=np.float64)
    b = np.arange(12_000, dtype=np.int32).reshape(100, 120)
    keep = np.ones(20_000)
    gens.write(0, {"a": a, "b": b, "gone": np.zeros(5), "keep": keep}, None, mode="incremental", block=1024)
    a2, b2 = a.astype(np.float32), b.reshape(120, 100).copy()
    values1 = {"a": a2, "b": b2, "keep": keep, "new": np.full(3, 7)}
    gens.write(1, values1, 0, mode="incremental", block=1024)
    index = blocks.read_index(gens.path(1))
    assert index.role == "incr" and index.links == (0,)
    whole = {e.name: e.whole for e in index.entries}
    assert whole == {"a": True, "b": True, "keep": False, "new": True}
    assert not index.entry("keep").present.any()  # unchanged: nothing of it stored
    assert_same_values(gens.restore(1)[0], values1)
    a2[5] = -1.0  # now a block of the float32 array changes: a delta against gen 1's layout, not garbage from gen 0's
    gens.write(2, values1, 1, mode="incremental", block=1024)
    entry = blocks.read_index(gens.path(2)).entry("a")
    assert not entry.whole and entry.present.sum() == 1
    assert_same_values(gens.restore(2)[0], values1)


@pytest.mark.parametrize("block", [64, 100, 4096, 1 << 20])
def test_block_sizes_that_do_not_divide_values(tmp_path, block):
    gens = Generations(tmp_path)
    values = {"odd": np.arange(3_000_001, dtype=np.uint8), "zero-d": np.array(3), "empty": np.zeros(0), "pk": list(range(50))}
    gens.write(0, values, None, mode="incremental", block=block)
    values["odd"][-1] = 0  # the short last block
    values["odd"][0] = 9
    values["pk"].append("more")  # the pickle grows
    gens.write(1, values, 0, mode="incremental", block=block)
    assert gens.results[1]["role"] == "incr"
    stats: dict = {}
    assert_same_values(gens.restore(1, stats)[0], values)
    assert stats["read"] == gens.results[1]["restore"]


def test_a_full_version_2_file_loads_alone_and_an_incremental_one_asks_for_its_chain(tmp_path):
    gens = Generations(tmp_path)
    u = np.arange(50_000.0)
    gens.write(0, {"u": u}, None, mode="incremental", block=BLOCK)
    u[3] = 0
    gens.write(1, {"u": u}, 0, mode="incremental", block=BLOCK)
    values, iteration, _ = image.load(gens.path(0), (gens.results[0]["size"], gens.results[0]["digest"]))
    assert iteration == 0 and values["u"][3] == 3
    with pytest.raises(StoreError, match=r"needs generations \[0\]") as info:
        image.load(gens.path(1))
    assert str(gens.path(1)) in str(info.value)


def test_version_1_files_still_load_and_are_no_parent(tmp_path):
    old = tmp_path / "old.state"
    values = {"u": np.arange(7.0), "rec": np.zeros(2, dtype=[("a", "u1"), ("b", "<f8")]), "d": {"x": 1}}
    size, digest = save_v1(old, values, 4, {"k": 1})
    restored, iteration, extra = image.load(old, (size, digest))
    assert iteration == 4 and extra == {"k": 1}
    assert_same_values(restored, values)
    # offered as the parent of a new generation: the new one is full (a v1 file has no signature)
    result = blocks.save_generation(tmp_path / "new.state", values, gen=5, mode="adaptive", offered=[(4, old, (size, digest))])
    assert result["role"] == "full" and "bad magic" in result["why_full"]


def test_a_damaged_parent_makes_the_next_generation_full(tmp_path):
    gens = Generations(tmp_path)
    u = np.arange(50_000.0)
    gens.write(0, {"u": u}, None, mode="incremental", block=BLOCK)
    os.truncate(gens.path(0), 1000)
    result = gens.write(1, {"u": u}, 0, mode="incremental", block=BLOCK)
    assert result["role"] == "full" and str(gens.path(0)) in result["why_full"]
    assert_same_values(gens.restore(1)[0], {"u": u})


# ====================================================================== damaged links


def five_generations(tmp_path: Path) -> tuple[Generations, dict]:
    """gen 0 full, 1-4 incremental; gen 2 alone changes block 3 of u, so gen 4's restore reads that block from gen 2."""
    gens = Generations(tmp_path)
    u = np.zeros(40 * BLOCK // 8)
    for gen in range(5):
        if gen:
            u[(10 + gen) * BLOCK // 8] = gen
        if gen == 2:
            u[3 * BLOCK // 8] = 42
        gens.write(gen, {"u": u, "log": ["step", gen]}, gen - 1 if gen else None, mode="incremental", block=BLOCK)
    assert gens.results[4]["links"] == [3, 2, 1, 0]
    return gens, {"u": u, "log": ["step", 4]}


def test_chain_restores_and_reads_block_from_middle_link(tmp_path):
    gens, values = five_generations(tmp_path)
    assert_same_values(gens.restore(4)[0], values)


def test_corrupted_block_in_middle_link_names_path_value_and_block(tmp_path):
    gens, _ = five_generations(tmp_path)
    index = blocks.read_index(gens.path(2))
    entry = index.entry("u")
    assert entry.present[3]
    flip_byte(gens.path(2), entry.offset + 10)  # gen 2's first stored block: block 3 of u
    with pytest.raises(StoreError) as info:
        gens.restore(4)
    message = str(info.value)
    assert str(gens.path(2)) in message and "'u'" in message and "block 3" in message, message


def test_corrupted_index_of_middle_link_names_path(tmp_path):
    gens, _ = five_generations(tmp_path)
    offset, length = footer(gens.path(2))
    flip_byte(gens.path(2), offset + length // 2)
    with pytest.raises(StoreError, match="index does not match its checksum") as info:
        gens.restore(4)
    assert str(gens.path(2)) in str(info.value)


@pytest.mark.parametrize("keep", [0, 7, 100, -41, -1])
def test_truncated_middle_link_names_path(tmp_path, keep):
    gens, _ = five_generations(tmp_path)
    size = gens.path(2).stat().st_size
    os.truncate(gens.path(2), keep % size)
    with pytest.raises(StoreError) as info:
        gens.restore(4)
    assert str(gens.path(2)) in str(info.value)


def test_a_link_swapped_for_another_generation_is_refused(tmp_path):
    gens, _ = five_generations(tmp_path)
    gens.path(2).write_bytes(gens.path(1).read_bytes())
    with pytest.raises(StoreError, match="not the link") as info:
        blocks.read_chain(gens.path(4), [(g, gens.path(g)) for g in (3, 2, 1, 0)])
    assert str(gens.path(2)) in str(info.value)
    with pytest.raises(StoreError, match=r"needs generations \[3, 2, 1, 0\]"):
        blocks.read_chain(gens.path(4), [(3, gens.path(3))])


def test_symlinked_and_fifo_links_are_not_opened(tmp_path):
    gens, _ = five_generations(tmp_path)
    real = tmp_path / "real-2.state"
    gens.path(2).rename(real)
    gens.path(2).symlink_to(real)
    with pytest.raises(StoreError, match="cannot open") as info:
        gens.restore(4)
    assert str(gens.path(2)) in str(info.value)
    gens.path(2).unlink()
    os.mkfifo(gens.path(2))
    with pytest.raises(StoreError, match="cannot open"):  # not a regular file: refused, not waited on
        gens.restore(4)


# ====================================================================== hostile files


def delta_file(tmp_path: Path) -> tuple[Generations, bytes]:
    gens = Generations(tmp_path)
    u = np.arange(20_000, dtype=np.float64)
    gens.write(0, {"u": u, "d": {"a": 1}, "s": np.array(2.5)}, None, mode="incremental", block=1024)
    u[100] = -1
    u[9000] = -2
    gens.write(1, {"u": u, "d": {"a": 2}, "s": np.array(2.5)}, 0, mode="incremental", block=1024)
    return gens, gens.path(1).read_bytes()


def only_store_errors(gens: Generations, data: bytes) -> None:
    gens.path(1).write_bytes(data)
    for attempt in (lambda: blocks.read_chain(gens.path(1), [(0, gens.path(0))]),
                    lambda: blocks.read_chain(gens.path(1), gens.chain(1), (gens.results[1]["size"], gens.results[1]["digest"])),
                    lambda: blocks.read_index(gens.path(1)),
                    lambda: image.load(gens.path(1))):
        try:
            attempt()
        except StoreError:
            pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_or_cut_delta_files_raise_only_store_errors(tmp_path, data):
    gens, good = delta_file(tmp_path)
    damaged = bytearray(good)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(damaged) - 1))
        damaged[at] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        damaged = damaged[: data.draw(st.integers(0, len(damaged)))]
    only_store_errors(gens, bytes(damaged))
    # and as an owner would: the damage made consistent with the index checksum
    only_store_errors(gens, refresh_index_hash(bytes(damaged)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_indexes_with_a_fixed_checksum_raise_only_store_errors(tmp_path, data):
    """Flips inside the index, the footer's checksum recomputed: the decoder's own checks must hold."""
    gens, good = delta_file(tmp_path)
    offset, length = footer(gens.path(1))
    damaged = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        at = offset + data.draw(st.integers(0, length - 1))
        damaged[at] ^= data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 255]))
    only_store_errors(gens, refresh_index_hash(bytes(damaged)))


HOSTILE_INDEXES = {
    "huge array": lambda h, r: ({**h, "entries": [{**h["entries"][0], "meta": {"dtype": "<f8", "shape": [1 << 58]}, "nbytes": 1 << 61,
                                                  "nblocks": (1 << 61) // 1024}]}, r),
    "nblocks disagree": lambda h, r: ({**h, "entries": [{**h["entries"][0], "nblocks": 3}, *h["entries"][1:]]}, r),
    "negative size": lambda h, r: ({**h, "entries": [{**h["entries"][0], "nbytes": -8}, *h["entries"][1:]]}, r),
    "object dtype": lambda h, r: ({**h, "entries": [{**h["entries"][0], "meta": {"dtype": "|O", "shape": [20_000]}}, *h["entries"][1:]]}, r),
    "code in a dtype": lambda h, r: ({**h, "entries": [{**h["entries"][0], "meta": {"dtype": pickle.dumps(os.getcwd), "shape": [20_000]}},
                                                       *h["entries"][1:]]}, r),
    "tiny block": lambda h, r: ({**h, "block": 1}, r),
    "index too short": lambda h, r: (h, r[:-5]),
    "index too long": lambda h, r: (h, r + b"\0"),
    "repeated value": lambda h, r: ({**h, "entries": [h["entries"][0], h["entries"][0]]}, r),
    "missing field": lambda h, r: ({k: v for k, v in h.items() if k != "base"}, r),
    "chain to itself": lambda h, r: ({**h, "links": [1], "parent": 1}, r),
    "chain too long": lambda h, r: ({**h, "links": list(range(5000, 0, -1)), "gen": 5001, "parent": 5000}, r),
    "full with links": lambda h, r: ({**h, "role": "full", "parent": None, "base": 1}, r),
    "extra not a dict": lambda h, r: ({**h, "extra": [1]}, r),
    "entries not a list": lambda h, r: ({**h, "entries": {"u": 1}}, r),
    "stray block bits": lambda h, r: (h, r[:-1] + bytes([r[-1] | 1])),
}


@pytest.mark.parametrize("case", list(HOSTILE_INDEXES))
def test_hostile_index_is_refused_before_use(tmp_path, case):
    gens, _ = delta_file(tmp_path)
    rewrite_index(gens.path(1), HOSTILE_INDEXES[case])
    with pytest.raises(StoreError) as info:
        blocks.read_chain(gens.path(1), [(0, gens.path(0))])
    assert str(gens.path(1)) in str(info.value)


def test_hostile_footer_offsets_are_refused(tmp_path):
    gens, good = delta_file(tmp_path)
    offset, length = footer(gens.path(1))
    for bad_offset, bad_length in ((0, length), (offset, length + 1), (offset - 1, length), (1 << 63, 8), (offset, 1 << 40)):
        data = good[: -blocks.FOOTER.size] + blocks.FOOTER.pack(bad_offset, bad_length, b"\0" * 16, blocks.END)
        gens.path(1).write_bytes(data)
        with pytest.raises(StoreError, match="corrupted") as info:
            blocks.read_index(gens.path(1))
        assert str(gens.path(1)) in str(info.value)


# ====================================================================== a program run alone (ckptlib.init(mode=...))

ALONE = textwrap.dedent(
    """
    import hashlib, os, sys, time
    import numpy as np
    from gangd import ckptlib as ckpt

    N, KILL = int(os.environ.get("T_N", "50")), int(os.environ.get("T_KILL", "-1"))
    ckpt.init(mode=os.environ["T_MODE"], keep=int(os.environ.get("T_KEEP", "100")), block_kib=4, chain_max=6)
    u = ckpt.protect("u", lambda: np.zeros(1 << 17))  # 1 MiB: 256 blocks of 4 KiB
    kind = ckpt.protect("kind", lambda: np.arange(100, dtype=np.int32))
    st = ckpt.protect("st", lambda: {"log": []})

    def digest():
        return hashlib.sha256(u.tobytes() + kind.dtype.str.encode() + kind.tobytes() + repr(st).encode()).hexdigest()

    class Slow:  # pickled in the snapshot child: holds that generation's writer until it is killed
        def __reduce__(self):
            time.sleep(60)
            return (Slow, ())

    SLOW = int(os.environ.get("T_SLOW_AT", "-1"))
    for it in ckpt.loop(range(N)):
        if it == KILL:
            os.kill(os.getpid(), 9)
        if it == SLOW:
            st["slow"] = Slow()
        if SLOW >= 0 and it == SLOW + 1:  # the checkpoint at boundary SLOW + 1 forked a writer stuck in Slow: kill it mid-write
            del st["slow"]
            stuck = ckpt._cp.writes[-1]
            print("killed-gen", ckpt.generation(), flush=True)
            os.kill(stuck.pid, 9)
        r = np.random.default_rng(it)
        for b in r.integers(0, 256, 3):
            u[int(b) * 512] += 1.0  # a few blocks change per iteration
        if it % 7 == 3:
            st["log"].append(it)  # the pickle grows
        if it == 20:  # a dtype change: protected again under the same name
            kind = ckpt.protect("kind", kind.astype(np.float64))
        ckpt.request()  # a checkpoint at every boundary
        print("state", it + 1, digest(), flush=True)
    ckpt.fini()
    print("final", digest(), flush=True)
    """
)


def run_alone(directory: Path, **env) -> subprocess.CompletedProcess:
    script = directory / "alone.py"
    script.write_text(ALONE)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    environment.update({k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, str(script)], cwd=directory, env=environment, check=False, capture_output=True,
                          text=True, timeout=120)


def restored_digest(values: dict) -> str:
    u, kind, st = values["u"], values["kind"], values["st"]
    return hashlib.sha256(u.tobytes() + kind.dtype.str.encode() + kind.tobytes() + repr(st).encode()).hexdigest()


@pytest.mark.parametrize("background", ["1", "0"], ids=["background", "inline"])
@pytest.mark.parametrize("mode", MODES)
def test_alone_fifty_generations_each_restored_bit_identical(tmp_path, mode, background):
    result = run_alone(tmp_path, T_MODE=mode, GANGD_CKPT_BACKGROUND=background)
    assert result.returncode == 0, result.stderr
    assert "gangd.ckptlib" not in result.stderr, result.stderr  # no failed checkpoint, no warning
    states = {int(w[1]): w[2] for w in (line.split() for line in result.stdout.splitlines()) if w[0] == "state"}
    root = tmp_path / "alone.ckpt"
    alone = Standalone(root, keep=100)
    complete = alone.complete()
    assert len(complete) >= 45, complete  # background writes still under way at a request are skipped, not queued
    roles = []
    for gen in complete:
        cp = Checkpointer(None, background=False)
        alone.restore(cp, gen)
        assert restored_digest(cp.restored) == states[cp.start], (mode, gen)
        index = blocks.read_index(alone._file(gen))
        roles.append(index.role)
        assert len(index.links) + 1 <= 6
    if mode == "full":
        assert set(roles) == {"full"}
    else:
        assert set(roles) - {"full"}, roles  # deltas were written
        sizes = [ckptstore.read_manifest(ckptstore.gen_dir(root, 0, g)).files["rank-0.state"][0] for g in complete]
        assert sum(sizes) < 0.5 * len(sizes) * (1 << 20)  # deltas of a few blocks, not the MiB each time


@pytest.mark.parametrize("mode", ["incremental", "adaptive"])
def test_alone_killed_and_restarted_from_a_delta_ends_as_an_uninterrupted_run(tmp_path, mode):
    reference = run_alone(tmp_path, T_MODE=mode, T_N=30, T_KEEP=2)
    assert reference.returncode == 0, reference.stderr
    shutil.rmtree(tmp_path / "alone.ckpt")
    killed = run_alone(tmp_path, T_MODE=mode, T_N=30, T_KEEP=2, T_KILL=24, GANGD_CKPT_BACKGROUND=0)
    assert killed.returncode == -9
    root = tmp_path / "alone.ckpt"
    alone = Standalone(root, keep=2)
    newest = max(alone.complete())
    assert blocks.read_index(alone._file(newest)).role != "full"  # the restart reads a chain
    resumed = run_alone(tmp_path, T_MODE=mode, T_N=30, T_KEEP=2, GANGD_RESTART="latest")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split()[-1] == reference.stdout.split()[-1]


@pytest.mark.parametrize("mode", ["incremental", "adaptive"])
def test_alone_retention_keeps_exactly_what_the_kept_generations_need(tmp_path, mode):
    result = run_alone(tmp_path, T_MODE=mode, T_N=30, T_KEEP=2, GANGD_CKPT_BACKGROUND=0)
    assert result.returncode == 0, result.stderr
    root = tmp_path / "alone.ckpt"
    alone = Standalone(root, keep=2)
    present = ckptstore.generations(root, 0)
    assert present == alone.complete()  # no leftovers
    newest_two = present[-2:]
    needs = {g: alone.links(g) for g in present}
    assert set(present) == delta.needed(needs, newest_two)  # nothing needed removed, nothing else kept
    assert len(present) > 2  # the chains kept their links


def test_alone_damaged_middle_link_falls_back_to_an_intact_chain(tmp_path):
    result = run_alone(tmp_path, T_MODE="incremental", T_N=12, GANGD_CKPT_BACKGROUND=0)
    assert result.returncode == 0, result.stderr
    states = {int(w[1]): w[2] for w in (line.split() for line in result.stdout.splitlines()) if w[0] == "state"}
    root = tmp_path / "alone.ckpt"
    alone = Standalone(root, keep=100)
    newest = max(alone.complete())
    links = alone.links(newest)
    assert len(links) >= 2
    middle = links[len(links) // 2]
    os.truncate(alone._file(middle), 100)
    cp = Checkpointer(None, background=False)
    alone.restore(cp, "latest")
    assert cp.restarted_from is not None and cp.restarted_from < middle  # newer ones all need the damaged link
    assert restored_digest(cp.restored) == states[cp.start]
    assert (ckptstore.gen_dir(root, 0, newest) / "DAMAGED").exists()
    assert str(alone._file(middle)) in (ckptstore.gen_dir(root, 0, newest) / "DAMAGED").read_text()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_or_cut_version_1_files_raise_only_store_errors(tmp_path, data):
    """Old generations are read by the same rules: no allocation from an unchecked size, nothing but StoreError."""
    path = tmp_path / "old.state"
    save_v1(path, {"u": np.arange(3000.0), "rec": np.zeros(3, dtype=[("a", "u1"), ("b", "<f8")]), "d": {"k": [1, 2]}}, 4)
    damaged = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, min(len(damaged) - 1, 400)))  # mostly the header
        damaged[at] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        damaged = damaged[: data.draw(st.integers(0, len(damaged)))]
    path.write_bytes(bytes(damaged))
    try:
        image.load(path)
    except StoreError:
        pass


def test_a_version_1_header_asking_for_more_than_the_file_is_refused_unallocated(tmp_path):
    path = tmp_path / "old.state"
    header = msgpack.packb({"v": 1, "iteration": 0, "entries": [["a", "nd", {"dtype": "<f8", "shape": [1 << 40]}, 8 << 40]], "extra": {}},
                           use_bin_type=True)
    path.write_bytes(image.MAGIC + len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(StoreError, match="truncated") as info:
        image.load(path)
    assert str(path) in str(info.value)
    header = msgpack.packb({"v": 1, "iteration": 0, "entries": [["p", "pk", {}, 1 << 50]], "extra": {}}, use_bin_type=True)
    path.write_bytes(image.MAGIC + len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(StoreError, match="truncated"):
        image.load(path)


def test_alone_a_delta_writer_killed_mid_write_commits_nothing_and_the_next_diffs_against_the_last_complete(tmp_path):
    result = run_alone(tmp_path, T_MODE="incremental", T_N=12, T_SLOW_AT=5)
    assert result.returncode == 0, result.stderr
    assert "writer process died (killed by SIGKILL)" in result.stderr  # said, and the job ran on
    killed = int(next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("killed-gen")))
    states = {int(w[1]): w[2] for w in (line.split() for line in result.stdout.splitlines()) if w[0] == "state"}
    root = tmp_path / "alone.ckpt"
    alone = Standalone(root, keep=100)
    complete = alone.complete()
    assert killed not in complete and not (ckptstore.gen_dir(root, 0, killed) / ckptstore.MANIFEST).exists()
    assert killed + 1 in complete
    assert killed not in alone.links(killed + 1)  # offered the last complete generation, never the one still writing
    for gen in complete:  # and every committed generation restores
        cp = Checkpointer(None, background=False)
        alone.restore(cp, gen)
        assert restored_digest(cp.restored) == states[cp.start]
