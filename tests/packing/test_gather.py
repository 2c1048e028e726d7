"""The gather kernel that writes a packed dataset's tokens in placement order, against numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.packing.gather import gather_ranges

pytestmark = pytest.mark.kernel


@settings(derandomize=True, max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=0, max_size=12),
       st.sampled_from([np.uint16, np.int32]), st.sampled_from([np.uint16, np.int32]), st.booleans())
def test_gather_equals_concatenated_slices(spans, source_type, out_type, placed):
    source = (np.arange(80) * 7 % 65_000).astype(source_type)
    begins = np.array([min(a, 80) for a, _ in spans], dtype=np.int64)
    ends = np.minimum(begins + np.array([n for _, n in spans], dtype=np.int64), 80)
    pieces = [source[a:b] for a, b in zip(begins.tolist(), ends.tolist())]
    expected = np.concatenate(pieces).astype(out_type) if pieces else np.zeros(0, out_type)
    if not placed:
        assert np.array_equal(gather_ranges(source, begins, ends, out_type), expected)
        return
    # Each range at a place given in reverse order: the result is the reversed concatenation.
    sizes = ends - begins
    at = np.cumsum(sizes[::-1])[::-1] - sizes
    out = gather_ranges(source, begins, ends, out_type, out=np.full(int(sizes.sum()), 9, out_type), at=at)
    reverse = [p.astype(out_type) for p in pieces[::-1]]
    assert np.array_equal(out, np.concatenate(reverse) if reverse else expected)


def test_a_memory_map_source(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype="<u2").tofile(path)
    mapped = np.memmap(path, dtype="<u2", mode="r")
    assert gather_ranges(mapped, [90, 0], [92, 3], np.int32).tolist() == [90, 91, 0, 1, 2]


@pytest.mark.parametrize("call, message", [
    (lambda s: gather_ranges(s, [0], [11]), r"range 0 \[0, 11\) is not inside the source of 10 tokens"),
    (lambda s: gather_ranges(s, [3], [2]), r"range 0 \[3, 2\) is not inside"),
    (lambda s: gather_ranges(s, [-1], [2]), r"range 0 \[-1, 2\) is not inside"),
    (lambda s: gather_ranges(s, [0, 1], [2]), "begins has 2 entries, ends 1"),
    (lambda s: gather_ranges(s, [0], [2], np.int64), "dtype must be uint16 or int32"),
    (lambda s: gather_ranges(s.astype(np.int64), [0], [2]), "source must be a 1-D uint16 or int32 array"),
    (lambda s: gather_ranges(s, [0], [2], out=np.zeros(1, np.int32)), "at least 2 tokens"),
    (lambda s: gather_ranges(s, [0], [2], out=np.zeros(2, np.uint16)), "int32 array"),
    (lambda s: gather_ranges(s, [0], [2], at=[-1]), "one non-negative place per range"),
    (lambda s: gather_ranges(s, [5, 0], [10, 5], out=s), "out overlaps source in memory"),
])
def test_bad_arguments(call, message):
    with pytest.raises(sp.InvalidInputError, match=message):
        call(np.arange(10, dtype=np.int32))
    # The exact-limit twin: the whole source, in an output of exactly its size.
    assert gather_ranges(np.arange(10, dtype=np.int32), [0], [10], out=np.zeros(10, np.int32)).tolist() == list(range(10))


def test_an_out_that_aliases_the_bounds_is_refused():
    # out = ends.view(int32) passed the checks; the kernel then rewrote ends mid-copy and read
    # far past the source (a segfault) (review).
    source = np.arange(8, dtype=np.int32)
    begins, ends, at = np.array([0, 1], np.int64), np.array([1, 1], np.int64), np.array([0, 1], np.int64)
    for name, out in (("ends", ends.view(np.int32)), ("begins", begins.view(np.int32)), ("at", at.view(np.int32))):
        with pytest.raises(sp.InvalidInputError, match=f"out overlaps {name} in memory"):
            gather_ranges(source, begins, ends, out=out, at=at if name == "at" else None)
    assert ends.tolist() == [1, 1] and gather_ranges(source, begins, ends).tolist() == [0]



def test_an_out_that_overlaps_a_strided_source_is_refused():
    # The check compared out with the contiguous copy of a strided source, so an out over
    # the caller's source passed and the gather overwrote it (review).
    memory = np.arange(20, dtype=np.int32)
    source, out = memory[::2], memory[10:15]
    with pytest.raises(sp.InvalidInputError, match="out overlaps source in memory"):
        gather_ranges(source, [0], [5], out=out)
    assert memory.tolist() == list(range(20))
