"""Audit of the packing and layout layers: each test was a silent wrong answer (or worse) before its fix."""

import numpy as np
import pytest

import seqpack as sp
from seqpack.errors import InvalidInputError, VerificationError
from seqpack.packing.gather import gather_ranges

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def binding():
    return sp.BatchBinding.fixture()


@pytest.fixture(scope="module")
def table(binding):
    lengths = [3, 1, 5, 2, 4]
    tokens = np.array([0] + [99 + i for i in range(max(lengths))] + [1], dtype=np.int32)
    return sp.ExampleTable.from_arrays(tokens, [0, len(tokens)], binding,
                                       ranges=[(0, n + 1) for n in lengths], documents=[0] * len(lengths))


def test_plan_batch_rows_rejects_numbers_outside_the_plan(table, binding):
    plan = sp.plan(table, sp.PackConfig(5, 3), partition=TRAIN, binding=binding)
    assert plan.row_count == 4 and len(plan) == 2 and [plan.batch_rows(i) for i in range(2)] == [3, 1]
    assert plan.batch_rows(np.int64(1)) == 1
    # Before: -1 gave 3 rows, 2 gave -2 rows, 5 gave -11, True gave batch 1's rows.
    for number in (-1, 2, 5, True, 1.0, np.int64(INT64_MAX)):
        with pytest.raises(InvalidInputError, match="outside this plan"):
            plan.batch_rows(number)


@pytest.mark.parametrize("pad", [False, True])
def test_verify_catches_an_unsupervised_real_target(table, binding, pad):
    if pad:
        batch = sp.pad(table, sp.PadConfig(2), partition=TRAIN, binding=binding)[1]
    else:
        batch = sp.pack(table, sp.PackConfig(6, 3), partition=TRAIN, binding=binding)[0]
    batch.verify()
    loss_mask = batch.loss_mask.copy()
    loss_mask[0, 2] = False  # a real target dropped from the loss: the denominator shrinks
    batch.loss_mask = loss_mask
    with pytest.raises(VerificationError, match="row 0, column 2") as raised:
        batch.verify()
    assert (raised.value.row, raised.value.column) == (0, 2)


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_epoch_index_rejects_bool(table, binding, policy):
    packed = sp.pack(table, sp.PackConfig(6, 1), partition=TRAIN, binding=binding, policy=policy)
    padded = sp.pad(table, sp.PadConfig(2), partition=TRAIN, binding=binding)
    for epoch in (packed, padded):
        assert epoch[np.int64(1)] is epoch[1]
        for index in (True, False, np.True_):
            with pytest.raises(InvalidInputError, match="bool"):
                epoch[index]  # before: True was batch 1, False batch 0
    with pytest.raises(InvalidInputError, match="bool"):
        packed.batches[True]


def test_gather_ranges_place_past_int64_is_an_error():
    source = np.arange(10, dtype=np.int32)
    # Before: at + length wrapped negative; with out=None numpy raised a foreign error,
    # with out given the kernel wrote past the end of out (heap corruption).
    with pytest.raises(InvalidInputError, match="range 0 at place"):
        gather_ranges(source, [0], [3], at=[INT64_MAX - 1])
    with pytest.raises(InvalidInputError, match="range 1 at place"):
        gather_ranges(source, [0, 0], [3, 3], at=[0, INT64_MAX - 1], out=np.zeros(10, np.int32))
    # A place whose range ends exactly at the int64 limit is not refused for that reason.
    with pytest.raises(InvalidInputError, match="out must be"):
        gather_ranges(source, [0], [3], at=[INT64_MAX - 3], out=np.zeros(10, np.int32))


def test_gather_ranges_rejects_overlapping_places():
    source = np.arange(10, dtype=np.int32)
    # Before: [0, 5, 6, 7], range 0 silently overwritten by range 1.
    with pytest.raises(InvalidInputError, match="range 0 at place 0 .* overlaps range 1 at place 1"):
        gather_ranges(source, [0, 5], [3, 8], at=[0, 1])
    with pytest.raises(InvalidInputError, match="range 1 at place 0 .* overlaps range 2 at place 2"):
        gather_ranges(source, [0, 5, 1], [3, 8, 2], at=[6, 0, 2], out=np.zeros(9, np.int32))
    # Touching and out-of-order places are fine, and an empty range overlaps nothing.
    assert gather_ranges(source, [0, 5], [3, 8], at=[3, 0]).tolist() == [5, 6, 7, 0, 1, 2]
    assert gather_ranges(source, [0, 5, 2], [3, 8, 2], at=[0, 3, 1]).tolist() == [0, 1, 2, 5, 6, 7]


def test_gather_ranges_gaps_are_zero_not_uninitialized():
    source = np.arange(1, 11, dtype=np.int32)
    for _ in range(20):  # fresh allocations may reuse freed, dirty memory
        np.full(4096, 7, np.int32)
        out = gather_ranges(source, [0, 5], [2, 7], at=[0, 4000])
        assert out.shape == (4002,)
        assert out[:2].tolist() == [1, 2] and out[4000:].tolist() == [6, 7]
        assert not out[2:4000].any()


def test_a_plan_is_indexed_like_a_dataset(table, binding):
    """``plan[i]`` indexes like a dataset on disk: batch(i), negative numbers, slices."""
    plan = sp.plan(table, sp.PackConfig(5, 2), partition=TRAIN, binding=binding)
    for number in range(len(plan)):
        assert np.array_equal(plan[number].inputs, plan.batch(number).inputs)
    assert np.array_equal(plan[-1].inputs, plan.batch(len(plan) - 1).inputs)
    assert [b.target_count for b in plan[1:5]] == [plan.batch(i).target_count for i in range(1, len(plan))]
    for bad in (len(plan), -len(plan) - 1, True):
        with pytest.raises(InvalidInputError, match=rf"batch {bad!r} is outside (this plan's|the) batches \[0, {len(plan)}\)"):
            plan[bad]


def test_reuse_buffers_must_be_a_bool(table, binding):
    """The string "False" is truthy: it would hand out shared buffers the caller did not ask for."""
    plan = sp.plan(table, sp.PackConfig(5, 2), partition=TRAIN, binding=binding)
    with pytest.raises(InvalidInputError, match="reuse_buffers must be a bool"):
        next(plan.batches(reuse_buffers="False"))
    assert len(list(plan.batches(reuse_buffers=np.bool_(True)))) == len(plan)


def test_a_stream_names_a_bad_example_by_its_place_in_the_stream(table, binding):
    """The third example of a stream is index 2, not its place in its own one-item list."""
    other = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="elsewhere")
    stranger = sp.ExampleTable.from_texts(["xyz"], other, capacity=16).example(0)
    items = [table.example(0), table.example(1), stranger]
    with pytest.raises(sp.BindingError, match=r"\(index 2\) was built under a different binding"):
        list(sp.stream(items, sp.PackConfig(16, 2), partition=TRAIN, binding=binding))
    with pytest.raises(InvalidInputError, match="example 1 is a str"):
        list(sp.stream([table.example(0), "text"], sp.PackConfig(16, 2), partition=TRAIN, binding=binding))
