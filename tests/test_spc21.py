"""SPC plug-ins that hand over buffers get incremental checkpoints (issue 17).

A plug-in that keeps the program's state itself (not in ``protect``ed
values) and hands it to gangd as buffers (``SPC.buffers`` /
``SPC.restore_buffers``) is written in gangd's block format: in every mode,
each generation restores bit-identical from its chain, a delta stores
exactly the blocks that changed since the generation it is a delta of,
a damaged link falls back to the newest intact chain, and a program killed
and restarted ends as an uninterrupted run -- written from a forked
snapshot or inline. A plug-in that writes its own file keeps doing so.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gangd import ckptstore
from gangd.checkpoint import delta
from gangd.ckptlib import blocks, spc
from gangd.ckptlib.core import Checkpointer, DeltaSettings, Standalone

MODES = ["full", "incremental", "differential", "adaptive"]
BLOCK = 4 << 10
CELLS = 1 << 17  # float64: 1 MiB, 256 blocks of 4 KiB
RAW = 64 << 10  # bytes: 16 blocks


class Slab(spc.SPC):
    """A plug-in that holds the program's state itself and hands it over as buffers:
    an array, a bytearray (as a memoryview: it comes back as a uint8 array) and a small dict (pickled)."""

    name = "slab"

    def __init__(self) -> None:
        self.cells = np.zeros(CELLS)
        self.raw = bytearray(RAW)
        self.meta: dict = {"t": 0, "log": []}
        self.given_back: dict | None = None

    def buffers(self, values: dict) -> dict:
        return {"cells": self.cells, "raw": memoryview(self.raw), "meta": self.meta}

    def restore_buffers(self, buffers: dict) -> dict:
        self.given_back = dict(buffers)
        raw = buffers["raw"]
        assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.shape == (RAW,)
        self.cells, self.raw, self.meta = buffers["cells"], bytearray(raw.tobytes()), buffers["meta"]
        return {}

    def step(self, it: int) -> None:
        r = np.random.default_rng(it)
        for b in r.integers(0, CELLS * 8 // BLOCK, 3):
            self.cells[int(b) * (BLOCK // 8)] += 1.0  # three blocks of 256 change per iteration
        if it % 4 == 1:
            self.raw[int(r.integers(0, RAW))] ^= 0xFF
        self.meta["t"] = it + 1
        if it % 7 == 3:
            self.meta["log"].append(it)  # the pickle grows: written whole

    def digest(self) -> str:
        return hashlib.sha256(self.cells.tobytes() + bytes(self.raw) + repr(self.meta).encode()).hexdigest()


PROGRAM = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, os.environ["T_TESTS"])
    from gangd import ckptlib as ckpt
    from test_spc21 import Slab

    N, KILL = int(os.environ.get("T_N", "30")), int(os.environ.get("T_KILL", "-1"))
    slab = Slab()
    ckpt.init(spc=slab, mode=os.environ["T_MODE"], keep=int(os.environ.get("T_KEEP", "100")), block_kib=4, chain_max=6)
    print("restarted", ckpt.restarted(), flush=True)
    for it in ckpt.loop(range(N)):
        if it == KILL:
            os.kill(os.getpid(), 9)
        slab.step(it)
        ckpt.request()  # a checkpoint at every boundary
        print("state", it + 1, slab.digest(), flush=True)
    ckpt.fini()
    print("final", slab.digest(), flush=True)
    """
)


def run(directory: Path, **env) -> subprocess.CompletedProcess:
    script = directory / "slab.py"
    script.write_text(PROGRAM)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    environment.update({k: str(v) for k, v in env.items()}, T_TESTS=str(Path(__file__).parent))
    return subprocess.run([sys.executable, str(script)], cwd=directory, env=environment, check=False, capture_output=True,
                          text=True, timeout=180)


def states_of(result: subprocess.CompletedProcess) -> dict[int, str]:
    return {int(w[1]): w[2] for w in (line.split() for line in result.stdout.splitlines()) if w[0] == "state"}


def restore(alone: Standalone, gen: int | str) -> tuple[Slab, Checkpointer]:
    """Generation ``gen`` restored the way a restart does it, into a fresh plug-in."""
    slab = Slab()
    cp = Checkpointer(None, background=False, spc=slab)
    alone.restore(cp, gen)
    return slab, cp


