"""Shared helpers for issue 17's tests (incremental checkpoints): a sparse-update app, chains of generations on disk,
damaging a v2 file's index the way an owner who can write it could, and the version 1 writer (old generations)."""

from __future__ import annotations

import copy
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from gangd.checkpoint import round as rd
from gangd.ckptlib import blocks

# ---------------------------------------------------------------- version 1 (read only in gangd now)


def save_v1(path: Path, values: dict, iteration: int, extra: dict | None = None) -> tuple[int, str]:
    """A version 1 file (``GANGDCK1``), exactly as gangd wrote them before issue 17; returns (size, xxh3-128)."""
    entries, payloads = [], []
    for name, value in values.items():
        if type(value) is np.ndarray:
            arr = np.ascontiguousarray(value) if not value.flags.c_contiguous else value
            simple = arr.dtype.names is None and arr.dtype.subdtype is None
            dtype = arr.dtype.str if simple else pickle.dumps(arr.dtype, protocol=pickle.HIGHEST_PROTOCOL)
            entries.append([name, "nd", {"dtype": dtype, "shape": list(arr.shape)}, arr.nbytes])
            payloads.append(arr.tobytes())
        else:
            blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            entries.append([name, "pk", {}, len(blob)])
            payloads.append(blob)
    header = msgpack.packb({"v": 1, "iteration": iteration, "entries": entries, "extra": extra or {}}, use_bin_type=True)
    data = b"GANGDCK1" + struct.pack("<Q", len(header)) + header + b"".join(payloads)
    Path(path).write_bytes(data)
    return len(data), xxhash.xxh3_128_hexdigest(data)


# ---------------------------------------------------------------- a v2 file's parts


def footer(path: Path) -> tuple[int, int]:
    """(index offset, index length) of a v2 file."""
    data = Path(path).read_bytes()
    offset, length, _, end = blocks.FOOTER.unpack_from(data, len(data) - blocks.FOOTER.size)
    assert end == blocks.END
    return offset, length


def rewrite_index(path: Path, change) -> None:
    """Replace a v2 file's index by ``change(head: dict, raw: bytes) -> (head, raw)`` and fix the footer's checksum:
    what a user who can write the file can do (the checksum catches accidents, not intent)."""
    data = Path(path).read_bytes()
    offset, length = footer(path)
    index = data[offset : offset + length]
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(index)
    head = unpacker.unpack()
    head, raw = change(head, index[unpacker.tell() :])
    new = msgpack.packb(head, use_bin_type=True) + raw
    Path(path).write_bytes(data[:offset] + new + blocks.FOOTER.pack(offset, len(new), xxhash.xxh3_128_digest(new), blocks.END))


def refresh_index_hash(data: bytes) -> bytes:
    """``data`` (a damaged v2 file) with its footer's index checksum recomputed, if its footer still places an index."""
    if len(data) < blocks.FOOTER.size + len(blocks.MAGIC):
        return data
    offset, length, _, end = blocks.FOOTER.unpack_from(data, len(data) - blocks.FOOTER.size)
    if end != blocks.END or offset + length + blocks.FOOTER.size != len(data):
        return data
    index = data[offset : offset + length]
    return data[: offset + length] + blocks.FOOTER.pack(offset, length, xxhash.xxh3_128_digest(index), blocks.END)


# ---------------------------------------------------------------- an app and its generations


class SparseApp:
    """A program's protected state that changes a few blocks per iteration: arrays whose sizes no block size divides,
    a 0-d and a 0-byte array, and a pickled log that sometimes grows."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.values: dict[str, object] = {
            "u": self.rng.random(50_001),  # 400,008 bytes
            "ids": np.arange(30_011, dtype=np.int32),
            "grid": self.rng.random((37, 41)).astype(np.float32),
            "scalar": np.array(1.5),
            "empty": np.zeros((0, 4)),
            "log": {"steps": [0], "note": "x"},
        }

    def step(self, touches: int = 3) -> None:
        u, ids, grid = self.values["u"], self.values["ids"], self.values["grid"]
        assert isinstance(u, np.ndarray) and isinstance(ids, np.ndarray) and isinstance(grid, np.ndarray)
        for _ in range(touches):
            target = (u, ids, grid)[int(self.rng.integers(0, 3))].reshape(-1)
            target[int(self.rng.integers(0, target.size))] += 1
        self.values["scalar"] = np.array(float(self.rng.random()))
        if self.rng.random() < 0.3:
            log = self.values["log"]
            assert isinstance(log, dict)
            log["steps"].append(len(log["steps"]))

    def snapshot(self) -> dict:
        return copy.deepcopy(self.values)


@dataclass
class Generations:
    """Generations written in one directory (``gen-G.state``), each with the result save_generation returned."""

    directory: Path
    results: dict[int, dict] = field(default_factory=dict)

    def path(self, gen: int) -> Path:
        return self.directory / f"gen-{gen}.state"

    def chain(self, gen: int) -> list[tuple[int, Path, tuple[int, str]]]:
        """The links of ``gen`` as read_chain takes them (with each link's expected size and checksum)."""
        return [(link, self.path(link), (self.results[link]["size"], self.results[link]["digest"])) for link in self.results[gen]["links"]]

    def offer(self, gen: int) -> list[tuple[int, Path, tuple[int, str]]]:
        """``gen`` and its chain: what a next generation is offered."""
        return [(gen, self.path(gen), (self.results[gen]["size"], self.results[gen]["digest"])), *self.chain(gen)]

    def write(self, gen: int, values: dict, parent: int | None, **options) -> dict:
        offered = self.offer(parent) if parent is not None else []
        result = blocks.save_generation(self.path(gen), values, gen=gen, iteration=gen * 10, offered=offered, **options)
        self.results[gen] = result
        return result

    def restore(self, gen: int, stats: dict | None = None):
        result = self.results[gen]
        return blocks.read_chain(self.path(gen), self.chain(gen), (result["size"], result["digest"]), stats=stats)


def assert_same_values(restored: dict, original: dict) -> None:
    assert list(restored) == list(original)
    for name, want in original.items():
        got = restored[name]
        if isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray), name
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.tobytes() == want.tobytes(), name
        else:
            assert got == want, name


# ---------------------------------------------------------------- the checkpoint round, up to its commit


def round_at_commit() -> rd.Round:
    """Job 7's round of generation 5 on n1 and n2, every phase answered up to the commit (its answers are the test's)."""
    r = rd.Round(job=7, gen=5, lineage=7, nodes=frozenset({"n1", "n2"}), trigger="t", started=0.0, placement=["n1", "n2"],
                 expect=lambda counters, n: {}, nranks=2)
    r.handle(rd.Start(5))
    for phase in (rd.Phase.BEGIN, rd.Phase.CUT, rd.Phase.CAPTURE, rd.Phase.RESUME):
        for node in ("n1", "n2"):
            r.handle(rd.Answered(5, phase, node, {"iteration": 3} if phase is rd.Phase.BEGIN else {}))
    return r
