"""Complete causal windows and mini-batch epochs (the chapter's fixed-window contrast)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import BatchDocument, CapacityError, InvalidInputError, Partition
from seqpack.data import BatchOrder, CausalWindowConfig, MiniBatchConfig, MiniBatchEpoch

SHORT = BatchDocument("short", [0, 99, 1])
LONG = BatchDocument("long", [0, 100, 101, 102, 1])


def reference_windows(tokens, context, stride):
    """Every (document index, start, inputs, targets) by a plain loop."""
    out = []
    start = 0
    while start + context + 1 <= len(tokens):
        inputs = list(tokens[start : start + context])
        out.append((start, inputs, list(tokens[start + 1 : start + context + 1])))
        start += stride
    return out


def test_chapter_contrast_context_4_stride_4():
    epoch = MiniBatchEpoch.build(
        Partition.TRAIN, [SHORT, LONG], CausalWindowConfig(4, 4), MiniBatchConfig(2, BatchOrder.SEQUENTIAL)
    )
    assert len(epoch.batches) == 1
    (batch,) = epoch.batches
    assert batch.inputs.tolist() == [[0, 100, 101, 102]]
    assert batch.targets.tolist() == [[100, 101, 102, 1]]
    assert batch.document_indices.tolist() == [1] and batch.starts.tolist() == [0]
    assert batch.token_count == 4 and epoch.token_count == 4 and epoch.window_count == 1
    # Variable full-document examples would supply 2 + 4 = 6 targets.
    assert sum(len(d) - 1 for d in (SHORT, LONG)) == 6


def test_windows_exact_and_one_short():
    config = CausalWindowConfig(4, 4)
    assert list(config.windows([0, 99, 1])) == []
    assert config.window_count(4) == 0 and config.window_count(5) == 1
    # numpy's unsigned scalars wrapped below zero (review: np.uint8(3) gave 64 windows)
    assert [config.window_count(kind(3)) for kind in (np.uint8, np.uint32, np.uint64, np.int8)] == [0] * 4
    assert config.window_count(np.uint64(9)) == 2 and len(config.window_starts(np.uint8(3))) == 0
    for bad, message in ((-1, "token_count must be at least 0"), (10.5, "token_count must be an int")):
        with pytest.raises(InvalidInputError, match=message):
            config.window_count(bad)
    (window,) = config.windows(LONG.token_ids)
    assert window.inputs.tolist() == [0, 100, 101, 102]
    assert window.targets.tolist() == [100, 101, 102, 1]
    assert window.inputs.dtype == np.int32 and len(window) == 4
    assert not window.inputs.flags.writeable
    overlapping = CausalWindowConfig(2, 1)
    assert [w.inputs.tolist() for w in overlapping.windows([0, 1, 2, 3])] == [[0, 1], [1, 2]]
    assert config.window_starts(13).tolist() == [0, 4, 8]
    assert config.window_starts(12).tolist() == [0, 4]


@settings(derandomize=True, max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 30), max_size=40),
    st.integers(1, 6),
    st.integers(1, 6),
)
def test_windows_equal_reference(tokens, context, stride):
    config = CausalWindowConfig(context, stride)
    got = [(w.inputs.tolist(), w.targets.tolist()) for w in config.windows(np.array(tokens, dtype=np.int64))]
    expected = [(i, t) for _, i, t in reference_windows(tokens, context, stride)]
    assert got == expected
    assert config.window_count(len(tokens)) == len(expected)


documents_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 300), max_size=20), st.sampled_from(list(Partition))),
    max_size=8,
)


@settings(derandomize=True, max_examples=80, deadline=None)
@given(documents_strategy, st.integers(1, 5), st.integers(1, 5), st.integers(1, 4))
def test_sequential_epoch_equals_reference(specs, context, stride, batch_size):
    documents = [BatchDocument(f"d{i}", tokens, part) for i, (tokens, part) in enumerate(specs)]
    epoch = MiniBatchEpoch.build(
        Partition.TRAIN, documents, CausalWindowConfig(context, stride), MiniBatchConfig(batch_size)
    )
    expected = [
        (index, start, inputs, targets)
        for index, (tokens, part) in enumerate(specs)
        if part is Partition.TRAIN
        for start, inputs, targets in reference_windows(tokens, context, stride)
    ]
    got = [
        (int(d), int(s), i.tolist(), t.tolist())
        for batch in epoch.batches
        for d, s, i, t in zip(batch.document_indices, batch.starts, batch.inputs, batch.targets)
    ]
    assert got == expected
    sizes = [len(batch) for batch in epoch.batches]
    assert all(size == batch_size for size in sizes[:-1])
    assert not sizes or 1 <= sizes[-1] <= batch_size
    assert epoch.token_count == len(expected) * context
    for batch in epoch.batches:
        assert batch.inputs.dtype == batch.targets.dtype == np.int32
        assert batch.inputs.shape == batch.targets.shape == (len(batch), context)


def test_final_batch_keeps_its_size():
    documents = [BatchDocument(f"d{i}", np.arange(i, i + 6)) for i in range(5)]
    epoch = MiniBatchEpoch.build(Partition.TRAIN, documents, CausalWindowConfig(3, 3), MiniBatchConfig(2))
    assert [len(b) for b in epoch.batches] == [2, 2, 1]
    assert epoch.batches[-1].inputs.tolist() == [[4, 5, 6]]


def test_partition_filter_and_empty_epoch():
    held_out = BatchDocument("v", [0, 5, 6, 7, 8, 1], Partition.VALIDATION)
    config = CausalWindowConfig(4, 4)
    epoch = MiniBatchEpoch.build(Partition.VALIDATION, [LONG, held_out], config, MiniBatchConfig(2))
    assert [b.document_indices.tolist() for b in epoch.batches] == [[1]]
    assert epoch.batches[0].inputs.tolist() == [[0, 5, 6, 7]]
    empty = MiniBatchEpoch.build(Partition.TEST, [LONG, held_out], config, MiniBatchConfig(2))
    assert empty.batches == () and empty.token_count == 0
    nothing = MiniBatchEpoch.build(Partition.TRAIN, [], config, MiniBatchConfig(2))
    assert nothing.batches == ()


def test_documents_may_come_from_a_generator_and_configs_are_checked():
    # A generator was used up by the type check and gave an empty epoch (review).
    config = CausalWindowConfig(2, 1)
    listed = MiniBatchEpoch.build(Partition.TRAIN, [LONG, SHORT], config, MiniBatchConfig(3))
    generated = MiniBatchEpoch.build(Partition.TRAIN, (d for d in (LONG, SHORT)), config, MiniBatchConfig(3))
    assert generated.window_count == listed.window_count > 0
    assert [b.inputs.tolist() for b in generated.batches] == [b.inputs.tolist() for b in listed.batches]
    for args, message in ((((2, 1), MiniBatchConfig(3)), "window_config must be a CausalWindowConfig, got tuple"),
                          ((config, 3), "minibatch_config must be a MiniBatchConfig, got int")):
        with pytest.raises(InvalidInputError, match=message):
            MiniBatchEpoch.build(Partition.TRAIN, [LONG], *args)


def _shuffled(seed):
    documents = [BatchDocument(f"d{i}", np.arange(10 * i, 10 * i + 9)) for i in range(6)]
    return MiniBatchEpoch.build(
        Partition.TRAIN, documents, CausalWindowConfig(2, 2), MiniBatchConfig(3, BatchOrder.SHUFFLED, seed)
    )


def _rows(epoch):
    return [row for batch in epoch.batches for row in batch.inputs.tolist()]


def test_shuffled_epochs_are_deterministic_per_seed():
    first, again, other = _shuffled(7), _shuffled(7), _shuffled(8)
    assert _rows(first) == _rows(again)
    assert _rows(first) != _rows(other)
    sequential = MiniBatchEpoch.build(
        Partition.TRAIN,
        [BatchDocument(f"d{i}", np.arange(10 * i, 10 * i + 9)) for i in range(6)],
        CausalWindowConfig(2, 2),
        MiniBatchConfig(3),
    )
    assert sorted(_rows(first)) == sorted(_rows(sequential)) and _rows(first) != _rows(sequential)
    order = np.random.default_rng(7).permutation(24)
    assert _rows(first) == [_rows(sequential)[k] for k in order]
    for batch in first.batches:  # every shuffled row still pairs with its own target
        assert (batch.targets[:, 0] == batch.inputs[:, 1]).all()
        assert (batch.inputs[:, 0] == batch.document_indices * 10 + batch.starts).all()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: CausalWindowConfig(0, 1), "context_length"),
        (lambda: CausalWindowConfig(2, 0), "stride"),
        (lambda: CausalWindowConfig(2.0, 1), "context_length"),
        (lambda: MiniBatchConfig(0), "batch_size"),
        (lambda: MiniBatchConfig(1, "shuffled"), "BatchOrder"),
        (lambda: MiniBatchConfig(1, BatchOrder.SHUFFLED, -1), "seed"),
        (
            lambda: MiniBatchEpoch.build("train", [LONG], CausalWindowConfig(1, 1), MiniBatchConfig(1)),
            "Partition",
        ),
        (
            lambda: MiniBatchEpoch.build(
                Partition.TRAIN, [[0, 1]], CausalWindowConfig(1, 1), MiniBatchConfig(1)
            ),
            "documents\\[0\\]",
        ),
    ],
)
def test_bad_configs(build, match):
    with pytest.raises(InvalidInputError, match=match):
        build()


def test_window_sizes_past_int32_are_refused_where_they_enter():
    # 2**63 was accepted, and windows() then raised OverflowError (review).
    for context, stride in ((2**63, 1), (1, 2**63), (2**31, 1)):
        with pytest.raises(InvalidInputError, match=r"(context_length|stride) is \d+; the maximum is 2147483647"):
            CausalWindowConfig(context, stride)
    assert CausalWindowConfig(2**31 - 1, 2**31 - 1).window_count(2**31) == 1


def test_smallest_valid_configs():
    assert CausalWindowConfig(1, 1).window_count(2) == 1
    assert MiniBatchConfig(1, BatchOrder.SHUFFLED, 0).seed == 0


def test_refuse_long_names_the_first_item_over_the_limit():
    from seqpack.data.windows import refuse_long

    refuse_long(np.array([3, 4, 4]), 4, str)  # at the limit: nothing to refuse
    refuse_long(np.zeros(0, np.int64), 4, str)
    with pytest.raises(CapacityError, match=r"^item 1 has 6 predictions; max_width is 4 \(cut it\)$") as caught:
        refuse_long(np.array([4, 6, 9]), 4, lambda index: f"item {index}", limit_name="max_width", hint=" (cut it)")
    assert (caught.value.cells, caught.value.maximum) == (6, 4)