def changed_blocks(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Which ``BLOCK``-byte blocks of two arrays' bytes differ."""
    a, b = new.reshape(-1).view(np.uint8), old.reshape(-1).view(np.uint8)
    pad = -len(a) % BLOCK
    a, b = np.concatenate([a, np.zeros(pad, np.uint8)]), np.concatenate([b, np.zeros(pad, np.uint8)])
    return np.any(a.reshape(-1, BLOCK) != b.reshape(-1, BLOCK), axis=1)


@pytest.mark.parametrize("background", ["1", "0"], ids=["background", "inline"])
@pytest.mark.parametrize("mode", MODES)
def test_a_plugin_handing_over_buffers_restores_every_generation_and_writes_only_changed_blocks(tmp_path, mode, background):
    """Thirty generations, three blocks of the array (and now and then one
    of the bytearray) changed between each: every generation restores
    bit-identical through the plug-in's restore_buffers; in a delta mode
    each delta stores exactly the blocks that differ from the generation it
    is a delta of, so its file is a few blocks plus its index, where a full
    one is the whole state."""
    result = run(tmp_path, T_MODE=mode, GANGD_CKPT_BACKGROUND=background)
    assert result.returncode == 0, result.stderr
    assert "gangd.ckptlib" not in result.stderr, result.stderr  # no failed checkpoint, no warning
    states = states_of(result)
    root = tmp_path / "slab.ckpt"
    alone = Standalone(root, keep=100)
    complete = alone.complete()
    assert len(complete) >= (25 if background == "0" else 10), complete  # (a request while a background write is under way is skipped)
    restored: dict[int, dict] = {}
    indexes: dict[int, blocks.Index] = {}
    for gen in complete:
        slab, cp = restore(alone, gen)
        assert cp.restarted_from == gen
        assert slab.digest() == states[cp.start], (mode, gen)
        assert slab.given_back is not None and set(slab.given_back) == {"cells", "raw", "meta"}
        restored[gen] = slab.given_back
        indexes[gen] = blocks.read_index(alone._file(gen))
    state = CELLS * 8 + RAW
    sizes = {g: ckptstore.read_manifest(ckptstore.gen_dir(root, 0, g)).files["rank-0.state"][0] for g in complete}
    roles = {g: indexes[g].role for g in complete}
    if mode == "full":
        assert set(roles.values()) == {"full"} and all(size > state for size in sizes.values())
        return
    deltas = [g for g in complete if roles[g] != "full"]
    assert len(deltas) >= len(complete) // 2, roles
    if mode == "differential":
        assert {roles[g] for g in deltas} == {"diff"}
    for gen in deltas:
        index = indexes[gen]
        against = index.parent
        assert against in restored, (gen, index.links)
        for name in ("cells", "raw"):
            entry = index.entry(name)
            assert entry is not None and not entry.whole
            want = changed_blocks(restored[gen][name], restored[against][name])
            assert (entry.present == want).all(), (mode, gen, name, np.flatnonzero(entry.present), np.flatnonzero(want))
        stored = sum(e.stored for e in index.entries)
        assert sizes[gen] < stored + 12 * 1024  # (the blocks, plus an index of 16 B per block of the state)
        # Per iteration since the generation it is a delta of: three blocks of the array, one of the bytearray, the pickle.
        steps = index.iteration - indexes[against].iteration
        assert 0 < steps and sizes[gen] <= (4 * steps + 2) * BLOCK + 12 * 1024, (gen, steps, sizes[gen])
    assert sum(sizes.values()) < 0.4 * len(sizes) * state


@pytest.mark.parametrize("background", ["1", "0"], ids=["background", "inline"])
def test_a_plugin_program_killed_and_restarted_from_a_delta_ends_as_an_uninterrupted_run(tmp_path, background):
    reference = run(tmp_path, T_MODE="adaptive", T_N=24, T_KEEP=2, GANGD_CKPT_BACKGROUND=background)
    assert reference.returncode == 0, reference.stderr
    root = tmp_path / "slab.ckpt"
    ckptstore.remove(root)
    killed = run(tmp_path, T_MODE="adaptive", T_N=24, T_KEEP=2, T_KILL=17, GANGD_CKPT_BACKGROUND=background)
    assert killed.returncode == -9, killed.stderr
    alone = Standalone(root, keep=2)
    newest = max(alone.complete())
    assert blocks.read_index(alone._file(newest)).role != "full"  # the restart reads a chain
    resumed = run(tmp_path, T_MODE="adaptive", T_N=24, T_KEEP=2, GANGD_RESTART="latest", GANGD_CKPT_BACKGROUND=background)
    assert resumed.returncode == 0, resumed.stderr
    assert "restarted True" in resumed.stdout
    assert resumed.stdout.split()[-1] == reference.stdout.split()[-1]
    present = ckptstore.generations(root, 0)  # retention kept the newest two and what they need, nothing else
    assert set(present) == delta.needed({g: alone.links(g) for g in present}, present[-2:])


def test_a_damaged_link_of_a_plugin_s_chain_falls_back_to_an_intact_one(tmp_path):
    result = run(tmp_path, T_MODE="incremental", T_N=12, GANGD_CKPT_BACKGROUND=0)
    assert result.returncode == 0, result.stderr
    states = states_of(result)
    root = tmp_path / "slab.ckpt"
    alone = Standalone(root, keep=100)
    newest = max(alone.complete())
    links = alone.links(newest)
    assert len(links) >= 2, links
    middle = links[len(links) // 2]
    damaged = alone._file(middle)
    data = bytearray(damaged.read_bytes())
    data[len(blocks.MAGIC) + 100] ^= 0xFF  # a byte of a stored block: only the signature check sees it
    damaged.write_bytes(bytes(data))
    slab, cp = restore(alone, "latest")
    assert cp.restarted_from is not None and cp.restarted_from < middle  # every newer one needs the damaged link
    assert slab.digest() == states[cp.start]
    why = (ckptstore.gen_dir(root, 0, newest) / "DAMAGED").read_text()
    assert str(damaged) in why and "does not match" in why, why


# ---------------------------------------------------------------- in this process: the interface's edges


class Json(spc.SPC):
    """A plug-in that writes its own file (no buffers): full files, whatever the mode."""

    name = "json"

    def __init__(self, state: dict):
        self.state = state

    def do_ckpt(self, values, iteration):
        self.path.write_text(repr((iteration, self.state)))

    def restart(self):
        import ast

        iteration, state = ast.literal_eval(self.path.read_text())
        self.state.clear()
        self.state.update(state)
        return {}, iteration


class OwnFile(spc.Registered):
    """The default checkpointer with its own do_ckpt: its own file, as before buffers existed."""

    def do_ckpt(self, values, iteration):
        self.path.write_bytes(pickle.dumps((iteration, values)))

    def restart(self):
        iteration, values = pickle.loads(self.path.read_bytes())  # noqa: S301 -- the test's own file
        return values, iteration


def take(alone: Standalone, cp: Checkpointer, k: int) -> None:
    cp.requested = True
    alone.at_boundary(cp, k)


def test_which_plugins_hand_over_buffers():
    assert spc.hands_over(spc.Registered()) and spc.hands_over(Slab())
    assert not spc.hands_over(Json({})) and not spc.hands_over(spc.Callables(save=print, load=print))
    assert not spc.hands_over(OwnFile())  # (a subclass whose do_ckpt is its own keeps writing its file)


@pytest.mark.parametrize("plugin", [Json, OwnFile])
def test_a_plugin_that_writes_its_own_file_keeps_writing_full_files_in_a_delta_mode(tmp_path, plugin):
    state = {"n": 0}
    alone = Standalone(tmp_path / "own", keep=100)
    chosen = plugin(state) if plugin is Json else plugin()
    cp = Checkpointer(alone, background=False, spc=chosen, settings=DeltaSettings.from_options(mode="incremental"))
    cp.values = {"n": state}
    alone.attach(cp)
    for k in range(4):
        state["n"] = k * 10
        take(alone, cp, k)
    assert len(alone.complete()) == 4
    for gen in alone.complete():
        path = alone._file(gen)
        assert not path.read_bytes().startswith(blocks.MAGIC)  # the plug-in's own format
        assert alone.links(gen) == []
        state["n"] = -1
        again = Checkpointer(None, background=False, spc=plugin(state) if plugin is Json else plugin())
        alone.restore(again, gen)
        got = state if plugin is Json else again.restored["n"]
        assert got == {"n": (gen - 1) * 10}


def test_a_plugin_whose_buffers_are_unusable_fails_its_checkpoint_and_the_program_goes_on(tmp_path, capsys):
    class Bad(Slab):
        def buffers(self, values):
            return {"__gangd.mine": self.cells}

    alone = Standalone(tmp_path / "bad", keep=2)
    cp = Checkpointer(alone, background=False, spc=Bad(), settings=DeltaSettings.from_options(mode="adaptive"))
    alone.attach(cp)
    take(alone, cp, 0)
    assert alone.complete() == []
    said = capsys.readouterr().err
    assert "checkpoint failed" in said and "'__gangd.mine'" in said and "names are strings not starting with '__gangd.'" in said


def test_gangd_s_own_entries_ride_along_with_a_plugin_s_buffers(tmp_path):
    """A one-rank world's network context is saved beside the buffers and comes back to gangd, not to the plug-in."""
    slab = Slab()
    slab.step(0)
    path = tmp_path / "f.state"
    mine = {"pending": [1, 2]}
    values = {"x": 1, "__gangd.comm__": mine}
    handed = spc.handed_over(slab, values)
    assert handed is not None and set(handed) == {"cells", "raw", "meta", "__gangd.comm__"}
    result = blocks.save_generation(path, handed, gen=1, mode="adaptive", block=BLOCK)
    back = Slab()
    got, iteration = spc.read(back, path, (result["size"], result["digest"]))
    assert got == {"__gangd.comm__": mine} and iteration == 0
    assert back.digest() == slab.digest()
