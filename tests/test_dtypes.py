"""Dtypes in a checkpoint's index: described as data, rebuilt by numpy's public constructor, never by its unpickling.

numpy's own unpickling of a dtype trusts the pickled state; fuzzing old
(format 1) files found flipped bytes that crashed the reading process
(SIGSEGV in ``numpy.dtype.__setstate__``) and a damaged length that made
CPython's unpickler allocate exabytes. These tests run the readers in this
process: a crash fails the run.
"""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd.ckptlib import dtypes

DTYPES = [
    np.dtype("<f8"), np.dtype(">i2"), np.dtype("?"), np.dtype("S5"), np.dtype("<U3"), np.dtype("V16"), np.dtype("<M8[s]"),
    np.dtype(">m8[10ms]"), np.dtype("<c16"),
    np.dtype([("a", "u1"), ("b", "<f8")]),
    np.dtype([("a", "u1"), ("b", "<f8")], align=True),
    np.dtype([("x", "<f4", (2, 3)), ("s", "S5"), ("u", "<U3"), ("t", "<M8[s]"), ("n", [("p", ">i2"), ("v", "V3")])]),
    np.dtype({"names": ["a", "b"], "formats": ["<i4", "<i4"], "offsets": [0, 2], "itemsize": 8}),  # (overlapping fields)
    np.dtype({"names": ["a"], "formats": ["<i4"], "offsets": [8], "itemsize": 16}),  # (padding before and after)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_an_array_can_have_comes_back_the_same_through_the_index_and_from_an_old_pickle(dtype):
    description = msgpack.unpackb(msgpack.packb(dtypes.describe(dtype)), raw=False)
    for rebuilt in (dtypes.build(description), dtypes.from_pickle(pickle.dumps(dtype, protocol=pickle.HIGHEST_PROTOCOL))):
        assert rebuilt == dtype and rebuilt.itemsize == dtype.itemsize
        assert [rebuilt.fields[n][1] for n in rebuilt.names or ()] == [dtype.fields[n][1] for n in dtype.names or ()]
        a = np.arange(4 * dtype.itemsize, dtype=np.uint8).view(dtype)
        assert a.view(rebuilt).tobytes() == a.tobytes()


@pytest.mark.parametrize("spec", [
    "O", "<f8,<i4", {"names": ["a"], "formats": ["O"], "offsets": [0], "itemsize": 8},
    {"names": ["a"], "formats": ["<f8"], "offsets": [4], "itemsize": 8},  # (a field past the end)
    {"names": ["a", "a"], "formats": ["<f8", "<f8"], "offsets": [0, 8], "itemsize": 16},
    {"names": [], "formats": [], "offsets": [], "itemsize": 0}, {"sub": "<f8", "shape": [-1]}, {"sub": "<f8", "shape": []},
    {"names": ["a"], "formats": ["<f8"], "offsets": [-8], "itemsize": 8}, {"names": ["a"], "formats": ["<f8"], "offsets": [0], "itemsize": 1 << 40},
    12, None, [1, 2], {"sub": {"sub": {"sub": {"sub": {"sub": {"sub": {"sub": {"sub": {"sub": "<f8", "shape": [1]}, "shape": [1]}, "shape": [1]},
                                                                 "shape": [1]}, "shape": [1]}, "shape": [1]}, "shape": [1]}, "shape": [1]}, "shape": [1]},
])
def test_descriptions_that_are_not_plain_data_are_refused(spec):
    with pytest.raises(ValueError):
        dtypes.build(spec)


def test_an_old_pickle_of_anything_but_a_dtype_is_refused_without_running_it():
    for thing in (np.zeros(3), {"a": 1}, np.dtype("O"), np.dtype([("o", "O")])):
        with pytest.raises((ValueError, pickle.UnpicklingError)):
            dtypes.from_pickle(pickle.dumps(thing, protocol=pickle.HIGHEST_PROTOCOL))


BLOBS = [pickle.dumps(d, protocol=p) for d in DTYPES[9:13] for p in (2, pickle.HIGHEST_PROTOCOL)]


# (the damage drawn as plain values, each position taken modulo the blob's length: strategies built once,
# not inside every example through st.data() -- that cost 80 s of the suite for 600 examples)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=st.sampled_from(BLOBS), flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 1 << 16))
def test_damaged_old_pickles_fail_with_an_error_never_a_crash_or_a_huge_allocation(source, flips, cut):
    blob = bytearray(source)
    for where, xor in flips:
        blob[where % len(blob)] ^= xor
    if cut is not None:
        blob = blob[: cut % (len(blob) + 1)]
    try:
        dtype = dtypes.from_pickle(bytes(blob))
    except Exception:  # noqa: BLE001 -- any error is the point; a crash or a MemoryError's allocation is not
        return
    assert isinstance(dtype, np.dtype) and not dtype.hasobject
    np.empty(2, dtype=dtype)  # (a dtype that came back is usable)
