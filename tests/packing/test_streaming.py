"""Streaming next-fit: identical to pack_examples on the same input, lazy, and verified."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp

from helpers import BIG, assert_same_batches, both_paths, corpora, example_list, predicting, table_of

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN


def streamed(items, binding, config):
    return list(sp.stream(items, config, partition=TRAIN, binding=binding))


def spans(table, cuts):
    """Consecutive ``(start, stop)`` spans of ``table`` ending at the sorted ``cuts`` (and at its end)."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(table))), len(table)]
    return list(zip(bounds, bounds[1:]))


def chunked(table, cuts):
    """``table`` as consecutive chunks ending at the sorted ``cuts`` (and at its end)."""
    return [table.chunk(a, b) for a, b in spans(table, cuts)]


@pytest.mark.slow
@settings(derandomize=True, max_examples=60, deadline=None)
@given(corpora(max_documents=8), st.integers(0, 8), st.integers(1, 4), st.data())
def test_stream_equals_batch_path(binding, case, extra, max_rows, data):
    documents, options = case
    table, examples = both_paths(documents, options, binding)
    capacity = int(table.lengths.max()) + extra
    config = sp.PackConfig(capacity, max_rows, max_rows * capacity, BIG)
    expected = sp.pack(examples, config, partition=TRAIN, binding=binding).batches
    count = len(table)
    # (a) one SequenceExample at a time
    assert_same_batches(streamed(examples, binding, config), expected)
    # (b) table chunks of random sizes, 1-example chunks included
    cuts = data.draw(st.lists(st.integers(1, max(1, count - 1)), max_size=count))
    assert_same_batches(streamed(chunked(table, cuts), binding, config), expected)
    assert_same_batches(streamed(chunked(table, range(count)), binding, config), expected)
    # (c) a mix: each chunk given as a table or as its examples one by one
    mixed = []
    for start, stop in spans(table, cuts):
        if data.draw(st.booleans()):
            mixed.append(table.chunk(start, stop))
        else:
            mixed.extend(examples[start:stop])
    assert_same_batches(streamed(mixed, binding, config), expected)


def test_final_partial_row_and_call(binding):
    # Next-fit at capacity 5, lengths 3 4 2 5 2 3 4: rows [3] [4] [2] [5] [2 3] [4]; 4 rows per call.
    documents = predicting((3, 4, 2, 5, 2, 3, 4))
    table, examples = table_of(documents, binding), example_list(documents, binding)
    config = sp.PackConfig(5, 4, 20, BIG)
    expected = sp.pack(table, config, partition=TRAIN, binding=binding).batches
    assert [b.shape for b in expected] == [(4, 5), (2, 5)]
    assert expected[-1].valid_lengths.tolist() == [5, 4]  # the final row is partial
    for items in (examples, [table], chunked(table, [1, 2, 3, 5, 6]), [table.chunk(0, 5), *examples[5:]]):
        batches = streamed(items, binding, config)
        assert_same_batches(batches, expected)
        assert [(o.ordinal, o.row, o.segment) for o in batches[-1].occurrences] == [(4, 0, 4), (5, 0, 5), (6, 1, 6)]


def test_exact_fill_at_a_call_boundary(binding):
    """A call whose last row is exactly full is complete only once a later example arrives."""
    documents = predicting((2, 2, 4, 2))
    table, examples = table_of(documents, binding), example_list(documents, binding)
    config = sp.PackConfig(4, 1, 4, BIG)
    expected = sp.pack(table, config, partition=TRAIN, binding=binding).batches
    assert [b.valid_lengths.tolist() for b in expected] == [[4], [4], [2]]
    assert_same_batches(streamed(examples, binding, config), expected)
    assert_same_batches(streamed(examples[:3], binding, config), expected[:2])


def test_stream_is_lazy(binding):
    """The first call arrives from an endless stream; later calls keep counting ordinals."""
    documents = predicting((4, 6, 3, 8, 2))
    examples = example_list(documents, binding)
    config = sp.PackConfig(8, 2, 16, BIG)
    pulled = []

    def endless():
        for ordinal in itertools.count():
            pulled.append(ordinal)
            yield examples[ordinal % len(examples)]

    batches = sp.stream(endless(), config, partition=TRAIN, binding=binding)
    first, second = next(batches), next(batches)
    expected = sp.pack(examples * 4, config, partition=TRAIN, binding=binding).batches
    assert_same_batches([first, second], expected[:2])
    # Next-fit rows [4] [6] | [3] [8] | [2 4] [6] | [3] ...: a call closes when the
    # example opening the next call's first row arrives (ordinals 2, then 4).
    assert len(pulled) == 5
    third = next(batches)
    assert len(pulled) == 8
    assert [(o.ordinal, o.row, o.segment) for o in third.occurrences] == [(4, 0, 4), (5, 0, 5), (6, 1, 6)]
    third.verify()


