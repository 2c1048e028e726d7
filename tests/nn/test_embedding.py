"""The masked embedding gather/scatter kernels and the token-ID check."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import PAD_CELL, InvalidInputError
from seqpack.nn import _embedding
from seqpack.nn.autograd import Tensor
from seqpack.nn.ops import check_token_ids, embedding

pytestmark = pytest.mark.kernel


def reference_gather(table, ids):
    out = np.zeros(ids.shape + (table.shape[1],))
    for index in np.ndindex(ids.shape):
        if ids[index] != PAD_CELL:
            out[index] = table[ids[index]]
    return out


def reference_scatter(table_shape, ids, upstream):
    dtable = np.zeros(table_shape)
    for index in np.ndindex(ids.shape):
        if ids[index] != PAD_CELL:
            dtable[ids[index]] += upstream[index]
    return dtable


@settings(derandomize=True, max_examples=50, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(1, 7),
    st.floats(0.0, 1.0),
    st.integers(0, 2**32 - 1),
)
def test_gather_and_scatter_match_the_reference(vocabulary, width, rows, columns, padding, seed):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(vocabulary, width))
    ids = rng.integers(0, vocabulary, size=(rows, columns)).astype(np.int32)
    ids[rng.random(ids.shape) < padding] = PAD_CELL
    upstream = rng.normal(size=(rows, columns, width))
    leaf = Tensor(table, requires_grad=True)
    out = embedding(leaf, ids)
    assert np.array_equal(out.value, reference_gather(table, ids))
    out.backward(upstream)
    np.testing.assert_allclose(leaf.grad, reference_scatter(table.shape, ids, upstream), rtol=1e-14, atol=1e-15)


def test_padding_is_never_read_or_written():
    table = np.arange(12.0).reshape(4, 3)
    table[-1] = np.nan  # PAD_CELL = -1 must not wrap around to the last row
    ids = np.array([PAD_CELL, 2, PAD_CELL, 0], dtype=np.int32)
    out = np.full((4, 3), np.nan)
    _embedding.embedding_forward(table, ids, out)
    assert np.array_equal(out, [[0, 0, 0], [6, 7, 8], [0, 0, 0], [0, 1, 2]])
    dtable = np.zeros((4, 3))
    _embedding.embedding_backward(np.full((4, 3), np.nan), np.full(4, PAD_CELL, dtype=np.int32), dtable)
    assert not dtable.any()


def test_repeated_ids_accumulate_in_cell_order():
    dtable = np.zeros((2, 1))
    ids = np.array([1, 1, 1], dtype=np.int32)
    _embedding.embedding_backward(np.array([[1e16], [1.0], [-1e16]]), ids, dtable)
    assert dtable[1, 0] == (1e16 + 1.0) - 1e16


def test_float32_kernels():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(5, 3)).astype(np.float32)
    ids = np.array([4, PAD_CELL, 0], dtype=np.int32)
    out = np.empty((3, 3), dtype=np.float32)
    _embedding.embedding_forward(table, ids, out)
    assert np.array_equal(out, reference_gather(table, ids).astype(np.float32))
    dtable = np.zeros((5, 3), dtype=np.float32)
    _embedding.embedding_backward(out, ids, dtable)
    assert np.array_equal(dtable, reference_scatter((5, 3), ids, out).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_token_id_check_accepts_pad_and_the_last_id(dtype):
    ids = np.array([[0, 9], [9, 1]], dtype=dtype)
    if dtype != np.uint8:
        ids[1, 1] = PAD_CELL
    checked = check_token_ids(ids, 10)
    assert checked.dtype == np.int32 and np.array_equal(checked, ids.astype(np.int32))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (-2, r"token ID -2 at cell \(1, 0\)"),
        (10, r"token ID 10 at cell \(1, 0\)"),
        (2**40, r"token ID 1099511627776 at cell \(1, 0\)"),
        (-(2**40), r"token ID -1099511627776 at cell \(1, 0\)"),
    ],
)
def test_token_id_check_names_the_first_bad_cell(bad, message):
    ids = np.array([[0, PAD_CELL], [bad, 11]], dtype=np.int64)
    with pytest.raises(InvalidInputError, match=message + ".*vocabulary size 10"):
        check_token_ids(ids, 10)


def test_token_id_check_refuses_a_vocabulary_wider_than_int32():
    # An ID past 2**31 - 1 became PAD_CELL in the int32 copy (review).
    with pytest.raises(InvalidInputError, match=r"the vocabulary has 4294967306 entries; the embedding takes at most"):
        check_token_ids(np.array([5, 2**32 - 1]), 2**32 + 10)


def test_token_id_kernel_returns_first_bad_index():
    assert _embedding.first_invalid_token(np.array([0, -1, 4], dtype=np.int32), 5) == -1
    assert _embedding.first_invalid_token(np.array([0, 5, -3], dtype=np.int32), 5) == 1
    assert _embedding.first_invalid_token(np.array([0, -3, 5], dtype=np.int32), 5) == 1


def test_non_integer_token_ids_are_rejected():
    with pytest.raises(InvalidInputError, match="must be integers"):
        check_token_ids(np.array([0.0, 1.0]), 4)


def test_the_embedding_op_checks_its_ids_before_any_lookup():
    # seqpack.nn.ops.embedding read outside its table for an unchecked ID (review).
    table = Tensor(np.arange(12.0).reshape(4, 3))
    for bad in (4, -5):
        with pytest.raises(InvalidInputError, match=rf"token ID {bad} at cell \(1,\) is neither PAD_CELL"):
            embedding(table, np.array([0, bad]))
    rows = embedding(table, np.array([3, PAD_CELL], dtype=np.int64))
    assert rows.value.tolist() == [[9.0, 10.0, 11.0], [0.0, 0.0, 0.0]]
