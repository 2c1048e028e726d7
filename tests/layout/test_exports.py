"""The numpy exports of a batch's metadata: values on the ch05 fixture, dtypes, the int32
limit with its exact twin, and a round trip that rebuilds ``allowed_key`` exactly."""

import numpy as np
import pytest

import seqpack as sp
from seqpack.chapters.fixtures import chapter_batch
from seqpack.layout.exports import cumulative_lengths

from packed_cases import packed_plan, padded_epoch, random_predictions


def test_the_ch05_fixture():
    batch = chapter_batch("packed", sp.BatchBinding.fixture())
    assert sp.document_ids(batch).tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert sp.position_ids(batch).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert sp.seq_lens(batch).tolist() == [3, 2, 4]
    assert sp.cu_seqlens(batch).tolist() == [0, 3, 5, 9]
    assert sp.max_seqlen(batch) == 4 and type(sp.max_seqlen(batch)) is int


def test_dtypes_and_fresh_arrays():
    batch = chapter_batch("padded", sp.BatchBinding.fixture())
    exported = {"position_ids": (sp.position_ids(batch), np.int64), "document_ids": (sp.document_ids(batch), np.int32),
                "seq_lens": (sp.seq_lens(batch), np.int32), "cu_seqlens": (sp.cu_seqlens(batch), np.int32)}
    for name, (array, dtype) in exported.items():
        assert array.dtype == dtype, name
        assert array.flags.writeable and not np.shares_memory(array, batch.positions), name
    assert sp.cu_seqlens(batch).tolist() == [0, 2, 6]  # ch04: rows of 2 and 4 valid tokens
    assert sp.document_ids(batch).tolist() == [[0, 0, -1, -1], [1, 1, 1, 1]]


def test_cu_seqlens_stops_at_the_int32_limit_before_allocating():
    at_limit = cumulative_lengths(np.array([2**30, 2**30 - 1]))
    assert at_limit.dtype == np.int32 and at_limit.tolist() == [0, 2**30, 2**31 - 1]
    with pytest.raises(sp.InvalidInputError, match=r"2147483648 valid tokens; cu_seqlens is int32"):
        cumulative_lengths(np.array([2**30, 2**30]))


def test_a_batch_is_required():
    with pytest.raises(sp.InvalidInputError, match="expected a padded or packed batch, not dict"):
        sp.cu_seqlens({"positions": np.zeros((1, 1))})


def allowed_from_document_ids(batch):
    """Permission rebuilt from ``document_ids`` and ``position_ids`` alone."""
    doc, pos = sp.document_ids(batch), sp.position_ids(batch)
    return (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & (pos[:, None, :] <= pos[:, :, None])


def allowed_from_cu_seqlens(batch):
    """Permission rebuilt from ``cu_seqlens`` over the flattened valid tokens and ``token_valid``."""
    rows, width = batch.shape
    cu = sp.cu_seqlens(batch)
    flat_cells = np.flatnonzero(batch.token_valid)  # the flattened batch, row-major
    allowed = np.zeros((rows, width, width), dtype=bool)
    for begin, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        cells = flat_cells[begin:end]
        row, columns = cells // width, cells % width
        assert (row == row[0]).all() and (np.diff(columns) == 1).all()  # one contiguous run of one row
        for i, query in enumerate(columns):
            allowed[row[0], query, columns[: i + 1]] = True
    assert len(cu) - 1 == len(sp.seq_lens(batch)) and sp.max_seqlen(batch) == int(np.diff(cu).max())
    return allowed


@pytest.mark.parametrize("seed", range(6))
def test_exports_rebuild_allowed_key_exactly(seed):
    rng = np.random.default_rng(seed)
    predictions = random_predictions(rng, int(rng.integers(3, 9)), 9)
    policy = ["next-fit", "best-fit-decreasing"][seed % 2]
    batches = list(packed_plan(predictions, 10, 2, seed, policy)) + list(padded_epoch(predictions, 3, seed))
    for batch in batches:
        rows, width = batch.shape
        truth = np.array([[[batch.allowed_key(r, q, k) for k in range(width)] for q in range(width)]
                          for r in range(rows)])
        assert truth.any()
        np.testing.assert_array_equal(allowed_from_document_ids(batch), truth)
        np.testing.assert_array_equal(allowed_from_cu_seqlens(batch), truth)
        assert sp.seq_lens(batch).tolist() == [len(o.columns) for o in batch.occurrences]


def test_the_dense_mask_is_refused_past_its_memory_budget_before_any_allocation():
    """A (1, 131072) batch, which pack builds in a few MiB, asked numpy for 16 GiB at once:
    a raw MemoryError, or several 16 GiB temporaries on a machine that has them."""
    import resource

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="tests")
    table = sp.ExampleTable.from_texts(["x" * 131_070], binding, capacity=131_072)
    batch = sp.pack(table, sp.PackConfig(131_072, 1), partition=sp.Partition.TRAIN, binding=binding).batches[0]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(sp.MemoryBudgetError, match=r"the dense mask of a batch of 1 x 131072 cells needs "
                                                   r"68719476736 bytes; max_memory_bytes is 8589934592"):
        batch.dense_mask()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing was allocated
    small = chapter_batch("packed", sp.BatchBinding.fixture())   # 2 x 6 cells: 288 bytes
    assert small.dense_mask(max_memory_bytes=288).shape == (2, 6, 6)
    with pytest.raises(sp.MemoryBudgetError, match="needs 288 bytes; max_memory_bytes is 287"):
        small.dense_mask(max_memory_bytes=287)