def test_stream_of_table_chunks_is_lazy(binding):
    table = table_of(predicting((4, 4, 4, 4)), binding)
    config = sp.PackConfig(4, 1, 4, BIG)
    batch = next(sp.stream(itertools.cycle([table.chunk(0, 2)]), config, partition=TRAIN, binding=binding))
    assert batch.valid_lengths.tolist() == [4] and batch.occurrences == [sp.layout.Occurrence(0, 0, range(0, 4), 0)]
    batch.verify()


def test_chunks_of_different_tables_share_a_call(binding):
    left = table_of([[0, 10, 11, 1], [0, 12, 1]], binding, ids=["a", "b"])
    right = table_of([[0, 20, 1], [0, 21, 22, 23, 1]], binding, ids=["c", "d"])
    config = sp.PackConfig(6, 2, 12, BIG)
    batches = streamed([left, right, left.chunk(1, 2)], binding, config)
    examples = [left.example(0), left.example(1), right.example(0), right.example(1), left.example(1)]
    assert_same_batches(batches, sp.pack(examples, config, partition=TRAIN, binding=binding).batches)
    assert [e.id for b in batches for e in b.examples] == ["a", "b", "c", "d", "b"]


def test_stream_errors_name_the_example(binding):
    """Errors raised mid-stream name the offending example by its id and stream ordinal."""
    documents = predicting((2, 3, 7, 2))
    table, examples = table_of(documents, binding, ids=list("abcd")), example_list(documents, binding, ids=list("abcd"))
    config = sp.PackConfig(6, 1, 6, BIG)
    assert len(streamed(examples[:2] + examples[3:], binding, config)) == 2
    for items in (examples, [table.chunk(0, 2), table.chunk(2, 4)], [table]):
        with pytest.raises(sp.CapacityError, match="example 'c' \\(index 2\\) has 7 predictions; capacity is 6"):
            streamed(items, binding, config)


def test_stream_rejects_bad_input(binding):
    table, examples = table_of([[0, 10, 1]], binding), example_list([[0, 10, 1]], binding)
    config = sp.PackConfig(4, 2, 8, BIG)
    assert streamed([], binding, config) == []
    with pytest.raises(sp.InvalidInputError, match="config must be a PackConfig"):
        streamed(examples, binding, sp.PadConfig(rows_per_batch=2, max_cells=8))
    narrow = sp.PackConfig(4, 2, 7, BIG)  # one row fits max_cells, two do not: as pack_examples
    assert len(streamed(examples, binding, narrow)) == 1
    with pytest.raises(sp.CapacityError, match="2 rows x 4 columns has 8 cells; max_cells is 7") as caught:
        streamed(example_list(predicting((4, 4)), binding), binding, narrow)
    assert (caught.value.cells, caught.value.maximum) == (8, 7)
    with pytest.raises(sp.BindingError, match="partition 'train', not 'test'"):
        list(sp.stream([table], config, partition=sp.Partition.TEST, binding=binding))
    with pytest.raises(sp.InvalidInputError, match="is a str, not a SequenceExample"):
        streamed(["text"], binding, config)


def test_empty_chunk_in_a_stream(binding):
    table = table_of([[0, 10, 1], [0, 11, 12, 1]], binding)
    config = sp.PackConfig(4, 1, 4, BIG)
    expected = sp.pack(table, config, partition=TRAIN, binding=binding).batches
    assert_same_batches(streamed([table.chunk(0, 0), table.chunk(0, 1), table.chunk(1, 1), table.chunk(1, 2)],
                               binding, config), expected)


def test_stream_call_budget(binding):
    examples = example_list(predicting((4, 4, 4)), binding)
    config = sp.PackConfig(4, 1, 4, BIG)
    assert len(streamed(examples, binding, config)) == 3
    with pytest.raises(sp.MemoryBudgetError, match="batch 0 needs \\d+ bytes") as caught:
        streamed(examples, binding, sp.PackConfig(4, 1, 4, 1000))
    required = caught.value.required
    assert caught.value.maximum == 1000 < required
    assert len(streamed(examples, binding, sp.PackConfig(4, 1, 4, required))) == 3
    with pytest.raises(sp.MemoryBudgetError, match=f"needs {required} bytes; max_memory_bytes is "
                                                     f"{required - 1}"):
        streamed(examples, binding, sp.PackConfig(4, 1, 4, required - 1))


def test_stream_batches_are_independent_arrays(binding):
    """Yielded calls own their arrays: a later call does not change an earlier one."""
    rng = np.random.default_rng(3)
    documents = [[0, *rng.integers(2, 266, size=int(n)).tolist(), 1] for n in rng.integers(1, 8, size=40)]
    config = sp.PackConfig(8, 2, 16, BIG)
    batches = sp.stream(example_list(documents, binding), config, partition=TRAIN, binding=binding)
    first = next(batches)
    snapshot = first.inputs.copy()
    rest = list(batches)
    np.testing.assert_array_equal(first.inputs, snapshot)
    assert_same_batches([first, *rest], sp.pack(table_of(documents, binding), config, partition=TRAIN, binding=binding).batches)
